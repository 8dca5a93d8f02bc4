"""The deferred queue's indexes (dflash2/reservations/waiting.py): each call of admission finds what
it needs of the waiting reservations without a scan of the queue (before, a deferred reserve, and
with two slot sizes waiting every free, cancel and poll, walked it: 1.8 ms a free at 16,000 waiting),
and every answer is the one a scan gives."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.errors import ReservationError
from dflash2.reservations import Outcome
from dflash2.reservations.records import Reservation
from dflash2.tiers import Tier
from dflash2.reservations.waiting import RunningSums, WaitQueue, served_order

from conftest import SMALL, SMALL_FP8
from reservation_helpers import settings as admission_settings


def _res(i: int, priority: int, client: int, slot: int, hbm: int, expires: float) -> Reservation:
    return Reservation(i, client, 0, 1, priority, expires, 0, 0.0, hbm, slot, slot)


def _counting_scans(monkeypatch) -> list[int]:
    """A list that grows by one at each iteration over any WaitQueue from now on (a scan)."""
    scans = []
    real = WaitQueue.__iter__
    monkeypatch.setattr(WaitQueue, "__iter__", lambda self: scans.append(1) or real(self))
    return scans


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "add", "remove", "due"]), st.integers(-2, 2),
                          st.integers(0, 3), st.sampled_from([8192, 16384, 65536]), st.integers(1, 5),
                          st.integers(0, 10)), max_size=80))
def test_every_answer_is_the_scans(ops):
    queue, model, ids = WaitQueue(), [], itertools.count(1)
    for op, priority, client, slot, kib, when in ops:
        if op == "add":
            res = _res(next(ids), priority, client, slot, kib * 1024, float(when))
            queue.add(res)
            model.append(res)
            model.sort(key=served_order)
        elif op == "remove" and model:
            res = model.pop(when % len(model))
            queue.remove(res)
        elif op == "due":
            gone = queue.remove_due(float(when))
            assert gone == [r for r in model if r.expires <= when]
            model = [r for r in model if r.expires > when]
        assert list(queue) == model and len(queue) == len(model)
        assert queue.problems() == []
        for i, res in enumerate(model):
            assert queue.position(res) == (i, sum(r.hbm_bytes for r in model[:i + 1]))
            assert queue.get(res.id) is res and res.id in queue
        for p in range(-3, 4):
            assert queue.slots_from(p) == {r.slot for r in model if r.priority >= p}
        for c in range(4):
            assert queue.of_client(c) == [r for r in model if r.client == c]
            assert queue.client_bytes(c) == sum(r.hbm_bytes for r in model if r.client == c)
        for s in (8192, 16384, 65536):
            assert queue.line(s) == [r for r in model if r.slot == s]
            for p in range(-3, 4):
                for c in (None, 0, 1):
                    ahead = [r for r in model if r.slot == s and r.priority >= p and r.client != c]
                    assert queue.held_ahead(p, s, c) == (len(ahead), sum(r.hbm_bytes for r in ahead))
        assert queue.firsts() == sorted({r.slot: r for r in reversed(model)}.values(), key=served_order)
        assert queue.slot_count() == len({r.slot for r in model})


def test_the_bytes_up_to_each_are_kept_as_heads_leave_and_others_join(monkeypatch):
    """The running sums survive the head's grant and the last one's cancel without being worked out
    again, through compactions of the entries left before the head."""
    monkeypatch.setattr(RunningSums, "COMPACT", 4)
    queue, model, ids = WaitQueue(), [], itertools.count(1)
    compacted = heads = 0
    for step in range(200):
        if step % 2 == 0 or len(model) < 2:
            res = _res(next(ids), 0, step % 2, 16384, (step % 7 + 1) * 1024, 100.0)
            queue.add(res)
            model.append(res)
        else:
            queue.remove(model.pop(-1 if step % 10 == 9 else 0))
        assert queue._sums._sums is not None  # (never stale: only those changes)
        for i, res in enumerate(model):
            assert queue.position(res) == (i, sum(r.hbm_bytes for r in model[:i + 1]))
        assert queue.problems() == []
        compacted += queue._sums._head < heads
        heads = queue._sums._head
    assert compacted


def test_calls_on_a_long_queue_do_not_scan_it(make_manager, monkeypatch):
    """1,000 reservations of one size wait behind a head that waits on blocks being written, one of
    another size at the back: a reserve, a poll, a free, a cancel and an allocate each look up what
    they need (the queue is never iterated), and the one at the back is still tried on each free."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=64, admission=admission_settings(max_deferred=2000))
    w = mgr.attach("w")
    clients = [mgr.attach(f"c{i}") for i in range(4)]
    big, fp8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.allocate(w, big, 6)
    small = mgr.allocate(w, fp8, 2)
    waiting = [mgr.reserve(clients[i % 4], big, tokens=16 * 3) for i in range(1000)]
    assert all(d.outcome is Outcome.DEFERRED for d in waiting)
    back = mgr.reserve(clients[1], fp8, tokens=16)  # no free 8 KiB slot in a slab in use: waits
    assert back.outcome is Outcome.DEFERRED and back.position == 1000, back
    scans = _counting_scans(monkeypatch)
    d = mgr.reserve(clients[2], big, tokens=16)
    assert d.outcome is Outcome.DEFERRED and d.position == 1001, d
    assert mgr.reservation_status(clients[0], waiting[500].reservation_id).position == 500
    mgr.cancel(clients[3], waiting[3].reservation_id)
    assert mgr.allocate(clients[3], big, 1) is None  # (the room is the queue's)
    mgr.free(w, small[:1])  # a free 8 KiB slot in a slab in use: the one at the back passes
    assert mgr.reservation_status(clients[1], back.reservation_id).outcome is Outcome.GRANTED
    assert scans == []
    monkeypatch.undo()
    mgr.check_invariants()


def test_an_expiry_among_many_waiting_does_not_scan_the_queue(make_manager, clock, monkeypatch):
    """500 reservations wait, each expiring at its own time: a poll that meets one expiry ends it
    through the expiries' heap (before, two passes over the queue and a rebuild of it: 21 ms a poll
    at 16,000 waiting), and the one expired is told so."""
    mgr = make_manager(hbm_blocks=8, admission=admission_settings(max_deferred=1000, reservation_ttl_s=100.0))
    w, c = mgr.attach("w"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 8)
    waiting = []
    for _ in range(500):
        waiting.append(mgr.reserve(c, lid, tokens=16).reservation_id)
        clock.advance(0.01)
    clock.advance(96.0)  # 101 s since the first was made: the first 100 or so are due, the rest not
    scans = _counting_scans(monkeypatch)
    d = mgr.reservation_status(c, waiting[-1])
    assert d.outcome is Outcome.DEFERRED and d.position == len(mgr.admission.deferred) - 1
    assert scans == []
    monkeypatch.undo()
    with pytest.raises(ReservationError, match="expired"):
        mgr.reservation_status(c, waiting[0])
    gone = 500 - len(mgr.admission.deferred)
    assert 90 < gone < 110 and mgr.admission.counters["expired"] == gone
    mgr.check_invariants()


def test_a_reservation_spent_then_given_blocks_back_after_a_stall_still_expires(make_manager, clock):
    """Every block of a granted reservation taken (spent), the daemon stalls (expiries move later,
    the expiries' heap made anew), then a take is undone: the reservation holds its block again and
    must still expire at its (moved) time, giving the block back."""
    mgr = make_manager(hbm_blocks=8, admission=admission_settings(reservation_ttl_s=10.0))
    c = mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(c, lid, tokens=16)
    assert d.outcome is Outcome.GRANTED
    res = mgr.admission.find(d.reservation_id)
    vids = mgr.take(c, d.reservation_id, 1)
    mgr.admission.credit_stall(5.0)
    clock.advance(12.0)  # past its first expiry, before its moved one (15 s)
    mgr.untake(c, res, vids)
    assert mgr.admission.find(d.reservation_id) is res and res.remaining == 1
    clock.advance(4.0)
    mgr.admission.tick()  # (the step's expiry; `find` would end it on its own, past its time)
    assert res.id not in mgr.admission.granted and mgr.admission.counters["expired"] == 1
    assert mgr.table.allocators[Tier.HBM].free_bytes == 8 * 16 * 1024
    mgr.check_invariants()


def test_the_expiries_heap_keeps_about_the_reservations_live(make_manager, clock, monkeypatch):
    """Reservations granted and taken at once (spent) leave their entries in the heap until their
    time; under a day's TTL a steady stream kept one per reservation made that day. The heap is made
    anew from the live ones past twice their number (and 1,024); the spent ones kept here 100."""
    from dflash2.reservations import ended
    monkeypatch.setattr(ended, "SPENT_KEPT", 100)
    mgr = make_manager(hbm_blocks=8, admission=admission_settings(reservation_ttl_s=86400.0))
    c = mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    for _ in range(5000):
        d = mgr.reserve(c, lid, tokens=16)
        mgr.free(c, mgr.take(c, d.reservation_id, 1))
        clock.advance(0.01)
    live = len(mgr.admission._live())
    assert live <= 100 and len(mgr.admission._expiries) <= 2 * live + 1024 + 1
    mgr.check_invariants()


def test_a_rejected_reservation_leaves_no_expiry_behind(make_manager, clock):
    """HBM full, the queue full: reserves refused at once kept their expiry's entry (and the
    reservation) until their time would have come, an hour here (a review: 50,000 refusals kept
    24 MB). Only admitted reservations expire."""
    mgr = make_manager(hbm_blocks=8, admission=admission_settings(max_deferred=4, reservation_ttl_s=3600.0))
    w, c = mgr.attach("w"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 8)
    for _ in range(4):
        assert mgr.reserve(c, lid, tokens=16).outcome is Outcome.DEFERRED
    for _ in range(300):
        assert mgr.reserve(c, lid, tokens=16).outcome is Outcome.REJECTED
        clock.advance(0.001)
    assert len(mgr.admission._expiries) == 4



def test_many_expiring_at_once_keep_the_reasons_of_the_last_ones(make_manager, clock, monkeypatch):
    """More waiting reservations expire together than reasons are kept (ENDED_KEPT): the reasons of
    the last ones are kept, as when each was written and the oldest pushed out; the others are told
    what any unknown reservation is, and every one has ended."""
    from dflash2.reservations import ended
    monkeypatch.setattr(ended, "ENDED_KEPT", 8)
    mgr = make_manager(hbm_blocks=8, admission=admission_settings(max_deferred=100, reservation_ttl_s=10.0))
    w, c = mgr.attach("w"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 8)
    ids = [mgr.reserve(c, lid, tokens=16).reservation_id for _ in range(80)]
    objs = [mgr.admission.find(i) for i in ids]
    clock.advance(11.0)
    mgr.admission.tick()
    assert mgr.admission.counters["expired"] == 80 and all(r.ended for r in objs)
    for i in ids[:72]:
        with pytest.raises(ReservationError, match="unknown, expired or cancelled"):
            mgr.reservation_status(c, i)
    for i in ids[72:]:
        with pytest.raises(ReservationError, match="expired .admission.reservation_ttl_s 10.*deferred queue"):
            mgr.reservation_status(c, i)


def test_a_reservation_with_no_expiry_entry_breaks_the_invariants(make_manager):
    from dflash2.invariants import InvariantViolation
    mgr = make_manager(hbm_blocks=8)
    c = mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    assert mgr.reserve(c, lid, tokens=16).outcome is Outcome.GRANTED
    mgr.check_invariants()
    mgr.admission._expiries.rebuild([])
    with pytest.raises(InvariantViolation, match="no expiry entry: they would never expire"):
        mgr.admission.check_invariants()
