"""Whether a path still names a file held open: the check of the lock-file protocol (open by path,
lock, then see that the path was not removed or replaced meanwhile), which the endpoint's lock file
(daemon/endpoint.py) and the NVMe cache files (arena/nvmefiles.py) both need."""

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
