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
    assert os.path.getsize(arena.path) == CAP
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


def test_io_error_fails_the_batch(arena, monkeypatch):
    arena.write_blocks([0], [np.ones(10, np.uint8)])

    def broken(fd, buf, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(nvme, "pwrite_all", broken)
    with pytest.raises(ArenaError, match="write .* failed"):
        arena.write_blocks([0, ALIGN], [np.ones(10, np.uint8), np.ones(10, np.uint8)])
    # the overwritten slot no longer counts as written
    assert not arena.read_blocks([0], [np.zeros(10, np.uint8)]).any()


def test_capacity_error_when_disk_is_short(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    need = round_up(free + (1 << 30))
    with pytest.raises(CapacityError, match=rf"NVMe tier needs {need} bytes at .*, only \d+ free"):
        NvmeArena(tmp_path / "big.bin", need, staging_bytes=STAGING)


def test_file_in_use_raises(arena):
    with pytest.raises(ArenaError, match="in use"):
        NvmeArena(arena.path, CAP, staging_bytes=STAGING)


def test_close_keeps_the_file(tmp_path):
    a = NvmeArena(tmp_path / "keep.bin", CAP, staging_bytes=STAGING)
    a.close()
    a.close()
    assert os.path.getsize(tmp_path / "keep.bin") == CAP
    with pytest.raises(ArenaError, match="closed"):
        a.write_blocks([0], [np.ones(1, np.uint8)])
    b = NvmeArena(tmp_path / "keep.bin", CAP, staging_bytes=STAGING)  # reopens: an empty tier
    assert not b.read_blocks([0], [np.zeros(1, np.uint8)]).any()
    b.remove()
    assert not (tmp_path / "keep.bin").exists()


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
