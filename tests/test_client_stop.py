"""The client's heartbeat stop signal (client/stopevent.py) under signal handlers, threads and fork:
a close() within a close, one cut off, a forked child's close, a set() under way on another thread.
Split from test_daemon_liveness.py (whose daemon fixture and child-process helper these use)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from conftest import SMALL
from test_daemon_liveness import _child, daemon  # noqa: F401  (a fixture)

from dflash2.client import Client


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
