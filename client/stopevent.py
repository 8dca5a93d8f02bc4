"""The heartbeat's stop Event, which close() sets, also from a signal handler and after a close cut off.

A threading.Event's set() takes its Condition's plain Lock. Reviews found two ways that went wrong: a
signal handler's close() landing within this thread's own set() waited for the lock that set() held, for
good; and an exception landing there (Ctrl-C, a handler's deadline) left it held, so that a later set()
hung. Setting the Event once only (a flag raised before set()) traded that for another hang: a close cut
off as set() began, before the Event's flag was set, left the flag raised and the Event unset, so that
every later close() skipped set() and waited its whole timeout joining a heartbeat never told to stop,
which then met UnknownClient after the detach and said the lease was lost (a review). Here the lock is
reentrant and a close latches on the Event being set, not on having asked once."""

from __future__ import annotations

import threading


class StopEvent(threading.Event):
    """An Event whose Condition's lock is reentrant: a set() within this thread's own set() (a signal
    handler's) runs whole instead of waiting for the lock its thread holds."""

    def __init__(self):
        super().__init__()
        self._cond = threading.Condition(threading.RLock())

    def stop(self, timeout_s: float) -> bool:
        """Set the Event unless it is set already (a close cut off after the flag was set may have left the
        lock held: not taken again). Waits at most `timeout_s` for a lock another thread left held by a set()
        cut off before the flag was set; False then (the Event unset), True once set."""
        if self.is_set():
            return True
        if not self._cond.acquire(timeout=timeout_s):  # (at once on this thread: reentrant)
            return False
        try:
            self.set()
        finally:
            self._cond.release()
        return True
