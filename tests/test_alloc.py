import copy
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


def _first_fit_one_at_a_time(free: np.ndarray, length: int, k: int) -> list[int]:
    """The reference: k first-fit searches, each after the pages of the last run are taken."""
    free, heads = free.copy(), []
    for _ in range(k):
        head = next((h for h in range(len(free) - length + 1) if free[h: h + length].all()), None)
        if head is None:
            break
        heads.append(head)
        free[head: head + length] = False
    return heads


@pytest.mark.parametrize("length", [1, 2, 3, 7])
def test_many_slabs_are_claimed_in_one_pass_as_one_at_a_time_would(length):
    """A promotion of blocks as large as a page claims a slab per block: all at once, the same
    slabs in the same order as claiming them one by one (first fit)."""
    rng = np.random.default_rng(length)
    for _ in range(30):
        a = SlotAllocator(200 * MIB, MIB, 256)
        a._page_free[:] = rng.random(200) < rng.uniform(0.2, 0.95)
        a._n_free_pages = int(a._page_free.sum())
        k = int(rng.integers(1, 40))
        want = _first_fit_one_at_a_time(a._page_free, length, k)
        assert a._find_runs(length, k).tolist() == want


def test_a_large_allocation_of_page_sized_blocks_fills_scattered_pages_exactly():
    """Free pages scattered through a full tier: one alloc takes them all, each slot once, and
    a further block does not fit (all or nothing); freeing and allocating again gives them back."""
    a = SlotAllocator(64 * MIB, MIB, 256)
    everything = a.alloc(MIB, 64)
    freed = everything[np.random.default_rng(0).permutation(64)[:20]]
    a.free(MIB, freed)
    a._reclaim(exclude=-1)  # their empty slabs back to the page pool, as a tier under pressure does
    got = a.alloc(MIB, 20)
    assert sorted(got.tolist()) == sorted(freed.tolist())
    assert a.alloc(MIB, 1) is None and a.used_bytes == 64 * MIB
    a.free(MIB, got)
    assert sorted(a.alloc(MIB, 20).tolist()) == sorted(freed.tolist())
    # Two-page slabs (a 1.5 MiB slot): only whole free runs count, and a shortfall changes nothing.
    b = SlotAllocator(16 * MIB, MIB, 256)
    b._page_free[:] = np.array([1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 0], dtype=bool)
    b._n_free_pages = int(b._page_free.sum())
    assert b._find_runs(2, 10).tolist() == [0, 5, 7, 10]
    assert b.alloc(3 * MIB // 2, 5) is None
    assert int(b._page_free.sum()) == 10 and b.used_bytes == 0
    assert b.alloc(3 * MIB // 2, 4) is not None


def test_alloc_in_used_slabs_takes_no_room_another_size_could_use():
    """Slabs of 8 KiB slots, two to a 16 KiB page: free slots in slabs still in use are handed out;
    an empty slab's and free pages' never (they are room for 16 KiB blocks), so the room of the
    other size stays as it was. Fewer such slots than asked: None, and nothing changes; asked again
    after a slot of the class was freed, it looks again."""
    a = SlotAllocator(8 * 16384, 16384, 256)
    small = a.alloc(8192, 8)  # four pages
    a.free(8192, small[[0, 2]])  # one free slot in each of two slabs still in use
    a.free(8192, small[[4, 5]])  # the third slab empty: room for 16 KiB blocks (reclaimable)
    room16, stats = a.room_for(16384), a.stats()
    assert a.alloc_in_used_slabs(8192, 3) is None  # only two such slots
    assert a.stats() == stats and a.room_for(16384) == room16
    a.free(8192, small[[6]])  # a third, in the fourth slab (its other slot still in use)
    room16 = a.room_for(16384)
    got = a.alloc_in_used_slabs(8192, 3)
    assert sorted(got.tolist()) == sorted(small[[0, 2, 6]].tolist())
    assert a.room_for(16384) == room16 and a.used_bytes == 6 * 8192
    assert a.alloc_in_used_slabs(8192, 1) is None and a.alloc_in_used_slabs(4096, 1) is None
    a.free(8192, got)  # handed out properly: freed as any slot
    assert a.used_bytes == 3 * 8192


def test_first_fit_from_the_lowest_free_page_finds_what_a_whole_pass_finds(monkeypatch):
    """The searches for free pages start at the lowest page that may be free (`_free_from`), a
    window at a time for single pages (a pass over the whole page map per claim cost a drain piece
    3 ms at two million NVMe pages): over random allocations and frees of slots of one page, half a
    page and four pages, every search finds the runs a pass over the whole map finds, and no page
    below `_free_from` is free."""
    import dflash2.alloc as alloc_mod

    monkeypatch.setattr(alloc_mod, "SCAN_PAGES", 8)  # windows much smaller than the map
    a = SlotAllocator(256 * 16384, 16384, 256)
    find_runs, searches = SlotAllocator._find_runs, []

    def whole_pass(self, length, k):
        if k <= 0 or self._n_free_pages < length:
            return np.empty(0, dtype=np.int64)
        count = np.concatenate(([0], np.cumsum(self._page_free, dtype=np.int64)))
        hits = np.flatnonzero(count[length:] - count[:-length] == length)
        heads, i = [], 0
        while len(heads) < k and i < len(hits):
            heads.append(int(hits[i]))
            i = int(np.searchsorted(hits, hits[i] + length))
        return np.asarray(heads, dtype=np.int64)

    def checked(self, length, k):
        got = find_runs(self, length, k)
        assert got.tolist() == whole_pass(self, length, k).tolist(), (length, k)
        searches.append(length)
        return got
    monkeypatch.setattr(SlotAllocator, "_find_runs", checked)
    rng = np.random.default_rng(3)
    held = []
    for _ in range(600):
        if held and rng.random() < 0.45:
            size, offsets = held.pop(int(rng.integers(len(held))))
            a.free(size, offsets)
        else:
            size = int(rng.choice([8192, 16384, 65536]))
            got = a.alloc(size, int(rng.integers(1, 9)))
            if got is not None:
                held.append((size, got))
        assert not a._page_free[: a._free_from].any()
    assert searches.count(1) > 50 and searches.count(4) > 20


def test_capacity_is_whole_pages_a_tail_past_the_last_page_holds_no_block():
    alloc = SlotAllocator(3 * MIB, 2 * MIB, 4096)
    assert alloc.capacity_bytes == 2 * MIB
    assert alloc.alloc(256 * 1024, 8) is not None and alloc.alloc(256 * 1024, 1) is None
    assert alloc.used_bytes == alloc.capacity_bytes  # full reads full


def _host_manager_in_2_mib_pages(hbm_mb: int, dram_mb: int, name: str, **policy):
    """(config, manager) of a host daemon's tiers (lru, `policy` keys beside) in 2 MiB pages, as the
    daemon builds them."""
    from dflash2.assemble import build_manager
    from dflash2.config import parse_config

    cfg = parse_config({"enable": True, "device": {"kind": "host"},
                        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": hbm_mb, "dram_capacity_mb": dram_mb,
                                   "page_kb": 2048, "staging_buffer_size_mb": 4},
                        "policy": {"name": "lru", **policy}})
    return cfg, build_manager(cfg, instance=f"t-alloc-{name}-{__import__('os').getpid()}")


def test_a_full_hbm_with_a_page_tail_crosses_its_high_watermark():
    """HBM of 3 MiB in 2 MiB pages (HBM is not rounded to pages; DRAM and NVMe are): full, it read
    2/3 used, under its high watermark for good, and the background never drained it (a review)."""
    from dflash2.layout import Layout
    from dflash2.tiers import Tier

    cfg, m = _host_manager_in_2_mib_pages(hbm_mb=3, dram_mb=16, name="tail")
    try:
        c = m.attach("t")
        lid = m.register_layout(Layout("l", 1, 1, 64 * 1024, "fp16", 1))  # 256 KiB blocks
        vids = m.allocate(c, lid, 8)  # every slot of HBM's one whole page
        m.commit(c, vids, keys=list(range(1, 9)))
        m.free(c, vids)  # cached, idle
        assert m.placement.used_fraction(Tier.HBM) >= cfg.policy.watermarks.hbm.high
        m.tick()
        assert m.stats()["tiers"]["dram"]["blocks"] > 0, "the background drains a full HBM"
    finally:
        m.close()


def test_a_drain_stops_at_low_as_the_watermarks_weigh_the_tier():
    """Blocks just over a page (2 MiB + 4 KiB: a slab of two pages each, nearly half of it tail). The
    drain began by the watermarks' measure but stopped by free bytes, where the tails of emptied slabs
    (kept by their size until another needs the pages) never came free: with `low` 0.45 it moved every
    block out of HBM (a review). It stops at `low` in the watermarks' measure: 7 blocks of 4 MiB stay."""
    from dflash2.layout import Layout
    from dflash2.tiers import Tier

    _, m = _host_manager_in_2_mib_pages(hbm_mb=64, dram_mb=256, name="drainlow",
                                        watermarks={"hbm": {"high": 0.9, "low": 0.45}})
    try:
        c = m.attach("t")
        lid = m.register_layout(Layout("x", 1, 1, 1024, "bf16", 513))
        assert m.table.slot_bytes(lid, Tier.HBM) == 2 * MIB + 4096
        vids = m.allocate(c, lid, 16)  # every slot of HBM's 32 pages
        m.free(c, m.commit(c, vids, keys=list(range(1, 17))))
        for _ in range(20):
            m.tick()
            m.settle()
        assert m.stats()["tiers"]["hbm"]["blocks"] == 7, m.stats()["tiers"]["hbm"]
        assert 0.45 - 4 / 64 < m.placement.used_fraction(Tier.HBM) <= 0.45
    finally:
        m.close()


def test_full_bytes_counts_the_page_tails_of_slabs_in_use_only():
    """Page tails count as full while a block lies in their slab; an empty slab's tail is room (it
    goes back to the pages): counted from what was not free, a tier whose blocks all left read 12.5%
    full, and with blocks of just over a page 49%, over a legal watermark (a review)."""
    alloc = SlotAllocator(8 * MIB, 2 * MIB, 4096)
    offsets = alloc.alloc(1_835_008, 4)
    assert offsets is not None and alloc.free_bytes == 0
    assert alloc.full_bytes == alloc.capacity_bytes > alloc.used_bytes
    alloc.free(1_835_008, offsets[:1])
    assert alloc.full_bytes == 3 * 2 * MIB
    alloc.free(1_835_008, offsets[1:])
    assert alloc.full_bytes == 0 and alloc.free_bytes < alloc.capacity_bytes  # (the slabs stay claimed)
    span = SlotAllocator(32 * MIB, 2 * MIB, 4096)
    assert span.alloc(2 * MIB + 4096, 1) is not None and span.full_bytes == 4 * MIB  # a slab of two pages
    span.free(2 * MIB + 4096, span.alloc(2 * MIB + 4096, 1))
    assert span.full_bytes == 4 * MIB


def test_a_tier_whose_blocks_leave_page_tails_is_full_when_nothing_is_free():
    """1,835,008-byte blocks (a 7B model's bf16 at 32 tokens) in 2 MiB pages leave 12.5% of each page
    unused: a tier with no free byte read 87.5% used, under its high watermark and the alerts, and the
    background never drained it (a review). Its fill counts the page tails of its slabs."""
    from dflash2.layout import Layout
    from dflash2.metrics import _tier_families
    from dflash2.tiers import Tier

    _, m = _host_manager_in_2_mib_pages(hbm_mb=8, dram_mb=32, name="pagetail")
    try:
        c = m.attach("t")
        lid = m.register_layout(Layout("qwen7b", 28, 4, 128, "bf16", 32))
        assert m.table.layouts[lid].block_bytes == 1_835_008
        n = m.placement.free_bytes(Tier.HBM, 1_835_008) // m.table.slot_bytes(lid, Tier.HBM)
        vids = m.allocate(c, lid, n)  # every slot HBM has for them
        m.commit(c, vids, keys=list(range(1, n + 1)))
        m.free(c, vids)  # cached, idle
        hbm = m.stats()["tiers"]["hbm"]
        assert hbm["free_bytes"] == 0 and hbm["used_bytes"] < 0.9 * hbm["capacity_bytes"], hbm
        assert m.placement.used_fraction(Tier.HBM) == 1.0
        family = next(f for f in _tier_families(m.stats()) if f.name == "dflash2_gpu_memory_utilization")
        assert [s.value for s in family.samples] == [1.0]
        m.tick()
        assert m.stats()["tiers"]["dram"]["blocks"] > 0, "the background drains a full HBM"
    finally:
        m.close()


@pytest.mark.parametrize("seed", range(40))
def test_room_without_is_never_below_the_room_left_once_the_rest_is_freed(seed):
    """`room_without` is the room for one size were every block gone but those kept, as the
    allocator counts it (roombound.py refuses a call only below it, so under the truth it would
    refuse one that could succeed; above it, a call that cannot succeed made room first)."""
    rng = np.random.default_rng(seed)
    page = 64 * 1024
    a = SlotAllocator(24 * page, page, 256)
    sizes = [8 * 1024, 16 * 1024, 40 * 1024, 96 * 1024, 200 * 1024]
    held = _churned(rng, a, sizes, 60)
    for size, off in [h for h in held if rng.random() < 0.1]:  # (as NVMe slots whose storage failed)
        held.remove((size, off))
        a.free(size, np.array([off]))
        a.quarantine(size, np.array([off]))
    kept = [h for h in held if rng.random() < 0.3]
    asked = sizes[rng.integers(len(sizes))]
    bound = a.room_without(a.slot_for(asked), np.array([o for _, o in kept], dtype=np.int64))
    for size, off in held:
        if (size, off) not in kept:
            a.free(size, np.array([off]))
    truth = a.room_for(asked)
    assert bound == truth  # (slabs of several pages too: from the runs, as blocks_free counts them)


def _churned(rng, a: SlotAllocator, sizes: list[int], steps: int) -> list[tuple[int, int]]:
    """Random allocations of `sizes` and frees in `a`: the (block bytes, offset) still held."""
    held = []
    for _ in range(steps):
        size = sizes[rng.integers(len(sizes))]
        got = a.alloc(size, int(rng.integers(1, 4)))
        if got is not None:
            held += [(size, int(o)) for o in got]
        if held and rng.random() < 0.3:
            size, off = held.pop(int(rng.integers(len(held))))
            a.free(size, np.array([off]))
    return held


@pytest.mark.parametrize("seed", range(200))
def test_sizes_fit_never_refuses_blocks_of_several_sizes_that_fit(seed):
    """`sizes_fit` is a necessary condition for blocks of several sizes to lie in the arena at once
    were every block gone but those kept (roombound.py refuses a read of several sizes on it): where
    allocating them, in any order tried here, succeeds once the rest is freed, it says so."""
    rng = np.random.default_rng(seed)
    page = 64 * 1024
    a = SlotAllocator(16 * page, page, 256)
    sizes = [8 * 1024, 16 * 1024, 40 * 1024, 96 * 1024]
    held = _churned(rng, a, sizes, 40)
    kept = [h for h in held if rng.random() < 0.4]
    asked = {sizes[i]: int(rng.integers(1, 6)) for i in rng.choice(len(sizes), 2, replace=False)}
    counts = {a.slot_for(s): n for s, n in asked.items()}
    said = a.sizes_fit(counts, np.array([o for _, o in kept], dtype=np.int64))
    for size, off in held:
        if (size, off) not in kept:
            a.free(size, np.array([off]))
    for order in (sorted(asked, reverse=True), sorted(asked)):
        trial = copy.deepcopy(a)
        if all(trial.alloc(s, asked[s]) is not None for s in order):
            assert said, (asked, kept)
            break
