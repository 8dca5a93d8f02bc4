"""The heartbeat's stop signal, which close() sets, also from a signal handler and after a close cut off.

Invariant: it holds no lock, and setting it never waits. A signal handler runs on the thread it
interrupts, which may be inside close()'s own set(): any lock the signal took could be held by that
thread. Reviews found three hangs that way, with a threading.Event and its Condition's lock: a
handler's close() within set() waited for the lock set() held, for good; an exception landing there
(Ctrl-C, a handler's deadline) left it held, the heartbeat blocked for good taking it back after its
wait and every later close() joined it its whole timeout; and with that lock made reentrant, the
handler's close() got through but the heartbeat, woken in Event.wait, could not take the lock back
from the set() the handler interrupted, so the handler's close waited its whole timeout joining it,
detached, and the heartbeat beat once more, met UnknownClient and said the lease was lost.

Here it is a flag and a pipe: set() raises the flag, then writes a byte to the pipe's non-blocking
write end (a byte there already: nothing to add), which wakes the heartbeat polling the read end.
Both steps are safe within themselves and from a handler, an exception anywhere leaves nothing held,
and each later close() sets it again (a byte more is harmless).

Invariant: the pipe's descriptors are closed only when nothing refers to the StopEvent any more (`__del__`):
a set() under way holds it, so never writes into a number closed and reused. A close() of the pipe while
the object lived let one thread's set() write its byte into a number another thread's close() had freed
and the process reused (a review), and a guard against that made a set() skip its byte while another
set() held it, the heartbeat then woken only by its interval (a review). The client drops its reference
once its heartbeat has ended (`Client.detach`).

Invariant: only the process that made it writes to the pipe. A fork shares it, not the flag: a child's
byte would wake every wait of the parent's heartbeat with its flag unset, a beat sent without pause
(set() checks; close() checks `_forked()` first and sets nothing)."""

from __future__ import annotations

import math
import os
import select
import threading


class StopEvent:
    """What the heartbeat waits on (`wait(timeout)` -> whether set, `is_set()`), as a threading.Event."""

    def __init__(self) -> None:
        self._flag = False
        self._pid = os.getpid()
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._joiner: int | None = None  # the thread joining the heartbeat (`join`)

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True  # (first: a wait woken by the byte reads it)
        try:
            if os.getpid() == self._pid:
                os.write(self._w, b"\0")
        except OSError:  # BlockingIOError: the pipe full of bytes already written, each of which wakes it
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, waiting at most `timeout` seconds (None: for good) for set()."""
        r = self._r
        if not self._flag and r >= 0:
            poll = select.poll()  # (not select(): a serving process's descriptors may number past 1024)
            poll.register(r, select.POLLIN)
            poll.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
        return self._flag

    def join(self, beat: threading.Thread, timeout_s: float) -> bool:
        """Join the heartbeat thread `beat` (at most `timeout_s`), unless this thread is joining it already:
        False then, at once. A signal handler's close() within close()'s own join found the thread's end
        lock held by the join it interrupted and waited its whole timeout, the lease lapsing meanwhile (a
        review); the close it interrupted goes on and detaches."""
        me = threading.get_ident()
        if self._joiner == me:
            return False
        try:
            self._joiner = me  # (within the try: an exception landing before it leaves no joiner behind)
            beat.join(timeout=timeout_s)
        finally:
            self._joiner = None
        return True

    def __del__(self) -> None:  # (nothing polls or sets it any more: a set() under way refers to it)
        for fd in (getattr(self, "_r", -1), getattr(self, "_w", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


class Stopped(StopEvent):
    """A stop signal set for good, with no pipe: what a client holds in place of its StopEvent once its
    heartbeat has ended, so that the StopEvent, and its pipe, go as soon as nothing else refers to it."""

    def __init__(self) -> None:
        self._flag, self._pid, self._r, self._w, self._joiner = True, os.getpid(), -1, -1, None

    def set(self) -> None:
        pass
