"""Logging of failed copy batches, rate-limited per kind of failure.

A failing disk (ENOSPC, EIO) fails every batch the background step retries, several a second; one
traceback per batch filled the daemon's log (a soak: 10,127 tracebacks, 27.9 MB, in 45 s of a full
disk). A `FailureLog` logs a failure (with its traceback, unless the disk is full) once per REPEAT_LOG_S for each kind
(direction, exception type, errno), and the next one it logs says how many it left out. The same
limit (`RepeatLimit`) serves the mover's warnings about failed batches and the NVMe tier's about
reads it had to retry block by block.

Invariant: every failure is either logged or counted in the next logged line of its kind; none is
dropped unsaid.
"""

from __future__ import annotations

import logging
import threading
import time

from dflash2.errors import DISK_FULL, NoFileError
from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch

REPEAT_LOG_S = 60.0  # a failure of the same kind is logged with its traceback at most this often


class RepeatLimit:
    """Once per REPEAT_LOG_S for each kind (any hashable key): `due(kind)` says whether a line of that
    kind is to be logged now, and if so the suffix it ends with, counting what was left out since
    the last one logged (None: not now; it is counted for the next). Thread-safe (the CUDA backend's
    staged moves fail on their own threads)."""

    def __init__(self, noun: str):
        self._noun = noun  # what is counted: "failures", "batches"
        self._lock = threading.Lock()
        self._seen: dict = {}  # kind -> (last logged, left out since, their blocks)

    def due(self, kind, blocks: int | None = None) -> str | None:
        now = time.monotonic()
        with self._lock:
            last, quiet, quiet_blocks = self._seen.get(kind, (None, 0, 0))
            if last is not None and now - last < REPEAT_LOG_S:
                self._seen[kind] = (last, quiet + 1, quiet_blocks + (blocks or 0))
                return None
            self._seen[kind] = (now, 0, 0)
        if not quiet:
            return ""
        of = "" if blocks is None else f" ({quiet_blocks} blocks)"
        return (f" ({quiet} more such {self._noun}{of} since the last one logged, {now - last:.0f} s ago, "
                "were not logged)")


class FailureLog:
    def __init__(self, logger: logging.Logger, what: str):
        self._log = logger
        self._what = what  # names the copy in the message: "host copy", "staged move"
        self._limit = RepeatLimit("failures")

    def failed(self, batch: CopyBatch, error: BaseException, settled: int = 0, part: int | None = None,
               unread: int | None = None, not_read: int = 0) -> None:
        """Log `batch`'s failure unless one of its kind was logged in the last REPEAT_LOG_S. Called
        from the `except` block that caught `error` (log.exception keeps its traceback). `settled`:
        blocks of the batch that had moved before it failed (a staged move's earlier chunks); `part`:
        the blocks of the one chunk that failed, the batch going on past it (a staged read's). For a
        read out of NVMe, `unread`: how many of the failed blocks the disk failed to read, dropped
        (None: all of them, a backend that does not tell them apart); `not_read`: how many were never
        read (a batch ended by an exception before their chunk); the others the disk did read, their
        GPU copy failed, and they stay on NVMe (`CopyJob.unreadable`)."""
        cause = error.__cause__ if error.__cause__ is not None else error
        more = self._limit.due((batch.src_tier, batch.dst_tier, type(cause).__name__, getattr(cause, "errno", None)))
        if more is None:
            return
        failed = part if part is not None else len(batch) - settled
        then = self._then(batch.src_tier, failed, unread, not_read)
        how = "as a whole" if not settled else f"after its first {settled} were done, for the {len(batch) - settled} others"
        if part is not None:
            how = f"for a chunk of {part} of them, the others going on"
            then = then.replace("its blocks are", "that chunk's are").replace("its blocks", "that chunk's blocks")
        args = (self._what, len(batch), batch.total_bytes, batch.src_tier.label, batch.dst_tier.label, how, then, more)
        # A full disk is the disk's state, not a fault in the code: no traceback (one a minute of a
        # full disk was a screen of frames that said nothing more).
        # So is a tier without its file (removed, none can be made: said by the tier, nvmegone.py; a review).
        if isinstance(cause, OSError) and cause.errno in DISK_FULL or isinstance(cause, NoFileError):
            self._log.error("%s of %d blocks (%d bytes) %s → %s failed %s; %s%s: %s", *args, error)
        else:
            self._log.exception("%s of %d blocks (%d bytes) %s → %s failed %s; %s%s", *args)

    @staticmethod
    def _then(src: Tier, failed: int, unread: int | None, not_read: int) -> str:
        """What the mover does with the `failed` blocks (mover.py): those of a read back from NVMe that
        the disk failed are a miss, since their stored bytes are not to be trusted; any other stays
        where it was. A chunk of which one block failed its checksum and whose GPU copy then failed was
        said "dropped from the cache, a miss each", all of it, while the mover kept the others on NVMe
        (a review)."""
        if src != Tier.NVME:
            return "its blocks stay where they were"
        if unread is None or unread >= failed:
            return "its blocks are dropped from the cache, a miss each"
        said = [f"{unread} of them dropped from the cache (the disk failed their read)"] if unread else []
        copied = failed - unread - not_read
        if copied and not said and not not_read:
            said.append("its blocks stay where they were (the disk read them: the copy on from the staging buffer "
                        "failed)")
        elif copied:
            said.append("the others stay on NVMe (their copy failed)" if not not_read
                        else f"{copied} of them stay on NVMe (the disk read them, their copy failed)")
        if not_read:
            said.append(f"{not_read} not read (the batch ended before them): they stay on NVMe")
        return ", ".join(said)
