"""Audit of the metadata core: the slot allocator, the block table's state machine around moves,
heat weights and decay, the frequency sketch, and layout validation. Each test names the invariant
it holds the code to."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2.alloc import SlotAllocator, blocks_that_fit
from dflash2.errors import ArenaError, IllegalTransition, LayoutError, NotOwner, UnknownBlock
from dflash2.layout import Layout
from dflash2.policy.admission import FrequencySketch
from dflash2.policy.heat import HeatPolicy
from dflash2.table import BlockState
from dflash2.tiers import Tier

from conftest import SMALL

PAGE = 64 * 1024


# -- slot allocator ------------------------------------------------------------------------------
@pytest.mark.parametrize("pages", [127, 128, 200])
def test_a_slab_of_128_pages_or_more_is_found(pages):
    """A free arena holds a block that spans many pages: the search for a run of free pages must not
    wrap its count (it summed in int8, so no run of 128 pages or more was ever found)."""
    a = SlotAllocator(1024 * PAGE, PAGE, 256)
    block = pages * PAGE
    assert a.blocks_free(block) >= 1
    got = a.alloc(block, 1)
    assert got is not None and a.used_bytes == block
    assert blocks_that_fit(1024 * PAGE, PAGE, 256, block) >= 1


def test_scattered_free_pages_are_not_counted_as_room_for_a_multi_page_slab():
    """blocks_free promises what alloc delivers: a slab of several pages needs them contiguous."""
    a = SlotAllocator(10 * PAGE, PAGE, 256)
    one_page = a.alloc(PAGE, 10)
    a.free(PAGE, one_page[::2])  # frees pages 0, 2, 4, 6, 8: empty one-page slabs, none adjacent
    big = PAGE + PAGE // 4  # 80 KiB: slabs of several pages
    assert a._slab_shape(a.slot_for(big))[0] > 1
    assert a.blocks_free(big) == 0
    assert not a.can_fit(big, 1)
    assert a.alloc(big, 1) is None


def test_alloc_uses_the_contiguous_room_that_blocks_free_counted():
    """Free pages and other sizes' empty slabs that together form one run: alloc must merge them
    before cutting slabs (cutting from the free pages first split the run and fell short)."""
    a = SlotAllocator(4 * PAGE, PAGE, 256)
    one_page = a.alloc(PAGE, 4)  # pages 0..3 in one-page slabs
    a.free(PAGE, one_page[:3])
    half = a.alloc(PAGE // 2, 1)  # takes pages 0..2 back into the pool, and page 0 for itself
    a.free(PAGE // 2, half)
    a.free(PAGE, one_page[3:])
    # Page 0: an empty slab of half pages; pages 1, 2: free; page 3: an empty slab of whole pages.
    two_pages = 2 * PAGE - 4096
    assert a._slab_shape(a.slot_for(two_pages)) == (2, 1)
    assert a.blocks_free(two_pages) == 2
    got = a.alloc(two_pages, 2)
    assert got is not None and sorted(got.tolist()) == [0, 2 * PAGE]


def test_free_refuses_a_double_free_and_changes_nothing():
    """A slot freed twice would be handed to two blocks: the second free raises and frees nothing."""
    a = SlotAllocator(4 * PAGE, PAGE, 256)
    got = a.alloc(16 * 1024, 3)
    a.free(16 * 1024, got[:1])
    before = a.stats()
    with pytest.raises(ArenaError, match=str(int(got[0]))):
        a.free(16 * 1024, got[:2])
    assert a.stats() == before
    with pytest.raises(ArenaError):
        a.free(16 * 1024, np.array([got[1], got[1]]))  # the same slot twice in one call
    assert a.stats() == before
    taken = a.alloc(16 * 1024, a.blocks_free(16 * 1024))
    assert len(np.unique(np.concatenate([taken, got[1:]]))) == len(taken) + 2, "a slot was handed out twice"


def test_free_refuses_offsets_that_are_not_its_slots():
    a = SlotAllocator(4 * PAGE, PAGE, 256)
    got = a.alloc(16 * 1024, 2)
    with pytest.raises(ArenaError):
        a.free(16 * 1024, got + 256)  # inside a slot, not its start
    with pytest.raises(ArenaError):
        a.free(16 * 1024, np.array([3 * PAGE]))  # a free page
    with pytest.raises(ArenaError):
        a.free(8 * 1024, got)  # another size (a slot of another layout)
    with pytest.raises(ArenaError):
        a.free(16 * 1024, np.array([100 * PAGE]))  # past the arena (another tier's offset)
    a.free(16 * 1024, got)
    assert a.used_bytes == 0


# -- block table: the state machine around moves -------------------------------------------------
@pytest.fixture
def mgr(make_manager):
    return make_manager(hbm_blocks=8, dram_blocks=8)


def test_a_block_in_flight_cannot_be_committed(mgr):
    """commit is WRITING → RESIDENT only: MIGRATING → RESIDENT is the end of a move, not a commit
    (the block was published and made RESIDENT under the mover)."""
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(c, mgr.allocate(c, lid, 1))
    rows = t.rows(v)
    dst = t.begin_move(rows, Tier.DRAM)
    with pytest.raises(IllegalTransition, match="MIGRATING"):
        t.commit(c, v, keys=[5])
    assert t.cols.state[rows][0] == BlockState.MIGRATING and len(t.keys) == 0
    t.end_move(rows, Tier.DRAM, dst, np.ones(1, dtype=bool))
    mgr.check_invariants()


def test_the_check_finds_a_slot_that_begins_inside_another(make_manager):
    """Blocks of two sizes in one tier: a block whose slot begins inside another's shares its bytes
    (a reader of one reads the other's writes) though no two offsets are equal; the check looked for
    equal offsets only, and passed such a table."""
    from conftest import SMALL_FP8
    from dflash2.invariants import InvariantViolation

    mgr = make_manager(hbm_blocks=16)
    t = mgr.table
    c = mgr.attach("a")
    big, little = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)  # 16 KiB, 8 KiB
    rb = t.rows(mgr.allocate(c, big, 1))
    rl = t.rows(mgr.allocate(c, little, 1))
    mgr.check_invariants()
    t.cols.offset[rl[0]] = t.cols.offset[rb[0]] + 8192  # (the allocator's counts unchanged)
    with pytest.raises(InvariantViolation, match="begins inside block"):
        mgr.check_invariants()


def test_end_move_requires_a_block_in_flight(mgr):
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.allocate(c, lid, 1)  # WRITING
    rows = t.rows(v)
    with pytest.raises(IllegalTransition, match="WRITING"):
        t.end_move(rows, Tier.DRAM, np.array([0]), np.ones(1, dtype=bool))
    assert t.cols.state[rows][0] == BlockState.WRITING and t.cols.tier[rows][0] == Tier.HBM


def test_a_block_freed_mid_move_takes_no_new_reference_or_pin(mgr):
    """A private block whose last reference went mid-move is freed when the move ends; a reference
    or pin taken meanwhile would outlive the row and later stand for the row's next block."""
    t = mgr.table
    c, other = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(c, mgr.allocate(c, lid, 1))
    rows = t.rows(v)
    dst = t.begin_move(rows, Tier.DRAM)
    t.free(c, v)
    with pytest.raises(UnknownBlock):
        t.add_ref(c, v)
    with pytest.raises(UnknownBlock):
        t.pin(c, v)
    t.end_move(rows, Tier.DRAM, dst, np.ones(1, dtype=bool))
    mgr.check_invariants()
    reused = mgr.allocate(other, lid, 1)
    assert int(t.rows(reused)[0]) == int(rows[0]), "the row is reused"
    assert int(rows[0]) not in t.clients[c].refs
    mgr.check_invariants()


def test_a_lost_block_takes_no_new_pin_that_its_last_reference_would_free(mgr):
    """A block whose bytes failed their checksum stays only for the references held before; a pin
    taken on it then did not keep it: the last reference's holder dying freed it under the pin."""
    t = mgr.table
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7])  # a holds a reference
    t.drop_lost(t.rows(v))
    with pytest.raises(UnknownBlock):
        t.pin(b, v)
    with pytest.raises(UnknownBlock):
        t.add_ref(b, v)
    mgr.detach(a)
    assert t.cols.live == 0 and t.cols.pins.sum() == 0
    mgr.check_invariants()


def test_a_move_of_a_block_listed_twice_is_refused(mgr):
    """One destination slot per block: a repeated row took two and later freed its source twice."""
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(c, mgr.allocate(c, lid, 1))
    rows = np.repeat(t.rows(v), 2)
    with pytest.raises(ValueError, match="twice"):
        t.begin_move(rows, Tier.DRAM)
    assert t.cols.state[rows[0]] == BlockState.RESIDENT
    mgr.check_invariants()


def test_a_negative_block_count_is_refused(mgr):
    """take_rows(-1) put a live row back on the free list: the next allocation handed it out again."""
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    first = t.allocate(c, lid, 2)
    with pytest.raises(ValueError):
        t.allocate(c, lid, -1)
    again = t.allocate(c, lid, 1)
    assert not set(t.rows(again).tolist()) & set(t.rows(first).tolist())
    assert t.cols.live == 3


def test_a_block_in_flight_cannot_be_pinned(mgr):
    """A pinned block never changes tier or state: pinning one between begin_move and end_move
    would let the move's end carry it to another tier under the pin."""
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    vids = t.allocate(c, lid, 2)
    t.commit(c, vids, keys=[11, 12])
    rows = t.rows(vids)
    t.begin_move(rows[1:], Tier.DRAM)
    with pytest.raises(IllegalTransition, match="moving between tiers"):
        t.pin(c, vids)
    assert t.cols.pins[rows].sum() == 0 and not t.client(c).pins


def test_a_lost_block_held_only_by_a_pin_goes_with_its_last_pin(mgr):
    """A published block pinned (acquired) but not referenced whose bytes are then found bad: it is
    kept while pinned, and the last unpin frees it; it stayed forever, keyless and unreachable."""
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    vids = t.allocate(c, lid, 2)
    t.commit(c, vids, keys=[41, 42])
    t.free(c, vids)  # published, nobody references them
    rows = t.rows(vids)
    t.pin(c, vids[1:])
    t.pin(c, vids[1:])
    t.drop_lost(rows[1:])
    assert t.cols.state[rows[1]] != BlockState.FREE, "kept while pinned"
    mgr.check_invariants()  # kept by its pins alone: not a leak (it was reported as one)
    t.unpin(c, vids[1:])
    assert t.cols.state[rows[1]] != BlockState.FREE
    t.unpin(c, vids[1:])
    assert t.cols.state[rows[1]] == BlockState.FREE and not t.lost
    assert t.cols.live == 1
    mgr.check_invariants()


def test_a_row_whose_generation_runs_out_is_retired(mgr):
    """A row's uint32 generation must never wrap: one more reuse would make it 0 again, and an id
    handed out 2**32 reuses ago would name the row's next block. The row is retired instead."""
    from dflash2.table.columns import GEN_LAST

    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    old = t.allocate(c, lid, 1)
    row = int(t.rows(old)[0])
    t.cols.gen[row] = GEN_LAST - 1
    last = t.vids(np.array([row]))
    t.free(c, last)
    assert t.cols.retired == 1 and t.cols.live == 0
    fresh = t.allocate(c, lid, 4)
    assert row not in t.rows(fresh).tolist()
    for stale in (old, last):
        with pytest.raises(UnknownBlock):
            t.rows(stale)
    assert t.cols.live == 4
    mgr.check_invariants()


# -- heat ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight", [float("inf"), 1e39, float("nan"), -1.0])
def test_heat_weights_stay_finite(weight):
    """A weight of inf (or one that float32 rounds to inf) made 0 · inf = NaN scores."""
    pol = HeatPolicy()
    with pytest.raises(ValueError, match=">= 0"):
        pol.set_weights({"recency": weight})
    assert pol.weights["recency"] == 1.0
    pol.set_weights({"recency": 1e6, "priority": 0.0})  # the config's bounds are accepted


def test_decay_after_a_long_pause_clears_counts_at_once(make_manager):
    """Half-lives that went by are counted, not looped one at a time: a half-life below the clock's
    resolution never advanced the loop (an endless tick)."""
    mgr = make_manager(hbm_blocks=4)
    pol = HeatPolicy(decay_half_life_s=1e-12)
    keys = np.array([42], dtype=np.uint64)
    pol.sketch.add(np.repeat(keys, 8))
    pol.on_tick(mgr.table, 1000.0)
    assert pol.sketch.estimate(keys)[0] == 8
    pol.on_tick(mgr.table, 2000.0)
    assert pol.sketch.estimate(keys)[0] == 0
    pol.on_tick(mgr.table, 1500.0)  # the clock went back: nothing halves
    pol.sketch.add(keys)
    pol.on_tick(mgr.table, 1999.0)
    assert pol.sketch.estimate(keys)[0] == 1


@pytest.mark.parametrize("n", [15, 256, 300])
def test_sketch_counters_saturate_instead_of_wrapping(n):
    """Counters are 4-bit: many references of one key in one batch saturate at 15, never wrap."""
    s = FrequencySketch(1 << 10)
    key = np.array([12345], dtype=np.uint64)
    s.add(np.repeat(key, n))
    assert s.estimate(key)[0] == 15
    assert s.table.max() == 15


# -- layouts ---------------------------------------------------------------------------------------
def test_negative_or_lone_mla_dims_are_refused():
    with pytest.raises(LayoutError, match="MLA dims"):
        Layout("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16,
               mla_latent_dim=-1)
    with pytest.raises(LayoutError, match="mla_rope_dim"):
        Layout("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16,
               mla_rope_dim=64)
    ok = Layout("m", num_layers=1, num_kv_heads=0, head_dim=0, dtype="fp4", tokens_per_block=2,
                mla_latent_dim=3, mla_rope_dim=0)
    assert ok.block_bytes == 3  # 6 four-bit elements
    with pytest.raises(LayoutError, match="whole number of bytes"):
        Layout("m", num_layers=1, num_kv_heads=0, head_dim=0, dtype="int4", tokens_per_block=1,
               mla_latent_dim=3)


def test_a_duplicate_commit_moves_every_reference_and_frees_the_copy(make_manager):
    """A client that took a second reference to the block it is writing, then commits it under a
    key already cached: both references move to the cached block and the copy is freed."""
    mgr = make_manager(hbm_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    cached = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7])
    mgr.free(a, cached)
    copy = mgr.allocate(a, lid, 1)
    mgr.add_ref(a, copy)
    used = mgr.table.allocators[Tier.HBM].used_bytes
    assert mgr.commit(a, copy, keys=[7]).tolist() == cached.tolist()
    assert mgr.table.allocators[Tier.HBM].used_bytes < used, "the copy's slot is given back"
    assert mgr.free(a, cached) == 0 and mgr.free(a, cached) == 0  # both references moved
    with pytest.raises(NotOwner):
        mgr.free(a, cached)
    mgr.check_invariants()


def test_a_table_without_rows_is_refused():
    from dflash2.table.columns import Columns
    with pytest.raises(ValueError, match="at least 1 row"):
        Columns(0)


def test_a_pinned_copy_committed_under_a_cached_key_stays_where_its_writer_views_it(make_manager, clock):
    """An engine pins the block it writes (to keep reading it after commit) and commits it under a
    key that is already cached, in NVMe: its copy must stay where it views it, and its release (by
    the id it pinned) must work and free the copy. Before, the pin moved to the cached twin in NVMe
    (a pinned block below the memory tiers) and the copy's slot was freed under the view."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=8)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    cached = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7])
    mgr.free(a, cached)
    for k in range(100, 112):  # push key 7 down to NVMe
        clock.advance(1)
        mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1), keys=[k]))
    assert mgr.place(int(cached[0])).tier == Tier.NVME
    copy = mgr.allocate(b, lid, 1)
    [viewed] = mgr.acquire(b, copy)
    assert mgr.commit(b, copy, keys=[7]).tolist() == cached.tolist()
    assert mgr.place(int(copy[0])) == viewed, "the pinned copy stays where its writer views it"
    assert mgr.table.cols.pins[mgr.table.rows(cached)[0]] == 0, "no pin lands on the twin in NVMe"
    mgr.check_invariants()
    for again in (mgr.acquire, mgr.add_ref):  # the copy is dead to new holders: the twin is the block
        with pytest.raises(UnknownBlock, match=f"already cached.*use the id commit returned for it, {int(cached[0]):#x}"):
            again(b, copy)
        # Another client too (its vid handed on): it was told NotOwner, "a private block of another
        # client", not the id to use (a review); and so for its place.
        with pytest.raises(UnknownBlock, match=f"already cached.*use the id commit returned for it, {int(cached[0]):#x}"):
            again(a, copy)
    with pytest.raises(UnknownBlock, match=f"use the id commit returned for it, {int(cached[0]):#x}"):
        mgr.table.seen_rows(a, copy)
    for who in (b, a):  # (its writer's free of the id it allocated was called a double free, a review)
        with pytest.raises(UnknownBlock, match=f"use the id commit returned for it, {int(cached[0]):#x}"):
            mgr.free(who, copy)
    used = mgr.table.allocators[Tier.HBM].used_bytes
    mgr.release(b, copy)
    assert mgr.table.allocators[Tier.HBM].used_bytes < used, "the last pin frees the copy"
    with pytest.raises(UnknownBlock):
        mgr.place(int(copy[0]))
    assert mgr.free(b, cached) == 0  # b's reference moved to the twin
    mgr.check_invariants()


def test_a_pinned_copy_is_freed_when_its_writer_detaches(make_manager):
    mgr = make_manager(hbm_blocks=8)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7]))
    copy = mgr.allocate(b, lid, 1)
    mgr.acquire(b, copy)
    mgr.commit(b, copy, keys=[7])
    used = mgr.table.allocators[Tier.HBM].used_bytes
    released = mgr.detach(b)
    assert mgr.table.allocators[Tier.HBM].used_bytes < used
    assert not mgr.table.pinned_copies
    assert released["freed"] == 1, released  # the copy freed at the detach is counted (it was 0)
    mgr.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_a_recomputed_block_keeps_its_fast_slot_and_the_slow_twin_is_freed(make_manager, clock, policy):
    """A block recomputed in HBM (its cached twin was too slow to read back, or not looked up) and
    committed under the twin's key: the twin takes the fresh copy's HBM slot (same bytes) and its NVMe
    slot is freed. Dropping the fresh copy would leave the block where it is withheld again."""
    from dflash2.policy import make_policy
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=8, policy=make_policy(policy))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    parent = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[6])
    cached = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7], parent=int(parent[0]))
    mgr.free(a, [*parent, *cached])
    for k in range(100, 112):
        clock.advance(1)
        mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1), keys=[k]))
    assert mgr.place(int(cached[0])).tier == Tier.NVME
    fresh = mgr.allocate(a, lid, 1)
    slot = mgr.place(int(fresh[0]))
    nvme_used = mgr.table.allocators[Tier.NVME].used_bytes
    assert mgr.commit(a, fresh, keys=[7], parent=int(parent[0])).tolist() == cached.tolist()
    twin = mgr.place(int(cached[0]))
    assert (twin.tier, twin.offset) == (Tier.HBM, slot.offset)
    assert mgr.table.allocators[Tier.NVME].used_bytes < nvme_used
    mgr.check_invariants()  # the parent's child counts per tier follow the twin
    mgr.free(a, cached)
    mgr.tick()
    mgr.check_invariants()


def test_a_twin_pinned_where_it_lies_keeps_its_place(make_manager, clock):
    mgr = make_manager(hbm_blocks=4, dram_blocks=8)
    a, reader = mgr.attach("a"), mgr.attach("reader")
    lid = mgr.register_layout(SMALL)
    cached = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7])
    mgr.free(a, cached)
    for k in range(100, 106):
        clock.advance(1)
        mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1), keys=[k]))
    [held] = mgr.acquire(reader, cached, up_to=Tier.DRAM)  # a host-side reader views it in DRAM
    assert held.tier == Tier.DRAM
    fresh = mgr.allocate(a, lid, 1)
    mgr.commit(a, fresh, keys=[7])
    assert mgr.place(int(cached[0])) == held
    with pytest.raises(UnknownBlock):
        mgr.place(int(fresh[0]))  # the fresh copy was freed instead
    mgr.check_invariants()


def test_one_key_for_two_layouts_in_one_commit_is_refused_before_anything_changes(make_manager):
    """The same content key given twice in one commit, to blocks of two layouts (16 KiB in DRAM, then
    8 KiB in HBM): refused as a clash, nothing changed. Before, the second deduplicated onto the first
    (another layout's block), and with the slot swap two slots of different sizes were exchanged:
    the allocators broke and a later block overlapped the published one (the review of 40f6549)."""
    from conftest import SMALL_FP8
    from dflash2.errors import ImmutableBlock
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=8)
    a = mgr.attach("a")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    x = mgr.allocate(a, big, 1, tier=Tier.DRAM)
    y = mgr.allocate(a, small, 1)
    with pytest.raises(ImmutableBlock, match="given in this commit, for another layout"):
        mgr.commit(a, [*x, *y], keys=[7, 7])
    assert mgr.table.cols.state[mgr.table.rows([*x, *y])].tolist() == [int(BlockState.WRITING)] * 2
    assert not len(mgr.table.take_recast())
    mgr.check_invariants()
    assert mgr.commit(a, [*x, *y], keys=[7, 8]).tolist() == [*x, *y]  # namespaced keys: fine
    mgr.check_invariants()


def test_a_key_cached_for_another_layout_names_both_layouts(make_manager):
    """Two models' clients on one node: a commit under a key another layout's block holds is refused
    naming that layout and the commit's (it said "another layout", naming neither: a review)."""
    from conftest import SMALL_FP8
    from dflash2.errors import ImmutableBlock
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=8)
    a, b = mgr.attach("a"), mgr.attach("b")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, big, 1), keys=[7]))
    y = mgr.allocate(b, small, 1)
    with pytest.raises(ImmutableBlock, match=rf"for another layout \('small', id {big}; this block is of 'small-fp8', "
                                             rf"id {small}\)"):
        mgr.commit(b, y, keys=[7])
    mgr.check_invariants()


@pytest.mark.parametrize("bad", [[7.9], [-1], [2**64], np.array([-5]), [True], [1, True], [np.int64(5), np.True_],
                                 [5, None], [None]])
def test_keys_that_are_not_uint64_are_refused_by_name_in_process(make_manager, bad):
    """The block manager in process refuses content keys that are not integers in [0, 2^64), as the
    client does, and changes nothing: before, commit stored 7.9 as key 7, np.int64(-5) as 2^64 - 5
    and True as key 1, and raised numpy's OverflowError for -1 and 2^64 (even under a parent that
    is not published, where ImmutableBlock was due); a lookup of 7.9 found key 7. A bool among ints
    is refused too, and None by name (a review)."""
    mgr = make_manager(hbm_blocks=4)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    found = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7])
    v = mgr.allocate(a, lid, 1)
    with pytest.raises(ValueError, match="content keys must be integers in \\[0, 2\\^64\\)"):
        mgr.commit(a, v, keys=bad)
    with pytest.raises(ValueError, match="content keys must be integers"):
        mgr.commit(a, v, keys=bad, parent=int(v[0]))
    with pytest.raises(ValueError, match="content keys must be integers"):
        mgr.lookup(bad, lid)
    assert mgr.table.cols.state[mgr.table.rows(v)].tolist() == [int(BlockState.WRITING)]
    assert len(mgr.table.keys) == 1  # key 7 alone
    assert [p.vid for p in mgr.lookup(np.array([7], dtype=np.uint64), lid)] == found.tolist()
    from dflash2.settling import rows_a_commit_meets  # (a commit meeting copies in flight asks it first)
    assert rows_a_commit_meets(mgr.table, np.array([[7, 8]], dtype=np.uint64), None).tolist() == mgr.table.rows(found).tolist()
    assert not len(rows_a_commit_meets(mgr.table, bad, None))
    mgr.check_invariants()
    assert mgr.commit(a, v, keys=[2**64 - 1]).tolist() == v.tolist()
    mgr.check_invariants()


def test_dead_rows_are_found_by_either_path(make_manager):
    """usable_rows checks a call's rows against the rows dead to new holders by set membership when
    the call is small, or one vectorised pass when it is large: both find the same rows."""
    mgr = make_manager(hbm_blocks=8)
    t = mgr.table
    t.pinned_copies.update({3: 0x103, 5: 0x105})  # (each with its twin's id)
    t.lost.add(7)
    few = np.array([1, 3, 7], dtype=np.int64)
    many = np.arange(8, dtype=np.int64)
    assert t._dead_rows(few).tolist() == [3, 7]
    assert t._dead_rows(many).tolist() == [3, 5, 7]
    t.pinned_copies.clear()
    t.lost.clear()
