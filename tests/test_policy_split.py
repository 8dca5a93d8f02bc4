"""ARC's adaptive split (policy/split.py) on its own, and inside the heat policy."""

import numpy as np
import pytest

from dflash2.invariants import InvariantViolation
from dflash2.policy.split import (FIRST, HYSTERESIS, MAX_HIT_WEIGHT, MIN_RESOLVED, RATE_BAND, RETURNING, STEP_BLOCKS,
                                  WINDOW_SHARE, AdaptiveSplit)

from dflash2.policy.heat import INNER_CLASS
from dflash2.policy.heat_lut import keep_ranks

from test_policy_heat import cache_chain, manager


def code(tier, lst):
    return tier * 2 + lst


def filled(capacity=100, first=60, share=0.5):
    """A split whose tier 0 holds `capacity` blocks, `first` of them first-timers."""
    s = AdaptiveSplit(tiers=3, rows=1024, start_share=share)
    s.recount(np.full(0, -1, np.int8), np.array([code(0, FIRST)] * first + [code(0, RETURNING)] * (capacity - first),
                                                dtype=np.int8))
    return s


def test_list_sizes_follow_recounts_and_capacity_is_the_most_held():
    s = filled(100, 60)
    assert s.sizes[0].tolist() == [60, 40] and s.capacity[0] == 100
    # Ten first-timers read again (they return); five leave.
    s.recount(np.array([code(0, FIRST)] * 10, np.int8), np.array([code(0, RETURNING)] * 10, np.int8))
    s.recount(np.array([code(0, FIRST)] * 5, np.int8), np.full(5, -1, np.int8))
    assert s.sizes[0].tolist() == [45, 50] and s.capacity[0] == 100
    with pytest.raises(InvariantViolation, match="went negative"):
        s.recount(np.array([code(1, FIRST)], np.int8), np.full(1, -1, np.int8))


def test_a_first_timer_back_soon_after_it_left_grows_their_target():
    s = filled(100, 60)
    s.left(np.array([code(0, FIRST)] * 3, np.int8), np.array([11, 12, 13], np.uint64))
    s.referenced(0, np.array([12], np.uint64))
    # One step, weighed by the mean of the lists' departures (3 and, at least, 1) over its own list's.
    assert s.share[0] * 100 == pytest.approx(50 + 2 / 3)
    assert s.ghost_hits[0].tolist() == [1, 0]
    s.referenced(0, np.array([12], np.uint64))  # a ghost speaks once
    assert s.ghost_hits[0].tolist() == [1, 0]
    # Other tiers have ghosts of their own.
    s.referenced(1, np.array([11], np.uint64))
    assert s.ghost_hits[1].tolist() == [0, 0]


def test_steps_scale_with_a_tier_larger_than_step_blocks():
    s = filled(4 * STEP_BLOCKS, 2 * STEP_BLOCKS)
    s.left(np.array([code(0, FIRST)], np.int8), np.array([5], np.uint64))
    s.referenced(0, np.array([5], np.uint64))
    # A step of weight 1 (each list let at most one block go) times capacity / STEP_BLOCKS: the tier
    # is crossed in as many hits as a tier of STEP_BLOCKS blocks.
    assert s.share[0] * 4 * STEP_BLOCKS == pytest.approx(2 * STEP_BLOCKS + 4)


def test_a_returning_block_back_soon_after_it_left_shrinks_the_target():
    s = filled(100, 60)
    s.left(np.array([code(0, RETURNING)], np.int8), np.array([7], np.uint64))
    s.referenced(0, np.array([7, 8], np.uint64))  # 8 was never a ghost
    assert s.share[0] * 100 == pytest.approx(50 - 1)
    assert s.ghost_hits[0].tolist() == [0, 1]


def test_return_rates_per_departure_move_the_target_not_hit_counts():
    # 30 first-timers and 3 returning blocks left; 3 and 1 of them come back: first-timers come back
    # a tenth of the time and returning blocks a third, so returning blocks win the room although
    # their ghosts hit less often (ARC's counts would grow the first-timers' target).
    s = filled(100, 60)
    s.left(np.full(30, code(0, FIRST), np.int8), np.arange(1, 31, dtype=np.uint64))
    s.left(np.full(3, code(0, RETURNING), np.int8), np.arange(101, 104, dtype=np.uint64))
    s.referenced(0, np.array([28, 29, 30, 103], np.uint64))
    mean = (30 + 3) / 2
    assert s.share[0] * 100 == pytest.approx(50 + 3 * mean / 30 - mean / 3)
    assert s.share[0] < 0.5 and s.ghost_hits[0].tolist() == [3, 1]


def test_a_hit_weighs_at_most_max_hit_weight():
    s = filled(10_000, 6_000)
    s.left(np.full(1, code(0, RETURNING), np.int8), np.array([7], np.uint64))
    s.left(np.full(500, code(0, FIRST), np.int8), np.arange(1000, 1500, dtype=np.uint64))
    s.referenced(0, np.array([7], np.uint64))  # weight (500 + 1) / 2 over 1, bounded
    assert s.share[0] * 10_000 == pytest.approx(5_000 - MAX_HIT_WEIGHT * 10_000 / STEP_BLOCKS)


def test_recent_departures_halve_once_a_capacity_has_left():
    s = filled(100, 60)
    s.left(np.full(60, code(0, FIRST), np.int8), np.arange(1, 61, dtype=np.uint64))
    s.left(np.full(39, code(0, RETURNING), np.int8), np.arange(101, 140, dtype=np.uint64))
    assert s.recent_departures[0].tolist() == [60, 39]
    s.left(np.full(1, code(0, RETURNING), np.int8), np.array([140], np.uint64))  # the 100th
    assert s.recent_departures[0].tolist() == [30, 20] and s.departures[0].tolist() == [60, 40]


def rated(first_back: int, returning_back: int) -> AdaptiveSplit:
    """A 1,000-block tier whose lists each let 100 blocks go (keys 1-100 first-timers, 101-200
    returning), the given numbers of them asked for again, and then 500 first-timers (keys
    1001-1500): a window (500 departures) after the first 200, whose rates are then known."""
    s = filled(1000, 600)
    assert WINDOW_SHARE * 1000 == 500 and MIN_RESOLVED <= 100
    s.left(np.full(100, code(0, FIRST), np.int8), np.arange(1, 101, dtype=np.uint64))
    s.left(np.full(100, code(0, RETURNING), np.int8), np.arange(101, 201, dtype=np.uint64))
    s.referenced(0, np.arange(1, 1 + first_back, dtype=np.uint64))
    s.referenced(0, np.arange(101, 101 + returning_back, dtype=np.uint64))
    assert s.recent_rates(0) is None  # none of the departures' windows has closed yet
    s.left(np.full(500, code(0, FIRST), np.int8), np.arange(1001, 1501, dtype=np.uint64))
    assert s.resolved[0].tolist() == [100, 100]  # the 500 just gone are still in their window
    return s


def test_ghosts_of_a_list_that_comes_back_far_less_often_do_not_move_the_target():
    # First-timers come back 5% of the time, returning blocks 40%: below RATE_BAND of it.
    s = rated(5, 40)
    assert s.recent_rates(0).tolist() == [0.05, 0.4] and 0.05 < RATE_BAND * 0.4
    before = s.share[0]
    s.referenced(0, np.array([1200, 1300], np.uint64))  # two first-timers back soon after they left
    assert s.share[0] == before  # counted, but the target stays
    assert s.ghost_hits[0].tolist() == [7, 40] and s.recent_returns[0].tolist() == [7, 40]
    assert s.resolved[0].tolist() == [102, 100]  # the two came back: resolved before their window closed
    d = s.describe()[0]
    assert d["recent_return_rate"] == {"first_timers": round(7 / 102, 4), "returning": 0.4}
    assert d["ghosts_move_target"] == {"first_timers": False, "returning": True}
    s.left(np.full(1, code(0, RETURNING), np.int8), np.array([9], np.uint64))
    s.referenced(0, np.array([9], np.uint64))  # a returning block back: the target shrinks
    assert s.share[0] < before


def test_ghosts_of_both_lists_move_the_target_while_their_rates_are_within_the_band():
    s = rated(30, 40)  # 30% against 40%: within RATE_BAND
    before = s.share[0]
    s.referenced(0, np.array([1200], np.uint64))
    assert s.share[0] > before
    assert s.describe()[0]["ghosts_move_target"] == {"first_timers": True, "returning": True}


def test_without_a_band_every_ghost_moves_the_target():
    s = rated(5, 40)
    s.rate_band[:] = 0.0  # as in the heat policy's split of the returning blocks and below HBM
    before = s.share[0]
    s.referenced(0, np.array([1200], np.uint64))
    assert s.share[0] > before


def test_a_batch_of_departures_closes_with_its_first():
    s = filled(100, 60)  # a window of 50 departures
    s.left(np.full(40, code(0, FIRST), np.int8), np.arange(1, 41, dtype=np.uint64))  # one batch: 1-40
    s.left(np.full(30, code(0, RETURNING), np.int8), np.arange(101, 131, dtype=np.uint64))  # 41-70
    # More than 50 departures followed the batch's first: the whole batch counts
    # (docs/policy-experiments.md: closing one departure at a time cost the conversation trace's
    # largest tiered row).
    assert s.resolved[0].tolist() == [40, 0]
    s.left(np.full(20, code(0, FIRST), np.int8), np.arange(41, 61, dtype=np.uint64))  # 71-90
    assert s.resolved[0].tolist() == [40, 0]  # the returning batch began at 41: 49 followed it
    s.left(np.full(1, code(0, FIRST), np.int8), np.array([61], np.uint64))  # 91: 50 followed, still a ghost's window
    assert s.resolved[0].tolist() == [40, 0]
    s.left(np.full(1, code(0, FIRST), np.int8), np.array([62], np.uint64))  # 92: past it
    assert s.resolved[0].tolist() == [40, 30]


def test_rates_are_unknown_until_both_lists_have_min_resolved_departures():
    s = filled(1000, 600)
    s.left(np.full(100, code(0, FIRST), np.int8), np.arange(1, 101, dtype=np.uint64))
    s.left(np.full(MIN_RESOLVED - 1, code(0, RETURNING), np.int8), np.arange(101, 100 + MIN_RESOLVED, dtype=np.uint64))
    s.left(np.full(600, code(0, FIRST), np.int8), np.arange(1001, 1601, dtype=np.uint64))
    assert s.resolved[0, RETURNING] == MIN_RESOLVED - 1 and s.recent_rates(0) is None
    assert s.describe()[0]["recent_return_rate"] == {"first_timers": None, "returning": None}
    before = s.share[0]
    s.referenced(0, np.array([1500], np.uint64))  # no rates: every ghost moves the target
    assert s.share[0] > before


def test_rates_halve_with_the_departures_and_keep_a_quiet_lists_rate():
    s = rated(5, 40)
    # 300 more first-timers: the tier's 1,000th departure halves every recent count; the returning
    # list, which let nothing go meanwhile, keeps its rate.
    s.left(np.full(300, code(0, FIRST), np.int8), np.arange(2001, 2301, dtype=np.uint64))
    assert s.recent_departures[0, RETURNING] == 50 and s.recent_returns[0].tolist() == [2.5, 20]
    assert s.recent_rates(0)[RETURNING] == 0.4


def test_a_recent_return_rate_is_a_share_of_the_departures():
    # Every departure is asked for again at once, while its window is open: each list's rate is 1, and
    # no more (a departure returns once: its ghost is forgotten). Hits counted at once over departures
    # counted once their window closed read 2.25 here, and 1.62 on a live daemon (a review).
    s = filled(200, 100)
    worst, key = 0.0, 1
    for _ in range(60):
        for lst in (FIRST, RETURNING):
            keys = np.arange(key, key + 10, dtype=np.uint64)
            key += 10
            s.left(np.full(10, code(0, lst), np.int8), keys)
            s.referenced(0, keys)
        rates = s.recent_rates(0)
        worst = max(worst, 0.0 if rates is None else float(rates.max()))
    assert s.ghost_hits[0].tolist() == s.departures[0].tolist() == [600, 600]
    assert 0.9 <= worst <= 1.0, f"a recent return rate of {worst:.3f} per departure"


def test_a_ghost_that_many_departures_of_either_list_followed_says_nothing():
    s = filled(100, 60)  # a ghost speaks while at most WINDOW_SHARE * 100 departures followed it
    assert WINDOW_SHARE * 100 == 50
    s.left(np.full(2, code(0, FIRST), np.int8), np.array([1, 2], dtype=np.uint64))
    s.left(np.full(50, code(0, RETURNING), np.int8), np.arange(101, 151, dtype=np.uint64))
    s.referenced(0, np.array([1], np.uint64))  # 51 followed it, returning blocks among them
    assert s.ghost_hits[0].tolist() == [0, 0] and s.share[0] == 0.5
    s.referenced(0, np.array([2], np.uint64))  # 50 followed it: still a ghost
    assert s.ghost_hits[0].tolist() == [1, 0]


def test_the_target_stays_within_the_tier():
    s = filled(100, 60, share=0.99)
    s.left(np.full(30, code(0, FIRST), np.int8), np.arange(1, 31, dtype=np.uint64))
    s.referenced(0, np.arange(1, 31, dtype=np.uint64))
    assert s.share[0] == 1.0
    s = filled(100, 60, share=0.0)
    s.left(np.full(30, code(0, RETURNING), np.int8), np.arange(1, 31, dtype=np.uint64))
    s.referenced(0, np.arange(1, 31, dtype=np.uint64))
    assert s.share[0] == 0.0


def test_the_side_changes_only_past_the_hysteresis():
    s = filled(1000, 500, share=0.5)
    margin = HYSTERESIS * 1000
    assert not s.update_sides() and s.first_out[0]  # at the target: unchanged
    move = int(margin) + 1
    s.recount(np.full(move, code(0, FIRST), np.int8), np.full(move, code(0, RETURNING), np.int8))
    assert s.update_sides() and not s.first_out[0]  # first-timers under target: they keep their blocks
    s.recount(np.full(move, code(0, RETURNING), np.int8), np.full(move, code(0, FIRST), np.int8))
    assert not s.update_sides() and not s.first_out[0]  # back at the target: no flip-flop
    s.recount(np.full(move, code(0, RETURNING), np.int8), np.full(move, code(0, FIRST), np.int8))
    assert s.update_sides() and s.first_out[0]


def test_bad_start_share_is_refused():
    with pytest.raises(ValueError, match="start_share"):
        AdaptiveSplit(tiers=1, rows=16, start_share=1.5)
    with pytest.raises(ValueError, match="rate_band"):
        AdaptiveSplit(tiers=1, rows=16, rate_band=-0.1)
    with pytest.raises(ValueError, match="one per tier"):
        AdaptiveSplit(tiers=3, rows=16, rate_band=[0.5, 0.0])


# -- inside the heat policy ------------------------------------------------------------------

def read(mgr, lid, client, keys):
    vids = [p.vid for p in mgr.lookup(keys, lid)]
    assert mgr.acquire(client, vids) is not None
    mgr.release(client, vids)


def cached_keys(mgr):
    c = mgr.table.cols
    return set(c.key[(c.key != 0) & (c.state != 0)].tolist())


def test_the_list_over_its_target_gives_up_blocks_first_whatever_their_age():
    mgr, lid, c = manager(8)
    clock = mgr.table.clock
    for k in (1, 2, 3, 4):  # four chains of one block, each read again: returning
        cache_chain(mgr, lid, c, [k])
        read(mgr, lid, c, [k])
    for k in (5, 6, 7, 8):  # newer, never read again: first-timers
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    split = mgr.policy.split
    assert split.sizes[0].tolist() == [4, 4] and split.capacity[0] == 8
    split.share[0] = 0.0  # as after returning blocks' ghosts spoke: first-timers are over target
    mgr.policy._sides()
    assert split.first_out[0]
    clock.now += 1.0
    cache_chain(mgr, lid, c, [9])
    # One first-timer goes, although every returning block is older (LRU would drop block 1).
    assert cached_keys(mgr) == {1, 2, 3, 4, 6, 7, 8, 9}
    # With room for every first-timer, the returning blocks give way instead.
    split.share[0] = 1.0
    mgr.policy._sides()
    assert not split.first_out[0]
    clock.now += 1.0
    cache_chain(mgr, lid, c, [10])
    assert cached_keys(mgr) & {6, 7, 8, 9, 10} == {6, 7, 8, 9, 10}
    assert len(cached_keys(mgr) & {1, 2, 3, 4}) == 3
    mgr.check_invariants()


def test_returning_blocks_seen_two_or_three_times_give_way_before_the_others_while_over_their_target():
    mgr, lid, c = manager(8)
    clock = mgr.table.clock
    for k in (3, 4):  # older, read three times: referenced four times (frequency class 2)
        cache_chain(mgr, lid, c, [k])
        for _ in range(3):
            read(mgr, lid, c, [k])
    for k in (1, 2):  # newer, read once: referenced twice (class 1)
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
        read(mgr, lid, c, [k])
    for k in (5, 6, 7, 8):  # first-timers
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    pol = mgr.policy
    assert pol.split.sizes[0].tolist() == [4, 4] and pol.inner.sizes[0].tolist() == [2, 2]
    pol.split.share[0] = 1.0  # first-timers under their target: returning blocks give way first
    pol.inner.share[0] = 0.0  # and of those, the ones seen 2-3 times (over their target)
    pol._sides()
    clock.now += 1.0
    cache_chain(mgr, lid, c, [9])
    # Block 1 goes, although blocks 3 and 4 are older (recency alone would drop block 3).
    assert cached_keys(mgr) == {2, 3, 4, 5, 6, 7, 8, 9}
    assert pol.inner.departures[0].tolist() == [1, 0] and pol.split.departures[0].tolist() == [0, 1]
    pol.inner.share[0] = 1.0  # room for all seen 2-3 times: those seen more often give way first
    pol._sides()
    clock.now += 1.0
    cache_chain(mgr, lid, c, [10])
    assert cached_keys(mgr) == {2, 4, 5, 6, 7, 8, 9, 10}
    assert pol.inner.departures[0].tolist() == [1, 1]
    # First-timers over their target go before any returning block, whatever the inner split says.
    pol.split.share[0] = 0.0
    pol._sides()
    clock.now += 1.0
    cache_chain(mgr, lid, c, [11])
    assert cached_keys(mgr) == {2, 4, 6, 7, 8, 9, 10, 11}
    # Block 1, written again soon after it left the seen-2-3 list: that list's ghost speaks.
    clock.now += 1.0
    cache_chain(mgr, lid, c, [1])
    assert pol.inner.ghost_hits[0].tolist() == [1, 0]
    mgr.check_invariants()


def test_below_hbm_returning_blocks_are_one_list():
    mgr, lid, c = manager(4, dram_blocks=4)
    pol = mgr.policy
    for k in (1, 2):
        cache_chain(mgr, lid, c, [k])
        read(mgr, lid, c, [k])  # returning, in HBM: counted in the inner split
    # The rate band holds ghosts in HBM's outer split only (docs/policy-experiments.md: the
    # band elsewhere cost the conversation trace's largest tiered row its lead over LRU).
    assert pol.split.rate_band.tolist() == [RATE_BAND, 0.0, 0.0] and pol.inner.rate_band.tolist() == [0.0]
    assert pol.inner.sizes.tolist() == [[2, 0]]
    for k in (3, 4):  # HBM full
        cache_chain(mgr, lid, c, [k])
    pol.split.share[0] = 1.0  # returning blocks give way first: block 1 goes down to DRAM
    pol._sides()
    cache_chain(mgr, lid, c, [5])
    row = mgr.table.rows([p.vid for p in mgr.lookup([1], lid)])[0]
    assert mgr.table.cols.tier[row] == 1 and pol.split.sizes[1].tolist() == [0, 1]
    assert pol.inner.sizes.tolist() == [[1, 0]] and pol.inner.departures.tolist() == [[1, 0]]
    # Ranks (0 gives way first) of first-timers, returning blocks seen 2-3 times and seen more often:
    # below HBM the two returning lists share one rank.
    pol.split.first_out[:] = [True, False, True]
    pol.inner.first_out[:] = [False]
    assert keep_ranks(pol.split, pol.inner).tolist() == [[0, 2, 1], [1, 0, 0], [0, 1, 1]]
    pol.split.first_out[:] = [False, True, False]
    pol.inner.first_out[:] = [True]
    assert keep_ranks(pol.split, pol.inner).tolist() == [[2, 0, 1], [0, 1, 1], [1, 0, 0]]
    mgr.check_invariants()


def test_heat_feeds_ghosts_from_evictions_and_moves():
    mgr, lid, c = manager(4)
    clock = mgr.table.clock
    for k in (1, 2):  # read again: returning blocks
        cache_chain(mgr, lid, c, [k])
        read(mgr, lid, c, [k])
    split = mgr.policy.split
    split.share[0] = 1.0  # first-timers under target: the returning blocks go first
    mgr.policy._sides()
    for k in (3, 4, 5, 6):
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    assert cached_keys(mgr) == {3, 4, 5, 6} and split.departures[0].tolist() == [0, 2]
    split.share[0] = 0.0  # and now the first-timers
    mgr.policy._sides()
    clock.now += 1.0
    cache_chain(mgr, lid, c, [7])
    assert cached_keys(mgr) == {4, 5, 6, 7} and split.departures[0].tolist() == [1, 2]
    clock.now += 1.0
    # A ghost speaks while at most two departures (half the tier) followed it: 2 left before 3.
    cache_chain(mgr, lid, c, [2])  # a returning block's ghost; the target cannot go below 0
    assert split.ghost_hits[0].tolist() == [0, 1] and split.share[0] == 0.0
    cache_chain(mgr, lid, c, [3])  # written again soon after it left: a first-timer's ghost
    assert split.ghost_hits[0].tolist() == [1, 1] and split.share[0] > 0.0
    # A block demoted to DRAM leaves HBM's list; promoted back, it is HBM's ghost that speaks.
    mgr, lid, c = manager(2, dram_blocks=4)
    clock = mgr.table.clock
    for k in (1, 2, 3):
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    split = mgr.policy.split
    assert mgr.table.cols.tier[mgr.table.rows([p.vid for p in mgr.lookup([1], lid)])][0] == 1
    assert split.departures[0].tolist() == [1, 0] and split.sizes[1].tolist() == [1, 0]
    read(mgr, lid, c, [1])  # promoted into HBM
    assert split.ghost_hits[0].sum() == 1
    mgr.check_invariants()


def test_a_key_back_after_it_left_the_last_tier_is_that_tiers_ghost():
    # A key that left the last tier comes back by a write into HBM, never by arriving in that
    # tier: its ghost must speak on the reference, or the last tier's target never moves.
    mgr, lid, c = manager(2, dram_blocks=2)
    clock = mgr.table.clock
    for k in (1, 2, 3, 4, 5):
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    split = mgr.policy.split
    assert 1 not in cached_keys(mgr) and split.departures[1].sum() == 1
    cache_chain(mgr, lid, c, [1])  # recomputed and written into HBM
    assert split.ghost_hits[1].tolist() == [1, 0] and split.share[1] > 0.0
    # A block read from DRAM speaks to HBM's ghosts only: DRAM still holds it until it moves.
    before = split.ghost_hits[1].copy()
    read(mgr, lid, c, [4])
    assert split.ghost_hits[1].tolist() == before.tolist()
    mgr.check_invariants()


def test_heat_counts_every_cached_keyed_block_in_one_list():
    mgr, lid, c = manager(16, dram_blocks=16)
    pol = mgr.policy
    cache_chain(mgr, lid, c, [1, 2, 3, 4])
    split = pol.split
    assert split.sizes[0].tolist() == [4, 0]
    read(mgr, lid, c, [1, 2, 3, 4])  # read again: returning
    assert split.sizes[0].tolist() == [0, 4]
    for start in range(100, 140, 8):  # 40 blocks more through 32 slots: demotions, evictions
        cache_chain(mgr, lid, c, list(range(start, start + 8)))
    read(mgr, lid, c, [100, 101])
    read(mgr, lid, c, [100, 101])
    read(mgr, lid, c, [100, 101])  # referenced four times: the inner split's second list
    c_ = mgr.table.cols
    held = (c_.key != 0) & (c_.state != 0)
    for tier in (0, 1):
        here = held & (c_.tier == tier)
        returning = here & (pol._cls > 0)
        assert split.sizes[tier].tolist() == [int((here & ~returning).sum()), int(returning.sum())]
    # HBM's returning blocks, and only those, in the inner split's lists.
    hbm_returning = held & (c_.tier == 0) & (pol._cls > 0)
    often = hbm_returning & (pol._cls >= INNER_CLASS)
    assert pol.inner.sizes.tolist() == [[int((hbm_returning & ~often).sum()), int(often.sum())]]
    assert often.any(), "some blocks must be in the inner split's second list"
    assert split.capacity[0] == 16 and split.capacity[1] == 16
    mgr.check_invariants()


def test_the_split_is_in_the_stats_as_json():
    import json

    mgr, lid, c = manager(8, dram_blocks=8)
    for k in range(1, 13):
        cache_chain(mgr, lid, c, [k])
    split = json.loads(json.dumps(mgr.stats()))["policy"]["split"]
    assert [t["tier"] for t in split] == ["hbm", "dram"]
    assert split[0]["first_timers"] + split[0]["returning"] == 8
    assert split[1]["first_timers"] == 4
    assert set(split[0]["ghost_hits"]) == {"first_timers", "returning"}


def test_a_tier_whose_blocks_grew_large_is_judged_by_what_it_holds():
    """A tier that held 4,096 blocks of a 16 KiB layout, then holds 32 of a 2 MiB one: judged at the
    old count, the hysteresis margin (41 blocks) exceeded the whole tier, and once the returning list
    gave way first it did so for good, thrashing a hot set while first-timers stayed (a review)."""
    s = filled(4096, 0, share=0.5)
    s.update_sides()
    assert not s.first_out[0]  # (first-timers under their target: the returning list gives way)
    s.share[0] = 0.0  # (the ghosts moved the target since)
    # The small blocks leave; 32 large ones come, first-timers all: over their target of 0.
    s.recount(np.array([code(0, RETURNING)] * 4096, np.int8), np.full(4096, -1, np.int8))
    s.recount(np.full(32, -1, np.int8), np.array([code(0, FIRST)] * 32, np.int8))
    assert s.capacity[0] == 4096
    s.update_sides()
    assert s.first_out[0], "first-timers over their target must give way first"
