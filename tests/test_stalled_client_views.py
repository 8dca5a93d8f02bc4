"""A serving process stopped (SIGSTOP: a GC pause, a swap storm, a frozen cgroup) past its lease and
the daemon's set-aside time, then resumed: the daemon has let its blocks and pins go and given their
slots to other blocks. A new view it asks for then is refused (ArenaError naming the lapsed lease),
though its heartbeat thread has not run since the stop to hear of the lapse: the client asks the
daemon before a view once no call of its was answered for a whole lease. Before, the library handed
out the view: a resumed writer wrote into another client's cached block (read as a hit with the
wrong bytes), a resumed reader read another block's bytes (a review's repros). Views taken before
the stall stay unprotected, as the README says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.errors import ArenaError
from dflash2.keys import chain_keys

LEASE = {"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.2, "set_aside_leases": 1}
# A daemon stall within the set-aside window, wide enough for a loaded machine: only within it does the
# client vouch for its lease (Awake.vouches).
STALL = {**LEASE, "set_aside_leases": 5}

# A child that takes one block (written, or a cached one acquired), stops itself, and once resumed
# asks for a new view of it and writes through it.
CHILD = """
    import json, os, signal, sys
    from dflash2.client import Client
    from dflash2.layout import Layout
    ep, lay, keys = sys.argv[1], Layout.from_dict(json.loads(sys.argv[2])), json.loads(sys.argv[3])
    c = Client.connect(ep, name="stalled", layouts=[lay])
    if keys:
        mine = c.acquire(c.lookup(keys)["vid"])
    else:
        mine = c.allocate(c.layouts[0], 1)
        c.view_bytes(mine[0])[:] = 0x33
    print(json.dumps({"first": int(c.view_bytes(mine[0])[0])}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    try:
        view = c.view_bytes(mine[0])
        out = {"view": sorted(set(view.tolist()))}
        view[:] = 0x99
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
"""


def _stalled_child(endpoint: str, keys: list) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), endpoint, json.dumps(SMALL.to_dict()),
                              json.dumps(keys)], stdout=subprocess.PIPE, text=True)
    json.loads(child.stdout.readline())
    deadline = time.monotonic() + 10
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the child did not stop itself"
        time.sleep(0.01)
    return child


def _until_let_go(other: Client) -> dict:
    """Past the stalled child's lease and the set-aside time: its blocks and pins are let go."""
    deadline = time.monotonic() + 15
    while True:
        st = other.stats()
        if [c["name"] for c in st["clients"]] == ["other"] and st["set_aside"]["clients"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.05)


def _daemon(config_file, tmp_path, lease: dict = LEASE) -> DaemonProcess:
    return DaemonProcess(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 4, "nvme_capacity_mb": 0},
                                     daemon={"endpoint": f"ipc://{tmp_path}/d.sock", **lease})).start()


def _others_in_every_slot(other: Client, st: dict):
    """`other` writes and publishes a block in every HBM slot (the lapsed client's old one among
    them): its vids, to check with `_others_intact`."""
    n = st["tiers"]["hbm"]["capacity_bytes"] // SMALL.block_bytes
    places = other.allocate(other.layouts[0], n)
    for p in places:
        other.view_bytes(p)[:] = 0x22
    return other.commit(places["vid"], keys=chain_keys(range(16 * n), 16, "others"))


def _others_intact(other: Client, vids) -> None:
    pinned = other.acquire(vids)
    assert all((other.view_bytes(p) == 0x22).all() for p in pinned)
    other.release(vids)


def _until_a_beat_is_answered(c: Client) -> None:
    deadline = time.monotonic() + 10
    while c._awake.heard < 0:
        assert time.monotonic() < deadline, "no heartbeat was answered"
        time.sleep(0.02)


def _refused_and_others_intact(lapsed: Client, mine, other: Client, vids) -> None:
    """A new view of the lapsed client's block is refused, naming the lapse, and the other client's
    cached blocks (`_others_in_every_slot`) keep their bytes."""
    with pytest.raises(ArenaError, match="lease lapsed"):
        lapsed.view_bytes(mine[0])[:] = 0x99
    _others_intact(other, vids)


def _stop(d: DaemonProcess, *clients) -> None:
    for c in clients:
        if c is not None:
            c.close()
    d.stop()


def _view_while_stopped(d: DaemonProcess, c: Client, mine, stopped_s: float) -> float:
    """With the daemon stopped for `stopped_s`, a new view of `mine[0]` written 0x44: how long it took."""
    os.kill(d.pid, signal.SIGSTOP)
    try:
        time.sleep(stopped_s)
        began = time.monotonic()
        c.view_bytes(mine[0])[:] = 0x44
        return time.monotonic() - began
    finally:
        os.kill(d.pid, signal.SIGCONT)


def _run(config_file, tmp_path, reader: bool) -> dict:
    d = _daemon(config_file, tmp_path)
    other = child = None
    try:
        other = Client.connect(d.endpoint, name="other", layouts=[SMALL])
        lid = other.layouts[0]
        keys = []
        if reader:  # a cached block for the child to pin
            keys = chain_keys(range(16), 16, "stalled-reader")
            place = other.allocate(lid, 1)
            other.view_bytes(place[0])[:] = 0x11
            other.free(other.commit(place["vid"], keys=keys))
        child = _stalled_child(d.endpoint, keys)
        st = _until_let_go(other)
        n = st["tiers"]["hbm"]["capacity_bytes"] // SMALL.block_bytes
        cached = chain_keys(range(16 * n), 16, "stalled-others")
        places = other.allocate(lid, n)  # every HBM slot, the child's old one among them
        for p in places:
            other.view_bytes(p)[:] = 0x22
        vids = other.commit(places["vid"], keys=cached)
        os.kill(child.pid, signal.SIGCONT)
        out = json.loads(child.stdout.readline())
        child.wait(timeout=20)
        found = other.lookup(cached)
        pinned = other.acquire(found["vid"])
        out["wrong"] = [i for i, p in enumerate(pinned) if not (other.view_bytes(p) == 0x22).all()]
        other.release(found["vid"])
        other.free(vids)
        return out
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        if other is not None:
            other.close()
        d.stop()


def test_a_resumed_writer_gets_no_view_of_a_slot_given_to_a_cached_block(config_file, tmp_path):
    out = _run(config_file, tmp_path, reader=False)
    assert not out["wrong"], f"cached blocks {out['wrong']} hold the resumed writer's bytes ({out})"
    assert "lease" in out.get("error", ""), out


def test_a_resumed_reader_gets_no_view_of_a_slot_given_away(config_file, tmp_path):
    out = _run(config_file, tmp_path, reader=True)
    assert "lease" in out.get("error", ""), f"the resumed reader was given a view: {out}"
    assert not out["wrong"], out


@pytest.mark.parametrize("asks", ["stats", "ping", "nothing"])
def test_a_call_the_daemon_answers_without_a_lease_renews_none(config_file, tmp_path, asks):
    """`ping`, `stats`, `check` and `history` are answered whether or not the daemon knows the
    client: counted as renewals, a stats() after the lapse disarmed the check and the view wrote into
    another client's cached block (a review)."""
    d = _daemon(config_file, tmp_path)
    other = lapsed = None
    try:
        other = Client.connect(d.endpoint, name="other", layouts=[SMALL])
        lapsed = Client.connect(d.endpoint, name="lapsed", layouts=[SMALL], heartbeat=False)
        mine = lapsed.allocate(lapsed.layouts[0], 1)
        lapsed.view_bytes(mine[0])[:] = 0x33
        st = _until_let_go(other)
        vids = _others_in_every_slot(other, st)
        if asks != "nothing":
            getattr(lapsed, asks)()
        _refused_and_others_intact(lapsed, mine, other, vids)
    finally:
        _stop(d, lapsed, other)


def test_a_view_of_a_held_block_while_the_daemon_stalls_is_handed_out_at_once(config_file, tmp_path):
    """The daemon (not the client) stalls past a lease: it counts its stall out of every lease
    (Service.resumed), so the client keeps its blocks, and its heartbeat thread ran all along. Before,
    the check asked the stalled daemon before every view of a block the client held: each view waited
    the call's whole timeout and was then refused (a review)."""
    d = _daemon(config_file, tmp_path, STALL)
    c = None
    try:
        c = Client.connect(d.endpoint, name="writer", layouts=[SMALL], timeout_s=1.0)
        mine = c.allocate(c.layouts[0], 1)
        c.view_bytes(mine[0])[:] = 0x33
        _until_a_beat_is_answered(c)  # (the heartbeat's socket is heard: Awake vouches only then)
        took = _view_while_stopped(d, c, mine, 1.3)  # past one lease, the heartbeats unanswered
        assert took < 0.5, f"the view waited {took:.2f}s for the stalled daemon"
        c.ping()
        assert "writer" in [x["name"] for x in c.stats()["clients"]] and not c.lease_lost
        assert (c.view_bytes(mine[0]) == 0x44).all()
    finally:
        _stop(d, c)


def test_the_heartbeat_threads_gap_marks_a_stopped_process(monkeypatch):
    """Awake: a run of marks with no gap of more than a lease, with a beat answered in it, vouches for
    the time since its start; a longer gap (the process stopped) starts a new run, a thread that
    stopped marking vouches for nothing once a lease has passed, and nor does a run of beats only ever
    waited on (never answered: a heartbeat socket that never connected, a review)."""
    from dflash2.client import heartbeat
    now = [100.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: now[0])
    awake = heartbeat.Awake(lease_s=1.0)
    for _ in range(10):  # a beat every 0.5 s, waited on: 5 s, one run, none answered
        now[0] += 0.5
        awake.mark()
    assert not awake.ran_since(100.0)
    awake.mark(answered=True)
    assert awake.ran_since(100.0) and awake.ran_since(104.0)
    now[0] += 3.0  # the process stopped 3 s: the thread did not mark
    assert not awake.ran_since(100.0)
    awake.mark(answered=True)  # resumed: the thread marks first, then the view asks
    assert not awake.ran_since(105.0) and awake.ran_since(now[0])


def test_a_view_after_heartbeats_that_never_reached_the_daemon_asks_it(config_file, tmp_path, monkeypatch):
    """The heartbeat thread runs all along but its beats cannot be sent (no socket: a serving process
    at its descriptor limit): the daemon, not stalled, lets the lease lapse and gives the slot away.
    Marked at each pass of its loop, the thread vouched for the lease, and the view wrote into
    another client's cached block (a review). Only beats sent (waiting, or answered) vouch."""
    from dflash2.client import transport as T
    from dflash2.errors import DaemonUnavailable
    import threading
    d = _daemon(config_file, tmp_path)
    other = c = None
    try:
        other = Client.connect(d.endpoint, name="other", layouts=[SMALL])
        c = Client.connect(d.endpoint, name="starved", layouts=[SMALL])
        mine = c.allocate(c.layouts[0], 1)
        c.view_bytes(mine[0])[:] = 0x33
        real_call = T.Transport.call

        def call(self, op, *a, **k):  # the heartbeat thread's socket cannot be made
            if threading.current_thread().name == f"dflash2-heartbeat-{c.client_id}":
                raise DaemonUnavailable(f"{op.value}: cannot make a socket for {self.endpoint}: Too many open files")
            return real_call(self, op, *a, **k)
        monkeypatch.setattr(T.Transport, "call", call)
        st = _until_let_go(other)
        vids = _others_in_every_slot(other, st)
        _refused_and_others_intact(c, mine, other, vids)
    finally:
        _stop(d, c, other)


@pytest.mark.parametrize("between", ["at", "since"])
def test_the_first_mark_after_a_stop_never_lets_a_check_vouch_across_it(between):
    """`ran_since` read `since`, then `at`: the heartbeat thread's first mark after a resume, run
    between the two reads, paired the old `since` with the new `at` and vouched for a renewal before
    the stop (a review). Forced here: the mark runs just after the check reads either attribute."""
    import threading
    from dflash2.client.heartbeat import Awake

    class Switching(Awake):
        armed = False

        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            if name == between and object.__getattribute__(self, "armed"):
                object.__setattr__(self, "armed", False)
                t = threading.Thread(target=self.mark)  # the heartbeat thread resumes and marks
                t.start()
                t.join()
            return value

    awake = Switching(1.0)
    now = time.monotonic()
    awake.since, awake.at, awake.heard = now - 10, now - 3.0, now - 3.0  # ran until 3 s ago, stopped since
    renewed = now - 5.0
    assert not awake.ran_since(renewed)  # before the mark
    awake.armed = True
    assert not awake.ran_since(renewed)  # with the mark between its reads
    assert not awake.ran_since(renewed)  # after it


@pytest.mark.parametrize("daemon_slow", [False, True])
def test_beats_sent_that_never_reach_the_daemon_vouch_for_no_lease(config_file, tmp_path, monkeypatch, daemon_slow):
    """The heartbeat socket connects to an endpoint nobody serves (a connection that never completes:
    a tcp path lost for it): its beats are sent and wait, marked every 50 ms, and vouched for the
    lease the daemon let lapse; the view wrote into another client's cached block (a review), and
    after the quick ask, where the daemon was slow for 0.5 s then (another). A run vouches only with
    a beat answered in it."""
    import threading
    import dflash2.client.heartbeat as hb
    real = hb.Transport
    monkeypatch.setattr(hb, "Transport", lambda ep, *a, **kw: real(f"ipc://{tmp_path}/nowhere.sock", *a, **kw))
    d = _daemon(config_file, tmp_path)
    other = unheard = None
    try:
        unheard = Client.connect(d.endpoint, name="unheard", layouts=[SMALL])
        monkeypatch.setattr(hb, "Transport", real)
        other = Client.connect(d.endpoint, name="other", layouts=[SMALL])
        mine = unheard.allocate(unheard.layouts[0], 1)
        unheard.view_bytes(mine[0])[:] = 0x33
        st = _until_let_go(other)
        vids = _others_in_every_slot(other, st)
        assert not unheard._awake.ran_since(unheard._renewed)  # (beats waited on, none answered)
        if daemon_slow:
            os.kill(d.pid, signal.SIGSTOP)
            threading.Timer(0.5, os.kill, (d.pid, signal.SIGCONT)).start()
        _refused_and_others_intact(unheard, mine, other, vids)
    finally:
        _stop(d, unheard, other)


def test_a_heartbeat_interval_just_under_the_lease_still_vouches_through_a_daemon_stall(config_file, tmp_path):
    """An interval of 0.97 s against a lease of 1 s: a waiting beat's first mark comes one
    GONE_CHECK_S (50 ms) after its send, so every gap went past the lease and a view during a daemon
    stall waited the call's timeout, then was refused (a review). Awake.SLACK_S covers that slice."""
    lease = {**STALL, "heartbeat_interval_s": 0.97}
    d = _daemon(config_file, tmp_path, lease)
    c = None
    try:
        c = Client.connect(d.endpoint, name="writer", layouts=[SMALL], timeout_s=1.5)
        mine = c.allocate(c.layouts[0], 1)
        _until_a_beat_is_answered(c)
        took = _view_while_stopped(d, c, mine, 2.3)  # past two leases, the beats unanswered
        assert took < 0.5, f"the view waited {took:.2f}s for the stalled daemon"
        c.ping()
        assert not c.lease_lost
    finally:
        _stop(d, c)


@pytest.mark.parametrize("set_aside_leases", [1, 0])
def test_beats_lost_after_one_was_answered_vouch_for_no_lapsed_lease(config_file, tmp_path, monkeypatch,
                                                                    set_aside_leases):
    """The heartbeat's path is lost after a beat was answered, while the daemon runs (its call socket
    works): the beats wait, marked every 50 ms, and the run that had one answered went on vouching for a
    lease the daemon let lapse, set aside, then let go; with the daemon slow for 0.5 s at the view's quick
    ask, the view wrote into another client's cached block (a review). A run vouches only within the
    window the daemon keeps the slots (the lease and its set-aside; none where that is 0)."""
    import threading
    import dflash2.client.heartbeat as hb
    real, lost = hb.Transport, threading.Event()
    nowhere = f"ipc://{tmp_path}/nowhere.sock"

    class LosesItsPath(real):
        def call(self, op, *a, **kw):
            if lost.is_set() and self._connect_to != nowhere:
                self._connect_to = nowhere  # the path to the daemon is lost (made again at the next send)
                self.reset()
            return super().call(op, *a, **kw)

    monkeypatch.setattr(hb, "Transport", LosesItsPath)
    d = _daemon(config_file, tmp_path, {**LEASE, "set_aside_leases": set_aside_leases})
    other = c = None
    try:
        c = Client.connect(d.endpoint, name="unheard-later", layouts=[SMALL])
        monkeypatch.setattr(hb, "Transport", real)
        other = Client.connect(d.endpoint, name="other", layouts=[SMALL])
        mine = c.allocate(c.layouts[0], 1)
        c.view_bytes(mine[0])[:] = 0x33
        _until_a_beat_is_answered(c)
        lost.set()
        st = _until_let_go(other)  # the daemon ran all along: no stall credited, the lease lapsed
        vids = _others_in_every_slot(other, st)
        assert c._awake.ran_since(c._renewed)  # (the run goes on: only the window stops it vouching)
        os.kill(d.pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (d.pid, signal.SIGCONT)).start()
        _refused_and_others_intact(c, mine, other, vids)
    finally:
        _stop(d, c, other)


@pytest.mark.parametrize("set_aside_s, silent_s, vouched", [(0.0, 1.05, False), (1.0, 1.05, True),
                                                            (1.0, 1.75, False)])
def test_a_run_vouches_only_within_the_daemons_set_aside(monkeypatch, set_aside_s, silent_s, vouched):
    """A process stopped just past its lease (by less than Awake.SLACK_S) found its run unbroken, and
    vouched: with `set_aside_leases` 0 the daemon had freed its blocks at the lapse, and a view slow to be
    answered was handed out over another block (a review). Now the check waits for the daemon's word
    (the call's whole timeout, ArenaError without it) unless the view is handed out (after ASK_S) with
    SLACK_S to spare before the lease and its set-aside end."""
    from dflash2.client import heartbeat
    from dflash2.errors import DaemonUnavailable
    now = [100.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: now[0])
    awake = heartbeat.Awake(lease_s=1.0)
    awake.set_aside_s = set_aside_s  # (as the attach reply says)
    for _ in range(5):  # a beat every 0.2 s, each answered
        now[0] += 0.2
        awake.mark(answered=True)
    c = Client.__new__(Client)  # (the check alone: no daemon)
    c._awake, c._renewed, c.lease_timeout_s, c.lease_lost = awake, now[0], 1.0, False
    asked = []

    def call(op, *a, timeout_s=None, **kw):  # the daemon does not answer in time
        asked.append(timeout_s)
        raise DaemonUnavailable(f"{op.value}: no answer")
    c._call = call
    now[0] += silent_s  # the process stopped: the thread did not mark
    assert awake.ran_since(c._renewed) == (silent_s <= 1.0 + heartbeat.Awake.SLACK_S)
    if vouched:
        c._confirm_lease()
        assert asked == [heartbeat.Awake.ASK_S]
    else:
        with pytest.raises(ArenaError, match="does not answer now"):
            c._confirm_lease()
        assert asked == [None]  # the call's whole timeout
