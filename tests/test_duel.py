"""The duel (dflash2/duel.py): heat ranks as the best of heat, LRU and LFU in miniature replays."""

import logging
import random

import numpy as np
import pytest

import dflash2.duel as D
from dflash2.bench.policy import LAYOUT, SLOT, replay
from dflash2.cli import main
from dflash2.config import parse_config
from dflash2.duel import Duel
from dflash2.keysample import SMALL_LOOKUP, sampled
from dflash2.manager import BlockManager, TierSpec
from dflash2.policy import make_policy
from dflash2.replay import Request
from dflash2.tiers import Tier
from duel_helpers import manager


def chat(n: int, live: int = 24, seed: int = 3) -> list[Request]:
    """Live sessions that re-read their whole history each turn and add 2-6 blocks (the README's
    chat shape, smaller): LRU finds more than heat's split here, which sends a session's newest
    turn (first-timers) out before its older returning blocks."""
    rng = np.random.default_rng(seed)
    nid = [1000]

    def fresh(k):
        nid[0] += k
        return tuple(range(nid[0] - k, nid[0]))

    system, sessions, out = fresh(4), [], []
    while len(out) < n:
        while len(sessions) < live:
            sessions.append([system + fresh(int(rng.integers(2, 7))), int(rng.integers(2, 13))])
        i = int(rng.integers(len(sessions)))
        out.append(Request(len(out) * 0.05, sessions[i][0]))
        sessions[i][0] += fresh(int(rng.integers(2, 7)))
        sessions[i][1] -= 1
        if sessions[i][1] == 0:
            sessions.pop(i)
    return out


def scans(n: int, seed: int = 3) -> list[Request]:
    """30 hot 8-block prefixes, and a one-time 40-block prompt every third request: heat's
    second-hit split keeps the hot set where LRU lets the scans flush it."""
    rng = np.random.default_rng(seed)
    hot = [tuple(range(1000 + 8 * i, 1008 + 8 * i)) for i in range(30)]
    return [Request(i * 0.05, hot[int(rng.integers(30))] if i % 3 else tuple(range(10**6 + 40 * i, 10**6 + 40 * i + 40)))
            for i in range(n)]


def shift(passes: int, seed: int = 1) -> list[Request]:
    """A popularity shift: 100 old 5-block prefixes read 15 times each, then passes over 120 new
    ones (a review's shape). Heat's counts keep the old blocks; LRU lets them go."""
    rng = random.Random(seed)
    old = [tuple(1 + 5 * i + j for j in range(5)) for i in range(100)]
    new = [tuple(501 + 5 * i + j for j in range(5)) for i in range(120)]
    reqs = [p for p in old for _ in range(15)]
    rng.shuffle(reqs)
    return [Request(i * 0.1, p) for i, p in enumerate(reqs + new * passes)]


CONFIG = {"enable": True, "device": {"kind": "host"},
          "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 64, "dram_capacity_mb": 0, "nvme_capacity_mb": 0},
          "kv_block": {"block_size": 16},
          "layouts": {"small": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16"}}}


def test_the_sample_is_a_fixed_fraction_of_keys_chosen_by_key():
    keys = np.arange(1, 200_001, dtype=np.uint64)
    picked = sampled(keys, 8)
    assert 0.115 < len(picked) / len(keys) < 0.135  # 1 in 8, from consecutive keys (low bits alone would be exact)
    assert np.array_equal(sampled(picked, 8), picked)  # a key sampled once is sampled in every chain naming it
    assert len(np.intersect1d(picked, sampled(keys, 16))) < len(picked)


def test_heat_follows_lru_where_lru_finds_more():
    trace = chat(1500)
    alone = replay(trace, "heat", 200, duel_sample=0)
    lru = replay(trace, "lru", 200)
    duel = replay(trace, "heat", 200, duel_sample=2)
    assert lru["prefix_hit_rate"] > alone["prefix_hit_rate"] * 1.02  # the shape does what it is for
    d = duel["duel"]
    assert d["following"] == "lru" and d["switches"] >= 1 and d["state"] == "judging"
    assert d["hit_rate"]["lru"] > d["hit_rate"]["heat"]
    # Following LRU, the real cache finds close to what LRU finds, well above heat alone.
    assert duel["prefix_hit_rate"] > alone["prefix_hit_rate"] * 1.02
    assert duel["prefix_hit_rate"] > lru["prefix_hit_rate"] * 0.98
    assert d["requests"] > 1000 and d["queued"] == 0 and d["dropped"] == 0


def test_heat_stays_heat_where_it_leads():
    trace = scans(1500)
    alone = replay(trace, "heat", 200, duel_sample=0)
    duel = replay(trace, "heat", 200, duel_sample=2)
    d = duel["duel"]
    assert d["following"] == "heat" and d["switches"] == 0 and d["state"] == "judging"
    assert d["hit_rate"]["heat"] > d["hit_rate"]["lru"]
    assert duel["prefix_hit_rate"] == alone["prefix_hit_rate"]  # same blocks kept, to the last one


def test_following_ranks_every_tier_as_the_followed_policy_and_admits_every_block():
    """While heat follows LRU or LFU, every tier's blocks rank in that policy's order and the full
    last tier admits every block, as those policies do. (Ranking HBM alone, heat kept its admission
    below: a popularity shift's old blocks stayed in the last tier, 0.8418 of references found
    against LRU's 0.9511, docs/policy-experiments.md "Following in every tier".)"""
    mgr = manager(4, dram_blocks=4, clock=lambda: 9.0)
    lid = mgr.register_layout(LAYOUT)
    client = mgr.attach("c")
    below = mgr.commit(client, mgr.allocate(client, lid, 4, tier=Tier.DRAM), [1, 2, 3, 4])
    fresh = mgr.commit(client, mgr.allocate(client, lid, 4), [5, 6, 7, 8])
    mgr.free(client, np.concatenate([below, fresh]))
    pol, table, c = mgr.policy, mgr.table, mgr.table.cols
    pol.sketch.add(np.repeat(np.arange(1, 5, dtype=np.uint64), 5))  # DRAM's keys asked for six times
    rows = table.rows(np.concatenate([fresh, below]))
    c.last_access[rows] = 9.0 - np.arange(1, 9)  # ages 1..8 s: a distinct order in both tiers
    c.hits[rows] = np.arange(8)[::-1]
    assert (c.tier[rows] == int(Tier.DRAM)).sum() == 4 and table.allocators[Tier.DRAM].free_bytes == 0
    heat = pol.rescore(table, 9.0)[rows].copy()
    assert pol.admit(table, rows[:1], Tier.DRAM, 9.0).tolist() == [False]  # heat's rule: asked for once
    # (on heat's log scale; these blocks have no priority, references or holders: no terms added)
    lfu = make_policy("lfu").scores(table, rows, 9.0)
    for name, expected in (("lru", -0.2 * np.log2(1.0 + (9.0 - c.last_access[rows]))), ("lfu", np.log2(1.0 + lfu))):
        pol.follow(name)
        for scores in (pol.scores_all(table, 9.0)[rows], pol.scores(table, rows, 9.0)):
            assert np.allclose(scores, expected, rtol=0, atol=1e-3)  # in HBM and in DRAM
        assert pol.admit(table, rows[:1], Tier.DRAM, 9.0).tolist() == [True]
        assert pol.describe()["ranking"] == name
    pol.follow("heat")
    assert np.array_equal(pol.scores_all(table, 9.0)[rows], heat)
    assert pol.admit(table, rows[:1], Tier.DRAM, 9.0).tolist() == [False]
    with pytest.raises(ValueError, match="heat can rank as heat, lru, lfu, not 'belady'"):
        pol.follow("belady")


def test_with_lower_tiers_heat_follows_lru_through_a_popularity_shift():
    """Over HBM 200 / DRAM 400 / NVMe 300 blocks LRU's miniature finds more in some tier and as many
    in HBM: heat follows it in every tier (0.80 of references here against 0.68 without the duel;
    LRU 0.90). Asked for 3% more in HBM as well, as while following ranked HBM alone, the duel kept heat."""
    trace = shift(5)
    alone = replay(trace, "heat", 200, 400, 300, duel_sample=0)
    duel = replay(trace, "heat", 200, 400, 300)
    d = duel["duel"]
    assert d["following"] == "lru" and d["switches"] == 1 and d["state"] == "judging"
    assert duel["prefix_hit_rate"] > alone["prefix_hit_rate"] + 0.1
    # The rule refused blocks before the switch; following LRU every block is admitted since: the
    # bench's admission_gate said rule_on true all the same (a review).
    assert duel["admission_gate"]["refused"] > 0
    assert duel["admission_gate"]["rule_on"] is False and duel["admission_gate"]["following"] == "lru"


def test_status_and_metrics_say_the_admission_rule_is_off_while_following():
    """Following LRU or LFU the last tier admits every block (`admit` does not consult the rule):
    status said "rule on" and dflash2_policy_admission_rule_on was 1 meanwhile (a review)."""
    from dflash2 import metrics
    from dflash2.status import _policy_lines
    mgr = manager(4, dram_blocks=4, clock=lambda: 9.0)
    mgr.register_layout(LAYOUT)
    pol = mgr.policy
    pol.rescore(mgr.table, 9.0)  # (the gate is made with the per-row state)
    assert pol.gate.on and pol.describe()["admission"]["rule_on"] is True
    for name, on in (("lru", 0), ("lfu", 0), ("heat", 1)):
        pol.follow(name)
        st = mgr.stats()
        line = [ln for ln in _policy_lines(st) if ln.startswith("last-tier admission")]
        rule = "on" if on else f"off (heat ranks as {name}: every block admitted)"
        assert line == [f"last-tier admission: rule {rule}; refused 0, admitted against the rule 0"]
        gauge = next(f for f in metrics._policy_families(st) if f.name == "dflash2_policy_admission_rule_on")
        assert [s.value for s in gauge.samples] == [on]


def test_an_lru_ranking_keeps_its_order_on_a_clock_of_days():
    # A daemon's clock is seconds since boot: float32 scores of raw timestamps would tie whole seconds.
    mgr = manager(64, clock=lambda: 9e6)
    lid = mgr.register_layout(LAYOUT)
    client = mgr.attach("c")
    vids = mgr.allocate(client, lid, 4)
    mgr.commit(client, vids, [1, 2, 3, 4])
    mgr.free(client, vids)
    rows = mgr.table.rows(vids)
    mgr.table.cols.last_access[rows] = 9e6 - np.array([0.1, 0.2, 0.3, 0.4])  # the last row is the oldest
    mgr.policy.follow("lru")
    assert list(np.argsort(mgr.policy.rescore(mgr.table, 9e6)[rows], kind="stable")) == [3, 2, 1, 0]


@pytest.mark.parametrize("ranking", ["heat", "lru", "lfu"])
@pytest.mark.parametrize("priority, older_s", [(100, 1), (0, 60)])
def test_following_keeps_heats_priority_and_running_requests_in_hbm(ranking, priority, older_s):
    """A running request's blocks (older, still referenced) and 11 newer idle blocks of priority 0: the
    background drain takes idle ones first whatever HBM's ranking. At priority 100 (followed alone,
    LRU's and LFU's demoted three of the running request's four, and `set_weights` of priority
    changed nothing, a review); at priority 0, written 70 s ago against the idle blocks' 10 s
    (following LRU, whose age counted 1 a doubling against heat's 0.2, it took three of the running
    four: the sharing and stage terms, +2, outweighed 2 doublings of age only, a review)."""
    from conftest import SMALL, FakeClock, specs

    clock = FakeClock()
    m = BlockManager(specs(16, 64), policy="heat", clock=clock, prefetch_window=0)
    lid = m.register_layout(SMALL)
    running, finished = m.attach("running"), m.attach("finished")
    v_run = m.commit(running, m.allocate(running, lid, 4, priority=priority), keys=[1, 2, 3, 4])
    clock.advance(older_s)
    v_done = m.commit(finished, m.allocate(finished, lid, 11), keys=list(range(100, 111)))
    m.free(finished, v_done)
    clock.advance(1 if priority else 10)
    m.policy.follow(ranking)
    m.tick(drain=False, duel=False)
    m.placement.make_room(Tier.HBM, 6 * SMALL.block_bytes, cold_only=True)
    tier = m.table.cols.tier
    assert not (tier[m.table.rows(v_run)] != int(Tier.HBM)).any()
    assert (tier[m.table.rows(v_done)] != int(Tier.HBM)).sum() >= 5
    m.check_invariants()
    m.close()


def test_bad_samples_and_policies_are_refused():
    for bad in (0, 1, -3, 2.5, True):
        with pytest.raises(ValueError, match="duel sample must be an integer >= 2"):
            Duel(manager(64), bad)
    with pytest.raises(ValueError, match="policy 'lru' cannot follow another ranking"):
        Duel(manager(64, "lru"), 8)


def test_a_miniature_too_small_to_judge_turns_the_duel_off(caplog):
    mgr = manager(60)
    duel = Duel(mgr, 4)  # 15 blocks; 30 at the finest sample, 1 in 2
    lid = mgr.register_layout(LAYOUT)
    with caplog.at_level(logging.INFO, logger="dflash2.duel"):
        mgr.lookup(list(range(1, 200)), lid)
        duel.run()
    assert duel.off.startswith("1/4 of HBM holds 15 blocks of layout 'replay', fewer than 32")
    assert "duel off: 1/4 of HBM holds 15 blocks" in caplog.text
    assert duel.describe()["state"] == "off" and mgr.policy.ranking == "heat"
    mgr.lookup(list(range(1, 200)), lid)
    assert duel.describe()["queued"] == 0  # off: nothing more is sampled


@pytest.mark.parametrize("blocks, sample, fitted", [(255, 8, 7), (200, 8, 6), (100, 8, 3), (64, 8, 2), (64, 2, 2),
                                                    (256, 8, 8), (4000, 8, 8)])
def test_a_small_hbm_replays_the_coarsest_sample_that_leaves_enough_blocks(caplog, blocks, sample, fitted):
    """Where 1/`sample` of HBM holds fewer than 32 blocks, the duel replays a finer sample, the coarsest
    that leaves 32 (it stopped: HBM under 256 blocks at the default sample ranked as heat alone, and
    a review's re-read shape found 0.4220 of references at 200 blocks against LRU's 0.4496); said in
    the log, shown as `sample` beside the configured `first_sample`."""
    mgr = manager(blocks)
    duel = Duel(mgr, sample)
    lid = mgr.register_layout(LAYOUT)
    with caplog.at_level(logging.INFO, logger="dflash2.duel"):
        mgr.lookup(list(range(1, 400)), lid)
        duel.run()
    d = duel.describe()
    assert duel.off is None and d["state"] == "warming up" and d["requests"] == 1, d
    assert (d["sample"], d["first_sample"]) == (fitted, sample)
    assert d["capacity_blocks"] == blocks // fitted >= D.MIN_BLOCKS
    assert fitted == sample or blocks // (fitted + 1) < D.MIN_BLOCKS  # the coarsest that leaves enough
    said = f"its miniatures replay 1 in {fitted} keys instead ({blocks // fitted} blocks"
    assert (said in caplog.text) == (fitted != sample), caplog.text
    # Every key sampled was sampled at the fitted sample, with its whole history.
    assert duel.sampled_refs == len(sampled(np.arange(1, 400, dtype=np.uint64), fitted))


def test_a_key_in_a_coarser_sample_is_in_every_finer_one():
    keys = np.arange(1, 100_001, dtype=np.uint64)
    for fine, coarse in ((2, 16), (8, 64), (8, 1024)):
        assert np.isin(sampled(keys, coarse), sampled(keys, fine)).all()


def test_config_turns_the_duel_on_for_heat_only(tmp_path, caplog):
    from dflash2.assemble import build_manager

    base = CONFIG
    cfg = parse_config({**base, "policy": {"name": "heat"}})
    assert cfg.policy.duel_sample == 8
    m = build_manager(cfg, instance=f"duel-{tmp_path.name}")
    try:
        assert m.duel is not None and m.duel.sample == 8
    finally:
        m.close()
    for policy in ({"name": "heat", "duel_sample": 0}, {"name": "lru", "duel_sample": 4}):
        m = build_manager(parse_config({**base, "policy": policy}), instance=f"duel-{tmp_path.name}")
        try:
            assert m.duel is None
        finally:
            m.close()


def test_a_duel_sample_set_for_another_policy_is_warned_of_by_check_too():
    """policy.duel_sample set with lru or lfu was said only in the start-up log, at info, once per
    GPU: `dflash2d --check` said nothing, as it does of policy.weights and decay_half_life_s."""
    from dflash2.config_warnings import config_warnings

    said = config_warnings(parse_config({**CONFIG, "policy": {"name": "lru", "duel_sample": 4}}), mem_total_bytes=0)
    assert said == ["policy.duel_sample is ignored: only the heat policy uses it, and policy.name is 'lru'"], said
    # (unset, off, heat's)
    for policy in ({"name": "lru"}, {"name": "lru", "duel_sample": 0}, {"name": "heat", "duel_sample": 4}):
        said = config_warnings(parse_config({**CONFIG, "policy": policy}), mem_total_bytes=0)
        assert not [w for w in said if "duel_sample" in w], said


def test_config_refuses_a_sample_of_one():
    from dflash2.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config({**CONFIG, "policy": {"duel_sample": 1}})
    assert info.value.key == "policy.duel_sample" and "1 would replay every key at full size" in str(info.value)


def test_bench_option(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i}, "hash_ids": [{i % 5}, {i % 5 + 10}]}}\n' for i in range(40)))
    with pytest.raises(SystemExit) as exc:
        main(["bench", "policy", "--trace", str(trace), "--hbm-blocks", "8", "--duel-sample", "1", "--json"])
    assert exc.value.code == 2 and "1 would replay every key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # bounded as the config's key is
        main(["bench", "policy", "--trace", str(trace), "--hbm-blocks", "8", "--duel-sample", str(2 << 20), "--json"])
    assert exc.value.code == 2 and "at most 1048576 (as policy.duel_sample)" in capsys.readouterr().err



def test_a_probe_lookup_is_answered_but_not_replayed(clock):
    from dflash2 import protocol as P
    from dflash2.daemon.service import Service

    mgr = manager(1024, clock=clock)
    duel = Duel(mgr, 2)
    svc = Service(mgr, lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock)

    def call(args, keys):
        return P.decode_reply(svc.handle_frames(P.encode_request(
            P.Op.LOOKUP, 7, client, args, [np.asarray(keys, dtype=P.KEYS_DTYPE).tobytes()],
            token=svc.sessions[client].token)))

    attach = P.encode_request(P.Op.ATTACH, 1, None, {"name": "c", "pid": 0, "layouts": [LAYOUT.to_dict()]}, [])
    client = P.decode_reply(svc.handle_frames(attach)).result["client"]
    keys = list(range(1, 40))
    assert call({"layout": 0}, keys).ok and duel.describe()["queued"] == 1
    assert call({"layout": 0, "probe": True}, keys).ok and duel.describe()["queued"] == 1
    bad = call({"layout": 0, "probe": "yes"}, keys)
    assert not bad.ok and "lookup: argument 'probe' must be bool, got str" in bad.error_message
    assert duel.describe()["queued"] == 1


@pytest.mark.parametrize("hits, hbm, follows", [
    # (heat, lru, lfu) decayed blocks found in some tier / in HBM, over 1000 sampled references
    ((500, 520, 400), (500, 520, 400), "lru"),  # HBM alone: 4% more
    ((500, 505, 400), (500, 505, 400), "heat"),  # 1%: under the margin
    ((500, 520, 400), (300, 200, 100), "heat"),  # more in some tier, far fewer in HBM: not followed
    ((500, 520, 400), (300, 290, 100), "heat"),  # ...nor with 3.3% fewer in HBM
    ((500, 520, 400), (300, 292, 100), "lru"),  # 2.7% fewer in HBM: followed (a copy, not a recompute)
    ((500, 520, 400), (300, 303, 100), "lru"),
    ((900, 900, 900), (700, 760, 600), "heat"),  # as many found, more in HBM: not followed (the same)
    ((500, 480, 530), (400, 300, 420), "lfu"),
])
def test_the_judgement_wants_more_found_in_some_tier_and_not_fewer_in_hbm(hits, hbm, follows):
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 40)), lid)
    duel.run()  # the miniatures exist
    for mini in duel._minis:
        mini.manager.placement.stats.evicted_bytes = 512 * SLOT  # each has let go as many bytes as it holds
    duel._refs = 1000.0
    duel._hits, duel._hbm_hits = np.array(hits, dtype=float), np.array(hbm, dtype=float)
    duel._sq = np.full((3, 3), 1.0)  # a steady difference: the margin decides
    duel._judge()
    assert duel.describe()["following"] == mgr.policy.ranking == follows
    duel._sq = np.full((3, 3), 1e6)  # the same figures from a noisy difference
    duel.following, duel.switches = 0, 0
    mgr.policy.follow("heat")
    duel._judge()
    assert mgr.policy.ranking == "heat" and duel.switches == 0
    for mini in duel._minis:
        mini.manager.placement.stats.evicted_bytes = 511 * SLOT  # no miniature has turned over yet
    duel._sq = np.full((3, 3), 1.0)
    duel._judge()
    assert mgr.policy.ranking == "heat"


def test_the_duel_judges_once_one_miniature_has_turned_over():
    """A candidate whose miniature keeps what is asked for lets little go: after a popularity shift
    LRU's miniature let the old blocks go and held the new working set, heat's thrashed, and a duel
    that waited for every miniature to turn over never judged (a review: 0.891 against 0.961 in the
    miniatures, heat at full size 0.8711, LRU 0.9511)."""
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 40)), lid)
    duel.run()
    for mini, evicted in zip(duel._minis, (512, 100, 0)):  # heat's turned over, LRU's and LFU's not
        mini.manager.placement.stats.evicted_bytes = evicted * SLOT
    duel._refs = 1000.0
    duel._hits = duel._hbm_hits = np.array((891.0, 961.0, 300.0))
    duel._sq = np.full((3, 3), 1.0)
    assert duel.describe()["state"] == "judging" and duel.describe()["turned_over"] == 1.0
    duel._judge()
    assert mgr.policy.ranking == "lru"


def test_a_few_keys_are_sampled_as_an_array_of_them_would_be():
    """`sampled` hashes a lookup of a few keys as Python ints (the numpy steps cost a tenth of a
    one-key lookup's handling): the same keys must come out as from the array path, whatever the
    keys' bits, the sample and the count."""
    rng = np.random.default_rng(5)
    keys = np.concatenate([rng.integers(0, 2**63, 4000, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                           np.arange(4000, dtype=np.uint64), np.array([0, 2**64 - 1], dtype=np.uint64)])
    for sample in (1, 2, 8, 1000):
        whole = set(sampled(keys, sample).tolist())  # the array path: more keys than SMALL_LOOKUP
        for n in range(SMALL_LOOKUP + 1):
            for start in range(0, len(keys) - n, 97):
                part = keys[start:start + n]
                got = sampled(part, sample)
                assert got.dtype == np.uint64
                assert got.tolist() == [k for k in part.tolist() if k in whole], (sample, n, start)


@pytest.mark.parametrize("sample", [2, 8])
def test_a_duel_too_small_at_the_finest_sample_says_what_hbm_needs(sample):
    """At policy.duel_sample 2 (the finest the config takes) the advice to lower it could not be
    followed (a fresh user on the shipped config), nor at 8 once the duel samples as finely as HBM
    needs: it says how large HBM must be instead (it said to lower the sample, and at 2 that HBM
    needs 64)."""
    mgr = manager(60)
    duel = Duel(mgr, sample)
    lid = mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 200)), lid)
    duel.run()
    assert duel.off is not None and "lower policy.duel_sample" not in duel.off
    assert f"1/{sample} of HBM holds {60 // sample} blocks" in duel.off, duel.off
    assert f"HBM needs {2 * D.MIN_BLOCKS} such blocks for the duel at the finest sample, 1 in 2" in duel.off


def _layout(name, layers, heads, dim):
    from dflash2.layout import Layout
    return Layout(name, num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="fp16", tokens_per_block=16)


def test_a_duel_stopped_for_a_large_first_layout_runs_once_a_small_one_registers():
    """The miniatures are sized by the smallest layout registered when they are first built: a node
    whose first client's layout had 2 MiB blocks (16 in a miniature HBM) stopped the duel, and the
    16 KiB layout that attached later was never replayed until a restart (a review). (HBM of 48 such
    blocks: 24 at the finest sample.)"""
    mib = 1 << 20
    mgr = BlockManager([TierSpec(Tier.HBM, 96 * mib, 2 * mib, 256)], policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, 8)
    big = mgr.register_layout(_layout("big", 32, 8, 128))
    duel.offer(list(range(1, 65)), big)
    duel.run()
    assert duel.off is not None and "layout 'big'" in duel.off
    duel.offer(list(range(1, 65)), big)  # (no layout registered since: still off)
    assert duel.off is not None and duel.describe()["queued"] == 0
    small = mgr.register_layout(_layout("small", 2, 2, 64))
    for r in range(50):
        duel.offer(list(range(10**6 + 64 * r, 10**6 + 64 * r + 64)), small)
        duel.run()
    assert duel.off is None and duel.requests == 50
    assert duel.sample == 8  # fitted again, to the small layout (the big one's 1 in 2 is not kept)
    duel.offer(list(range(1, 65)), big)
    duel.run()
    assert duel.off is None and duel.not_replayed["layout_too_large"] == 1


def test_the_heat_miniature_decays_its_counts_as_the_real_heat():
    """`policy.decay_half_life_s`: the real heat halves its access counts every half-life of wall
    time; its duel miniature was built without it and counted every read for ever, so the duel
    judged a heat that did not run (a review)."""
    from dflash2.policy.heat import HeatPolicy

    mib = 1 << 20
    now = [1000.0]
    real = HeatPolicy(decay_half_life_s=1.0)
    mgr = BlockManager([TierSpec(Tier.HBM, 256 * mib, 2 * mib, 256)], policy=real, clock=lambda: now[0])
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(_layout("small", 2, 2, 64))
    c = mgr.attach("x")
    keys = list(range(1, 65))
    for _ in range(6):  # the same chain, once every 10 half-lives
        now[0] += 10.0
        places = mgr.lookup(keys, lid)
        if places:
            vids = [p.vid for p in places]
            mgr.acquire(c, vids)
            mgr.release(c, vids)
        else:
            mgr.free(c, mgr.commit(c, mgr.allocate(c, lid, len(keys)), keys))
        mgr.tick()
    mini = duel._minis[0].manager.policy
    assert mini.decay_half_life_s == 1.0
    picked = sampled(np.array(keys, dtype=np.uint64), 2)
    assert mini.sketch.estimate(picked).max() <= 1, mini.sketch.estimate(picked)  # (6 before: every read kept)


@pytest.mark.parametrize("hbm_mb, block_kib", [(1, 16), (1, 8), (2, 16), (3, 32)])
def test_the_check_counts_what_the_miniatures_of_a_finer_sample_reserve(tmp_path, hbm_mb, block_kib):
    """Under an address-space limit `--check` and start-up weigh the miniatures' rows (daemon/roomnow.py
    `tables_bytes`) as 3/8 of the table's, a sample of 1 in 8; where HBM is small the duel replays down
    to 1 in 2 (`_fit_sample`) and its miniatures reserve more: with HBM 1 MB and 16 KiB blocks over
    DRAM 64 MB and NVMe 1 GB, 786,432 rows against 418,000 counted, and a daemon started at a limit
    the check said fits exited 6 at its first client's calls (a review)."""
    from dflash2.assemble import tier_specs
    from dflash2.daemon.roomnow import ROW_BYTES, tables_bytes
    from dflash2.layout import Layout
    from dflash2.plan import resolve_plan

    cfg = parse_config({**CONFIG, "device": {"kind": "host"}, "policy": {"name": "heat"},
                        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": hbm_mb, "dram_capacity_mb": 64,
                                   "nvme_capacity_mb": 1024, "nvme_path": str(tmp_path / "n.cache"),
                                   "page_kb": 64}})
    plan = resolve_plan(cfg)
    counted = tables_bytes(plan, "heat", 8) - tables_bytes(plan, "heat", 0)
    mgr = BlockManager(tier_specs(plan), policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, 8)
    heads = block_kib * 1024 // (2 * 2 * 128 * 16)  # (K and V, fp16, head_dim 128, 16 tokens)
    lid = mgr.register_layout(Layout("l", num_layers=1, num_kv_heads=heads, head_dim=128, dtype="fp16",
                                     tokens_per_block=16))
    assert mgr.table.layout(lid).block_bytes == block_kib * 1024
    mgr.lookup(list(range(1, 65)), lid)
    duel.run()
    assert duel.off is None and duel.sample < 8, duel.describe()  # (fitted finer)
    reserved = sum(m.manager.table.cols.reserved for m in duel._minis) * ROW_BYTES
    assert reserved <= counted, (duel.sample, reserved, counted)


@pytest.mark.parametrize("sample, block_kib", [(2, 8), (2, 16), (4, 8)])
def test_the_check_counts_what_the_miniatures_of_a_configured_fine_sample_reserve(tmp_path, sample, block_kib):
    """`tables_bytes` weighed the miniatures' rows as 3/8 of the table's, those of 1 in 8, whatever
    policy.duel_sample said: at 1 in 2 (the finest the config takes) they hold four times as many
    blocks. A review: HBM 16 MB, DRAM and NVMe 1 GB each, 8 KiB blocks at 1 in 2: `--check` under
    ulimit -v said "fits" with about 0.47 GB for the tables, and the miniatures' reservations were
    refused at the first lookup (ENOMEM, then MemoryError: "a miniature replay failed", the duel off)."""
    from dflash2.assemble import tier_specs
    from dflash2.daemon.roomnow import ROW_BYTES, tables_bytes
    from dflash2.layout import Layout
    from dflash2.plan import resolve_plan

    cfg = parse_config({**CONFIG, "device": {"kind": "host"}, "policy": {"name": "heat"},
                        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 16, "dram_capacity_mb": 1024,
                                   "nvme_capacity_mb": 1024, "nvme_path": str(tmp_path / "n.cache"),
                                   "page_kb": 64}})
    plan = resolve_plan(cfg)
    counted = tables_bytes(plan, "heat", sample) - tables_bytes(plan, "heat", 0)
    mgr = BlockManager(tier_specs(plan), policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, sample)
    heads = block_kib * 1024 // (2 * 2 * 128 * 16)  # (K and V, fp16, head_dim 128, 16 tokens)
    lid = mgr.register_layout(Layout("l", num_layers=1, num_kv_heads=heads, head_dim=128, dtype="fp16",
                                     tokens_per_block=16))
    mgr.lookup(list(range(1, 65)), lid)
    duel.run()
    assert duel.off is None and duel.sample == sample, duel.describe()  # (as configured: not fitted)
    reserved = sum(m.manager.table.cols.reserved for m in duel._minis) * ROW_BYTES
    assert reserved <= counted, (sample, reserved, counted)
