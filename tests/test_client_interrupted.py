"""A call cut off by an exception of the caller's while it waits (a serving loop's request deadline by
SIGALRM, Ctrl-C), and a Client dropped without close(), against a real daemon. A review found both
left things held for the client's life: the interrupted call sent no `forget` (only a timeout did), so
what it handed out stayed held under ids the engine never learned, and an interrupted commit left its
block viewable by id though it may move; the heartbeat thread held the Client, so one dropped was
never collected and renewed its lease for ever."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import weakref

import numpy as np
import pytest
import zmq
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2 import protocol as P
from dflash2.client import Client
from dflash2.errors import ArenaError, DaemonUnavailable


class Deadline(Exception):
    pass


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(memory={"nvme_capacity_mb": 0},
                                     daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 1.0,
                                             "heartbeat_interval_s": 0.2, "set_aside_leases": 0})).start()
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.stop()


def interrupted(daemon, call) -> None:
    """Run `call` while the daemon is stopped, a SIGALRM handler raising Deadline 0.3 s into it; the
    daemon then runs on and answers the call, whose reply nobody reads."""
    def deadline(*_):
        raise Deadline("request deadline")

    old = signal.signal(signal.SIGALRM, deadline)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Deadline):
            call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.kill(daemon.pid, signal.SIGCONT)


@pytest.mark.parametrize("what", ["allocate", "reserve"])
def test_an_interrupted_call_gives_back_what_it_handed_out(daemon, what):
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=5.0)
    try:
        lid = c.layouts[0]
        interrupted(daemon, (lambda: c.allocate(lid, 8)) if what == "allocate" else (lambda: c.reserve(lid, 16 * 8)))
        c.ping()  # the forget went first, on the fresh socket
        c.ping()
        st = c.stats()
        assert (st["tiers"]["hbm"]["blocks"], st["reservations"]["reserved_blocks"]) == (0, 0)
    finally:
        c.close()


def test_an_interrupted_commit_leaves_no_view_by_id_of_a_block_that_may_move(daemon):
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=5.0)
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        interrupted(daemon, lambda: c.commit([vid], keys=[123456789]))
        c.ping()
        with pytest.raises(ArenaError, match="is not being written or acquired by this client"):
            c.view_bytes(vid)  # it may have run: committed, the block may move
    finally:
        c.close()


def dropped_client(endpoint: str, caplog) -> dict:
    """A client that allocated 4 blocks and reserved is dropped without close() or detach(); more than
    two leases (of 1 s) later, the daemon's stats as another client reads them."""
    def request():
        c = Client.connect(endpoint, name="dropped", layouts=[SMALL])
        c.allocate(c.layouts[0], 4)
        assert c.reserve(c.layouts[0], 64).granted
        return weakref.ref(c)

    with caplog.at_level(logging.WARNING, logger="dflash2.client"):
        ref = request()
        gc.collect()
        assert ref() is None
        time.sleep(2.5)  # more than two leases
    with Client.connect(endpoint, name="checker", layouts=[SMALL]) as checker:
        st = checker.stats()
    assert [x["name"] for x in st["clients"]] == ["checker"]
    return st


def test_a_client_dropped_without_close_lets_its_lease_lapse(daemon, caplog):
    st = dropped_client(daemon.endpoint, caplog)
    assert "was dropped without close() or detach(): its heartbeat stops" in caplog.text
    assert (st["tiers"]["hbm"]["blocks"], st["reservations"]["reserved_blocks"]) == (0, 0)


def _segment_descriptors() -> list[str]:
    """What this process's descriptors of dflash2 shared memory name (segments, liveness objects)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(n for n in names if n.startswith("/dev/shm/dflash2-"))


def test_a_dropped_clients_descriptors_go_with_it(daemon):
    """A Client dropped without close(), once collected, keeps no descriptor of the daemon's segments or
    liveness object: each kept one (3 a client on a host node, a review's 20 dropped clients 60), for the
    process's life, and after the daemon stopped they held its unlinked segments' memory (/dev/shm)."""
    before = _segment_descriptors()

    def request():
        c = Client.connect(daemon.endpoint, name="dropped", layouts=[SMALL])
        assert len(_segment_descriptors()) > len(before)  # (its segments and liveness object are open)
        return weakref.ref(c)

    refs = [request() for _ in range(3)]
    gc.collect()
    assert [r() for r in refs] == [None] * 3
    assert _segment_descriptors() == before


def test_a_dropped_clients_blocks_are_set_aside_while_its_process_lives(config_file, tmp_path, caplog):
    """With set-aside on (the default): at the lapse its reservation goes and its private blocks are
    kept out of reuse, as any live process's whose lease lapsed (views taken from it may still write);
    the README said they went at the lapse (a review)."""
    proc = DaemonProcess(config_file(memory={"nvme_capacity_mb": 0},
                                     daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 1.0,
                                             "heartbeat_interval_s": 0.2})).start()
    try:
        st = dropped_client(proc.endpoint, caplog)
        assert "keeps its private blocks and pins out of reuse until this process ends" in caplog.text
        assert st["reservations"]["reserved_blocks"] == 0
        assert (st["set_aside"]["clients"], st["set_aside"]["blocks"]) == (1, 4), st["set_aside"]
    finally:
        proc.stop()


def test_a_commit_cut_off_while_it_waits_for_the_clients_lock_is_not_lost(daemon):
    """Another thread's call holds the client's lock; the commit, waiting for it, is cut off. It was
    neither sent nor kept (a commit that timed out waiting is), yet no longer the writer's here: its
    block stayed being written until detach (a review)."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=5.0)
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        os.kill(daemon.pid, signal.SIGSTOP)
        slow = threading.Thread(target=c.ping)  # holds the client's lock while the daemon is stopped
        slow.start()
        time.sleep(0.1)
        try:
            interrupted(daemon, lambda: c.commit([vid], keys=[987654321]))  # (resumes the daemon)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        slow.join(10)
        c.ping()
        c.ping()
        ran = len(c.lookup([987654321])) == 1
        assert ran or c.stats()["tiers"]["hbm"]["blocks"] == 0  # ran, or forgotten and its block freed
    finally:
        c.close()


def test_a_release_left_to_the_next_call_and_cut_off_there_runs_once_and_soon(daemon):
    """Noted before it left the client's queue, a release cut off there was noted again by the next
    call, under another call id, and ran twice: another thread's pin went (a review). Out of the
    queue first, and what was noted but not all sent goes with the next call on the same socket."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=5.0, heartbeat=False)
    try:
        lay = c.layouts[0]
        vid = int(c.allocate(lay, 1)["vid"][0])
        c.commit([vid], keys=[4242])
        assert c.acquire([vid]) is not None  # thread A's pin
        assert c.acquire([vid]) is not None  # thread B's pin
        # thread A's release timed out waiting for the client's lock: left to the next call
        c._unsent.append((P.Op.RELEASE, np.array([vid], dtype=P.VIDS_DTYPE).tobytes()))
        c._held.released(np.array([vid], dtype=P.VIDS_DTYPE))
        real = c._transport._send_pending
        calls = {"n": 0}

        def interrupted_once():
            calls["n"] += 1
            if calls["n"] == 1:
                raise Deadline("request deadline lands inside give_up_unsent")
            return real()
        c._transport._send_pending = interrupted_once
        with pytest.raises(Deadline):
            c.ping()
        c.ping()  # sends the pending retries
        c.ping()
        retries = daemon.log().count("sent it again: run now")
        # thread B still holds its pin: its own release must succeed, and only one retry ran
        try:
            c.release([vid])
            b_err = None
        except Exception as e:  # noqa: BLE001
            b_err = e
        assert retries == 1 and b_err is None, f"thread A's one release ran {retries} times; B's release: {b_err!r}"
    finally:
        c.close()


def test_an_exception_just_as_a_call_takes_the_clients_lock_leaves_it_free(daemon):
    """The handler of a signal that arrives as the lock's acquire returns runs just after it: the call's
    exception path re-raised without giving the lock back, every later call failed "waited ... behind
    other threads' calls" and close() hung (a review's stress of SIGALRM deadlines). Made certain here by
    a lock whose acquire takes it and then raises, as that handler does."""
    c = Client.connect(daemon.endpoint, name="deadline", layouts=[SMALL], timeout_s=1.0)
    real = c._lock

    class InterruptedAfterTaking:
        def acquire(self, timeout=-1):
            real.acquire()
            raise KeyboardInterrupt  # a SIGINT's handler, run as acquire returns

        def __getattr__(self, name):
            return getattr(real, name)

    c._lock = InterruptedAfterTaking()
    with pytest.raises(KeyboardInterrupt):
        c.ping()
    c._lock = real
    assert real.acquire(blocking=False)  # (free: taken and given back here)
    real.release()
    assert c.ping()["version"] == P.VERSION
    closing = threading.Thread(target=c.close)
    closing.start()
    closing.join(5)
    assert not closing.is_alive(), "close() hung on the lock the interrupted call left held"


def test_a_call_from_a_signal_handler_during_a_call_is_refused_not_mixed(daemon):
    """The lock is reentrant (so that the call can tell it took it): a call made by a signal handler
    while a call of the same thread runs is refused by name, never sent beside it."""
    c = Client.connect(daemon.endpoint, name="handler", layouts=[SMALL], timeout_s=1.0)
    try:
        with c._lock:  # as within a call of this thread
            with pytest.raises(DaemonUnavailable, match="called while a call of this client runs on this thread"):
                c.ping()
        assert c.ping()["version"] == P.VERSION
    finally:
        c.close()


@pytest.mark.parametrize("op", ["release", "free", "commit"])
def test_an_exception_just_before_a_call_is_sent_gives_it_up_as_after_a_timeout(daemon, monkeypatch, op):
    """Cut off (a handler's exception) as the request was encoded, before it was sent: neither sent
    nor kept, yet given up on the client's side; its pins, reference or block being written stayed
    held until detach (a review). Now it is given up as after a timeout: a release's or free's sent
    again, a commit's blocks forgotten."""
    from dflash2.client import transport as T

    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=2.0)
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        if op != "commit":
            c.commit([vid], keys=[31337])
            assert c.acquire([vid]) is not None
        kind = {"release": P.Op.RELEASE, "free": P.Op.FREE, "commit": P.Op.COMMIT}[op]
        for where in ("encoded", "before the transport took it"):
            if where != "encoded":  # (given back by the first: taken again for the second)
                c.acquire([vid]) if op == "release" else c.add_ref([vid])
            real, fired = (T.P.encode_request if where == "encoded" else c._transport._unsent), []

            def cut_off(*a, **k):
                if not fired and (not a or a[0] == kind):
                    fired.append(1)
                    raise KeyboardInterrupt  # the handler of a signal that arrived just before
                return real(*a, **k)
            if where == "encoded":
                monkeypatch.setattr(T.P, "encode_request", cut_off)
            else:  # (as it sends the forgets and retries pending: a review of the mend)
                monkeypatch.setattr(c._transport, "_unsent", cut_off)
            with pytest.raises(KeyboardInterrupt):
                {"release": lambda: c.release([vid]), "free": lambda: c.free([vid]),
                 "commit": lambda: c.commit([vid], keys=[4711])}[op]()
            monkeypatch.undo()
            c.ping()
            c.ping()
            if op == "commit":
                break  # (its block is gone: forgotten)
        if op == "release":
            c.free([vid])  # the engine's own reference
        if op == "free":
            c.release([vid])  # the engine's own pin
    finally:
        released = c.close()
    assert not any(released.values()), released


def test_a_release_from_a_signal_handler_during_a_call_keeps_its_pins_and_close_waits_for_the_call(daemon):
    """Refused (a call of this thread runs), the handler's release was never sent, yet its pins were
    given up here: the daemon held them until detach (a review). They stay viewable now; and close()
    from a handler during a call ran inside it and closed its socket under it (a raw ZMQError): it
    runs once that call has ended."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=3.0)
    vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
    c.commit([vid], keys=[777])
    assert c.acquire([vid]) is not None
    got = {}

    def handler(*_):
        try:
            c.release([vid])
        except DaemonUnavailable as e:
            got["release"] = str(e)
        got["viewable"] = c.view_bytes(vid).nbytes  # (its pin kept: before, "acquire it first")
        got["close"] = c.close()

    old = signal.signal(signal.SIGALRM, handler)
    os.kill(daemon.pid, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (daemon.pid, signal.SIGCONT)).start()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        places = c.allocate(c.layouts[0], 2)  # the handler's calls come while this one waits
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.kill(daemon.pid, signal.SIGCONT)
    assert "called while a call of this client runs on this thread" in got["release"] and got["close"] == {}
    assert got["viewable"] == SMALL.block_bytes
    assert len(places) == 2  # the call ended as it would have; then the client detached
    with Client.connect(daemon.endpoint, name="checker", layouts=[SMALL]) as checker:
        assert [x["name"] for x in checker.stats()["clients"]] == ["checker"]
        assert checker.stats()["tiers"]["hbm"]["blocks"] == 1  # the published block alone, unpinned
        checker.check()


def _handler_calls_once_while_waiting(monkeypatch, call):
    """As a signal handler that runs while a call waits for its reply (after it was sent) and lets
    out the exception of its own call (`call`)."""
    from dflash2.client import transport as T

    real, fired = T.recv_frames, []

    def recv(sock, *a, **k):
        if not fired:
            fired.append(1)
            call()
        return real(sock, *a, **k)
    monkeypatch.setattr(T, "recv_frames", recv)


@pytest.mark.parametrize("op", ["release", "allocate", "commit"])
def test_a_handlers_error_let_out_into_a_call_gives_the_call_up(daemon, monkeypatch, op):
    """A handler's call of the same client (CallInProgress) or of another (its DaemonUnavailable),
    let out into a call waiting for its reply, was taken for the call's own error: no forget or
    retry, and a CallInProgress read as "never sent" (a review): a release that had run was kept to
    send again (run twice, another thread's pin dropped), an allocation's blocks stayed held, a
    committed block stayed viewable. The call is given up as after a timeout now."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=3.0, heartbeat=False)
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        if op == "release":
            c.commit([vid], keys=[5150])
            assert c.acquire([vid]) is not None and c.acquire([vid]) is not None  # two threads' pins
        _handler_calls_once_while_waiting(monkeypatch, c.stats)
        with pytest.raises(DaemonUnavailable, match="cut off by a call made within it"):
            {"release": lambda: c.release([vid]), "allocate": lambda: c.allocate(c.layouts[0], 8),
             "commit": lambda: c.commit([vid], keys=[6160])}[op]()
        monkeypatch.undo()
        c.ping()
        c.ping()
        if op == "release":
            c.release([vid])  # the other thread's own pin: still there (the first release ran once)
            c.free([vid])
        if op == "commit":
            with pytest.raises(ArenaError):
                c.view_bytes(vid)  # committed, unpinned: it may move
        if op == "allocate":
            c.free([vid])  # (the test's own block)
    finally:
        released = c.close()
    assert not any(released.values()), released


def test_another_clients_error_let_out_into_a_call_is_not_this_calls_answer(daemon, monkeypatch):
    """A handler's call of another client whose error (a refusal: UnknownBlock; a lapsed lease:
    UnknownClient) came out of this client's call was read as this call's answer: a release's pins
    kept though it ran, and this client's own lease taken for lost (its views refused, close() sent
    no detach). A review of the mend."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=3.0)
    other = Client.connect(daemon.endpoint, name="other", layouts=[SMALL], timeout_s=3.0, heartbeat=False)
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        c.commit([vid], keys=[5150])
        assert c.acquire([vid]) is not None and c.acquire([vid]) is not None
        _handler_calls_once_while_waiting(monkeypatch, lambda: other.release([0x7FFF000000000001]))
        with pytest.raises(DaemonUnavailable, match=r"cut off by a call made within it \(DaemonError: UnknownBlock.*"
                                                     "given up as after a timeout"):
            c.release([vid])
        monkeypatch.undo()
        c.release([vid])  # the other pin; the first release ran (or is sent again and runs)
        with pytest.raises(ArenaError):
            c.view_bytes(vid)
        time.sleep(1.5)  # the other's lease lapses (no heartbeat); this one's heartbeat renews its own
        _handler_calls_once_while_waiting(monkeypatch, lambda: other.allocate(other.layouts[0], 1))
        with pytest.raises(DaemonUnavailable, match="UnknownClient"):
            c.ping()
        monkeypatch.undo()
        assert not c.lease_lost
        c.free([vid])
    finally:
        released = c.close()
        other.close()
    assert not c.lease_lost and not any(released.values()), released


def test_a_pending_retry_cut_off_between_its_frames_is_sent_again_whole(daemon, monkeypatch):
    """Cut off between a pending retry's frames, the socket took the next message's frames as the
    rest of it: a garbled request the daemon never answered, and the release never ran (a review of
    the mend). The socket is dropped then, and the next call sends it again whole."""
    from dflash2.client import transport as T

    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        c.commit([vid], keys=[4242])
        assert c.acquire([vid]) is not None and c.acquire([vid]) is not None
        c._unsent.append((P.Op.RELEASE, np.array([vid], dtype=P.VIDS_DTYPE).tobytes()))  # one thread's release,
        c._held.released(np.array([vid], dtype=P.VIDS_DTYPE))  # left to the next call
        real, fired = T.send_frames, []

        def half(sock, frames, flags=0, copy=True):
            if not fired and flags == T.NOBLOCK:  # (a pending retry's send)
                fired.append(1)
                sock.send(frames[0], flags | zmq.SNDMORE, copy=copy)
                raise KeyboardInterrupt  # SIGINT's default handler, as the first frame's send returns
            return real(sock, frames, flags, copy)
        monkeypatch.setattr(T, "send_frames", half)
        with pytest.raises(KeyboardInterrupt):
            c.ping()
        monkeypatch.undo()
        for _ in range(3):
            c.ping()
        assert daemon.log().count("sent it again: run now") == 1
        c.release([vid])  # the other thread's pin
        c.free([vid])
    finally:
        released = c.close()
    assert not any(released.values()), released
