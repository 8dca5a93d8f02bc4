"""Logging of failed copy batches, rate-limited per kind of failure.

A failing disk (ENOSPC, EIO) fails every batch the background step retries, several a second; one
traceback per batch filled the daemon's log (a soak: 10,127 tracebacks, 27.9 MB, in 45 s of a full
disk). A `FailureLog` logs a failure with its traceback once per REPEAT_LOG_S for each kind
(direction, exception type, errno), and the next one it logs says how many it left out.

Invariant: every failure is either logged or counted in the next logged line of its kind; none is
dropped unsaid.
"""

from __future__ import annotations

import logging
import threading
import time

from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch

REPEAT_LOG_S = 60.0  # a failure of the same kind is logged with its traceback at most this often


class FailureLog:
    def __init__(self, logger: logging.Logger, what: str):
        self._log = logger
        self._what = what  # names the copy in the message: "host copy", "staged move"
        self._lock = threading.Lock()  # the CUDA backend's staged moves fail on their own threads
        self._seen: dict[tuple, tuple[float, int]] = {}  # kind of failure -> (last logged, not logged since)

    def failed(self, batch: CopyBatch, error: BaseException) -> None:
        """Log `batch`'s failure unless one of its kind was logged in the last REPEAT_LOG_S. Called
        from the `except` block that caught `error` (log.exception keeps its traceback)."""
        cause = error.__cause__ if error.__cause__ is not None else error
        key = (batch.src_tier, batch.dst_tier, type(cause).__name__, getattr(cause, "errno", None))
        now = time.monotonic()
        with self._lock:
            last, quiet = self._seen.get(key, (None, 0))
            if last is not None and now - last < REPEAT_LOG_S:
                self._seen[key] = (last, quiet + 1)
                return
            self._seen[key] = (now, 0)
        more = (f" ({quiet} more such failures since the last one logged, {now - last:.0f} s ago, were not logged)"
                if quiet else "")
        # What the mover does with a failed batch (mover.py): a read back from NVMe is a miss, since
        # its stored bytes are not to be trusted; any other copy leaves its blocks where they were.
        then = ("its blocks are dropped from the cache, a miss each" if batch.src_tier == Tier.NVME
                else "its blocks stay where they were")
        self._log.exception("%s of %d blocks (%d bytes) %s → %s failed as a whole; %s%s", self._what, len(batch),
                            batch.total_bytes, batch.src_tier.label, batch.dst_tier.label, then, more)
