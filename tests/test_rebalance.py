"""The background rebalance (dflash2/rebalance.py): drains down to the low watermark, in pieces,
step after step, over the cold cut taken when the tier went over its high watermark."""

import numpy as np
import pytest

from dflash2.placement import Watermark
from dflash2.tiers import Tier

from conftest import SMALL
from placement_helpers import fill, tier_of


def full_of_aged_blocks(make_manager, clock, monkeypatch, blocks: int, low: float, cold_threshold: float = 0.9):
    """A manager whose HBM of `blocks` blocks is full of cached blocks aged one tick apart (the
    oldest first), its high watermark at 0.95, and no time budget for a rebalance: one piece a
    step. Returns it, its layout and a count of HBM's blocks."""
    mgr = make_manager(hbm_blocks=blocks, dram_blocks=2 * blocks, cold_threshold=cold_threshold,
                       watermarks={Tier.HBM: Watermark(0.95, low)})
    monkeypatch.setattr(mgr.placement, "REBALANCE_BUDGET_S", 0.0)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    for k in range(1, blocks + 1):
        clock.advance(1)
        fill(mgr, a, lid, [k])
    return mgr, lid, lambda: mgr.stats()["tiers"]["hbm"]["blocks"]


def dram_of_idle_chains(mgr, a, lid, clock, blocks: int = 1940) -> None:
    """`blocks` idle cached blocks written into DRAM in chains of 20 (keys 1..blocks), 10 ms apart."""
    for k in range(0, blocks, 20):
        clock.advance(0.01)
        v = mgr.allocate(a, lid, 20, tier=Tier.DRAM)
        mgr.free(a, mgr.commit(a, v, keys=list(range(1 + k, 21 + k))))


def test_rebalance_demotes_cold_blocks_down_to_the_low_watermark(make_manager, clock, monkeypatch):
    mgr = make_manager(hbm_blocks=10, dram_blocks=20, cold_threshold=0.9,
                       watermarks={Tier.HBM: Watermark(0.75, 0.5)})
    # The whole drain in one step, whatever the machine's load (a 50 ms step could end after a piece).
    monkeypatch.setattr(mgr.placement, "REBALANCE_BUDGET_S", 30.0)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    for k in range(1, 10):
        clock.advance(1)
        fill(mgr, a, lid, [k])
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 9
    mgr.tick()
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 5
    # the oldest went down (LRU); the newest stayed
    assert tier_of(mgr, mgr.lookup([1], lid)[0].vid) == Tier.DRAM
    assert tier_of(mgr, mgr.lookup([9], lid)[0].vid) == Tier.HBM
    mgr.tick()  # below the high watermark now: nothing moves
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 5
    mgr.check_invariants()


def test_a_rebalance_drains_in_pieces_step_after_step(make_manager, clock, monkeypatch):
    """Over its high watermark, a tier drains a piece at a time (a hundredth of it) while the step's
    time lasts, and goes on in the next steps until it is down to its low watermark: 10% of a tier
    in one step held the daemon's loop for seconds when DRAM went down to NVMe. With no time left,
    each draining tier still gets one piece a step."""
    mgr, lid, hbm = full_of_aged_blocks(make_manager, clock, monkeypatch, 100, low=0.85)
    mgr.tick()
    assert hbm() == 99 and Tier.HBM in mgr.placement.draining
    for left in range(98, 84, -1):  # under the high watermark now, and still draining
        mgr.tick()
        assert hbm() == left
    assert Tier.HBM not in mgr.placement.draining
    mgr.tick()  # at the low watermark: nothing moves
    assert hbm() == 85
    assert tier_of(mgr, mgr.lookup([1], lid)[0].vid) == Tier.DRAM  # the oldest went first (LRU)
    assert tier_of(mgr, mgr.lookup([100], lid)[0].vid) == Tier.HBM
    mgr.check_invariants()


def test_a_drain_over_several_steps_moves_only_the_blocks_cold_when_it_began(make_manager, clock, monkeypatch):
    """cold_threshold 0.2: the drain that starts over the high watermark moves the coldest fifth of
    the tier as it was then, over as many steps as that takes, and stops there (a new cut each step
    would call the coldest of the rest cold, and drain warm blocks down to the low watermark)."""
    mgr, lid, _ = full_of_aged_blocks(make_manager, clock, monkeypatch, 100, low=0.5, cold_threshold=0.2)
    for _ in range(40):
        mgr.tick()
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 80
    assert Tier.HBM not in mgr.placement.draining
    assert {tier_of(mgr, mgr.lookup([k], lid)[0].vid) for k in range(1, 21)} == {Tier.DRAM}
    mgr.check_invariants()


def test_a_drain_sizes_its_pieces_by_its_measured_rate(make_manager, clock, monkeypatch):
    """A rebalance piece takes at most half the step's budget at the rate the tier drained last,
    within a sixteenth of 1% of the tier and 1%: 1% of a large DRAM tier written to NVMe held the
    daemon's loop for half a second whatever the budget. A tier's first piece is the floor, and so
    is every piece while a piece's fixed cost alone outlasts half the budget (by rate alone the
    pieces would shrink to one block a step)."""
    mgr, _, hbm = full_of_aged_blocks(make_manager, clock, monkeypatch, 3200, low=0.5)
    pl = mgr.placement
    block = 16384
    mgr.tick()
    assert hbm() == 3198  # the first piece: 2 blocks (a sixteenth of 1%), not 1% (32)
    assert Tier.HBM in pl._drain_rate
    for per_s, blocks in ((400, 20), (80, 4), (1e12, 32), (1, 2)):  # 0.05 s at that rate
        pl._drain_rate[Tier.HBM] = per_s * block
        assert pl._piece_bytes(Tier.HBM, 0.05) == blocks * block, per_s
    pl._drain_rate[Tier.HBM] = 1.0  # a slow rate: one piece a step, at the floor
    mgr.tick()
    assert hbm() == 3196  # the floor again
    mgr.check_invariants()


def test_a_piece_is_no_larger_than_its_copies_move_in_its_time(make_manager, clock, monkeypatch):
    """A piece's copies may be left in flight, and a call that settles them waits for what is left:
    sized by the loop's time alone, a piece of DRAM drained to NVMe grew to 40 MB of writes (32 ms
    of waiting for an allocation on the H200 host). The path's measured bandwidth caps it too."""
    mgr, _, _ = full_of_aged_blocks(make_manager, clock, monkeypatch, 3200, low=0.5)
    pl = mgr.placement
    block = 16384
    pl._drain_rate[Tier.HBM] = 400 * block  # the loop's time alone: 20 blocks in 0.05 s
    assert pl._piece_bytes(Tier.HBM, 0.05) == 20 * block
    mgr.read_cost.observe(Tier.HBM, Tier.DRAM, 1 << 30, (1 << 30) / (100 * block))  # copies: 100 blocks/s
    assert pl._piece_bytes(Tier.HBM, 0.05) == 5 * block
    mgr.read_cost.observe(Tier.HBM, Tier.DRAM, 1 << 40, 1e-3)  # copies far faster than the loop
    assert pl._piece_bytes(Tier.HBM, 0.05) == 20 * block


def test_the_floor_holds_a_piece_only_where_choosing_it_outlasts_its_copies(make_manager, clock, monkeypatch):
    """The floor is a share of the tier's bytes (a sixteenth of 1%), for pieces whose fixed cost
    would outlast their copies. It set every piece of a large tier whatever that cost: 80 MB of NVMe
    writes a piece of a 128 GB DRAM tier, 35 ms that an allocation waited for. Once a piece left in
    flight has measured its cost, the floor is no more than its copies move in that time."""
    mgr, _, _ = full_of_aged_blocks(make_manager, clock, monkeypatch, 3200, low=0.5)
    pl = mgr.placement
    block = 16384
    pl._drain_rate[Tier.HBM] = 400 * block  # the loop's time alone: 20 blocks in 0.05 s
    mgr.read_cost.observe(Tier.HBM, Tier.DRAM, 1 << 30, (1 << 30) / (20 * block))  # copies: 20 blocks/s
    assert pl._piece_bytes(Tier.HBM, 0.05) == 2 * block, "no cost measured: the floor (2 blocks), over the copies' 1"
    pl._piece_cost_s[Tier.HBM] = 0.01  # chosen in 10 ms: the copies' 0.05 s (one block) sets it
    assert pl._piece_bytes(Tier.HBM, 0.05) == block
    pl._piece_cost_s[Tier.HBM] = 0.075  # chosen in 75 ms: copies as long (1.5 blocks)
    assert pl._piece_bytes(Tier.HBM, 0.05) == int(1.5 * block)
    pl._piece_cost_s[Tier.HBM] = 10.0  # however slow the choice, never over the floor
    assert pl._piece_bytes(Tier.HBM, 0.05) == 2 * block
    pl._piece_cost_s[Tier.HBM] = 0.0
    assert pl._piece_bytes(Tier.HBM, 1e-9) == 1, "at least one byte: one block"


def test_draining_tiers_share_the_steps_budget(make_manager, clock, monkeypatch):
    """Every tier over its high watermark drains in the same step, slowest first, each for an equal
    part of what is left of the budget (and one piece whatever the time). Before, the first tier's
    pieces ran until the whole budget was spent and each later one still had its piece: with every
    tier full at a million blocks a step took 80-110 ms of a 50 ms budget. Here every piece takes
    10 ms (a fake clock): NVMe gets 50/3 ms (two pieces), DRAM half of the 30 left (two), HBM the
    last 10 (one), so the step ends at the budget, not at 70 ms."""
    import dflash2.rebalance as rebalance

    mgr = make_manager(hbm_blocks=40, dram_blocks=40, nvme_blocks=400, policy="lru", cold_threshold=0.9,
                       watermarks={t: Watermark(0.9, 0.2) for t in (Tier.HBM, Tier.DRAM, Tier.NVME)})
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    key = 1
    for tier, rounds in ((Tier.NVME, 10), (Tier.DRAM, 1), (Tier.HBM, 1)):
        for _ in range(rounds):  # 40 blocks written in a memory tier, to NVMe 40 at a time
            vids = []
            for _ in range(40):
                clock.advance(1)
                written = min(tier, Tier.DRAM)
                vids += mgr.commit(a, mgr.allocate(a, lid, 1, tier=written), keys=[key]).tolist()
                mgr.free(a, vids[-1:])
                key += 1
            if tier == Tier.NVME:
                assert mgr.mover.move(mgr.table.rows(vids), Tier.NVME).all()
    now = [0.0]
    monkeypatch.setattr(rebalance.time, "perf_counter", lambda: now[0])
    pl = mgr.placement
    make_room, pieces = pl.make_room, []

    def timed(tier, *args, **kw):
        if not pieces or pieces[-1][1] is not None:  # a piece of the rebalance, not the room it makes below
            pieces.append((tier, None))
            now[0] += 0.010
            try:
                return make_room(tier, *args, **kw)
            finally:
                pieces[-1] = (tier, now[0])
        return make_room(tier, *args, **kw)
    monkeypatch.setattr(pl, "make_room", timed)
    for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
        pl._drain_rate[tier] = 1.0  # slow: every piece at the floor, so the tiers keep draining
    mgr.tick()
    assert [t for t, _ in pieces] == [Tier.NVME, Tier.NVME, Tier.DRAM, Tier.DRAM, Tier.HBM]
    assert now[0] == pytest.approx(pl.REBALANCE_BUDGET_S)
    mgr.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "lfu", "heat"])
def test_a_chain_written_root_first_drains_down_to_the_low_watermark(make_manager, clock, policy):
    """One long chain written over time, its root first: every policy ranks its root side colder
    than its leaf side, so the cold cut a drain takes is the root side, whose blocks may leave only
    after their descendants, which are not in it. The drain moved nothing, and the tier stayed above
    its high watermark for good (soak2: a 512 MB DRAM tier at 97% of idle cached blocks, demoted 0)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=40, nvme_blocks=80, policy=policy,
                       watermarks={Tier.DRAM: Watermark(0.9, 0.5)})
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    pieces = []
    for _ in range(38):
        clock.advance(1)
        pieces.append(mgr.allocate(a, lid, 1, tier=Tier.DRAM))
    mgr.free(a, mgr.commit(a, np.concatenate(pieces), keys=list(range(1, 39))))
    for _ in range(50):
        clock.advance(0.1)
        mgr.tick()
    assert mgr.stats()["tiers"]["dram"]["blocks"] <= 20
    mgr.check_invariants()


def test_drain_slices_between_steps_take_no_new_cold_cut(make_manager, clock):
    """The server runs a drain's pieces between requests (`drain_slice`), many a step. A tier
    over its high watermark whose cut cannot move (every HBM block held by a writer) ends its
    drain at once; it must not be cut again (a pass over the whole table) in every slice that
    another tier's drain runs, only at the next step."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=2000, nvme_blocks=4000,
                       watermarks={Tier.DRAM: Watermark(0.9, 0.5)})
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    dram_of_idle_chains(mgr, a, lid, clock)  # DRAM at 97%
    mgr.allocate(a, lid, 16)  # every HBM block held (being written): HBM's drain cannot move a block
    cuts = []
    cold_mask = mgr.placement._cold_mask
    mgr.placement._cold_mask = lambda tier, scores: cuts.append(Tier(tier)) or cold_mask(tier, scores)
    clock.advance(0.1)
    mgr.tick(drain=False)  # the step begins both drains: one cut each
    assert sorted(cuts) == [Tier.HBM, Tier.DRAM]
    cuts.clear()
    for _ in range(10):  # slices of one piece per draining tier (no time left after it)
        mgr.drain_slice(0.0)
    assert mgr.draining()  # DRAM still draining: the slices ran its pieces
    assert cuts == []


def test_with_a_request_always_waiting_every_draining_tier_gets_pieces_in_turn(make_manager, clock):
    """A slice between requests ends after one piece when a request waits (the server's
    `yield_to`). Each slice began with the slowest draining tier: under constant load DRAM, draining
    down to NVMe, got every piece, and HBM, over its high watermark, none until DRAM was done (200
    slices in a review's script), its allocations making their room on the request path meanwhile.
    The next slice now begins where the last one stopped, so the draining tiers take turns."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=2000, nvme_blocks=4000,
                       watermarks={Tier.HBM: Watermark(0.9, 0.5), Tier.DRAM: Watermark(0.9, 0.5)})
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    dram_of_idle_chains(mgr, a, lid, clock)  # DRAM at 97%
    fill(mgr, a, lid, list(range(5000, 5016)))  # HBM full of idle cached blocks
    clock.advance(0.1)
    mgr.tick(drain=False)  # the step begins both drains
    assert mgr.placement.draining == {Tier.HBM, Tier.DRAM}
    hbm, dram = (lambda t=t: mgr.stats()["tiers"][t]["blocks"] for t in ("hbm", "dram"))
    dram_before = dram()
    pieces = []
    make_room = mgr.placement.make_room

    def counted(tier, *args, **kw):
        if kw.get("cold_only"):  # a drain's piece, not the room a piece makes below
            pieces.append(Tier(tier))
        return make_room(tier, *args, **kw)
    mgr.placement.make_room = counted
    for _ in range(40):
        mgr.drain_slice(0.0, yield_to=lambda seconds: True)  # a request always waits
    assert hbm() <= 8 and Tier.HBM not in mgr.placement.draining  # down to its low watermark
    assert Tier.DRAM in mgr.placement.draining and dram() < dram_before  # DRAM drained meanwhile too
    assert pieces[:4] == [Tier.DRAM, Tier.HBM, Tier.DRAM, Tier.HBM]  # one piece a slice, in turn
    mgr.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_a_drain_leaves_a_chain_being_written_where_it_is(make_manager, clock, monkeypatch, policy):
    """A chain written in pieces, each committed under the last block of the one before: its first
    piece is the tier's coldest once others were written after it. A drain's cut took the cold
    blocks with their descendants and moved them leaves first, so the block written last (the
    parent of the next piece) went down first, beside older chains' tips (where the next commit
    then found it gone, it was refused naming its parent: docs/known-gaps.md). A block is as cold
    as the hottest block under it in the tier: a chain is read through its root, so its root side
    is needed as long as its tip is."""
    mgr = make_manager(hbm_blocks=40, dram_blocks=80, cold_threshold=0.5, policy=policy,
                       watermarks={Tier.HBM: Watermark(0.9, 0.5)})
    monkeypatch.setattr(mgr.placement, "REBALANCE_BUDGET_S", 30.0)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    clock.advance(1)
    first = fill(mgr, a, lid, list(range(1000, 1008)))  # the chain's first piece, written first
    for k in range(5):  # another writer's chains, after it
        clock.advance(1)
        fill(mgr, b, lid, list(range(10 * k + 1, 10 * k + 5)))
    clock.advance(1)
    second = fill(mgr, a, lid, list(range(1008, 1016)), parent=int(first[-1]))
    clock.advance(1)
    fill(mgr, b, lid, [500])  # HBM at 37 of 40: over its high watermark
    for _ in range(10):  # (pieces sized by the drain's measured rate: one step may not finish it)
        clock.advance(0.1)
        mgr.tick()
    assert mgr.stats()["tiers"]["hbm"]["blocks"] <= 20  # drained to its low watermark
    chain = np.concatenate([first, second])
    assert [tier_of(mgr, v) for v in chain] == [Tier.HBM] * 16  # the chain being written stayed
    # the next piece chains under its tip, in HBM
    third = fill(mgr, a, lid, list(range(1016, 1024)), parent=int(second[-1]))
    assert tier_of(mgr, third[0]) == Tier.HBM
    assert tier_of(mgr, mgr.lookup([1], lid)[0].vid) == Tier.DRAM  # the older chains went instead
    mgr.check_invariants()
