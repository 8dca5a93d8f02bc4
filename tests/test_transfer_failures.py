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


def _four_blocks(src: Tier = Tier.NVME, dst: Tier = Tier.HBM):
    """A staged job of 4 blocks of 600 KiB, 1 MiB apart: one block a chunk."""
    from dflash2.transfer.cuda import StagedJob

    offsets = np.arange(4, dtype=np.int64) << 20
    return StagedJob(CopyBatch(src, dst, offsets, offsets.copy(), np.full(4, 600 << 10, dtype=np.int64)))


def _staged_logged(chunk, caplog, job=None):
    """`job` (`_four_blocks()` when None) through the staged loop of `chunk` (`_staged_backend`), its
    warnings caught by `caplog`; returns the job."""
    job = _four_blocks() if job is None else job
    with caplog.at_level(logging.WARNING, logger=log.name):
        _staged_backend(chunk)._staged(job)
    return job


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

    for src, dst, want in ((Tier.NVME, Tier.HBM, [[0], [1], [2], [3]]), (Tier.HBM, Tier.NVME, [[0], [1]])):
        tried = []

        def chunk(job, part):  # one 600 KiB block a chunk; the second's read (or write) fails whole
            tried.append(part.tolist())
            if part.tolist() == [1]:
                if job.unreadable is not None:
                    job.unreadable[part] = True  # (the disk's, as the real chunk marks a read that raised)
                raise ArenaError("NVMe tier read failed: [Errno 5] Input/output error")
            return np.ones(len(part), dtype=bool)

        caplog.clear()
        job = _staged_logged(chunk, caplog, _four_blocks(src, dst))
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

    tried = []

    def chunk(job, part):
        tried.append(part.tolist())
        raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 700")

    be = _staged_backend(chunk)

    def lost(error):
        be.fatal = f"GPU 0: the CUDA context is lost ({error})"
    be.check_gpu = lost
    job = _four_blocks()
    be._staged(job)
    assert tried == [[0]] and not job.wait().any() and be.fatal is not None


def test_a_staged_batch_that_fails_after_a_chunk_failed_alone_counts_only_the_chunks_done(caplog):
    """Chunk 2 unreadable (it fails alone), chunk 3 a CUDA error that ends the batch: the line said
    "after its first 2 were done", the failed chunk counted done (a review of the mend)."""
    from dflash2.errors import ArenaError

    def chunk(job, part):
        if part.tolist() == [1]:
            job.unreadable[part] = True  # (the disk's, as the real chunk marks a read that raised)
            raise ArenaError("NVMe tier read failed: [Errno 5] Input/output error")
        if part.tolist() == [2]:
            raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
        return np.ones(len(part), dtype=bool)

    job = _staged_logged(chunk, caplog)
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


def _one_read_failing(mgr, index: int):
    """The NVMe arena's reads fail the checksum of the `index`-th block of each batch; returns the real
    read_blocks."""
    nvme = mgr.arenas[Tier.NVME]
    real = nvme.read_blocks

    def one_bad(offsets, dests):
        ok = real(offsets, dests)
        ok[index] = False
        return ok
    nvme.read_blocks = one_bad
    return real


def _staged_reads(mgr, copy):
    """The manager's mover on a CUDA backend (no GPU) whose HBM<->NVMe moves run the real staged loop
    and chunk code (`_staged`, `_staged_chunk`, the real NVMe arena) with the one CUDA call,
    `_staged_copy`, stood in for by `copy`; every other move goes to the host backend as before."""
    import threading

    from dflash2.transfer.cuda import CudaTransferBackend, StagedJob

    host = mgr.mover.backend
    be = _staged_backend(None)
    del be._staged_chunk  # (the real one)
    be.arenas = mgr.arenas
    be.staging = type("Staging", (), {"nbytes": 1 << 20, "array": np.zeros(1 << 20, dtype=np.uint8),
                                      "device_ptr": 0})()
    be.hbm = type("HBM", (), {"ptr": 0})()
    be.d2h = be.h2d = None
    be._staged_copy = copy
    assert isinstance(be, CudaTransferBackend) and isinstance(be._staging_lock, type(threading.Lock()))

    def start(batch):
        if {batch.src_tier, batch.dst_tier} == {Tier.HBM, Tier.NVME}:
            job = StagedJob(batch)
            be._staged(job)
            return job
        return host.start(batch)
    be.start = start
    mgr.mover.backend = be


def _on_nvme(mgr, n):
    from tests.conftest import SMALL

    a = mgr.attach("t")
    vids = mgr.commit(a, mgr.allocate(a, mgr.register_layout(SMALL), n))
    assert mgr.mover.move(mgr.table.rows(vids), Tier.NVME).all()  # (the host backend: down to NVMe)
    return vids


@pytest.mark.parametrize("error", ["refused launch", "out of memory"])
def test_a_staged_read_whose_gpu_copy_fails_is_not_blamed_on_the_disk(small_nvme_manager, caplog, error):
    """A GPU node's NVMe->HBM read whose disk read worked but whose copy on from the staging buffer
    failed (a refused kernel launch, the GPU still usable) was taken for an unreadable disk: its
    blocks dropped from the cache, their sound NVMe slots suspected, the warning naming a failing
    disk (a review). Now they stay on NVMe as a failed move's, and the lines name the copy."""
    from dflash2.errors import ArenaError

    mgr = small_nvme_manager
    vids = _on_nvme(mgr, 4)

    def refused(*a, **k):  # (an ArenaError fails its chunk alone; any other error the chunks after it too)
        if error == "refused launch":
            raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 701 (grid 1, block 128)")
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory allocating the copy's offsets")
    _staged_reads(mgr, refused)
    with caplog.at_level(logging.WARNING):
        ok = mgr.mover.move(mgr.table.rows(vids), Tier.HBM)
    assert not ok.any()
    assert not mgr.mover.lost, "blocks dropped as if NVMe were unreadable"
    assert not mgr.mover.quarantine._suspects.get(Tier.NVME), "sound NVMe slots suspected"
    assert (mgr.table.cols.tier[mgr.table.rows(vids)] == int(Tier.NVME)).all()
    assert "failing" not in caplog.text and "dropped" not in caplog.text, caplog.text
    assert "4 of 4 blocks read from NVMe failed to move on to hbm after the disk read them" in caplog.text
    assert "stay where they were (the disk read them: the copy on from the staging buffer failed)" in caplog.text


def test_a_staged_read_the_disk_fails_is_still_dropped_and_its_slot_suspected(small_nvme_manager, caplog):
    """The other side of the one above: a block whose bytes fail their checksum on the disk is still
    dropped and its slot suspected, its chunk's sound blocks arriving; and a chunk whose read raises
    (a dead disk) is the disk's too."""
    from dflash2.errors import ArenaError

    mgr = small_nvme_manager
    vids = _on_nvme(mgr, 4)
    copied = []
    _staged_reads(mgr, lambda *a: copied.append(len(a[-1])))
    nvme = mgr.arenas[Tier.NVME]
    _one_read_failing(mgr, 1)  # (the second block's checksum)
    rows = mgr.table.rows(vids)
    bad_offset = int(mgr.table.cols.offset[rows[1]])
    with caplog.at_level(logging.WARNING):
        ok = mgr.mover.move(rows, Tier.HBM)
    assert ok.tolist() == [True, False, True, True] and copied == [3]
    assert mgr.mover.lost == [int(vids[1])]
    assert list(mgr.mover.quarantine._suspects.get(Tier.NVME, {})) == [bad_offset]
    assert "1 of 4 blocks read back from NVMe failed their checksum or read" in caplog.text

    def dead(offsets, dests):
        raise ArenaError("NVMe tier read failed: [Errno 5] Input/output error")
    nvme.read_blocks = dead
    assert mgr.mover.move(mgr.table.rows(vids[2:]), Tier.NVME).all()  # (staged down again, zeros copied)
    mgr.mover.take_lost()
    assert mgr.mover.move(mgr.table.rows(vids[2:]), Tier.HBM).tolist() == [False, False]
    assert sorted(mgr.mover.lost) == sorted(int(v) for v in vids[2:])


def test_a_staged_chunk_whose_copy_fails_after_a_checksum_failure_says_which_are_dropped(small_nvme_manager, caplog):
    """A chunk of 4 with one block failing its checksum, whose GPU copy then failed: the transfer log
    said "that chunk's are dropped from the cache, a miss each" at ERROR, while the mover dropped the
    one and kept the 3 others on NVMe, its own warning saying so (a review). Now the line counts them."""
    from dflash2.errors import ArenaError

    mgr = small_nvme_manager
    vids = _on_nvme(mgr, 4)

    def refused(*a, **k):
        raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 701")
    _staged_reads(mgr, refused)
    _one_read_failing(mgr, 1)  # (the second block's checksum)
    rows = mgr.table.rows(vids)
    with caplog.at_level(logging.WARNING):
        assert not mgr.mover.move(rows, Tier.HBM).any()
    assert mgr.mover.lost == [int(vids[1])]
    assert (mgr.table.cols.tier[rows[[0, 2, 3]]] == int(Tier.NVME)).all()
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("staged move")]
    assert len(line) == 1 and line[0].endswith(
        "failed for a chunk of 4 of them, the others going on; 1 of them dropped from the cache (the disk failed "
        "their read), the others stay on NVMe (their copy failed)"), line


def test_a_staged_read_ended_by_an_exception_says_its_later_chunks_not_read(caplog):
    """A batch ended by an exception in its second chunk's copy (the disk had read that chunk): the
    line said every failed block "the disk read them", the chunks after it too, never read."""

    def chunk(job, part):
        if part.tolist() == [1]:
            raise RuntimeError("cudaErrorMemoryAllocation: out of memory allocating the copy's offsets")
        return np.ones(len(part), dtype=bool)

    job = _staged_logged(chunk, caplog)
    assert job.wait().tolist() == [True, False, False, False]
    assert caplog.records[-1].getMessage().endswith(
        "after its first 1 were done, for the 3 others; 1 of them stay on NVMe (the disk read them, their copy "
        "failed), 2 not read (the batch ended before them): they stay on NVMe"), caplog.records[-1].getMessage()


@pytest.mark.parametrize("mode", ["at once", "serving", "parked"])
def test_an_acquire_whose_gpu_copy_failed_is_told_so_and_copied_once(small_nvme_manager, mode):
    """An acquire whose NVMe->HBM copy failed after the disk read its blocks (they stay on NVMe) was
    told "the room made fell short", counted tier_full with HBM empty, and its promotion's second
    pass read and copied the same blocks again: 3 times for one acquire in serving mode (read_later,
    parking: promote_later, settle, promote), 4 where it was parked on them (a review). Now it is
    told the copy failed, counted copy_failed, after one try; a retry tries again."""
    from dflash2.errors import ArenaError, CopiesRunning
    from tests.conftest import SMALL

    mgr = small_nvme_manager
    a = mgr.attach("t")
    vids = mgr.commit(a, mgr.allocate(a, mgr.register_layout(SMALL), 4))
    assert mgr.mover.move(mgr.table.rows(vids), Tier.NVME).all()
    copies = []

    def refused(*args, **k):
        copies.append(1)
        raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 701")
    _staged_reads(mgr, refused)
    if mode == "parked":  # (its reads run past PARK_AFTER_S: parked on them, run again once settled)
        mgr.placement.end_soon = lambda flights=None: False
    own, got = 0, ()
    mgr.placement.read_later = mode != "at once"
    try:
        while got == ():  # (as the daemon's Service serves it: tests/test_prefetch_parked.py)
            mgr.placement.parking, mgr.placement.own_parks = mode != "at once", own
            try:
                got = mgr.acquire(a, vids)
            except CopiesRunning as e:
                own += e.own
                mgr.placement.parking = False
                mgr.settle()
    finally:
        mgr.placement.read_later = mgr.placement.parking = False
        mgr.placement.own_parks = 0
        mgr.placement.__dict__.pop("end_soon", None)
    assert got is None and len(copies) == 1 and own == (mode == "parked"), (got, copies, own)
    assert (mgr.table.cols.tier[mgr.table.rows(vids)] == int(Tier.NVME)).all()
    assert mgr.acquire_refusal == ("the copy of 4 of them from NVME into HBM failed (the transfer log names the "
                                   "error; the blocks stay on NVME): retry later, or recompute them")
    assert mgr.refusals.counts["acquire"] == {"tier_full": 0, "copy_failed": 1}
    _staged_reads(mgr, lambda *args: copies.append(2))  # (the GPU's copies work again)
    assert mgr.acquire(a, vids) is not None and copies == [1, 2]
    mgr.check_invariants()


def test_a_copy_that_failed_before_an_acquire_began_is_tried_again_after_it_parked(small_nvme_manager):
    """A copy up that failed before the acquire began (a prefetch's, another reader's) stayed on record
    while the acquire parked on other blocks' copies, and its run after the park refused the blocks
    as copy_failed untried, the GPU's copies working again (a review). A new call forgets the record
    as it begins."""
    from dflash2.errors import ArenaError, CopiesRunning
    from tests.conftest import SMALL

    mgr = small_nvme_manager
    a = mgr.attach("t")
    vids = mgr.commit(a, mgr.allocate(a, mgr.register_layout(SMALL), 4))
    rows = mgr.table.rows(vids)
    assert mgr.mover.move(rows, Tier.NVME).all()

    def refused(*args, **k):
        raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 701")
    _staged_reads(mgr, refused)
    assert not mgr.mover.move(rows[2:], Tier.HBM).any() and len(mgr.mover.copy_failed) == 2
    _staged_reads(mgr, lambda *args: None)  # (the GPU's copies work again)
    mgr.placement.read_later = True
    assert mgr.placement.promote_later(rows[:2], Tier.HBM)  # a prefetch of the first two, on its way up
    mgr.placement.end_soon = lambda flights=None: False
    try:
        mgr.placement.parking, mgr.placement.own_parks = True, 0
        with pytest.raises(CopiesRunning):
            mgr.acquire(a, vids)  # parked on the prefetch's copies
        mgr.placement.parking = False
        mgr.settle()
        mgr.placement.__dict__.pop("end_soon", None)
        mgr.placement.parking, mgr.placement.own_parks = True, 1
        got = mgr.acquire(a, vids)
    finally:
        mgr.placement.read_later = mgr.placement.parking = False
        mgr.placement.own_parks = 0
        mgr.placement.__dict__.pop("end_soon", None)
    assert got is not None, (mgr.acquire_refusal, mgr.refusals.counts["acquire"])
    assert mgr.refusals.counts["acquire"]["copy_failed"] == 0
    mgr.check_invariants()


def test_blocks_a_staged_read_never_reached_are_said_not_read(small_nvme_manager, caplog):
    """A staged read ended by its first chunk's copy (not an ArenaError: the batch ends, its later
    chunks untried): the mover said all four "failed to move on to hbm after the disk read them",
    where the transfer log said two were never read (a review). It says so too."""
    mgr = small_nvme_manager
    vids = _on_nvme(mgr, 4)
    block = int(mgr.table.block_bytes(mgr.table.rows(vids))[0])

    def oom(*args, **k):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
    _staged_reads(mgr, oom)
    mgr.mover.backend.staging.nbytes = 2 * block  # two blocks a chunk: chunks [0, 1] and [2, 3]
    with caplog.at_level(logging.WARNING):
        assert not mgr.mover.move(mgr.table.rows(vids), Tier.HBM).any()
    said = [r.getMessage() for r in caplog.records if "failed to move on to hbm" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("4 of 4 blocks from NVMe failed to move on to hbm") and (
        "2 copied after the disk read them failed, 2 were not read (the batch ended before them)" in said[0]), said
    assert (mgr.table.cols.tier[mgr.table.rows(vids)] == int(Tier.NVME)).all()


def test_an_acquire_after_one_that_ended_in_unknownblock_is_a_new_call(small_nvme_manager):
    """An acquire whose own promotion settled at once and ended in UnknownBlock (a block failed its read
    back) left the record of what it waited for: the client's next acquire, of other blocks, was taken
    for that call run again, and refused copy_failed untried for a copy failure on record from before
    it, the GPU's copies working again (a review)."""
    from dflash2.errors import ArenaError, UnknownBlock
    from tests.conftest import SMALL

    mgr = small_nvme_manager
    a = mgr.attach("t")
    layout = mgr.register_layout(SMALL)
    first, other = (mgr.commit(a, mgr.allocate(a, layout, 2)) for _ in range(2))
    assert mgr.mover.move(mgr.table.rows(np.concatenate([first, other])), Tier.NVME).all()

    def refused(*args, **k):
        raise ArenaError("cuLaunchKernel of the copy kernel failed with CUDA error 701")
    _staged_reads(mgr, refused)
    assert not mgr.mover.move(mgr.table.rows(other), Tier.HBM).any()  # (a prefetch's copy failed)
    copies = []
    _staged_reads(mgr, lambda *args: copies.append(1))  # (the GPU's copies work again)
    nvme = mgr.arenas[Tier.NVME]
    real = _one_read_failing(mgr, -1)  # (a checksum failure: that block is dropped)
    mgr.placement.read_later = True
    try:
        mgr.placement.parking, mgr.placement.own_parks = True, 0
        with pytest.raises(UnknownBlock):
            mgr.acquire(a, first)  # serving mode: promote_later, end_soon, settle, refuse_dropped
    finally:
        mgr.placement.read_later = mgr.placement.parking = False
        nvme.read_blocks = real
    copies.clear()
    assert mgr.acquire(a, other) is not None and copies, (mgr.acquire_refusal, mgr.refusals.counts["acquire"])
    mgr.check_invariants()
