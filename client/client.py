"""The synchronous dflash2 client: attach, renew the lease in the background, call every op, and
view daemon-owned blocks with zero copies.

    with Client.connect(config="dflash2_config.json", name="engine-0", layouts=[layout]) as c:
        lay = c.layouts[0]
        d = c.reserve(lay, tokens=4096)                   # granted / deferred / rejected
        places = c.take(d.reservation_id, 4)              # blocks to write, in HBM
        c.view(places[0]).copy_(kv)                        # a torch tensor over the block's bytes
        c.commit(places["vid"], keys=chain_keys(tokens, 16, "llama3-8b"))

Every call has a timeout (DaemonUnavailable names the endpoint and the op); an error reply raises
DaemonError whose `.kind` is the daemon's error type (NotOwner, UnknownBlock, ...). Calls are
serialised by a lock, so one client may be shared by threads.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from dflash2 import protocol as P
from dflash2 import threads
from dflash2.client.heartbeat import Awake, run as run_heartbeat
from dflash2.client.args import _int, _keys, _seconds, _vids, layout_dict, vid_array
from dflash2.client.callmarks import CallMarks, raised_by, refused
from dflash2.client.held import HeldPlaces
from dflash2.client.reservation import Reservation, reservation_of
from dflash2.client.stopevent import StopEvent, Stopped
from dflash2.client.endpoint_check import check_endpoint
from dflash2.client.localgpu import uuid_of_local_device as _uuid_of_local_device
from dflash2.client.transport import Transport, check_descriptors, check_timeout, pid_namespace
from dflash2.client.viewing import BlockViews
from dflash2.client.views import ArenaMap
from dflash2.client.where import config_of
from dflash2.errors import (AccessDenied, ArenaError, CallInProgress, DaemonError, DaemonUnavailable, DFlash2Error,
                            ProtocolError)
from dflash2.layout import Layout
from dflash2.protocol import Op

log = logging.getLogger("dflash2.client")


def _places(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=P.PLACE_DTYPE)


class Client(BlockViews):
    def __init__(self, endpoint: str, name: str, layouts: Sequence[Layout] = (), timeout_s: float = 5.0,
                 heartbeat: bool = True, device: int | None = None,
                 prefill_tokens_per_s: Sequence[float | None] | None = None, host_only: bool = False,
                 key_file: os.PathLike | None = None):
        check_endpoint(endpoint, attaching=True)
        self.host_only = bool(host_only)
        self.endpoint = endpoint
        # The GPU this client serves (None: the daemon's first). Checked as the daemon takes it: True
        # served GPU 1's pool, and "0" or 1.0 failed in a format or an index, naming nothing (a review).
        self.gpu = None if device is None else _int("device", device)
        if self.gpu is not None and self.gpu < 0:
            raise ValueError(f"device must be a CUDA device number (0 or more), got {device!r}")
        self.name = name
        self.timeout_s = timeout_s = check_timeout(timeout_s)
        # Reentrant only so that `_call` can tell it took the lock (`_is_owned`) when the caller's exception
        # cut in just after; a call from within a call on one thread is refused there.
        self._lock = threading.RLock()
        self._detach_after = False  # a detach asked for within a call (a signal handler's): run after it
        # Commits, releases and frees that timed out waiting for the lock, unsent, with their block ids: they
        # go with the next call (_call), a commit as a `forget` (its blocks dropped), the rest as a `retry`.
        self._unsent: collections.deque[tuple[Op, bytes]] = collections.deque()
        self._refusals = threading.local()  # (`last_refusal`: each thread's own)
        self._pid = os.getpid()  # the process that attached: the only one that may use this client
        check_descriptors(endpoint)
        # A call in progress when the daemon is killed ends then, not after its whole timeout.
        self._transport = Transport(endpoint, timeout_s, gone=self._arenas_gone, key_file=key_file)
        self.key_file = self._transport.key_file  # a tcp endpoint's (dflash2/tcpkeys.py); None for ipc
        self._layouts: dict[int, Layout] = {}
        self._held = HeldPlaces()  # the blocks this client may view by vid now
        self._arenas: ArenaMap | None = None
        self._stop = StopEvent()  # the heartbeat's; close() sets it, also from a signal handler (stopevent.py)
        self._heartbeat_thread: threading.Thread | None = None
        self._awake: Awake | None = None  # when the heartbeat thread ran (its process ran, `view_bytes`)
        self.lease_lost = False
        self._renewed = time.monotonic()  # the lease renewed by then at least (`renewed`; runs on through a SIGSTOP)
        self._gone_lock = threading.RLock()  # _daemon_gone runs on the call thread and the heartbeat thread
        self._ended = False  # _daemon_gone found the daemon ended (and let its mappings go)
        self._alive_checked = time.monotonic()  # when a view last asked whether the daemon lives (view_bytes)
        self._detached = False  # detach() called: every later call says so
        self.client_id: int | None = None
        try:
            self._attach(layouts, heartbeat, prefill_tokens_per_s)
        except BaseException:
            # No Client came to be: its socket goes now (it stayed open until the garbage collector found
            # it, a ResourceWarning each, a review's 200 refused attaches). (Closed already where the
            # mappings failed: `detach`.)
            self._transport.close()
            raise

    @classmethod
    def connect(cls, endpoint: str | None = None, config=None, name: str | None = None,
                layouts: Sequence[Layout] = (), timeout_s: float | None = None, heartbeat: bool = True,
                device: int | None = None, prefill_tokens_per_s: Sequence[float | None] | None = None,
                host_only: bool = False) -> "Client":
        """Attach to the daemon. `device` names the GPU this process serves: its blocks live in that
        GPU's pool and views map that GPU's arena. `host_only`: map no GPU arena (a client that reads
        and writes host tiers only, such as sglang's storage backend, may attach to another GPU's
        pool without a CUDA context on that GPU; a view of a block in HBM is refused). Every call
        times out after `timeout_s` (default: the config's `daemon.request_timeout_s`, or 5 s when
        only an endpoint is given).
        `prefill_tokens_per_s`, one per layout (None where unknown): how fast this engine recomputes
        KV of that layout; lookups then offer only blocks that load faster than that (cost-aware
        reuse; `set_prefill_rate` changes it later). A tcp endpoint's key file (dflash2/tcpkeys.py)
        is the config's `daemon.tcp_key_file`, else `tcp-PORT.key` in the runtime folder."""
        key_file = None
        if endpoint is not None:
            from dflash2.endpoints import connectable, endpoint_parts

            endpoint_parts(endpoint)  # ValueError naming what is wrong (a port with leading zeros named another key file)
            # A daemon's endpoint on every address (tcp://*:P, as it logs it) is reached at loopback, as
            # `dflash2 status --endpoint` does: connecting to "*" failed as "Invalid argument" (a review).
            endpoint = connectable(endpoint)
        if endpoint is None or config is not None:
            cfg = config_of(config)
            endpoint = endpoint or cfg.client_endpoint()
            timeout_s = cfg.daemon.request_timeout_s if timeout_s is None else timeout_s
            key_file = cfg.resolved_tcp_key_file()
        return cls(endpoint, name or f"pid-{os.getpid()}", layouts, 5.0 if timeout_s is None else timeout_s,
                   heartbeat, device, prefill_tokens_per_s, host_only, key_file)

    # -- life ------------------------------------------------------------------------------
    def _attach(self, layouts: Sequence[Layout], heartbeat: bool,
                prefill_tokens_per_s: Sequence[float | None] | None) -> None:
        if isinstance(layouts, Layout):  # ("'Layout' object is not iterable", naming nothing)
            raise TypeError(f"layouts is a sequence of dflash2.layout.Layout, not one Layout: pass [{layouts!r}]")
        # Once: an iterator (a dict's values(), a generator) was registered here and then zipped with the ids
        # as empty, so that every view said its layout "was not registered by this client" (a review).
        layouts = list(layouts)
        args = {"name": self.name, "pid": os.getpid(), "layouts": [layout_dict(lay) for lay in layouts]}
        # (One number failed as "'float' object is not iterable".)
        if isinstance(prefill_tokens_per_s, (int, float, np.integer, np.floating)):
            raise TypeError(f"prefill_tokens_per_s is one rate per layout (None where unknown), not one number: "
                            f"pass [{prefill_tokens_per_s!r}]")
        if prefill_tokens_per_s is not None:
            args["prefill_tokens_per_s"] = list(prefill_tokens_per_s)
        ns = pid_namespace()
        if ns is not None:  # unknown (no /proc/self/ns/pid): left out, the daemon relies on the lease
            args["pid_namespace"] = ns
        if self.gpu is not None:
            # `device` is this process's device number; the daemon may number its GPUs differently
            # (CUDA_VISIBLE_DEVICES), so the GPU goes by its UUID where this process can see it.
            # Without CUDA here (a host-only client) the number is the daemon's own (without CuPy, logged).
            uuid = _uuid_of_local_device(self.gpu)
            if uuid is not None:
                args["gpu_uuid"] = uuid
            else:
                args["device"] = self.gpu
        if self._transport.read_only:
            self._transport.close()
            raise AccessDenied(f"cannot attach to the tcp endpoint {self.endpoint}: this process holds only the "
                               f"monitoring key file {self.key_file}, whose holders may ask status, history and "
                               "check; serving processes read the key file itself (they run as the daemon's user)")
        sent = time.monotonic()
        reply = self._call(Op.ATTACH, args)
        self._renewed = sent
        r = reply.result
        self.client_id = int(r["client"])
        self._token = str(r["token"])
        self._transport.token = self._token
        self.layout_ids: list[int] = [int(i) for i in r["layouts"]]
        self._layouts.update(zip(self.layout_ids, layouts))
        self.lease_timeout_s = float(r["lease_timeout_s"])
        self.heartbeat_interval_s = float(r["heartbeat_interval_s"])
        self.device = r.get("device")
        self.gpu = r.get("gpu", self.gpu)  # the daemon's number of the GPU whose pool this client uses
        self.gpu_uuid = r.get("gpu_uuid")
        self.arena_info: list[dict] = list(r.get("arenas", []))  # [{tier, kind, name, capacity_bytes, alignment}]
        try:
            # The daemon's liveness object (absent from an older daemon) comes with the mappings: it
            # tells when they are a dead daemon's (_daemon_gone).
            mapped = [d for d in self.arena_info if not (self.host_only and d.get("kind") == "cuda")]
            self._arenas = ArenaMap(mapped, r.get("liveness"), r.get("liveness_id"), f"dflash2d at {self.endpoint}",
                                    r.get("pid_namespace"))
        except Exception:
            self.detach()
            raise
        if heartbeat:
            self._awake = Awake(self.lease_timeout_s, float(r.get("set_aside_s") or 0.0))  # (older daemon: none)
            self._heartbeat_thread = threading.Thread(
                target=run_heartbeat, name=f"dflash2-heartbeat-{self.client_id}", daemon=True,
                args=(weakref.ref(self), self._stop, self.heartbeat_interval_s, self.client_id, self.name,
                      self.lease_timeout_s, self._awake))
            # The stop signals stay the serving process's main thread's (dflash2/threads.py).
            threads.start(self._heartbeat_thread)

    @property
    def last_refusal(self) -> str | None:
        """Why the daemon answered this thread's last `allocate` or `acquire` on this client that
        returned None (no room now), as its reply said (e.g. HBM held for reservations waiting
        ahead). Each thread's own: one attribute for all, another thread's refusal overwrote it
        between a call and its reading (the sglang backend's storage threads)."""
        return getattr(self._refusals, "reason", None)

    @last_refusal.setter
    def last_refusal(self, reason: str | None) -> None:
        self._refusals.reason = reason

    def _arenas_gone(self) -> bool:
        """Whether the daemon whose memory this client maps has ended (a waiting call's test, no side effects)."""
        if self._ended:  # found by the other thread (call or heartbeat), which let the mappings go
            return True
        arenas = self._arenas
        return arenas is not None and arenas.daemon_gone()

    def _lease_lost(self) -> None:
        """The daemon does not know this client (its lease lapsed, or it is a new daemon, whose answer lets the
        dead one's memory go as when none answers: the client kept its segments, and a GPU's HBM, mapped)."""
        self.lease_lost = True
        self._daemon_gone()

    def _daemon_gone(self, wait: bool = True) -> bool:
        """After a call no daemon answered, or a new daemon answered UnknownClient: whether the daemon
        this client attached to has ended (nothing holds its liveness object or segments any more). Then
        the lease is lost and the mappings of its memory (segments, a GPU's HBM) let go, views alive keeping
        theirs: while clients held a dead daemon's, its restart could fail for room (exit 4). `wait` False (a
        view's): False at once where another test runs (a signal handler's view hung for good, a review)."""
        if self._gone_lock._is_owned() or not self._gone_lock.acquire(blocking=wait):  # (the call and heartbeat
            return False  # threads find a death at once; a signal handler's test within this thread's: not now)
        try:
            if self._ended:
                return True
            arenas = self._arenas
            if arenas is None or not arenas.daemon_gone(wait):
                return False
            if not self.lease_lost:
                log.error("dflash2: the daemon at %s has ended (nothing holds its liveness object or shared memory "
                          "any more); this client's session ended with it: attach again", self.endpoint)
            self.lease_lost = True
            self._ended = True
            arenas.close("its daemon has ended (attach again)")
            return True
        finally:
            self._gone_lock.release()

    def _let_socket_go(self) -> None:
        """The daemon has ended: close the call socket (`Transport.let_go`; the next call makes a fresh one),
        unless a call of another thread holds it (that call finds the daemon ended, and lets it go)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._transport.closed:
                self._transport.let_go()
        finally:
            self._lock.release()

    def detach(self) -> dict:
        """Leave: the daemon releases this client's reservations, pins and private blocks. Idempotent;
        the arena mappings stay valid for views still alive, then go with them."""
        self._detached = True
        if self._forked():  # its copy only, and no lock: one a parent's thread held at the fork stays
            self._arenas, self._held = None, HeldPlaces()  # held in the child for good (close() hung, a review)
            return {}  # (nor its stop pipe, the parent's too: a byte there woke the parent's heartbeat without end)
        self._stop.set()  # (each close; lock-free, it never waits, also within a set() it interrupts: stopevent.py)
        beat = self._heartbeat_thread  # (joined at most the timeout: a beat under way waits for its answer)
        if beat is not None and not self._stop.join(beat, min(self.timeout_s, threading.TIMEOUT_MAX)):
            return {}  # (a handler's close within this thread's join: the close it interrupted detaches)
        if beat is None or not beat.is_alive():  # its pipe goes with the last reference (stopevent.py)
            self._stop = Stopped()
        released = {}
        if self._lock._is_owned():  # (from a signal handler during a call of this thread: after that call)
            self._detach_after = True
            return released
        with self._lock:
            # A lost lease: the daemon no longer knows this id (another client's, after a restart): nothing to detach.
            if not self._transport.closed and self.client_id is not None and not self.lease_lost:
                try:
                    released = self._transport.call(Op.DETACH, self.client_id).result.get("released", {})
                except (DaemonUnavailable, DaemonError) as e:
                    if isinstance(e, DaemonError) and e.kind == "UnknownClient":
                        self._lease_lost()  # (its lease lapsed, or a new daemon answered: as in `_run`)
                        if self._ended:  # (the new daemon's answer blamed a detach or a lapsed lease, a review)
                            e = (f"UnknownClient: the daemon client {self.client_id} attached to at {self.endpoint} has "
                                 "ended (stopped or restarted), and its blocks, pins and reservations with it")
                    log.warning("dflash2 detach: %s", e)
                self.client_id = None
            self._transport.close()
            arenas, self._arenas = self._arenas, None  # (gone for a view asked for on another thread)
            if arenas is not None:
                arenas.close()
            self._held = HeldPlaces()
        return released

    close = detach

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _call(self, op: Op, args: dict | None = None, arrays: list[bytes] | None = None,
              timeout_s: float | None = None, gives_up: Callable[[], Callable[[], None]] | None = None) -> P.Reply:
        """One call. `gives_up`: a commit's, release's or free's giving up of its views here, run first
        (whatever way the call ends but a refusal, no view may outlive it: a block handed back may move;
        given up after the reply, a signal handler's exception landing between them left a committed
        block writable here, a review); it returns what puts them back after a refusal. Every exception
        out of here is the call's own answer or one of the caller's that cut it off (callmarks.py)."""
        call = None
        try:
            call = CallMarks(op, arrays, gives_up is not None)
            if gives_up is not None:
                call.restore = gives_up()
            return self._run(op, args, arrays, timeout_s, call)
        except BaseException as e:
            if call is None:  # (cut off as it began: nothing done)
                raise
            if call.owns(e, self._transport):
                if call.restore is not None and refused(e):
                    call.restore()
                raise
            if call.to_keep(self._transport):  # (a commit's blocks forgotten, a release or free sent, as after
                call.keep(self._unsent)  # a timeout)
            if not isinstance(e, DFlash2Error):
                raise
            raise DaemonUnavailable(f"{op.value}: cut off by a call made within it ({type(e).__name__}: {e}); "
                                    f"{call.fate(self._transport)}") from e

    def _run(self, op: Op, args: dict | None, arrays: list[bytes] | None, timeout_s: float | None,
             call: CallMarks) -> P.Reply:
        if self._forked():
            # ZeroMQ sockets do not survive fork: a call from a forked child would wait forever,
            # past any timeout, and speak for the parent's session. Say so instead.
            raise call.mine(DaemonUnavailable(
                f"{op.value}: this client was attached by process {self._pid}; process {os.getpid()} is a fork of "
                "it and cannot use it (ZeroMQ sockets do not survive fork): connect a new Client in the child"))
        if self._detached:
            raise call.mine(DaemonUnavailable(f"{op.value}: this client is detached; connect a new Client"))
        try:
            P.check_frames(op, arrays)  # (before it waits: kept to send later, one too large failed every later call)
        except ProtocolError as e:
            if raised_by(e, P.check_frames):
                call.mine(e)
            raise
        # The call's timeout counts its wait behind other threads' calls on this client (eight threads
        # on a stopped daemon: the last failed after 8 timeouts, each waiting out those ahead, a review).
        timeout = self._transport.timeout_s if timeout_s is None else timeout_s
        began = time.monotonic()
        if self._lock._is_owned():  # (a signal handler's call while a call of this thread runs)
            raise call.mine(CallInProgress(f"{op.value}: called while a call of this client runs on this thread (from "
                                           "a signal handler?): not sent, as its replies would mix; call it after that "
                                           "call"))
        try:
            got = self._lock.acquire(timeout=min(timeout, threading.TIMEOUT_MAX))
        except BaseException:  # cut off waiting by the caller's exception (a deadline's SIGALRM)
            if self._lock._is_owned():  # (taken just before the exception: held for good, every later
                self._lock.release()  # call failed and close() hung, a review)
            raise
        if not got:
            if call.vids is not None:
                call.keep(self._unsent)
            raise call.mine(DaemonUnavailable(
                f"{op.value}: waited {timeout:g}s behind other threads' calls on this client, never sent (dflash2d at "
                f"{self.endpoint} slow or stuck)" + ("" if call.vids is None else "; the next call asks it to drop the "
                                                     "blocks" if op == Op.COMMIT else "; the next call sends it")))
        try:
            if self._ended and op in P.NEEDS_CLIENT:  # (not sent, its socket let go below: sent, each call made a
                # socket to the next daemon there, a refused handshake where its keys were made again, and said
                # the daemon "ended while this call waited 0.05s", not to attach again, a review)
                raise call.mine(DaemonError("UnknownClient", f"{op.value}: not sent: this client's daemon has ended"))
            while self._unsent:
                # Out of the queue before it is noted again: noted twice (an exception between), a
                # release ran twice and dropped another thread's pin (a review); lost there, its pins
                # stay until detach, the safe side.
                self._transport.give_up_unsent(self.client_id, *self._unsent.popleft())
            waited = min(time.monotonic() - began, timeout - 1e-3)
            sent = time.monotonic()
            call.taken = self._transport.taken  # (cut off before the transport counts it, the call is kept)
            reply = self._transport.call(op, self.client_id, args, arrays, timeout, waited)
            call.answered = True
            if op in P.NEEDS_CLIENT:  # (ping, stats, check and history renew no lease: answered without one)
                self.renewed(sent)
            return reply
        except DFlash2Error as e:
            if call.owns(e, self._transport):  # (only the transport's own answers say the lease or the daemon ended)
                if isinstance(e, DaemonError) and e.kind == "UnknownClient":  # the lease lapsed (or the daemon
                    self._lease_lost()  # restarted): as the heartbeat says
                    if self._ended:  # (a new daemon's answer blamed a detach or a lapsed lease, a review)
                        self._let_socket_go()
                        raise call.mine(DaemonError("UnknownClient", (
                            f"client {self.client_id} is not attached: the daemon it attached to at {self.endpoint} "
                            "has ended (stopped or restarted), and its blocks, pins and reservations with it; "
                            "attach a new client"))) from None
                elif isinstance(e, DaemonUnavailable) and self._daemon_gone():
                    self._let_socket_go()
            raise
        finally:
            self._lock.release()
            if self._detach_after and not self._lock._is_owned():  # (asked for within the call: now, a review:
                self._detach_after = False  # run inside it, it closed the call's socket under it)
                self.detach()

    # -- layouts ---------------------------------------------------------------------------
    @property
    def layouts(self) -> list[int]:
        """Ids of the layouts registered at attach, in order."""
        return list(self.layout_ids)

    def register_layout(self, layout: Layout, prefill_tokens_per_s: float | None = None) -> int:
        """The layout's id on the daemon (the same for a layout registered before). A rate given is
        this client's prefill rate for it; none leaves a rate given before as it is
        (`set_prefill_rate(layout, None)` withdraws it)."""
        args = {"layout": layout_dict(layout)}
        if prefill_tokens_per_s is not None:
            args["prefill_tokens_per_s"] = prefill_tokens_per_s
        lid = int(self._call(Op.REGISTER_LAYOUT, args).result["layout"])
        self._layouts[lid] = layout
        return lid

    def set_prefill_rate(self, layout: int, tokens_per_s: float | None) -> None:
        """This engine recomputes KV of `layout` at `tokens_per_s` (None withdraws the rate): the
        daemon's lookups for this client then stop a prefix before the first block whose read back
        would take longer than recomputing it."""
        self._call(Op.PREFILL_RATE, {"layout": _int("layout", layout), "tokens_per_s": tokens_per_s})

    def layout(self, layout_id: int) -> Layout:
        try:
            return self._layouts[_int("layout_id", layout_id)]
        except KeyError:
            raise ArenaError(f"layout id {layout_id} was not registered by this client; register_layout it "
                             "to view its blocks") from None

    # -- reservations ----------------------------------------------------------------------
    def reserve(self, layout: int, tokens: int, priority: int = 0, deadline_s: float | None = None,
                request: int = 0) -> Reservation:
        args = {"layout": _int("layout", layout), "tokens": _int("tokens", tokens),
                "priority": _int("priority", priority), "request": _int("request", request)}
        if deadline_s is not None:
            args["deadline_s"] = _seconds("deadline_s", deadline_s)
        return reservation_of(self._call(Op.RESERVE, args).result)

    def reservation(self, reservation_id: int) -> Reservation:
        """Where a reservation stands now: a deferred one that fits by now is granted by this call
        (poll it about `est_wait_s` after the last answer)."""
        args = {"reservation": _int("reservation_id", reservation_id)}
        return reservation_of(self._call(Op.RESERVATION, args).result)

    def take(self, reservation_id: int, n: int) -> np.ndarray:
        """n blocks of a granted reservation, to write (their places; views are valid until commit)."""
        reply = self._call(Op.TAKE, {"reservation": _int("reservation_id", reservation_id), "n": _int("n", n)})
        return self._held.writing(_places(reply.arrays[0]))

    def cancel(self, reservation_id: int) -> None:
        self._call(Op.CANCEL, {"reservation": _int("reservation_id", reservation_id)})

    # -- blocks ----------------------------------------------------------------------------
    def allocate(self, layout: int, n: int, request: int = 0, priority: int = 0,
                 tier: str = "hbm") -> np.ndarray | None:
        """n private blocks to write (in HBM, or tier="dram" for a host-side writer), outside any
        reservation; None when that tier has no room now (DaemonError of kind NeverFits when n
        blocks exceed the whole tier)."""
        args = {"layout": _int("layout", layout), "n": _int("n", n), "request": _int("request", request),
                "priority": _int("priority", priority)}
        if tier != "hbm":
            args["tier"] = tier
        reply = self._call(Op.ALLOCATE, args)
        if not reply.result.get("allocated"):
            self.last_refusal = reply.result.get("reason")
            return None
        return self._held.writing(_places(reply.arrays[0]))

    def commit(self, vids, keys=None, parent: int | None = None) -> np.ndarray:
        """Make blocks final (and, with content keys, shareable). Returns the vids now held: a key
        already cached deduplicates to the cached block. A commit that timed out (DaemonUnavailable),
        sent or not, is forgotten (protocol.UNDOABLE): the daemon drops what it left this writer either way (its
        references on the blocks it returned, which stay cached, or the blocks being written, when
        it had not run), so they are the writer's no more, and no longer viewable by vid here."""
        vids = vid_array(vids)  # (first: one int vid with keys=[k] failed as "int has no len()")
        if keys is not None and len(keys) != len(vids):
            # (An empty key list went as "no keys": the blocks were committed unkeyed, never found.)
            raise ValueError(f"commit of {len(vids)} blocks with {len(keys)} content keys (keys=None: no keys)")
        args = {} if parent is None else {"parent": _int("parent", parent)}
        arrays = [vids.tobytes(), b"" if keys is None else _keys(keys)]
        reply = self._call(Op.COMMIT, args, arrays, gives_up=lambda: self._held.written(vids))
        return np.frombuffer(reply.arrays[0], dtype=P.VIDS_DTYPE)

    def lookup(self, keys, layout: int | None = None, tier: str = "hbm", *, probe: bool = False) -> np.ndarray:
        """Places of the longest cached prefix of a key chain (not pinned: acquire before viewing).
        tier="dram": a host-side reader; the daemon prefetches nothing into HBM for it. With a
        prefill rate given for the layout, the prefix ends before the first block that loads more
        slowly than this engine recomputes it. probe=True: a question about blocks (is the page before
        mine cached?), not a request's prefix, which heat's duel replays and the lookup figures count."""
        return self.lookup_with_cost(keys, layout, tier, probe=probe)[0]

    def lookup_with_cost(self, keys, layout: int | None = None, tier: str = "hbm", *,
                         probe: bool = False) -> tuple[np.ndarray, int]:
        """`lookup`, and how many cached blocks past the answer were withheld because reading them
        back would cost more than recomputing them (0 without a prefill rate), or they lie on a
        failing NVMe disk that backs off after failed reads."""
        args = {} if layout is None else {"layout": _int("layout", layout)}
        if tier != "hbm":
            args["tier"] = tier
        if probe:
            args["probe"] = True
        reply = self._call(Op.LOOKUP, args, [_keys(keys)])
        return _places(reply.arrays[0]), int(reply.result.get("withheld", 0))

    def acquire(self, vids, tier: str = "hbm", priority: int | None = None) -> np.ndarray | None:
        """Pin blocks in HBM (promoting them first); their places, or None when HBM has no room now
        (DaemonError of kind NeverFits when they exceed the whole tier; of kind PinnedBlock when one
        of them must move up but a host-side reader has it pinned where it lies: it can move once
        released). tier="dram": a host-side reader pins blocks in DRAM where they are (only NVMe ones
        move up). Each acquire is one pin per block, as many as the daemon counts: a block stays
        viewable by vid until its last pin is released. The room a promotion needs comes from idle
        blocks first, then from running requests' blocks; with `priority` (the reading request's),
        only from those of that priority or lower, and the blocks read carry at least it."""
        args = {} if tier == "hbm" else {"tier": tier}
        if priority is not None:
            args["priority"] = _int("priority", priority)
        reply = self._call(Op.ACQUIRE, args, [_vids(vids)])
        if not reply.result.get("acquired"):
            self.last_refusal = reply.result.get("reason")
            return None
        return self._held.pinned(_places(reply.arrays[0]))

    def release(self, vids) -> None:
        """Give up one pin per block. Whatever the answer but a refusal (DaemonError: the daemon ran
        nothing, its pins stay and so do the views), the pins are given up here: a release that timed
        out may have run, and a block no longer pinned may move under a view by vid. It is sent again
        until the daemon answers, and runs once (transport.py): never release again."""
        vids = vid_array(vids)  # (refused before anything is given up here)
        self._call(Op.RELEASE, {}, [vids.tobytes()], gives_up=lambda: self._held.released(vids))

    def free(self, vids) -> int:
        """Drop one reference per block (a block being written is freed); as with `release`, the
        blocks are no longer viewable by vid as written ones here, whatever the answer but a refusal."""
        vids = vid_array(vids)
        # (a pinned one stays viewable)
        return int(self._call(Op.FREE, {}, [vids.tobytes()], gives_up=lambda: self._held.written(vids)).result["freed"])

    def add_ref(self, vids, priority: int | None = None) -> None:
        """A request of this client shares these blocks; with its `priority`, they are protected as
        a running request of that priority (a shared prefix, as the highest-priority user's)."""
        self._call(Op.ADD_REF, {} if priority is None else {"priority": _int("priority", priority)}, [_vids(vids)])

    def places(self, vids) -> np.ndarray:
        """Where each block lies now (PLACE_DTYPE records): published blocks, and this client's own
        private ones (another client's: DaemonError NotOwner)."""
        return _places(self._call(Op.PLACES, {}, [_vids(vids)]).arrays[0])

    # -- daemon ----------------------------------------------------------------------------
    def ping(self) -> dict:
        return self._call(Op.PING).result

    def stats(self) -> dict:
        return self._call(Op.STATS).result

    def set_weights(self, weights: dict[str, float]) -> dict:
        return self._call(Op.SET_WEIGHTS, {"weights": dict(weights)}).result["policy"]

    def check(self) -> None:
        """The daemon's invariant check; DaemonError names the violation."""
        self._call(Op.CHECK)
