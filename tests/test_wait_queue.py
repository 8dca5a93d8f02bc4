"""The deferred queue's indexes (dflash2/reservations/waiting.py): each call of admission finds what
it needs of the waiting reservations without a scan of the queue (before, a deferred reserve, and
with two slot sizes waiting every free, cancel and poll, walked it: 1.8 ms a free at 16,000 waiting),
and every answer is the one a scan gives."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.reservations import Outcome
from dflash2.reservations.records import Reservation
from dflash2.reservations.waiting import RunningSums, WaitQueue, served_order

from conftest import SMALL, SMALL_FP8
from reservation_helpers import settings as admission_settings


def _res(i: int, priority: int, client: int, slot: int, hbm: int, expires: float) -> Reservation:
    return Reservation(i, client, 0, 1, priority, expires, 0, 0.0, hbm, slot, slot)


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
    scans = []
    real = WaitQueue.__iter__
    monkeypatch.setattr(WaitQueue, "__iter__", lambda self: scans.append(1) or real(self))
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
