"""The admission gate (policy/gate.py): TinyLFU's rule on while the blocks it refuses come back less
often than the blocks the tier lets go."""

import json

import numpy as np
import pytest

from dflash2.policy.gate import AdmissionGate
from dflash2.tiers import Tier

from test_policy_heat import SLOT, cache_chain, manager


def keys(*k):
    return np.array(k, dtype=np.uint64)


def test_on_at_start_and_while_refused_blocks_return_less_often_than_departed_ones():
    g = AdmissionGate(64)
    assert g.on
    admitted = g.decide(keys(101, 102), np.array([True, False]), capacity=8)
    assert admitted.tolist() == [True, False] and g.counts["refused"] == 1
    g.left(keys(1, 2, 3, 4))  # four blocks leave the tier; one of them is asked for again
    g.referenced(keys(2))
    assert g.describe()["departed_return_rate"] == 0.25 and g.on  # no refused block came back
    g.referenced(keys(2))  # a ghost speaks once
    assert g.counts["departed_back"] == 1
    g.referenced(keys(102))  # the refused block comes back: 1 of 1 against 1 of 4
    assert g.describe()["refused_return_rate"] == 1.0 and not g.on


def test_while_off_every_block_is_admitted_and_the_rule_still_measured():
    g = AdmissionGate(64)
    g.decide(keys(101), np.array([False]), capacity=8)
    g.left(keys(1, 2))
    g.referenced(keys(101))
    assert not g.on
    admitted = g.decide(keys(103, 104, 105), np.array([False, True, False]), capacity=8)
    assert admitted.tolist() == [True, True, True] and g.counts["admitted_against_rule"] == 2
    # Departed blocks come back more often than the blocks admitted against the rule: on again.
    g.left(keys(3, 4, 5))
    g.referenced(keys(1, 2, 3, 4, 5))
    assert g.describe()["refused_return_rate"] == round(1 / 3, 4) and g.on


def test_a_ghost_older_than_the_tier_says_nothing_and_counts_decay():
    g = AdmissionGate(64)
    g.decide(keys(101), np.array([False]), capacity=4)
    g.left(keys(1, 2, 3, 4, 5))  # five departures from a tier of four
    g.referenced(keys(101, 1))  # 101 left its window; 1 too (five departures since)
    assert g.counts["refused_back"] == 0 and g.counts["departed_back"] == 0
    assert g.seen.tolist() == [0.5, 2.5]  # halved once the tier's capacity had left
    assert json.loads(json.dumps(g.describe()))["departed"] == 5


def _read(mgr, lid, c, k):
    vids = [p.vid for p in mgr.lookup([k], lid)]
    assert mgr.acquire(c, vids) is not None
    mgr.release(c, vids)


def _warm(reads: int):
    """HBM 2, DRAM (the last tier) 2, heat: keys 1-4 written and each read `reads` times."""
    mgr, lid, c = manager(2, dram_blocks=2)
    for k in (1, 2, 3, 4):
        mgr.table.clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
        for _ in range(reads):
            _read(mgr, lid, c, k)
    return mgr, lid, c


def test_heat_admits_what_the_rule_refuses_once_refused_blocks_come_back_more():
    # HBM 2, DRAM (the last tier) 2. Keys read twice fill DRAM; once-used blocks demoted into it
    # are refused (TinyLFU: asked for less often than the blocks they would push out), and each
    # is asked for again at once, while what leaves the tier never comes back: the rule goes off.
    mgr, lid, c = _warm(reads=1)
    clock = mgr.table.clock
    pol = mgr.policy
    assert mgr.placement.stats.not_admitted == 0 and pol.gate.on
    written = []
    for k in range(50, 80):
        if not pol.gate.on:
            break
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
        written.append(k)
        for gone in [w for w in written if not mgr.lookup([w], lid)]:
            cache_chain(mgr, lid, c, [gone])
    assert pol.gate.counts["refused"] >= 1 and pol.gate.counts["refused_back"] >= 1
    assert not pol.gate.on
    before = mgr.placement.stats.not_admitted
    for k in range(100, 104):
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    assert mgr.placement.stats.not_admitted == before  # every block admitted now
    assert pol.gate.counts["admitted_against_rule"] >= 1
    assert mgr.stats()["policy"]["admission"]["rule_on"] is False
    mgr.check_invariants()


def test_a_refused_block_its_writer_holds_goes_down_counted_as_admitted_against_the_rule():
    """Refused by the rule but held (its writer's), a block goes into the full last tier all the same:
    it was counted a refusal that never happened, in `stats` and the metrics (a review). Now it is
    counted admitted against the rule; an idle one refused the same way is still dropped, refused."""
    mgr, lid, c = _warm(reads=3)
    clock = mgr.table.clock
    clock.now += 1.0
    gate = mgr.policy.gate
    cache_chain(mgr, lid, c, [11])  # idle, used once: refused, dropped
    assert mgr.placement.make_room(Tier.HBM, 2 * SLOT)
    assert not mgr.lookup([11], lid) and mgr.placement.stats.not_admitted == 1
    assert (gate.counts["refused"], gate.counts["admitted_against_rule"]) == (1, 0)
    clock.now += 1.0
    held = mgr.commit(c, mgr.allocate(c, lid, 1), [10])  # committed, still its writer's: refused, goes down
    assert mgr.placement.make_room(Tier.HBM, 2 * SLOT)
    assert mgr.place(int(held[0])).tier == Tier.DRAM and mgr.placement.stats.not_admitted == 1
    assert (gate.counts["refused"], gate.counts["admitted_against_rule"]) == (1, 1)
    assert mgr.stats()["policy"]["admission"]["refused"] == 1
    mgr.check_invariants()


def test_a_refused_held_block_that_finds_no_room_below_is_counted_refused_at_each_try():
    """Counted admitted against the rule as soon as it was chosen to go, a refused held block that
    found no room below (the last tier full of blocks its writer holds) was counted so at every try,
    though it never went in (a review of the mend): now only once it has gone."""
    mgr, lid, c = manager(2, dram_blocks=2)
    clock = mgr.table.clock
    w = mgr.attach("w")
    mgr.commit(w, mgr.allocate(w, lid, 2, tier=Tier.DRAM), [1, 2])  # held by a host-side writer
    for _ in range(4):
        clock.now += 1.0
        for k in (1, 2):
            vids = [p.vid for p in mgr.lookup([k], lid)]
            assert mgr.acquire(c, vids, Tier.DRAM) is not None
            mgr.release(c, vids)
    clock.now += 1.0
    held = mgr.commit(c, mgr.allocate(c, lid, 1), [10])  # committed, still its writer's: refused
    gate = mgr.policy.gate
    for _ in range(3):  # (an allocation's, a step's: each tries again)
        mgr.placement.make_room(Tier.HBM, 2 * SLOT)
    assert mgr.place(int(held[0])).tier == Tier.HBM
    assert (gate.counts["refused"], gate.counts["admitted_against_rule"]) == (3, 0)


def test_rates_within_the_hysteresis_band_change_nothing():
    g = AdmissionGate(4096)
    g.decide(np.arange(1000, 1010, dtype=np.uint64), np.zeros(10, dtype=bool), capacity=4096)
    g.left(np.arange(1, 101, dtype=np.uint64))
    g.referenced(np.arange(1, 11, dtype=np.uint64))  # departed blocks: 10 of 100 came back
    g.referenced(keys(1000))  # refused: 1 of 10, the same rate
    assert g.on
    g.referenced(np.arange(11, 13, dtype=np.uint64))  # departed 12 of 100: refused 0.1, within the band
    assert g.on
    g.referenced(keys(1001))  # refused 2 of 10 against departed 0.12: past the band
    assert not g.on
    g.referenced(np.arange(11, 16, dtype=np.uint64))  # departed blocks: 15 of 100
    assert not g.on  # refused 0.2 against departed 0.15: not 25% under it, the rule stays off
    g.referenced(np.arange(16, 41, dtype=np.uint64))  # departed 40 of 100: refused now 50% under
    assert g.on


def test_departure_numbers_wrap_past_32_bits():
    g = AdmissionGate(64)
    g.decide(keys(5), np.array([False]), capacity=10)
    g.departures = (1 << 32) - 3
    g.left(keys(7))
    g.left(keys(100, 101, 102, 103))  # the count passes 2**32
    g.referenced(keys(7))
    assert g.counts["departed_back"] == 1  # five departures since, within the window of ten


def test_a_refused_held_block_going_down_while_its_call_is_parked_never_counts_backwards(
        config_file, instance_name, monkeypatch):
    """A review: a refused held block going down was counted refused at the decision, and taken back
    (admitted against the rule) once its copy had ended. An allocation parked on those writes to NVMe
    let the daemon answer others and take its /metrics snapshot meanwhile: the counter
    dflash2_policy_admission_blocks_total{outcome="refused"} read 10, then 0 (a counter reset to
    Prometheus, whose rate() then counts the whole total again). Now it is counted when its copy ends."""
    import threading

    from dflash2.assemble import build_manager
    from dflash2.config import load_config
    from dflash2.errors import CopiesRunning
    from dflash2.layout import Layout

    layout = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB
    cfg = load_config(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                          "staging_buffer_size_mb": 1},
                                  kv_block={"block_size": 16, "prefetch_window": 0},
                                  policy={"name": "heat", "cold_threshold": 0.5, "swap_batch_size": 64}))
    m = build_manager(cfg, instance=instance_name)
    try:
        r, lid = m.attach("reader"), m.register_layout(layout)
        blocks = {t: s.capacity_bytes // layout.block_bytes for t, s in m.specs.items()}
        for k in range(1, blocks[Tier.NVME] + 1):  # NVMe full of blocks read often
            v = m.commit(r, m.allocate(r, lid, 1), keys=[k])
            m.free(r, v)
            for _ in range(4):
                vids = [p.vid for p in m.lookup([k], lid)]
                m.add_ref(r, vids)
                assert m.acquire(r, vids) is not None
                m.release(r, vids)
                m.free(r, vids)
            assert m.mover.move(m.table.rows([int(v[0])]), Tier.NVME).all()
        w = m.attach("writer")  # DRAM full of blocks their writer holds, read once; HBM full of idle ones
        held = m.commit(w, m.allocate(w, lid, blocks[Tier.DRAM]), keys=list(range(10**5, 10**5 + blocks[Tier.DRAM])))
        assert m.mover.move(m.table.rows([int(x) for x in held]), Tier.DRAM).all()
        m.free(w, m.commit(w, m.allocate(w, lid, blocks[Tier.HBM]), keys=list(range(2 * 10**5, 2 * 10**5 + blocks[Tier.HBM]))))
        nvme, go = m.arenas[Tier.NVME], threading.Event()
        write = nvme.write_blocks

        def held_write(offsets, buffers):
            assert go.wait(30)
            return write(offsets, buffers)
        monkeypatch.setattr(nvme, "write_blocks", held_write)
        m.placement.read_later = True  # as while the daemon serves
        m.placement.parking, m.placement.own_parks = True, 0
        gate = m.policy.gate
        with pytest.raises(CopiesRunning):  # parked on its room's writes to NVMe
            m.allocate(w, lid, 4)
        meanwhile = (gate.counts["refused"], gate.counts["admitted_against_rule"])  # a snapshot taken now
        go.set()
        m.placement.parking = False
        m.placement.settle()
        after = (gate.counts["refused"], gate.counts["admitted_against_rule"])
        assert after[1] > 0, "no refused held block went down"
        assert after[0] >= meanwhile[0] and after[1] >= meanwhile[1], (meanwhile, after)
        m.check_invariants()
    finally:
        m.placement.read_later = False
        m.close()
