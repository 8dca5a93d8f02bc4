"""`Placement.leave_whole` above a leaf held deep in a chain: every ancestor is held, those of a
chain beside it are not, and the walk up is not a whole-array round a level (a round a level, 20-50 us
each, took 505 ms above one leaf held 32,768 deep at a million blocks, a review)."""

import numpy as np

from dflash2 import placement as placement_module
from dflash2.tiers import Tier

from conftest import SMALL

DEPTH = 3000


def test_a_leaf_held_deep_holds_its_whole_chain_without_a_round_a_level(make_manager, monkeypatch):
    mgr = make_manager(hbm_blocks=2 * DEPTH, dram_blocks=16)
    lid, w = mgr.register_layout(SMALL), mgr.attach("w")
    chains = []
    for base in (1, 10 * DEPTH):
        vids = mgr.allocate(w, lid, DEPTH)
        mgr.commit(w, vids, keys=list(range(base, base + DEPTH)))
        mgr.free(w, vids)
        chains.append(mgr.table.rows(vids))
    held, whole = chains
    pl = mgr.placement
    mask = pl.movable(Tier.HBM, evict=False, idle_only=True)
    assert mask[held].all() and mask[whole].all()
    mask[held[-1]] = False  # the leaf cannot leave (as if pinned)
    rounds = []
    unique = np.unique
    monkeypatch.setattr(placement_module.np, "unique", lambda *a, **kw: rounds.append(1) or unique(*a, **kw))
    out = pl.leave_whole(Tier.HBM, mask, False)
    monkeypatch.undo()
    assert not out[held].any() and out[whole].all()
    assert len(rounds) < 64, len(rounds)  # (a round a level: DEPTH - 1 of them)
