"""The host transfer backend: copies batches between host arenas on one worker thread.

memory → memory: numpy copies between views, block by block (fine on a host);
memory → storage: one `write_blocks` call for the whole batch (blocks whose own slot could not be
written, EIO, fail: `CopyJob.unwritable`);
storage → memory: one `read_blocks` call into the destination views (per-block success from the
checksums: a mismatch is a miss, `CopyJob.unreadable`).

Invariants: `start` returns at once; batches run one at a time in the order they were started; an
exception during a copy fails the whole batch (every block False) and is logged, never lost and
never raised from `wait`; every batch `start` accepted is run before `close` returns (a start racing
close from another thread is either refused or queued ahead of the worker's stop marker, never
behind it, where nobody would run it and its `wait` would hang).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping

import numpy as np

from dflash2 import threads
from dflash2.arena.base import Arena, MemoryArena, StorageArena
from dflash2.errors import ArenaError
from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch, CopyJob, TransferBackend
from dflash2.transfer.doorbell import COMPLETIONS
from dflash2.transfer.failures import FailureLog

log = logging.getLogger("dflash2.transfer.host")


def written_mask(written, n: int) -> np.ndarray:
    """StorageArena.write_blocks' answer for a batch of n blocks, checked: one bool per block."""
    mask = np.asarray(written) if written is not None else None
    if mask is None or mask.dtype != bool or mask.shape != (n,):
        raise ArenaError(f"write_blocks of {n} blocks answered {written!r}, not one bool per block")
    return mask


class HostCopyJob(CopyJob):
    def __init__(self, batch: CopyBatch):
        self.batch = batch
        self._done = threading.Event()
        self._ok: np.ndarray | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> np.ndarray:
        self._done.wait()
        return self._ok

    def _finish(self, ok: np.ndarray) -> None:
        self._ok = ok
        self._done.set()
        COMPLETIONS.ring()  # (after `done`: whoever the bell wakes finds the job done)


class HostTransferBackend(TransferBackend):
    def __init__(self, arenas: Mapping[Tier, Arena]):
        self._arenas = dict(arenas)
        self._queue: queue.Queue[HostCopyJob | None] = queue.Queue()
        self._closed = False
        self._gate = threading.Lock()  # makes "not closed, so queue it" one step against close()
        self._failures = FailureLog(log, "host copy")  # one traceback a minute per kind of failure
        self._thread = threading.Thread(target=self._serve, name="dflash2-host-transfer", daemon=True)
        threads.start(self._thread)  # stop signals go to the main thread (threads.py)

    def start(self, batch: CopyBatch) -> HostCopyJob:
        for tier in (batch.src_tier, batch.dst_tier):
            if tier not in self._arenas:
                raise ValueError(f"host transfer backend has no arena for tier {tier.label}")
        src, dst = self._arenas[batch.src_tier], self._arenas[batch.dst_tier]
        if isinstance(src, StorageArena) and isinstance(dst, StorageArena):
            raise ValueError(f"storage to storage copies ({batch.src_tier.label} → {batch.dst_tier.label}) "
                             f"are not supported: go through a memory tier")
        job = HostCopyJob(batch)
        with self._gate:
            if self._closed:
                raise ArenaError("host transfer backend is closed")
            self._queue.put(job)
        return job

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            started = time.perf_counter()
            try:
                ok = self._copy(job)
            except Exception as e:
                self._failures.failed(job.batch, e)
                ok = np.zeros(len(job.batch), dtype=bool)
            job.seconds = time.perf_counter() - started  # one batch at a time: all of it is this batch's
            job._finish(ok)

    def _copy(self, job: HostCopyJob) -> np.ndarray:
        batch = job.batch
        src, dst = self._arenas[batch.src_tier], self._arenas[batch.dst_tier]
        sizes = batch.nbytes.tolist()
        if isinstance(dst, StorageArena):
            srcs = [src.view(o, n) for o, n in zip(batch.src_offsets.tolist(), sizes)]
            written = written_mask(dst.write_blocks(batch.dst_offsets, srcs), len(batch))
            job.unwritable = ~written
            return written
        dsts = [dst.view(o, n) for o, n in zip(batch.dst_offsets.tolist(), sizes)]
        if isinstance(src, StorageArena):
            job.unreadable = np.ones(len(batch), dtype=bool)  # (a read that raises, a dead disk: all the disk's)
            ok = np.asarray(src.read_blocks(batch.src_offsets, dsts), dtype=bool)
            job.unreadable = ~ok
            return ok
        assert isinstance(src, MemoryArena)
        for o, n, d in zip(batch.src_offsets.tolist(), sizes, dsts):
            d[:] = src.view(o, n)
        return np.ones(len(batch), dtype=bool)

    def close(self) -> None:
        """Finish the batches already started, then stop the worker. Idempotent: every call returns
        only once the worker has stopped (a second caller does not return while batches still run)."""
        with self._gate:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._thread.join()
