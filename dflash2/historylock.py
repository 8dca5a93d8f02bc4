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

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path

from dflash2.files import same_file


def lock_moved(lock_fd: int, lock_path: Path) -> bool:
    """Whether the file at `lock_path` is no longer the one `lock_fd` holds (removed, or another; a
    link there is another)."""
    return not same_file(lock_fd, lock_path, follow=False)


TAKEN, HELD, THEIRS = "taken", "and another daemon took it", "holding another daemon's history"


def lock_again(lock_fd: int, lock_path: Path, held: list[Path], names: Callable[[int], list[str]]) -> tuple[int, str]:
    """(fd, TAKEN): the lock taken on the file now at `lock_path`, given the text of the one `lock_fd`
    holds (its pid and names); (-1, HELD) where another daemon holds it; (-1, THEIRS) where it names
    other daemons (`names` of a lock's fd: history._lock_names) and their history files (`held`) lie
    beside it, as a start finds it (a folder moved into place, restored: its daemon's samples must
    not be appended to nor its lock taken, a review). OSError where it cannot be had: the folder still
    gone, or not a regular file of this user's there (a FIFO was flocked, not written, and leaked)."""
    text = os.pread(lock_fd, 4096, 0)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EINVAL, f"{lock_path} is not a regular file of this user's")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -1, HELD
        theirs = set(names(fd))
        if theirs and not theirs & set(names(lock_fd)) and any(p.exists() for p in held):
            os.close(fd)
            return -1, THEIRS
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)
        return fd, TAKEN
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
