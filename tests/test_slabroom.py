"""Room by slabs (dflash2/slabroom.py): room for one slot size among blocks of another empties whole
slabs (the last section, moved from test_placement.py), and what reviews of 2026-12-05 found since:
slots of several pages beside a free run, a tier below smaller than one slab, the cheap first pass on
prefix chains, admission by slab. Each failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier
from dflash2.placement import Watermark
from placement_helpers import fill, tier_of

PAGE = 64 << 10


def layout(layers: int, name: str) -> Layout:
    return Layout(name, num_layers=layers, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)


SMALL = layout(2, "small")  # 16 KiB: four to a page


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _idle_small_blocks(mgr, clock, a, lid: int, n: int) -> np.ndarray:
    """`n` small blocks written, published and freed one at a time, each newer than the last (page by
    page, four to a page): their vids."""
    vids = []
    for k in range(n):
        clock.now += 1
        v = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[k + 1])
        mgr.free(a, v)
        vids.append(int(v[0]))
    return np.array(vids)


def test_a_slot_of_five_pages_beside_a_free_run_empties_only_the_slabs_it_needs():
    """Pages 0-4 free (room for one 5-page slot); two such blocks asked: the free pages were counted
    again beside each cold slab, and four slabs were emptied for no room (36 blocks dropped, 20 did)."""
    clock, n = Clock(), 32
    mgr = BlockManager([TierSpec(Tier.HBM, n * PAGE, PAGE, 256)], policy="lru", clock=clock)
    a = mgr.attach("a")
    s, five = mgr.register_layout(SMALL), mgr.register_layout(layout(40, "five-pages"))  # 320 KiB
    vids = _idle_small_blocks(mgr, clock, a, s, 4 * n)
    cold = [5, 6, 7, 8, 20, 21, 22, 23, 24]  # pages whose blocks stay coldest; the others are read again
    for i in range(4 * n):
        if i // 4 not in cold + [0, 1, 2, 3, 4]:
            clock.now += 1
            rows = mgr.table.rows(vids[[i]])
            mgr.table.touch(rows)
            mgr.policy.on_access(mgr.table, rows, clock.now)
    mgr.placement._evict(mgr.table.rows(vids[:20]))  # pages 0-4 free
    before = mgr.placement.stats.evicted
    assert mgr.allocate(a, five, 2) is not None, mgr.allocate_refusal
    assert mgr.placement.stats.evicted - before == 20  # one run of five pages: 20 blocks
    mgr.check_invariants()


def test_a_tier_below_smaller_than_one_slab_is_no_error():
    """A 192 KiB block (3 pages) to demote into a DRAM of 2 pages holding a small block: numpy's
    sliding window raised ValueError out of `allocate`."""
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 6 * PAGE, PAGE, 256), TierSpec(Tier.DRAM, 2 * PAGE, PAGE, 4096)],
                       policy="lru", clock=clock)
    a = mgr.attach("a")
    s, big = mgr.register_layout(SMALL), mgr.register_layout(layout(24, "big"))
    clock.now += 1
    mgr.free(a, mgr.commit(a, mgr.allocate(a, s, 1, tier=Tier.DRAM), keys=[1]))
    for k in (10, 11):
        clock.now += 1
        mgr.free(a, mgr.commit(a, mgr.allocate(a, big, 1), keys=[k]))
    clock.now += 1
    assert mgr.allocate(a, big, 1) is not None
    mgr.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_room_for_one_block_among_chains_takes_the_cheap_pass(policy, monkeypatch):
    """Under lru a chain's oldest, coldest block is its head, which cannot leave first: the first pass
    chose it, failed, and the full pass over every movable row (the prefix forest) ran at every
    allocation of a mixed tier (60-130 ms against 3-6 at 250,000 blocks, a review)."""
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 64 * PAGE, PAGE, 256)], policy=policy, clock=clock)
    a = mgr.attach("a")
    s, big = mgr.register_layout(SMALL), mgr.register_layout(layout(8, "page"))  # 64 KiB: a page each
    for chain in range(28):  # 28 chains of 8 small blocks: 56 pages
        clock.now += 1
        mgr.free(a, mgr.commit(a, mgr.allocate(a, s, 8), keys=list(range(chain * 100 + 1, chain * 100 + 9))))
    for k in range(8):  # and 8 pages of page-sized blocks: the tier is full
        clock.now += 1
        mgr.free(a, mgr.commit(a, mgr.allocate(a, big, 1), keys=[10_000 + k]))
    from dflash2 import slabroom

    forests = []
    real = slabroom.subtree_heights  # (the full pass's, over every movable row)
    monkeypatch.setattr(slabroom, "subtree_heights", lambda *a, **k: forests.append(1) or real(*a, **k))
    clock.now += 1
    before = mgr.placement.stats.evicted
    assert mgr.allocate(a, s, 1) is not None
    assert mgr.placement.stats.evicted - before == 1
    assert not forests, "the full pass ran for one small block"
    mgr.check_invariants()


def test_a_large_block_asked_for_once_does_not_push_hot_blocks_out_by_their_slab():
    """Admission at the last tier compared a page-sized candidate with the tier's coldest blocks by
    score, spread over every slab, while room by slabs then emptied a whole slab, hot blocks and all:
    a block asked for once pushed out two asked for six times (a review)."""
    clock = Clock()
    big = Layout("big", num_layers=4, num_kv_heads=1, head_dim=64, dtype="fp16", tokens_per_block=64)  # a page
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * PAGE, PAGE, 256), TierSpec(Tier.DRAM, 4 * PAGE, PAGE, 4096)],
                       policy="heat", clock=clock)
    small, lb = mgr.register_layout(SMALL), mgr.register_layout(big)
    c = mgr.attach("c")
    keys = list(range(100, 116))  # DRAM (the last tier) full: four pages of four small blocks
    vids = []
    for k in keys:
        clock.now += 1
        vids.append(int(mgr.commit(c, mgr.allocate(c, small, 1, tier=Tier.DRAM), [k])[0]))
    mgr.free(c, vids)
    hot = [k for i, k in enumerate(keys) if i % 4 in (2, 3)]  # two of every page, asked for six times
    for _ in range(5):
        for i, k in enumerate(keys):
            if k in hot:
                clock.now += 1
                rows = mgr.table.rows(np.array([vids[i]]))
                mgr.table.touch(rows)
                mgr.placement.policy.on_access(mgr.table, rows, clock.now)
    clock.now += 1
    mgr.free(c, mgr.commit(c, mgr.allocate(c, lb, 1), [7]))  # asked for once
    mgr.placement.make_room(Tier.HBM, 2 * PAGE)  # (it leaves HBM: DRAM must take it or drop it)
    assert all(mgr.lookup([k], small) for k in hot)
    mgr.check_invariants()


@pytest.mark.parametrize("slab_first", [False, True])
def test_a_two_page_slot_finds_the_room_a_clear_slab_makes_on_either_side_of_a_free_run(slab_first):
    """A clear slab just before a free run of three pages: emptying it makes a run of four, room for
    two 2-page slots; the run's pages left over were counted at its end only, so no window joined the
    slab and the allocation was refused (a review)."""
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 4 * PAGE, PAGE, 256)], policy="lru", clock=clock)
    a = mgr.attach("a")
    s, two = mgr.register_layout(SMALL), mgr.register_layout(layout(16, "two-pages"))  # 128 KiB
    vids = _idle_small_blocks(mgr, clock, a, s, 16)  # the whole tier: four pages of four small blocks
    mgr.placement._evict(mgr.table.rows(vids[4:] if slab_first else vids[:12]))
    assert mgr.allocate(a, two, 2) is not None, mgr.allocate_refusal
    mgr.check_invariants()


def test_a_three_page_slot_finds_the_room_two_clear_slabs_make_only_together():
    """Six pages: 1-3 and 5 free (room for one 3-page slot), 0 and 4 each a slab of one idle block.
    Emptying either alone makes no second run of three; both do. No window of three pages is free or
    clear throughout, so no victims were found and the allocation was refused; in a manager with
    DRAM below, the rounds before had demoted most of HBM and dropped a cached block for it (a review's
    model-based test)."""
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 6 * PAGE, PAGE, 256)], policy="lru", clock=clock)
    a = mgr.attach("a")
    s, three = mgr.register_layout(SMALL), mgr.register_layout(layout(24, "three-pages"))  # 192 KiB
    vids = _idle_small_blocks(mgr, clock, a, s, 24)  # the whole tier: six pages of four small blocks
    assert (mgr.table.cols.offset[mgr.table.rows(vids[[0, 16]])] // PAGE).tolist() == [0, 4]
    mgr.placement._evict(mgr.table.rows(np.delete(vids, [0, 16])))
    assert mgr.allocate(a, three, 2) is not None, mgr.allocate_refusal
    assert mgr.placement.stats.evicted == 24  # the two blocks in the way, no more
    mgr.check_invariants()


def _cold_chain_beside_pages(policy: str, hold_pages: bool):
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 32 * PAGE, PAGE, 256)], policy=policy, clock=clock)
    a = mgr.attach("a")
    s, page = mgr.register_layout(SMALL), mgr.register_layout(layout(8, "page"))  # 16 KiB, 64 KiB
    clock.now += 1
    mgr.free(a, mgr.commit(a, mgr.allocate(a, s, 64), keys=list(range(1, 65))))  # one cold chain: 16 pages
    pages = []
    for k in range(16):  # 16 pages of page-sized blocks
        clock.now += 1
        v = mgr.commit(a, mgr.allocate(a, page, 1), keys=[10_000 + k])
        if not hold_pages:
            mgr.free(a, v)
        pages.append(int(v[0]))
    return clock, mgr, a, s, page, pages


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_hot_blocks_of_another_size_stay_while_a_cold_chain_can_leave(policy):
    """Blocks of the room's size with a cached child were ranked last (inf) in the cheap pass: hot
    page-sized blocks' slabs were emptied while a cold chain's tail stayed (a review)."""
    clock, mgr, a, s, page, pages = _cold_chain_beside_pages(policy, hold_pages=False)
    for _ in range(6):  # the page-sized blocks read again and again
        for v in pages:
            clock.now += 1
            rows = mgr.table.rows(np.array([v]))
            mgr.table.touch(rows)
            mgr.policy.on_access(mgr.table, rows, clock.now)
    clock.now += 1
    assert mgr.allocate(a, s, 32) is not None  # 8 pages' worth
    assert all(mgr.lookup([10_000 + k], page) for k in range(16))
    mgr.check_invariants()


def test_a_cold_chain_leaves_in_one_round():
    """With blocks of another size that cannot move, a chain of the room's size left one level per
    round of make_room (128 rounds, 139 ms, against one round and 2 ms, a review)."""
    clock, mgr, a, s, page, pages = _cold_chain_beside_pages("lru", hold_pages=True)
    rounds = []
    real = mgr.placement._select_slabs
    monkey = lambda *x, **k: (lambda out: rounds.append(len(out)) or out)(real(*x, **k))  # noqa: E731
    mgr.placement._select_slabs = monkey
    clock.now += 1
    assert mgr.allocate(a, s, 32) is not None
    assert len(rounds) <= 2, rounds
    mgr.check_invariants()


# -- room for one slot size among blocks of another: whole slabs ----------------------------------
# (PAGE: 4 blocks of SMALL a page; 16 pages: 64 blocks)
PAGE_BLOCK = Layout("page", num_layers=8, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
TWO_PAGES = Layout("two-pages", num_layers=16, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)


def slab_manager(clock, policy="lru", dram_pages=0, **kw):
    """HBM of 16 pages of 64 KiB (the last tier unless `dram_pages`), full of 64 SMALL blocks keyed
    1..64, block i (from 0) in page i // 4, cached and idle."""
    assert (PAGE_BLOCK.block_bytes, TWO_PAGES.block_bytes) == (PAGE, 2 * PAGE)
    specs = [TierSpec(Tier.HBM, 16 * PAGE, PAGE, 256)]
    if dram_pages:
        specs.append(TierSpec(Tier.DRAM, dram_pages * PAGE, PAGE, 4096))
    mgr = BlockManager(specs, policy=policy, clock=clock, **kw)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    vids = []
    for k in range(1, 65):
        clock.advance(1)
        vids.append(int(fill(mgr, a, lid, [k])[0]))
    assert mgr.placement.free_bytes(Tier.HBM) == 0
    return mgr, a, lid, np.array(vids)


def read_again(mgr, client, clock, vids):
    for v in vids:
        clock.advance(1)
        mgr.acquire(client, [int(v)])
        mgr.release(client, [int(v)])


def pages_read_again_but(skip):
    """Blocks 0, 2 of every page but those in `skip`: the coldest blocks lie in every slab."""
    return [i for i in range(64) if i % 4 in (0, 2) and i // 4 not in skip]


def cached_keys(mgr, lid):
    return {k for k in range(1, 65) if mgr.lookup([k], lid)}


def keys_of_pages(*pages):
    return {1 + i for p in pages for i in range(4 * p, 4 * p + 4)}


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_one_block_of_a_page_empties_the_coldest_slab_not_every_slab(clock, policy):
    """Room for a block that needs a whole page, in a last tier full of blocks a quarter of a page:
    the victims were the tier's lowest-scored blocks, whatever their page, round after round until
    a page happened to empty, and the coldest lay in every page (a reviewer's 64 MiB HBM of 4,096
    blocks of 16 KiB, half read again: one 1 MiB block dropped 2,079 with heat, 3,488 with lru). Now
    the one slab whose blocks are all cold goes, and only it."""
    mgr, a, lid, vids = slab_manager(clock, policy)
    read_again(mgr, a, clock, vids[pages_read_again_but({9})])
    big = mgr.register_layout(PAGE_BLOCK)
    got = mgr.allocate(a, big, 1)
    assert got is not None, mgr.allocate_refusal
    assert cached_keys(mgr, lid) == set(range(1, 65)) - keys_of_pages(9)
    assert mgr.placement.stats.evicted == 4
    mgr.check_invariants()
    mgr.close()


def test_a_block_of_two_pages_empties_the_coldest_run_of_two(clock):
    """A slot of two pages needs them contiguous: the two neighbouring cold slabs go (page 12,
    cold too, has hot neighbours)."""
    mgr, a, lid, vids = slab_manager(clock)
    read_again(mgr, a, clock, vids[pages_read_again_but({4, 5, 12})])
    got = mgr.allocate(a, mgr.register_layout(TWO_PAGES), 1)
    assert got is not None, mgr.allocate_refusal
    assert cached_keys(mgr, lid) == set(range(1, 65)) - keys_of_pages(4, 5)
    mgr.check_invariants()
    mgr.close()


def test_room_by_slabs_demotes_whole_slabs_into_the_tier_below(clock):
    """With a tier below, the same choice demotes: the cold slab goes down whole, nothing else (a
    reviewer's: 3,184 of 4,096 blocks of 16 KiB demoted for one 1 MiB block)."""
    mgr, a, lid, vids = slab_manager(clock, dram_pages=32, watermarks={
        Tier.HBM: Watermark(1.0, 0.95), Tier.DRAM: Watermark(1.0, 0.95)})  # (a room batch of one page)
    read_again(mgr, a, clock, vids[pages_read_again_but({3})])
    got = mgr.allocate(a, mgr.register_layout(PAGE_BLOCK), 1)
    assert got is not None, mgr.allocate_refusal
    assert mgr.placement.stats.demoted == 4 and mgr.placement.stats.evicted == 0
    assert [i for i in range(64) if tier_of(mgr, vids[i]) == Tier.DRAM] == [12, 13, 14, 15]
    mgr.check_invariants()
    mgr.close()


@pytest.mark.parametrize("child", ["cold", "hot", "held"])
def test_a_slab_leaves_with_the_descendants_that_hold_it(clock, child):
    """Prefix order, slab by slab: a block of the coldest slab (page 2) has a child in page 9. A
    cold child leaves with it (and only it of page 9); a hot one makes page 2 as hot as it (a slab
    costs the hottest block that leaves with it), and a held one keeps page 2 where it is: the next
    coldest slab (page 5, cold but for that) goes instead."""
    mgr = BlockManager([TierSpec(Tier.HBM, 16 * PAGE, PAGE, 256)], policy="lru", clock=clock)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    vids = []
    for k in range(1, 65):
        clock.advance(1)
        parent = vids[9] if k == 38 else None  # block 37 (page 9) under block 9 (page 2)
        vids.append(int(fill(mgr, a, lid, [k], parent=parent)[0]))
    vids = np.array(vids)
    others = pages_read_again_but({2} if child == "cold" else {2, 5})
    read_again(mgr, a, clock, vids[others + ([37] if child == "hot" else [])])
    if child == "held":
        mgr.acquire(a, [int(vids[37])])
    got = mgr.allocate(a, mgr.register_layout(PAGE_BLOCK), 1)
    assert got is not None, mgr.allocate_refusal
    gone = set(range(1, 65)) - cached_keys(mgr, lid)
    assert gone == (keys_of_pages(2) | {38} if child == "cold" else keys_of_pages(5))
    mgr.check_invariants()
    mgr.close()


def test_room_of_one_slot_size_makes_no_pass_by_slabs(clock, monkeypatch):
    """Where every block has the room's slot size, or free slots of its size suffice, room is made
    as ever: one selection by score, no pass over the slabs."""
    from dflash2.placement import Placement
    monkeypatch.setattr(Placement, "_select_slabs", lambda *a, **kw: pytest.fail("a pass by slabs"))
    mgr, a, lid, vids = slab_manager(clock)
    assert mgr.allocate(a, lid, 3) is not None and mgr.placement.stats.evicted == 3
    mgr.close()


@pytest.mark.parametrize("big_is", ["hot", "cold"])
def test_room_for_small_blocks_beside_a_page_block_takes_the_coldest(clock, big_is):
    """Room by slabs for the small size itself: its blocks go one by one, coldest first, and a
    page block's slab (a page: four small slots) only where it is colder than they are."""
    mgr, a, lid, vids = slab_manager(clock)
    mgr.placement._evict(mgr.table.rows(vids[60:]))  # page 15 for one page block
    big = fill(mgr, a, mgr.register_layout(PAGE_BLOCK), [99])
    if big_is == "hot":
        read_again(mgr, a, clock, big)
    read_again(mgr, a, clock, vids[2 if big_is == "hot" else 0:60])
    assert mgr.allocate(a, lid, 2) is not None
    gone = set(range(1, 61)) - cached_keys(mgr, lid)
    assert (gone, mgr.lookup([99], mgr.register_layout(PAGE_BLOCK)) == []) == (
        ({1, 2}, False) if big_is == "hot" else (set(), True))
    mgr.check_invariants()
    mgr.close()


def test_an_allocate_of_two_slabs_over_chains_split_across_full_tiers_is_served(make_manager, clock):
    """The model-based test's shrunk sequence (16 KiB pages, a 40 KiB block in a 3-page slot): HBM
    full of two idle cached chains, one of them reaching into a small DRAM tier. The bound said the
    room was there; making it demoted four blocks and dropped one, then found no victims for the last
    run of three pages (the two slabs left had to go together) and the allocation was refused, every
    retry alike (a review)."""
    from conftest import SMALL as S16
    big = Layout("big", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=40)
    m = make_manager(hbm_blocks=6, dram_blocks=4, swap_batch_size=4)
    s, b = m.register_layout(S16), m.register_layout(big)
    c = m.attach("c")
    a = m.allocate(c, s, 3, tier=Tier.DRAM)
    m.free(c, m.commit(c, a, keys=[20, 21, 22]))
    m.release(c, [p.vid for p in m.acquire(c, a[:1])])
    m.free(c, m.commit(c, m.allocate(c, s, 3), keys=[1, 2, 3]))
    m.acquire(c, a)  # the chain 20-21-22 up to HBM
    m.release(c, a[:1])
    m.release(c, a[1:2])
    m.tick()
    m.release(c, a[2:3])
    clock.advance(0.5)
    m.tick()  # HBM full: its drain demotes key 3 to DRAM
    m.free(c, m.commit(c, m.allocate(c, s, 1), keys=[23], parent=int(a[2])))
    assert m.allocate(c, b, 2) is not None, m.allocate_refusal
    m.check_invariants()


def test_a_three_page_slot_beside_two_free_pages_empties_one_slab():
    """Pages 2-3 free, 0 and 1 each a slab of idle blocks, page 0 the colder: the windows [0, 1, 2]
    and [1, 2, 3] cost alike (a window's cost is its hottest slab's), and the first was taken, page
    0's slab emptied for no room (a review). Ties go to the window of fewer slabs to empty."""
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 4 * PAGE, PAGE, 256)], policy="lru", clock=clock)
    a = mgr.attach("a")
    s, three = mgr.register_layout(SMALL), mgr.register_layout(layout(24, "three-pages"))  # 192 KiB
    vids = _idle_small_blocks(mgr, clock, a, s, 16)  # pages 0..3, four idle small blocks each, page 0 the coldest
    assert (mgr.table.cols.offset[mgr.table.rows(vids)] // PAGE).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    mgr.placement._evict(mgr.table.rows(vids[8:]))
    assert mgr.allocate(a, three, 1) is not None, mgr.allocate_refusal
    assert mgr.placement.stats.evicted == 8 + 4  # page 1's slab only
    mgr.check_invariants()


def test_a_sizes_own_empty_slabs_are_cut_anew_among_pages_of_another_size():
    """16 pages, a 96 KiB slot a slab of 2: seven such slabs cut around two pages of idle 16 KiB
    blocks (pages 2 and 9), then emptied. Eight 96 KiB blocks (the tier holds eight) were refused,
    "HBM is full of blocks that cannot move now", with those idle blocks there and, once they were
    gone, in an empty tier: the empty slabs stayed where they were cut, one page apart (a review).
    Now the idle blocks go and the slabs are cut anew."""
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 16 * PAGE, PAGE, 256)], policy="lru", clock=clock)
    a = mgr.attach("a")
    s, big = mgr.register_layout(SMALL), mgr.register_layout(layout(12, "big96k"))
    held = [mgr.allocate(a, big, 1)]
    _idle_small_blocks(mgr, clock, a, s, 4)  # page 2
    held.append(mgr.allocate(a, big, 3))
    mgr.free(a, mgr.commit(a, mgr.allocate(a, s, 4), keys=[11, 12, 13, 14]))  # page 9
    held.append(mgr.allocate(a, big, 3))
    pages = sorted(int(mgr.place(int(v)).offset) // PAGE for h in held for v in h)
    assert pages == [0, 3, 5, 7, 10, 12, 14]
    for h in held:
        mgr.free(a, h)
    got = mgr.allocate(a, big, 8)
    assert got is not None, mgr.allocate_refusal
    assert mgr.placement.stats.evicted == 8
    mgr.check_invariants()
    mgr.free(a, got)
    assert mgr.allocate(a, big, 8) is not None  # (and again, from the slabs as now cut)
    mgr.check_invariants()


def test_an_empty_tier_holds_as_many_slots_of_several_pages_as_it_did_empty():
    """The slot allocator alone: pages 2 and 9 of 16 held by 16 KiB slots while seven 2-page slabs are
    cut around them; all freed, the tier holds eight 96 KiB slots again (it held seven: a review)."""
    from dflash2.alloc import SlotAllocator

    alloc = SlotAllocator(16 * PAGE, PAGE, 256)
    big, small = 96 << 10, 16 << 10
    one = alloc.alloc(big, 1)
    s1 = alloc.alloc(small, 4)
    three = alloc.alloc(big, 3)
    s2 = alloc.alloc(small, 4)  # page 9 (page 2 is full: four 16 KiB slots a page)
    three_more = alloc.alloc(big, 3)
    assert sorted((np.concatenate([one, three, three_more]) // PAGE).tolist()) == [0, 3, 5, 7, 10, 12, 14]
    for size, offs in ((big, one), (big, three), (big, three_more), (small, s1), (small, s2)):
        alloc.free(size, offs)
    assert alloc.blocks_free(big) == 8
    got = alloc.alloc(big, 8)
    assert got is not None and len(np.unique(got)) == 8
