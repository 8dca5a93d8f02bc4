"""Leases are judged every heartbeat interval, whatever the background step's (a review of
2026-12-04: with `policy.rescore_interval_ms` at 60,000, a killed engine's session and blocks were
held until the next step, up to a minute; the key allows an hour), and a daemon that did not run for
a while (stopped, frozen) does not count that time against its clients' leases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from daemon_proc import DaemonProcess

from dflash2 import protocol as P
from dflash2.client import Client, Transport
from dflash2.config import load_config
from dflash2.config_warnings import config_warnings
from dflash2.daemon.service import Service
from dflash2.daemon.stalls import STALL_MIN_S, StallWatch
from dflash2.protocol import Op

from conftest import SMALL

CHILD = """
import json, sys, time
from dflash2.client import Client
from dflash2.layout import Layout
c = Client.connect(sys.argv[1], name="victim", layouts=[Layout.from_dict(json.loads(sys.argv[2]))])
c.allocate(c.layout_ids[0], 4)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_killed_client_is_let_go_of_between_steps_a_minute_apart(config_file, tmp_path):
    path = config_file(policy={"rescore_interval_ms": 60_000},
                       daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 1.0,
                               "heartbeat_interval_s": 0.2, "set_aside_leases": 0})
    assert any("policy.rescore_interval_ms (60000 ms) is longer than daemon.lease_timeout_s" in w
               for w in config_warnings(load_config(path)))
    daemon = DaemonProcess(path).start()
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.endpoint, json.dumps(SMALL.to_dict())],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().startswith("ready")
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        with Client.connect(daemon.endpoint, name="watch") as watch:
            deadline = time.monotonic() + 20  # (the next step comes 60 s after the first)
            while "victim" in [c["name"] for c in watch.stats()["clients"]]:
                assert time.monotonic() < deadline, "the killed client is still attached: held until the next step"
                time.sleep(0.2)
            assert watch.stats()["tiers"]["hbm"]["blocks"] == 0  # (its blocks freed with it)
    finally:
        daemon.stop()



def test_a_daemon_stopped_longer_than_a_lease_keeps_its_live_clients_and_lets_a_dead_one_go(config_file, tmp_path):
    """dflash2d stopped (SIGSTOP; a frozen container, a paused VM, a swap storm) for longer than a
    lease while its clients run: the heartbeats sent meanwhile never reached it (each timed out, and a
    fresh socket cannot connect to a stopped daemon), and every client whose heartbeat was not in
    flight as it resumed lost its lease at once (a review's script); a client without heartbeats that
    called just before the stop, and calls again just after, did so every time. A client that died
    meanwhile, in a pid namespace the daemon cannot see into (no pid to test), is let go about a lease
    after the daemon resumes."""
    lease = 2.0
    daemon = DaemonProcess(config_file(daemon={"lease_timeout_s": lease, "heartbeat_interval_s": 0.4,
                                               "request_timeout_s": 1.0})).start()
    clients = []
    ghost = Transport(daemon.endpoint, 1.0)
    try:
        clients = [Client.connect(daemon.endpoint, name=f"engine{i}", layouts=[SMALL], timeout_s=1.0) for i in range(3)]
        quiet = Client.connect(daemon.endpoint, name="quiet", layouts=[SMALL], heartbeat=False)
        clients.append(quiet)
        # (No pid namespace sent: the daemon cannot tell whether its process lives.)
        ghost.call(Op.ATTACH, args={"name": "ghost", "pid": os.getpid(), "layouts": []})
        for c in clients:
            assert c.allocate(c.layouts[0], 2) is not None
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5 * lease)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        resumed = time.monotonic()
        time.sleep(lease / 4)
        assert quiet.allocate(quiet.layouts[0], 1) is not None  # (UnknownClient: its lease had lapsed)
        time.sleep(lease / 2)
        with Client.connect(daemon.endpoint, name="watch", heartbeat=False) as watch:
            stats = watch.stats()
            assert stats["daemon"]["leases_expired"] == 0, [c["name"] for c in stats["clients"]]
            assert not any(c.lease_lost for c in clients)
            assert stats["tiers"]["hbm"]["blocks"] == 9 and stats["set_aside"]["blocks"] == 0
            while "ghost" in [c["name"] for c in watch.stats()["clients"]]:
                assert time.monotonic() - resumed < 2 * lease + 2, "the dead client is never let go"
                time.sleep(0.1)
            assert watch.stats()["daemon"]["leases_expired"] == 1
        assert "did not run for" in daemon.log()
    finally:
        for c in clients:
            c.close()
        ghost.close()
        daemon.stop()


def test_a_stall_is_the_time_no_thread_of_the_process_ran_beyond_a_wake(clock):
    watch = StallWatch(clock, every_s=0.1)
    clock.advance(0.1 + STALL_MIN_S - 0.01)  # late, not stalled (scheduling on a loaded machine)
    assert watch.stalled_s() == 0.0
    clock.advance(3.0)  # seen by the loop before the watching thread has run again
    assert watch.stalled_s() == pytest.approx(2.9)
    assert watch.stalled_s() == 0.0, "taken once"


def test_the_loops_own_long_call_is_no_stall():
    """The watching thread runs through it (as ZeroMQ's I/O thread does, queueing the heartbeats)."""
    watch = StallWatch()
    watch.start()
    try:
        spin_until = time.monotonic() + 2 * STALL_MIN_S
        while time.monotonic() < spin_until:
            pass
        assert watch.stalled_s() == 0.0
    finally:
        watch.close()


def test_a_stall_counts_against_no_lease_and_gives_a_heartbeat_interval_more(make_manager, clock):
    service = Service(make_manager(hbm_blocks=4), lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock,
                      pid_alive=lambda pid: True)
    for name, then in (("idle", 7.0), ("recent", 7.0), ("fresh", 1.0)):
        reply = service.handle_frames(P.encode_request(Op.ATTACH, 1, None, {"name": name, "pid": 1, "layouts": []}))
        assert P.decode_reply(reply).ok
        clock.advance(then)
    idle, recent, fresh = service.sessions.values()  # seen 15, 8 and 1 s ago; the lease is 10 s
    clock.advance(30.0)  # the daemon did not run
    service.resumed(30.0)
    assert [clock() - s.last_seen for s in (idle, recent)] == [15.0 - 2.0, 8.0 - 2.0]
    assert fresh.last_seen == clock(), "never seen later than now"
    assert service.expire_leases() == [idle.client]


def test_short_stalls_that_keep_coming_still_let_a_dead_client_go(make_manager, clock):
    """Stalls of 0.6 s every 2 s (a swap storm, a cgroup's long cpu.max period): each gave every lease
    a heartbeat interval more, 2.6 s of credit for every 2 s, and a client that died where its pid
    cannot be tested (another pid namespace) was never let go (a review). The interval more comes
    once a lease at most; the stalls themselves are still not counted."""
    service = Service(make_manager(hbm_blocks=4), lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock,
                      pid_alive=lambda pid: True)
    reply = service.handle_frames(P.encode_request(Op.ATTACH, 1, None, {"name": "dead", "pid": 1, "layouts": []}))
    assert P.decode_reply(reply).ok
    watch = StallWatch(clock, every_s=0.1)
    for second in range(0, 600, 2):
        for _ in range(14):  # the process runs 1.4 s ...
            clock.advance(0.1)
            watch._note()
            assert not service.expire_leases(behind_s=0.0, longest_call_s=0.0)
        clock.advance(0.6 + 0.1)  # ... then does not run for 0.6 s
        service.resumed(watch.stalled_s())
        if service.expire_leases(behind_s=0.0, longest_call_s=0.0):
            break
    else:
        raise AssertionError("a client silent for 10 minutes with a 10 s lease was never let go")
    # Running 1.4 s of each 2: a 10 s lease, a heartbeat interval more once, lapses after about 16 s.
    assert second <= 20, second


def test_a_stall_counts_against_no_reservations_ttl_but_a_clients_deadline_stands(make_manager, clock):
    """A granted reservation lapsed untaken, and a queued one left the queue, for time the daemon did
    not run, while their clients could not reach it (leases were credited, reservations not). A
    client's own deadline is its time and stands."""
    from reservation_helpers import settings

    from dflash2.errors import ReservationError
    from dflash2.reservations import Outcome

    mgr = make_manager(hbm_blocks=8, admission=settings(reservation_ttl_s=10.0))
    service = Service(mgr, lease_timeout_s=60.0, heartbeat_interval_s=2.0, clock=clock, pid_alive=lambda pid: True)
    a, w = mgr.attach("a"), mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    by_ttl = mgr.reserve(a, lid, tokens=16 * 2)
    by_deadline = mgr.reserve(a, lid, tokens=16 * 2, deadline=clock() + 8.0)
    spent = mgr.reserve(a, lid, tokens=16)
    mgr.take(a, spent.reservation_id, 1)  # every block taken: remembered until it expires
    mgr.allocate(w, lid, 3)  # the tier is full: the next one waits
    queued = mgr.reserve(a, lid, tokens=16 * 2)
    assert [d.outcome for d in (by_ttl, by_deadline, queued)] == [Outcome.GRANTED, Outcome.GRANTED, Outcome.DEFERRED]
    clock.advance(9.0)  # the daemon did not run
    service.resumed(9.0)
    clock.advance(5.0)
    def alive(decision) -> bool:
        try:
            return mgr.admission.status(decision.reservation_id).outcome is not Outcome.REJECTED
        except ReservationError:  # expired
            return False

    assert [alive(d) for d in (by_ttl, by_deadline, queued, spent)] == [True, False, True, True]
    clock.advance(5.5)  # 10 s of the TTL have run while the daemon ran
    assert not alive(by_ttl) and not alive(queued) and not alive(spent)
    mgr.check_invariants()


def test_a_stall_counts_against_no_set_aside(make_manager, clock):
    """A client whose lease lapsed while its process lived keeps its private blocks and pins set aside
    for `set_aside_leases` leases; a daemon stopped meanwhile counted that time against them, and freed
    them (its pins let go) the moment it ran again, though it had run 0.6 s of a 6 s set-aside and the
    process still lived (a review: SIGSTOP the client past its lease, then the daemon for 9 s)."""
    mgr = make_manager(hbm_blocks=8)
    service = Service(mgr, lease_timeout_s=2.0, heartbeat_interval_s=0.5, clock=clock, pid_alive=lambda pid: True,
                      set_aside_leases=3)
    reply = service.handle_frames(P.encode_request(Op.ATTACH, 1, None, {"name": "stopped", "pid": 1, "layouts": []}))
    client = P.decode_reply(reply).result["client"]
    mgr.allocate(client, mgr.register_layout(SMALL), 3)
    clock.advance(2.5)
    assert service.expire_leases(behind_s=0.0, longest_call_s=0.0) == [client]  # lapsed: set aside for 6 s
    assert mgr.stats()["set_aside"]["blocks"] == 3
    clock.advance(0.6)
    service.expire_leases(behind_s=0.0, longest_call_s=0.0)
    clock.advance(9.0)  # the daemon did not run
    service.resumed(9.0)
    service.expire_leases(behind_s=0.0, longest_call_s=0.0)
    assert mgr.stats()["set_aside"]["blocks"] == 3, "the set-aside ended for time the daemon did not run"
    clock.advance(5.5)  # 6.1 s of the set-aside have run while the daemon ran
    service.expire_leases(behind_s=0.0, longest_call_s=0.0)
    assert mgr.stats()["set_aside"]["blocks"] == 0
    mgr.check_invariants()


def test_a_take_queued_during_a_stall_finds_its_reservation_alive(config_file):
    """The stall was credited when leases were next judged, after the calls queued during it were
    answered: a take sent while the daemon was stopped longer than the TTL found its reservation
    expired (a review). Credited before any call is answered now."""
    daemon = DaemonProcess(config_file(admission={"reservation_ttl_s": 2.0},
                                       daemon={"lease_timeout_s": 30.0, "heartbeat_interval_s": 1.0,
                                               "request_timeout_s": 20.0})).start()
    try:
        with Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=20.0) as c:
            res = c.reserve(c.layouts[0], tokens=32)
            assert res.outcome == "granted", res
            got = {}
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                time.sleep(0.3)
                def take():
                    try:
                        got["v"] = c.take(res.reservation_id, 1)
                    except Exception as e:
                        got["e"] = e
                t = threading.Thread(target=take)
                t.start()  # sent while the daemon is stopped: it waits in the socket
                time.sleep(3.0)  # longer than the 2 s TTL: all of it a stall
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            t.join(25)
            assert "e" not in got, f"take after a {3.3:.1f} s stall: {got.get('e')!r}"
    finally:
        daemon.stop()
