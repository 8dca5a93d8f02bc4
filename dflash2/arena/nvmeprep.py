"""The NVMe tier's file at start-up (and when it is made again: nvmegone.py): opened or made, locked,
checked to be a dflash2 cache file or empty, its header written and its disk room taken, after
checking that the disk has the room and this process may write a file that large (`fsize_limit`).

A mixin of `NvmeArena` (nvme.py). A file this start made is removed again on any failure, so that a
failed start gives its disk space back; one an earlier daemon left is kept.
"""

from __future__ import annotations

import errno
import logging
import os

from dflash2.arena.nvmefiles import HEADER, HEADER_BYTES, OPEN_TRIES, is_foreign, lock_cache_file, open_cache_file
from dflash2.arena.shm import fsize_limit
from dflash2.errors import DISK_FULL, ArenaError, CapacityError
from dflash2.files import same_file

log = logging.getLogger("dflash2.arena.nvme")

# What to do where the disk lacks room for the file (the start-up line said only the bytes, a review).
ROOM_ADVICE = "free room on that disk, lower memory.nvme_capacity_mb, or set memory.nvme_path to a file on another disk"
# Where the user's disk quota is spent (EDQUOT): the disk itself may have room (a review).
QUOTA_ADVICE = ("free room under this user's disk quota there (quota -s), lower memory.nvme_capacity_mb, or set "
                "memory.nvme_path to a file on another disk")


class FilePreparation:
    def _preallocate(self, wait: float | None = None) -> None:
        """Create (or reuse) the cache file at full size, after checking that the disk has room.

        The header goes in before the preallocation: a preallocation that fails part way (ext4 keeps
        what it allocated when the disk fills) or is interrupted must not leave a file of zeros that
        the next start refuses as someone else's. A file this call created is removed again on any
        failure, so that a failed start gives its disk space back."""
        for _ in range(OPEN_TRIES):
            fd, created = open_cache_file(self.path)
            try:
                lock_cache_file(fd, self.path, wait)  # (wait: as lock_cache_file's; 0 for one try)
            except BaseException:
                os.close(fd)  # another process may hold a file we just created: never unlink it then
                raise
            if same_file(fd, self.path):
                break
            # Invariant: the arena's file is the one its path names. Another start's scan removed the
            # earlier daemon's file we had opened before we locked it (nvmefiles.py): open it afresh.
            os.close(fd)
            log.info("NVMe: %s was removed or replaced between its open and its lock (another daemon's start-up); "
                     "opening it again", self.path)
        else:
            raise ArenaError(f"NVMe tier file {self.path} was removed or replaced each of the {OPEN_TRIES} times "
                             "it was opened: is another process removing it?")
        try:
            self._prepare_file(fd)
        except BaseException as e:
            os.close(fd)
            if created:
                os.unlink(self.path)
            if isinstance(e, OSError):
                kind = CapacityError if e.errno in DISK_FULL else ArenaError
                raise kind(f"NVMe tier cannot prepare its file at {self.path} "
                           f"({HEADER_BYTES + self.capacity_bytes} bytes): {e}") from e
            raise
        # This fd keeps the lock for the arena's life; the I/O fd may be a second, O_DIRECT one.
        self._lock_fd = fd
        self.reused = not created  # an earlier daemon's file (what it held is not valid here: dropped)

    def _prepare_file(self, fd: int) -> None:
        """Refuse a foreign file, write the header, take the disk space (the file is locked)."""
        st = os.fstat(fd)
        if is_foreign(os.pread(fd, len(HEADER), 0)):
            raise ArenaError(f"{self.path} exists and is not a dflash2 NVMe cache file: the NVMe tier "
                             f"would overwrite it (remove it if it is an old cache file, or set "
                             f"memory.nvme_path to another file)")
        total = HEADER_BYTES + self.capacity_bytes
        if (limit := fsize_limit()) is not None and limit < total:
            # (a file reused under the limit was taken, and every write past it failed, EFBIG, as a
            # full disk's: NVMe backed off and came back each second, its slots past it never filled)
            raise CapacityError(f"NVMe tier needs {total} bytes at {self.path}, but this process may not write "
                                f"past byte {limit} of a file (its file size limit, RLIMIT_FSIZE: ulimit -f, "
                                f"systemd's LimitFSIZE): raise the limit or lower memory.nvme_capacity_mb")
        have = min(st.st_blocks * 512, total)  # already allocated, reused
        st_fs = os.fstatvfs(fd)  # the file's own filesystem
        free = st_fs.f_bavail * st_fs.f_frsize
        if total - have > free:
            raise CapacityError(f"NVMe tier needs {total} bytes at {self.path} ({self.capacity_bytes} for blocks "
                                f"and a {HEADER_BYTES}-byte header), only {free + have} free: {ROOM_ADVICE}")
        if st.st_size > total:
            os.ftruncate(fd, total)
        os.pwrite(fd, HEADER.ljust(HEADER_BYTES, b"\0"), 0)  # ours from here on, even if cut short below
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            raise CapacityError(f"NVMe tier needs {total} bytes at {self.path}, preallocation failed: {e}"
                                + {errno.ENOSPC: f": {ROOM_ADVICE}",
                                   errno.EDQUOT: f": {QUOTA_ADVICE}"}.get(e.errno, "")) from e
