import numpy as np
import pytest

from dflash2.alloc import SlotAllocator, blocks_that_fit, slab_shape, slot_bytes

MIB = 1 << 20


def test_slot_rounds_up_to_alignment():
    assert slot_bytes(1, 256) == 256
    assert slot_bytes(4096, 4096) == 4096
    assert slot_bytes(4097, 4096) == 8192


def test_alloc_is_all_or_nothing():
    a = SlotAllocator(4 * MIB, MIB, 256)
    assert a.alloc(MIB, 5) is None
    assert a.used_bytes == 0 and a.free_bytes == 4 * MIB
    got = a.alloc(MIB, 4)
    assert sorted(got.tolist()) == [0, MIB, 2 * MIB, 3 * MIB]
    assert a.alloc(256, 1) is None


def test_offsets_are_unique_and_in_range():
    a = SlotAllocator(8 * MIB, MIB, 256)
    got = np.concatenate([a.alloc(100_000, 10), a.alloc(300_000, 5), a.alloc(3 * MIB, 1)])
    ends = got + np.array([100_096] * 10 + [300_032] * 5 + [3 * MIB])
    order = np.argsort(got)
    assert (got[order][1:] >= ends[order][:-1]).all(), "slots overlap"
    assert ends.max() <= 8 * MIB


def test_layouts_share_the_arena_without_partitions():
    """Pages freed by one size class are reused by another."""
    a = SlotAllocator(8 * MIB, MIB, 256)
    small = a.alloc(64 * 1024, 128)  # fills all 8 pages
    assert small is not None and a.alloc(MIB, 1) is None
    a.free(64 * 1024, small)
    big = a.alloc(MIB, 8)
    assert big is not None and a.used_bytes == 8 * MIB


def test_rounding_waste_is_measured():
    a = SlotAllocator(8 * MIB, MIB, 4096)
    a.alloc(5000, 10)  # slot 8192: 3192 bytes of rounding each
    st = a.stats()
    assert st["block_bytes"] == 50_000
    assert st["rounding_waste_bytes"] == 10 * 3192
    assert st["used_bytes"] == 10 * 8192


@pytest.mark.parametrize("block", [4096, 16 * 1024, 100_000, 3 * MIB, 5 * MIB + 17])
def test_blocks_that_fit_matches_real_allocation(block):
    cap, page = 64 * MIB, 2 * MIB
    n = blocks_that_fit(cap, page, 256, block)
    a = SlotAllocator(cap, page, 256)
    assert a.alloc(block, n) is not None
    assert a.alloc(block, 1) is None


def test_slab_shape_keeps_tail_waste_small():
    pages, per = slab_shape(slot_bytes(5 * MIB, 256), 2 * MIB)
    assert per * 5 * MIB >= 0.95 * pages * 2 * MIB
