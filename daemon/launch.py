"""`dflash2d`'s entry point: a stop signal unwinds start-up from the process's first step.

The console script imports the module of its function before it calls it: `daemon/main.py` imports
the config, plan and policy modules (0.2-0.3 s on the development VM), with the stop signals blocked
(threads.py), before `main` installs its start-up handlers. A SIGINT then came as a KeyboardInterrupt
traceback (exit 130) once the block ended, and a SIGTERM or SIGHUP killed the process without a word
(143, 129) (a review). Here the handlers come first, with nothing imported but `signal` and `sys`: a
stop before `main` runs says so in one plain-text line (the config's `logging.format` is not read
yet) and exits 0, as a stop during the rest of start-up does. Nothing is taken before `main` runs.
"""

from __future__ import annotations

import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # (threads.STOP_SIGNALS, not imported yet)


class _EarlyStop(BaseException):
    """A stop signal before `main` took over the handlers."""


def _early_stop(signum: int, frame) -> None:
    for sig in STOP_SIGNALS:  # (one unwind: a second signal must not cut it short)
        signal.signal(sig, signal.SIG_IGN)
    raise _EarlyStop(signal.Signals(signum).name)


def main() -> int:
    # A hang-up the process was started to ignore (`nohup dflash2d &`) stays ignored, here, in `main`
    # and once it serves: it stopped the daemon at the logout nohup was there for (a review).
    hangup_ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    for sig in STOP_SIGNALS:
        if not (hangup_ignored and sig == signal.SIGHUP):
            signal.signal(sig, _early_stop)
    try:
        from dflash2.daemon.main import main as daemon_main

        return daemon_main()  # (it installs its own handlers, and puts these back when it returns)
    except _EarlyStop as exc:
        print(f"dflash2d: stopped by {exc} during start-up", file=sys.stderr)
        return 0
    finally:
        for sig in STOP_SIGNALS:  # (past `main`: nothing left to unwind)
            signal.signal(sig, signal.SIG_IGN if hangup_ignored and sig == signal.SIGHUP else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
