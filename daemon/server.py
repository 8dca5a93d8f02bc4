"""dflash2d's request loop: serves the control endpoint, runs rescoring and moves in the background,
and stops cleanly when asked (start-up and shutdown around it: startup.py).

One thread owns the block manager: it reads a request, handles it, replies, and between requests
runs the periodic work (lease expiry, reservation ticks), and a draining tier's pieces: each step's
share of the drain (REBALANCE_BUDGET_S) one piece at a time between requests, and more while no
request has come for IDLE_AFTER_S; the heat policy's duel's sampled lookups likewise, one at a time
while no request waits (DUEL_STARVED_S). A piece's copies run while the loop answers requests (its blocks
stay where they were until the copies have ended: `BlockManager.drain_slice`), and so do a
promotion's reads from NVMe (an acquire's, a prefetch's: promotion.py `promote_later`). A call that
must wait for copies still running PARK_AFTER_S after they began (it meets their blocks, or does
placement work) is parked, not waited for: the loop answers the others meanwhile, and runs it
again, whole, once its pool's copies have ended (parking.py; settling.py); an acquire that started
the reads is parked on them. Every
other move is finished or rolled back before its request returns, and shutdown settles what is in
flight first (answering the calls still parked), so it never leaves a block half-moved.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time

import zmq

from dflash2 import protocol as P
from dflash2.daemon.keygate import KeyGate, ReadOnlyFrames
from dflash2.daemon.observe import SAMPLE_INTERVAL_S, Observers
from dflash2.daemon.parking import Parked, ParkedCalls
from dflash2.daemon.service import Service
from dflash2.daemon.stalls import StallWatch
from dflash2.errors import DaemonUnavailable
from dflash2.rebalance import Rebalancing
from dflash2.tcpkeys import DaemonKeys
from dflash2.transfer.doorbell import COMPLETIONS
from dflash2.zmqio import NOBLOCK, recv_frames, send_frames

log = logging.getLogger("dflash2.daemon")

DRAIN_BEFORE_TICK = 1024  # most queued requests answered before a due tick runs ...
# ... and most time spent answering them, in tick intervals: a count alone let 1,024 slow requests
# (24 busy clients, or a flood of calls never read back) hold the tick off for seconds.
DRAIN_BUDGET_TICKS = 1.0
# A due step gives way to requests while copies left in flight run (`_copies_ended`); once it is
# this late (seconds), the leases are judged meanwhile, once a tick interval, whatever the copies:
# on a slow disk some copy was nearly always in flight (each request parked on one started more when
# it ran again), the step came 6-18 s late while clients called back to back, and a dead client kept
# its lease for that long (NVMe reads of 1 s, a review's script; lease 2 s).
STEP_LATE_MAX_S = 1.0
# While a tier drains (rebalance), the loop runs rebalance slices of this budget between requests
# (each a piece sized to take half of it, or the tier's floor piece): a request that arrives
# meanwhile waits for that piece at most. Each background step's share of the drain
# (REBALANCE_BUDGET_S a pool) runs so while requests come, a piece no sooner than PIECE_SPACING times
# its own length after the last one ended, and at once while none waits. Run inside the step in one
# stretch, it held every call that came meanwhile: calls at random times waited 22-30 ms at p50 and
# up to 100 ms while DRAM drained to NVMe (an experiment script, docs/measured-figures.md). Slices of
# 20 ms made those waits longer again (p50 25-117 ms: requests queue up behind longer pieces).
IDLE_DRAIN_S = 0.01
# Replies queued for one connection at most (the protocol's limit on calls in flight on one
# connection): a library client has one call in flight on each of its connections, so only a peer
# that does not read its replies fills this (ZeroMQ counts a burst sent within about a millisecond
# as queued, however fast the peer reads: 40 pipelined pings lost replies at 16). ZeroMQ's default,
# 1,000 messages of any size, let one such peer hold 1.9 GB of the daemon's memory (a review:
# `places` replies of 1.9 MB never read); 64 of the largest replies are about 120 MB. Further
# replies to it are dropped (`_answer`), logged.
REPLIES_QUEUED_PER_PEER = 64
DROPPED_LOGGED_EVERY_S = 60.0
# Requests get at least twice a piece's length before the next piece while they come: the drain takes
# at most a third of a busy loop, as the stretch did (50 ms in a cycle of 150). At half (a piece's
# length), a client calling back to back alongside three writers made 20% fewer lookups (soak3).
PIECE_SPACING = 2.0
# ... and beyond the step's share, once no request has come for this long: a client in
# mid-conversation (calls back to back) is not made to wait for pieces (a 2 GB DRAM drain: lookups at
# p50 5.1-5.4 ms during it, 0.25 ms without pieces between the steps: experiment scripts, README), a
# quiet daemon drains faster.
IDLE_AFTER_S = 0.005
# The longest the loop waits for a request when nothing else is due: how soon it sees `stop`.
MAX_WAIT_MS = 200
MOST_FRAMES = 1 + P.MAX_REQUEST_FRAMES  # the ROUTER's peer identity, then the request's
# The duel's sampled lookups (duel.py) are served once no request has come for IDLE_AFTER_S, one at
# a time while none waits; and at each step, whatever waits, those expected to take DUEL_STEP_S in
# all (2% of a 100 ms step: the share a loop never idle gives them) and what earlier steps saved. One
# that would take longer than DUEL_SAVED_S waits for a quiet loop, unless none was served for
# DUEL_STARVED_S while some waited: then a step serves it. One sampled lookup served at every step,
# whatever its cost, held a call in ten behind it (6-8 ms for one of a 1024-key lookup on the 2-core
# VM, `dflash2 bench calls`).
DUEL_STEP_S = 0.002
DUEL_STARVED_S = 1.0
# A step's share not spent (no lookup that fits) is saved for the next steps, up to DUEL_SAVED_S: a
# lookup of 2-3 ms (one or two keys replayed by three miniatures of three tiers, the 2-core VM) never
# fit in one step's 2 ms, and a loop never idle served about one a second (the starved one): 345 in
# 150 s while 5,120 were dropped (`dflash2 bench churn` with 64 MB of HBM; 1,245-1,304 since, its
# duel judging by the end). Saved up, each such lookup is served every second step or so, a call
# waiting for one at most, the duel's share the same.
DUEL_SAVED_S = 0.01


class Server:
    def __init__(self, service: Service, endpoint: str, tick_interval_s: float, observers: Observers | None = None,
                 keys: DaemonKeys | None = None, key_file: str | None = None, context: zmq.Context | None = None):
        """`keys`: a tcp endpoint's (from `key_file`): only clients holding its client key, or the
        monitoring key (answered read-only calls alone), connect. `context`: ZeroMQ's, its threads
        started (startup.py), else a new one."""
        self.service = service
        if endpoint.startswith("tcp://"):  # (in ping and stats, and checked against monitoring calls': keygate.py)
            service.request_port = int(endpoint.rpartition(":")[2])
        self.observers = observers
        self.endpoint = endpoint
        self.tick_interval_s = tick_interval_s
        self._stop = threading.Event()
        self.failed: str | None = None  # why serving stopped on its own (service.fatal), if it did
        self._last_tick_s = 0.0  # how long the last background step took
        self._slices_on = True  # drain slices between requests (off after one failed, until the next step)
        self._duel_slices_on = True  # the duel's lookups between requests (likewise)
        # Per pool, the duel's lookups served, and since when none more while some waited (_duel_step);
        # and the steps' share saved up, or owed (seconds, within DUEL_SAVED_S either way).
        self._duel_progress: dict[int, tuple[int, float]] = {}
        self._duel_saved: dict[int, float] = {}
        self._drain_owed_s = 0.0  # what is left of this step's share of the drain (seconds)
        self._piece_ended = 0.0  # when the last drain slice ended (monotonic) ...
        self._piece_s = 0.0  # ... and how long it took
        self._last_answer = 0.0  # when the last request was answered (monotonic)
        self._parked = ParkedCalls(self._copies_done)  # calls waiting for copies in flight (parking.py)
        self._first_pool = -1  # the pool that last ran a drain piece (_drain_slice)
        self._stalls = StallWatch()  # time the process did not run, counted out of leases (_judge_leases)
        self._ctx = zmq.Context() if context is None else context
        self._sock = self._request_socket()
        # Replies dropped (a full queue), undelivered (gone), hand-outs given back: since their last line.
        self._dropped, self._gone, self._given_back, self._dropped_logged_at = 0, 0, 0, -DROPPED_LOGGED_EVERY_S
        self._gate = None if keys is None else KeyGate(self._ctx, keys, str(key_file))
        if self._gate is not None:
            self._gate.request_port = service.request_port
        self.monitoring_port: int | None = None  # a tcp endpoint's monitoring socket's (keygate.py)
        try:
            if self._gate is not None:
                self._gate.secure(self._sock)
            # An ipc socket is owner-only from its bind on: made under the start's umask (000: mode
            # 777) and chmod-ed after, another user connected in between and stayed connected (a
            # review: attached and served). (Process-wide for the moment of the bind: any file made
            # meanwhile only gets a stricter mode.)
            umask = os.umask(0o177)
            try:
                self._sock.bind(endpoint)
            finally:
                os.umask(umask)
            if self._gate is not None:  # (after the request socket: the system might give it the request port)
                monitoring = self._request_socket()
                self._gate.secure(monitoring, monitoring=True)
                monitoring.bind(f"{endpoint.rpartition(':')[0]}:*")  # (a port of the system's choosing)
                self.monitoring_port = int(monitoring.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
        except BaseException:
            self.close()  # (the gate's thread would keep the process alive)
            raise
        self._poller = zmq.Poller()  # requests, and the end of a copy thread's batch (`_request_or_copies_ended`)
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(COMPLETIONS.fileno(), zmq.POLLIN)

    def _request_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)  # a larger frame drops its sender
        sock.setsockopt(zmq.SNDHWM, REPLIES_QUEUED_PER_PEER)
        # A reply that cannot be queued raises (zmq.Again: the peer's queue is full; EHOSTUNREACH: the
        # peer is gone) instead of vanishing without a word.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT too (IPv4 addresses still work)
        return sock

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        """Blocking receive with a timeout (cheaper per request than a poller): between requests,
        and at least every tick interval, the periodic work runs."""
        sock = self._sock
        timeout_ms = -1  # the socket's receive timeout as last set (it follows the step that is due)
        next_tick = time.monotonic()
        # The observers' next sample (metrics snapshot, history), due every SAMPLE_INTERVAL_S
        # whatever the step's interval; the step samples too (each when due).
        next_sample = next_tick + SAMPLE_INTERVAL_S if self.observers is not None else math.inf
        leases_judged = -math.inf  # when the leases were last judged apart from a late step
        # Leases are judged every heartbeat interval, whatever the step's (policy.rescore_interval_ms,
        # up to an hour: a crashed engine held its blocks that long): between steps too, when longer.
        judge_s = self.service.heartbeat_interval_s
        next_judge = next_tick + judge_s if judge_s < self.tick_interval_s else math.inf
        # Nothing could be answered before the loop ran: leases are judged as of its start until
        # the queue is first seen empty (a heartbeat queued before then lapses nobody).
        self.service.queue_empty()
        self._parking(True)
        self._stalls.start()
        gate = self._gate
        while not self._stop.is_set():
            if gate is not None and (monitoring := gate.next_monitoring(MOST_FRAMES)) is not None:
                self._answer(monitoring)  # (at most one a turn: a request waits behind one at most)
            if self._parked and self._parked.ready():
                self._parked.answer(lambda frames, parked: self._answer(frames, again=parked))
            # While a tier drains, the next slice is due (_next_slice) when no request waits by then,
            # and, while the step's share lasts, after a request answered once it is due. No slice
            # begins while calls are parked: its copies would keep them waiting.
            draining = self._slices_on and not self._parked and self._draining()
            # Else, while the duel's sampled lookups wait, they are served once no request has come
            # for IDLE_AFTER_S, one at a time while none waits (_duel_slice).
            dueling = not draining and self._duel_slices_on and not self._parked and self._duel_pending()
            if gate is not None:
                gate.end_turn()  # (a monitoring message's turn, from its receipt: never the waits below)
            if self._parked:
                request = self._request_or_copies_ended()
                if self._parked.ready():
                    # The parked calls first (the loop's next turn), the request after them: answered
                    # first, it could start copies of its own (a prefetch's reads) that they would wait
                    # for too, and a parked call could be overtaken again and again.
                    continue
            try:
                if self._parked and not request:
                    raise zmq.Again()  # (a parked call is answered once the copies end: looked at each turn)
                if draining and not sock.poll(max(0, math.ceil(1000 * (self._next_slice() - time.monotonic()))),
                                              zmq.POLLIN):
                    raise zmq.Again()
                if dueling and not sock.poll(max(0, math.ceil(1000 * (min(self._last_answer + IDLE_AFTER_S, next_tick)
                                                                      - time.monotonic()))), zmq.POLLIN):
                    raise zmq.Again()
                # Otherwise a wait until the step is due, no longer (nor more than MAX_WAIT_MS, to
                # see a stop): a fixed timeout overshot the step by up to its own length each time.
                wait_ms = 0 if draining or dueling or self._parked else \
                    min(MAX_WAIT_MS, math.ceil(1000 * (min(next_tick, next_sample, next_judge) - time.monotonic())))
                if wait_ms <= 0:
                    frames = self._recv(NOBLOCK)
                elif gate is not None:
                    # A monitoring call wakes the wait too (it waited out the request socket's
                    # timeout: 90-200 ms a call on an idle daemon, a review); read at the loop's top.
                    if not gate.wait(sock, wait_ms):
                        raise zmq.Again()
                    frames = self._recv(NOBLOCK)
                else:
                    if wait_ms != timeout_ms:
                        sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                        timeout_ms = wait_ms
                    frames = self._recv()
            except zmq.Again:
                frames = None
                # Every message sent before now is answered: leases are judged as of then (a
                # heartbeat still queued is not yet seen).
                self.service.queue_empty()
                if draining and time.monotonic() < next_tick:
                    self._drain_slice(wait=True)
                elif dueling and time.monotonic() < next_tick:
                    self._duel_slice()
            if frames is not None:
                self._answer(frames)
                if draining and self._drain_owed_s > 0 and self._next_slice() <= time.monotonic() < next_tick:
                    self._drain_slice(wait=False)
            if gate is not None:
                gate.end_turn()  # (a monitoring message's wake-up and the request socket's failed read; not the step)
            now = time.monotonic()
            if now >= next_sample:
                self._sample()
                next_sample = now + SAMPLE_INTERVAL_S
            if now >= next_judge:
                if now < next_tick:  # (the step judges them itself)
                    self._expire_leases()
                next_judge = now + judge_s
            if now >= next_tick:
                # What queued up while the last request ran (a long promotion from NVMe) is read
                # first: the heartbeats in it are what keep those clients' leases, which the tick
                # is about to check. Bounded in count and in time, so that a flood of requests
                # cannot hold the tick off; leases are judged as of the last empty queue, so a
                # heartbeat left queued by the bound never lapses its client's lease.
                # At least as long as the step itself took last time: with a tiny interval and a
                # slow step, requests would otherwise get a fraction of the loop.
                budget = now + max(DRAIN_BUDGET_TICKS * self.tick_interval_s, self._last_tick_s)
                for _ in range(DRAIN_BEFORE_TICK):
                    try:
                        frames = self._recv(NOBLOCK)
                    except zmq.Again:
                        self.service.queue_empty()
                        break
                    self._answer(frames)
                    if time.monotonic() >= budget:
                        break
                if not self._copies_ended():
                    if now - next_tick >= STEP_LATE_MAX_S and now - leases_judged >= min(self.tick_interval_s, judge_s):
                        self._expire_leases()
                        leases_judged = now
                    continue  # a request waits while a drain piece's copies run: it goes first
                started = time.monotonic()
                self._slices_on = self._duel_slices_on = True  # (after a failed slice, from the next step on)
                self._tick(late_s=started - next_tick)
                self._last_tick_s = time.monotonic() - started
                next_tick = time.monotonic() + self.tick_interval_s
            lost = self.service.fatal()
            if lost:  # every later move would fail: a restarted daemon serves again, a zombie never
                self.failed = lost
                return
        # Stopping: the calls still parked are answered without being run (the daemon stops, and
        # what they would hand out goes with it). Run whole, each started reads of its own: a stop
        # with four readers parked on a slow disk's NVMe reads took 7 s past the 1.5 s read in
        # flight (a review). The copies in flight end in Service.shutdown.
        self._parking(False)
        while self._parked:
            frames, _ = self._parked.popleft()
            self._send_reply(frames, P.encode_reply(P.error_reply(P.peek_call_id(frames[1:]), DaemonUnavailable(
                "dflash2d is stopping: this call waited for copies in flight and was not run"))))

    def _parking(self, on: bool) -> None:
        """While the loop serves: a call that must wait for copies not yet ended is parked, and a
        promotion's reads from NVMe are left in flight (settling.py, promotion.py)."""
        self.service.parking = on
        for m in self.service.managers.values():
            m.placement.read_later = on

    def _request_or_copies_ended(self) -> bool:
        """(Calls parked) wait up to Rebalancing.FLIGHT_POLL_S for a request, as a drain slice waiting
        for its piece's copies does, but waking at once when a copy thread ends a batch (the
        doorbell: transfer/doorbell.py); whether a request waits."""
        ready = dict(self._poller.poll(math.ceil(1000 * Rebalancing.FLIGHT_POLL_S)))
        if COMPLETIONS.fileno() in ready:
            COMPLETIONS.drain()
        return self._sock in ready

    def _draining(self) -> bool:
        """Whether a pool's tier drains, or a drain piece's copies are in flight (asked every turn of
        the loop: a plain loop, where a generator cost more than the answer on an idle daemon)."""
        for m in self.service.managers.values():
            if m.draining():
                return True
        return False

    def _duel_pending(self) -> bool:
        """Whether a pool's duel has sampled lookups waiting (asked every turn of the loop: a plain loop)."""
        for m in self.service.managers.values():
            if m.duel is not None and m.duel.pending:
                return True
        return False

    def _duel_step(self, pool: int, manager) -> None:
        """The duel's share of a background step, whatever waits: the sampled lookups expected to
        take DUEL_STEP_S in all, with what earlier steps left unspent while lookups waited (up to
        DUEL_SAVED_S: a lookup longer than one step's share is served once enough is saved); the
        rest between requests (`_duel_slice`). And one however long once it has served none for
        DUEL_STARVED_S while some waited (a loop never idle that long would starve it)."""
        duel = manager.duel
        now = time.monotonic()
        served, since = self._duel_progress.get(pool, (duel.requests, now))
        if duel.requests != served or not duel.pending:
            since = now
        share = min(max(DUEL_SAVED_S, DUEL_STEP_S), self._duel_saved.get(pool, 0.0) + DUEL_STEP_S)
        began = time.perf_counter()
        duel.run(share, fits=True, at_least_one=now - since >= DUEL_STARVED_S)
        # What a lookup took beyond its expected cost is owed (down to -DUEL_SAVED_S): the duel's time
        # stays its share. Nothing is saved or owed while none wait: the quiet serves them.
        left = max(-DUEL_SAVED_S, share - (time.perf_counter() - began))
        self._duel_saved[pool] = left if duel.pending else 0.0
        if duel.requests != served:
            since = time.monotonic()
        self._duel_progress[pool] = (duel.requests, since)

    def _duel_slice(self) -> None:
        """Serve the duels' sampled lookups while no request waits: one at a time, IDLE_DRAIN_S at
        most a pool (duel.py `run`): a request that comes meanwhile waits for one sampled lookup."""
        with self.service.busy():
            for manager in self.service.managers.values():
                if manager.duel is None or not manager.duel.pending:
                    continue
                try:
                    manager.duel.run(IDLE_DRAIN_S, self._request_waits)
                except Exception:
                    # Not again before the next background step (as a drain slice that fails).
                    self._duel_slices_on = False
                    log.exception("the duel's lookups between requests failed; they wait for the next background step")
                    return
                if self._request_waits():
                    return

    def _copies_done(self, device: int | None = None) -> bool:
        """Whether the pool (None: no pool) has copies in flight that have not ended (settling them
        waits for nothing)."""
        pools = self.service.managers.values() if device is None else [self.service.managers[device]]
        return not any(m.copies_running() for m in pools)

    def _next_slice(self) -> float:
        """When the next drain slice is due (monotonic): once no request has come for IDLE_AFTER_S;
        sooner while the step's share lasts, PIECE_SPACING times as long after the last slice ended as
        that slice took."""
        due = self._last_answer + IDLE_AFTER_S
        if self._drain_owed_s > 0:
            due = min(due, self._piece_ended + PIECE_SPACING * self._piece_s)
        return due

    def _drain_slice(self, wait: bool) -> None:
        """A rebalance slice of IDLE_DRAIN_S for each pool still draining (`BlockManager.drain_slice`;
        one piece when a request waits), counted against the step's share. `wait` False (right after
        an answer): a pool whose last piece's copies still run is left alone (the slice would only
        wait for them, the step's share spent on waiting); True (no request came): the slice waits
        for them, watching for a request meanwhile. No slice begins once the step is due: the step
        settles the copies in flight, and a new piece's would hold it off (serve_forever)."""
        started = time.monotonic()
        waited = 0.0  # for copies to end, watching for a request: idle time, not the drain's
        pools = list(self.service.managers.values())
        # The pools in turn, from the one after the last to start a piece: a request that arrives
        # stops the slice after the pool at hand (it started a piece in every draining pool: 8 GPUs
        # draining held a waiting request for 8 pieces, and the first pool took every first piece).
        first = (self._first_pool + 1) % len(pools)
        with self.service.busy():
            for index in [*range(first, len(pools)), *range(first)]:
                manager = pools[index]
                if not manager.draining() or (not wait and manager.copies_running()):
                    continue
                self._first_pool = index  # (by the pool that ran: one past a pool not draining favoured the next)
                try:
                    waited += manager.drain_slice(IDLE_DRAIN_S, self._request_waits)
                except Exception as e:
                    # Not again before the next background step: one that fails each time would
                    # otherwise fill the log as fast as the loop spins.
                    self._slices_on = False
                    log.exception("a rebalance piece between requests failed; drains wait for the next "
                                  "background step")
                    self.service.verify_after(e, "a rebalance piece")  # (failing.py)
                if self._request_waits():
                    break
        self._piece_ended = time.monotonic()
        self._piece_s = max(0.0, self._piece_ended - started - waited)
        self._drain_owed_s -= self._piece_s

    def _copies_ended(self) -> bool:
        """Before the background step (which settles them: it rescores and may move blocks): whether
        the drain copies in flight have ended and are settled. While they run it waits for them, but
        gives way to a request that arrives (False: the step comes at the loop's next turn), which
        must not wait for the disk, and to a parked call whose own pool's copies have ended (it
        waited a tick interval for another pool's); at most a tick interval."""
        until = time.perf_counter() + self.tick_interval_s

        def yield_to(within_s: float) -> bool:
            return bool(self._parked and self._parked.ready()) or self._request_waits(within_s)

        return all(m.placement.settle_when_done(yield_to, until) for m in self.service.managers.values())

    def _request_waits(self, within_s: float = 0.0) -> bool:
        """Whether a request is queued, or comes within `within_s` (a poll; 0: no wait): an idle drain
        stops after its piece, and a slice waiting for its piece's copies gives way to it."""
        return bool(self._sock.poll(math.ceil(within_s * 1000) if within_s > 0 else 0, zmq.POLLIN))

    def _log_dropped(self, force: bool = False) -> None:
        """Replies dropped (REPLIES_QUEUED_PER_PEER queued unread) or undelivered (the connection gone: once said
        at debug alone) since the last line, once a minute at most, or at once with `force` (the stop)."""
        now = time.monotonic()
        if (self._dropped or self._gone) and (force or now - self._dropped_logged_at >= DROPPED_LOGGED_EVERY_S):
            n, gone = self._dropped, self._gone
            said = [f"dropped {n} repl{'y' if n == 1 else 'ies'}: {REPLIES_QUEUED_PER_PEER} replies to one connection "
                    "were queued unread (a client that does not read its replies)"][:n]
            said += [f"{gone} undelivered: the connection was gone (a client that timed out)"][:gone]
            log.warning("%s, since the last such line; what %d of those calls handed out is given back",
                        "; ".join(said), self._given_back)
            self._dropped, self._gone, self._given_back, self._dropped_logged_at = 0, 0, 0, now

    def _recv(self, flags: int = 0) -> list[bytes]:
        """The next request's frames (zmq.Again as recv_frames)."""
        return recv_frames(self._sock, flags, MOST_FRAMES)

    def _answer(self, frames: list[bytes], again: Parked | None = None) -> bool:
        """Handle one request and send its reply; False when the call was parked instead (no reply
        yet: `ParkedCalls.answer` runs it again once its pool's copies in flight have ended)."""
        read_only = type(frames) is ReadOnlyFrames
        if read_only:
            self._gate.begin_turn(frames)  # (its turn is charged from its receipt on, the call within: keygate.py)
        elif self._gate is not None:
            self._gate.end_turn()  # a request's call is never charged to the monitoring calls
        if read_only and (refusal := self._gate.refusal(frames)) is not None:
            self.service.counters["requests"] += 1
            self.service.counters["errors"] += 1
            self._send_reply(frames, refusal)
            self._gate.end_turn(close=False)
            return True
        self._credit_stall()  # before the call: it may take a reservation the stall would have expired
        settled = self._settled_s()
        reply = self.service.handle_frames(frames[1:], again)
        if read_only:
            self._gate.end_turn(close=False)  # (charged now; the loop's checks after it are its turn's too)
        if isinstance(reply, Parked):
            self._parked.append((frames, reply))
            return False
        if not self._send_reply(frames, reply, said=False):
            self._given_back += self.service.reply_dropped()  # (what it handed out, its client never learns of)
            self._log_dropped()
        self.service.after_reply()
        self._last_answer = time.monotonic()
        spent = self._settled_s() - settled
        if spent > 0:
            # The call ended a drain piece's copies first (settling.py: an allocation that made
            # room, a promotion, a reservation): its wait is that piece's use of the loop, so the
            # next piece comes PIECE_SPACING times the whole of it later. Counted by the slice's
            # time alone, a piece began right after each such answer, and every call back to back
            # waited for a piece's copies (one-block allocations back to back during a 48 GB drain
            # on the H200 host: 8.95 ms on average, 0.8 since; docs/measured-figures.md).
            self._piece_ended = self._last_answer
            self._piece_s += spent
            self._drain_owed_s -= spent
        return True

    def _send_reply(self, frames: list[bytes], reply: list[bytes], said: bool = True) -> bool:
        """Send `reply` to the peer of `frames` (by their socket), never waiting; whether it was sent."""
        sock = frames.sock if type(frames) is ReadOnlyFrames and frames.sock is not None else self._sock
        try:
            send_frames(sock, [frames[0], *reply], NOBLOCK)
            return True
        except zmq.Again:
            self._dropped += 1  # (REPLIES_QUEUED_PER_PEER queued unread)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            # The connection is gone (a client that timed out resets its socket, then sends `forget`).
            log.debug("a reply's connection is gone: reply dropped")
            self._gone += 1
        if said:
            self._log_dropped()
        return False

    def _settled_s(self) -> float:
        """Seconds calls and slices have spent ending drain copies, every pool (rebalance.py `settled_s`)."""
        total = 0.0  # (twice a call: a plain loop, not a generator)
        for m in self.service.managers.values():
            total += m.placement.settled_s
        return total

    def _expire_leases(self) -> None:
        """The step's lease expiry alone: between steps longer apart than the heartbeat interval, and
        for a step held off by copies in flight (STEP_LATE_MAX_S).
        A lease that lapses then waits for those copies (a detach settles them first: 1-3 s a lapse
        with NVMe reads of 1 s, the loop answering nothing meanwhile); one that does not costs a
        pass over the sessions. With reads of 1 s, dead clients were let go 3-5 s after their 2 s
        lease lapsed (6-18 s before; the review's script)."""
        self._run_steps([("Service.expire_leases", self._judge_leases)])

    def _judge_leases(self) -> None:
        """Service.expire_leases, the time the daemon did not run (stalls.py) counted out first: the
        heartbeats its clients sent meanwhile never reached it."""
        self._credit_stall()
        if self._parked:  # (their clients are heard from, as the step's judging hears them: a review)
            self.service.waiting([parked for _, parked in self._parked])
        self.service.expire_leases()

    def _credit_stall(self) -> None:
        """Count out of leases and reservations the time the daemon did not run, before anything
        judges them: credited at the next judging only, the calls queued during a stall were answered
        first, and a `take` of a reservation whose TTL the stall had run out found it expired (a
        review: a TTL of 2 s, the daemon stopped for 3.3 s)."""
        stalled = self._stalls.stalled_s()
        if stalled > 0:
            log.warning("dflash2d did not run for %.1f s (stopped, frozen, or not scheduled): that time does not "
                        "count against its %d clients' leases or reservations, and each client has a heartbeat "
                        "interval more to reach it again", stalled, len(self.service.sessions))
            self.service.resumed(stalled)

    def _run_steps(self, steps) -> None:
        """(name, step) pairs, each on its own: one that fails must not stop the others from running."""
        with self.service.busy():
            for name, step in steps:
                try:
                    step()
                except Exception as e:
                    log.exception("background step %s failed; the daemon keeps serving", name)
                    self.service.verify_after(e, f"the background step {name}")  # (failing.py)

    def _tick(self, late_s: float = 0.0) -> None:
        """The background step, `late_s` after it was due (leases are judged as of the last time
        the request queue was seen empty: `Service.queue_empty`)."""
        started = time.perf_counter()
        self.service.note_tick(late_s)
        # A pool's step begins its drains; the loop runs their pieces (_drain_slice).
        self._run_steps([("Service.expire_leases", self._judge_leases),
                         *((f"BlockManager.tick (pool {pool})", functools.partial(m.tick, drain=False, duel=False))
                           for pool, m in self.service.managers.items()),
                         *((f"Duel.run (pool {pool})", functools.partial(self._duel_step, pool, m))
                           for pool, m in self.service.managers.items() if m.duel is not None)])
        # This step's share of the drain, each pool's REBALANCE_BUDGET_S (what the last step's left undone lapses).
        self._drain_owed_s = sum(m.placement.REBALANCE_BUDGET_S for m in self.service.managers.values())
        self._log_dropped()
        if self.observers is not None:
            try:
                self.observers.after_tick(late_s, time.perf_counter() - started)
            except Exception:
                log.exception("metrics/history sampling failed; the daemon keeps serving")

    def _sample(self) -> None:
        """The observers' sample between steps (a step's interval may be far longer than theirs)."""
        try:
            self.observers.sample()
        except Exception:
            log.exception("metrics/history sampling failed; the daemon keeps serving")

    def close(self) -> None:
        self._log_dropped(force=True)
        self._stalls.close()
        if self._gate is not None:
            self._gate.close()  # (its monitor of the socket first)
        self._sock.close(0)
        self._ctx.term()
