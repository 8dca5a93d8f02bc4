"""The heat policy, its frequency sketch and admission filter, prefix-aware victim choice, prefetch."""

import numpy as np
import pytest

from dflash2.bench.policy import Request, replay
from dflash2.errors import UnknownPolicy
from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.policy import make_policy, policy_names
from dflash2.policy.admission import FrequencyAdmission, FrequencySketch
from dflash2.policy.ghosts import ghost_bits
from dflash2.prefetch import Prefetcher
from dflash2.tiers import Tier

LAYOUT = Layout("t", num_layers=1, num_kv_heads=1, head_dim=64, dtype="fp16", tokens_per_block=64)  # 16 KiB
SLOT = LAYOUT.block_bytes


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def manager(hbm_blocks, policy="heat", dram_blocks=0, clock=None):
    specs = [TierSpec(Tier.HBM, hbm_blocks * SLOT, SLOT, 256)]
    if dram_blocks:
        specs.append(TierSpec(Tier.DRAM, dram_blocks * SLOT, SLOT, 256))
    mgr = BlockManager(specs, policy=policy, clock=clock or Clock())
    return mgr, mgr.register_layout(LAYOUT), mgr.attach("c")


def cache_chain(mgr, lid, client, keys, parent=None):
    vids = mgr.commit(client, mgr.allocate(client, lid, len(keys)), keys, parent)
    mgr.free(client, vids)
    return vids


def test_registered_by_name():
    assert {"heat", "belady", "lru", "lfu"} <= set(policy_names())
    assert make_policy("heat").name == "heat"
    with pytest.raises(UnknownPolicy, match="heat"):
        make_policy("hot")


def test_weights_change_at_run_time_and_are_checked():
    mgr, lid, c = manager(16)
    cache_chain(mgr, lid, c, [1, 2])
    pol = mgr.policy
    rows = mgr.table.rows(cache_chain(mgr, lid, c, [3]))
    mgr.table.cols.priority[rows] = 5
    before = pol.scores(mgr.table, rows, 0.0)
    pol.set_weights({"priority": 3.0})
    assert pol.scores(mgr.table, rows, 0.0)[0] == pytest.approx(before[0] + 10.0)
    with pytest.raises(ValueError, match="unknown heat weights"):
        pol.set_weights({"temperature": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        pol.set_weights({"recency": -1.0})


def test_scores_all_matches_scores_and_rescores_on_access():
    mgr, lid, c = manager(64)
    vids = cache_chain(mgr, lid, c, list(range(1, 11)))
    pol, table = mgr.policy, mgr.table
    rows = table.rows(vids)
    assert np.allclose(pol.scores_all(table, 0.0)[rows], pol.scores(table, rows, 0.0))
    before = pol.scores_all(table, 0.0)[rows[0]]
    mgr.acquire(c, vids[:1])
    mgr.release(c, vids[:1])
    # The cached pass is patched for the accessed block at once (no wait for the next rescore).
    assert pol.scores_all(table, 0.0)[rows[0]] == pytest.approx(pol.scores(table, rows[:1], 0.0)[0])
    assert pol.scores_all(table, 0.0)[rows[0]] != before


def test_with_a_background_step_a_calls_scores_are_not_rescored_while_the_step_is_due(monkeypatch):
    """The step rescores every interval; a client's call in the window between the cache's expiry
    and the step that is due must not pay for a full pass the step then repeats (tens of ms at a
    million blocks). Without steps (a replay), scores are rescored on demand each interval."""
    clock = Clock()
    mgr, lid, c = manager(64, clock=clock)
    cache_chain(mgr, lid, c, list(range(1, 11)))
    pol, table = mgr.policy, mgr.table
    passes = []
    rescore = pol.rescore
    monkeypatch.setattr(pol, "rescore", lambda *a: passes.append(1) or rescore(*a))
    interval = pol.rescore_interval_s
    pol.scores_all(table, 0.0)
    pol.scores_all(table, 1.5 * interval)
    assert len(passes) == 2  # no step yet: on demand, each interval
    mgr.tick()  # the step rescores
    stepped = len(passes)
    at = clock.now
    pol.scores_all(table, at + 1.5 * interval)  # the next step is due: not a pass of the call's own
    assert len(passes) == stepped
    pol.scores_all(table, at + 2.5 * interval)  # the steps stopped: the call rescores
    assert len(passes) == stepped + 1


def test_ghost_tables_grow_with_the_table():
    """The daemon's table starts small and doubles as the tiers fill: the learners' ghost tables
    (twice the table's rows) are made anew at each doubling, not left at the first size (4096
    slots: a sliver of a large cache's departures)."""
    mgr, lid, c = manager(8192)
    pol = mgr.policy
    cache_chain(mgr, lid, c, [1])
    small = pol.gate._ghosts[0].bits
    for k in range(2, 6002, 1000):
        cache_chain(mgr, lid, c, list(range(k, k + 1000)))
    grown = ghost_bits(mgr.table.cols.capacity)
    assert grown > small
    assert pol.gate._ghosts[0].bits == pol.gate._ghosts[1].bits == grown
    assert all(g is None or g.bits == grown for g in pol.split._ghosts + pol.inner._ghosts)


def test_ghosts_of_blocks_that_left_hbm_outlive_a_doubling_of_the_table(monkeypatch):
    """HBM sends blocks down to a DRAM tier that is still filling: the table doubles (1024 rows, then
    2048, 4096) while HBM's ghosts speak. Each learner's ghost tables grow holding as many ghosts
    (which ones: test_hot_paths); before, each doubling made them anew, empty."""
    from dflash2.policy.gate import AdmissionGate
    from dflash2.policy.split import AdaptiveSplit

    def ghosts(tables):
        return [None if g is None else g.ghosts() for g in tables]

    seen = []
    for cls in (AdaptiveSplit, AdmissionGate):
        def grow(self, rows, _grow=cls.grow):
            before = ghosts(self._ghosts)
            _grow(self, rows)
            seen.append((before, ghosts(self._ghosts)))
        monkeypatch.setattr(cls, "grow", grow)
    mgr, lid, c = manager(256, dram_blocks=8192)
    for k in range(1, 6001, 200):
        cache_chain(mgr, lid, c, list(range(k, k + 200)))
    assert mgr.table.cols.capacity >= 4096
    held = [(before, after) for before, after in seen if any(before)]
    assert held, "no learner held ghosts when the table grew"
    for before, after in held:
        assert after == before
    mgr.check_invariants()


def test_fanout_and_sharing_raise_heat():
    mgr, lid, c = manager(64)
    mgr.policy.set_weights({"fanout": 0.5})  # 0 by default (README, Policies)
    root = cache_chain(mgr, lid, c, [1])
    lone = cache_chain(mgr, lid, c, [2])
    for k in (10, 11, 12):
        cache_chain(mgr, lid, c, [k], parent=int(root[0]))
    s = mgr.policy.scores(mgr.table, mgr.table.rows([root[0], lone[0]]), 0.0)
    assert s[0] > s[1]
    mgr.add_ref(c, lone)
    s2 = mgr.policy.scores(mgr.table, mgr.table.rows([lone[0]]), 0.0)
    assert s2[0] > s[1]


def test_the_stage_weight_ranks_a_block_a_request_holds_over_one_every_request_let_go_of():
    """The stage term (decoding > finished) read a column no call ever set: its weight changed
    nothing (a review's script: a weight of 10^6 left the drain's choice as it was). A block a
    request holds, referenced (its writer's, add_ref) or pinned (acquire), is one it decodes from."""
    mgr, lid, c = manager(64)
    mgr.policy.set_weights({"sharing": 0.0, "stage": 0.0})
    held = mgr.commit(c, mgr.allocate(c, lid, 1), [1])  # its writer still holds it
    pinned = cache_chain(mgr, lid, c, [2])
    mgr.acquire(c, pinned)
    done = cache_chain(mgr, lid, c, [3])  # every request let go of it
    rows = mgr.table.rows([held[0], pinned[0], done[0]])
    before = mgr.policy.scores(mgr.table, rows, 0.0)
    mgr.policy.set_weights({"stage": 5.0})
    after = mgr.policy.scores(mgr.table, rows, 0.0)
    assert (after - before).tolist() == pytest.approx([5.0, 5.0, 0.0], abs=1e-3)  # (float32 scores)


def test_sketch_counts_and_ages():
    sk = FrequencySketch(width=1 << 10, sample_factor=1)
    keys = np.array([7, 7, 7, 9], dtype=np.uint64)
    sk.add(keys)
    est = sk.estimate(np.array([7, 9, 11], dtype=np.uint64))
    assert est.tolist() == [3, 1, 0]
    sk.add(np.arange(100, 100 + 1100, dtype=np.uint64))  # past the sample size: all counters halve
    assert sk.estimate(np.array([7], dtype=np.uint64))[0] <= 1


def test_a_sketch_grows_keeping_every_estimate():
    """Widening splits each counter into neighbours that start from its count: no key's estimate
    changes (a count-min sketch never undercounts), and later additions land on the wider rows."""
    rng = np.random.default_rng(0)
    sk = FrequencySketch(width=1 << 10, sample_factor=1000, max_width=1 << 13)
    where = sk.table.__array_interface__["data"][0]
    keys = rng.integers(1, 2**63, 3000, dtype=np.int64).astype(np.uint64)
    for batch in np.array_split(np.concatenate([keys, keys[:500], keys[:100]]), 7):
        sk.add(batch)
    probe = np.concatenate([keys[:800], rng.integers(1, 2**63, 500, dtype=np.int64).astype(np.uint64)])
    before = sk.estimate(probe)
    old_table = sk.table.copy()
    sk.grow(1 << 13)
    assert np.array_equal(sk.table, np.repeat(old_table, 8, axis=1))  # each counter split into eight
    assert sk.table.__array_interface__["data"][0] == where  # widened in its reservation, no copy
    assert sk.mapped_bytes == sk.table.nbytes == sk.depth << 13
    beyond = FrequencySketch(width=1 << 10, sample_factor=1000)  # reserved for its first width only
    beyond.add(keys)
    first = beyond.table.copy()
    beyond.grow(1 << 12)  # copied, then widened
    assert np.array_equal(beyond.table, np.repeat(first, 4, axis=1))
    assert sk.width == 1 << 13 and sk.table.shape == (sk.depth, 1 << 13) and sk.sample == 1000 << 13
    assert sk.estimate(probe).tolist() == before.tolist()
    sk.add(keys[:10])
    assert (sk.estimate(keys[:10]) == np.minimum(before[:10] + 1, 15)).all()
    with pytest.raises(ValueError, match="power of two"):
        sk.grow(3 << 13)


def test_a_sketch_whose_reservation_is_refused_takes_only_the_counters_it_uses(monkeypatch, caplog):
    """Where the system refuses the mapping, the sketch takes plain memory for its width in use (not
    for its largest width: 64 MiB committed where a mapping was just refused), says so, and still
    widens keeping every estimate (a copy each time)."""
    import dflash2.table.rowspace as R

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(R, "reserve", refuse)  # (rowspace's reserve_or_plain falls back)
    sk = FrequencySketch(width=1 << 10, max_width=1 << 16)
    assert "refused a reservation of 262144 counters" in caplog.text and sk.mapped_bytes == 0
    assert sk._cells_buf.nbytes == sk.depth << 10
    keys = np.arange(1, 2000, dtype=np.uint64)
    sk.add(keys)
    before = sk.estimate(keys)
    sk.grow(1 << 12)
    assert sk._cells_buf.nbytes == sk.depth << 12 and sk.estimate(keys).tolist() == before.tolist()


def test_the_sketch_widens_with_the_table_so_new_keys_read_as_new():
    """At its first width (2**18) a table of half a million rows had 56% of never-seen keys read as
    seen before (class 1, the split's returning list: SPLIT_BONUS above their chain's first-timer
    neighbours, which then wait for them to leave a draining tier). The sketch keeps at least two
    counters a row per table row, so that most new keys read as new."""
    from dflash2.policy.heat import SKETCH_PER_ROW

    n = 1 << 18
    B = 1024
    layout = Layout("tiny", num_layers=1, num_kv_heads=1, head_dim=128, dtype="fp16", tokens_per_block=2)
    assert layout.block_bytes == B
    mgr = BlockManager([TierSpec(Tier.HBM, n * B, B, 256)], policy="heat")
    c, lid = mgr.attach("w"), mgr.register_layout(layout)
    rng = np.random.default_rng(0)  # content keys are hashes (client.chain_keys)
    keys = rng.integers(1, 2**63, n + 20000, dtype=np.int64).astype(np.uint64)
    for first in range(0, n, 8192):
        vids = mgr.allocate(c, lid, 8192)
        mgr.free(c, mgr.commit(c, vids, keys[first:first + 8192]))
    sketch = mgr.policy.sketch
    assert sketch.width >= SKETCH_PER_ROW * mgr.table.cols.capacity >= SKETCH_PER_ROW * n
    assert np.mean(sketch.estimate(keys[n:]) >= 1) < 0.05
    mgr.close()


def test_heats_per_row_state_grows_with_the_table_without_a_copy():
    """Heat's per-row arrays lie in memory reserved with the table's (rowspace.py): the table's
    doubling leaves them where they are, every row's state kept (their copy was 35 ms of a 256 ms
    doubling at a million rows)."""
    B = 1024
    layout = Layout("tiny", num_layers=1, num_kv_heads=1, head_dim=128, dtype="fp16", tokens_per_block=2)
    mgr = BlockManager([TierSpec(Tier.HBM, 8192 * B, B, 256)], policy="heat")
    c, lid = mgr.attach("w"), mgr.register_layout(layout)
    first = mgr.commit(c, mgr.allocate(c, lid, 1000), np.arange(1, 1001, dtype=np.uint64))
    heat = mgr.policy
    rows = mgr.table.rows(first)
    where, last = heat._last.__array_interface__["data"][0], heat._last[rows].copy()
    assert mgr.table.cols.capacity == 1024 and len(heat._last) == 1024
    mgr.commit(c, mgr.allocate(c, lid, 5000), np.arange(2001, 7001, dtype=np.uint64))
    assert mgr.table.cols.capacity == 8192 and len(heat._last) == 8192
    assert heat._last.__array_interface__["data"][0] == where
    assert heat._last[rows].tolist() == last.tolist()
    assert (heat._code[mgr.table.cols.state == 0] == -1).all()  # free rows are not counted in a list
    mgr.check_invariants()
    mgr.close()


def test_frequency_admission_compares_newcomers_with_the_blocks_they_push_out():
    sk = FrequencySketch(width=1 << 10)
    f = FrequencyAdmission(sk)
    sk.add(np.array([1, 1, 1, 2, 5, 5, 6], dtype=np.uint64))  # 1: 3 refs, 2: 1, 3: 0; victims 5: 2, 6: 1
    cand, victims = np.array([1, 2, 3], dtype=np.uint64), np.array([5, 6], dtype=np.uint64)
    # the two most frequent candidates meet the two weakest victims: 1 (3) beats 6 (1), 2 (1) loses
    # to 5 (2); candidate 3 is beyond the victims (the tier had room for it)
    assert f.admit(cand, victims).tolist() == [True, False, True]
    assert f.admit(cand, victims[:0]).all()
    # victim 5 idle too long for its count to say anything (STALE_TURNOVERS): 2 (1) takes its place
    assert f.admit(cand, victims, stale=np.array([True, False])).tolist() == [True, True, True]


def test_frequency_admission_counts_the_victims_by_bytes():
    """A candidate as large as several victims is compared with every one whose bytes it takes:
    counted a block each, it met the weakest alone."""
    sk = FrequencySketch(width=1 << 10)
    f = FrequencyAdmission(sk)
    sk.add(np.repeat(np.array([1, 2, 5, 6, 7, 8], dtype=np.uint64), [3, 5, 1, 1, 2, 6]))
    cand, victims = np.array([1, 2], dtype=np.uint64), np.array([5, 6, 7, 8], dtype=np.uint64)
    # 2 (5 refs, one unit) takes 5 (1); 1 (3 refs, four units) takes 6, 7 and 8, and 8 has 6 refs
    assert f.admit(cand, victims, np.array([4, 1]), np.ones(4, dtype=np.int64)).tolist() == [False, True]
    # past the victims' bytes a candidate has room (1 takes 8's two units and no more)
    assert f.admit(cand, victims[:1], np.array([4, 1]), np.array([2])).tolist() == [True, True]
    # equal sizes: the rule counted in blocks
    same = np.ones(4, dtype=np.int64)
    assert f.admit(cand, victims, same[:2], same).tolist() == f.admit(cand, victims).tolist() == [True, True]


def test_a_large_block_is_refused_where_it_would_push_out_many_hotter_blocks():
    """The full last tier holds 16 blocks of 16 KiB, all but one asked for six times; a 64 KiB block
    asked for once would push out four of them. Compared with one victim (the weakest, asked for
    once as it was) it got in and the tier lost three popular blocks; now it is compared with all
    four and dropped, and the tier keeps its blocks. A 64 KiB block asked for as often gets in."""
    page = 64 << 10
    big = Layout("big", num_layers=4, num_kv_heads=1, head_dim=64, dtype="fp16", tokens_per_block=64)
    assert big.block_bytes == page
    clock = Clock()
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * page, page, 256), TierSpec(Tier.DRAM, 4 * page, page, 4096)],
                       policy="heat", clock=clock)
    try:
        small, lb = mgr.register_layout(LAYOUT), mgr.register_layout(big)
        c = mgr.attach("c")
        pol = mgr.placement.policy
        for k in range(100, 116):
            mgr.commit(c, mgr.allocate(c, small, 1, tier=Tier.DRAM), [k])
        mgr.detach(c)
        c = mgr.attach("c")
        pol.sketch.add(np.repeat(np.arange(101, 116, dtype=np.uint64), 5))  # 100: once, the others six times
        once, often = (mgr.commit(c, mgr.allocate(c, lb, 1), [k]) for k in (7, 8))
        pol.sketch.add(np.repeat(np.array([8], dtype=np.uint64), 5))
        assert mgr.table.allocators[Tier.DRAM].free_bytes == 0
        rows = mgr.table.rows(np.concatenate([once, often]))
        assert pol.admit(mgr.table, rows[:1], Tier.DRAM, clock.now).tolist() == [False]
        assert pol.admit(mgr.table, rows[1:], Tier.DRAM, clock.now).tolist() == [True]
        assert pol.admit(mgr.table, rows, Tier.DRAM, clock.now).tolist() == [False, True]
        mgr.free(c, np.concatenate([once, often]))
        mgr.acquire(c, often)  # (HBM's one block that may go: the once-asked one)
        mgr.placement.make_room(Tier.HBM, page)
        assert mgr.lookup([7], lb) == [] and len(mgr.lookup(list(range(100, 116)), small)) == 16
        assert mgr.placement.stats.not_admitted == 1 and mgr.placement.stats.evicted == 1
        mgr.check_invariants()
    finally:
        mgr.close()


def test_heat_refuses_rarely_used_blocks_only_at_the_last_tier():
    """A full DRAM with an NVMe tier below admits a once-used block (what it pushes out moves down);
    the full last tier refuses it when its coldest blocks were asked for more often."""
    specs = [TierSpec(t, 2 * SLOT, SLOT, 256) for t in (Tier.HBM, Tier.DRAM, Tier.NVME)]
    clock = Clock()
    mgr = BlockManager(specs, policy="heat", clock=clock)
    try:
        lid = mgr.register_layout(LAYOUT)
        c = mgr.attach("c")
        pol = mgr.placement.policy
        popular = [cache_chain(mgr, lid, c, [k])[0] for k in (1, 2, 3, 4)]
        pol.sketch.add(np.array([1, 2, 3, 4] * 5, dtype=np.uint64))  # asked for often
        mgr.mover.move(mgr.table.rows(popular[:2]), Tier.NVME)
        mgr.mover.move(mgr.table.rows(popular[2:]), Tier.DRAM)  # DRAM and NVMe full
        new = cache_chain(mgr, lid, c, [50])  # once-used, in HBM
        rows = mgr.table.rows(new)
        assert pol.admit(mgr.table, rows, Tier.DRAM, clock.now).tolist() == [True]
        assert pol.admit(mgr.table, rows, Tier.NVME, clock.now).tolist() == [False]
        mgr.check_invariants()
    finally:
        mgr.close()


def test_victims_are_the_lowest_blocks_of_the_tier_not_the_lowest_leaves():
    # A cold chain of 3 and a hot single block; room for 3 more. Only two are leaves (the chain's
    # tail and the hot block): taking the 3 lowest *leaves* would take the hot one. The cold chain
    # leaves instead, tail first over several rounds, and the hot block stays.
    mgr, lid, c = manager(4, policy="lru")
    clock = mgr.table.clock
    clock.now = 1.0
    cold = cache_chain(mgr, lid, c, [1, 2, 3])
    clock.now = 2.0
    hot = cache_chain(mgr, lid, c, [9])
    mgr.table.cols.last_access[mgr.table.rows(cold)] = [0.1, 0.2, 0.3]
    clock.now = 3.0
    cache_chain(mgr, lid, c, [20, 21, 22])
    assert [p.vid for p in mgr.lookup([9])] == [int(hot[0])]
    assert mgr.lookup([1]) == []
    mgr.check_invariants()


def workload_hot_prefix_and_scan(n=400, prefix=8, scan=20, every=6):
    """Every `every`-th request reads a shared prefix (a system prompt plus a short question);
    the others are scans of blocks never seen again."""
    reqs, nxt = [], 1000
    for i in range(n):
        if i % every == 0:
            keys = tuple(range(1, prefix + 1)) + (nxt,)
            nxt += 1
        else:
            keys = tuple(range(nxt, nxt + scan))
            nxt += scan
        reqs.append(Request(i * 0.05, keys))
    return reqs


def test_heat_beats_lru_on_hot_prefix_with_scans():
    reqs = workload_hot_prefix_and_scan()
    heat = replay(reqs, "heat", hbm_blocks=64)
    lru = replay(reqs, "lru", hbm_blocks=64)
    lfu = replay(reqs, "lfu", hbm_blocks=64)
    # The scans flush LRU and LFU completely; heat keeps part of the prefix (the optimum all of it).
    assert heat["prefix_hit_rate"] > max(lru["prefix_hit_rate"], lfu["prefix_hit_rate"])
    assert heat["prefix_hit_rate"] >= 0.25 * replay(reqs, "belady", hbm_blocks=64)["prefix_hit_rate"]


def test_prefetch_window_doubles_with_room_and_falls_back_under_pressure():
    mgr, lid, c = manager(100, policy="lru", dram_blocks=100)
    pf = Prefetcher(mgr, 2)
    vids = cache_chain(mgr, lid, c, list(range(1, 41)))
    assert mgr.mover.move(mgr.table.rows(vids)[::-1], Tier.DRAM).all()  # all of it down in DRAM
    assert pf.ahead(vids, 0) == 4  # HBM nearly empty: the window doubled (2 -> 4)
    assert pf.ahead(vids, 4) == 8
    pf.reading(vids[:6])
    assert (pf.useful, pf.wasted) == (6, 0)
    pf.finish()
    assert pf.wasted == 6  # promoted, never read
    filler = mgr.allocate(c, lid, 85)  # HBM above its high watermark: back to the configured window
    pf.ahead(vids, 20)
    assert pf.window == 2
    mgr.free(c, filler)
    mgr.check_invariants()


def test_access_counts_halve_every_half_life_on_the_tick():
    from dflash2.policy.heat import HeatPolicy
    mgr, lid, c = manager(4, policy=HeatPolicy(decay_half_life_s=10.0))
    keys = np.array([42], dtype=np.uint64)
    mgr.policy.sketch.add(np.repeat(keys, 8))
    mgr.table.clock.now = 100.0
    mgr.tick()  # starts the half-life clock
    assert mgr.policy.sketch.estimate(keys)[0] == 8
    mgr.table.clock.now = 125.0  # two half-lives later
    mgr.tick()
    assert mgr.policy.sketch.estimate(keys)[0] == 2


def test_counts_still_halve_after_a_pause_of_more_half_lives_than_a_float_counts():
    """A review: the least half-life the config takes (1e-300 s) after a pause made the number of
    half-lives due infinite, the mark with it, and no count was halved again."""
    from dflash2.policy.heat import HeatPolicy
    mgr, lid, c = manager(4, policy=HeatPolicy(decay_half_life_s=1e-300))
    keys = np.array([42], dtype=np.uint64)
    mgr.table.clock.now = 1.0
    mgr.tick()
    mgr.table.clock.now = 1e9  # 1e309 half-lives later
    mgr.tick()
    mgr.policy.sketch.add(np.repeat(keys, 8))
    mgr.table.clock.now = 1e9 + 1.0
    mgr.tick()
    assert mgr.policy.sketch.estimate(keys)[0] == 0


@pytest.mark.parametrize("children", [3, 40])  # fan-out folded into the lookup, and beyond FUSE_FANOUT
def test_full_pass_matches_per_row_scores_with_fanout_weights_and_refits(children):
    from dflash2.policy.heat_score import FUSE_FANOUT

    mgr, lid, c = manager(256)
    pol, table = mgr.policy, mgr.table
    root = cache_chain(mgr, lid, c, [1])
    for k in range(children):
        cache_chain(mgr, lid, c, [100 + k, 1000 + k], parent=root[0])
    assert (table.cols.nkids.max() > FUSE_FANOUT) == (children > FUSE_FANOUT)
    rows = table.live_rows()

    def check():
        full = pol.rescore(table, 0.0)[rows]
        assert np.allclose(full, pol.scores(table, rows, 0.0), rtol=1e-6, atol=1e-5)
        return full

    base = check()
    pol.set_weights({"fanout": 2.0, "frequency": 0.5})
    check()
    # The root's heat follows the fan-out weight in the full pass (not a stale table).
    r = table.rows(root)[0]
    i = int(np.flatnonzero(rows == r)[0])
    assert pol.rescore(table, 0.0)[r] != base[i]
    pol.set_weights({"fanout": 0.0, "frequency": 1.0})
    check()
    # A refit changes the density: the full pass must use the new one.
    pol.set_weights({"fanout": 0.5})
    before = pol.rescore(table, 0.0)[rows].copy()
    pol.model.tier_log_density[:] += 3.0
    pol.model.version += 1
    after = check()
    assert np.allclose(after, before + 3.0, atol=1e-4)


def test_select_takes_the_lowest_scored_leaves_and_keeps_scores_intact():
    mgr, lid, c = manager(64)
    pol, table = mgr.policy, mgr.table
    # Cached children keep a parent above its leaf (with recency alone a chain's parent, stamped
    # with its leaf, would be among the two lowest and leave with it).
    pol.set_weights({"fanout": 0.5})
    chains = [cache_chain(mgr, lid, c, [10 * k + 1, 10 * k + 2]) for k in range(5)]
    for k in (0, 2, 4):  # these chains are read again: hotter
        mgr.acquire(c, chains[k])
        mgr.release(c, chains[k])
    scores = pol.rescore(table, 0.0)
    kept = scores.copy()
    victims = mgr.placement.select(Tier.HBM, 2 * SLOT, evict=True)
    assert np.array_equal(scores, kept)  # the choice works on a copy of the scores
    leaves = [table.rows(ch)[1] for ch in chains]
    assert sorted(victims.tolist()) == sorted(sorted(leaves, key=lambda r: scores[r])[:2])
    assert all(v in [table.rows(chains[k])[1] for k in (1, 3)] for v in victims)


def test_a_lower_tier_ranks_by_its_own_lifetimes():
    """Reuses are the same for every tier; the lives never reused end where each tier lets blocks
    go. A tier that lets blocks go young wastes less space on them, so its density at young ages is
    higher than the whole cache's, whose blocks linger until they are dropped much older."""
    from dflash2.policy.density import HitDensityModel, age_bin
    model = HitDensityModel(tiers=3, period=1 << 20)
    keys = np.arange(1, 2001, dtype=np.uint64)
    cls = np.zeros(len(keys), dtype=np.int64)
    model.observe(keys, cls, 0.0)
    model.observe(keys[:500], cls[:500], 100.0)  # a quarter come back at age 100, the rest never
    model.left_tier(1, cls[:1500], np.full(1500, 50.0))  # DRAM lets blocks go at age 50
    model.evicted(cls[:1500], np.full(1500, 5000.0))  # the whole cache drops them at 5000
    model.fit()
    young = age_bin(np.array([10.0]))[0]
    assert model.tier_log_density[1, 0, young] > model.log_density[0, young]
    assert (model.tier_log_density[0] == model.log_density).all(), "HBM keeps the whole cache's ends"
    assert (model.tier_log_density[2] == model.log_density).all(), "no block left NVMe yet: the cache's"


def test_blocks_demoted_from_a_tier_teach_that_tiers_density_only():
    specs = [TierSpec(t, 4 * SLOT, SLOT, 256) for t in (Tier.HBM, Tier.DRAM, Tier.NVME)]
    mgr = BlockManager(specs, policy="heat", clock=Clock())
    try:
        lid = mgr.register_layout(LAYOUT)
        c = mgr.attach("c")
        pol = mgr.placement.policy
        vids = [cache_chain(mgr, lid, c, [k])[0] for k in range(1, 5)]
        rows = mgr.table.rows(vids)
        assert mgr.placement.mover.move(rows, Tier.DRAM).all()
        pol.on_insert(mgr.table, rows, 0.0)  # as placement reports a demotion
        assert pol.model.tier_exits[1].sum() == 0, "nothing left DRAM yet"
        assert pol.model.tier_exits[0].sum() == 0, "HBM's exits are not counted (it ranks by the cache's)"
        assert mgr.placement.mover.move(rows, Tier.NVME).all()
        pol.on_insert(mgr.table, rows, 0.0)
        assert pol.model.tier_exits[1].sum() == 4
        assert (pol._tier[rows] == int(Tier.NVME)).all()
        mgr.check_invariants()
    finally:
        mgr.close()


def test_blocks_below_hbm_lose_heat_with_age_faster_by_recency_below():
    clock = Clock()
    mgr, lid, c = manager(64, dram_blocks=4, clock=clock)
    try:
        pol = mgr.placement.policy
        up, down = (cache_chain(mgr, lid, c, [k])[0] for k in (1, 2))
        rows = mgr.table.rows([up, down])
        assert mgr.mover.move(rows[1:], Tier.DRAM).all()
        pol.on_insert(mgr.table, rows[1:], clock.now)  # as placement reports the demotion
        pol.on_access(mgr.table, np.asarray(rows), clock.now)  # same age, same class
        for _ in range(50):  # both age alike
            cache_chain(mgr, lid, c, [1000 + _])
        gap = lambda: float(np.diff(pol.rescore(mgr.table, clock.now)[rows])[0])  # noqa: E731
        pol.set_weights({"recency_below": 0.0})
        same = gap()
        pol.set_weights({"recency_below": 1.0})
        assert gap() < same, "the block below HBM is colder by the extra recency"
        assert [p.tier for p in mgr.places_of_rows(rows)] == [Tier.HBM, Tier.DRAM]
        assert mgr.stats()["policy"]["weights"]["recency_below"] == 1.0
        mgr.check_invariants()
    finally:
        mgr.close()
