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

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from dflash2.arena.staging import ALIGN
from dflash2.errors import ArenaError, CapacityError
from dflash2.files import holders_text, make_private_folders, nearest_existing, owner_text, same_file

log = logging.getLogger("dflash2.arena")

# The first page of every cache file: its magic line, zero-padded to ALIGN bytes.
HEADER = b"dflash2 NVMe cache file; its contents are valid only while the daemon that wrote it runs\n"
HEADER_BYTES = ALIGN
# How long start-up tries a cache file's lock, which another start's scan holds for a moment (below),
# and how often it opens the file again when its path no longer names the one it opened.
LOCK_WAIT_S = 0.25
OPEN_TRIES = 3


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


def folder_named(nvme_path: Path) -> str | None:
    """Why `memory.nvme_path` cannot be the cache file's path because it names a folder (a disk's
    mount point written without a file name), or None. With several GPUs the files
    (`nvme_path.gpuN`) went beside that folder, in its parent: on the root disk for a mount point."""
    try:
        if not nvme_path.is_dir():
            return None
    except OSError:
        return None  # (what cannot be looked at is said where the file is opened)
    return (f"memory.nvme_path {nvme_path} is a folder, not the NVMe cache file's path; give the path of the file in it "
            f"(such as {nvme_path / 'nvme.cache'})")


def open_cache_file(path: str) -> tuple[int, bool]:
    """An fd of the cache file at `path`, created (True) or an earlier one opened (False): ArenaError
    naming what stands in the way. A file removed between the two tries (another start's scan) is
    created afresh, where "No such file or directory" failed the start. `path` is a resolved one
    (os.path.realpath: a link's target is the file); a link put there since is refused, named."""
    folder = os.path.dirname(path)
    above = nearest_existing(Path(folder))  # (the folders below it are this call's to make)
    for _ in range(OPEN_TRIES):
        created = True
        try:
            try:
                make_private_folders(folder)  # (folders it makes: owner-only, as the file)
            except FileNotFoundError as e:  # (on a filesystem that makes no folders, /proc: said "is gone", a review)
                raise ArenaError(f"NVMe tier cannot make the folder {e.filename or folder} for its file {path}: "
                                 f"{e.strerror}") from None
            try:
                return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), True
            except FileExistsError:
                created = False
                _refuse_unless_regular(os.stat(path), path)  # (before it is opened: see there)
                return _own_file(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY), path), False
        except FileNotFoundError:
            if not created and os.path.islink(path):
                # A dangling link (O_EXCL never follows one) was taken for a file removed between the
                # tries, each of them, and said "removed" (a review).
                raise ArenaError(f"NVMe tier cannot open {path}: a symbolic link to {os.path.realpath(path)}, "
                                 "which does not exist, was put there as it was opened; the link's target is made "
                                 "where the path is taken again (a start, the tier's next try for a file)") from None
            if not created and os.path.isdir(folder):
                continue  # removed between the two tries: create it
            if created and os.path.isdir(folder):  # (ENOENT in a folder that is there: /proc, /sys, said "gone")
                raise ArenaError(f"NVMe tier cannot create its file at {path}: the filesystem of {folder} makes "
                                 "no files (such as /proc or /sys); give a path on a disk") from None
            raise ArenaError(f"NVMe tier cannot create its file at {path}: its folder {folder} is gone") from None
        except OSError as e:
            what = "create its file at" if created else "open its existing file"
            if e.errno in (errno.EEXIST, errno.ENOTDIR):  # a file where a folder above it must be
                blocker = file_among_folders(folder)
                if blocker is not None:
                    raise ArenaError(f"NVMe tier cannot {what} {path}: {blocker} is not a folder") from e
            if e.errno in (errno.ENOSPC, errno.EDQUOT) and created:  # (its file or a folder above it could not be made)
                # The folders made for the file go again: each took an inode, the filesystem's (or the
                # user's quota's) last one where one was left, and the next start was told to free files
                # in an empty folder.
                why = no_room_for_files(str(above)) if e.errno == errno.ENOSPC else QUOTA_FILES_ADVICE
                _remove_made_folders(Path(folder), above)
                raise CapacityError(f"NVMe tier cannot {what} {path}: {e.strerror}: {why}") from e
            raise ArenaError(f"NVMe tier cannot {what} {path}: {e}") from e
    raise ArenaError(f"NVMe tier cannot open {path}: removed each of the {OPEN_TRIES} times it was opened: is "
                     "another process removing it?")


# Where this user's disk quota (its inodes, or its bytes) is spent as the file is made: EDQUOT, said with
# no advice before, where the fallocate's EDQUOT had nvmeprep's.
QUOTA_FILES_ADVICE = ("this user's disk quota there is spent (quota -s): free room or files under it, or set "
                      "memory.nvme_path to a file on another filesystem")


def _remove_made_folders(folder: Path, above: Path) -> None:
    """Remove `folder` and the folders between it and `above`, which was there before they were made,
    where they are still empty (another start may have put its file in one meanwhile: left)."""
    while folder != above and above in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def no_room_for_files(folder: str) -> str:
    """Why a file (or folder) cannot be made in `folder` where the filesystem says ENOSPC, and what to do.
    A filesystem out of inodes (ext4's, fixed when it was made) has room for bytes and makes no file:
    "No space left on device" on a disk with gigabytes free, which `--check` said fits (a review)."""
    try:
        st = os.statvfs(existing := nearest_existing(Path(folder)))
    except OSError:
        st = None
    if st is not None and st.f_files and not st.f_favail:
        return (f"its filesystem has no free inodes (df -i {existing}), though it has room for bytes: remove "
                "files there, or set memory.nvme_path to a file on another filesystem")
    return "its disk is full: free room there, or set memory.nvme_path to a file on another disk"


def _refuse_unless_regular(st: os.stat_result, path: str) -> None:
    """ArenaError unless `st` is a regular file's. A device or FIFO named as the cache file (a
    review: `/dev/null`) was opened read-write, made owner-only (every other user of the node lost
    /dev/null) and only then refused; opening some devices acts by itself (a watchdog's starts it),
    so the path is looked at before it is opened, and what was opened is looked at again."""
    if not stat.S_ISREG(st.st_mode):
        raise ArenaError(f"memory.nvme_path {path} is not a regular file ({stat.filemode(st.st_mode)}): give the "
                         "path of a cache file the daemon makes (such as /var/lib/dflash2/nvme.cache), not a "
                         "device, FIFO or socket; the path was left as it is")


def _own_file(fd: int, path: str) -> int:
    """`fd`, an existing file at the cache file's path, once it is this user's and owner-only. The
    blocks written there are the cache's (prompts' KV): another user's file, which anyone may plant
    in a shared folder (empty, or with the header), was served from, every block readable by that
    user (a review). One of this user's open to others is made owner-only, said, only where it is
    empty or a cache file: a shared data file named by mistake was made owner-only, every other user
    losing it, and only then refused as foreign (a review). A foreign one is refused once it is
    locked (NvmeArena._prepare_file), its mode as it was."""
    st = os.fstat(fd)
    try:
        _refuse_unless_regular(st, path)  # (again, on what was opened: the path may have changed since)
        foreign = is_foreign(os.pread(fd, len(HEADER), 0))  # (a FIFO is refused above, before it is read)
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)  # (opened non-blocking, in case the path had become a FIFO)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise ArenaError(f"NVMe tier file {path} is not this user's ({owner_text(st)}; the daemon runs as uid "
                         f"{os.geteuid()}): its owner could read the cache; remove it, or set memory.nvme_path "
                         "to a path in a folder of the daemon's user")
    if st.st_mode & 0o077 and not foreign:
        os.fchmod(fd, 0o600)
        log.warning("NVMe: %s was open to other users (mode %o): made owner-only (0600)", path,
                    stat.S_IMODE(st.st_mode))
    return fd


def lock_cache_file(fd: int, path: str, wait: float | None = None) -> None:
    """Take the lock a running daemon holds on its cache file for its life. Another start's scan
    holds it for a moment while it looks at an earlier daemon's file: tried for LOCK_WAIT_S, where
    one try took that moment for a daemon running on the file ("in use by another process").
    `wait`: seconds to try for instead (0: one try; a tier without a file trying again, nvmegone.py)."""
    deadline = time.monotonic() + (LOCK_WAIT_S if wait is None else wait)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ArenaError(f"NVMe tier file {path} is in use by another process{holders_text(fd)}") from None
            time.sleep(0.01)


class Unused(NamedTuple):
    path: Path
    held: int  # bytes it holds on disk
    link: bool  # reached through a symlink: the operator's (a link per GPU onto a disk each), left as it is


def unused_cache_files(nvme_path: Path, in_use: list[Path]) -> list[Unused]:
    """Each dflash2 cache file at `nvme_path` or `nvme_path.gpuN` not among `in_use` and held by no
    process (at the moment of looking). An entry that cannot be looked at (a link into a folder
    this user may not read, a failing disk) is said in the log and left: it crashed start-up with a
    traceback (exit 1) before, though this start does not use it (a review)."""
    folder = nvme_path.parent
    try:
        if not folder.is_dir():
            return []
        taken = {os.path.realpath(p) for p in in_use}
        # Exactly `.gpuN` (N the digits of a GPU index): `nvme.cache.gpu0.orig`, an operator's copy
        # with dflash2's header, went too (a review).
        names = {nvme_path.name} | {p.name for p in folder.glob(f"{_glob_escape(nvme_path.name)}.gpu*")
                                    if re.fullmatch(r"gpu[0-9]+", p.name[len(nvme_path.name) + 1:])}
    except OSError as e:
        log.warning("NVMe: cannot look for an earlier daemon's cache files in %s (%s): none is removed", folder, e)
        return []
    out = []
    for name in sorted(names):
        path = folder / name
        try:
            if os.path.realpath(path) in taken or not path.is_file():
                continue
            with _idle_cache_file(path) as held:
                if held is not None:
                    out.append(Unused(path, held, path.is_symlink()))
        except OSError as e:
            log.warning("NVMe: cannot look at %s (%s), which no pool of this start uses: it is left as it is", path, e)
    return out


def remove_unused_cache_files(nvme_path: Path, in_use: list[Path]) -> None:
    """Remove what `unused_cache_files` finds, each said in the log (a failure too: the start goes on,
    and the room check that follows names the bytes it lacks). A symlink is left, said: it is the
    operator's (removing the link freed nothing, and the layout of a disk per GPU went, a review).

    Invariant: a file is unlinked only while this process holds its lock, and only if its path
    still names the file locked. A file is taken by a daemon that opens it by path and then locks
    it (nvme.py): unlinked after the lock was let go, a daemon that took the file in between served
    from a deleted file, its room out of sight (two daemons on one folder starting together, a
    review). The arena checks, once it holds the lock, that the path still names its file."""
    for path, held, link in unused_cache_files(nvme_path, in_use):
        if link:
            log.warning("NVMe: %s leads to an earlier daemon's cache file %s (%d bytes on disk) that no pool of this "
                        "start uses; the link is left as it is (remove the file to give its disk room back)",
                        path, os.path.realpath(path), held)
            continue
        try:
            with _idle_cache_file(path) as still:  # taken again: it may be another daemon's by now
                if still is None:
                    log.info("NVMe: %s was taken by another process as this start looked at it: left", path)
                    continue
                os.unlink(path)
        except OSError as e:
            log.warning("NVMe: an earlier daemon's cache file %s (%d bytes), which no pool of this start uses, "
                        "could not be removed: %s", path, held, e)
        else:
            log.warning("NVMe: removed an earlier daemon's cache file %s (%d bytes on disk): no pool of this start "
                        "uses it (it was made for another number of GPUs), and what it held is not valid after a "
                        "restart", path, held)


@contextlib.contextmanager
def _idle_cache_file(path: Path) -> Iterator[int | None]:
    """Within the block, the bytes a dflash2 cache file at `path` holds on disk, with its lock held,
    when no process held the lock and the path still names the file locked; else None. A file that
    cannot be opened or locked for a reason other than its absence is said in the log (a lock that
    the filesystem refuses, such as NFS's for a file open read-only, left such files unsaid)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield None
        return
    except OSError as e:
        log.warning("NVMe: cannot open %s to see whether it is an earlier daemon's cache file (%s): left", path, e)
        yield None
        return
    try:
        if os.pread(fd, len(HEADER), 0) != HEADER:
            held = None
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (the lock a running daemon holds; let go at close)
            except BlockingIOError:
                held = None
            except OSError as e:
                log.warning("NVMe: cannot lock %s to see whether a daemon uses it (%s): left", path, e)
                held = None
            else:
                held = os.fstat(fd).st_blocks * 512 if same_file(fd, path) else None
        yield held
    finally:
        os.close(fd)


def _glob_escape(name: str) -> str:
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)
