"""Releases and frees of many blocks at once (`BlockTable._unpin_distinct`, `_free_distinct`): a call
that lists each block once, and more than `BlockTable.SMALL` of them, takes whole-array steps instead
of the per-row Counter steps of the general path. Both must leave the same table, answer the same,
and refuse the same calls with the same error, nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import SMALL, specs
from dflash2.errors import DFlash2Error, NotOwner, PinnedBlock
from dflash2.manager import BlockManager
from dflash2.tiers import Tier

PUBLISHED, PRIVATE = 16, 8  # blocks each client setup has: committed with keys, and written, uncommitted


def setup(general: bool):
    """A manager with PUBLISHED cached blocks and PRIVATE blocks client `a` writes; `general`: every
    call takes the general per-row path (SMALL raised past any call's size)."""
    t = [0.0]
    mgr = BlockManager(specs(64), clock=lambda: t[0])
    if general:
        mgr.table.SMALL = 1 << 30
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    published = mgr.commit(a, mgr.allocate(a, lid, PUBLISHED), keys=list(range(1, PUBLISHED + 1)))
    mgr.free(a, published)
    private = mgr.allocate(a, lid, PRIVATE)
    return mgr, (a, b), np.concatenate([published, private])


def state(mgr, clients):
    """Everything the calls may change, down to the order in which freed rows and slots are reused."""
    c, t = mgr.table.cols, mgr.table
    hbm = t.allocators[min(t.allocators)]
    slots = {size: cls.free[: cls.n_free].tolist() for size, cls in hbm._classes.items()}
    return (c.refs.tolist(), c.pins.tolist(), c.state.tolist(), c.priority.tolist(), c.gen.tolist(),
            [(dict(t.clients[x].refs), dict(t.clients[x].pins), t.clients[x].ref_slot_bytes) for x in clients],
            hbm.used_bytes, slots, c._free_rows[: c._n_free].tolist(), t.movable_epoch.tolist())


def apply(mgr, clients, vids, op):
    kind, who, picks = op
    client, chosen = clients[who], [int(vids[i]) for i in picks]
    try:
        if kind == "add_ref":
            return mgr.table.add_ref(client, chosen)
        if kind == "add_ref_priority":  # (the blocks carry priority 3 while held: released, back to 0)
            return mgr.add_ref(client, chosen, priority=3)
        if kind == "pin":
            return mgr.table.pin(client, chosen).tolist()
        if kind == "pin_priority":  # (as an acquire of a request of priority 3 pins them)
            rows = mgr.table.pin(client, chosen)
            mgr.table.raise_priority(rows, 3)
            return rows.tolist()
        if kind == "free":
            return mgr.table.free(client, chosen)
        return mgr.table.unpin(client, chosen)
    except DFlash2Error as e:
        return type(e).__name__, str(e)


ops = st.lists(st.tuples(st.sampled_from(["add_ref", "add_ref_priority", "pin", "pin_priority", "free", "unpin"]), st.integers(0, 1),
                         st.lists(st.integers(0, PUBLISHED + PRIVATE - 1), min_size=9, max_size=20, unique=True)),
               min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_the_whole_array_path_answers_as_the_general_one(sequence):
    fast, clients, vids = setup(general=False)
    slow, clients_slow, vids_slow = setup(general=True)
    assert vids.tolist() == vids_slow.tolist()
    for op in sequence:
        assert apply(fast, clients, vids, op) == apply(slow, clients_slow, vids_slow, op), op
        assert state(fast, clients) == state(slow, clients_slow), op
        fast.check_invariants()


def test_a_large_free_in_any_order_reuses_rows_and_slots_as_the_general_path():
    """Freed rows and slots go back in row order (the order later allocations take them in),
    whatever order the call listed them in."""
    made = [setup(general) for general in (False, True)]
    for mgr, (a, b), vids in made:
        mgr.add_ref(a, vids[:4])
        assert mgr.table.free(a, np.concatenate([vids[PUBLISHED:][::-1], vids[:4]])) == PRIVATE
    assert state(made[0][0], made[0][1]) == state(made[1][0], made[1][1])


def test_a_large_release_frees_a_pinned_copy_at_its_last_pin_as_the_general_path():
    """A block written under a key already cached, pinned by its writer when it committed it, is
    kept only for those pins: the release that ends them frees it."""
    made = [setup(general) for general in (False, True)]
    for mgr, (a, b), vids in made:
        t = mgr.table
        copy = vids[PUBLISHED:PUBLISHED + 1]
        t.pin(a, copy)
        assert mgr.commit(a, copy, keys=[1]).tolist() == vids[:1].tolist()  # key 1 is cached: the twin
        t.pin(a, vids[1:10])
        t.unpin(a, np.concatenate([vids[1:10], copy]))
        assert t.cols.state[int(copy[0]) & 0xFFFFFFFF] == 0  # FREE
        mgr.check_invariants()
    assert state(made[0][0], made[0][1]) == state(made[1][0], made[1][1])


def test_a_refused_free_names_the_first_bad_block_and_changes_nothing():
    mgr, (a, b), vids = setup(general=False)
    t = mgr.table
    mgr.add_ref(a, vids[:12])
    pinned_private = vids[PUBLISHED:PUBLISHED + 1]
    t.pin(a, pinned_private)
    before = state(mgr, (a, b))
    # Block 12 is not held by `a`: NotOwner names it, though blocks 0-11 were fine.
    with pytest.raises(NotOwner, match=hex(int(vids[12]))):
        t.free(a, vids[:13])
    # The pinned private block (its last reference) comes before the block `a` does not hold.
    listed = np.concatenate([vids[:5], pinned_private, vids[12:13], vids[5:8]])
    with pytest.raises(PinnedBlock, match=hex(int(pinned_private[0]))):
        t.free(a, listed)
    # A block `a` holds once, listed twice: named with both counts, not as one it holds no reference to.
    with pytest.raises(NotOwner, match=rf"holds 1 reference\(s\) to block {hex(int(vids[0]))}, freed 2"):
        t.free(a, np.concatenate([vids[:1], vids[:1]]))
    assert state(mgr, (a, b)) == before


def test_a_large_free_drops_one_reference_each_and_frees_the_private_blocks():
    mgr, (a, b), vids = setup(general=False)
    t = mgr.table
    mgr.add_ref(a, vids[:10])
    mgr.add_ref(a, vids[:4])  # held twice
    listed = np.concatenate([vids[:10], vids[PUBLISHED:]])  # 18 blocks, 8 of them private
    assert t.free(a, listed) == PRIVATE  # the private ones had their last reference
    refs = t.clients[a].refs
    rows = t.rows(vids[:4])
    assert {r: refs[r] for r in rows.tolist()} == dict.fromkeys(rows.tolist(), 1) and len(refs) == 4
    assert t.cols.refs[t.rows(vids[:10])].tolist() == [1] * 4 + [0] * 6
    assert t.clients[a].ref_slot_bytes == t.ref_slots(rows)
    mgr.check_invariants()


def test_a_large_release_unpins_once_each_and_refuses_a_block_not_pinned():
    mgr, (a, b), vids = setup(general=False)
    t = mgr.table
    t.pin(a, vids[:12])
    t.pin(a, vids[:3])  # pinned twice
    before = state(mgr, (a, b))
    with pytest.raises(NotOwner):
        t.unpin(a, vids[:13])  # block 12 is not pinned by `a`
    with pytest.raises(NotOwner):
        t.unpin(b, vids[:12])  # nor any by `b`
    assert state(mgr, (a, b)) == before
    t.unpin(a, vids[:12])
    assert dict(t.clients[a].pins) == dict.fromkeys(t.rows(vids[:3]).tolist(), 1)
    assert t.cols.pins[t.rows(vids[:12])].tolist() == [1] * 3 + [0] * 9
    mgr.check_invariants()


def test_a_commit_onto_cached_twins_lets_the_copies_go_in_one_step(monkeypatch):
    """A commit of blocks whose keys are cached hands each copy's references to its twin and frees
    the copies: one release per block held the daemon's loop 0.5 s a commit of 8,192 (a review's
    profile; 3 ms for fresh keys). The copies go in one step, a pinned one stays until its last pin,
    and the client's references and their HBM bytes are the twins', as before."""
    t = [0.0]
    mgr = BlockManager(specs(64), clock=lambda: t[0])
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    twins = mgr.commit(a, mgr.allocate(a, lid, 8), keys=list(range(1, 9)))
    mgr.free(a, twins)
    copies = mgr.allocate(a, lid, 10)
    mgr.acquire(a, copies[:1])  # viewed by its writer: kept until released
    held = mgr.table.client(a).ref_slot_bytes
    steps = []
    real = type(mgr.table)._after_refs_dropped
    monkeypatch.setattr(type(mgr.table), "_after_refs_dropped", lambda self, rows: steps.append(len(rows)) or real(self, rows))
    out = mgr.commit(a, copies, keys=list(range(1, 11)))  # 8 cached, 2 new
    assert steps == [7], steps  # the 7 unpinned copies, together
    assert out[:8].tolist() == twins.tolist() and out[8:].tolist() == copies[8:].tolist()
    assert mgr.table.client(a).ref_slot_bytes == held
    assert sorted(mgr.table.client(a).refs) == sorted(mgr.table.rows(out).tolist())
    mgr.release(a, copies[:1])
    mgr.free(a, out)
    assert mgr.table.allocators[Tier.HBM].used_slots == 10  # 8 twins and 2 new: the copies freed
    mgr.check_invariants()
