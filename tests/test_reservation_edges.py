"""Reservations at their edges (a review of 2026-12-04): a full queue and priority, a reservation
whose every block was taken, takes of no block, and a chain let go of from its root while a
reservation waits. Each failed before its fix (dflash2/reservations/). Metadata-only managers on
the fake clock."""

from __future__ import annotations

import pytest

from dflash2.errors import ReservationError
from dflash2.reservations import Outcome

from conftest import SMALL
from reservation_helpers import settings


def test_a_full_queue_takes_a_higher_priority_reservation_in_place_of_its_lowest(make_manager):
    """Before, a queue full of one client's low-priority reservations rejected every interactive
    one, and the next free block went to a batch job."""
    mgr = make_manager(hbm_blocks=4, admission=settings(max_deferred=4))
    w, bulk, vip = mgr.attach("writer"), mgr.attach("batch"), mgr.attach("interactive")
    lid = mgr.register_layout(SMALL)
    held = mgr.allocate(w, lid, 4)  # HBM full of blocks being written
    low = [mgr.reserve(bulk, lid, 16, priority=-100) for _ in range(4)]
    assert all(d.outcome is Outcome.DEFERRED for d in low)
    same = mgr.reserve(bulk, lid, 16, priority=-100)  # no lower one to displace: refused, as before
    assert same.outcome is Outcome.REJECTED and "queue is full" in same.reason
    high = mgr.reserve(vip, lid, 16, priority=100)
    assert high.outcome is Outcome.DEFERRED and high.position == 0
    # The latest of the lowest priority left the queue, and its client is told why.
    with pytest.raises(ReservationError, match="displaced from the full deferred queue"):
        mgr.reservation_status(bulk, low[-1].reservation_id)
    assert [mgr.reservation_status(bulk, d.reservation_id).outcome for d in low[:3]] == [Outcome.DEFERRED] * 3
    mgr.free(w, held[:1])
    assert mgr.reservation_status(vip, high.reservation_id).outcome is Outcome.GRANTED
    totals = mgr.stats()["reservations"]
    # (the displaced one was deferred: an ending of its own, not a second decision; counted rejected
    # too, the decisions outnumbered the calls, a review)
    assert (totals["total_rejected"], totals["total_deferred"], totals["total_displaced"]) == (1, 5, 1)
    mgr.check_invariants()


def test_a_reservation_whose_blocks_were_all_taken_says_so(make_manager, clock):
    """Before, a take past the last block, a poll and a cancel each said "unknown, expired or
    cancelled": an engine whose request outgrew its estimate took the wrong path."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, 16 * 3)
    mgr.take(a, d.reservation_id, 2)
    mgr.take(a, d.reservation_id, 1)
    with pytest.raises(ReservationError, match="all its 3 blocks were taken already, asked for 1 more"):
        mgr.take(a, d.reservation_id, 1)
    polled = mgr.reservation_status(a, d.reservation_id)
    assert polled.outcome is Outcome.GRANTED and "all 3 blocks taken" in polled.reason
    mgr.cancel(a, d.reservation_id)  # nothing to give back: no error, not counted as cancelled
    assert mgr.stats()["reservations"]["total_cancelled"] == 0
    with pytest.raises(ReservationError, match=r"^reservation \d+ was cancelled after every block was taken "
                                                r"\(nothing to give back: its blocks are the client's\)$"):
        mgr.reservation_status(a, d.reservation_id)
    # One used whole is forgotten at its expiry, not counted as expired.
    e = mgr.reserve(a, lid, 16)
    mgr.take(a, e.reservation_id, 1)
    clock.advance(31.0)  # (settings: reservation_ttl_s 30)
    mgr.tick()
    with pytest.raises(ReservationError, match="unknown, expired or cancelled"):
        mgr.take(a, e.reservation_id, 1)
    assert mgr.stats()["reservations"]["total_expired"] == 0
    mgr.check_invariants()


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
def test_a_take_of_no_block_is_refused(make_manager, n):
    """take(-1) handed out all but the last block and counted `taken` down."""
    mgr = make_manager(hbm_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, 16 * 3)
    with pytest.raises(ValueError, match="at least 1 block"):
        mgr.take(a, d.reservation_id, n)
    res = mgr.admission.granted[d.reservation_id]
    assert (res.remaining, res.taken) == (3, 0)


@pytest.mark.parametrize("root_first", [True, False])
def test_a_chain_let_go_of_a_block_at_a_time_makes_room_in_the_release_that_frees_it(make_manager, root_first):
    """HBM full of one pinned chain, a reservation of 2 blocks waiting. Released root first, each
    block counted as movable while its leaf was held: the tries fell short, each doubled the next
    one's bar, and after the last release the reservation waited for the background step."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=64, admission=settings())
    w, reader, c = mgr.attach("writer"), mgr.attach("reader"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    chain = mgr.commit(w, mgr.allocate(w, lid, 16), keys=list(range(1, 17)))
    mgr.free(w, chain)
    mgr.acquire(reader, list(chain))
    d = mgr.reserve(c, lid, 16 * 2)
    assert d.outcome is Outcome.DEFERRED
    order = list(chain) if root_first else list(chain)[::-1]
    for i, vid in enumerate(order, 1):
        mgr.release(reader, [vid])
        if d.reservation_id in mgr.admission.granted:
            break
    assert d.reservation_id in mgr.admission.granted, "granted only by the background step"
    assert i == (16 if root_first else 2)  # (root first, the leaf's release frees the whole chain)
    mgr.check_invariants()


def test_a_chain_idle_but_for_its_pinned_leaf_makes_room_when_the_leaf_is_let_go_of(make_manager):
    """Only the leaf was pinned; the rest of the chain was idle before room was tried, held in HBM
    by the leaf. Its release frees the whole chain, which counted one block before."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=64, admission=settings())
    w, reader, c = mgr.attach("writer"), mgr.attach("reader"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    chain = mgr.commit(w, mgr.allocate(w, lid, 16), keys=list(range(1, 17)))
    mgr.free(w, chain)
    mgr.acquire(reader, [chain[-1]])
    d = mgr.reserve(c, lid, 16 * 3)
    assert d.outcome is Outcome.DEFERRED
    mgr.release(reader, [chain[-1]])
    assert d.reservation_id in mgr.admission.granted, "granted only by the background step"
    mgr.check_invariants()


def test_spent_reservations_are_kept_within_a_bound_and_never_scanned(make_manager, clock, monkeypatch):
    """Kept until their expiry, they were scanned whole at each call once the first had expired (25
    times the cost per request at 1,000 a second, a review's script), with no bound on their number."""
    from dflash2.reservations import ended

    monkeypatch.setattr(ended, "SPENT_KEPT", 8)
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    ids = []
    for _ in range(20):
        d = mgr.reserve(a, lid, 16)
        mgr.free(a, mgr.take(a, d.reservation_id, 1))
        ids.append(d.reservation_id)
    assert list(mgr.admission._ended.spent) == ids[-8:]
    with pytest.raises(ReservationError, match="unknown, expired or cancelled"):
        mgr.take(a, ids[0], 1)
    with pytest.raises(ReservationError, match="all its 1 blocks were taken"):
        mgr.take(a, ids[-1], 1)
    clock.advance(31.0)
    d = mgr.reserve(a, lid, 16)
    mgr.free(a, mgr.take(a, d.reservation_id, 1))
    assert list(mgr.admission._ended.spent) == [d.reservation_id]  # (the expired ones pruned as it came)


def test_a_reservation_past_its_deadline_holds_no_allocation_back(make_manager, clock):
    """A review's script: a deferred reservation past its deadline held `allocate` back until the next
    background step (a whole `policy.rescore_interval_ms`), refused as "held for 1 reservation(s)
    waiting", though its client's poll was told it had expired."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    w, b, c = mgr.attach("writer"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 6)  # blocks being written: two free
    waiting = mgr.reserve(b, lid, 16 * 4, deadline=clock() + 0.3)
    assert waiting.outcome is Outcome.DEFERRED
    assert mgr.allocate(c, lid, 2) is None  # held back while it may still be granted
    clock.advance(0.6)
    vids = mgr.allocate(c, lid, 2)
    assert vids is not None, mgr.allocate_refusal
    assert mgr.admission.counters["expired"] == 1 and not mgr.admission.deferred
    mgr.check_invariants()


def test_a_reservation_that_expired_or_was_cancelled_says_so(make_manager, clock):
    # A review: an expired reservation answered "unknown, expired or cancelled", so its client could
    # not tell whether to reserve again or look for a bug of its own.
    mgr = make_manager(hbm_blocks=4, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    granted = mgr.reserve(a, lid, 16 * 2)
    mgr.take(a, granted.reservation_id, 1)
    short = mgr.reserve(a, lid, 16, deadline=clock() + 5.0)
    filler = mgr.allocate(a, lid, 1)  # (HBM now full: the next one waits)
    waiting = mgr.reserve(a, lid, 16 * 2)
    assert waiting.outcome is Outcome.DEFERRED, waiting
    clock.advance(6.0)
    with pytest.raises(ReservationError, match=r"reservation \d+ expired \(its client's deadline_s\), granted, "
                                                r"0 of its 1 blocks taken: its room is given back; reserve again"):
        mgr.take(a, short.reservation_id, 1)
    clock.advance(25.0)  # (settings: reservation_ttl_s 30)
    mgr.tick()
    with pytest.raises(ReservationError, match=r"expired \(admission.reservation_ttl_s 30\), granted, 1 of its 2 "
                                                r"blocks taken"):
        mgr.take(a, granted.reservation_id, 1)
    with pytest.raises(ReservationError, match=r"expired \(admission.reservation_ttl_s 30\), while it waited in "
                                                r"the deferred queue"):
        mgr.reservation_status(a, waiting.reservation_id)
    d = mgr.reserve(a, lid, 16)
    mgr.cancel(a, d.reservation_id)
    with pytest.raises(ReservationError, match=r"^reservation \d+ was cancelled$"):
        mgr.take(a, d.reservation_id, 1)
    with pytest.raises(ReservationError, match=r"^reservation 999 is unknown, expired or cancelled$"):
        mgr.take(a, 999, 1)
    mgr.free(a, filler)
    mgr.check_invariants()


def test_how_a_reservation_ended_is_told_to_its_own_client_only(make_manager, clock):
    # A review: another client asking ids in turn was told "reservation 1 expired (its client's
    # deadline_s), granted, 1 of its 2 blocks taken": others' requests, and advice not its own.
    mgr = make_manager(hbm_blocks=4, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, 16 * 2, deadline=clock() + 1.0)
    mgr.take(a, d.reservation_id, 1)
    c = mgr.reserve(a, lid, 16)
    mgr.cancel(a, c.reservation_id)
    clock.advance(2.0)
    for rid in (d.reservation_id, c.reservation_id):
        with pytest.raises(ReservationError, match=rf"^reservation {rid} is unknown, expired or cancelled$"):
            mgr.reservation_status(b, rid)
        with pytest.raises(ReservationError, match=rf"^reservation {rid} is unknown, expired or cancelled$"):
            mgr.take(b, rid, 1)
    with pytest.raises(ReservationError, match=r"expired \(its client's deadline_s\), granted, 1 of its 2 blocks"):
        mgr.reservation_status(a, d.reservation_id)
    with pytest.raises(ReservationError, match=r"was cancelled$"):
        mgr.take(a, c.reservation_id, 1)


def test_a_displaced_reason_outlives_a_flood_of_cancels(make_manager, monkeypatch):
    """Each cancel took a place among the ENDED_KEPT reasons kept: a client that cancels thousands
    a second pushed out at once the reason of a reservation the daemon displaced, which its client
    cannot know unless told. Cancels are kept apart."""
    from dflash2.reservations import ended
    monkeypatch.setattr(ended, "ENDED_KEPT", 8)
    mgr = make_manager(hbm_blocks=4, admission=settings(max_deferred=2))
    w, bulk, vip = mgr.attach("writer"), mgr.attach("batch"), mgr.attach("interactive")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 4)
    low = [mgr.reserve(bulk, lid, 16, priority=-100) for _ in range(2)]
    mgr.reserve(vip, lid, 16, priority=100)  # displaces low[-1]
    for _ in range(3 * 8):
        d = mgr.reserve(vip, lid, 16, priority=100)
        mgr.cancel(vip, d.reservation_id)
    last = d.reservation_id
    with pytest.raises(ReservationError, match="displaced from the full deferred queue"):
        mgr.reservation_status(bulk, low[-1].reservation_id)
    with pytest.raises(ReservationError, match=rf"^reservation {last} was cancelled$"):
        mgr.reservation_status(vip, last)
    with pytest.raises(ReservationError, match=rf"^reservation {last} is unknown, expired or cancelled$"):
        mgr.reservation_status(bulk, last)  # another client's cancel: not told
    mgr.check_invariants()
