"""An NVMe cache file cut short by another process while its tier runs (`: > nvme.cache` to free the
disk, a copytruncate-style tool): found before each batch and at close, taken back (its header and
its disk room again), and the blocks it lost forgotten: misses, said as the file's, not the disk's.

Before, the tier noticed nothing: its later writes grew a sparse file whose header page was a hole,
which the next start refused as "not a dflash2 NVMe cache file" (exit 4 until removed by hand);
reads past the cut failed as "preadv moved 0 bytes", and their slots were set aside as bad sectors
until the disk was said to be failing (reviews' scripts). A cut that lands while a batch writes may
be grown back over by that batch (its last slot restores the size): the header page, a hole then,
says so, and every block is taken as lost, the point of the cut being unknown; so is every block
of a file whose header page another program wrote over (said as such, not as a cut). A cut that kept
the header page and was grown back over is not seen: its blocks fail their checksums when read
(misses, never wrong bytes, but counted as the disk's).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from dflash2.arena.nvmefiles import HEADER, HEADER_BYTES
from dflash2.arena.staging import ALIGN
from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.arena")


class FileCuts:
    """The slots (ALIGN-byte units of the tier) whose blocks a cut took: their reads are misses that
    blame neither slot nor disk (`lost`), until the slot is written or forgotten again."""

    def __init__(self, nslots: int):
        self.lost = np.zeros(nslots, dtype=bool)
        self.forgets = 0  # times blocks were lost to the file (a cut, nvmegone.py's removal): `StorageArena.forgets`
        self._failing = False  # a cut was said and its take-back fails (tried again each batch)
        self._said = RepeatLimit("batches")  # a take-back that keeps failing: once a minute

    def renewed(self) -> None:
        """A new file at the path (nvmegone.py): a take-back still failing was the old file's. Before,
        the new, whole file was said "taken back" at its next batch (a review)."""
        self._failing, self._said = False, RepeatLimit("batches")

    def check(self, fd: int, path: str, total: int, lens: np.ndarray) -> None:
        """Whether the file open on `fd` is still the tier's whole file of `total` bytes, its header
        first; if not, take it back and forget (`lens` = 0) the blocks lost, said in the log."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, len(HEADER), 0) if size >= len(HEADER) else b""
        if size >= total and head == HEADER:
            if self._failing:  # (grown whole by the tier's own writes: its disk room is still to take)
                self._take_back(fd, path, "", total, size, 0)
            return
        first = max(0, size - HEADER_BYTES) // ALIGN if head == HEADER else 0
        # ... and those that begin before the cut and reach past it (their tails are holes now).
        begun = np.flatnonzero(lens[:first])
        first = min([first, *begun[begun * ALIGN + lens[begun] > size - HEADER_BYTES].tolist()])
        lost = lens[first:] != 0
        self.lost[first:] |= lost
        self.forgets += bool(lost.any())
        lens[first:] = 0
        if head == HEADER or size < total:
            how = f"was cut to {size} bytes by another process"
        elif not head.strip(b"\0"):
            how = "was cut and grown again by another process (its header page is a hole)"
        else:  # (same size, header bytes written over: not a cut, a review; where it began is unknown)
            how = ("had its header page written over (not cut: the size is whole); find what writes to it "
                   "(a dd, a copy, another program given this path)")
        self._take_back(fd, path, how, total, size, int(lost.sum()))

    def _take_back(self, fd: int, path: str, how: str, total: int, size: int, lost: int) -> None:
        """The header and the disk room again, said in the log (`how`: what happened to the file)."""
        try:
            os.pwrite(fd, HEADER.ljust(HEADER_BYTES, b"\0"), 0)
            os.posix_fallocate(fd, 0, total)
        except OSError as e:  # (its writes then fail as the disk's, and say so; tried again each batch)
            self._unmended(path, how, total, size, lost, e)
            return
        if self._failing and not lost:  # (the cut said already: its take-back at last)
            self._failing, self._said = False, RepeatLimit("batches")
            log.warning("NVMe: %s (%d bytes) is taken back to %d bytes, its header and disk room again", path, size,
                        total, extra={"event": "dflash2_nvme_file_cut", "path": path, "size": size})
            return
        self._failing = False
        log.warning("NVMe: %s %s (the tier's file is %d bytes): %d blocks past the damage are lost (misses); its "
                    "header and disk room are taken again", path, how, total, lost,
                    extra={"event": "dflash2_nvme_file_cut", "path": path, "size": size})

    def _unmended(self, path: str, how: str, total: int, size: int, lost: int, error: OSError) -> None:
        """Log a take-back that failed (a full disk, a file size limit): at once the first time, then,
        while it keeps failing (however) and nothing more is lost, once a minute with the count of
        batches since, whatever the file's size (the tier's own writes past its end grow it). Before,
        every later batch logged the cut again, with a warning that said its room was taken again, and
        the failure: two lines a batch while the disk stayed full; then, keyed on the size, a line a
        batch as the tier's writes grew the file, each blaming another process (reviews)."""
        if lost == 0 and self._failing:  # (however it fails now: the cut was said, a review)
            more = self._said.due(path)
            if more is not None:
                log.error("NVMe: %s still cannot be taken back to %d bytes (%d now): %s; writes past its end may "
                          "fail as the disk's until it can%s", path, total, size, error, more)
            return
        self._failing = True  # (the cut said, its take-back failing)
        self._said = RepeatLimit("batches")  # (this line starts the minute and the count: a review)
        self._said.due(path)
        log.error("NVMe: %s %s (the tier's file is %d bytes): %d blocks past the damage are lost (misses); it "
                  "cannot be taken back to %d bytes: %s (tried again at each batch, said once a minute)", path, how,
                  total, lost, total, error, extra={"event": "dflash2_nvme_file_cut", "path": path, "size": size})
