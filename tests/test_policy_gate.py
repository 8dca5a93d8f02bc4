"""The admission gate (policy/gate.py): TinyLFU's rule on while its refusals gain more than they lose."""

import json

import numpy as np

from dflash2.policy.gate import AGAINST, DOOMED, NONE, SPARED, AdmissionGate

from test_policy_heat import cache_chain, manager


def keys(*k):
    return np.array(k, dtype=np.uint64)


def rows(*r):
    return np.array(r, dtype=np.int64)


def test_refusals_mark_the_spared_blocks_and_remember_the_refused_keys():
    g = AdmissionGate(64)
    assert g.on
    admitted = g.decide(rows(1, 2), keys(101, 102), np.array([True, False]), rows(10, 11, 12), capacity=8)
    assert admitted.tolist() == [True, False]
    # One refusal: the best-scored of the blocks it would have pushed out keeps its place.
    assert g.mark[10] == SPARED and g.mark[11] == NONE and g.counts["refused"] == 1
    g.read(rows(10))  # the spared block is read: a hit the refusal won
    assert g.gained == 1 and g.mark[10] == NONE
    g.read(rows(10))  # counted once
    assert g.gained == 1
    g.written(keys(102))  # the refused key is recomputed soon after: a hit the refusal lost
    assert g.lost == 1
    g.written(keys(102))  # a ghost speaks once
    assert g.lost == 1 and g.on  # 1 >= 1: still on


def test_the_rule_goes_off_when_refusals_lose_and_is_measured_while_off():
    g = AdmissionGate(64)
    g.decide(rows(1, 2), keys(101, 102), np.array([False, False]), rows(10, 11), capacity=8)
    g.written(keys(101, 102))
    assert g.lost == 2 and not g.on
    # Off: every block is admitted, and the rule's verdicts are kept as marks.
    admitted = g.decide(rows(3, 4), keys(103, 104), np.array([False, True]), rows(12, 13), capacity=8)
    assert admitted.tolist() == [True, True] and g.counts["admitted_against_rule"] == 1
    assert g.mark[3] == AGAINST and g.mark[12] == DOOMED and g.mark[4] == NONE
    g.read(rows(3))  # a block the rule would have refused is read: refusing would have lost it
    assert g.lost == 3
    # The block pushed out instead of being spared leaves, and comes back soon: a refusal's gain.
    g.left(rows(12), keys(112))
    g.written(keys(112))
    assert g.gained == 1 and g.lost == 3 and not g.on
    # More such gains turn the rule back on.
    for i in range(8):
        if g.on:
            break
        g.decide(rows(5), keys(105), np.array([False]), rows(14), capacity=64)
        g.left(rows(14), keys(200 + i))
        g.written(keys(200 + i))
    assert g.on and g.gained >= g.lost


def test_a_ghost_older_than_the_tier_says_nothing_and_counts_decay():
    g = AdmissionGate(64)
    g.decide(rows(1), keys(101), np.array([False]), rows(10), capacity=4)
    g.read(rows(10))
    assert g.gained == 1
    g.left(rows(20, 21, 22, 23, 24), keys(1, 2, 3, 4, 5))  # five departures from a tier of four
    assert g.gained == 0.5  # halved once the tier's capacity left
    g.written(keys(101))
    assert g.lost == 0 and g.on


def test_marks_clear_when_rows_leave_another_way_and_grow_with_the_table():
    g = AdmissionGate(4)
    g.decide(rows(1), keys(101), np.array([False]), rows(2), capacity=4)
    g.clear(rows(2))
    g.read(rows(2))
    assert g.gained == 0
    g.grow(16)
    assert len(g.mark) == 16 and g.mark[2] == NONE
    assert json.loads(json.dumps(g.describe()))["refused"] == 1


def test_heat_admits_what_the_rule_refuses_once_refusals_lost():
    # HBM 2, DRAM (the last tier) 2. Keys read twice fill DRAM; once-used blocks demoted into it
    # are refused (TinyLFU: asked for less often than the blocks they would push out), and each
    # is asked for again at once: the refusals lose, and the rule goes off.
    mgr, lid, c = manager(2, dram_blocks=2)
    clock = mgr.table.clock
    pol = mgr.policy

    def read(k):
        vids = [p.vid for p in mgr.lookup([k], lid)]
        assert mgr.acquire(c, vids) is not None
        mgr.release(c, vids)

    for k in (1, 2, 3, 4):
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
        read(k)
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
    assert pol.gate.counts["refused"] >= 1 and pol.gate.counts["lost"] >= 1
    assert not pol.gate.on
    before = mgr.placement.stats.not_admitted
    for k in range(100, 104):
        clock.now += 1.0
        cache_chain(mgr, lid, c, [k])
    assert mgr.placement.stats.not_admitted == before  # every block admitted now
    assert pol.gate.counts["admitted_against_rule"] >= 1
    assert mgr.stats()["policy"]["admission"]["rule_on"] is False
    mgr.check_invariants()
