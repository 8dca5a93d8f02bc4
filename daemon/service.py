"""The daemon's request handling, without sockets: decode → validate → call the manager → reply.

Every request is answered: a malformed message, an unknown op, bad arguments, a foreign or stale
block id all get an error reply naming the problem, and change nothing. Leases: a client that sends
nothing (heartbeats included) for `lease_timeout_s` (time the daemon did not run not counted:
`resumed`), or whose process is gone, is detached: its reservations and pins are released and its
private blocks freed (those of a process that may still run, once it is gone or after a while:
sessions.SetAside); what it published stays cached.

Sessions: attach returns a random token that every later call of that client carries; a call with
the client's id and another token is refused (WrongToken), so a process that read the id from
`stats` cannot release the client's pins or detach it. A client that timed out on a call that hands
it something (protocol.UNDOABLE) sends `forget` (forgetting.py): if the call ran, what it handed out is given back;
if it has not arrived yet (it came on the client's previous socket), it is refused when it does.
A release or free it timed out on (protocol.RETRIED) comes again as a `retry`: run once, whichever
of the two arrives first.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import Callable

import numpy as np

from dflash2 import protocol as P
from dflash2.arena.shm import address_space_note
from dflash2.daemon import wire
from dflash2.daemon.descriptors import refuse_past_descriptors
from dflash2.daemon.devices import Devices
from dflash2.daemon.failing import Failing, checked_refusal
from dflash2.daemon.forgetting import Forgetting
from dflash2.daemon.leases import Leases, some_ids
from dflash2.daemon.parking import Parked
from dflash2.daemon.poolstats import sum_stats
from dflash2.daemon.sessions import PID_MAX, Session, SetAside, pid_namespace, same_token
from dflash2.daemon.sessions import pid_alive as process_alive
from dflash2.errors import CopiesRunning, DaemonUnavailable, DFlash2Error, ProtocolError, UnknownClient, WrongToken
from dflash2.invariants import InvariantViolation
from dflash2.manager import BlockManager
from dflash2.protocol import Op, Reply, Request, arg

log = logging.getLogger("dflash2.daemon")



class Service(Leases, Forgetting, Failing, Devices):
    def __init__(self, managers: BlockManager | dict[int, BlockManager], *, lease_timeout_s: float,
                 heartbeat_interval_s: float, device: str = "host", clock: Callable[[], float] = time.monotonic,
                 pid_alive: Callable[[int], bool] | None = None, set_aside_leases: int = 30,
                 liveness: str | None = None, liveness_id: str | None = None):
        # One block pool per GPU (device index -> manager); a client says which device it serves at
        # attach and every call it makes goes to that pool only, so no move ever crosses GPUs.
        self.managers = managers if isinstance(managers, dict) else {0: managers}
        # Client ids are daemon-wide (whichever pool a client uses) and start at a random base, so
        # that a client of a previous daemon on this endpoint cannot pass for a new one's client.
        self._next_client = secrets.randbelow(1 << 30) + 1
        self.lease_timeout_s = lease_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.device = device
        self.liveness = liveness  # the name of the daemon's liveness object, given at attach (arena/liveness.py)
        self.liveness_id = liveness_id  # ... and the id it carries, which the client checks
        self.clock = clock
        self.pid_alive = pid_alive or process_alive
        self.sessions: dict[int, Session] = {}
        # Lapsed clients whose process may still write their private blocks (asked through self, which tests set)
        self.set_aside = SetAside(lease_timeout_s, set_aside_leases, lambda pid: self.pid_alive(pid),
                                  lambda: self.clock())
        # When this daemon started (unix s): readers of its figures tell a restart by it, as pid 1 in a
        # container keeps its pid across restarts (history.py `change`).
        self.started = round(time.time(), 3)
        self.counters = {"requests": 0, "errors": 0, "leases_expired": 0, "calls_undone": 0,
                         "calls_refused_forgotten": 0, "calls_parked": 0}
        # Whether a call that must wait for copies not yet ended is parked (handle_frames answers
        # `Parked`) rather than waited for: the server's loop sets it; in-process callers wait.
        self.parking = False
        # A tcp endpoint's request port (the server sets it), in `ping` and `stats`: a monitoring
        # client checks that the daemon at its monitoring port serves the endpoint it asks about.
        self.request_port: int | None = None
        self._stall_grace_at = -math.inf  # when a stall last gave clients a heartbeat interval more (`resumed`)
        self.latency: dict[str, list[float]] = {}  # op -> [count, total seconds]
        # How late the background step started, the last time and the most over its last 64 runs,
        # and how far behind the request queue was then (the server notes each run).
        self._late: collections.deque[float] = collections.deque(maxlen=64)
        self._behind_s = 0.0
        # When the server last saw its request queue empty (this service's clock; None without a
        # server), and the longest stretch since that read no request (a call, the work after its
        # reply, the background step: `busy`): what leases are judged by (expire_leases).
        self._caught_up: float | None = None
        self._replying: int | None = None  # the client whose call was answered last
        self._handed: Request | None = None  # the call answered last, where it handed something out (forgetting.py)
        self._longest_call_s = 0.0
        self.on_request: Callable[[str, float], None] | None = None  # (op, seconds): metrics observe here
        self.history = None  # a dflash2.history.History when history_enabled
        self._handlers: dict[Op, Callable[[Request], tuple[dict, list[bytes]]]] = {
            Op.PING: self._ping, Op.ATTACH: self._attach, Op.HEARTBEAT: self._heartbeat,
            Op.DETACH: self._detach, Op.REGISTER_LAYOUT: self._register_layout, Op.RESERVE: self._reserve,
            Op.RESERVATION: self._reservation, Op.TAKE: self._take, Op.CANCEL: self._cancel,
            Op.ALLOCATE: self._allocate, Op.COMMIT: self._commit, Op.LOOKUP: self._lookup,
            Op.ACQUIRE: self._acquire, Op.RELEASE: self._release, Op.FREE: self._free,
            Op.ADD_REF: self._add_ref, Op.PLACES: self._places, Op.STATS: self._stats,
            Op.SET_WEIGHTS: self._set_weights, Op.CHECK: self._check, Op.HISTORY: self._history,
            Op.PREFILL_RATE: self._set_prefill_rate, Op.FORGET: self._forget, Op.RETRY: self._retry,
        }

    @property
    def manager(self) -> BlockManager:
        """The first device's pool (the only one on a host or one-GPU node)."""
        return next(iter(self.managers.values()))

    def _mgr(self, req: Request) -> BlockManager:
        return self.managers[self.sessions[req.client].device]

    # -- entry points ----------------------------------------------------------------------
    def handle_frames(self, frames: list[bytes], again: Parked | None = None) -> list[bytes] | Parked:
        """One message in, one reply out; never raises. With `parking` on (the server's loop), a
        call that must wait for copies not yet ended is not run: `Parked` is returned instead, and
        the server hands the same frames back (`again`) once they have ended."""
        if again is None:
            self.counters["requests"] += 1
        self._replying = None
        self._handed = None  # (set by a call that hands something out: `reply_dropped`)
        try:
            req = P.decode_request(frames)
        except DFlash2Error as e:
            self.counters["errors"] += 1
            return P.encode_reply(P.error_reply(P.peek_call_id(frames), e))
        except Exception as e:  # a bug in decoding: say so, keep serving the others
            self.counters["errors"] += 1
            log.exception("internal error decoding a message")
            return P.encode_reply(Reply(P.peek_call_id(frames), False, {}, "InternalError", f"{type(e).__name__}: {e}"))
        if not self.parking:  # (in-process callers, which wait; `again`'s arrival counts, should one come)
            return self._encoded(req, self.handle(req, None if again is None else again.arrived))
        own_parks = 0 if again is None else again.own_parks
        arrived = time.perf_counter() if again is None else again.arrived
        for m in self.managers.values():
            m.placement.parking, m.placement.own_parks = True, own_parks
        try:
            reply = self.handle(req, arrived)
        except CopiesRunning as e:
            if again is None:  # (calls, not parks: one may be parked again on copies a call before it began)
                self.counters["calls_parked"] += 1
            session = self.sessions.get(req.client)
            return Parked(own_parks + e.own, req.client, arrived=arrived, device=None if session is None else session.device)
        finally:
            for m in self.managers.values():
                m.placement.parking, m.placement.own_parks = False, 0
        return self._encoded(req, reply)

    def handle(self, req: Request, arrived: float | None = None) -> Reply:
        """One request: its reply (CopiesRunning escapes, with `Placement.parking` on: settling.py).
        `arrived` (time.perf_counter): when a parked call first came, its latency's start (the
        latency left its wait out: the slowest acquires, those parked on NVMe reads, read 7.5 ms on
        average against 18.5 at the client, a review's script)."""
        began = self.clock()
        started = time.perf_counter() if arrived is None else arrived
        needs_client = req.op in P.NEEDS_CLIENT
        session = None
        try:
            self.verify_noted()  # (failures a manager carried on past: failing.py)
            if self.broken is not None:  # (the daemon exits at once)
                raise DaemonUnavailable(f"dflash2d is stopping: {self.broken}")
            if needs_client:
                session = self._touch(req.client, req.token)
                # (Only an UNDOABLE call can have been forgotten: the heartbeat thread's own call
                # ids, counted apart, must never match one.)
                if req.op in P.UNDOABLE:
                    self._refuse_forgotten(req, session)
            result, arrays = self._handlers[req.op](req)
            reply = Reply(req.call_id, True, result, arrays=arrays)
        except CopiesRunning:
            raise  # nothing changed: the server parks the call (handle_frames)
        except (DFlash2Error, ValueError, KeyError, TypeError) as e:
            self.counters["errors"] += 1
            reply = P.error_reply(req.call_id, e)
            if isinstance(e, InvariantViolation):  # (a bug, never the client's: said, a review)
                log.error("internal error handling %s: %s", req.op.value, e)
            if req.op not in P.READ_ONLY and self.broken is None and checked_refusal(e):  # (part way? failing.py)
                self.after_refusal(e, req.op.value)
        except Exception as e:  # a bug: say so, keep serving the others
            self.counters["errors"] += 1
            log.exception("internal error handling %s", req.op.value)
            note = address_space_note() if isinstance(e, MemoryError) else ""  # (ulimit -v: say so)
            reply = Reply(req.call_id, False, {}, "InternalError", f"{type(e).__name__}: {e}{note}")
            self._check_gpus(e)
            if req.op not in P.READ_ONLY:  # (it may have changed part of the table: failing.py)
                self.verify_after(e, req.op.value)
        now = self.clock()
        self._replying = None
        # (The session the call's token was checked against, still attached: a session is never
        # replaced under its id, since ids are never reused.)
        if session is not None and self.sessions.get(req.client) is session:
            # Heard from at the end of its call too: a call that ran longer than the lease (a
            # large promotion) must not let its own client's lease lapse while it waited.
            session.last_seen = session.heard_at = now
            self._replying = req.client
        elapsed = time.perf_counter() - started
        self._note_busy(began, now)
        op = req.op.value
        stat = self.latency.get(op)
        if stat is None:
            stat = self.latency[op] = [0, 0.0]
        stat[0] += 1
        stat[1] += elapsed
        if self.on_request is not None:
            self.on_request(op, elapsed)
        return reply

    def after_reply(self) -> None:
        """Work a call left for after its answer (a reader's prefetch window, `run_prefetch`)."""
        due = [m for m in self.managers.values() if m.prefetcher.due]  # (most replies leave none)
        if due:
            with self.busy():
                for m in due:
                    m.run_prefetch()
        session = self.sessions.get(self._replying)
        if session is not None:  # heard from at the end of its call's work too (as at its reply)
            session.last_seen = session.heard_at = self.clock()

    @contextlib.contextmanager
    def busy(self):
        """A stretch of the loop that reads no request (a call, the work after its reply, the
        background step): the longest since the queue was last empty extends the lease credit,
        since every heartbeat sent meanwhile waited behind it."""
        began = self.clock()
        try:
            yield
        finally:
            self._note_busy(began)

    def _note_busy(self, began: float, now: float | None = None) -> None:
        self._longest_call_s = max(self._longest_call_s, (self.clock() if now is None else now) - began)

    def queue_empty(self) -> None:
        """The server found its request queue empty: every message sent before now is answered."""
        self._caught_up = self.clock()
        self._longest_call_s = 0.0

    def queue_behind_s(self) -> float:
        """How long ago the request queue was last seen empty (0 without a server)."""
        return 0.0 if self._caught_up is None else max(0.0, self.clock() - self._caught_up)

    def note_tick(self, late_s: float) -> None:
        """The background step ran `late_s` after it was due (and the queue as far behind as it is now)."""
        self._late.append(max(0.0, late_s))
        self._behind_s = self.queue_behind_s()

    def shutdown(self) -> None:
        self._check_refusals(now=True)  # (those still waiting for the budget: a broken table said, a review)
        for client in list(self.sessions):
            try:  # (each client whatever became of the one before: a failed detach skipped the rest)
                self._drop_session(client)
            except Exception:
                log.exception("stopping: the detach of client %d failed", client)
        for s in self.set_aside.take_all():
            try:
                self.managers[s.device].detach(s.client)
            except Exception:
                log.exception("stopping: freeing the set-aside blocks of client %d failed", s.client)
        for m in self.managers.values():
            m.settle()  # a drain's copies still in flight end, and their batches are said ...
            m.mover.swap_log.flush()  # ... before the shutdown line (swaplog.py)

    # -- sessions --------------------------------------------------------------------------
    def _touch(self, client: int, token: str | None) -> Session:
        """The session of a call's client, renewed: UnknownClient when there is none, WrongToken when
        the call does not carry that session's token (checked before the lease is renewed)."""
        session = self.sessions.get(client)
        if session is None:
            raise UnknownClient(f"client {client} is not attached (detached, or its lease lapsed: attach again)")
        if not same_token(session, token):
            raise WrongToken(f"client {client}: the call does not carry that client's session token (a client id "
                             "is used only by the process that attached it)")
        session.last_seen = session.heard_at = self.clock()
        return session

    # -- handlers --------------------------------------------------------------------------
    def _ping(self, req):
        return {"version": P.VERSION, "pid": os.getpid(), "request_port": self.request_port}, []

    def _attach(self, req):
        name = P.client_name(arg(req, "name", str))
        pid = arg(req, "pid", int, lo=0, hi=PID_MAX)
        specs = arg(req, "layouts", list, default=[])
        pid_ns = arg(req, "pid_namespace", int, default=None)
        device = self._device_of(req)
        layouts = [wire.layout_of(d) for d in specs]  # validate all before changing anything
        rates = arg(req, "prefill_tokens_per_s", list, default=[None] * len(layouts))
        if len(rates) != len(layouts):
            raise ProtocolError(f"attach: {len(rates)} prefill rates for {len(layouts)} layouts (one per "
                                "layout, null where unknown)")
        rates = [wire.prefill_rate(req, r) for r in rates]
        refuse_past_descriptors(name, pid)
        m = self.managers[device]
        for lay in layouts:
            m.check_layout(lay)  # before anything changes: a refused layout attaches nobody
        m.table.refuse_layouts(layouts)
        client = m.attach(name, client_id=self._next_client)
        self._next_client += 1
        ids = [m.register_layout(lay) for lay in layouts]
        for lid, rate in zip(ids, rates):
            m.set_prefill_rate(client, lid, rate)
        now, token = self.clock(), secrets.token_hex(P.TOKEN_CHARS // 2)
        self.sessions[client] = Session(client, name, pid, now, now,
                                        pid_ns is not None and pid_ns == pid_namespace(), device, token, pid_ns=pid_ns)
        # Its process's lapsed sessions, whose blocks count against its share (shares.py), under a share < 1.
        earlier = self.set_aside.of_process(pid, pid_ns, device) if m.admission.shares.limited else []
        m.admission.shares.carry(client, earlier)
        # (Not every id: a line of 12 KB after a process's thousand sessions, a review.)
        carried = (f"; the set-aside blocks of its process's {len(earlier)} earlier session(s) "
                   f"{some_ids(earlier)} count against its share") if earlier else ""
        log.info("client %d attached: %s (pid %d), %d layouts%s", client, name, pid, len(ids), carried)
        # set_aside_s: how long a lapsed client's slots stay kept (Awake.vouches only within it).
        return {"client": client, "layouts": ids, "arenas": wire.arenas(m),
                "lease_timeout_s": self.lease_timeout_s, "heartbeat_interval_s": self.heartbeat_interval_s,
                "device": self.device, "gpu": device if self.device == "cuda" else None,
                "gpu_uuid": self._gpu_uuids().get(device), "token": token, "liveness": self.liveness,
                "liveness_id": self.liveness_id, "pid_namespace": pid_namespace(),
                "set_aside_s": self.set_aside.hold_s}, []

    def _heartbeat(self, req):
        return {"lease_timeout_s": self.lease_timeout_s}, []

    def _detach(self, req):
        released = self._drop_session(req.client)
        log.info("client %d detached: released %s", req.client, released)
        return {"released": released}, []

    def _register_layout(self, req):
        m = self._mgr(req)
        layout = wire.layout_of(arg(req, "layout", dict))
        given = req.args.get("prefill_tokens_per_s")
        rate = wire.prefill_rate(req, given)
        lid = m.register_layout(layout)
        # (None leaves a rate given before: re-registering withdrew it, a review; a first registration
        # without one is this client's "none given", as at attach: it was no client of the layout, whose
        # blocks were then judged by other engines' rates alone, another review.)
        if given is not None or m.read_cost.rate(req.client, lid) is None:
            m.set_prefill_rate(req.client, lid, rate)
        return {"layout": lid}, []

    def _set_prefill_rate(self, req):
        m = self._mgr(req)
        lid = wire.layout_id(m, req)
        if "tokens_per_s" not in req.args:
            raise ProtocolError("prefill_rate: missing argument 'tokens_per_s' (a number, or null to withdraw it)")
        m.set_prefill_rate(req.client, lid, wire.prefill_rate(req, req.args["tokens_per_s"]))
        return {}, []

    def _reserve(self, req):
        m = self._mgr(req)
        deadline_s = arg(req, "deadline_s", (int, float), default=None, lo=0)
        d = m.reserve(
            req.client, wire.layout_id(m, req), arg(req, "tokens", int, lo=1, hi=1 << 40),
            priority=arg(req, "priority", int, default=0, lo=-128, hi=127),
            deadline=None if deadline_s is None else m.table.clock() + deadline_s,
            request=arg(req, "request", int, default=0))
        if d.reservation_id is not None:
            self._undoable(req, m.cancel, d.reservation_id)
        return d.to_dict(), []

    def _reservation(self, req):
        m = self._mgr(req)
        # Only its own client may see a reservation, granted or still waiting in the queue (as
        # with take and cancel): a wrong id must not silently report another client's place.
        return m.reservation_status(req.client, arg(req, "reservation", int)).to_dict(), []

    def _take(self, req):
        m = self._mgr(req)
        rid, n = arg(req, "reservation", int), arg(req, "n", int, lo=1, hi=P.MAX_BATCH)
        res = m.admission.find(rid)  # before a take of its last blocks forgets it
        vids = m.take(req.client, rid, n)
        self._undoable(req, m.untake, res, vids)
        return {}, [wire.places_of(m, vids)]

    def _cancel(self, req):
        m = self._mgr(req)
        m.cancel(req.client, arg(req, "reservation", int))
        return {}, []

    def _allocate(self, req):
        m = self._mgr(req)
        vids = m.allocate(req.client, wire.layout_id(m, req), arg(req, "n", int, lo=1, hi=P.MAX_BATCH),
                          request=arg(req, "request", int, default=0),
                          priority=arg(req, "priority", int, default=0, lo=-128, hi=127),
                          tier=wire.memory_tier(req))
        if vids is None:
            return {"allocated": False, "reason": m.allocate_refusal}, [b""]
        self._undoable(req, m.free, vids)
        return {"allocated": True}, [wire.places_of(m, vids)]

    def _commit(self, req):
        m = self._mgr(req)
        vids = req.array(0, P.VIDS_DTYPE, "block ids")
        keys = req.array(1, P.KEYS_DTYPE, "content keys") if len(req.arrays) > 1 and req.arrays[1] else None
        if keys is not None and len(keys) != len(vids):
            raise ProtocolError(f"commit: {len(vids)} block ids but {len(keys)} content keys")
        parent = arg(req, "parent", int, default=None)
        if parent is not None and keys is None and len(vids):  # (it was ignored, unchecked: a review)
            raise ProtocolError(f"commit: argument 'parent' ({parent:#x}) chains published blocks under it, and a "
                                "commit without content keys publishes none: give the blocks' keys, or no parent")
        out = m.commit(req.client, vids, keys, parent)  # (the wire's uint64s: key_array takes them as they are)
        # Forgotten: the references it leaves the writer on the returned blocks are dropped (they
        # stay cached, published); the writer never learned their ids when a key deduplicated.
        self._undoable(req, m.free, out)
        return {}, [np.asarray(out, dtype=P.VIDS_DTYPE).tobytes()]

    def _lookup(self, req):
        m = self._mgr(req)
        keys = req.array(0, P.KEYS_DTYPE, "content keys")
        layout = arg(req, "layout", int, default=None, lo=0)
        if layout is not None:
            m.table.layout(layout)  # an unknown layout id is an error, never an empty (all-miss) answer
        probe = arg(req, "probe", bool, default=False)
        withheld = m.access.withheld
        rows = m.lookup_rows(keys, layout, reader=wire.memory_tier(req), client=req.client, probe=probe)
        return {"withheld": m.access.withheld - withheld}, [wire.records(m, rows)]

    def _acquire(self, req):
        m, vids, tier = self._mgr(req), req.array(0, P.VIDS_DTYPE, "block ids"), wire.memory_tier(req)
        priority = arg(req, "priority", int, default=None, lo=-128, hi=127)
        rows = m.acquire_rows(req.client, vids, tier, priority=priority, call=req.call_id)  # (the call's record)
        if rows is None:  # (why, naming the tier asked for: a host reader's refusal named HBM, a review)
            return {"acquired": False, "reason": m.acquire_refusal}, [b""]
        self._undoable(req, m.release, vids)
        return {"acquired": True}, [wire.records(m, rows)]

    def _release(self, req):
        m, vids = self._mgr(req), req.array(0, P.VIDS_DTYPE, "block ids")
        self._once(req, req.call_id, lambda: m.release(req.client, vids))  # (its `retry` may have run it)
        return {}, []

    def _free(self, req):
        m, vids = self._mgr(req), req.array(0, P.VIDS_DTYPE, "block ids")
        return {"freed": self._once(req, req.call_id, lambda: m.free(req.client, vids))[1] or 0}, []

    def _add_ref(self, req):
        m = self._mgr(req)
        vids = req.array(0, P.VIDS_DTYPE, "block ids")
        m.add_ref(req.client, vids, priority=arg(req, "priority", int, default=None, lo=-128, hi=127))
        self._undoable(req, m.free, vids)
        return {}, []

    def _places(self, req):
        m = self._mgr(req)
        vids = req.array(0, P.VIDS_DTYPE, "block ids")
        m.table.seen_rows(req.client, vids)  # UnknownBlock for any that is not live, NotOwner: another's private one
        m.settle()  # a block whose drain copy is in flight lies where that copy ends
        return {}, [wire.places_of(m, vids)]

    def _stats(self, req):
        return self.stats(), []

    def stats(self) -> dict:
        """Manager figures plus clients and daemon counters (the `stats` op, metrics and history)."""
        if len(self.managers) == 1:
            st = self.manager.stats()
        else:  # top level: the node's totals over every GPU's pool; each pool under "devices"
            per_device = {str(d): m.stats() for d, m in self.managers.items()}
            st = sum_stats(list(per_device.values()))
            st["devices"] = per_device
        st["clients"] = [{"client": s.client, "name": s.name, "pid": s.pid, "device": s.device,
                          "idle_s": round(self.clock() - s.last_seen, 3)} for s in self.sessions.values()]
        st["daemon"] = {"pid": os.getpid(), "started": self.started, "device": self.device, **self.counters,
                        "request_port": self.request_port,
                        "gpus": {str(d): u for d, u in self._gpu_uuids().items()},  # pool -> GPU UUID
                        "pools": [str(d) for d in self.managers],  # their keys (a lone pool's too)
                        "latency": {op: {"count": n, "mean_us": round(1e6 * t / n, 1)}
                                    for op, (n, t) in self.latency.items()},
                        "background": {"late_s": round(self._late[-1], 4) if self._late else None,
                                       "late_max_s": round(max(self._late), 4) if self._late else None,
                                       "queue_behind_s": round(self._behind_s, 4)}}
        return st

    def _history(self, req):
        since_s = arg(req, "since_s", (int, float), default=None, lo=0)
        if self.history is None:
            return {"enabled": False, "interval_s": None, "count": 0}, [b""]
        count, lines = self.history.encoded(since_s)
        return {"enabled": True, "interval_s": self.history.interval_s, "count": count}, [lines]

    def _set_weights(self, req):
        floats = wire.weights_of(req)
        before = dict(getattr(self.manager.policy, "weights", None) or {})  # (a copy: updated in place)
        for m in self.managers.values():
            m.policy.set_weights(floats)
        if floats:  # (every later eviction changes: said, with who asked, a review)
            s, after = self.sessions[req.client], self.manager.policy.weights
            log.info("client %d (%s, pid %d) set the policy's weights: %s", req.client, s.name, s.pid, ", ".join(
                f"{k} {before[k]:g} -> {after[k]:g}" for k in floats if before[k] != after[k]) or "unchanged")
        return {"policy": self.manager.policy.describe()}, []

    def _check(self, req):
        for m in self.managers.values():
            m.check_invariants()
        return {}, []

