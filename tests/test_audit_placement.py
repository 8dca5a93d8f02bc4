"""Audit of placement and prefetch: promotions and prefetches that push out the very prefix they
serve, demotions that drop blocks the tier below has room for, prefetched blocks sent straight back
down by the next rebalance, and prefetch waste that went uncounted."""

import numpy as np
import pytest

from dflash2.errors import NeverFits
from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier

from conftest import SMALL


def fill(mgr, client, lid, keys, parent=None):
    """Commit one published block per key, chained, and drop the client's references (cached)."""
    vids = mgr.commit(client, mgr.allocate(client, lid, len(keys)), keys=keys, parent=parent)
    mgr.free(client, vids)
    return vids


def tiers_of(mgr, vids):
    rows, live = mgr.table.liveness(np.asarray(vids, dtype=np.int64))
    return [Tier(int(mgr.table.cols.tier[r])).label if ok else "gone" for r, ok in zip(rows.tolist(), live.tolist())]


def prefix_ordered(labels):
    order = {"hbm": 0, "dram": 1, "nvme": 2}
    ranks = [order[t] for t in labels]
    return ranks == sorted(ranks)


def test_a_promotion_never_demotes_the_prefix_of_the_blocks_it_brings_up(make_manager, clock):
    """Acquiring the tail of a chain whose head lies (unpinned) in a full HBM: the room for the tail
    must not be made by demoting its own head, which would put the tail above its prefix."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, a, lid, [1, 2, 3, 4])  # the oldest blocks (LRU)
    mgr.mover.move(mgr.table.rows(chain[2:])[::-1], Tier.DRAM)  # head in HBM, tail in DRAM
    clock.advance(1)
    fill(mgr, a, lid, [10, 11])  # HBM full, these newer than the head
    assert mgr.acquire(a, chain[2:]) is not None
    labels = tiers_of(mgr, chain)
    assert prefix_ordered(labels), f"a block above its prefix: {labels}"
    assert labels == ["hbm", "hbm", "hbm", "hbm"]
    mgr.check_invariants()


def test_a_lookup_prefetch_never_demotes_the_blocks_of_its_own_window(make_manager, clock):
    """The window's head already lies in HBM; making room for the rest of the window must push out
    other blocks, not the head the request reads first."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, prefetch_window=4)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, a, lid, [1, 2, 3, 4])
    mgr.mover.move(mgr.table.rows(chain[2:])[::-1], Tier.DRAM)
    clock.advance(1)
    fill(mgr, a, lid, [10, 11, 12, 13, 14, 15])  # HBM full (window stays 4)
    found = mgr.lookup([1, 2, 3, 4], lid)
    assert [p.vid for p in found] == chain.tolist()
    assert [p.tier for p in found] == [Tier.HBM] * 4, tiers_of(mgr, chain)
    mgr.check_invariants()


def test_a_demotion_keeps_what_the_tier_below_has_room_for(make_manager, clock):
    """The tier below can take only some of the victims (the rest of it is held): those move
    down, only the others are dropped. A batch that does not fit whole used to drop them all."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    held = mgr.commit(b, mgr.allocate(b, lid, 2), keys=[100, 101])  # b keeps its references
    mgr.mover.move(mgr.table.rows(held)[::-1], Tier.DRAM)  # DRAM: 2 of 4 slots held, 2 free
    cached = [int(fill(mgr, a, lid, [k])[0]) for k in range(1, 5)]  # HBM full of cached blocks
    assert mgr.allocate(a, lid, 4) is not None
    labels = tiers_of(mgr, cached)
    assert labels.count("dram") == 2 and labels.count("gone") == 2, labels
    assert mgr.placement.stats.evicted == 2  # the tier's two free slots kept two of the four
    mgr.check_invariants()


def test_a_prefetched_block_is_not_sent_back_down_by_the_next_rebalance(make_manager, clock, monkeypatch):
    """A lookup's prefetch fills HBM past its high watermark; the tick that follows before the read
    must demote other cold blocks, not the prefetched ones (whose scores are old: the prefetch is
    not a read) — that would send them straight back down and make the read wait for them again.
    The step's budget is ample: on a loaded machine a step of 50 ms could end after its first piece
    (a flaky failure, 19 blocks left in HBM), and the next step no longer protects them (one tick)."""
    from dflash2.placement import Placement

    monkeypatch.setattr(Placement, "REBALANCE_BUDGET_S", 30.0)
    for policy in ("lru", "heat"):
        mgr = make_manager(hbm_blocks=20, dram_blocks=40, prefetch_window=4, policy=policy)
        a = mgr.attach("a")
        lid = mgr.register_layout(SMALL)
        chain = fill(mgr, a, lid, [1, 2, 3, 4])
        mgr.mover.move(mgr.table.rows(chain)[::-1], Tier.DRAM)
        for k in range(18):  # HBM between its watermarks (0.9): the window stays 4
            clock.advance(1)
            fill(mgr, a, lid, [100 + k])
        found = mgr.lookup([1, 2, 3, 4], lid)
        assert [p.tier for p in found] == [Tier.HBM] * 4
        clock.advance(0.1)
        mgr.tick()  # HBM is full: rebalance demotes down to the low watermark
        assert mgr.stats()["tiers"]["hbm"]["blocks"] <= 17
        assert tiers_of(mgr, chain) == ["hbm"] * 4, policy
        assert mgr.acquire(a, chain) is not None
        assert mgr.access.reads[Tier.HBM] == 4, policy
        assert (mgr.prefetcher.useful, mgr.prefetcher.wasted) == (4, 0), policy
        mgr.check_invariants()


def test_a_block_prefetched_again_after_leaving_hbm_unread_counts_one_waste(make_manager, clock):
    """Prefetched, pushed out unread (no tick in between to settle it), prefetched again, then read:
    two prefetches, one useful and one wasted. The second prefetch used to hide the first."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, prefetch_window=1)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    block = fill(mgr, a, lid, [1])
    mgr.mover.move(mgr.table.rows(block), Tier.DRAM)
    clock.advance(1)
    fill(mgr, a, lid, [10, 11, 12])  # HBM: 3 of 4 used
    assert mgr.lookup([1], lid)[0].tier == Tier.HBM  # prefetched into the free slot
    assert mgr.prefetcher.pending == 1
    mgr.placement.make_room(Tier.HBM, 4 * 16384)  # another request needs all of HBM: it goes down
    assert tiers_of(mgr, block) == ["dram"]
    assert mgr.lookup([1], lid)[0].tier == Tier.HBM  # prefetched again
    assert mgr.acquire(a, block) is not None
    assert (mgr.prefetcher.useful, mgr.prefetcher.wasted) == (1, 1)
    assert mgr.prefetcher.pending == 0
    assert b is not None
    mgr.check_invariants()


def test_a_chain_extended_in_batches_is_demoted_past_a_stuck_tier_not_dropped(make_manager, clock):
    """A chain written batch by batch, each batch committed under the last block of the one before
    and then freed (cached only): making room for a batch demotes the chain's tail, so the next batch
    lies in HBM under a parent in DRAM. DRAM fills with runs each followed by HBM blocks, and none of
    them may go down first (prefix order). Blocks must then go past DRAM to NVMe, which has room,
    instead of being dropped (the lifecycle audit: the 256 newest blocks dropped with NVMe 99% free)."""
    mgr = make_manager(hbm_blocks=64, dram_blocks=64, nvme_blocks=256)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    keys = list(range(1, 1 + 20 * 16))
    parent = None
    for start in range(0, len(keys), 16):
        clock.advance(1)
        placed = mgr.allocate(a, lid, 16)
        assert placed is not None, f"no room for the batch at block {start}"
        vids = mgr.commit(a, placed, keys=keys[start:start + 16], parent=parent)
        mgr.free(a, vids)
        parent = int(vids[-1])
        mgr.check_invariants()
    stats = mgr.placement.stats
    assert stats.evicted == 0 and stats.not_admitted == 0  # 320 blocks, 384 slots: all kept
    assert stats.past_full > 0  # DRAM got stuck on the way, and blocks went past it
    found = mgr.lookup(keys, lid)
    assert len(found) == len(keys)  # the whole chain is still found, in order
    tiers = tiers_of(mgr, [f.vid for f in found])
    assert tiers.count("nvme") == len(keys) - 128  # HBM and DRAM full, the rest below


def test_a_block_never_passes_below_its_own_child(make_manager, clock):
    """P in HBM has its child C in DRAM, pinned there by a host-side reader, and DRAM is full of
    pinned blocks: P may not go past DRAM to NVMe (it would lie below its child). The allocation
    that needs P's slot finds no room, as before the pass-through (the review of 40f6549)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=2, nvme_blocks=8)
    a, reader = mgr.attach("a"), mgr.attach("reader")
    lid = mgr.register_layout(SMALL)
    p = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[1])
    child = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[2], parent=int(p[0]))
    other = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[3])
    mgr.free(a, [*p, *child, *other])
    clock.advance(1)
    mgr.acquire(reader, p)
    mgr.release(reader, p)  # P is hotter than its child
    clock.advance(1)
    mgr.free(a, mgr.allocate(a, lid, 3))  # the child and `other` go down to DRAM
    assert tiers_of(mgr, [*p, *child, *other]) == ["hbm", "dram", "dram"]
    mgr.acquire(reader, [int(child[0]), int(other[0])], up_to=Tier.DRAM)  # DRAM: all pinned
    clock.advance(1)
    assert mgr.allocate(a, lid, 4) is None
    assert tiers_of(mgr, [*p, *child]) == ["hbm", "dram"]
    assert mgr.placement.stats.past_full == 0
    mgr.check_invariants()


def test_a_promotion_keeps_the_blocks_it_makes_room_from(make_manager, clock):
    """A reader brings up a chain that fills DRAM while HBM is full of other cached blocks: DRAM has
    room only once the chain has left it, so HBM's blocks go past it to NVMe (a write on the read's
    path) instead of being dropped (a recompute for their next reader). Two reviews weighed the two;
    losing cache while NVMe has room is the worse."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=16)
    a, reader = mgr.attach("a"), mgr.attach("reader")
    lid = mgr.register_layout(SMALL)
    chain = mgr.commit(a, mgr.allocate(a, lid, 4), keys=[1, 2, 3, 4])
    mgr.free(a, chain)
    clock.advance(1)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 4), keys=[100, 101, 102, 103]))  # the chain to DRAM
    clock.advance(1)
    assert mgr.acquire(reader, chain) is not None
    assert len(mgr.lookup([100, 101, 102, 103], lid)) == 4 and mgr.placement.stats.evicted == 0
    mgr.check_invariants()


def test_a_promotion_with_one_block_in_a_pinned_dram_keeps_hbms_blocks(make_manager, clock):
    """The review of 6dea78d: the chain comes up from NVMe and one block of it lies in a DRAM
    otherwise full of pinned blocks; HBM's idle blocks go past DRAM, not dropped."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=16)
    a, reader = mgr.attach("a"), mgr.attach("reader")
    lid = mgr.register_layout(SMALL)
    chain = mgr.commit(a, mgr.allocate(a, lid, 3), keys=[1, 2, 3])
    mgr.free(a, chain)
    rows = mgr.table.rows(chain)
    assert mgr.mover.move(rows[1:], Tier.NVME).all() and mgr.mover.move(rows[:1], Tier.DRAM).all()
    for k in (11, 12, 13):
        v = mgr.commit(a, mgr.allocate(a, lid, 1, tier=Tier.DRAM), keys=[k])
        mgr.free(a, v)
        mgr.acquire(reader, v, up_to=Tier.DRAM)
    clock.advance(1)
    idle = mgr.commit(a, mgr.allocate(a, lid, 4), keys=[100, 101, 102, 103])
    mgr.free(a, idle)
    clock.advance(1)
    assert mgr.acquire(reader, chain) is not None
    assert len(mgr.lookup([100, 101, 102, 103], lid)) == 4 and mgr.placement.stats.evicted == 0
    mgr.check_invariants()


def test_blocks_pass_a_stuck_tier_only_to_a_tier_that_keeps_them(make_manager, clock):
    """NVMe reads back slower than the engine recomputes (cost-aware reuse: placement drops rather
    than demotes there), DRAM is full of pinned blocks, and HBM's victim P has a cached child in
    NVMe (so it cannot be dropped): P must stay, not go past DRAM into NVMe, where lookups would
    never offer it (the review of 40f6549: its whole chain became unofferable)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=2, nvme_blocks=8)
    a, reader = mgr.attach("a"), mgr.attach("reader")
    lid = mgr.register_layout(SMALL)
    p = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[1])
    child = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[2], parent=int(p[0]))
    mgr.free(a, [*p, *child])
    assert mgr.mover.move(mgr.table.rows(child), Tier.NVME).all()
    pinned = [mgr.commit(a, mgr.allocate(a, lid, 1, tier=Tier.DRAM), keys=[k]) for k in (3, 4)]
    for v in pinned:
        mgr.free(a, v)
        mgr.acquire(reader, v, up_to=Tier.DRAM)  # DRAM: all pinned by a host-side reader
    mgr.read_cost.observe(Tier.NVME, Tier.HBM, 16 << 20, 1.0)  # 16 MiB/s measured
    mgr.set_prefill_rate(a, lid, 1e12)  # recomputing is faster than any read from NVMe
    assert not mgr.read_cost.keeps(mgr.table.layouts, np.array([lid]), Tier.NVME)[0]
    clock.advance(1)
    assert mgr.allocate(a, lid, 4) is None
    assert tiers_of(mgr, [*p, *child]) == ["hbm", "nvme"]
    assert mgr.placement.stats.past_full == 0
    mgr.check_invariants()


def test_an_acquire_whose_cached_prefix_can_never_fit_is_never_fits(make_manager):
    """The promotion brings the block's cached prefix up first: one block of a 6-block chain in DRAM
    fits an HBM of 4, its chain never does. It answered None ("no room now") to every retry, each
    demoting another client's idle blocks for nothing."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=16)
    lid = mgr.register_layout(SMALL)
    other = mgr.attach("other")
    mgr.free(other, mgr.commit(other, mgr.allocate(other, lid, 3), [101, 102, 103]))
    writer = mgr.attach("host-writer")
    chain = mgr.commit(writer, mgr.allocate(writer, lid, 6, tier=Tier.DRAM), [1, 2, 3, 4, 5, 6])
    mgr.free(writer, chain)
    reader = mgr.attach("reader")
    with pytest.raises(NeverFits, match=r"acquire of 1 blocks \(with their cached prefix, 6\) needs"):
        mgr.acquire(reader, [int(chain[5])])
    assert [p.tier for p in mgr.lookup([101, 102, 103], lid)] == [Tier.HBM] * 3, "nothing was demoted"
    assert mgr.acquire(reader, [int(chain[1])]) is not None  # a prefix of two fits
    mgr.check_invariants()


def test_blocks_of_two_layouts_that_can_never_lie_together_are_never_fits(clock):
    """A page holds blocks of one size: 5 blocks of 40 KiB and 4 of 48 KiB, each a one-page slab,
    need 9 pages of a tier of 8, though the bytes fit and each layout alone would."""
    from dflash2.layout import Layout
    from dflash2.manager import BlockManager, TierSpec

    kib = 1024
    a = Layout("a", num_layers=2, num_kv_heads=5, head_dim=64, dtype="fp16", tokens_per_block=16)
    b = Layout("b", num_layers=2, num_kv_heads=6, head_dim=64, dtype="fp16", tokens_per_block=16)
    mgr = BlockManager([TierSpec(Tier.HBM, 8 * 64 * kib, 64 * kib, 256),
                        TierSpec(Tier.DRAM, 64 * 64 * kib, 64 * kib, 4096)], clock=clock)
    la, lb = mgr.register_layout(a), mgr.register_layout(b)
    w = mgr.attach("w")
    va = mgr.commit(w, mgr.allocate(w, la, 5, tier=Tier.DRAM), [1, 2, 3, 4, 5])
    vb = mgr.commit(w, mgr.allocate(w, lb, 4, tier=Tier.DRAM), [11, 12, 13, 14])
    mgr.free(w, va)
    mgr.free(w, vb)
    r = mgr.attach("r")
    with pytest.raises(NeverFits, match="needs 9 pages of hbm for its blocks of 2 layouts"):
        mgr.acquire(r, [*va.tolist(), *vb.tolist()])
    assert mgr.acquire(r, [*va.tolist(), *vb[:3].tolist()]) is not None  # 8 pages: they fit
    mgr.check_invariants()
    mgr.close()


def test_acquire_keeps_and_brings_up_the_prefix_above_a_stranded_block(make_manager, clock):
    """A pinned ancestor left below while a descendant came up (prefix order broken once, as
    designed): a walk cut where it met HBM neither brought up the ancestor once unpinned nor
    protected the head above it, which was demoted to make room for its own tail (a review of a
    version never landed). The walk goes to the root."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=16)
    lid = mgr.register_layout(SMALL)
    w = mgr.attach("w")
    x = mgr.commit(w, mgr.allocate(w, lid, 1), [1])  # HBM
    pyz = mgr.commit(w, mgr.allocate(w, lid, 3, tier=Tier.DRAM), [2, 3, 4], parent=int(x[0]))
    mgr.free(w, x)
    mgr.free(w, pyz)
    p, y, z = (int(v) for v in pyz)
    host = mgr.attach("host-reader")
    assert mgr.acquire(host, [p], up_to=Tier.DRAM) is not None  # P pinned in DRAM
    r = mgr.attach("reader")
    clock.advance(1)
    assert mgr.acquire(r, [y]) is not None  # Y comes up, P stays (pinned)
    mgr.release(r, [y])
    mgr.release(host, [p])
    assert tiers_of(mgr, [int(x[0]), p, y, z]) == ["hbm", "dram", "hbm", "dram"]
    clock.advance(1)
    o = mgr.commit(w, mgr.allocate(w, lid, 2), [10, 11])  # HBM full: X, Y, O1, O2; X the oldest
    mgr.free(w, o)
    clock.advance(1)
    assert mgr.acquire(r, [z]) is not None
    labels = tiers_of(mgr, [int(x[0]), p, y, z])
    assert labels[0] == "hbm", f"the chain's head was demoted to make room for its own tail: {labels}"
    assert labels == ["hbm"] * 4, labels
    mgr.check_invariants()


KIB = 1024
BIG = Layout("big", num_layers=8, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)  # 64 KiB
SMALL_16K = Layout("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)  # 16 KiB


def two_layout_tiers(clock):
    return BlockManager([TierSpec(Tier.HBM, 8 * 64 * KIB, 64 * KIB, 256),
                         TierSpec(Tier.DRAM, 64 * 64 * KIB, 64 * KIB, 4096)], clock=clock)


def test_mixed_layout_chain_that_can_never_fit_is_never_fits(clock):
    """A chain of 64 KiB blocks in HBM, 16 KiB ones below: its whole prefix (528 KiB) never fits an
    HBM of 512 KiB. Counted by depth at the layout of where a walk was cut, it "fit", and the
    acquire answered None for ever (a review of a version never landed)."""
    mgr = two_layout_tiers(clock)
    lb, ls = mgr.register_layout(BIG), mgr.register_layout(SMALL_16K)
    w = mgr.attach("w")
    head = mgr.commit(w, mgr.allocate(w, lb, 6), [1, 2, 3, 4, 5, 6])  # 6 pages of HBM
    cut = mgr.commit(w, mgr.allocate(w, ls, 1), [7], parent=int(head[-1]))  # HBM
    tail = mgr.commit(w, mgr.allocate(w, ls, 8, tier=Tier.DRAM), list(range(8, 16)), parent=int(cut[-1]))
    for v in (head, cut, tail):
        mgr.free(w, v)
    r = mgr.attach("r")
    # The whole prefix: 6 x 64 KiB + 9 x 16 KiB = 528 KiB > the 512 KiB HBM. Never fits.
    assert len(mgr.placement.with_ancestors(mgr.table.rows(tail[-1:]), Tier.HBM)) == 15
    with pytest.raises(NeverFits, match=r"with their cached prefix, 15"):
        mgr.acquire(r, [int(tail[-1])])
    mgr.close()
