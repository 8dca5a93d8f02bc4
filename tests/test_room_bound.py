"""Calls that cannot succeed now move and drop nothing (dflash2/roombound.py): the bound on the room a
tier could make, with the call's own picks, checked before any room is made, and what it costs."""

import numpy as np
import pytest

from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier

from conftest import KIB, SMALL, SMALL_FP8, FakeClock
from placement_helpers import fill, tier_of

FORTY_KIB = Layout("forty", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=40)
EIGHT_KIB = Layout("half", num_layers=1, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)


@pytest.mark.parametrize("dram_blocks", [0, 8])
def test_an_allocate_that_fails_anyway_moves_and_drops_nothing(make_manager, dram_blocks):
    """HBM of 4 with 2 blocks being written and 1 cached idle: an allocate of 3 cannot succeed until
    the writes end. It made room first: the idle block was dropped (HBM alone) or demoted, for
    nothing (a review: a replayed request longer than what its pinned prefix left flushed HBM,
    Belady's "optimum" included)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=dram_blocks)
    c = mgr.attach("t")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(c, lid, 2)  # being written
    idle = fill(mgr, c, lid, [13])
    assert mgr.allocate(c, lid, 3) is None
    assert "HBM is full of blocks that cannot move now" in mgr.allocate_refusal
    assert tier_of(mgr, idle[0]) == Tier.HBM and len(mgr.lookup_rows((13,), lid)) == 1
    assert mgr.stats()["placement"]["demoted"] == 0
    assert len(mgr.allocate(c, lid, 1)) == 1  # one that fits is still served, from the free slot
    assert len(mgr.allocate(c, lid, 1)) == 1  # ... and then by moving the idle block out
    mgr.check_invariants()


def _halves(mgr, w, small: int) -> None:
    """In an HBM of pages of 16 KiB, two pages each left holding an 8 KiB block being written and a
    free 8 KiB slot: 16 KiB of free slots that hold no 16 KiB block until a write ends."""
    writing = mgr.allocate(w, small, 4)
    by_page = {}
    for v in writing.tolist():
        by_page.setdefault(mgr.place(v).offset // (16 << 10), []).append(v)
    assert len(by_page) == 2
    mgr.free(w, [vs[0] for vs in by_page.values()])


@pytest.mark.parametrize("dram_blocks", [0, 3])
def test_an_allocate_that_fails_anyway_beside_other_sizes_moves_nothing(make_manager, dram_blocks):
    """HBM of 3 pages: one holds another client's idle cached 16 KiB block, two the halves. Two 16
    KiB blocks cannot come in; the bound counted the halves' free slots as room (by bytes), so the
    idle block was dropped (HBM alone) or demoted, then the allocate refused (a review's model-based
    test)."""
    mgr = make_manager(hbm_blocks=3, dram_blocks=dram_blocks)
    w, r = mgr.attach("w"), mgr.attach("r")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    cached = fill(mgr, r, big, [77])
    _halves(mgr, w, small)
    assert mgr.allocate(w, big, 2) is None and "cannot move now" in mgr.allocate_refusal
    placement = mgr.stats()["placement"]
    assert (placement["demoted"], placement["evicted"]) == (0, 0), placement
    assert tier_of(mgr, cached[0]) == Tier.HBM and len(mgr.lookup_rows((77,), big)) == 1
    assert len(mgr.allocate(w, big, 1)) == 1  # one that fits is served, by moving the idle block out
    mgr.check_invariants()


def test_an_acquire_that_fails_anyway_beside_other_sizes_moves_nothing(make_manager):
    """The read's case: a 2-block chain of 16 KiB blocks in DRAM cannot come up beside the halves."""
    mgr = make_manager(hbm_blocks=3, dram_blocks=8)
    w, r = mgr.attach("w"), mgr.attach("r")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    chain = fill(mgr, r, big, [1, 2])
    fill(mgr, r, big, [5, 6, 7])  # pushes the chain down to DRAM
    _halves(mgr, w, small)
    idle = fill(mgr, r, big, [9])
    assert [tier_of(mgr, v) for v in chain] == [Tier.DRAM, Tier.DRAM] and tier_of(mgr, idle[0]) == Tier.HBM
    cols = mgr.table.cols
    before = {k: getattr(cols, k).copy() for k in ("tier", "offset", "state", "refs", "pins")}
    assert mgr.acquire(r, chain) is None
    assert [k for k, v in before.items() if not np.array_equal(v, getattr(cols, k))] == []
    mgr.check_invariants()


def test_an_acquire_that_fails_anyway_moves_nothing(make_manager):
    """HBM of 4 with 3 blocks being written and 1 idle cached block: an acquire of a 2-block chain
    lying in DRAM cannot fit until the writes end. It demoted the idle block first, promoted
    nothing, and answered "no room now" (a review: the allocate's case, for reads)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8)
    w, r = mgr.attach("w"), mgr.attach("r")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, w, lid, [1, 2])
    other = fill(mgr, w, lid, [21, 22, 23, 24])  # pushes [1, 2] down to DRAM
    mgr.allocate(w, lid, 3)  # being written: 3 of HBM's 4 slots; [21] stays, idle
    assert [tier_of(mgr, v) for v in chain] == [Tier.DRAM, Tier.DRAM] and tier_of(mgr, other[0]) == Tier.HBM
    cols = mgr.table.cols
    before = {k: getattr(cols, k).copy() for k in ("tier", "offset", "state", "refs", "pins")}
    demoted = mgr.stats()["placement"]["demoted"]
    assert mgr.acquire(r, chain) is None
    assert [k for k, v in before.items() if not np.array_equal(v, getattr(cols, k))] == []
    assert mgr.stats()["placement"]["demoted"] == demoted
    got = mgr.acquire(r, chain[:1])  # one that fits beside the writes is still served
    assert got is not None and tier_of(mgr, chain[0]) == Tier.HBM
    mgr.check_invariants()


def test_a_retried_refused_allocate_makes_no_pass_over_the_table(make_manager, monkeypatch):
    """HBM full of blocks being written: nothing can move, and `_nothing_movable` remembers it. The
    check that an allocate could succeed at all ran `movable` over every row on each retry (a
    review: a refused allocate went from 0.13 to 3.7 ms at a million rows)."""
    from dflash2.placement import Placement
    mgr = make_manager(hbm_blocks=64)
    c = mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    assert len(mgr.allocate(c, lid, 64)) == 64
    assert mgr.allocate(c, lid, 1) is None  # the first refusal may pass over the table (and remember)
    passes = []
    real = Placement.movable
    monkeypatch.setattr(Placement, "movable", lambda self, *a, **k: passes.append(1) or real(self, *a, **k))
    for _ in range(10):
        assert mgr.allocate(c, lid, 1) is None
    assert passes == [], f"{len(passes)} passes over the table for 10 retries of a refused allocate"


def test_an_acquire_with_a_priority_may_push_out_idle_blocks_written_at_a_higher_one(make_manager):
    """HBM full of cached, idle blocks a priority-5 request wrote: a read at priority 0 makes its
    room from them (a promotion's first pass takes idle blocks of any priority). The check that it
    could fit at all applied the priority to every block, and refused it, at every retry (a review)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8)
    w, r = mgr.attach("w"), mgr.attach("r")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, w, lid, [1, 2])
    hot = mgr.commit(w, mgr.allocate(w, lid, 4, priority=5), keys=[21, 22, 23, 24])
    mgr.free(w, hot)  # idle; they pushed [1, 2] down to DRAM
    assert [tier_of(mgr, v) for v in chain] == [Tier.DRAM, Tier.DRAM]
    assert mgr.acquire(r, chain, priority=0) is not None
    assert [tier_of(mgr, v) for v in chain] == [Tier.HBM, Tier.HBM]
    mgr.check_invariants()


def test_the_bound_on_room_counts_no_parent_held_by_a_child_that_stays(make_manager):
    """HBM of 4: X -> Y (Y pinned by a reader, so X, idle, cannot leave before it) and two idle blocks;
    a read of a 3-block chain in DRAM cannot fit. The bound counted X as room: the acquire demoted
    both idle blocks, promoted two of the chain, and answered None (a review)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8)
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    target = fill(mgr, a, lid, [1, 2, 3])
    xy = fill(mgr, a, lid, [20, 21])
    idle = np.concatenate([fill(mgr, a, lid, [30]), fill(mgr, a, lid, [31])])
    assert [tier_of(mgr, v) for v in target] == [Tier.DRAM] * 3
    assert mgr.acquire(c, xy[1:]) is not None
    assert not mgr.placement.could_hold(Tier.HBM, 3 * mgr.table.slot_bytes(lid, Tier.HBM), idle_only=True)
    assert mgr.acquire(b, target) is None
    assert [tier_of(mgr, v) for v in (*target, *idle)] == [Tier.DRAM] * 3 + [Tier.HBM] * 2
    assert len(mgr.acquire(b, target[:2])) == 2  # what fits beside X and Y is still read
    mgr.check_invariants()


def test_the_walk_above_blocks_that_stay_takes_few_whole_array_rounds_and_is_exact(make_manager, monkeypatch):
    """An idle chain 4,096 deep under a leaf another client holds: the bound walked up a level a
    round of whole-array steps to the root (a chain 32,768 deep took 270-300 ms a call at a million
    rows, a review). It takes WALK_LEVELS such rounds, then walks the few deeper chains a block a
    step: every block of the chain stays (capped at 64 levels, the rest counted as room, and a read
    made room for nothing again: another review)."""
    from dflash2 import roombound
    depth = 4096
    mgr = make_manager(hbm_blocks=depth + 1, dram_blocks=64)
    a, w = mgr.attach("a"), mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    slot = mgr.table.slot_bytes(lid, Tier.HBM)
    chain = mgr.commit(a, mgr.allocate(a, lid, depth), keys=list(range(1, depth + 1)))
    mgr.free(a, chain)
    mgr.commit(w, mgr.allocate(w, lid, 1), keys=[depth + 1], parent=int(chain[-1]))  # held by w
    rounds = []
    real = roombound.unique
    monkeypatch.setattr(roombound, "unique", lambda v: rounds.append(1) or real(v))
    assert mgr.placement.room_most(Tier.HBM, slot, idle_only=True) == 0
    assert len(rounds) == roombound.WALK_LEVELS
    monkeypatch.setattr(roombound, "WALK_LEVELS", 1)
    assert mgr.placement.room_most(Tier.HBM, slot, idle_only=True) == 0


def test_leave_whole_past_its_level_walk_holds_every_block_above_a_held_leaf(make_manager, monkeypatch):
    """Idle chains 300 deep under leaves a reader holds, and an idle chain beside them: every block of
    the held chains stays (the blocks above a held one wait for it), the idle chain may leave. Walked
    a level at a time to the root, 4 chains 65,536 deep took 0.5 s a call, twice a step while a
    reservation waited (a review): past 64 levels the rest is found by pointer jumping."""
    from dflash2 import placement as placement_module
    depth = 300
    mgr = make_manager(hbm_blocks=3 * depth + 8, dram_blocks=16)
    a, r = mgr.attach("a"), mgr.attach("r")
    lid = mgr.register_layout(SMALL)
    held = [fill(mgr, a, lid, list(range(k * 1000, k * 1000 + depth))) for k in (1, 2, 3)]
    idle = fill(mgr, a, lid, [50, 51, 52])
    assert mgr.acquire(r, [int(ch[-1]) for ch in held]) is not None
    jumps = []
    real = placement_module.marked_or_above
    monkeypatch.setattr(placement_module, "marked_or_above", lambda *args: jumps.append(1) or real(*args))
    p, table = mgr.placement, mgr.table
    for evict in (True, False):
        out = p.leave_whole(Tier.HBM, p.movable(Tier.HBM, evict=evict), evict)
        assert not out[table.rows(np.concatenate(held))].any()
        assert out[table.rows(idle)].all()
    assert len(jumps) == 2


def test_the_walk_above_blocks_that_stay_goes_on_in_whole_array_rounds_while_levels_are_wide(make_manager,
                                                                                             monkeypatch):
    """WALK_WIDE idle chains deeper than WALK_LEVELS under leaves another client holds: past
    WALK_LEVELS the walk goes on in whole-array rounds while a level has WALK_WIDE blocks (a block a
    step, 1,024 chains 1,024 deep took 270 ms a call, asked at every status poll of a reservation
    waiting beside another slot size's, a review), and every block of them stays."""
    from dflash2 import roombound
    depth, chains = roombound.WALK_LEVELS + 8, roombound.WALK_WIDE
    mgr = make_manager(hbm_blocks=depth * chains, dram_blocks=16)
    a, w = mgr.attach("a"), mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    slot = mgr.table.slot_bytes(lid, Tier.HBM)
    for k in range(chains):
        chain = fill(mgr, a, lid, list(range(k * 1000 + 1, k * 1000 + depth)))
        mgr.commit(w, mgr.allocate(w, lid, 1), keys=[k * 1000 + depth], parent=int(chain[-1]))  # held by w
    rounds = []
    real = roombound.unique
    monkeypatch.setattr(roombound, "unique", lambda v: rounds.append(1) or real(v))
    assert mgr.placement.room_most(Tier.HBM, slot, idle_only=True) == 0
    assert len(rounds) == depth  # (to the roots, and a round that finds none above them)


def test_a_read_beside_a_chain_deeper_than_the_whole_array_rounds_moves_nothing(make_manager):
    """HBM of 68: two idle blocks and an idle chain 66 deep whose leaf a reader holds; a 3-block chain
    in DRAM cannot come up (2 slots at most). With the walk capped at 64 levels the chain's top
    counted as room: the read demoted both idle blocks, promoted two, and answered None (a review)."""
    from dflash2 import roombound
    depth = roombound.WALK_LEVELS + 2  # the leaf and 65 blocks above it: one past the whole-array rounds
    mgr = make_manager(hbm_blocks=depth + 2, dram_blocks=16)
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    target = mgr.commit(a, mgr.allocate(a, lid, 3, tier=Tier.DRAM), keys=[1, 2, 3])
    mgr.free(a, target)
    idle = np.concatenate([fill(mgr, a, lid, [10]), fill(mgr, a, lid, [11])])
    chain = fill(mgr, a, lid, list(range(100, 100 + depth)))
    assert mgr.acquire(c, chain[-1:]) is not None
    assert mgr.acquire(b, target) is None
    assert "nothing was moved" in mgr.acquire_refusal
    assert [tier_of(mgr, v) for v in (*target, *idle)] == [Tier.DRAM] * 3 + [Tier.HBM] * 2
    mgr.check_invariants()


def _beside_an_empty_slab_of_another_size():
    """HBM of two 64 KiB pages: page 1 holds four 16 KiB blocks being written, page 0 an empty slab of
    40 KiB slots (24 KiB of it a tail), and a cached chain of four 16 KiB blocks lies in DRAM. Free by
    bytes: 40 KiB; for 16 KiB blocks: 64 KiB (the allocator gives the empty slab's whole page back)."""
    page = 64 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * page, page, 256), TierSpec(Tier.DRAM, 32 * page, page, 4096)],
                       clock=FakeClock())
    w, r = mgr.attach("w"), mgr.attach("r")
    small, big = mgr.register_layout(SMALL), mgr.register_layout(FORTY_KIB)
    chain = fill(mgr, r, small, [1, 2, 3, 4])
    assert mgr.allocate(w, small, 4) is not None
    b = mgr.allocate(w, big, 1)  # demotes the chain; page 0 becomes a 40 KiB slab
    assert b is not None and [tier_of(mgr, v) for v in chain] == [Tier.DRAM] * 4
    mgr.free(w, b)
    alloc = mgr.table.allocators[Tier.HBM]
    assert alloc.free_bytes == 40 * KIB and alloc.room_for(16 * KIB) == 64 * KIB
    return mgr, r, chain


def test_a_read_that_fits_beside_another_sizes_empty_slab_is_served():
    """The bound's shortcuts answered the free bytes, short of the room for the call's size: the read
    was refused "no room now" and a prefetch window cut in half, though both fit with nothing moved
    (a review)."""
    mgr, r, chain = _beside_an_empty_slab_of_another_size()
    try:
        assert mgr.placement.room_most(Tier.HBM, 64 * KIB, idle_only=True, slot=16 * KIB) >= 64 * KIB
        assert mgr.placement.fitting_prefix(mgr.table.rows(chain), Tier.HBM) == 4
        got = mgr.acquire(r, chain)
        assert got is not None and [p.tier for p in got] == [Tier.HBM] * 4
        mgr.check_invariants()
    finally:
        mgr.close()


@pytest.mark.parametrize("dram_pages", [0, 16])
def test_page_tails_are_not_room_in_a_tier_of_one_size(dram_pages):
    """16 pages of 64 KiB, each one 40 KiB slot and a 24 KiB tail: 15 blocks being written and one
    idle cached block. Two more can never fit; counted by bytes, the tails were room (424 KiB said
    for 40 KiB), and the idle block was dropped (HBM alone) or demoted first (a review)."""
    page = 64 * KIB
    specs = [TierSpec(Tier.HBM, 16 * page, page, 256)]
    if dram_pages:
        specs.append(TierSpec(Tier.DRAM, dram_pages * page, page, 4096))
    mgr = BlockManager(specs, clock=FakeClock())
    try:
        w, r = mgr.attach("w"), mgr.attach("r")
        lid = mgr.register_layout(FORTY_KIB)
        slot = mgr.table.slot_bytes(lid, Tier.HBM)
        cached = fill(mgr, r, lid, [7])
        assert mgr.allocate(w, lid, 15) is not None
        assert mgr.placement.room_most(Tier.HBM, 2 * slot, idle_only=True, slot=slot) == slot
        assert mgr.allocate(w, lid, 2) is None
        assert len(mgr.lookup_rows((7,), lid)) == 1 and tier_of(mgr, cached[0]) == Tier.HBM
        assert len(mgr.allocate(w, lid, 1)) == 1  # one that fits is served, by moving the idle block out
        mgr.check_invariants()
    finally:
        mgr.close()


def test_free_pages_are_room_by_their_slots_for_an_allocate_or_a_read():
    """16 pages of 64 KiB, one 40 KiB slot each: 10 blocks being written, 1 idle cached block, 5
    pages free; 7 can never fit (6 slots at most), but the free bytes (320 KiB >= 280 KiB) answered
    before the count by slots, and the allocate dropped the idle block, the read demoted it (a review
    of 5cc0d75)."""
    page = 64 * KIB
    for dram in (False, True):
        specs = [TierSpec(Tier.HBM, 16 * page, page, 256)] + ([TierSpec(Tier.DRAM, 32 * page, page, 4096)] if dram else [])
        mgr = BlockManager(specs, clock=FakeClock())
        try:
            w, r = mgr.attach("w"), mgr.attach("r")
            lid = mgr.register_layout(FORTY_KIB)
            slot = mgr.table.slot_bytes(lid, Tier.HBM)
            if dram:
                chain = mgr.commit(r, mgr.allocate(r, lid, 7, tier=Tier.DRAM), keys=list(range(1, 8)))
                mgr.free(r, chain)
            assert mgr.allocate(w, lid, 10) is not None
            idle = fill(mgr, r, lid, [200])
            assert mgr.table.allocators[Tier.HBM].free_bytes == 5 * page
            assert mgr.placement.room_most(Tier.HBM, 7 * slot, idle_only=True, slot=slot) == 6 * slot
            cols = mgr.table.cols
            before = {k: getattr(cols, k).copy() for k in ("tier", "offset", "state")}
            assert (mgr.acquire(r, chain) if dram else mgr.allocate(w, lid, 7)) is None
            assert [k for k, v in before.items() if not np.array_equal(v, getattr(cols, k))] == []
            assert len(mgr.lookup_rows((200,), lid)) == 1 and tier_of(mgr, idle[0]) == Tier.HBM
            mgr.check_invariants()
        finally:
            mgr.close()


@pytest.mark.parametrize("dram_pages", [0, 16])
def test_scattered_free_pages_are_no_slab_of_several_pages(dram_pages):
    """4 pages of 32 KiB, a 40 KiB slot a slab of 2: pages 1-2 hold a cached 40 KiB block that a
    reader pins, pages 0 and 3 are free but apart. Two such blocks cannot fit; counted from the
    pages' number, the bound let the allocate through (a review). Where that block is idle, its
    slab, once emptied, is pages again: two fit (its slab stayed where it was cut, and the bound
    said one, a later review)."""
    page = 32 * KIB
    for pinned in (True, False):
        specs = [TierSpec(Tier.HBM, 4 * page, page, 256)] + ([TierSpec(Tier.DRAM, dram_pages * page, page, 4096)]
                                                             if dram_pages else [])
        mgr = BlockManager(specs, clock=FakeClock())
        try:
            w, r = mgr.attach("w"), mgr.attach("r")
            small, big = mgr.register_layout(SMALL), mgr.register_layout(FORTY_KIB)
            v = mgr.allocate(w, small, 1)  # page 0: a slab of 16 KiB slots, emptied below
            cached = fill(mgr, r, big, [7])  # pages 1-2
            mgr.free(w, v)
            if pinned:
                mgr.acquire(r, cached)
            slot = mgr.table.slot_bytes(big, Tier.HBM)
            assert mgr.table.allocators[Tier.HBM].slab_shape_of(slot) == (2, 1)
            most = mgr.placement.room_most(Tier.HBM, 2 * slot, idle_only=True, slot=slot)
            assert most == (0 if pinned else 2 * slot)
            if pinned:
                assert mgr.allocate(w, big, 2) is None
                assert len(mgr.lookup_rows((7,), big)) == 1 and tier_of(mgr, cached[0]) == Tier.HBM
            else:
                assert mgr.allocate(w, big, 2) is not None, mgr.allocate_refusal
                assert len(mgr.lookup_rows((7,), big)) == (1 if dram_pages else 0)
            mgr.check_invariants()
        finally:
            mgr.close()


def test_scattered_free_pages_beside_other_sizes_are_no_slab_of_several_pages():
    """Pages 0 and 4 free, 3 and 5 holding 16 KiB blocks being written, 1-2 an idle 40 KiB block:
    room for one 40 KiB block at most (room_without counted the pages' number: two)."""
    page = 32 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 6 * page, page, 256)], clock=FakeClock())
    try:
        w, r = mgr.attach("w"), mgr.attach("r")
        small, big = mgr.register_layout(SMALL), mgr.register_layout(FORTY_KIB)
        a = mgr.allocate(w, small, 2)  # page 0
        cached = fill(mgr, r, big, [7])  # pages 1-2
        mgr.allocate(w, small, 2)  # page 3, being written
        d = mgr.allocate(w, small, 2)  # page 4
        mgr.allocate(w, small, 2)  # page 5, being written
        mgr.free(w, a)
        mgr.free(w, d)
        assert mgr.table.allocators[Tier.HBM].page_slabs()[2].tolist() == [0, 1, 1, 2, 0, 2]
        slot = mgr.table.slot_bytes(big, Tier.HBM)
        assert mgr.placement.room_most(Tier.HBM, 2 * slot, idle_only=True, slot=slot) == slot
        assert mgr.allocate(w, big, 2) is None and tier_of(mgr, cached[0]) == Tier.HBM
        mgr.check_invariants()
    finally:
        mgr.close()


@pytest.mark.parametrize("order", ["qb", "bq"])
@pytest.mark.parametrize("hbm_blocks", [3, 4])
def test_a_read_of_blocks_that_fit_is_served_beside_a_prefix_that_does_not(make_manager, order, hbm_blocks):
    """`b` in HBM, its parent `a` in DRAM (the chain extended in HBM under a parent demoted); a read of
    q and b, q's chain [p, q] in DRAM. p and q fit in HBM beside b (HBM of 4 with a block being
    written, or of 3), and the read needs no more. Counted with it, `a` got the read refused: with
    "nothing was moved" (the room bound), NeverFits (HBM of 3), or, named [b, q], brought up first
    into the room p or q needed (a review's model-based test, then a review of its fix)."""
    mgr = make_manager(hbm_blocks=hbm_blocks, dram_blocks=8)
    c = mgr.attach("t")
    lid = mgr.register_layout(SMALL)
    a = mgr.commit(c, mgr.allocate(c, lid, 1, tier=Tier.DRAM), keys=[1])
    mgr.free(c, a)
    b = mgr.commit(c, mgr.allocate(c, lid, 1), keys=[2], parent=int(a[0]))
    mgr.free(c, b)
    pq = mgr.commit(c, mgr.allocate(c, lid, 2, tier=Tier.DRAM), keys=[10, 11])
    mgr.free(c, pq)
    if hbm_blocks == 4:
        mgr.allocate(c, lid, 1)  # being written: stays
    assert (tier_of(mgr, a[0]), tier_of(mgr, b[0]), tier_of(mgr, pq[1])) == (Tier.DRAM, Tier.HBM, Tier.DRAM)
    read = [int(pq[1]), int(b[0])] if order == "qb" else [int(b[0]), int(pq[1])]
    got = mgr.acquire(c, read)
    assert got is not None, mgr.acquire_refusal
    assert [int(p.tier) for p in got] == [int(Tier.HBM)] * 2 and tier_of(mgr, a[0]) == Tier.DRAM
    mgr.check_invariants()


def _state(mgr) -> dict:
    c = mgr.table.cols
    rows = np.flatnonzero(c.state != 0)
    return {v: (int(c.tier[r]), int(c.offset[r])) for v, r in zip(mgr.table.vids(rows).tolist(), rows.tolist())}


@pytest.mark.parametrize("idle_in_hbm", [False, True])
def test_a_read_of_two_sizes_whose_large_block_never_fits_moves_nothing(idle_in_hbm):
    """HBM of two 64 KiB pages, each holding a block being written: no page can take a 40 KiB block
    (a page each). A read of a small and a 40 KiB block from DRAM: free bytes (and the bound's bytes)
    said there was room, so the read demoted HBM's idle blocks, brought the small one up, then was
    refused "the room made fell short; retry later", a retry that never succeeds (a review's
    model-based test). Each size is bounded by its own slots now: refused with nothing moved."""
    page = 64 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * page, page, 256), TierSpec(Tier.DRAM, 8 * page, page, 4096)],
                       clock=FakeClock())
    small, big = mgr.register_layout(SMALL), mgr.register_layout(FORTY_KIB)
    w, r = mgr.attach("writer"), mgr.attach("reader")
    v = mgr.allocate(w, small, 8 if idle_in_hbm else 6).tolist()  # v[0] (page 0) and v[4] (page 1) stay written
    idle = mgr.commit(w, v[1:4] + v[5:], keys=list(range(10, 10 + len(v) - 2))).tolist()
    mgr.free(w, idle)
    s = mgr.commit(w, mgr.allocate(w, small, 1, tier=Tier.DRAM).tolist(), keys=[2]).tolist()
    b = mgr.commit(w, mgr.allocate(w, big, 1, tier=Tier.DRAM).tolist(), keys=[3]).tolist()
    mgr.free(w, s + b)
    before = _state(mgr)
    assert mgr.acquire(r, s + b, up_to=Tier.HBM) is None
    assert "nothing was moved" in mgr.acquire_refusal and _state(mgr) == before
    mgr.check_invariants()


@pytest.mark.parametrize("idle_on_page_0", [False, True])
def test_a_read_whose_blocks_fit_is_served_beside_an_unneeded_prefix_of_another_size(idle_on_page_0):
    """HBM of three 64 KiB pages: page 0 free (or holding an idle 40 KiB block), page 1 `b` (40 KiB)
    whose parent `a` lies in DRAM, page 2 an 8 KiB block being written. A read of [b, q], q a 16 KiB
    block in DRAM: q fits in page 0, and `a` is not needed. Moved in one batch with q, `a` (which did
    not fit beside it) failed the batch: refused "the room made fell short", every retry alike (a
    review). The read's blocks move first; the rest only where room is left."""
    page = 64 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 3 * page, page, 256), TierSpec(Tier.DRAM, 16 * page, page, 4096)],
                       clock=FakeClock())
    small, big, half = mgr.register_layout(SMALL), mgr.register_layout(FORTY_KIB), mgr.register_layout(EIGHT_KIB)
    w, r = mgr.attach("writer"), mgr.attach("reader")
    a = mgr.commit(w, mgr.allocate(w, big, 1, tier=Tier.DRAM), keys=[1]).tolist()
    if idle_on_page_0:
        mgr.free(w, mgr.commit(w, mgr.allocate(w, big, 1), keys=[5]).tolist())
    b = mgr.commit(w, mgr.allocate(w, big, 1), keys=[2], parent=a[0]).tolist()
    mgr.allocate(w, half, 1)  # being written: stays on page 2
    q = mgr.commit(w, mgr.allocate(w, small, 1, tier=Tier.DRAM), keys=[3]).tolist()
    mgr.free(w, a + b + q)
    got = mgr.acquire(r, b + q, up_to=Tier.HBM)
    assert got is not None, mgr.acquire_refusal
    assert [p.tier for p in got] == [Tier.HBM, Tier.HBM] and tier_of(mgr, a[0]) == Tier.DRAM
    mgr.check_invariants()


def test_a_read_of_two_sizes_that_fit_each_alone_but_not_together_moves_nothing():
    """HBM of two 64 KiB pages: an idle 40 KiB block and one being written. A read of a 40 KiB and a
    16 KiB block: one page can be freed, room for either, not both. Each size checked alone against
    the same room passed, and the read demoted the idle block, then was refused "the room made fell
    short" (a review's model-based test). The sizes share the pages that could be freed now."""
    page = 64 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * page, page, 256), TierSpec(Tier.DRAM, 8 * page, page, 4096)],
                       clock=FakeClock(), policy="lru")
    small, big = mgr.register_layout(SMALL), mgr.register_layout(FORTY_KIB)
    w = mgr.attach("w")
    b = mgr.commit(w, mgr.allocate(w, big, 1, tier=Tier.DRAM), keys=[1001]).tolist()
    s = mgr.commit(w, mgr.allocate(w, small, 1, tier=Tier.DRAM), keys=[1]).tolist()
    mgr.free(w, b + s)
    mgr.free(w, mgr.commit(w, mgr.allocate(w, big, 1), keys=[1005]).tolist())
    assert mgr.allocate(w, big, 1) is not None  # being written: its page stays
    before = _state(mgr)
    assert mgr.acquire(w, b + s, up_to=Tier.HBM) is None
    assert "nothing was moved" in mgr.acquire_refusal and _state(mgr) == before
    mgr.check_invariants()


@pytest.mark.parametrize("free_page", ["free", "an empty 8 KiB slab"])
def test_a_read_of_two_sizes_that_fits_once_an_idle_block_goes_is_served(free_page):
    """HBM of two 64 KiB pages, one free, one holding an idle 40 KiB block; a read of a 40 KiB and an
    8 KiB block from DRAM needs both pages. Each size's room counted the one free page, none was
    made, the move failed: refused "the room made fell short", every retry alike (a review). The
    room maker also asks for the pages the sizes need together. With the free page an empty 8 KiB
    slab (its block written, then freed unpublished), those pages counted it as free 8 KiB slots and
    `room_for` as a free page: the ask fell short the same way (another)."""
    page = 64 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * page, page, 256), TierSpec(Tier.DRAM, 8 * page, page, 4096)],
                       clock=FakeClock(), policy="lru")
    big, half = mgr.register_layout(FORTY_KIB), mgr.register_layout(EIGHT_KIB)
    w = mgr.attach("w")
    idle = mgr.commit(w, mgr.allocate(w, big, 1), keys=[100]).tolist()
    mgr.free(w, idle)
    if free_page != "free":
        mgr.free(w, mgr.allocate(w, half, 1).tolist())  # unpublished: its slab left empty
    b = mgr.commit(w, mgr.allocate(w, big, 1, tier=Tier.DRAM), keys=[1]).tolist()
    h = mgr.commit(w, mgr.allocate(w, half, 1, tier=Tier.DRAM), keys=[2]).tolist()
    mgr.free(w, b + h)
    got = mgr.acquire(w, b + h, up_to=Tier.HBM)
    assert got is not None, mgr.acquire_refusal
    assert [p.tier for p in got] == [Tier.HBM, Tier.HBM] and tier_of(mgr, idle[0]) == Tier.DRAM
    mgr.check_invariants()


def test_a_read_of_two_sizes_that_fits_free_pages_moves_no_idle_block():
    """HBM of six 64 KiB pages: an idle 96 KiB block (two pages), an idle small block (one), three
    free. A read of a 96 KiB and a 40 KiB block takes three pages: it fits as things stand. The room
    for the 40 KiB size asked for both sizes' bytes (3.4 slots of 40 KiB, where three pages hold
    both) and demoted an idle block first (a review). Each size asks for its own slots, then the
    pages they need together."""
    ninety_six = Layout("ninety-six", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=96)
    page = 64 * KIB
    mgr = BlockManager([TierSpec(Tier.HBM, 6 * page, page, 256), TierSpec(Tier.DRAM, 64 * page, page, 4096)],
                       clock=FakeClock(), policy="lru")
    big, forty, small = (mgr.register_layout(lay) for lay in (ninety_six, FORTY_KIB, SMALL))
    w, r = mgr.attach("w"), mgr.attach("r")
    idle, want = [], []
    for key, lid, tier, out in ((100, big, Tier.HBM, idle), (101, small, Tier.HBM, idle),
                                (1, big, Tier.DRAM, want), (2, forty, Tier.DRAM, want)):
        v = mgr.commit(w, mgr.allocate(w, lid, 1, tier=tier), keys=[key]).tolist()
        mgr.free(w, v)
        out += v
    got = mgr.acquire(r, want, up_to=Tier.HBM)
    assert got is not None, mgr.acquire_refusal
    assert [p.tier for p in got] == [Tier.HBM, Tier.HBM]
    assert [tier_of(mgr, v) for v in idle] == [Tier.HBM, Tier.HBM]
    mgr.check_invariants()


def test_a_read_of_two_several_page_slab_sizes_on_scattered_free_pages_is_served():
    """HBM of 64 pages (a 96 KiB slot then takes a 3-page slab, a 40 KiB one a 2-page slab), free
    pages 0-2, 4 and 6, idle 64 KiB blocks on the rest. Each size saw the run 0-2 as its room and the
    pages together counted five free: no room was made, and the read, whose slabs need two runs, was
    refused every retry (a review of the change that had each size ask for its own slots only). A
    size of several-page slabs asks for the larger sizes' bytes too."""
    ninety_six = Layout("ninety-six", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=96)
    whole_page = Layout("page", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=64)
    page, n = 64 * KIB, 64
    mgr = BlockManager([TierSpec(Tier.HBM, n * page, page, 256), TierSpec(Tier.DRAM, 256 * page, page, 4096)],
                       clock=FakeClock(), policy="lru")
    pg, big, forty = (mgr.register_layout(lay) for lay in (whole_page, ninety_six, FORTY_KIB))
    w, r = mgr.attach("w"), mgr.attach("r")
    vids = mgr.allocate(w, pg, n).tolist()
    keep = [v for v in vids if mgr.place(v).offset // page not in (0, 1, 2, 4, 6)]
    mgr.free(w, [v for v in vids if v not in keep])
    mgr.free(w, mgr.commit(w, keep, keys=[100 + i for i in range(len(keep))]).tolist())
    want = []
    for key, lid in ((1, big), (2, forty)):
        v = mgr.commit(w, mgr.allocate(w, lid, 1, tier=Tier.DRAM), keys=[key]).tolist()
        mgr.free(w, v)
        want += v
    got = mgr.acquire(r, want, up_to=Tier.HBM)
    assert got is not None, mgr.acquire_refusal
    assert [p.tier for p in got] == [Tier.HBM, Tier.HBM]
    mgr.check_invariants()
