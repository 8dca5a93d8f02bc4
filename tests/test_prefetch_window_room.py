"""The prefetch window under pressure, over a real host manager (and a daemon): the window reported
falls back as HBM fills, a window brought up stays through the drain that follows, and a window HBM
cannot hold whole brings up what fits. Moved from test_reads_and_prefetch.py (past 600 lines)."""

from __future__ import annotations

import functools
import time

import numpy as np
from conftest import SMALL
from placement_helpers import fill
from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.manager import Watermark
from dflash2.tiers import Tier


def test_the_window_reported_falls_back_as_hbm_fills(make_manager):
    """`stats()["prefetch"]["window"]` (the gauge, `dflash2 status`): once HBM has filled past its high
    watermark, the base window, not the doubled one of the last prefetch (it stayed until a prefetch ran)."""
    m = make_manager(hbm_blocks=32, dram_blocks=32, prefetch_window=2)
    c = m.attach("c")
    lid = m.register_layout(SMALL)
    keys = list(range(1, 9))
    m.free(c, m.commit(c, m.allocate(c, lid, 8, tier=Tier.DRAM), keys=keys))
    m.lookup_rows(keys, lid, client=c)  # its prefetch: HBM below its low watermark, the window doubles
    doubled = m.prefetcher.window
    assert doubled > 2 and m.stats()["prefetch"]["window"] == doubled
    held = m.allocate(c, lid, 31 - round(m.placement.used_fraction(Tier.HBM) * 32))  # 31 of 32 slots
    assert m.placement.used_fraction(Tier.HBM) >= m.placement.watermarks[Tier.HBM].high
    assert m.stats()["prefetch"]["window"] == 2
    m.free(c, held)
    m.check_invariants()


def test_a_prefetched_window_stays_through_the_drain_the_next_step_begins(config_file, tmp_path):
    """The daemon's step takes a drain's cold cut, then lets go of its list of fresh prefetches, and
    the cut's pieces run later, between requests: a reader's prefetched chain, not read yet (its
    scores old: a prefetch is not a read), went straight back down (a review)."""
    cfg = config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 4, "nvme_capacity_mb": 0, "page_kb": 64},
                      policy={"name": "heat", "cold_threshold": 0.5, "swap_batch_size": 64,
                              "rescore_interval_ms": 1000, "duel_sample": 0},
                      kv_block={"block_size": 16, "prefetch_window": 4},
                      daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "state_dir": str(tmp_path / "state")})
    d = DaemonProcess(cfg).start()
    try:
        c = Client.connect(d.endpoint, name="reader", layouts=[SMALL])
        keys = list(range(1, 9))
        chain = c.commit(c.allocate(0, 8)["vid"], keys)
        c.free(chain)
        filler = c.commit(c.allocate(0, 64)["vid"], list(range(1000, 1064)))  # pushes the chain down to DRAM
        c.free(filler)
        hbm = lambda: c.stats()["tiers"]["hbm"]["blocks"]
        deadline = time.monotonic() + 5
        while hbm() > 54 and time.monotonic() < deadline:  # HBM (64 blocks) drains to its low watermark
            time.sleep(0.05)
        assert set(c.places(chain)["tier"].tolist()) == {1}  # the chain lies in DRAM
        placed = c.lookup(keys, 0)  # a reader's lookup: the window (8: doubled below the low watermark) comes up
        assert placed["tier"].tolist() == [0] * 8, placed["tier"]
        assert c.stats()["prefetch"]["pending"] == 8
        # HBM is now over its high watermark (62 of 64): the next step begins a drain.
        n0, t0 = hbm(), time.monotonic()
        while hbm() >= n0:
            assert time.monotonic() - t0 < 30, "no drain began"
            time.sleep(0.005)
        time.sleep(0.2)
        tiers = c.places(chain)["tier"].tolist()
        pre = c.stats()["prefetch"]
        assert tiers == [0] * 8, f"prefetched, unread blocks demoted by the first step's drain: tiers {tiers}, {pre}"
    finally:
        d.stop()


def _tiers(m, keys):
    return [p.tier for p in m.places_of_rows(m.table.lookup(keys, 0))]


def test_a_prefetch_during_a_drain_under_way_is_not_drained_again_unread(make_manager, clock):
    """A drain that spans steps keeps its cut: a chain it had taken down, brought back up by a
    reader's prefetch, went down again unread once the step let go of the fresh prefetches (the
    first fix left them out only of a cut taken after them, a review)."""
    m = make_manager(hbm_blocks=100, dram_blocks=400, prefetch_window=8,
                     watermarks={Tier.HBM: Watermark(0.9, 0.3)})
    a = m.attach("reader")
    m.register_layout(SMALL)
    keys = list(range(1, 9))
    chain = m.allocate(a, 0, 8)
    m.commit(a, chain, keys)
    m.free(a, chain)
    clock.advance(1)
    for i in range(85):  # newer blocks, one at a time (later accesses: warmer under LRU)
        v = m.allocate(a, 0, 1)
        m.commit(a, v, [1000 + i])
        m.free(a, v)
        clock.advance(0.01)
    assert m.placement.used_fraction(Tier.HBM) > 0.9
    m.tick(drain=False)  # the drain begins: its cut holds the chain (coldest)
    assert Tier.HBM in m.placement.draining
    for _ in range(200):  # pieces until the chain is down, the drain still going
        if all(t == Tier.DRAM for t in _tiers(m, keys)):
            break
        m.drain_slice(0.05, lambda s: True)  # the server's slices between requests
    assert all(t == Tier.DRAM for t in _tiers(m, keys)), _tiers(m, keys)
    assert Tier.HBM in m.placement.draining, "the drain ended before the test could look"
    # a reader's lookup: the window comes up for its read
    m.lookup_rows(keys, 0, client=a)
    assert all(t == Tier.HBM for t in _tiers(m, keys)), _tiers(m, keys)
    clock.advance(0.1)
    m.tick(drain=False)  # the next step (the drain goes on: no new cut)
    for _ in range(5):
        m.drain_slice(0.05, lambda s: True)  # the server's slices between requests
    assert all(t == Tier.HBM for t in _tiers(m, keys)), (
        f"prefetched, unread, demoted again by the drain begun before the prefetch: {_tiers(m, keys)}; "
        f"pending {m.prefetcher.pending}, wasted {m.prefetcher.wasted}")


def test_a_window_that_cannot_fit_brings_up_what_fits_and_makes_room_only_for_that(make_manager, clock):
    """HBM of 4 (2 pinned by another reader, 2 idle cached blocks) over a full DRAM holding a 4-block
    chain: the lookup's window of 4 cannot fit. It made room for all 4, dropping both idle blocks,
    then moved nothing (a batch moves whole or not at all): the guess cost two cached blocks and
    saved no read (a review). Only the first 2 come up now, and room is made for them alone."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, prefetch_window=4)
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    chain = functools.partial(fill, mgr, a, lid)
    target = chain([1, 2, 3, 4])
    idle = [chain([10 + i]) for i in range(4)]  # HBM full of idle blocks; the chain goes down to DRAM
    assert [mgr.place(int(v)).tier for v in target] == [Tier.DRAM] * 4
    assert mgr.acquire(c, np.concatenate(idle[:2])) is not None
    mgr.lookup_rows((1, 2, 3, 4), lid, client=b)
    assert [mgr.place(int(v)).tier for v in target] == [Tier.HBM] * 2 + [Tier.DRAM] * 2
    mgr.check_invariants()


def test_a_window_cut_to_a_bound_that_counts_a_held_parent_still_brings_up_what_fits(make_manager, clock):
    """HBM of 4: X -> Y (Y pinned by another reader, X idle but held in HBM by its child) and two idle
    blocks, over a full DRAM holding a 4-block chain. The bound on HBM's room counts X, so the window
    was cut to 3; room was made for 3 (the two idle blocks went), and the batch of 3, whole or not
    at all, moved nothing (a review). Now the leading part the room made holds moves: 2 blocks."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, prefetch_window=4)
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    chain = functools.partial(fill, mgr, a, lid)
    target = chain([1, 2, 3, 4])
    xy = chain([20, 21])
    chain([30]), chain([31])
    assert [mgr.place(int(v)).tier for v in target] == [Tier.DRAM] * 4
    assert mgr.acquire(c, xy[1:]) is not None
    mgr.lookup_rows((1, 2, 3, 4), lid, client=b)
    assert [mgr.place(int(v)).tier for v in target] == [Tier.HBM] * 2 + [Tier.DRAM] * 2
    mgr.check_invariants()
