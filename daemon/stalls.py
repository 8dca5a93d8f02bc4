"""Time the daemon's process did not run at all: stopped (SIGSTOP, a debugger), frozen (a cgroup
freezer, `docker pause`, a paused VM), or not scheduled (a swap storm). Its clients ran meanwhile,
but their heartbeats never reached it: each timed out, and the fresh socket a client makes then
cannot even connect to a daemon that does not run. The lease judgement counts that time out
(server.py `_judge_leases`, Service.resumed): before, every client's lease lapsed as the daemon ran
again, and every engine lost its reservations and private blocks (a review's script: leases of
2 s, the daemon stopped for 3 s).

A thread wakes every WATCH_S and notes by how much it woke late; the loop asks (`stalled_s`) before
it judges leases, and itself notes a stall that has just ended and that the thread, not yet run
again, has not seen. A long call of the loop's own is no stall: the thread, and ZeroMQ's I/O thread
that queues the heartbeats sent meanwhile, run through it (and leases are judged as of the last
time the request queue was seen empty: Service.expire_leases). One that held the GIL throughout (a C
call that does not let it go) would count as a stall: that delays a dead client's release by as long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dflash2 import threads

WATCH_S = 0.1  # how often the watching thread wakes
# A wake later than this beyond WATCH_S is a stall: a thread not scheduled that long is the whole
# process not running (beside a loop spinning in Python, load 2 on the 2-core VM, such a thread woke
# 27 ms late at most in 15 s, 20 ms at p99).
STALL_MIN_S = 0.5


class StallWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic, every_s: float = WATCH_S):
        self._clock = clock
        self._every_s = every_s
        self._lock = threading.Lock()  # the watching thread and the loop both note
        self._seen = clock()  # when a thread of the process was last seen running
        self._stalled_s = 0.0  # stalls noted and not yet taken (stalled_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            self._seen = self._clock()  # (the time before the start is no stall)
        self._thread = threads.start(threading.Thread(target=self._watch, name="dflash2-stall-watch", daemon=True))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self._every_s):
            with self._lock:
                self._note()

    def _note(self) -> None:
        """(Holding the lock) the process runs now: the time since it was last seen running, beyond
        a wake's interval, is a stall when longer than STALL_MIN_S."""
        now = self._clock()
        gap = now - self._seen - self._every_s
        if gap > STALL_MIN_S:
            self._stalled_s += gap
        self._seen = max(self._seen, now)

    def stalled_s(self) -> float:
        """Seconds the process did not run since the last call (each stall of more than STALL_MIN_S),
        a stall that has just ended included; 0.0 when none."""
        with self._lock:
            self._note()
            stalled, self._stalled_s = self._stalled_s, 0.0
        return stalled
