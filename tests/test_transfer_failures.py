"""FailureLog: a failed batch's traceback is logged once per REPEAT_LOG_S for each kind of failure,
and the next line of that kind counts those left out."""

from __future__ import annotations

import errno
import logging

import numpy as np
import pytest

from dflash2.tiers import Tier
from dflash2.transfer import failures
from dflash2.transfer.base import CopyBatch
from dflash2.transfer.failures import REPEAT_LOG_S, FailureLog

log = logging.getLogger("dflash2.test.failures")


def _batch(src, dst):
    one = np.zeros(1, dtype=np.int64)
    return CopyBatch(src, dst, one, one.copy(), np.full(1, 4096, dtype=np.int64))


def _fail(fl, batch, error):
    try:
        raise error
    except OSError as e:
        fl.failed(batch, e)


def test_each_kind_is_logged_once_a_minute_and_the_next_line_counts_the_rest(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: now[0])
    fl = FailureLog(log, "host copy")
    down = _batch(Tier.DRAM, Tier.NVME)
    with caplog.at_level(logging.ERROR, logger=log.name):
        for _ in range(30):
            _fail(fl, down, OSError(errno.ENOSPC, "full"))
        _fail(fl, down, OSError(errno.EIO, "bad sector"))          # another errno: its own kind
        _fail(fl, _batch(Tier.NVME, Tier.DRAM), OSError(errno.ENOSPC, "full"))  # another direction
        assert len(caplog.records) == 3
        # A full disk names its error without a traceback; any other failure keeps its traceback.
        assert [r.exc_info is not None for r in caplog.records] == [False, True, False]
        assert caplog.records[0].getMessage().endswith(": [Errno 28] full"), caplog.records[0].getMessage()
        now[0] += REPEAT_LOG_S - 1
        _fail(fl, down, OSError(errno.ENOSPC, "full"))
        assert len(caplog.records) == 3
        now[0] += 1
        _fail(fl, down, OSError(errno.ENOSPC, "full"))
    assert len(caplog.records) == 4
    last = caplog.records[-1].getMessage()
    assert "host copy of 1 blocks (4096 bytes) dram → nvme failed as a whole; its blocks stay where they were" in last
    # A failed read back from NVMe is what drops its blocks (a write's stay where they were: the
    # line said "the whole batch is a miss" for both).
    up = [r.getMessage() for r in caplog.records if "nvme → dram" in r.getMessage()]
    assert up and "its blocks are dropped from the cache, a miss each" in up[0], up
    assert "(30 more such failures since the last one logged, 60 s ago, were not logged)" in last, last


def test_the_count_of_failures_left_out_does_not_claim_they_were_in_the_last_minute(monkeypatch, caplog):
    """A failure an hour after the last one logged, with one left out in between, 30 s after it: the
    line said "1 more such failures in the last 60 s" (soak2: every such line came 60-80 s after the
    previous one, and on a disk that fails once an hour it would be an hour)."""
    now = [1000.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: now[0])
    fl = FailureLog(log, "host copy")
    down = _batch(Tier.DRAM, Tier.NVME)
    with caplog.at_level(logging.ERROR, logger=log.name):
        _fail(fl, down, OSError(errno.ENOSPC, "full"))
        now[0] += 30
        _fail(fl, down, OSError(errno.ENOSPC, "full"))
        now[0] += 3570
        _fail(fl, down, OSError(errno.ENOSPC, "full"))
    last = caplog.records[-1].getMessage()
    assert "in the last 60 s" not in last, last
    assert "(1 more such failures since the last one logged, 3600 s ago, were not logged)" in last, last


def _staged_backend(chunk):
    """The CUDA backend's staged loop alone (no GPU: `_staged_chunk` given), staging of 1 MiB."""
    import threading

    from dflash2.transfer.cuda import CudaTransferBackend

    be = object.__new__(CudaTransferBackend)
    be._staging_lock = threading.Lock()
    be.staging = type("Staging", (), {"nbytes": 1 << 20})()
    be.fatal = None
    be.check_gpu = lambda e: None
    be._staged_failures = FailureLog(log, "staged move")
    be._staged_chunk = chunk
    return be


def test_an_unreadable_chunk_of_a_staged_read_fails_alone(caplog):
    """A GPU node's NVMe read runs chunk by chunk through the staging buffer; a chunk none of whose
    blocks could be read (a bad sector) failed every later chunk untried: dropped as misses, their
    sound slots set aside as unreadable (a review). Now it fails alone, as on the host path; a
    write's chunk that fails still ends the batch (its blocks stay where they were)."""
    from dflash2.errors import ArenaError
    from dflash2.transfer.cuda import StagedJob

    for src, dst, want in ((Tier.NVME, Tier.HBM, [[0], [1], [2], [3]]), (Tier.HBM, Tier.NVME, [[0], [1]])):
        tried = []

        def chunk(job, part):  # one 600 KiB block a chunk; the second's read (or write) fails whole
            tried.append(part.tolist())
            if part.tolist() == [1]:
                raise ArenaError("NVMe tier read failed: [Errno 5] Input/output error")
            return np.ones(len(part), dtype=bool)

        offsets = np.arange(4, dtype=np.int64) << 20
        job = StagedJob(CopyBatch(src, dst, offsets, offsets.copy(), np.full(4, 600 << 10, dtype=np.int64)))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=log.name):
            _staged_backend(chunk)._staged(job)
        assert tried == want and job.wait().tolist() == [True, False, len(want) > 2, len(want) > 2]
        assert "Input/output error" in caplog.text
        # (a read's said as the chunk's, not the batch's: "failed as a whole; its blocks are dropped", a review)
        assert ("failed for a chunk of 1 of them, the others going on; that chunk's are dropped" in caplog.text) == (
            src == Tier.NVME)


def test_a_staged_read_chunk_whose_copy_finds_the_gpu_lost_ends_the_batch():
    """A chunk's copy launch fails as every launch does after a sticky CUDA error (an ArenaError too):
    taken for an unreadable chunk, the batch went on and the lost context was never found (a review of
    the mend). The GPU is checked; a lost one ends the batch and marks the backend dead."""
    from dflash2.errors import ArenaError
    from dflash2.transfer.cuda import StagedJob

    tried = []

    def chunk(job, part):
        tried.append(part.tolist())
        raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 700")

    be = _staged_backend(chunk)

    def lost(error):
        be.fatal = f"GPU 0: the CUDA context is lost ({error})"
    be.check_gpu = lost
    offsets = np.arange(4, dtype=np.int64) << 20
    job = StagedJob(CopyBatch(Tier.NVME, Tier.HBM, offsets, offsets.copy(), np.full(4, 600 << 10, dtype=np.int64)))
    be._staged(job)
    assert tried == [[0]] and not job.wait().any() and be.fatal is not None


def test_a_staged_batch_that_fails_after_a_chunk_failed_alone_counts_only_the_chunks_done(caplog):
    """Chunk 2 unreadable (it fails alone), chunk 3 a CUDA error that ends the batch: the line said
    "after its first 2 were done", the failed chunk counted done (a review of the mend)."""
    from dflash2.errors import ArenaError
    from dflash2.transfer.cuda import StagedJob

    def chunk(job, part):
        if part.tolist() == [1]:
            raise ArenaError("NVMe tier read failed: [Errno 5] Input/output error")
        if part.tolist() == [2]:
            raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
        return np.ones(len(part), dtype=bool)

    offsets = np.arange(4, dtype=np.int64) << 20
    job = StagedJob(CopyBatch(Tier.NVME, Tier.HBM, offsets, offsets.copy(), np.full(4, 600 << 10, dtype=np.int64)))
    with caplog.at_level(logging.WARNING, logger=log.name):
        _staged_backend(chunk)._staged(job)
    assert job.wait().tolist() == [True, False, False, False]
    assert "after its first 1 were done, for the 3 others" in caplog.records[-1].getMessage()


def test_a_staged_move_whose_thread_cannot_start_leaves_close_its_clean_up(monkeypatch):
    """A staged (HBM<->NVMe) move whose thread could not start (a container's pids.max: RuntimeError)
    stayed in the workers close() waits for: close() then raised "cannot join thread before it is
    started" and skipped the host backend's close, the device sync and the staging buffer's free (a
    review). No GPU: the backend's start and close alone, the CUDA calls stood in for."""
    import contextlib

    from dflash2.transfer import cuda as tc

    be = object.__new__(tc.CudaTransferBackend)
    be._closed, be._workers, be.fatal, be.device = False, [], None, 0
    closed = []
    be.host = type("Host", (), {"close": lambda self: closed.append("host")})()
    be.staging = type("Staging", (), {"close": lambda self: closed.append("staging"), "nbytes": 1 << 20})()

    def no_thread(thread):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(tc.threads, "start", no_thread)
    offsets = np.zeros(1, dtype=np.int64)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        be.start(CopyBatch(Tier.HBM, Tier.NVME, offsets, offsets.copy(), np.full(1, 4096, dtype=np.int64)))
    runtime = type("Runtime", (), {"deviceSynchronize": lambda self: closed.append("sync")})()
    monkeypatch.setattr(tc, "cupy", lambda: type("cp", (), {"cuda": type("cuda", (), {"runtime": runtime})()})())
    monkeypatch.setattr(tc, "on_device", lambda device: contextlib.nullcontext())
    be.close()
    assert closed == ["host", "sync", "staging"]
