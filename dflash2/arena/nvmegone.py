"""An NVMe cache file removed (`rm nvme.cache`, to free the disk) or replaced (a `mv` over it)
while its tier runs: found before each batch, at the background step and at close, and a new file
made at the path as at start-up (header, disk room, the lock); the old file's blocks are forgotten
(misses, said as the file's, not the disk's) and its last descriptors closed, so its room is freed.

Before, nothing noticed (a review): the tier read and wrote the deleted file, its disk room held
out of sight, no line in the log; and the file's lock, which keeps a second daemon off the path
("in use by another process"), went with it: a second daemon on the same memory.nvme_path started
on a new file. A new file that cannot be had (another process holds the path's lock by now, a full
disk, a foreign file put there) is said, naming the path and the cause; the tier then refuses its
writes (ArenaError: the write back-off, backoff.py), its reads are misses, and the file is tried
again at most once a second (RETRY_S: by a write, a re-test or the background step, never a read;
one try of the path's lock), said once a minute, never the deleted one used. The tier's status
shows it (`no_file`). The blocks the old file held leave the cache over the next background steps,
FORGOTTEN_PER_STEP (256) a step (`BlockManager._drop_forgotten`: `forgets`): a file of 10,000 blocks
in about 4 s at the default step, its blocks still counted in the tier's figures meanwhile (a
review), each a miss when asked for.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import numpy as np

from dflash2.arena.nvmefiles import HEADER_BYTES
from dflash2.errors import ArenaError, NoFileError
from dflash2.files import same_file
from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.arena")

MOVED = "was moved away"  # (the file and its disk room live on elsewhere: never said freed, a review)
RETRY_S = 1.0  # a tier without a file tries for one at most this often


def file_gone(fd: int, path: str) -> str | None:
    """What became of the file open on `fd` if `path` no longer names it, else None."""
    try:
        if same_file(fd, path):
            return None
    except OSError as e:  # (a folder of the path replaced by a file, ENOTDIR; no search right, EACCES)
        # Before, this escaped the batch as a raw OSError, taken for the disk's: the mover set the
        # slots aside as bad sectors (a review). The path names no file of the tier's now.
        if not os.path.islink(path):  # (a link into a folder that is a file: said as the link, below)
            return f"can no longer be reached at its path ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})"
    # A link at the path replaced the file only where the file is gone (`rm; ln -s`): one moved away
    # (its link count kept) from behind a link left at the path by an earlier `mv; ln -s` on the same
    # filesystem was said "replaced by a symbolic link", "its disk room freed" (a review).
    removed = os.fstat(fd).st_nlink == 0
    if os.path.islink(path):  # (where it leads is taken as start-up takes it: FileRenewal._renew)
        return f"was replaced by a symbolic link (to {os.path.realpath(path)})" if removed else MOVED
    if os.path.lexists(path):
        return "was replaced (another file is at the path now)"
    return "was removed" if removed else MOVED


def _where(given: str, path: str) -> str:
    """Where a renewal makes the file, `path`, when it is not where the old one was: a link named only
    where `given` is one now (a link removed and a file made at its path was said "where the symbolic
    link leads"; a folder above that is a link repointed the same, a review)."""
    if os.path.islink(given):
        return f"at {path}, where the symbolic link {given} leads"
    return f"at {path}" if path == os.path.normpath(given) else f"at {path}, where the path {given} now leads"


class FileRenewal:
    """NvmeArena's watch on its file's path (the attributes it uses are NvmeArena's: path, _given_path,
    _lock_fd, _fd, _len, _cuts, _preallocate, _open_for_io)."""

    def _init_renewal(self) -> None:
        self._unusable = ""  # why the tier has no file (a new one could not be had), or ""
        self._gone_how = ""  # what became of the old file (kept through the retries: its first cause)
        self._unusable_said = RepeatLimit("batches")
        self._retry_at = 0.0  # (time.monotonic) the next try for a file while the tier has none

    @property
    def forgets(self) -> int:
        return self._cuts.forgets

    @property
    def no_file(self) -> str:
        """Why the tier has no file (status, metrics), or "" while it has one."""
        return self._unusable

    def check_file(self) -> None:
        """(The background step) a removal found while no batch runs: the second daemon the lock
        keeps off the path is kept off within a step, not at the next batch. Skipped while a batch
        holds the tier (it checks for itself): the step never waits for the disk."""
        if self._lock.acquire(blocking=False):
            try:
                if self._ring is not None and (self._lock_fd >= 0 or self._unusable):
                    self._check_file(cut=False, retry=True)
            finally:
                self._lock.release()

    def _check_file(self, write: bool = False, cut: bool = True, renew: bool = True, retry: bool = False) -> None:
        """Under self._lock: the file is still the one its path names (else a new one, `_renew`), and
        whole (nvmecut.py, `cut`). `write`: ArenaError while the tier has no file. While it has none,
        a write or `retry` tries for one (`_retry`); a read never does: its blocks are misses anyway."""
        if self._lock_fd >= 0:
            how = file_gone(self._lock_fd, self.path)
            if how is None:
                if cut:
                    self._cuts.check(self._lock_fd, self.path, HEADER_BYTES + self.capacity_bytes, self._len)
                return
            if not renew:  # (closing: its room is freed as it closes)
                log.warning("NVMe: %s %s while the tier ran; the tier closes", self.path, how)
                return
            self._renew(how)
        elif renew and (write or retry):
            self._retry()
        if write and self._unusable:
            raise NoFileError(f"NVMe tier has no file: {self._unusable}; writes are refused until one can be made at "
                             f"{self.path} (tried again at most once a second)")

    def _retry(self) -> None:
        """A new file tried for while the tier has none: at most once a second, one try of the path's
        lock. Before, every batch (reads too) waited LOCK_WAIT_S for a lock another process holds,
        under the tier's lock on the host backend's one worker thread: acquiring a block from NVMe
        took 264 ms where it took 1.5 ms (a review)."""
        if self._unusable and time.monotonic() >= self._retry_at:
            self._renew("")

    def _forget_all(self) -> int:
        """Every block of the old file forgotten, marked lost to it (misses that blame no slot)."""
        held = self._len != 0
        self._cuts.lost |= held
        self._cuts.forgets += bool(held.any())
        self._len[:] = 0
        return int(np.count_nonzero(held))

    def _close_files(self) -> None:
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def _renew(self, how: str) -> None:
        """A new file at the path, as at start-up; `how`: what became of the old one ("" for a retry)."""
        lost = self._forget_all()
        self._close_files()  # (its last descriptors: the deleted file's disk room is freed)
        self._cuts.renewed()  # (a failed take-back was the old file's: the new one is whole, a review)
        self._gone_how = how or self._gone_how  # (a retry keeps the first cause, a review)
        # The path taken as start-up takes it: a link's target is the file, made where it is not. A link
        # put at the path (`ln -s /mnt/nvme1/nvme.cache nvme.cache`, the cache moved to another disk)
        # was opened as it stood: O_EXCL's EEXIST, then no file to stat, said "removed each of the 3
        # times this start opened it", and the tier had no file for good (a review).
        was, self.path = self.path, os.path.realpath(self._given_path)
        there = "there" if self.path == was else _where(self._given_path, self.path)
        try:
            self._preallocate(None if how else 0)  # (a retry: one try of the lock, never a wait)
            try:
                self.direct_io = self._open_for_io()
            except BaseException:
                if not self.reused:
                    os.unlink(self.path)  # (still locked: a file this call made goes again, as at start-up)
                self._close_files()
                raise
        except (ArenaError, OSError) as e:
            self.path = was  # (the path the tier watched: a retry resolves the link again)
            self._unusable = f"its file {was} {self._gone_how} and a new one cannot be made {there}: {e}"
            self._retry_at = time.monotonic() + RETRY_S
            self._refused(how, lost, e, there)
            return
        if not how:
            log.warning("NVMe: a new file is made %s: the tier takes writes again",
                        f"at {was}" if there == "there" else there,
                        extra={"event": "dflash2_nvme_file_gone", "path": self.path})
        else:
            log.warning("NVMe: %s %s by another process (an rm, a mv) while the tier ran: %d blocks it held are "
                        "lost (misses); a new file is made %s (its header, disk room and lock) and the old one "
                        "closed%s", was, how, lost, there,
                        " (it keeps its disk room where it was moved)" if how == MOVED else ", its disk room freed",
                        extra={"event": "dflash2_nvme_file_gone", "path": self.path})
        self._unusable, self._gone_how, self._unusable_said = "", "", RepeatLimit("batches")

    def _refused(self, how: str, lost: int, error: Exception, there: str) -> None:
        """Say a new file that cannot be had: at once when the old one is found gone, then once a minute.
        `there`: where it was to be made ("there", the path; else a link's target, both named)."""
        if how:
            self._unusable_said = RepeatLimit("batches")
            self._unusable_said.due(self.path)
            log.error("NVMe: %s %s by another process (an rm, a mv) while the tier ran: %d blocks it held are "
                      "lost (misses), and a new file cannot be made %s: %s; the tier refuses writes until one "
                      "can (tried again at most once a second, said once a minute)", self.path, how, lost, there,
                      error, extra={"event": "dflash2_nvme_file_gone", "path": self.path})
            return
        more = self._unusable_said.due(self.path)
        if more is not None:
            log.error("NVMe: still no file %s for the tier: %s; writes are refused%s",
                      f"at {self.path}" if there == "there" else there, error, more)
