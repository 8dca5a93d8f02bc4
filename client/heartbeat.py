"""The client's heartbeat thread: renews the lease every heartbeat_interval_s until detach, a lost
lease (the daemon answers UnknownClient) or the daemon's end. Any failure but those (an error reply
of another kind among them) is logged and the next beat tries again: a thread
that died on one (a socket that could not be made, no descriptor left) let the lease lapse with no
word.

Invariant: the thread holds its Client by a weak reference only, never across a wait. It held the
Client itself (its target was a bound method): a Client dropped without close() or detach() was
never collected, and renewed its lease for the process's life, its blocks, pins and reservations
held (a review). Now the beat stops once the Client is collected, said in the log, and the daemon
lets all of it go when the lease lapses.
"""

from __future__ import annotations

import logging
import math
import time
import weakref

from dflash2.client.stopevent import StopEvent
from dflash2.client.transport import Transport
from dflash2.errors import DaemonError, DaemonUnavailable
from dflash2.protocol import Op

log = logging.getLogger("dflash2.client")


class Awake:
    """When the heartbeat thread last had a beat answered or waiting for its answer, and since when it
    has had one with no gap of more than a lease: it marks each answer, and every GONE_CHECK_S while a
    sent beat waits for one, so its gaps are at most the heartbeat interval (below the lease) while
    its process runs and its beats reach the daemon. A process stopped (SIGSTOP, a frozen cgroup)
    stops the thread too, and CLOCK_MONOTONIC runs on: the gap shows it; so does a run of beats that
    could not be sent (no socket, no descriptor left), which the daemon never heard: marked at each
    pass of the loop, they vouched for a lease the daemon let lapse, and a view wrote into a slot
    given to another client's cached block (a review).

    The client's check before a new view (`Client._confirm_lease`) asks the daemon for ASK_S only, and
    trusts this without an answer, where the thread ran all along since the lease was last renewed with
    a beat answered in that run: a silence of the daemon's own (paused, stalled) then costs a view of
    blocks the client still holds 0.2 s at most, and no refusal; the daemon counts its stall out of
    every lease (Service.resumed). Before, each such view waited the whole call timeout for the
    stalled daemon and was then refused (a review).

    Invariant: it vouches only within the window in which the daemon keeps the client's slots even if
    the lease did lapse (`vouches`): the lease, then the set-aside time (`set_aside_s`, from the attach
    reply). Beats that stopped reaching a running daemon after one was answered (a heartbeat path lost
    for it alone) kept the run going, and vouched for a lease lapsed and set aside long before: the view
    wrote into the slot of another client's cached block (a review). With no set-aside (0, or a daemon
    that does not say), a lapse frees the slots at once, and nothing vouches."""

    # How long a view waits for the daemon's word where this vouches: a daemon that is not stalled
    # answers in milliseconds, and its word wins (the beats sent may never have reached it: a heartbeat
    # socket that never connected vouched for a lapsed lease, a review).
    ASK_S = 0.2
    # A gap marked is at most the interval plus one GONE_CHECK_S (a waiting beat's first mark comes one
    # slice after its send): an interval within 50 ms of the lease broke every run (a review).
    SLACK_S = 0.1

    def __init__(self, lease_s: float, set_aside_s: float = 0.0) -> None:
        self.lease_s = lease_s
        self.set_aside_s = set_aside_s  # how long the daemon keeps a lapsed client's slots (SetAside.hold_s)
        self.at = self.since = time.monotonic()
        self.heard = -math.inf  # the last answered beat's mark

    def mark(self, answered: bool = False) -> None:
        now = time.monotonic()
        if now - self.at > self.lease_s + self.SLACK_S:
            self.since = now  # (first: a reader between the two sees a run that starts now)
        self.at = now
        if answered:
            self.heard = now

    def ran_since(self, t: float) -> bool:
        """Whether the thread ran from before monotonic time `t` until within the last lease, with no
        gap of more than a lease, and had a beat answered in that run: beats that were only ever
        waited on (a heartbeat socket that never connected) vouched where the daemon, slow at the
        view's quick ask, would have said the lease lapsed (a review). `at` is read first: a mark
        between two reads the other way round paired the old `since` with the new `at` (a review)."""
        at = self.at
        return time.monotonic() - at <= self.lease_s + self.SLACK_S and self.heard >= self.since <= t

    def vouches(self, renewed: float) -> bool:
        """Whether a view may be handed out without the daemon's answer, the lease last renewed at
        monotonic time `renewed`: the thread ran since (`ran_since`), and the view is handed out (after
        ASK_S) with SLACK_S to spare before the daemon may free the client's slots. The daemon lapses a
        lease a lease after it last heard the client (heard no sooner than `renewed`, the call's send),
        then keeps its slots `set_aside_s` more: the window ends no sooner than `renewed` plus both.
        SLACK_S covers the two clocks (another host's over tcp) and the first write through the view."""
        silent_s = time.monotonic() - renewed
        return (silent_s + self.ASK_S + self.SLACK_S < self.lease_s + self.set_aside_s
                and self.ran_since(renewed))


def run(ref: weakref.ref, stop: StopEvent, interval_s: float, client_id: int, name: str,
        lease_timeout_s: float, awake: Awake | None = None) -> None:
    """The thread's body (`ref`: the Client's weak reference; `awake`: marked as it runs)."""
    transport = None
    mark = awake.mark if awake is not None else (lambda answered=False: None)

    def gone() -> bool:  # (a Transport keeps its test: a bound method of the Client would keep it)
        mark()
        client = ref()
        return client is None or client._arenas_gone()

    # The first pass makes the socket at once, as the call socket was: the daemon counts a client's
    # two connections against its descriptors at attach (a socket made at the first beat let 75
    # clients attach where 48 fit, their heartbeats then connecting past its limit).
    beat = False
    try:
        while not (beat and (stop.wait(interval_s) or stop.is_set())):  # (set as a wait timed out: no beat more)
            client = ref()
            if client is None:
                # (Not detached here: views taken from it may outlive it and still write, so the
                # daemon sets its blocks aside at the lapse, as any live process's.)
                log.warning("dflash2: client %d (%s) was dropped without close() or detach(): its heartbeat stops; "
                            "when its lease lapses (%gs) the daemon lets its reservations go and keeps its private "
                            "blocks and pins out of reuse until this process ends or its set-aside ends "
                            "(daemon.set_aside_leases): close or detach clients to give them back at once",
                            client_id, name, lease_timeout_s)
                return
            try:
                if transport is None:
                    transport = Transport(client.endpoint, min(client.timeout_s, client.lease_timeout_s),
                                          gone=gone, key_file=client.key_file)
                    transport.token = client._token
                if beat:
                    sent = time.monotonic()
                    transport.call(Op.HEARTBEAT, client_id)
                    mark(answered=True)  # (`gone` marks while a sent beat waits)
                    client.renewed(sent)
            except DaemonUnavailable as e:
                if client._daemon_gone():
                    client._let_socket_go()
                    return
                log.warning("dflash2 heartbeat: %s", e)
            except DaemonError as e:
                if e.kind != "UnknownClient":
                    # The daemon failed answering this beat (an InternalError: a MemoryError it served on
                    # past): the lease holds, as after a call's error (`Client._run`). Taken for a lost
                    # lease, the beats stopped, views were refused, and close() sent no detach: the
                    # daemon set the client's blocks aside at the lapse (a review).
                    log.warning("dflash2 heartbeat: %s; trying again in %gs", e, interval_s)
                    continue
                client._lease_lost()
                if client._ended:  # (a new daemon's answer blamed a detach or a lapsed lease, a review)
                    client._let_socket_go()
                    log.error("dflash2 lease lost: the daemon client %d attached to at %s has ended (stopped or "
                              "restarted), and its blocks, pins and reservations with it; attach again", client_id,
                              client.endpoint)
                else:
                    log.error("dflash2 lease lost (%s); attach again", e)
                return
            except Exception:
                log.exception("dflash2 heartbeat failed; trying again in %gs", interval_s)
            finally:
                beat = True
                client = None  # not held across the wait
    finally:
        if transport is not None:
            transport.close()
