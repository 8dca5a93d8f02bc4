"""The NVMe tier's files: the header that marks a file as a dflash2 cache file, and the files that no
pool of this start uses: an earlier daemon's, made for another number of
GPUs (`nvme_path` with one pool, `nvme_path.gpuN` with several: plan.py `nvme_files`).

Their contents are valid only while the daemon that wrote them runs (nvme.py's header), so a file of
another layout of pools holds nothing a restart could use, and it took the disk room the new files
need: a two-GPU daemon's two files left a one-pool restart on the same disk refused for room (exit 4,
the message naming bytes only, a review). Start-up removes each such file, logged by name; a file
another process holds (a daemon running on it) is left, and so is any file that is not a dflash2
cache file; a file reached through a symlink is named and left (the link is the operator's).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import NamedTuple

from dflash2.arena.staging import ALIGN

log = logging.getLogger("dflash2.arena")

# The first page of every cache file: its magic line, zero-padded to ALIGN bytes.
HEADER = b"dflash2 NVMe cache file; its contents are valid only while the daemon that wrote it runs\n"
HEADER_BYTES = ALIGN


def is_foreign(head: bytes) -> bool:
    """Whether a file whose first len(HEADER) bytes are `head` is someone else's: not empty, and
    not a dflash2 cache file. Such a file is refused, never overwritten."""
    return bool(head) and head != HEADER


def file_among_folders(folder: str) -> str | None:
    """The first path above or at `folder` that exists and is not a folder (makedirs said only "File
    exists", as if the cache file were meant), or None."""
    path = folder
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path if path and not os.path.isdir(path) else None


class Unused(NamedTuple):
    path: Path
    held: int  # bytes it holds on disk
    link: bool  # reached through a symlink: the operator's (a link per GPU onto a disk each), left as it is


def unused_cache_files(nvme_path: Path, in_use: list[Path]) -> list[Unused]:
    """Each dflash2 cache file at `nvme_path` or `nvme_path.gpuN` not among `in_use` and held by no
    process (at the moment of looking)."""
    folder = nvme_path.parent
    if not folder.is_dir():
        return []
    taken = {os.path.realpath(p) for p in in_use}
    names = {nvme_path.name} | {p.name for p in folder.glob(f"{_glob_escape(nvme_path.name)}.gpu*")}
    out = []
    for name in sorted(names):
        path = folder / name
        if os.path.realpath(path) in taken or not path.is_file():
            continue
        held = _idle_cache_file(path)
        if held is not None:
            out.append(Unused(path, held, path.is_symlink()))
    return out


def remove_unused_cache_files(nvme_path: Path, in_use: list[Path]) -> None:
    """Remove what `unused_cache_files` finds, each said in the log (a failure too: the start goes on,
    and the room check that follows names the bytes it lacks). A symlink is left, said: it is the
    operator's (removing the link freed nothing, and the layout of a disk per GPU went, a review)."""
    for path, held, link in unused_cache_files(nvme_path, in_use):
        if link:
            log.warning("NVMe: %s leads to an earlier daemon's cache file %s (%d bytes on disk) that no pool of this "
                        "start uses; the link is left as it is (remove the file to give its disk room back)",
                        path, os.path.realpath(path), held)
            continue
        try:
            os.unlink(path)
        except OSError as e:
            log.warning("NVMe: an earlier daemon's cache file %s (%d bytes), which no pool of this start uses, "
                        "could not be removed: %s", path, held, e)
        else:
            log.warning("NVMe: removed an earlier daemon's cache file %s (%d bytes on disk): no pool of this start "
                        "uses it (it was made for another number of GPUs), and what it held is not valid after a "
                        "restart", path, held)


def _idle_cache_file(path: Path) -> int | None:
    """The bytes a dflash2 cache file at `path` holds on disk, when no process holds its lock; else None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.pread(fd, len(HEADER), 0) != HEADER:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (the lock a running daemon holds; let go at close)
        except BlockingIOError:
            return None
        return os.fstat(fd).st_blocks * 512
    except OSError:
        return None
    finally:
        os.close(fd)


def _glob_escape(name: str) -> str:
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)
