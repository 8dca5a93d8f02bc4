"""Whether a path still names a file held open: the check of the lock-file protocol (open by path,
lock, then see that the path was not removed or replaced meanwhile), which the endpoint's lock file
(daemon/endpoint.py) and the NVMe cache files (arena/nvmefiles.py) both need; and how a file of
another user is named in errors (its owner and mode)."""

from __future__ import annotations

import os


def same_file(fd: int, path: str | os.PathLike) -> bool:
    """Whether `path` (where it leads, for a link) names the file open at `fd` now."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (mine.st_dev, mine.st_ino)


def user_name(uid: int) -> str:
    """` (NAME)` of a uid the passwd database knows, else ""."""
    import pwd

    try:
        return f" ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""


def owner_text(st: os.stat_result) -> str:
    """`uid N (NAME), mode 644`: whose a file is, for an error that refuses another user's file."""
    return f"uid {st.st_uid}{user_name(st.st_uid)}, mode {st.st_mode & 0o7777:o}"
