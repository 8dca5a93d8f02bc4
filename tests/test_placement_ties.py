"""A choice of victims where a fifth of the blocks tie at the bottom: the cut found among few and the
victims' order only as far as they go, the same victims as the whole ranking (`bench table`'s heat
choice of 1% of a million took 146 ms, 107 of them partitioning every score, 32 ranking 195,098 tied
rows; 6-10 ms after, the 2-core VM)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2 import forest, kth, placement
from dflash2.bench import table as bench_table
from dflash2.tiers import Tier

CHAINS = 48  # 1,024-deep chains: 49,152 blocks, past kth.WORTH


@pytest.fixture(scope="module")
def served():
    """A table of served chains as `bench table` builds it: each chain written, then read four
    times as prefixes from its root, so each chain's unread tail (about a fifth of it) scores alike."""
    n = CHAINS * bench_table.CHUNK
    mgr, lid, client = bench_table._empty(n, "heat")
    bench_table._fill(mgr, lid, client, n)
    bench_table._served(mgr, np.random.default_rng(0), n)
    mgr.policy.rescore(mgr.table, mgr.table.clock())
    return mgr


def test_tied_cold_blocks_are_chosen_without_ranking_them_all(served, monkeypatch):
    mgr = served
    scores = mgr.policy.scores_all(mgr.table, mgr.table.clock())
    live = mgr.table.live_rows()
    tied = int(np.count_nonzero(scores[live] == scores[live].min()))
    assert tied > len(live) // 10  # the case: many tie at the bottom
    need = len(live) // 100 * bench_table.LAYOUT.block_bytes
    partitioned, ranked = [], []
    partition, heights = np.partition, forest.subtree_heights
    monkeypatch.setattr(np, "partition",
                        lambda a, k, *args, **kw: partitioned.append(len(a)) or partition(a, k, *args, **kw))
    monkeypatch.setattr(placement, "subtree_heights", lambda *args: ranked.append(len(args[0])) or heights(*args))
    fast = mgr.placement.select(Tier.HBM, need, evict=True)
    monkeypatch.undo()
    assert len(fast) == len(live) // 100
    assert partitioned and max(partitioned) < len(live) // 4, partitioned
    assert not ranked  # the levels peeled from the leaves held the room
    # The whole ranking (every score partitioned, every tied row's height) takes the same victims.
    monkeypatch.setattr(kth, "WORTH", 10 ** 12)
    monkeypatch.setattr(mgr.placement, "PEEL_LEVELS", 0)
    monkeypatch.setattr(placement, "subtree_heights", lambda *args: ranked.append(len(args[0])) or heights(*args))
    whole = mgr.placement.select(Tier.HBM, need, evict=True)
    assert ranked and ranked[0] >= tied
    assert fast.tolist() == whole.tolist()
    assert (scores[fast] == scores[live].min()).all()


def test_a_room_deeper_than_the_peel_ranks_every_row(served, monkeypatch):
    """Room for more than the peeled levels hold: the whole ranking, the same victims as ever."""
    mgr = served
    need = 40 * CHAINS * bench_table.LAYOUT.block_bytes  # 40 levels of every chain's tail
    ranked = []
    heights = forest.subtree_heights
    monkeypatch.setattr(placement, "subtree_heights", lambda *args: ranked.append(len(args[0])) or heights(*args))
    got = mgr.placement.select(Tier.HBM, need, evict=True)
    assert ranked  # 32 levels held too little
    monkeypatch.setattr(mgr.placement, "PEEL_LEVELS", 10 ** 6)
    ranked.clear()
    assert mgr.placement.select(Tier.HBM, need, evict=True).tolist() == got.tolist() and not ranked


def test_a_room_of_most_of_the_rows_under_the_cut_ranks_them_without_peeling(served, monkeypatch):
    """Room for more than 1/PEEL_SHARE of the rows at or under the cut: the peel would mostly run its
    levels and fail (1.25x the choice, a review), so every row is ranked at once; the same victims."""
    mgr = served
    scores = mgr.policy.scores_all(mgr.table, mgr.table.clock())
    live = mgr.table.live_rows()
    tied = int(np.count_nonzero(scores[live] == scores[live].min()))
    need = tied // 2 * bench_table.LAYOUT.block_bytes  # half the tied rows at the bottom
    peeled = []
    levels = forest.lowest_levels
    monkeypatch.setattr(placement, "lowest_levels", lambda *args: peeled.append(len(args[0])) or levels(*args))
    got = mgr.placement.select(Tier.HBM, need, evict=True)
    assert not peeled and len(got) == tied // 2
    monkeypatch.setattr(mgr.placement, "PEEL_SHARE", 1)
    assert mgr.placement.select(Tier.HBM, need, evict=True).tolist() == got.tolist() and peeled


def test_a_small_tier_gathers_its_rows_for_the_cut(served, monkeypatch):
    """Where the reachable rows are a small share of the table, the cut is found over them alone
    (passes over every row cost a tier of 100 rows among a million 1.8x, a review)."""
    mgr = served
    live = mgr.table.live_rows()
    protect = live[live % bench_table.CHUNK < bench_table.CHUNK - 2]  # each chain's last two may leave: 96 rows
    asked = []
    real = kth.kth_lowest
    monkeypatch.setattr(placement, "kth_lowest", lambda values, k, where=None: asked.append(
        (len(values), where is None)) or real(values, k, where=where))
    got = mgr.placement.select(Tier.HBM, 10 * bench_table.LAYOUT.block_bytes, evict=True, protect=protect)
    assert asked == [(2 * CHAINS, True)] and len(got) == 10
    monkeypatch.setattr(mgr.placement, "GATHER_BELOW", 10 ** 9)
    assert mgr.placement.select(Tier.HBM, 10 * bench_table.LAYOUT.block_bytes, evict=True,
                                protect=protect).tolist() == got.tolist()
    assert asked[1] == (len(mgr.table.cols.tier), False)


def test_a_low_cold_threshold_over_tied_blocks_partitions_few(served, monkeypatch):
    """The cold cut of a threshold of 0.1 lies inside the fifth of the blocks tied at the bottom: its
    cutoff is found among few (kth.py), the same rows cold as a partition of the tier's scores."""
    mgr = served
    scores = mgr.policy.scores_all(mgr.table, mgr.table.clock())
    live = mgr.table.live_rows()
    monkeypatch.setattr(mgr.placement, "cold_threshold", 0.1)
    sizes = []
    partition = np.partition
    monkeypatch.setattr(np, "partition",
                        lambda a, k, *args, **kw: sizes.append(len(a)) or partition(a, k, *args, **kw))
    cold = mgr.placement._cold_mask(Tier.HBM, scores)
    monkeypatch.undo()
    assert sizes and max(sizes) < len(live) // 4, sizes
    k = int(np.ceil(0.1 * len(live)))
    assert (cold == (mgr.table.cols.tier == int(Tier.HBM)) & (scores <= np.partition(scores[live], k - 1)[k - 1])).all()
    assert cold.sum() > k  # the tie at the cutoff counts as cold


def test_room_for_every_movable_block_takes_them_without_a_cut(served, monkeypatch):
    """k of every reachable row: the cut is the highest of them, so all of them, found without a
    partition (a whole partition of a million rows, 6-7 ms, a review)."""
    mgr = served
    reach = mgr.placement.movable(Tier.HBM, evict=True)
    scores = mgr.policy.scores_all(mgr.table, mgr.table.clock())
    n_reach = int(reach.sum())
    monkeypatch.setattr(placement, "kth_lowest", lambda *args, **kw: pytest.fail("a partition for every row"))
    assert (mgr.placement._at_or_below_cut(reach, n_reach, scores, n_reach) == reach).all()
