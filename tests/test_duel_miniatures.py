"""The duel's miniatures and its queue of lookups (dflash2/duel.py): what is replayed, what is
skipped and counted, how the miniatures are sized, cut and turned over, and the loop's budget."""

import logging

import numpy as np
import pytest

import dflash2.duel as D
from dflash2.bench.policy import ALIGN, LAYOUT, SLOT
from dflash2.duel import Duel
from dflash2.keysample import sampled
from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier
from duel_helpers import manager


def queued_lookups(monkeypatch, bound: str, value: int, width: int) -> Duel:
    """A duel (1 key in 2) whose queue bound `bound` is `value`, after 12 lookups of `width` keys."""
    monkeypatch.setattr(D, bound, value)
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    for i in range(12):
        mgr.lookup(list(range(1000 * i + 1, 1000 * i + width)), lid)
    return duel


def test_a_full_queue_drops_its_oldest_lookups_counted_and_logged(caplog, monkeypatch):
    duel = queued_lookups(monkeypatch, "QUEUE_LIMIT", 5, 40)
    assert duel.describe()["queued"] == 5 and duel.dropped == 7
    with caplog.at_level(logging.INFO, logger="dflash2.duel"):
        duel.run(0.0)  # no time this tick: nothing served, the drops are reported
    assert "7 sampled lookups dropped so far (7 since the last report)" in caplog.text
    duel.run()
    assert duel.requests == 5 and duel.describe()["queued"] == 0


def test_the_queue_is_bounded_by_sampled_keys_too(monkeypatch):
    """A lookup may name 65,536 keys: bounded by lookups alone, a queue the tick cannot keep up
    with held 4096 such chains' sampled keys as Python ints (over a GiB). The keys wait as uint64
    arrays, and past QUEUE_KEYS_LIMIT of them the oldest lookups are dropped and counted."""
    duel = queued_lookups(monkeypatch, "QUEUE_KEYS_LIMIT", 250, 200)
    queued = list(duel._queue)
    assert all(isinstance(k, np.ndarray) and k.dtype == np.uint64 for _, _, k in queued)
    assert sum(len(k) for _, _, k in queued) == duel._queued_keys <= 250
    assert duel.dropped == 12 - len(queued) > 0
    duel.run()
    assert duel.requests == len(queued) and duel._queued_keys == 0 and duel.describe()["queued"] == 0


def busy_duel(monkeypatch, hbm_blocks: int, lookups: int, serve_every: int | None) -> tuple[Duel, BlockManager, int]:
    """A duel (1 key in 2) whose loop serves one sampled lookup after every `serve_every` lookups
    of 10 new keys (None: none), with room for 8 waiting and a coarser sample after 40 dropped."""
    monkeypatch.setattr(D, "QUEUE_LIMIT", 8)
    monkeypatch.setattr(D, "COARSEN_AFTER", 40)
    mgr = manager(hbm_blocks)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    for i in range(lookups):
        mgr.lookup(list(range(10 * i + 1, 10 * i + 11)), lid)
        if serve_every and i % serve_every == 0:
            duel.run(at_least_one=True, yield_to=lambda: True)  # one, as a step of a loop never idle
    return duel, mgr, lid


def test_a_duel_the_loop_cannot_keep_up_with_replays_fewer_keys(monkeypatch, caplog):
    """Dropped lookups leave holes in the miniatures' history (a key asked for again looks new);
    once COARSEN_AFTER were dropped, the duel samples fewer keys instead, by the factor the lookups
    offered outnumbered those served, and its miniatures start again at the new size."""
    with caplog.at_level(logging.INFO, logger="dflash2.duel"):
        duel, mgr, lid = busy_duel(monkeypatch, 4096, 60, serve_every=5)
    served, dropped = duel.requests, duel.dropped
    assert duel.coarsened == 1 and duel.sample == 16  # 1 served in about 5 offered: 2 x 8
    assert "served 12 of 60 sampled lookups lately; its miniatures now replay 1 in 16 keys (1 in 2 before)" in caplog.text
    d = duel.describe()
    assert (d["sample"], d["first_sample"], d["coarsened"], d["state"]) == (16, 2, 1, "warming up")
    # What waits is of the new sample only; the miniatures are built again at 1/16 of HBM.
    for i in range(60, 66):
        mgr.lookup(list(range(10 * i + 1, 10 * i + 11)), lid)
    assert duel._queue and all(np.array_equal(sampled(k, 16), k) for _, _, k in duel._queue)
    duel.run()
    assert duel.describe()["capacity_blocks"] == 4096 // 16 and duel.off is None
    assert duel.requests > served and duel.dropped == dropped  # (the queue dropped at the change, counted then)


def test_the_coarsest_sample_leaves_a_miniature_hbm_to_judge_by(monkeypatch):
    """A loop that serves nothing: the sample grows at once, but no further than a miniature HBM of
    MIN_BLOCKS (256 blocks: 1 in 8); past that the oldest lookups are dropped, as before."""
    duel, mgr, lid = busy_duel(monkeypatch, 256, 400, serve_every=None)
    assert duel.sample == 8 and duel.coarsened == 1 and duel.off is None
    assert duel.dropped > 2 * D.COARSEN_AFTER  # dropped past the coarsest sample, not coarser
    duel.run()
    assert duel.off is None and duel.describe()["capacity_blocks"] == 32


def test_a_coarser_sample_keeps_the_ranking_followed(monkeypatch):
    monkeypatch.setattr(D, "QUEUE_LIMIT", 8)
    monkeypatch.setattr(D, "COARSEN_AFTER", 40)
    mgr = manager(4096)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    mgr.policy.follow("lru")  # as if the duel had switched
    duel.following = 1
    for i in range(60):
        mgr.lookup(list(range(10 * i + 1, 10 * i + 11)), lid)
    assert duel.coarsened == 1
    assert mgr.policy.ranking == "lru" and duel.describe()["following"] == "lru"


def test_a_miniature_of_a_small_tier_in_large_pages_is_cut_in_smaller_ones():
    """A 16 MB tier of 2 MiB pages (`dflash2 bench churn`'s HBM) is one page at 1/8 and none at
    1/16: the miniature's pages are halved (down to the alignment) until it holds MIN_PAGES, so
    the duel can grow coarser there. Tiers of many pages keep theirs."""
    mib = 1 << 20
    small = Layout("4k", num_layers=1, num_kv_heads=1, head_dim=64, dtype="fp16", tokens_per_block=16)
    assert small.block_bytes == 4096
    mgr = BlockManager([TierSpec(Tier.HBM, 16 * mib, 2 * mib, ALIGN), TierSpec(Tier.DRAM, 1024 * SLOT, SLOT, ALIGN)],
                       policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, 8)
    hbm, dram = duel._specs(16)
    assert (hbm.capacity_bytes, hbm.page_bytes) == (mib, mib // 8) and dram.page_bytes == SLOT
    assert duel._specs(8)[0].page_bytes == mib // 4 and duel._hbm_blocks(64, small) == mib // 4 // 4096
    # Cut at the alignment: no page smaller than it, and a share under one such page is no tier.
    assert duel._specs(16 * mib // ALIGN)[0].page_bytes == ALIGN
    assert all(s.tier != Tier.HBM for s in duel._specs(32 * mib // ALIGN))
    duel.sample = 64  # a coarser sample's miniatures are built of those pages
    lid = mgr.register_layout(small)
    mgr.lookup(list(range(1, 4000)), lid)
    duel.run()
    assert duel.off is None and duel.describe()["capacity_blocks"] == (mib // 4 + 1024 * SLOT // 64) // 4096


def test_miniatures_of_several_layouts_turn_over_and_forget_by_bytes():
    """Sized in blocks of the first layout looked up (here the small one), the miniatures count a
    lookup of a layout 4 times larger as 4 times the bytes: they have turned over once they let go
    as many bytes as they hold (a quarter as many of the large blocks), and their figures' half-life
    is in bytes referenced. Counted in blocks, a node whose first layout was its smallest never saw
    its miniatures turn over in a 5-minute soak."""
    small = LAYOUT
    large = Layout("4x", num_layers=1, num_kv_heads=4, head_dim=64, dtype="fp16",
                   tokens_per_block=small.tokens_per_block)
    assert large.block_bytes == 4 * small.block_bytes
    mgr = BlockManager([TierSpec(Tier.HBM, 1024 * large.block_bytes, large.block_bytes, ALIGN)],
                       policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, 2)
    s_lid, l_lid = mgr.register_layout(small), mgr.register_layout(large)
    mgr.lookup(list(range(1, 21)), s_lid)
    duel.run()
    capacity = duel.describe()["capacity_blocks"]
    assert capacity == 512 * 4  # 1/2 of HBM, in blocks of the small layout
    # One lookup of the large layout ages the figures by its bytes: 4 units a key.
    refs, keys = duel._refs, sampled(np.arange(10**6, 10**6 + 20, dtype=np.uint64), 2)
    mgr.lookup(list(range(10**6, 10**6 + 20)), l_lid)
    duel.run()
    assert duel._refs == pytest.approx((refs + len(keys)) * 0.5 ** (4 * len(keys) / (D.HALF_LIFE * capacity)))
    # New chains of large blocks, never asked for again: every miniature fills, then lets go.
    held = capacity * small.block_bytes
    key = 2 * 10**6
    turned = 0.0
    while not any(m.manager.placement.stats.evicted_bytes >= held for m in duel._minis):
        d = duel.describe()
        assert d["state"] == "warming up" and turned <= d["turned_over"] < 1  # how far along, never back
        turned = d["turned_over"]
        mgr.lookup(list(range(key, key + 20)), l_lid)
        duel.run()
        key += 20
    assert duel.describe()["state"] == "judging" and duel.describe()["turned_over"] == 1.0
    assert all(m.manager.placement.stats.evicted < capacity for m in duel._minis)  # a quarter as many blocks


def test_heat_miniatures_are_sized_for_the_keys_they_see():
    """Each heat miniature sees 1 in `sample` keys: its sketch and density ghosts are cut by that
    factor (at full size three miniatures held 3 x 18 MiB once enough keys came)."""
    mgr = manager(1024)
    duel = Duel(mgr, 8)
    lid = mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 400)), lid)
    duel.run()
    full = mgr.policy
    heats = [m.manager.policy for m in duel._minis if m.manager.policy.name == "heat"]
    assert heats  # the miniature ranking as heat at least (a loop over none would check nothing)
    for pol in heats:
        assert pol.sketch.width == full.sketch.width // 8
        assert len(pol.model.ghost_key) == len(full.model.ghost_key) // 8


def test_the_managers_tick_serves_the_queue_within_its_budget():
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    for i in range(50):
        mgr.lookup(list(range(100 * i + 1, 100 * i + 40)), lid)
    duel.tick_budget_s = 0.0
    mgr.tick()
    assert duel.requests == 0
    duel.tick_budget_s = 60.0
    mgr.tick()
    assert duel.requests == 50
    assert mgr.stats()["duel"]["sampled_refs"] == duel.sampled_refs > 0


def test_a_lookup_naming_no_layout_among_several_is_not_sampled():
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 40)))  # one layout: it is that one's
    assert duel.describe()["queued"] == 1
    duel.run()
    assert duel.off is None and duel.requests == 1 and duel.sampled_refs > 0
    mgr.lookup(list(range(1, 40)))
    mgr.register_layout(Layout("other", num_layers=1, num_kv_heads=1, head_dim=32, dtype="fp16", tokens_per_block=512))
    mgr.lookup(list(range(1, 40)))
    assert duel.not_replayed["no_layout"] == 1 and duel.describe()["queued"] == 1
    duel.run()
    assert duel.off is None and duel.requests == 2


def test_lookups_the_duel_does_not_replay_are_counted_by_why_logged_and_shown(caplog):
    """A host-side reader's lookup (served without HBM, which the duel ranks) and one naming no
    layout among several are not replayed: counted by why, in the log, `status` and /metrics.
    Before, the second was only counted where nothing showed it, and the first was replayed as
    HBM traffic the node never had."""
    from dflash2.metrics import _duel_families
    from dflash2.status import _duel_line

    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    with caplog.at_level(logging.INFO, logger="dflash2.duel"):
        mgr.lookup_rows(list(range(1, 40)), lid, reader=Tier.DRAM)
        mgr.register_layout(Layout("other", num_layers=1, num_kv_heads=1, head_dim=32, dtype="fp16", tokens_per_block=512))
        mgr.lookup(list(range(1, 40)))
        mgr.lookup(list(range(1, 40)))
    assert duel.describe()["queued"] == 0
    assert duel.not_replayed == {"host_reader": 1, "no_layout": 2, "layout_too_large": 0, "refused": 0}
    said = [r.getMessage() for r in caplog.records]
    assert sum("host-side readers" in m for m in said) == 1 and sum("names no layout" in m for m in said) == 1, said
    assert all(r.levelno == logging.INFO for r in caplog.records if "host-side readers" in r.getMessage())
    d = duel.describe()
    assert "not replayed: 1 by host-side readers, 2 naming no layout among several" in _duel_line(d, "heat")
    family = next(f for f in _duel_families([("0", d)]) if f.name == "dflash2_policy_duel_not_replayed")
    assert {s.labels["kind"]: s.value for s in family.samples}["no_layout"] == 2


def test_a_lookup_a_miniature_refuses_is_skipped_not_the_end_of_the_duel():
    """Key 0 (no key) ends the chain, as the real lookup does; a key the miniatures cached for
    another layout (the node refuses that commit too) skips that lookup, leaving nothing held in
    the miniatures. Before, either turned the duel off until a restart, after a lookup the node
    answered without an error."""
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    a = mgr.register_layout(LAYOUT)
    b = mgr.register_layout(Layout("same-size", num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                                   head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, tokens_per_block=LAYOUT.tokens_per_block))
    keys = [k for k in range(1, 400) if len(sampled(np.array([k], dtype=np.uint64), 2))][:8]
    mgr.lookup([0] + keys, a)  # nothing past key 0
    assert duel.describe()["queued"] == 0
    mgr.lookup(keys, a)
    duel.run()
    assert duel.requests == 1
    mgr.lookup(keys, b)  # the same keys for another layout: the miniatures' commits refuse them
    duel.run()
    assert duel.off is None and duel.not_replayed["refused"] == 1 and duel.requests == 1
    for mini in duel._minis:
        held = mini.manager.table.client(mini.client)
        assert not held.refs and not held.pins, "a refused request leaves nothing held"
        mini.manager.check_invariants()
    mgr.lookup(keys, a)
    duel.run()
    assert duel.requests == 2


def test_whether_the_duel_runs_does_not_follow_which_layout_is_looked_up_first():
    """The miniatures are sized by the smallest layout registered; lookups of a layout too large
    for them are not replayed (counted). Before, a first lookup of the large layout stopped the
    duel for good, and a first lookup of the small one replayed the large one in a miniature of
    a few of its blocks."""
    big = Layout("big", num_layers=LAYOUT.num_layers * 16, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim,
                 dtype=LAYOUT.dtype, tokens_per_block=LAYOUT.tokens_per_block)
    outcomes = []
    for first in ("big", "small"):
        mgr = manager(512)  # 1/4 of it: 128 small blocks, 8 big ones (fewer than MIN_BLOCKS)
        duel = Duel(mgr, 4)
        ids = {"small": mgr.register_layout(LAYOUT), "big": mgr.register_layout(big)}
        order = [first, "small" if first == "big" else "big"]
        for i in range(40):
            mgr.lookup(list(range(1000 * i + 1, 1000 * i + 40)), ids[order[i % 2]])
        duel.run()
        outcomes.append((duel.off, duel.requests, duel.not_replayed["layout_too_large"]))
    assert outcomes[0] == outcomes[1], outcomes
    off, served, too_large = outcomes[0]
    assert off is None and served > 0 and too_large > 0


def test_a_miniature_table_begins_small_on_a_large_node():
    """Sized for every tier at once, a node of 80 GB of HBM and 1 TB of DRAM took 1.1 s and about
    530 MB at its first sampled lookup; the tables begin at MINI_ROWS_LOG2 and grow."""
    slot = 128 * 1024
    mgr = BlockManager([TierSpec(Tier.HBM, 80 << 30, 2 << 20, ALIGN), TierSpec(Tier.DRAM, 1 << 40, 2 << 20, ALIGN)],
                       policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, 8)
    lid = mgr.register_layout(Layout("l", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bf16", tokens_per_block=8))
    assert mgr.table.layout(lid).block_bytes == slot
    mgr.lookup(list(range(1, 40)), lid)
    duel.run()
    assert duel.requests == 1
    assert all(m.manager.table.cols.capacity <= 1 << D.MINI_ROWS_LOG2 for m in duel._minis)


def test_a_failing_miniature_stops_the_duel_and_heat_ranks_as_heat(caplog):
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 40)), lid)
    duel.run()
    mgr.policy.follow("lru")  # as if the duel had switched
    duel.following = 1

    def broken(*args):
        raise RuntimeError("boom")

    duel._minis[2].serve = broken
    mgr.lookup(list(range(1, 40)), lid)
    with caplog.at_level(logging.ERROR, logger="dflash2.duel"):
        duel.run()
    assert "a miniature replay failed; the duel stops and heat ranks as heat" in caplog.text
    assert duel.off == "a miniature replay failed (see the log)"
    assert mgr.policy.ranking == "heat" and duel.describe()["following"] == "heat"


def test_run_time_weights_reach_the_heat_miniature():
    mgr = manager(1024)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    mgr.lookup(list(range(1, 40)), lid)
    duel.run()
    mgr.policy.set_weights({"frequency": 1.0})
    mgr.lookup(list(range(1, 40)), lid)
    duel.run()
    assert duel._minis[0].manager.policy.weights["frequency"] == 1.0


def test_miniatures_reserve_rows_for_what_they_hold_not_for_their_tiers():
    """The real table reserves a row per KiB of its tiers, up to 2**28 (rowspace.py); a miniature
    holds an eighth of the real tiers' blocks and reserves rows for that: past a 2 TiB pool, one
    per KiB of its own tiers was the ceiling too, and the three of them took 4x the real table's
    address space (a review: 122 GiB of virtual size over a 5.2 TiB pool)."""
    GiB = 1 << 30
    specs = [TierSpec(Tier.HBM, 80 * GiB, 2 << 20, 256), TierSpec(Tier.DRAM, 1024 * GiB, 2 << 20, 4096),
             TierSpec(Tier.NVME, 4096 * GiB, 2 << 20, 4096)]
    mgr = BlockManager(specs, policy="heat")
    layout = Layout("big", num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", tokens_per_block=16)
    lid = mgr.register_layout(layout)
    assert mgr.table.cols.reserved == 1 << 28
    duel = Duel(mgr, 8)
    duel._build(lid)
    blocks = duel._capacity_blocks  # what the miniatures hold, in blocks of this layout
    for mini in duel._minis:
        reserved = mini.manager.table.cols.reserved
        assert blocks <= reserved <= 8 * blocks < 1 << 22, (reserved, blocks)
    mgr.close()


def test_a_lookup_one_miniature_would_refuse_is_served_by_none():
    """A key cached for another layout in one miniature (heat's had let it go, LRU's kept it): the
    miniatures before the refusing one had served the request, written its key, though it was counted
    "not replayed", and their caches drifted apart on it (a review). Now none serves it."""
    mgr = manager(512)  # miniatures of 256 blocks
    duel = Duel(mgr, 2)
    a = mgr.register_layout(LAYOUT)
    b = mgr.register_layout(Layout("same-size", num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                                   head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, tokens_per_block=LAYOUT.tokens_per_block))

    def kept(keys):  # those the 1-in-2 sample keeps
        return [k for k in keys if len(sampled(np.array([k], dtype=np.uint64), 2))]

    hot = kept(range(1, 1000))[:200]
    for _ in range(3):  # a returning hot set
        for i in range(0, 200, 8):
            mgr.lookup(hot[i:i + 8], a)
            duel.run()
    key = kept(range(10**6, 10**6 + 50))[:1]
    mgr.lookup(key, a)  # written once for layout a
    duel.run()
    fresh = kept(range(2 * 10**6, 2 * 10**6 + 400))[:120]
    for i in range(0, 120, 8):  # first-timers after it: heat lets it go first, LRU its oldest hot blocks
        mgr.lookup(fresh[i:i + 8], a)
        duel.run()
    holds = [len(m.manager.table.lookup(np.array(key, dtype=np.uint64), m.layouts[a])) for m in duel._minis]
    assert 0 in holds and 1 in holds  # (the miniatures differ on it: the case)
    mgr.lookup(key, b)  # the same key for another layout
    duel.run()
    assert duel.not_replayed["refused"] == 1
    assert [m.layouts.get(b) is None or len(m.manager.table.lookup(np.array(key, dtype=np.uint64), m.layouts[b])) == 0
            for m in duel._minis] == [True] * 3
