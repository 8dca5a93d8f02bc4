"""The core library's calls refuse bad arguments before they change anything (a request id, a
priority, a client id, tier specs), and a metadata-only manager says it holds no bytes. Moved from
test_audit_core.py (past 600 lines)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2.errors import ArenaError
from dflash2.tiers import Tier

from conftest import SMALL


@pytest.fixture
def mgr(make_manager):
    return make_manager(hbm_blocks=8, dram_blocks=8)


def test_a_metadata_only_manager_says_it_has_no_bytes_to_view(mgr):
    """A manager built without arenas has no bytes for any block: its view of a block acquired in
    HBM said "lies in hbm, which has no memory view; acquire it first" (a review)."""
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = int(mgr.allocate(a, lid, 1)[0])
    assert [p.tier for p in mgr.acquire(a, [v])] == [Tier.HBM]
    with pytest.raises(ArenaError, match="metadata only") as told:
        mgr.view(v)
    assert "acquire it first" not in str(told.value)


def test_tier_specs_without_hbm_room_or_with_a_tier_twice_are_refused_by_name():
    """An HBM spec of no capacity failed with a bare KeyError from admission, and a tier given twice
    took its last spec without a word (a review)."""
    from dflash2.manager import BlockManager, TierSpec

    with pytest.raises(ArenaError, match="HBM tier .* has no capacity"):
        BlockManager([TierSpec(Tier.HBM, 0, 16384, 256), TierSpec(Tier.DRAM, 16 * 16384, 16384, 256)])
    with pytest.raises(ArenaError, match="a tier is given more than once: hbm"):
        BlockManager([TierSpec(Tier.HBM, 16 * 16384, 16384, 256), TierSpec(Tier.HBM, 32 * 16384, 16384, 256)])


@pytest.mark.parametrize("request_id", [2**64, "x", 1.5, None])
def test_an_allocation_with_a_request_id_out_of_range_takes_nothing(mgr, request_id):
    """The request id was stored after the rows and slots were taken: a value the int64 column refuses
    (OverflowError, ValueError, TypeError) left both held by nobody, leaked (a review), through
    allocate and through a reservation's grant alike."""
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    with pytest.raises(ValueError, match="request must be an integer in the int64 range"):
        mgr.allocate(a, lid, 2, request=request_id)
    with pytest.raises(ValueError, match="request must be an integer in the int64 range"):
        mgr.reserve(a, lid, 32, request=request_id)
    assert mgr.table.allocators[Tier.HBM].used_slots == 0
    assert not mgr.admission.granted and not len(mgr.admission.deferred)
    mgr.check_invariants()
    assert len(mgr.allocate(a, lid, 2, request=2**63 - 1)) == 2
    mgr.check_invariants()


@pytest.mark.parametrize("priority", ["x", float("nan"), 2.5])
def test_a_read_with_a_priority_that_is_no_integer_takes_nothing(mgr, priority):
    """The priority was applied after the pins (acquire) or references (add_ref) were taken: a NaN or a
    string raised then, and the failed call's pins and references stayed held (a review)."""
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    v = mgr.allocate(a, lid, 1)
    mgr.commit(a, v, keys=[5])
    mgr.free(a, v)
    with pytest.raises(ValueError, match="priority must be an integer"):
        mgr.add_ref(b, v, priority=priority)
    with pytest.raises(ValueError, match="priority must be an integer"):
        mgr.acquire(b, v, priority=priority)
    assert not mgr.table.client(b).refs and not mgr.table.client(b).pins
    mgr.check_invariants()
    mgr.add_ref(b, v, priority=3)
    assert [p.vid for p in mgr.acquire(b, v, priority=3)] == v.tolist()
    mgr.check_invariants()


@pytest.mark.parametrize("client_id", [-1, 2**31, 2**40])
def test_a_client_id_outside_the_owner_column_is_refused(mgr, client_id):
    """Client -1 is the owner column's NO_CLIENT: its private blocks read as published, another client
    pinned them and the table broke its invariants; an id past int32 failed its allocate after the rows
    and slots were taken (a review)."""
    with pytest.raises(ValueError, match="client id must be an integer in 0..2147483647"):
        mgr.attach("x", client_id)
    assert client_id not in mgr.table.clients
    mgr.check_invariants()


def test_a_client_id_picked_above_one_given_at_the_top_is_refused(mgr):
    """The table picks ids above the highest given: after one at the top of the owner column, it picked
    2**31, unchecked, and that client's allocate raised after the rows and slots were taken (a review)."""
    lid = mgr.register_layout(SMALL)
    assert mgr.attach("top", 2**31 - 1) == 2**31 - 1
    with pytest.raises(ValueError, match="no client id left to pick: the next would be 2147483648"):
        mgr.attach("next")
    assert set(mgr.table.clients) == {2**31 - 1}
    assert mgr.attach("given", 7) == 7 and len(mgr.allocate(7, lid, 1)) == 1
    mgr.check_invariants()


@pytest.mark.parametrize("priority", [np.int64(2**63 - 1), np.uint64(2**64 - 1)])
def test_a_read_at_a_numpy_integers_top_priority_makes_room_as_at_127(make_manager, priority):
    """A numpy integer priority (taken by the priority check) plus one wrapped at its type's top: the
    acquire could make room only below priority -2**63, none, and was refused "full of blocks that cannot
    move" where priority 127 (or the same Python int) brought its block up (a review)."""
    import warnings

    m = make_manager(hbm_blocks=2, dram_blocks=8)
    a, b, c = m.attach("a"), m.attach("b"), m.attach("c")
    lid = m.register_layout(SMALL)
    v = m.allocate(a, lid, 1)
    m.commit(a, v, keys=[1])
    m.free(a, v)
    m.mover.move(m.table.rows(v), Tier.DRAM)
    m.commit(c, m.allocate(c, lid, 2), keys=[2, 3])  # HBM full of another client's blocks, priority 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the wrap's overflow warning: the refusal is what is checked)
        got = m.acquire(b, v, priority=priority)
    assert got is not None and [p.tier for p in got] == [Tier.HBM], m.acquire_refusal
    m.check_invariants()


@pytest.mark.parametrize("priority", [3.0, np.int8(127)])
def test_a_reservation_at_a_priority_the_check_takes_is_decided_as_at_that_int(make_manager, priority):
    """The priority check takes an integral float and numpy integers: a 3.0 reservation, queued, then
    failed its deferred decision (an IndexError) and stayed queued, its id never told; an np.int8 127
    wrapped in the movable count (127 + 128) and was told it waited on blocks that cannot move, where
    127 counted the running blocks it may preempt (a review)."""
    import warnings

    m = make_manager(hbm_blocks=8, dram_blocks=32)
    a, b = m.attach("a"), m.attach("b")
    lid = m.register_layout(SMALL)
    m.commit(a, m.allocate(a, lid, 8), keys=list(range(1, 9)))  # HBM full of running blocks, priority 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the wrap's overflow warning)
        d = m.reserve(b, lid, 2 * SMALL.tokens_per_block, priority=priority)
    assert d.reason == "not enough HBM free yet", d
    assert [r.priority for r in m.admission.deferred] == [int(priority)]
    m.check_invariants()
