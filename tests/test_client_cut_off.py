"""Exceptions of the caller's (a signal handler's: a request deadline, an error of a call the handler
made) that land in a client call outside the transport, against a real daemon. A review found them read
as the call's answer there: met while a commit waited for the client's lock, a handler's refusal kept the
block writable here though the commit ran with the next call and the daemon handed the block to another
client; met just after a reply, another client's UnknownClient ended this client's lease; met as a
release, free or commit entered the client, what it named was given up here but neither sent nor kept,
held by the daemon until detach; met after the reply, a committed block stayed writable here."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from conftest import SMALL
from test_client_interrupted import Deadline, daemon  # noqa: F401  (a fixture)

from dflash2 import protocol as P
from dflash2.client import Client
from dflash2.errors import ArenaError, DaemonUnavailable


def _connect(daemon, name: str, heartbeat: bool = False) -> Client:
    return Client.connect(daemon.endpoint, name=name, layouts=[SMALL], timeout_s=5.0, heartbeat=heartbeat)


def _committed_and_pinned_twice(c: Client, key: int) -> int:
    vid = int(c.commit([int(c.allocate(c.layouts[0], 1)["vid"][0])], keys=[key])[0])
    assert c.acquire([vid]) is not None and c.acquire([vid]) is not None  # two threads' pins
    return vid


def _cut_off_waiting_for_the_lock(c: Client, handler_call, call) -> BaseException:
    """Another thread holds c's lock 0.5 s; `call` waits for it; 0.1 s in, a SIGALRM handler runs
    `handler_call`, whose exception comes out of `call`."""
    held = threading.Event()

    def hold():
        with c._lock:
            held.set()
            time.sleep(0.5)
    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    old = signal.signal(signal.SIGALRM, lambda *_: handler_call())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(BaseException) as got:
            call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t.join()
    return got.value


def test_a_refusal_met_waiting_for_the_lock_is_no_answer_of_a_commit_which_runs_later(daemon):
    c, other = _connect(daemon, "engine"), _connect(daemon, "other")
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        e = _cut_off_waiting_for_the_lock(c, lambda: other.release([0x7FFF000000000001]),
                                          lambda: c.commit([vid], keys=[424242]))
        assert isinstance(e, DaemonUnavailable), repr(e)
        assert "cut off by a call made within it (DaemonError: UnknownBlock" in str(e)
        assert str(e).endswith("; kept to go with the next call")  # (it said "given up as after a timeout")
        c.ping()  # the kept commit goes (as its blocks' forget): the daemon frees the block
        c.ping()
        assert c.stats()["tiers"]["hbm"]["blocks"] == 0
        with pytest.raises(ArenaError):
            c.view_bytes(vid)  # (it was: a view over the place the daemon gives the next allocation)
    finally:
        c.close()
        other.close()


def test_a_refusal_met_waiting_for_the_lock_is_no_answer_of_a_release_which_runs_later(daemon):
    c, other = _connect(daemon, "engine"), _connect(daemon, "other")
    try:
        vid = _committed_and_pinned_twice(c, 5150)
        e = _cut_off_waiting_for_the_lock(c, lambda: other.release([0x7FFF000000000001]), lambda: c.release([vid]))
        assert isinstance(e, DaemonUnavailable), repr(e)
        c.ping()  # the kept release runs
        c.release([vid])  # the other thread's pin
        with pytest.raises(ArenaError):
            c.view_bytes(vid)
        c.free([vid])
    finally:
        released = c.close()
        other.close()
    assert not any(released.values()), released


def test_a_deadline_met_waiting_for_the_lock_keeps_the_release_to_send(daemon):
    c = _connect(daemon, "engine")

    def deadline():
        raise Deadline("request deadline")
    try:
        vid = _committed_and_pinned_twice(c, 5151)
        e = _cut_off_waiting_for_the_lock(c, deadline, lambda: c.release([vid]))
        assert isinstance(e, Deadline)
        c.ping()
        c.release([vid])
        c.free([vid])
    finally:
        released = c.close()
    assert not any(released.values()), released


def test_another_clients_unknownclient_met_after_the_reply_leaves_this_lease(daemon, monkeypatch):
    c = _connect(daemon, "engine", heartbeat=True)
    other = _connect(daemon, "other")
    try:
        time.sleep(1.5)  # the other's lease lapses (no heartbeat); this one's heartbeat renews its own
        real, fired = c.renewed, []

        def renewed(sent):  # (where CPython runs a pending handler: a Python call's entry)
            if not fired:
                fired.append(1)
                other.allocate(other.layouts[0], 1)  # DaemonError UnknownClient
            return real(sent)
        monkeypatch.setattr(c, "renewed", renewed)
        with pytest.raises(DaemonUnavailable, match="UnknownClient.*it had run: its answer is lost"):
            c.set_prefill_rate(c.layouts[0], None)
        monkeypatch.undo()
        assert not c.lease_lost
        c.ping()
    finally:
        released = c.close()
        other.close()
    assert not c.lease_lost and released is not None and not any(released.values()), released


@pytest.mark.parametrize("op", ["release", "commit", "free"])
def test_a_call_cut_off_as_it_enters_the_client_is_kept_to_send(daemon, monkeypatch, op):
    c = _connect(daemon, "engine")
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        if op == "release":
            vid = int(c.commit([vid], keys=[5150])[0])
            assert c.acquire([vid]) is not None and c.acquire([vid]) is not None
        real, fired = P.check_frames, []

        def cut(*a, **k):  # (a handler's exception at the entry of a function the call runs first)
            if not fired:
                fired.append(1)
                raise Deadline("request deadline")
            return real(*a, **k)
        monkeypatch.setattr(P, "check_frames", cut)
        with pytest.raises(Deadline):
            {"release": lambda: c.release([vid]), "commit": lambda: c.commit([vid], keys=[6160]),
             "free": lambda: c.free([vid])}[op]()
        monkeypatch.undo()
        assert len(c._unsent) == 1
        c.ping()
        c.ping()
        if op == "release":
            c.release([vid])  # the other thread's pin: the engine never releases the first again
            c.free([vid])
    finally:
        released = c.close()
    assert not any(released.values()), released


def test_a_commit_cut_off_after_its_reply_leaves_no_writable_view(daemon, monkeypatch):
    c = _connect(daemon, "engine")
    try:
        vid = int(c.allocate(c.layouts[0], 1)["vid"][0])
        real, fired = c.renewed, []

        def renewed(sent):
            if not fired:
                fired.append(1)
                raise Deadline("request deadline")
            return real(sent)
        monkeypatch.setattr(c, "renewed", renewed)
        with pytest.raises(Deadline):
            c.commit([vid], keys=[7170])
        monkeypatch.undo()
        with pytest.raises(ArenaError):
            c.view_bytes(vid)  # committed: it may move under a view
        assert len(c.lookup([7170])) == 1  # (it ran)
    finally:
        c.close()


def test_a_refused_release_keeps_its_views(daemon):
    """Given up before the call is sent, a release's pins are put back when the daemon refuses it."""
    c, other = _connect(daemon, "engine"), _connect(daemon, "other")
    try:
        vid = _committed_and_pinned_twice(c, 5152)
        ovid = int(other.allocate(other.layouts[0], 1)["vid"][0])
        with pytest.raises(Exception, match="NotOwner|UnknownBlock|not pinned"):
            c.release([vid, ovid])  # (another's block being written: refused whole)
        assert c.view_bytes(vid) is not None
        c.release([vid])
        c.release([vid])
        c.free([vid])
        other.free([ovid])
    finally:
        released = c.close()
        other.close()
    assert not any(released.values()), released


def test_two_threads_closing_one_client_at_once(daemon):
    """A shutdown hook and the serving loop close one client at once: the second close() checked the
    heartbeat thread, the first set it to None, and the second failed on it (AttributeError, a review).
    The second thread is held at that check (a line trace), the thread read, while the first closes."""
    import inspect
    import sys

    c = _connect(daemon, "engine", heartbeat=True)
    lines, first = inspect.getsourcelines(Client.detach)
    check = next(first + i for i, line in enumerate(lines) if "beat is not None" in line)  # (held as it begins)
    at_check, closed, errors = threading.Event(), threading.Event(), []

    def hold(frame, event, arg):
        if frame.f_code is not Client.detach.__code__:
            return None

        def line(frame, event, arg):
            if event == "line" and frame.f_lineno == check:
                at_check.set()
                closed.wait(10)
            return line
        return line

    def second():
        sys.settrace(hold)
        try:
            assert c.close() == {}
        except BaseException as e:
            errors.append(e)
        finally:
            sys.settrace(None)
    t = threading.Thread(target=second)
    t.start()
    assert at_check.wait(10)
    c.close()
    closed.set()
    t.join(10)
    assert not errors, errors
