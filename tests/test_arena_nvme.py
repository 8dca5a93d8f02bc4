"""NvmeArena: preallocated cache file, batched aligned I/O through the staging ring, checksums."""

import logging
import os

import numpy as np
import pytest

import dflash2.arena.nvme as nvme
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.staging import ALIGN, crc32_combine, plan_chunks, round_up
from dflash2.errors import ArenaError, CapacityError

CAP = 16 << 20
STAGING = 64 << 10  # small, so that batches and blocks span many slots


@pytest.fixture
def arena(tmp_path):
    a = NvmeArena(tmp_path / "sub" / "nvme.bin", CAP, staging_bytes=STAGING)
    yield a
    a.remove()


def _blocks(rng, lengths, gap_pages=0):
    """Sequential slot offsets (with an optional free gap between slots) and random contents."""
    offsets, pos = [], 0
    for n in lengths:
        offsets.append(pos)
        pos += round_up(n) + gap_pages * ALIGN
    return offsets, [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]


def test_file_is_preallocated(arena):
    assert os.path.getsize(arena.path) == nvme.HEADER_BYTES + CAP
    with open(arena.path, "rb") as f:
        assert f.read(len(nvme.HEADER)) == nvme.HEADER
    assert arena.describe()["path"] == arena.path


@pytest.mark.parametrize("gap_pages", [0, 1, 40])
def test_round_trip_odd_lengths(arena, gap_pages):
    rng = np.random.default_rng(gap_pages)
    lengths = [1, 4095, 4096, 4097, 100_003, 3 * STAGING + 17, STAGING, STAGING - 1, 777] * 3
    offsets, srcs = _blocks(rng, lengths, gap_pages)
    perm = rng.permutation(len(lengths))  # unsorted batches are fine
    arena.write_blocks([offsets[i] for i in perm], [srcs[i] for i in perm])
    dsts = [np.zeros(n, dtype=np.uint8) for n in lengths]
    ok = arena.read_blocks(offsets, dsts)
    assert ok.all()
    for s, d in zip(srcs, dsts):
        assert np.array_equal(s, d)


def test_many_batches_and_typed_buffers(arena):
    rng = np.random.default_rng(1)
    src = rng.standard_normal((64, 100)).astype(np.float16)  # 12800 bytes, not page-multiple
    offsets = [k * round_up(src.nbytes) for k in range(8)]
    for k in range(0, 8, 2):
        arena.write_blocks(offsets[k:k + 2], [src, memoryview(src.tobytes())])
    dst = [np.zeros_like(src) for _ in range(8)]
    assert arena.read_blocks(offsets, dst).all()
    assert all(np.array_equal(d, src) for d in dst)


def test_corruption_is_a_miss(arena):
    rng = np.random.default_rng(2)
    offsets, srcs = _blocks(rng, [5000, 9000, 200_000])
    arena.write_blocks(offsets, srcs)
    arena.corrupt_for_test(offsets[1])
    ok = arena.read_blocks(offsets, [np.zeros(s.size, np.uint8) for s in srcs])
    assert ok.tolist() == [True, False, True]


def test_never_written_forgotten_and_wrong_length_are_misses(arena):
    rng = np.random.default_rng(3)
    offsets, srcs = _blocks(rng, [8192, 8192, 8192])
    arena.write_blocks(offsets[:2], srcs[:2])
    arena.forget([offsets[0]])
    dsts = [np.zeros(8192, np.uint8) for _ in range(3)]
    assert arena.read_blocks(offsets, dsts).tolist() == [False, True, False]
    assert not arena.read_blocks([offsets[1]], [np.zeros(100, np.uint8)]).any()


def test_rewrite_replaces_checksum(arena):
    a, b = np.full(10_000, 1, np.uint8), np.full(10_000, 2, np.uint8)
    arena.write_blocks([0], [a])
    arena.write_blocks([0], [b])
    d = np.zeros(10_000, np.uint8)
    assert arena.read_blocks([0], [d]).all() and (d == 2).all()


@pytest.mark.parametrize("offsets,lens,match", [
    ([1], [10], "multiples"),
    ([CAP - ALIGN], [ALIGN + 1], "past"),
    ([0, 0], [10, 10], "overlapping"),
    ([0, ALIGN], [ALIGN + 1, 10], "overlapping"),
    ([0], [0], "lengths"),
])
def test_bad_batches_raise(arena, offsets, lens, match):
    with pytest.raises(ArenaError, match=match):
        arena.write_blocks(offsets, [np.zeros(n, np.uint8) for n in lens])


def test_read_only_destination_raises(arena):
    arena.write_blocks([0], [np.ones(10, np.uint8)])
    d = np.zeros(10, np.uint8)
    d.flags.writeable = False
    with pytest.raises(ArenaError, match="read-only"):
        arena.read_blocks([0], [d])


def test_a_full_disk_fails_the_batch(arena, monkeypatch):
    arena.write_blocks([0], [np.ones(10, np.uint8)])

    def broken(fd, buf, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme, "pwrite_all", broken)
    with pytest.raises(ArenaError, match="write .* failed"):
        arena.write_blocks([0, ALIGN], [np.ones(10, np.uint8), np.ones(10, np.uint8)])
    # the overwritten slot no longer counts as written
    assert not arena.read_blocks([0], [np.zeros(10, np.uint8)]).any()


def test_an_io_error_on_every_slot_refuses_each_block_and_raises_nothing(arena, monkeypatch):
    """EIO (a bad region) is the slots' fault, not the batch's: each block is written again alone,
    and those that still fail are named (False) for the caller to set their slots aside."""
    arena.write_blocks([0], [np.ones(10, np.uint8)])

    def broken(fd, buf, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(nvme, "pwrite_all", broken)
    assert arena.write_blocks([0, ALIGN], [np.ones(10, np.uint8), np.ones(10, np.uint8)]).tolist() == [False, False]
    # the overwritten slot no longer counts as written
    assert not arena.read_blocks([0], [np.zeros(10, np.uint8)]).any()


def test_an_io_error_at_one_slot_refuses_that_block_alone(arena, monkeypatch):
    """A batch whose I/O fails with EIO where one slot lies: written again block by block, the
    others are written (readable, their checksums recorded), the bad one is refused, a miss."""
    rng = np.random.default_rng(3)
    offsets, srcs = _blocks(rng, [ALIGN, 3000, 2 * ALIGN + 5, 700])
    bad = offsets[2] + nvme.HEADER_BYTES
    real = os.pwritev

    def pwritev(fd, bufs, offset):
        n = sum(memoryview(b).nbytes for b in bufs)
        if fd == arena._fd and offset < bad + ALIGN and offset + n > bad:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    assert arena.write_blocks(offsets, srcs).tolist() == [True, True, False, True]
    monkeypatch.undo()
    dsts = [np.zeros(len(s), np.uint8) for s in srcs]
    assert arena.read_blocks(offsets, dsts).tolist() == [True, True, False, True]
    assert all(np.array_equal(d, s) for k, (d, s) in enumerate(zip(dsts, srcs)) if k != 2)


def test_an_error_other_than_eio_while_writing_block_by_block_fails_the_batch(arena, monkeypatch):
    arena.write_blocks([0], [np.ones(10, np.uint8)])
    errors = iter([5] + [28] * 10)  # the batch: EIO; then, block by block, the disk is full

    def broken(fd, buf, offset):
        raise OSError(next(errors), "injected")

    monkeypatch.setattr(nvme, "pwrite_all", broken)
    with pytest.raises(ArenaError, match="written again block by block"):
        arena.write_blocks([0, ALIGN], [np.ones(10, np.uint8), np.ones(10, np.uint8)])
    assert not arena.read_blocks([0], [np.zeros(10, np.uint8)]).any()


def test_capacity_error_when_disk_is_short(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    need = round_up(free + (1 << 30))
    with pytest.raises(CapacityError, match=rf"NVMe tier needs {need + nvme.HEADER_BYTES} bytes at .* \({need} "
                                            rf"for blocks and a {nvme.HEADER_BYTES}-byte header\), only \d+ free: "
                                            "free room on that disk, lower memory.nvme_capacity_mb, or set memory.nvme_path"):
        NvmeArena(tmp_path / "big.bin", need, staging_bytes=STAGING)


def test_file_in_use_raises(arena):
    with pytest.raises(ArenaError, match="in use"):
        NvmeArena(arena.path, CAP, staging_bytes=STAGING)


def test_close_keeps_the_file(tmp_path):
    a = NvmeArena(tmp_path / "keep.bin", CAP, staging_bytes=STAGING)
    a.close()
    a.close()
    assert os.path.getsize(tmp_path / "keep.bin") == nvme.HEADER_BYTES + CAP
    with pytest.raises(ArenaError, match="closed"):
        a.write_blocks([0], [np.ones(1, np.uint8)])
    b = NvmeArena(tmp_path / "keep.bin", CAP, staging_bytes=STAGING)  # reopens: an empty tier
    assert not b.read_blocks([0], [np.zeros(1, np.uint8)]).any()
    b.remove()
    assert not (tmp_path / "keep.bin").exists()


@pytest.mark.parametrize("contents", [b"precious data\n" * 1000, b"\0" * 8192])
def test_a_file_that_is_not_a_cache_file_is_never_overwritten(tmp_path, contents):
    # A mistyped memory.nvme_path pointing at someone's file (or an old cache file without the
    # header): refused with the path named, the file left exactly as it was.
    victim = tmp_path / "data.bin"
    victim.write_bytes(contents)
    with pytest.raises(ArenaError, match=f"{victim} exists and is not a dflash2 NVMe cache file"):
        NvmeArena(victim, CAP, staging_bytes=STAGING)
    assert victim.read_bytes() == contents


def test_a_cache_file_is_reused_and_an_empty_file_becomes_one(tmp_path):
    path = tmp_path / "cache.bin"
    path.touch()
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    a.write_blocks([0], [np.full(ALIGN, 7, np.uint8)])
    a.close()
    b = NvmeArena(path, CAP, staging_bytes=STAGING)  # ours: reused, as an empty tier
    try:
        assert not b.read_blocks([0], [np.zeros(ALIGN, np.uint8)]).any()
        b.write_blocks([0], [np.full(ALIGN, 9, np.uint8)])
        out = np.zeros(ALIGN, np.uint8)
        assert b.read_blocks([0], [out]).all() and (out == 9).all()
    finally:
        b.remove()


@pytest.mark.parametrize("where", ["open", "test write"])
def test_an_io_error_in_the_o_direct_probe_refuses_the_tier_instead_of_falling_back(tmp_path, monkeypatch,
                                                                                    caplog, where):
    """EIO while the tier tries O_DIRECT is a failing disk, not a filesystem without O_DIRECT: falling
    back to buffered I/O (as before) hid it, the kernel failing the writes later, out of sight."""
    def eio(*args):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(nvme, "_open_direct" if where == "open" else "pwrite_all", eio)
    with caplog.at_level(logging.WARNING, logger="dflash2.arena.nvme"):
        with pytest.raises(ArenaError, match="I/O error.*failing.*nvme_capacity_mb"):
            NvmeArena(tmp_path / "failing.bin", CAP, staging_bytes=STAGING)
    assert not [r for r in caplog.records if "O_DIRECT is unavailable" in r.getMessage()]


def test_an_io_error_that_shows_at_the_probe_flush_only_refuses_the_tier(tmp_path, monkeypatch):
    """soak5: on a failing disk the direct test write returned success (the kernel wrote the header
    page _prepare had written through the page cache back first, failed, and did the direct write
    buffered); the EIO showed at fsync only, and the tier was taken."""
    def eio(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(nvme.os, "fdatasync", eio)
    with pytest.raises(ArenaError, match="I/O error.*failing.*nvme_capacity_mb"):
        NvmeArena(tmp_path / "failing.bin", CAP, staging_bytes=STAGING)


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    # This kernel's tmpfs accepts O_DIRECT (Linux >= 6.6), so refuse it the way older tmpfs does.
    def refuse(path):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(nvme, "_open_direct", refuse)
    with caplog.at_level(logging.WARNING, logger="dflash2.arena.nvme"):
        a = NvmeArena(tmp_path / "buffered.bin", CAP, staging_bytes=STAGING)
    try:
        assert a.direct_io is False and a.describe()["direct_io"] is False
        lines = [r.getMessage() for r in caplog.records if r.name == "dflash2.arena.nvme"]
        assert len(lines) == 1 and "O_DIRECT is unavailable" in lines[0] and "buffered I/O" in lines[0]
        rng = np.random.default_rng(4)
        offsets, srcs = _blocks(rng, [123, 70_000, 4096])
        a.write_blocks(offsets, srcs)
        dsts = [np.zeros(s.size, np.uint8) for s in srcs]
        assert a.read_blocks(offsets, dsts).all()
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    finally:
        a.remove()


def test_direct_io_probe_on_dev_shm():
    """Where the kernel's tmpfs refuses O_DIRECT the arena still works; where it accepts it, too."""
    path = f"/dev/shm/dflash2-test-nvme-{os.getpid()}.bin"
    a = NvmeArena(path, 1 << 20, staging_bytes=STAGING)
    try:
        a.write_blocks([0], [np.arange(100, dtype=np.uint8)])
        d = np.zeros(100, np.uint8)
        assert a.read_blocks([0], [d]).all() and np.array_equal(d, np.arange(100, dtype=np.uint8))
    finally:
        a.remove()


def test_crc32_combine_matches_zlib():
    import zlib
    rng = np.random.default_rng(5)
    for _ in range(50):
        a = rng.integers(0, 256, int(rng.integers(0, 5000)), dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, int(rng.integers(0, 70000)), dtype=np.uint8).tobytes()
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_plan_keeps_small_blocks_whole_and_bridges_read_gaps():
    offsets = np.array([0, 3 * ALIGN, 10 * ALIGN], dtype=np.int64)
    extents = np.array([3 * ALIGN, 3 * ALIGN, 2 * ALIGN], dtype=np.int64)
    order = np.arange(3)
    chunks = plan_chunks(order, offsets, extents, 4 * ALIGN, bridge=0)
    assert [c.ios for c in chunks] == [[(0, 0, 3 * ALIGN)], [(3 * ALIGN, 0, 3 * ALIGN)], [(10 * ALIGN, 0, 2 * ALIGN)]]
    chunks = plan_chunks(order, offsets, extents, 16 * ALIGN, bridge=8 * ALIGN)
    assert [c.ios for c in chunks] == [[(0, 0, 12 * ALIGN)]]
    assert chunks[0].pieces[2] == (2, 0, 2 * ALIGN, 10 * ALIGN)


# ---- the direct (zero-copy) path: page-aligned buffers move straight to and from the file -------

import mmap  # noqa: E402

import dflash2.arena.staging as staging  # noqa: E402
from dflash2.arena.shm import SharedMemoryArena  # noqa: E402
from dflash2.arena.staging import plan_runs  # noqa: E402
from dflash2.tiers import Tier  # noqa: E402


def _aligned(n):
    """A page-aligned uint8 buffer of n bytes (anonymous mmap)."""
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


@pytest.fixture
def spy(monkeypatch):
    """Counts bytes moved by the direct path's vectored I/O and by the staged path's plain I/O."""
    seen = {"direct": 0, "staged": 0}
    for name, kind in (("pwritev_all", "direct"), ("preadv_all", "direct"),
                       ("pwrite_all", "staged"), ("pread_all", "staged")):
        real = getattr(nvme, name)

        def wrapped(fd, bufs, off, _real=real, _kind=kind):
            seen[_kind] += sum(len(b) for b in bufs) if isinstance(bufs, list) else len(bufs)
            return _real(fd, bufs, off)
        monkeypatch.setattr(nvme, name, wrapped)
    return seen


def test_aligned_buffers_take_the_direct_path(arena, spy):
    rng = np.random.default_rng(10)
    lengths = [ALIGN, 3 * ALIGN, STAGING, 5 * STAGING, ALIGN]
    offsets, data = _blocks(rng, lengths)
    srcs = [_aligned(n) for n in lengths]
    for s, d in zip(srcs, data):
        s[:] = d
    arena.write_blocks(offsets, srcs)
    assert spy == {"direct": sum(lengths), "staged": 0}
    dsts = [_aligned(n) for n in lengths]
    assert arena.read_blocks(offsets, dsts).all()
    assert spy == {"direct": 2 * sum(lengths), "staged": 0}
    assert all(np.array_equal(s, d) for s, d in zip(data, dsts))


def test_shared_memory_views_take_the_direct_path(arena, spy):
    shm = SharedMemoryArena.create(f"dflash2-test-nvme-{os.getpid()}", 1 << 20, Tier.DRAM, alignment=ALIGN)
    try:
        srcs = [shm.view(k * 8 * ALIGN, 8 * ALIGN) for k in range(8)]
        dsts = [shm.view((8 + k) * 8 * ALIGN, 8 * ALIGN) for k in range(8)]
        for k, v in enumerate(srcs):
            v[:] = np.random.default_rng(k).integers(0, 256, v.size, dtype=np.uint8)
        offsets = [k * 8 * ALIGN for k in range(8)]
        arena.write_blocks(offsets, srcs)
        assert arena.read_blocks(offsets, dsts).all()
        assert spy["staged"] == 0 and all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
        del srcs, dsts
    finally:
        shm.close()


@pytest.mark.parametrize("readers,lanes", [(1, 1), (2, 3), (3, 1)])
@pytest.mark.parametrize("max_direct", [None, 2 * ALIGN])
def test_mixed_aligned_and_unaligned_batches(arena, spy, monkeypatch, max_direct, readers, lanes):
    """Aligned and unaligned buffers in one unsorted batch; written one way, read back the other.
    With several read and checksum lanes, the pieces of a block split over runs are read and
    checksummed out of order."""
    if max_direct:
        monkeypatch.setattr(staging, "MAX_DIRECT_IO_BYTES", max_direct)  # split large blocks over runs
    monkeypatch.setattr(nvme, "READ_LANES", readers)
    monkeypatch.setattr(nvme, "_crc_lanes", lambda ring, io_lanes: lanes)
    rng = np.random.default_rng(11)
    lengths = [ALIGN, 5000, 4 * ALIGN, STAGING + ALIGN, 3 * STAGING, 100_003, 2 * ALIGN, 7 * ALIGN]
    offsets, data = _blocks(rng, lengths, gap_pages=1)

    def bufs(aligned_first):
        out = []
        for k, d in enumerate(data):
            aligned = (k % 2 == 0) == aligned_first and d.size % ALIGN == 0
            b = _aligned(d.size) if aligned else _aligned(d.size + 64)[64:]  # shifted off a page
            out.append(b)
        return out

    srcs = bufs(True)
    for s, d in zip(srcs, data):
        s[:] = d
    perm = rng.permutation(len(lengths))
    arena.write_blocks([offsets[i] for i in perm], [srcs[i] for i in perm])
    assert spy["direct"] > 0 and spy["staged"] > 0
    for aligned_first in (True, False):
        dsts = bufs(aligned_first)
        assert arena.read_blocks(offsets, dsts).all()
        assert all(np.array_equal(s, d) for s, d in zip(data, dsts))


def test_direct_checksum_mismatch_is_a_miss(arena):
    rng = np.random.default_rng(12)
    lengths = [2 * ALIGN, 3 * ALIGN, 2 * ALIGN]
    offsets, data = _blocks(rng, lengths)
    srcs = [_aligned(n) for n in lengths]
    for s, d in zip(srcs, data):
        s[:] = d
    arena.write_blocks(offsets, srcs)
    arena.corrupt_for_test(offsets[1])
    direct = [_aligned(n) for n in lengths]
    assert arena.read_blocks(offsets, direct).tolist() == [True, False, True]
    staged = [np.zeros(n + 1, np.uint8)[1:] for n in lengths]
    assert arena.read_blocks(offsets, staged).tolist() == [True, False, True]
    assert np.array_equal(direct[2], data[2]) and np.array_equal(staged[0], data[0])


def test_direct_write_error_fails_the_batch(arena, monkeypatch):
    src = _aligned(2 * ALIGN)
    src[:] = 7
    arena.write_blocks([0], [src])

    def broken(fd, bufs, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme, "pwritev_all", broken)
    with pytest.raises(ArenaError, match="write .* failed"):
        arena.write_blocks([0, 2 * ALIGN], [src, src])
    assert not arena.read_blocks([0], [_aligned(2 * ALIGN)]).any()


def test_a_direct_read_error_is_read_again_block_by_block_and_the_arena_stays_usable(arena, monkeypatch):
    srcs = [_aligned(ALIGN) for _ in range(3)]
    for k, s in enumerate(srcs):
        s[:] = k + 1
    offsets = [0, 4 * ALIGN, 8 * ALIGN]  # three runs: the read lane fails on the second
    arena.write_blocks(offsets, srcs)
    real, calls = nvme.preadv_all, []

    def fails_second(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real(fd, bufs, offset)

    monkeypatch.setattr(nvme, "preadv_all", fails_second)
    dsts = [_aligned(ALIGN) for _ in range(3)]
    assert arena.read_blocks(offsets, dsts).all(), "a passing error: each block read again alone succeeds"
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))
    monkeypatch.setattr(nvme, "preadv_all", lambda fd, bufs, offset: (_ for _ in ()).throw(OSError(5, "EIO")))
    monkeypatch.setattr(nvme, "pread_all", lambda fd, buf, offset: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(ArenaError, match="read .* failed"):  # nothing readable: the batch fails
        arena.read_blocks(offsets, [_aligned(ALIGN) for _ in range(3)])
    monkeypatch.undo()
    dsts = [_aligned(ALIGN) for _ in range(3)]
    assert arena.read_blocks(offsets, dsts).all()
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))


@pytest.mark.parametrize("aligned", [True, False], ids=["direct", "staged"])
def test_an_unreadable_block_is_a_miss_alone_not_its_batch(arena, monkeypatch, caplog, aligned):
    """A bad sector (EIO on every read of one block's extent) used to fail the whole batch: every
    block in it was dropped from the cache, a recompute each, though their bytes read fine."""
    lengths = [ALIGN, 3 * ALIGN, ALIGN, 2 * ALIGN, STAGING + ALIGN]
    offsets, data = _blocks(np.random.default_rng(11), lengths)
    srcs = [_aligned(n) if aligned else np.empty(n + 1, np.uint8)[1:] for n in lengths]  # [1:]: unaligned
    for s, d in zip(srcs, data):
        s[:] = d
    arena.write_blocks(offsets, srcs)
    bad = nvme.HEADER_BYTES + offsets[2], nvme.HEADER_BYTES + offsets[2] + lengths[2]

    def failing(real):
        def io(fd, bufs, offset):
            n = sum(memoryview(b).nbytes for b in bufs) if isinstance(bufs, list) else memoryview(bufs).nbytes
            if offset < bad[1] and offset + n > bad[0]:
                raise OSError(5, "Input/output error")
            return real(fd, bufs, offset)
        return io

    monkeypatch.setattr(nvme, "preadv_all", failing(nvme.preadv_all))
    monkeypatch.setattr(nvme, "pread_all", failing(nvme.pread_all))
    dsts = [_aligned(n) if aligned else np.zeros(n + 1, np.uint8)[1:] for n in lengths]
    with caplog.at_level(logging.WARNING, logger="dflash2.arena.nvme"):
        ok = arena.read_blocks(offsets, dsts)
        arena.read_blocks(offsets, dsts)
    assert ok.tolist() == [True, True, False, True, True]
    assert all(np.array_equal(d, x) for d, x, good in zip(dsts, data, ok) if good)
    logged = [r for r in caplog.records if "read again one by one" in r.getMessage()]
    assert len(logged) == 1 and "Input/output error" in logged[0].getMessage(), "once a minute, naming the error"


def test_short_vectored_io_is_resumed(tmp_path):
    """pwritev/preadv may move fewer bytes than asked: the rest follows, across buffer bounds."""
    fd = os.open(tmp_path / "short.bin", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        bufs = [np.full(n, k + 1, np.uint8) for k, n in enumerate([3, 5, 7])]
        real = os.pwritev
        calls = []

        def short(fd, bs, off):
            calls.append(off)
            return real(fd, [memoryview(bs[0])[:2]], off)  # at most 2 bytes a call

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "pwritev", short)
            staging.pwritev_all(fd, list(bufs), 10)
        out = [np.zeros(n, np.uint8) for n in (3, 5, 7)]
        staging.preadv_all(fd, out, 10)
        assert all(np.array_equal(a, b) for a, b in zip(bufs, out)) and len(calls) == 9
    finally:
        os.close(fd)


def test_plan_runs_merges_adjacent_blocks_and_splits_large_ones():
    offsets = np.array([0, 2 * ALIGN, 6 * ALIGN, 8 * ALIGN], dtype=np.int64)
    lens = np.array([2 * ALIGN, 2 * ALIGN, 2 * ALIGN, 5 * ALIGN], dtype=np.int64)
    runs = plan_runs(np.arange(4), offsets, lens, max_bytes=4 * ALIGN)
    assert [(r.offset, r.pieces) for r in runs] == [
        (0, [(0, 0, 2 * ALIGN), (1, 0, 2 * ALIGN)]),
        (6 * ALIGN, [(2, 0, 2 * ALIGN), (3, 0, 2 * ALIGN)]),
        (10 * ALIGN, [(3, 2 * ALIGN, 5 * ALIGN)]),
    ]
    assert len(plan_runs(np.arange(4), offsets, lens, max_bytes=1 << 30, max_iov=1)) == 4


def test_forgetting_a_slot_does_not_wait_for_a_batch_in_flight(arena, monkeypatch):
    """The serving thread forgets a slot at every free or eviction on NVMe while the transfer thread
    writes other slots; forget waited on the lock a batch holds through its whole I/O (a slow disk
    held a commit that deduplicated onto an NVMe twin for the length of a batch). A slot in a batch
    is never forgotten meanwhile: its move holds it."""
    import threading
    rng = np.random.default_rng(5)
    offsets, srcs = _blocks(rng, [8192, 8192, 8192, 8192])
    arena.write_blocks(offsets[:1], srcs[:1])
    writing, release = threading.Event(), threading.Event()
    real = nvme.pwrite_all

    def held(fd, buf, offset):
        writing.set()
        assert release.wait(30)
        return real(fd, buf, offset)

    monkeypatch.setattr(nvme, "pwrite_all", held)
    writer = threading.Thread(target=arena.write_blocks, args=(offsets[1:], [np.ascontiguousarray(s[1:]) for s in srcs[1:]]))
    writer.start()
    try:
        assert writing.wait(10), "the batch's write began"
        forgot = threading.Thread(target=arena.forget, args=(offsets[:1],))
        forgot.start()
        forgot.join(10)
        assert not forgot.is_alive(), "forget waited for the batch's I/O"
    finally:
        release.set()
        writer.join(30)
    assert not arena.read_blocks(offsets[:1], [np.zeros(8192, np.uint8)]).any()  # forgotten: a miss


@pytest.mark.parametrize("reused", [False, True])
def test_a_start_that_fails_after_preallocating_removes_only_a_file_it_created(tmp_path, monkeypatch, reused):
    """The staging ring (or the O_DIRECT probe) failing after the file was made at full size left
    all of `memory.nvme_capacity_mb` on the disk after a failed start; a cache file an earlier
    daemon made stays (the next start reuses it)."""
    path = tmp_path / "nvme.bin"
    if reused:
        NvmeArena(path, CAP, staging_bytes=STAGING).close()

    def no_room(nbytes):
        raise CapacityError(f"NVMe tier's staging buffer needs {nbytes} bytes of memory, only 0 available")

    monkeypatch.setattr(nvme, "_staging_ring", no_room)
    with pytest.raises(CapacityError, match="staging buffer"):
        NvmeArena(path, CAP, staging_bytes=STAGING)
    assert path.exists() == reused


@pytest.mark.parametrize("reused", [False, True])
def test_a_file_size_limit_below_the_file_refuses_the_tier_naming_it(tmp_path, reused):
    """Under a file size limit (ulimit -f) below the file, a reused file (already whole) was taken,
    and every write past the limit failed (EFBIG) as a full disk's: NVMe backed off and came back
    every second, the slots past the limit never filled (a review's daemon); a new file failed as
    "preallocation failed: File too large". Both now name the limit, and a reused file is kept."""
    import resource
    import signal

    path = tmp_path / "nvme.bin"
    if reused:
        NvmeArena(path, CAP, staging_bytes=STAGING).close()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (CAP // 2, hard))
    try:
        with pytest.raises(CapacityError, match=rf"needs {CAP + nvme.HEADER_BYTES} bytes at {path}, but this process "
                                                rf"may not write past byte {CAP // 2} of a file \(its file size limit"):
            NvmeArena(path, CAP, staging_bytes=STAGING)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert path.exists() == reused and (not reused or os.path.getsize(path) == CAP + nvme.HEADER_BYTES)
