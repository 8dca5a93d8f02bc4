"""Threads' signal masks, read from Linux's /proc (tests/test_threads.py, tests/test_gpu_threads.py)."""

from __future__ import annotations

import signal
from pathlib import Path

STOP_BITS = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGHUP - 1))


def blocked_mask(pid: int | str, tid: int | str) -> int:
    """A thread's blocked signals, from /proc (SigBlk, a hex bit mask: signal n is bit n - 1)."""
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk line for thread {tid} of process {pid}")


def other_threads(pid: int) -> list[int]:
    """The thread ids of process `pid` but its main thread's."""
    return sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if t.name.isdigit() and int(t.name) != pid)


def taking_stop_signals(pid: int, tids: list[int]) -> list[str]:
    """'tid (name)' of each of these threads that does not block SIGTERM, SIGINT and SIGHUP."""
    return [f"{t} ({Path(f'/proc/{pid}/task/{t}/comm').read_text().strip()})" for t in tids
            if blocked_mask(pid, t) & STOP_BITS != STOP_BITS]


def own_mask() -> set[int]:
    """The calling thread's blocked signals."""
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
