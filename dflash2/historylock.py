"""The state folder's history lock, taken again where the folder was removed and made again under a
running daemon (history.py).

A daemon holds an flock on `STATE_DIR/history.lock` while it writes `history.jsonl` beside it; a
second daemon given the same folder finds it held and keeps its history in memory. The flock is on
the file the daemon opened at its start: once the folder is removed (a clean-up of ~/.local/state, a
tmpfiles rule) and made again, the daemon went on appending to the new folder's file while holding a
lock on a deleted one, and a second daemon took the new folder's lock and appended too: one file of
two daemons' samples, time going back and a false restart on every row (a review). So before each
write the lock is checked to still be the folder's, and taken again on the new file where it is not.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_moved(lock_fd: int, lock_path: Path) -> bool:
    """Whether the file at `lock_path` is no longer the one `lock_fd` holds (removed, or another)."""
    try:
        now = os.lstat(lock_path)
    except FileNotFoundError:
        return True
    held = os.fstat(lock_fd)
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def lock_again(lock_fd: int, lock_path: Path) -> int:
    """The lock taken on the file now at `lock_path`, holding the text of the one `lock_fd` holds
    (its pid and names): its fd, or -1 where another daemon holds it. OSError where it cannot be
    made (the folder still gone: the write would fail as well)."""
    text = os.pread(lock_fd, 4096, 0)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    return fd
