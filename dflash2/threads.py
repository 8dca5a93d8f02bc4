"""Threads that leave the stop signals (SIGTERM, SIGINT, SIGHUP) to the main thread.

Linux delivers a signal sent to a process to any of its threads that does not block it. Python runs
its handlers in the main thread only, and a signal taken by another thread does not interrupt the
main thread's system call: a daemon blocked in start-up (reading its history file, a FIFO in
tests/test_audit_config.py) then never sees its SIGTERM and never gives back its shared memory. That
test hung in 2 of 138 runs under load (none in 360 since), every signal caught and none pending,
the main thread still in `read`.

Invariant: every thread the daemon starts blocks the stop signals, so the kernel hands them to the
main thread. A thread inherits its creator's signal mask, so a thread started inside
`stop_signals_blocked()` blocks them from its first instruction; a signal that arrives meanwhile
waits, pending, and reaches the main thread when the block ends. Pools that start their threads
later, from whichever thread submits, block them in their initializer (`block_stop_signals`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

# SIGHUP too: a terminal that hangs up on a daemon started from it (and `kill -HUP`) stops it cleanly.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def daemon_takes(sig: int) -> bool:
    """Whether the daemon puts its own handler on stop signal `sig`: each but a SIGHUP the process was
    started to ignore (`nohup dflash2d &`: it stopped the daemon at the logout nohup was there for, a
    review). (daemon/launch.py, which imports nothing yet, keeps the same rule itself.)"""
    return not (sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN)


def block_stop_signals() -> None:
    """The calling thread no longer takes the stop signals (a thread pool's initializer)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Threads started inside block the stop signals from their start; the caller's mask is restored
    on the way out (a stop signal that arrived meanwhile is then taken)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start(thread: threading.Thread) -> threading.Thread:
    """`thread.start()`, the new thread blocking the stop signals."""
    with stop_signals_blocked():
        thread.start()
    return thread
