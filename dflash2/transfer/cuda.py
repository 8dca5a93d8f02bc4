"""The CUDA transfer backend: an HBM↔DRAM batch is one launch of the copy kernel or one batched
copy-engine submission (`dflash2.transfer.route` picks by block size, direction and whether the
other direction is busy), on a stream per direction so both directions overlap, completion by
events. Moves that touch NVMe go through a pinned staging buffer: HBM→NVMe gathers into it with
the kernel and then writes it to the file in one batch; NVMe→HBM reads into it and scatters from it.
DRAM↔NVMe is host I/O, done by the host backend.

Invariant: `start` only queues work; the source bytes stay untouched until the job is waited for
(the mover keeps the blocks MIGRATING, which nobody may free or write).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from dflash2 import threads
from dflash2.arena.base import Arena, StorageArena
from dflash2.cuda import cupy, event_passed, on_device
from dflash2.cuda.arena import CudaArena, PinnedBuffer, PinnedRegion
from dflash2.cuda.copy_engine import CopyEngineBatch
from dflash2.cuda.kernels import CopyKernel
from dflash2.errors import ArenaError
from dflash2.tiers import Tier
from dflash2.transfer import route
from dflash2.transfer.base import CopyBatch, CopyJob, TransferBackend
from dflash2.transfer.doorbell import COMPLETIONS
from dflash2.transfer.failures import FailureLog
from dflash2.transfer.host import HostTransferBackend, written_mask

log = logging.getLogger("dflash2.transfer.cuda")

TIMED_EVERY_S = 1.0  # seconds per direction between two batches timed on the device
STAGE_ALIGN = 4096  # each block's place in the staging buffer (the NVMe tier's O_DIRECT I/O lands there)


def staged_parts(nbytes: np.ndarray, staging_bytes: int) -> list[np.ndarray]:
    """Index runs of a batch whose blocks fit the staging buffer together, in batch order, each block
    at a STAGE_ALIGN-aligned place. A block larger than the whole buffer cannot move between HBM and
    NVMe: it is in no run, so it fails and stays where it was (read back from NVMe, a miss), and an
    error line says so and names the key to raise: never a silent failure."""
    parts, run, used, too_big = [], [], 0, []
    for i, n in enumerate(np.asarray(nbytes).tolist()):
        size = -(-n // STAGE_ALIGN) * STAGE_ALIGN
        if size > staging_bytes:
            too_big.append(n)
            continue
        if used + size > staging_bytes:
            parts.append(np.asarray(run, dtype=np.int64))
            run, used = [], 0
        run.append(i)
        used += size
    if run:
        parts.append(np.asarray(run, dtype=np.int64))
    if too_big:
        log.error("%d blocks of %d bytes or more cannot move between HBM and NVMe: each is larger than the GPU "
                  "staging buffer of %d bytes (raise memory.staging_buffer_size_mb); they stay where they were "
                  "(those on NVMe are dropped: a miss)",
                  len(too_big), min(too_big), staging_bytes)
    return parts


class KernelJob(CopyJob):
    """A batch queued on a stream; done when its event has passed."""

    def __init__(self, batch: CopyBatch, event, keep=(), began=None, on_error=None):
        self.batch = batch
        self._on_error = on_error  # the backend's check of the GPU after a failure
        self._event = event
        self._began = began  # recorded on the stream just before the copy: the device times it
        self._keep = keep  # buffers the queued copy still reads

    def done(self) -> bool:
        return event_passed(self._event)  # (failed too: `wait` then says so, and checks the GPU)

    def wait(self) -> np.ndarray:
        try:
            self._event.synchronize()
        except Exception as e:  # a launch that failed: the whole batch failed, the blocks stay put
            log.exception("copy kernel of %d blocks failed", len(self.batch))
            if self._on_error is not None:
                self._on_error(e)
            return np.zeros(len(self.batch), dtype=bool)
        self._keep = ()
        if self._began is not None and self.seconds is None:
            try:
                self.seconds = cupy().cuda.get_elapsed_time(self._began, self._event) / 1e3
            except Exception:  # the copy landed: only its timing (a read-cost sample) is lost
                log.warning("timing a copy of %d blocks failed; the read-cost figure skips it", len(self.batch),
                            exc_info=True)
            self._began = None
        return np.ones(len(self.batch), dtype=bool)


class StagedJob(CopyJob):
    """A batch between HBM and NVMe, run through the staging buffer on a worker thread."""

    def __init__(self, batch: CopyBatch):
        self.batch = batch
        self._done = threading.Event()
        self._ok = np.zeros(len(batch), dtype=bool)
        # A read's blocks the disk failed (`CopyJob.unreadable`), set chunk by chunk: a chunk never
        # tried, or one whose GPU copy failed after the read, is not the disk's (its blocks stay on NVMe).
        self.unreadable = np.zeros(len(batch), dtype=bool) if batch.src_tier == Tier.NVME else None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> np.ndarray:
        self._done.wait()
        return self._ok


class CudaTransferBackend(TransferBackend):
    def __init__(self, arenas: dict[Tier, Arena], dram_region: PinnedRegion | None, staging_bytes: int):
        cp = cupy()
        hbm = arenas[Tier.HBM]
        if not isinstance(hbm, CudaArena):
            raise TypeError("the CUDA backend needs a CudaArena for the HBM tier")
        self.hbm = hbm
        self.device = hbm.device
        self.arenas = arenas
        self.dram = dram_region
        self.kernel = CopyKernel(self.device)
        self.engines = CopyEngineBatch()
        with on_device(self.device):
            self.d2h = cp.cuda.Stream(non_blocking=True)
            self.h2d = cp.cuda.Stream(non_blocking=True)
        # per direction (device to host?): the event of its last batch and when that batch started
        self._last: dict[bool, tuple[object, float]] = {}
        # batches started, by (device to host?, mechanism)
        self.launches: collections.Counter = collections.Counter()
        self._timed_at = {True: -float("inf"), False: -float("inf")}  # when a batch was last timed
        # The staging buffer first: when it cannot be had (CapacityError), no host thread is left running.
        self.staging = PinnedBuffer(staging_bytes, self.device) if Tier.NVME in arenas else None
        self.host = HostTransferBackend({t: a for t, a in arenas.items() if t != Tier.HBM})
        if self.staging is not None:  # HBM<->NVMe moves go through the staging buffer, whole blocks
            self.max_block_bytes = self.staging.nbytes // STAGE_ALIGN * STAGE_ALIGN
        self._staging_lock = threading.Lock()
        self._staged_failures = FailureLog(log, "staged move")
        # One queueing onto the streams at a time: a timed batch's start event, its copies and its end
        # event go on its stream with no staged kernel (another thread) between them.
        self._queue_lock = threading.Lock()
        self._workers: list[threading.Thread] = []  # staged moves' threads (close waits for them)
        self._closed = False  # the daemon starts and closes from one thread: no race to guard

    def start(self, batch: CopyBatch) -> CopyJob:
        if self._closed:  # its staging buffer is freed: a staged move would write through a dangling pointer
            raise ArenaError("CUDA transfer backend is closed")
        pair = (batch.src_tier, batch.dst_tier)
        if Tier.HBM not in pair:
            return self.host.start(batch)
        if Tier.NVME in pair:
            job = StagedJob(batch)
            worker = threading.Thread(target=self._staged, args=(job,), name="dflash2-staged", daemon=True)
            # Kept until close(), which waits for them: the staging buffer must outlive every move using it.
            # Kept once started: one that could not start (a container's pids.max) made close() raise
            # "cannot join thread before it is started" and skip its clean-up (a review).
            self._workers = [t for t in self._workers if t.is_alive()]
            threads.start(worker)
            self._workers.append(worker)
            return job
        if self.dram is None:
            raise ValueError("no pinned DRAM region: HBM<->DRAM moves are unavailable")
        to_host = batch.src_tier == Tier.HBM
        stream = self.d2h if to_host else self.h2d
        src = self.hbm.ptr if to_host else self.dram.device_ptr
        dst = self.dram.device_ptr if to_host else self.hbm.ptr
        # blocks side by side in both arenas move as one copy
        src_off, dst_off, nbytes = route.coalesce(batch.src_offsets, batch.dst_offsets, batch.nbytes)
        # At most one batch per direction and TIMED_EVERY_S is timed on the device (the read-cost
        # figures): timing events on every batch cost 16 KiB batches 5% of their speed (bench transfer).
        now = time.monotonic()
        timed = now - self._timed_at[to_host] >= TIMED_EVERY_S
        if timed:
            self._timed_at[to_host] = now
        try:
            event, keep, began = self._launch(to_host, stream, src, dst, src_off, dst_off, nbytes, timed, now)
        except Exception as e:
            self.check_gpu(e)
            raise
        self._last[to_host] = (event, now)
        return KernelJob(batch, event, keep, began, self.check_gpu)

    def _launch(self, to_host, stream, src, dst, src_off, dst_off, nbytes, timed, now):
        """Queue one HBM<->DRAM batch on its direction's stream: (its end event, buffers it reads, its
        start event when timed)."""
        cp = cupy()
        keep = ()
        with self._queue_lock, on_device(self.device):
            began = None
            if timed:
                began = cp.cuda.Event()
                began.record(stream)
            other = self._last.get(not to_host)
            busy = route.other_busy(other is not None and not event_passed(other[0]),
                                    None if other is None else now - other[1])
            # route.split: the engines take the batch, or a mix's large copies, and the kernel the
            # rest, one after the other on the direction's stream (the batch's end event covers both).
            engines = route.split(nbytes, to_host, busy, self.engines.available)
            kernel = ~engines
            if engines.any():
                try:
                    keep = self.engines.launch(stream.ptr, dst, src, dst_off[engines], src_off[engines],
                                               nbytes[engines])
                    self.launches[(to_host, route.Mechanism.ENGINES)] += 1
                except ArenaError as e:
                    self.check_gpu(e)
                    if self.fatal is not None:  # the GPU failed, not the engines
                        raise
                    # The driver refused it: the kernel moves this batch (slices that landed before
                    # the refusal are copied again, the same bytes) and every later one, said once.
                    log.error("the copy engines failed (%s): this and every later HBM<->DRAM batch of GPU %d "
                              "moves with the copy kernel", e, self.device)
                    self.engines.withdraw()
                    kernel = np.ones(len(nbytes), dtype=bool)
            if kernel.all():  # the whole batch (the common case): its arrays as they are, no copies
                self.kernel.launch(stream, src, dst, src_off, dst_off, nbytes)
                self.launches[(to_host, route.Mechanism.KERNEL)] += 1
            elif kernel.any():
                self.kernel.launch(stream, src, dst, src_off[kernel], dst_off[kernel], nbytes[kernel])
                self.launches[(to_host, route.Mechanism.KERNEL)] += 1
            event = cp.cuda.Event(disable_timing=not timed)  # timed: with `began`, the copy's own time
            event.record(stream)
        return event, keep, began

    def copy_batches(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (to_host, mechanism), n in sorted(self.launches.items(), key=lambda kv: (not kv[0][0], kv[0][1].value)):
            out.setdefault("hbm->dram" if to_host else "dram->hbm", {})[mechanism.value] = n
        return out

    def check_gpu(self, error: BaseException) -> None:
        """A copy failed: is the GPU's CUDA context still usable? After a sticky error (an illegal
        address, an uncorrectable ECC error, a GPU fallen off the bus) every later CUDA call fails
        the same way: the backend is dead (`fatal`), and the daemon exits so that its supervisor
        restarts it. A failure that leaves the context usable (a refused launch, a disk error) is not."""
        if self.fatal is not None:
            return
        try:
            with on_device(self.device):
                cupy().cuda.runtime.deviceSynchronize()
        except Exception as probe:
            self.fatal = f"GPU {self.device}: the CUDA context is lost ({probe}; the first failure: {error})"
            log.critical("%s: no move can run on this GPU any more", self.fatal)

    # -- NVMe through the staging buffer -----------------------------------------------------
    def _staged(self, job: StagedJob) -> None:
        settled = 0  # blocks of the batch whose chunks ended (each chunk's copies waited for)
        ended = np.zeros(len(job.batch), dtype=bool)  # ... which those are
        tried = np.zeros(len(job.batch), dtype=bool)  # blocks of the chunks begun (read, for a read)
        try:
            with self._staging_lock:
                started = time.perf_counter()  # once the staging buffer is this batch's alone
                for part in staged_parts(job.batch.nbytes, self.staging.nbytes):
                    tried[part] = True
                    try:
                        job._ok[part] = self._staged_chunk(job, part)
                        settled += len(part)  # (done: a chunk that failed alone is not, a review)
                        ended[part] = True
                    except ArenaError as e:
                        if job.batch.src_tier == Tier.HBM:
                            raise  # (a write's later chunks stay where they are, blamed on nothing)
                        # A read none of whose chunk's blocks could be read (bad sectors) fails that
                        # chunk alone, as the host path's read of a batch: its later chunks are read
                        # still. Before, they failed untried: dropped as misses, their sound slots
                        # set aside as unreadable (a review). A launch that failed on a lost GPU ends it.
                        self.check_gpu(e)
                        if self.fatal is not None:
                            raise
                        # How many of the chunk the disk failed (dropped), not whether any did: a chunk
                        # with one block failing its checksum was said dropped whole (a review).
                        self._staged_failures.failed(job.batch, e, settled=settled, part=len(part),
                                                     unread=int(job.unreadable[part].sum()))
                job.seconds = time.perf_counter() - started
        except Exception as e:
            # The chunks that ended before keep their verdicts (their blocks were written, or read,
            # checked and copied; `_ok` starts False): the failed chunk and those after it fail.
            # Before, the whole batch did: a read's blocks that had arrived were dropped as misses,
            # and their NVMe slots set aside as if unreadable (quarantine.py).
            # Of the blocks failed, those the disk failed are dropped; the chunks never begun were not
            # read (they were said read, their copy failed: a review), and stay on NVMe too.
            unread = None if job.unreadable is None else int(job.unreadable[~ended].sum())
            # (a full disk fails every retry: not a traceback each)
            self._staged_failures.failed(job.batch, e, settled=settled, unread=unread,
                                         not_read=int((~tried).sum()))
            self.check_gpu(e)
        finally:
            if job.unreadable is not None and not tried.all():
                job.not_read = ~tried
            job._done.set()
            COMPLETIONS.ring()  # (after `done`: whoever the bell wakes finds the job done)

    def _staged_chunk(self, job: StagedJob, part: np.ndarray) -> np.ndarray:
        """One run from staged_parts: its blocks fit the staging buffer together."""
        batch = job.batch
        nbytes = batch.nbytes[part]
        slots = -(-nbytes // STAGE_ALIGN) * STAGE_ALIGN
        stage_off = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
        views = [self.staging.array[o:o + n] for o, n in zip(stage_off.tolist(), nbytes.tolist())]
        nvme: StorageArena = self.arenas[Tier.NVME]
        if batch.src_tier == Tier.HBM:
            self._staged_copy(self.d2h, self.hbm.ptr, self.staging.device_ptr, batch.src_offsets[part], stage_off,
                              nbytes)
            written = written_mask(nvme.write_blocks(batch.dst_offsets[part].tolist(), views), len(part))
            if job.unwritable is None:
                job.unwritable = np.zeros(len(batch), dtype=bool)
            job.unwritable[part] = ~written
            return written
        try:
            ok = np.asarray(nvme.read_blocks(batch.src_offsets[part].tolist(), views), dtype=bool)
        except BaseException:
            job.unreadable[part] = True  # (a chunk none of whose blocks could be read: a dead disk's)
            raise
        job.unreadable[part] = ~ok
        good = np.flatnonzero(ok)
        # A failure from here on is the GPU's, not the disk's: the chunk fails, its blocks stay on NVMe.
        self._staged_copy(self.h2d, self.staging.device_ptr, self.hbm.ptr, stage_off[good],
                          batch.dst_offsets[part][good], nbytes[good])
        return ok

    def _staged_copy(self, stream, src, dst, src_off, dst_off, nbytes) -> None:
        """One kernel between HBM and the staging buffer, waited for by its own event. It is queued
        on the direction's in-order stream, so it does wait for that direction's HBM<->DRAM batches
        queued before it (and the caller holds `_staging_lock` meanwhile): latency only, the
        staged chunk's copy starting once theirs have ended (an earlier docstring said it need not)."""
        cp = cupy()
        with self._queue_lock, on_device(self.device):
            self.kernel.launch(stream, src, dst, src_off, dst_off, nbytes)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        with on_device(self.device):
            done.synchronize()

    def close(self) -> None:
        """Finish the moves already started (staged ones too: their thread uses the staging buffer
        freed below), then release streams and buffers. Idempotent; a later start is refused."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.join()
        self._workers = []
        self.host.close()
        cp = cupy()
        try:
            with on_device(self.device):
                cp.cuda.runtime.deviceSynchronize()
            if self.staging is not None:
                self.staging.close()
        except Exception:
            if self.fatal is None:
                raise
            log.warning("GPU %d: streams and staging buffer not released (its CUDA context is lost)", self.device)
