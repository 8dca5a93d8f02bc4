"""Stop signals of the `dflash2` command, and the clean-up they must not cut short.

SIGTERM, SIGHUP and SIGINT end a bench through its clean-up (its daemon stopped, its shared memory
and scratch files removed): the handler raises SystemExit where the command stands. Landing inside
that clean-up, it cut it short: a SIGTERM as a swap bench closed its HBM arena left 800 MB of
/dev/shm behind, in 2 of 9 timed runs (a review). Clean-up runs `uninterrupted()`: a stop signal
that comes meanwhile is held, and raised once the outermost such block has ended.
"""

from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_lock = threading.RLock()  # (the handler runs on the main thread, which may hold it in `uninterrupted`)
_depth = 0  # uninterrupted blocks running (any thread: the handler runs on the main one)
_held: int | None = None  # a stop signal that came during one


def exit_on_signal(signum: int, frame) -> None:
    """The handler: SystemExit(128 + signum) now, or once the clean-up running has ended."""
    global _held
    with _lock:
        if _depth:
            _held = signum
            return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def uninterrupted():
    """Clean-up that a stop signal waits for (the signal is raised as the outermost block ends)."""
    global _depth, _held
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            signum = _held if not _depth else None
            if signum is not None:
                _held = None
        if signum is not None:
            raise SystemExit(128 + signum)


def install(interrupt: bool = True) -> dict:
    """The handler on each stop signal the process was not started to ignore (`nohup` ignores
    SIGHUP, a background shell SIGINT: they stay ignored); returns the handlers replaced. Only the
    main thread may set handlers: from another, none is set. `interrupt` False leaves SIGINT to
    Python (KeyboardInterrupt: `status --watch` ends on Ctrl-C with exit 0, and exited 130 under
    this handler, a review)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, exit_on_signal) for sig in STOP_SIGNALS
            if signal.getsignal(sig) is not signal.SIG_IGN and (interrupt or sig != signal.SIGINT)}
