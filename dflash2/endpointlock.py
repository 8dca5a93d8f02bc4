"""Who holds an ipc endpoint's lock (`holder`): the daemon takes `<socket>.lock` as it starts
(daemon/endpoint.py) and holds it while it serves; clients, `dflash2 status` and `dflash2d --check`
ask it here. A module of its own below both processes: the daemon's `--check` imported it from the
client, which the package's layers do not allow (a review)."""

from __future__ import annotations

import fcntl
import os


def holder(endpoint: str) -> str | None:
    """The pid (as its lock file says it) of the dflash2d holding an ipc endpoint's lock
    (`<socket>.lock`, daemon/endpoint.py); None for a tcp endpoint (its lock lies on the daemon's
    node) or while none holds it. Asked with a shared lock let go at once, which the daemon's own
    start waits out (`_take`): /proc/locks, read instead, shows no lock of a process in another pid
    namespace (a serving pod beside the DaemonSet's daemon). A serving daemon holds it too: a call
    that waited out its timeout names the pid and cannot tell a busy or stuck loop from one that
    starts or stops (a review: one sent as the daemon began to stop said "daemon gone or stuck")."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        fd = os.open(endpoint[len("ipc://"):] + ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # (nobody held it: the lock goes with the descriptor)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return None
    finally:
        os.close(fd)
