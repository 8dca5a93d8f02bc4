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
