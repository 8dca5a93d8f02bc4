"""The daemon's liveness object (dflash2/arena/liveness.py): how a client finds its daemon dead when
no shared-memory segment can tell it (a GPU daemon with HBM alone; here, on a host, the segment test
is switched off), what a clean shutdown and the next daemon leave of it, and what a client does with
an attach reply that names a bad one or one that cannot be opened."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time

import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess, mapped, quick_daemon

from dflash2.arena.liveness import DaemonLiveness, check_name
from dflash2.arena.shm import SharedMemoryArena
from dflash2.client import Client, DaemonUnavailable
from dflash2.client.client import Transport
from dflash2.client.views import ArenaMap
from dflash2.errors import ArenaError, ProtocolError
from dflash2.protocol import Op
from dflash2.tiers import Tier


def alive_path(pid: int) -> str:
    return f"/dev/shm/dflash2-{pid}-alive"


@pytest.fixture
def daemon(config_file, tmp_path):
    yield from quick_daemon(config_file, tmp_path)


@pytest.fixture
def name():
    """A liveness object's name that no daemon has: pids are below 2**22, this one's is 10 digits."""
    made = f"dflash2-{4_000_000_000 + secrets.randbelow(10**9)}-alive"
    yield made
    if os.path.lexists(f"/dev/shm/{made}"):  # a link or a FIFO a test planted
        os.unlink(f"/dev/shm/{made}")


# ---- the daemon ---------------------------------------------------------------------------------------


def test_a_daemon_holds_its_liveness_object_and_removes_it_at_a_clean_shutdown(daemon):
    with open(alive_path(daemon.pid)) as f:
        assert f.read().split()[0] == str(daemon.pid)  # then the start's id
    probe = DaemonLiveness.open(f"dflash2-{daemon.pid}-alive")
    try:
        assert not probe.gone()
        assert daemon.terminate() == 0
        assert not os.path.exists(alive_path(daemon.pid))
        assert probe.gone()
    finally:
        probe.close()


def test_the_next_daemon_removes_a_killed_ones_liveness_object(daemon):
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.proc.wait()
    assert os.path.exists(alive_path(daemon.pid)), "SIGKILL leaves it: the next daemon's to remove"
    second = DaemonProcess(daemon.config_path).start()
    try:
        assert not os.path.exists(alive_path(daemon.pid))
        assert f"removed shared-memory segment dflash2-{daemon.pid}-alive" in second.log()
        assert os.path.exists(alive_path(second.pid))
    finally:
        second.stop()
    assert not os.path.exists(alive_path(second.pid))


# ---- a client -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("finds_it", ["call", "heartbeat"])
def test_a_killed_daemon_is_found_by_its_liveness_object_alone(daemon, monkeypatch, finds_it):
    # As where no segment can tell (a GPU daemon with HBM alone): before, the client learned it only
    # when a restarted daemon answered UnknownClient, and kept the dead daemon's memory mapped.
    monkeypatch.setattr(SharedMemoryArena, "creator_gone", lambda self: False)
    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=finds_it == "heartbeat")
    try:
        names = [a["name"] for a in c.arena_info]
        c.view_bytes(c.allocate(c.layouts[0], 1)[0])[:] = 1
        assert mapped(names) == names and not c._arenas.daemon_gone()
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.proc.wait()
        if finds_it == "call":
            with pytest.raises(DaemonUnavailable):
                c.lookup([1])
        deadline = time.monotonic() + 5.0
        while not c.lease_lost or mapped(names):
            assert time.monotonic() < deadline, (c.lease_lost, mapped(names))
            time.sleep(0.05)
        with pytest.raises(ArenaError):
            c.view_bytes(0)
    finally:
        c.close()


@pytest.mark.parametrize("segments_tell", [True, False])
def test_a_call_waiting_when_the_daemon_is_killed_ends_then_not_at_its_timeout(daemon, monkeypatch, segments_tell):
    # Before, a call in progress waited out its whole timeout (request_timeout_s, 5 s by default)
    # for a daemon that was already gone; the serving process's step stalled that long.
    if not segments_tell:  # as a GPU daemon with HBM alone: the liveness object alone tells
        monkeypatch.setattr(SharedMemoryArena, "creator_gone", lambda self: False)
    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False, timeout_s=60.0)
    names = [a["name"] for a in c.arena_info]
    ended: list = []

    def lookup() -> None:
        start = time.monotonic()
        try:
            c.lookup([1])
        except DaemonUnavailable as e:
            ended.append((time.monotonic() - start, str(e)))

    try:
        os.kill(daemon.pid, signal.SIGSTOP)  # the call is sent and waits: nobody answers
        waiting = threading.Thread(target=lookup)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and not ended
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.proc.wait()
        waiting.join(timeout=30.0)
        assert not waiting.is_alive(), "the call still waits for a daemon that was killed"
        (took, said), = ended
        assert took < 10.0 and "ended while this call waited" in said, (took, said)
        assert c.lease_lost and mapped(names) == [], mapped(names)  # _daemon_gone let its mappings go
    finally:
        c.close()


def test_a_stopped_daemon_is_not_taken_for_a_dead_one(daemon):
    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False, timeout_s=0.5)
    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailable, match="no reply from dflash2d .* within 0.5s"):
                c.lookup([1])
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert not c.lease_lost and not c._arenas_gone()
        assert c.ping()["pid"] == daemon.pid
    finally:
        c.close()


def test_the_call_thread_and_the_heartbeat_thread_finding_the_daemon_gone_at_once(daemon, monkeypatch):
    # soak5: a call and a heartbeat that wait when the daemon is killed both find it gone within
    # GONE_CHECK_S, and both let its mappings go (_daemon_gone): one thread's ArenaMap.close iterated
    # the dict the other emptied, and a client call raised RuntimeError (dictionary changed size during
    # iteration) instead of DaemonUnavailable, or the heartbeat thread died of it.
    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False, timeout_s=60.0)
    names = [a["name"] for a in c.arena_info]
    close = SharedMemoryArena.close

    def slow_close(self):  # the munmap of a large populated segment: the other thread comes in meanwhile
        time.sleep(0.2)
        close(self)

    monkeypatch.setattr(SharedMemoryArena, "close", slow_close)
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.proc.wait()
    found: list = []
    failed: list = []

    def gone() -> None:
        try:
            found.append(c._daemon_gone())
        except Exception as e:  # noqa: BLE001
            failed.append(repr(e))

    both = [threading.Thread(target=gone) for _ in range(2)]
    try:
        for t in both:
            t.start()
            time.sleep(0.05)
        for t in both:
            t.join(timeout=10.0)
        assert failed == [] and found == [True, True], (failed, found)
        assert c.lease_lost and mapped(names) == [], mapped(names)
    finally:
        c.close()


def test_a_call_waiting_when_the_heartbeat_finds_the_daemon_gone_first_ends_then(daemon, monkeypatch):
    # soak5: the heartbeat thread's _daemon_gone let the mappings go first; the waiting call's gone
    # test then asked a closed ArenaMap (no liveness object, no segments: "not gone") and the call
    # waited out its whole timeout (10 of 16 calls in progress at a kill -9 in soak5's kt run).
    from dflash2.client import transport

    monkeypatch.setattr(transport, "GONE_CHECK_S", 0.5)  # the heartbeat's test comes first, surely
    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False, timeout_s=5.0)
    ended: list = []

    def lookup() -> None:
        start = time.monotonic()
        try:
            c.lookup([1])
        except DaemonUnavailable as e:
            ended.append((time.monotonic() - start, str(e)))

    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        waiting = threading.Thread(target=lookup)
        waiting.start()
        time.sleep(0.1)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.proc.wait()
        assert c._daemon_gone()  # as the heartbeat thread does after its own call found the daemon gone
        waiting.join(timeout=30.0)
        (took, said), = ended
        assert took < 2.0 and "ended while this call waited" in said, (took, said)
    finally:
        c.close()


def test_a_liveness_object_that_cannot_be_opened_is_said_and_the_attach_works(daemon, caplog):
    os.unlink(alive_path(daemon.pid))  # someone cleaned /dev/shm under the daemon
    with caplog.at_level(logging.ERROR, logger="dflash2.client"):
        c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False)
    try:
        assert c.ping()["pid"] == daemon.pid
        assert c._arenas.liveness is None
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(alive_path(daemon.pid) in line and "dead-daemon detection is off for this client" in line
                   for line in said), said
    finally:
        c.close()
    assert daemon.terminate() == 0  # its own file already gone: a clean shutdown all the same


@pytest.mark.parametrize("bad", ["/etc/passwd", "../../etc/passwd", "dflash2-1-dram", "dflash2-1-alive/x",
                                 "dflash2--alive", 7, ["dflash2-1-alive"]])
def test_a_reply_naming_a_bad_liveness_object_is_refused(daemon, monkeypatch, bad):
    real = Transport.call

    def bad_reply(self, op, *args, **kwargs):
        reply = real(self, op, *args, **kwargs)
        if op == Op.ATTACH:
            reply.result["liveness"] = bad
        return reply

    monkeypatch.setattr(Transport, "call", bad_reply)
    with pytest.raises(ProtocolError, match="liveness object.*refused"):
        Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False)
    monkeypatch.undo()
    with Client.connect(config=daemon.config_path, name="look", heartbeat=False) as look:
        assert [s["name"] for s in look.stats()["clients"]] == ["look"]  # the refused attach was detached


# ---- the object itself ----------------------------------------------------------------------------------


def test_a_client_sees_the_holder_go(name):
    held = DaemonLiveness.create(name)
    probe = DaemonLiveness.open(name)
    try:
        assert not probe.gone() and not probe.gone()  # the test gives the lock back
        held.close()
        assert not os.path.exists(f"/dev/shm/{name}") and probe.gone()
    finally:
        held.close()
        probe.close()
    assert not probe.gone()  # closed: nothing more to tell


def test_a_file_of_the_same_name_nobody_holds_is_replaced_and_a_held_one_refused(name):
    # A container's daemon is pid 1 every time: its killed predecessor's file has its very name.
    with open(f"/dev/shm/{name}", "w") as f:
        f.write("1\n")
    held = DaemonLiveness.create(name)
    try:
        with pytest.raises(ArenaError, match="a running process holds it"):
            DaemonLiveness.create(name)
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        held.close()


def test_a_link_or_a_fifo_under_that_name_is_not_opened(name, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, f"/dev/shm/{name}")
    with pytest.raises(ArenaError, match="cannot open"):
        DaemonLiveness.open(name)
    os.unlink(f"/dev/shm/{name}")
    os.mkfifo(f"/dev/shm/{name}")
    with pytest.raises(ArenaError, match="not a plain file"):
        DaemonLiveness.open(name)


def test_an_older_daemon_names_none(caplog):
    assert check_name(None) is None
    with caplog.at_level(logging.INFO, logger="dflash2.client"):
        arenas = ArenaMap([], None)
    assert arenas.liveness is None and not arenas.daemon_gone()
    assert any("names no liveness object" in r.getMessage() for r in caplog.records)


# ---- whose memory a client maps ------------------------------------------------------------------------


def test_a_client_refuses_memory_that_is_another_daemons_of_the_same_pid(daemon):
    """Two containers' daemons are pid 1 each, and their segments and liveness objects have the same
    names: a client that saw one's /dev/shm and reached the other over tcp mapped the wrong daemon's
    memory and read and wrote its blocks with no error (a review's script: zeros served as a hit, the
    other daemon's cached blocks overwritten). The daemon's attach reply carries its liveness
    object's random id; a client that finds another id there refuses to attach."""
    with Client.connect(daemon.endpoint, name="ours", layouts=[SMALL], heartbeat=False) as c:
        assert c.allocate(c.layouts[0], 1) is not None  # the id matches: attached as before
    path = alive_path(daemon.pid)
    with open(path) as f:
        pid, nonce = f.read().split()
    assert pid == str(daemon.pid) and len(nonce) == 16
    with open(path, "r+") as f:  # as another daemon of that pid would have written it
        f.write(f"{pid} {'0' * 16}\n")
    try:
        with pytest.raises(ArenaError, match="is not dflash2d at .*'s: it is another daemon's of the same pid"):
            Client.connect(daemon.endpoint, name="elsewhere", layouts=[SMALL], heartbeat=False)
        # Refused before any call: nothing of this client stays attached.
        t = Transport(daemon.endpoint)
        try:
            assert [c["name"] for c in t.call(Op.STATS).result["clients"]] == []
        finally:
            t.close()
    finally:
        with open(path, "r+") as f:
            f.write(f"{pid} {nonce}\n")


def test_a_liveness_object_carries_its_starts_id(name):
    alive = DaemonLiveness.create(name)
    try:
        seen = DaemonLiveness.open(name)
        assert alive.nonce and seen.matches(alive.nonce) and not seen.matches("0" * 16)
        seen.close()
        with pytest.raises(ProtocolError, match="liveness id"):
            ArenaMap([], name, liveness_id="../x")
    finally:
        alive.close()


def test_a_client_that_cannot_see_the_segments_is_told_why(tmp_path):
    with pytest.raises(ArenaError, match="dflash2d at X answered, but shared-memory segment .* does not exist.*"
                                         "a client must see the daemon's /dev/shm"):
        ArenaMap([{"tier": "dram", "kind": "shm", "name": f"dflash2-{4_100_000_000}-dram", "capacity_bytes": 4096}],
                 endpoint="dflash2d at X")


def test_a_segment_of_another_size_than_the_daemons_tier_is_refused(name):
    """With no liveness object to check (cleaned away, or a daemon from before it), a segment of
    another daemon under the same name was mapped: its size against the tier's says so."""
    seg = f"{name[:-len('-alive')]}-dram"
    made = SharedMemoryArena.create(seg, 16 * 4096, Tier.DRAM, alignment=4096)
    try:
        with pytest.raises(ArenaError, match=f"segment /dev/shm/{seg} this process sees holds 65536 bytes, and "
                                             "dflash2d at X's dram tier 131072: it is another daemon's"):
            ArenaMap([{"tier": "dram", "kind": "shm", "name": seg, "capacity_bytes": 32 * 4096}], endpoint="dflash2d at X")
        ArenaMap([{"tier": "dram", "kind": "shm", "name": seg, "capacity_bytes": 16 * 4096}]).close()
    finally:
        made.close()


def test_a_segment_that_cannot_be_opened_is_not_blamed_on_dev_shm(name, tmp_path):
    seg = f"{name[:-len('-alive')]}-dram"
    os.mkdir(f"/dev/shm/{seg}")  # opens with EISDIR: not a missing segment
    try:
        with pytest.raises(ArenaError) as info:
            ArenaMap([{"tier": "dram", "kind": "shm", "name": seg, "capacity_bytes": 4096}], endpoint="dflash2d at X")
        assert "cannot be opened" in str(info.value) and "must see the daemon's /dev/shm" not in str(info.value)
    finally:
        os.rmdir(f"/dev/shm/{seg}")


@pytest.mark.parametrize("heartbeat", [False, True])
def test_no_new_view_of_a_killed_daemons_memory(config_file, tmp_path, heartbeat):
    """A review: a new view of a block of a daemon killed (and restarted) since was handed out until the
    client's next call or heartbeat (a whole lease without one), over the segment the restarted daemon
    had removed: what the engine wrote there was lost without a word. A view asks whether the daemon
    lives (every 50 ms at most)."""
    d = DaemonProcess(config_file(memory={"nvme_capacity_mb": 0},
                                  daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    c = Client.connect(d.endpoint, name="engine", layouts=[SMALL], heartbeat=heartbeat)
    try:
        p = c.allocate(c.layouts[0], 1)
        c.view_bytes(p[0])[:] = 7
        (vid,) = c.commit(p["vid"], keys=[11])
        assert c.acquire([vid]) is not None
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait()
        d.start()  # the next daemon serves the endpoint (and has removed the killed one's segments)
        time.sleep(0.06)
        with pytest.raises(ArenaError, match="that this client attached to has ended"):
            c.view_bytes(vid)
    finally:
        c.close()
        d.stop()


IN_HELD = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from conftest import SMALL
from dflash2.client import Client, held
from dflash2.errors import DFlash2Error
handled = sys.argv[3]
c = Client.connect(sys.argv[1], name="sig", layouts=[SMALL], heartbeat=False, timeout_s=2.0)
mine, out = c.allocate(c.layouts[0], 1), []
def handler(signum, frame):
    try:
        out.append(c.view_bytes(mine[0]).nbytes if handled == "view" else
                   len(c.allocate(c.layouts[0], 1)) if handled == "allocate" else c.free(mine["vid"]))
    except DFlash2Error as e:
        out.append(repr(e))
signal.signal(signal.SIGUSR1, handler)
real, armed = held.HeldPlaces._remember, [True]
def remember(self, places):
    if armed[0]:
        armed[0] = False
        os.kill(os.getpid(), signal.SIGUSR1)  # (lands inside HeldPlaces.writing, its lock held)
    return real(self, places)
held.HeldPlaces._remember = remember
c.allocate(c.layouts[0], 1)
print("done", out, flush=True)
c.close()
"""

IN_A_TEST = """
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
from conftest import SMALL
from dflash2.client import Client
from dflash2.errors import DFlash2Error
import dflash2.arena.liveness as liveness
main, handled, daemon_pid = sys.argv[3], sys.argv[4], int(sys.argv[5])
c = Client.connect(sys.argv[1], name="sig", layouts=[SMALL], heartbeat=False, timeout_s=2.0)
mine, out = c.allocate(c.layouts[0], 1), []
def stop_a_while():  # (a daemon that answers late: a call waits for it, testing every 50 ms whether it lives)
    os.kill(daemon_pid, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (daemon_pid, signal.SIGCONT)).start()
def handler(signum, frame):
    try:
        out.append(c.view_bytes(mine[0]).nbytes if handled == "view" else c.close() if handled == "close"
                   else sorted(c.stats())[:1])
    except DFlash2Error as e:
        out.append(repr(e))
signal.signal(signal.SIGUSR1, handler)
real, armed = liveness.nobody_holds, [False]
def nobody_holds(fd):
    held = real(fd)
    if armed[0] and threading.current_thread() is threading.main_thread():
        armed[0] = False
        if handled == "call":
            stop_a_while()
        os.kill(os.getpid(), signal.SIGUSR1)  # (lands inside ArenaMap.daemon_gone, its locks held)
    return held
liveness.nobody_holds = nobody_holds
if main == "call":
    stop_a_while()
time.sleep(0.1)  # (the last view's test of the daemon is more than 50 ms old)
armed[0] = True
try:
    c.stats() if main == "call" else c.view_bytes(mine[0])
except DFlash2Error as e:
    out.append(repr(e))
print("done", out, flush=True)
c.close()
"""


@pytest.mark.parametrize("main, handled", [("call", "view"), ("view", "close"), ("view", "call"), ("write", "view"),
                                           ("write", "allocate"), ("write", "free")])
def test_a_signal_handler_does_not_wait_for_a_lock_its_own_thread_holds(daemon, main, handled):
    """Reviews: a handler's view landing while the same thread's call tested whether the stopped daemon
    lived, a handler's view or call landing while it recorded a reply's places, and a handler's close()
    or call landing in a view's test of the daemon, waited for the lock their own thread held (the arena
    map's, HeldPlaces'), for good. A view's test does not wait, a view reads places without the lock,
    HeldPlaces' lock is reentrant, and a test or close() within the same thread's test is skipped or run
    after it."""
    script, extra = (IN_HELD, [handled]) if main == "write" else (IN_A_TEST, [main, handled, str(daemon.pid)])
    out = _child(daemon, script, *extra, what=f"the handler's {handled} within a {main}")
    if handled == "view" and main == "call":
        assert f"done [{SMALL.block_bytes}]" in out, out
    if handled == "close":  # (its detach ran: the view is refused, the client's block let go)
        assert "detached" in out and "'freed': 1" in out, out
    if main == "write" and handled != "view":  # (the handler's call ran whole: its block, or the free of one)
        assert "done [1]" in out, out


CLOSE_IN_CLOSE = """
import logging, os, signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
from conftest import SMALL
from dflash2.client import Client
how, heartbeat, where = sys.argv[3], sys.argv[4] == "on", sys.argv[5]
said = []
class Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("dflash2").addHandler(Said())
class Deadline(Exception):
    pass
def handler(signum, frame):
    if how == "raise":
        raise Deadline()
    released.append(clients[-1].close())
signal.signal(signal.SIGUSR1, handler)
clients, released, bad = [], [], []
for k in range(40):  # the signal at the k-th event (a call, a C call, a return) within close()'s StopEvent.set()
    # (or, `where` join, within its join of the heartbeat thread)
    said.clear()
    released.clear()
    c = Client.connect(sys.argv[1], name="sig", layouts=[SMALL], heartbeat=heartbeat, timeout_s=1.5)
    clients.append(c)
    c.allocate(c.layouts[0], 1)
    beat = c._heartbeat_thread
    time.sleep(0.05)  # (the heartbeat waiting on the stop signal)
    seen, code = [-1], (type(c._stop).set if where == "set" else threading.Thread.join).__code__
    def prof(frame, event, arg):
        if seen[0] < 0 and not (event == "call" and frame.f_code is code):
            return
        seen[0] += 1
        if seen[0] == k or (event == "return" and frame.f_code is code):  # (its last event: set() returns)
            sys.setprofile(None)
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGUSR1)
    t = time.monotonic()
    sys.setprofile(prof)
    try:
        released.append(c.close())
    except Deadline:
        pass
    finally:
        sys.setprofile(None)
    first = time.monotonic() - t
    if seen[0] < k:  # (set() made fewer events)
        break
    t = time.monotonic()
    released.append(c.close())
    again = time.monotonic() - t
    if beat is not None:
        beat.join(0.5)
    fine = (first < 1.0 and again < 1.0 and not any("lease lost" in m for m in said) and c._stop.is_set()
            and not (beat is not None and beat.is_alive()) and [r.get("freed") for r in released if r] == [1])
    print(f"event {k}: close {first:.2f}s, again {again:.2f}s, heartbeat alive {beat is not None and beat.is_alive()},"
          f" released {released}, said {said}", flush=True)
    if not fine:
        bad.append(k)
print(f"events tried: {k}; bad: {bad}", flush=True)
print("done", flush=True)
"""


@pytest.mark.parametrize("heartbeat, where", [("off", "set"), ("on", "set"), ("on", "join")])
@pytest.mark.parametrize("how", ["close", "raise"])
def test_a_close_within_a_close_or_after_one_cut_off_does_not_hang(daemon, how, heartbeat, where):
    """Reviews: a signal handler's close() landing as this thread's close() set the heartbeat's stop
    Event waited for the Event's lock that set() held, for good; an exception landing there left the lock
    held, so that the heartbeat blocked for good and every later close() waited its whole timeout joining
    it; and with the lock reentrant, the handler's close got through but the heartbeat, woken, could not
    take the lock back from the set() the handler interrupted: the handler's close joined it its whole
    timeout, and the heartbeat beat once more after the detach and said the lease was lost. The stop
    signal holds no lock (stopevent.py): wherever within set() the signal lands, each close is quick, the
    heartbeat ends and says nothing, and the client's block is let go. So within close()'s join of the
    heartbeat thread, whose end lock the interrupted join held: the handler's close waited its whole
    timeout there, the lease lapsing meanwhile (a review); it leaves the detach to the close it
    interrupted (StopEvent.join)."""
    out = _child(daemon, CLOSE_IN_CLOSE, how, heartbeat, where,
                 what=f"a {how} within a close's {where} (heartbeat {heartbeat})")
    assert "events tried: " in out and "; bad: []" in out, out
    assert int(out.split("events tried: ")[1].split(";")[0]) >= 3, out  # (the signal landed within set())


CUT_AT_SET = """
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
from conftest import SMALL
from dflash2.client import Client
how = sys.argv[3]
c = Client.connect(sys.argv[1], name="sig", layouts=[SMALL], heartbeat=True, timeout_s=3.0)
c.allocate(c.layouts[0], 1)
beat = c._heartbeat_thread
class Deadline(Exception):
    pass
if how == "patch":  # (an exception landing at Event.set's first bytecode: its flag not set, its lock free)
    real, armed = c._stop.set, [True]
    def cut_set():
        if armed[0]:
            armed[0] = False
            raise Deadline()
        real()
    c._stop.set = cut_set
else:  # a real signal, sent as Event.set is entered
    def handler(signum, frame):
        raise Deadline()
    signal.signal(signal.SIGUSR1, handler)
    def prof(frame, event, arg):
        if event == "call" and frame.f_code is type(c._stop).set.__code__:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGUSR1)
    sys.setprofile(prof)
try:
    c.close()
except Deadline:
    print("cut off; the Event set:", c._stop.is_set(), flush=True)
finally:
    sys.setprofile(None)
t = time.monotonic()
print("close:", c.close(), flush=True)
print(f"the second close took {time.monotonic() - t:.2f}s; the heartbeat alive after it: {beat.is_alive()}", flush=True)
print("done", flush=True)
"""


@pytest.mark.parametrize("how", ["patch", "signal"])
def test_a_close_after_one_cut_off_before_the_stop_flag_stops_the_heartbeat(daemon, how):
    """A review: a close() cut off as it began to set the heartbeat's stop Event, before the Event's flag
    was set, left it unset for good (the Event was set once only): every later close() waited its whole
    timeout joining a heartbeat never told to stop, detached, and the heartbeat then said the lease was
    lost. Each close sets the Event until it is set."""
    out = _child(daemon, CUT_AT_SET, how, what=f"the close after one cut off ({how})")
    assert "cut off; the Event set: False" in out and "'freed': 1" in out, out
    assert "the heartbeat alive after it: False" in out and "lease lost" not in out, out
    assert float(out.split("the second close took ")[1].split("s;")[0]) < 2.0, out  # (not its 3 s timeout)


def test_a_forked_childs_close_leaves_the_parents_heartbeat_and_a_close_lets_its_pipe_go(daemon):
    """The stop signal's pipe is shared across fork: a child's close() (or set()) must not write to it,
    or the byte would wake every wait of the parent's heartbeat, its flag unset: a beat without pause. The parent's close lets the pipe's two
    descriptors go once the heartbeat has ended (a process opening clients one after another ran out)."""
    def pipes() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")}

    before = pipes()
    c = Client.connect(daemon.endpoint, name="fork", layouts=[SMALL], heartbeat=True, timeout_s=2.0)
    beat, ours = c._heartbeat_thread, pipes() - before
    assert len(ours) == 1  # (its two ends)
    pid = os.fork()
    if pid == 0:  # the child: closes the parent's client, then sets its stop signal outright
        try:
            c.close()
            c._stop.set()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    t = time.monotonic()
    assert not c._stop.wait(0.3) and beat.is_alive()
    assert time.monotonic() - t >= 0.25  # (a byte the child wrote woke every wait: a beat sent without pause)
    assert c.close()["freed"] == 0 and not beat.is_alive()
    assert not pipes() & ours


def _child(daemon, script: str, *args: str, what: str) -> str:
    """`script` run in a child process against `daemon` (a hang fails the test, never hangs it); its output,
    once it has ended well."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", script, daemon.endpoint, os.path.dirname(__file__), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = child.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"{what} hung")
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert child.returncode == 0 and "done" in out, out
    return out




def test_a_set_under_way_on_another_thread_neither_silences_a_set_nor_loses_the_pipe():
    """Reviews: one thread's close() let the pipe's descriptors go while another thread's set() had read
    the write end, whose byte then went into a file that reused the number; and a guard against that
    made a set() write nothing while another set() held it, the heartbeat woken only by its interval.
    The pipe goes only with the last reference to it (a set() under way holds one), and every set()
    writes. Thread B is held in set() where it compares the pid, its flag set, its byte not written."""
    import gc
    import time as _time

    from dflash2.client.stopevent import StopEvent

    stop = StopEvent()
    there, go, woke = threading.Event(), threading.Event(), []

    class WaitingPid(int):
        def __eq__(self, other):
            there.set()
            go.wait(10)
            return int.__eq__(self, other)
        __hash__ = int.__hash__
    waiter = threading.Thread(target=lambda s=stop: (s.wait(5), woke.append(_time.monotonic())))
    waiter.start()
    _time.sleep(0.1)  # (the waiter polling the pipe)
    stop._pid = WaitingPid(os.getpid())
    b = threading.Thread(target=stop.set)
    b.start()
    assert there.wait(10)
    stop._pid = os.getpid()  # (this thread's set() is not held)
    began = _time.monotonic()
    stop.set()  # writes its byte, B's under way: the waiter wakes now, not after its 5 s
    waiter.join(10)
    assert woke and woke[0] - began < 2.0, woke
    import weakref

    r, w, ref = stop._r, stop._w, weakref.ref(stop)
    del stop, waiter
    gc.collect()
    assert ref() is not None  # (B's set() under way still refers to it: the pipe is open)
    os.fstat(r), os.fstat(w)
    go.set()
    b.join(10)
    del b
    gc.collect()
    assert ref() is None  # the last reference gone: the pipe with it (__del__)
