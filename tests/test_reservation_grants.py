"""Reservations granted as soon as they fit: on a poll once admission's bucket has refilled, on a
commit or release that leaves the waiting head's blocks movable; honest wait estimates; preemption
by slot size; the costs of polls and of the calls beside a waiting queue."""

import logging

import pytest

from dflash2.errors import NotOwner, ReservationError
from dflash2.reservations import Outcome
from dflash2.tiers import Tier

from conftest import SMALL, SMALL_FP8
from reservation_helpers import count_room_making, settings


def _full_of_idle_blocks(make_manager, clock, **kw):
    """HBM of 40 blocks full of idle cached blocks, DRAM with room; a bucket of 4 blocks that refills
    at 4 blocks a second while a reservation waits (its floor: the burst per 1 s window)."""
    mgr = make_manager(hbm_blocks=40, dram_blocks=80,
                       admission=settings(burst_fraction=0.1, smoothing_window_s=1.0, **kw))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 40), keys=list(range(1, 41))))
    return mgr, a, lid


def test_a_poll_grants_a_deferred_reservation_once_the_bucket_pays_for_its_room(make_manager, clock):
    """Reservations that only the bucket holds back are granted when their client asks after it
    refilled, at the time the deferral estimated, not at the next background step (every
    `policy.rescore_interval_ms`: serial reservations into an HBM full of idle blocks were granted
    about one per step, and waited 2 to 25 times the estimate, a review's script)."""
    mgr, a, lid = _full_of_idle_blocks(make_manager, clock)
    decisions = [mgr.reserve(a, lid, tokens=16 * 2) for _ in range(4)]
    waiting = [d for d in decisions if d.outcome is Outcome.DEFERRED]
    assert waiting, decisions
    head = waiting[0]
    d = mgr.reservation_status(a, head.reservation_id)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s > 0
    clock.advance(d.est_wait_s * 1.01)
    assert mgr.reservation_status(a, head.reservation_id).outcome is Outcome.GRANTED, "no background step ran"
    for d in waiting[1:]:
        now = mgr.reservation_status(a, d.reservation_id)
        if now.outcome is Outcome.DEFERRED:
            clock.advance(now.est_wait_s * 1.01)
            assert mgr.reservation_status(a, d.reservation_id).outcome is Outcome.GRANTED
    assert not mgr.admission.deferred
    mgr.check_invariants()


def test_a_new_reservation_lets_the_head_of_the_queue_go_first_once_it_fits(make_manager, clock):
    """The head's room paid for by now: a reserve behind it grants it first, then queues or grants
    the newcomer in order (it was queued behind a head that fit, both waiting for a step)."""
    mgr, a, lid = _full_of_idle_blocks(make_manager, clock)
    while (d := mgr.reserve(a, lid, tokens=16 * 2)).outcome is Outcome.GRANTED:
        pass
    clock.advance(10)  # the bucket is full again
    late = mgr.reserve(a, lid, tokens=16 * 2)
    assert d.reservation_id in mgr.admission.granted, "the head went first"
    assert late.outcome is Outcome.GRANTED, late
    mgr.check_invariants()


def test_a_poll_of_another_clients_reservation_is_refused_and_grants_nothing(make_manager, clock):
    mgr, a, lid = _full_of_idle_blocks(make_manager, clock)
    b = mgr.attach("b")
    while (d := mgr.reserve(a, lid, tokens=16 * 2)).outcome is Outcome.GRANTED:
        pass
    clock.advance(10)
    with pytest.raises(NotOwner):
        mgr.reservation_status(b, d.reservation_id)
    assert d.reservation_id not in mgr.admission.granted
    with pytest.raises(ReservationError, match="unknown"):
        mgr.reservation_status(a, 10**6)


def test_the_wait_a_burst_is_told_is_not_shorter_than_its_polls_find(make_manager, clock):
    """A burst of reservations into an HBM full of idle blocks, polled every 10 ms with no background
    step: each is granted within the wait its deferral estimated (the estimate took the demand rate
    of the moment, which decays: the last of a burst of 12 were told half their wait)."""
    mgr, a, lid = _full_of_idle_blocks(make_manager, clock, max_deferred=64)
    told = {}
    for _ in range(12):
        d = mgr.reserve(a, lid, tokens=16 * 3)
        if d.outcome is Outcome.DEFERRED:
            told[d.reservation_id] = (clock.now, d.est_wait_s)
    assert len(told) >= 8, told
    waited = {}
    while len(waited) < len(told):
        clock.advance(0.01)
        for rid, (since, _) in told.items():
            if rid not in waited and mgr.reservation_status(a, rid).outcome is Outcome.GRANTED:
                waited[rid] = clock.now - since
    late = {rid: (round(waited[rid], 3), round(est, 3)) for rid, (_, est) in told.items() if waited[rid] > est + 0.011}
    assert not late, f"granted later than told (waited, told): {late}"
    last = max(told)
    assert waited[last] > 0.5 * told[last][1], "the estimate is no wild overstatement either"


def test_preemption_demotes_blocks_of_the_size_it_needs_first(make_manager, clock):
    """HBM pages of 16 KiB, all held by a running priority-0 request: 8 KiB blocks two to a page (an
    old request's beside a hot one's on every page) and 16 KiB blocks. A priority-5 reservation of 16
    blocks of 16 KiB demotes 16 of the 16 KiB blocks; it demoted 48 before, 32 of them 8 KiB blocks
    whose page-mates stayed: moves that made no slot it could use (a review's script)."""
    mgr = make_manager(hbm_blocks=64, dram_blocks=512, admission=settings())
    lo, hi = mgr.attach("lo"), mgr.attach("hi")
    big, fp8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    old, hot = [], []
    for _ in range(32):
        old += list(mgr.allocate(lo, fp8, 1, request=1))
        hot += list(mgr.allocate(lo, fp8, 1, request=2))
    clock.advance(1)
    large = list(mgr.allocate(lo, big, 32, request=3))
    mgr.commit(lo, old, keys=list(range(100, 132)))
    mgr.commit(lo, large, keys=list(range(1000, 1032)))
    mgr.commit(lo, hot, keys=list(range(5000, 5032)))
    clock.advance(1)
    mgr.acquire(lo, hot)
    mgr.release(lo, hot)  # read again: the old request's 8 KiB blocks are the coldest
    clock.advance(1)
    d = mgr.reserve(hi, big, tokens=16 * 16, priority=5)
    assert d.outcome is Outcome.GRANTED, d
    down = {name: sum(mgr.place(int(v)).tier == Tier.DRAM for v in vids)
            for name, vids in (("old 8 KiB", old), ("hot 8 KiB", hot), ("16 KiB", large))}
    assert down == {"old 8 KiB": 0, "hot 8 KiB": 0, "16 KiB": 16}, down
    mgr.check_invariants()


def test_room_for_one_size_falls_back_to_blocks_of_another_when_its_own_are_too_few(make_manager):
    """Idle 8 KiB blocks only (whole pages of them): making room for 16 KiB blocks demotes them, by
    pages, when no 16 KiB block can go."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=64, admission=settings())
    a = mgr.attach("a")
    big, fp8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, fp8, 16), keys=list(range(1, 17))))
    d = mgr.reserve(a, big, tokens=16 * 2)
    assert d.outcome is Outcome.GRANTED, d
    assert mgr.stats()["tiers"]["dram"]["blocks"] >= 4
    mgr.check_invariants()


def test_polls_at_many_priorities_scan_the_table_once_a_step(make_manager, monkeypatch):
    """Reservations waiting at many priorities, each polled after a background step: one count of
    what could move for them all (a count per priority polled cost 4 ms each at a million blocks)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, admission=settings(max_deferred=64))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(a, lid, 8)  # being written: nothing can move
    waiting = [mgr.reserve(mgr.attach(f"c{p}"), lid, tokens=16, priority=p) for p in range(-3, 9)]
    assert all(d.outcome is Outcome.DEFERRED for d in waiting)
    scans = []
    movable = mgr.placement.movable
    monkeypatch.setattr(mgr.placement, "movable", lambda *args, **kw: scans.append(1) or movable(*args, **kw))
    mgr.tick()
    scans.clear()
    for d in waiting:
        res = mgr.admission.find(d.reservation_id)
        assert mgr.reservation_status(res.client, d.reservation_id).est_wait_s is None
    assert len(scans) <= 2, f"{len(scans)} whole-table passes for {len(waiting)} polls"


def test_a_commit_of_blocks_the_head_may_preempt_grants_it_at_once(make_manager, clock):
    """HBM all being written by a priority-0 request; a priority-5 reservation waits on it. The
    writer commits and keeps its blocks (running, preemptable now): granted by that commit, not at
    the next background step (its polls, and other clients' reserves, found it still waiting)."""
    mgr = make_manager(hbm_blocks=64, dram_blocks=256, admission=settings())
    w, h = mgr.attach("writer"), mgr.attach("high")
    lid = mgr.register_layout(SMALL)
    written = mgr.allocate(w, lid, 64, priority=0)
    d = mgr.reserve(h, lid, tokens=16 * 4, priority=5)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
    mgr.commit(w, written[:2])  # two blocks: not enough yet
    assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.DEFERRED
    mgr.commit(w, written[2:])
    assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_release_that_leaves_blocks_idle_grants_the_waiting_head_at_once(make_manager, clock):
    """HBM full of cached blocks a reader has pinned: the reservation waits; the reader's release
    leaves them idle, and grants it in that call."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=32, admission=settings())
    a, r, b = mgr.attach("a"), mgr.attach("reader"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    cached = mgr.commit(a, mgr.allocate(a, lid, 8), keys=list(range(1, 9)))
    mgr.free(a, cached)
    assert mgr.acquire(r, cached) is not None
    d = mgr.reserve(b, lid, tokens=16 * 2)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
    mgr.release(r, cached)
    assert mgr.reservation_status(b, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


class _CopiesStillRunning:
    """A drain piece's copies in flight past the park deadline (rebalance.py `end_soon`)."""
    prepared: list = []

    def done(self) -> bool:
        return False


@pytest.mark.parametrize("call", ["release", "commit"])
def test_a_call_that_leaves_blocks_movable_while_copies_run_leaves_the_grant_to_the_step(make_manager, caplog,
                                                                                        call):
    """Served by the loop (parking on) while a drain piece's copies run past the park deadline: a
    release (or commit) that leaves the waiting head's blocks movable has done its work and cannot
    be parked, so its grant waits for the next step. Its follow-up met the copies (CopiesRunning,
    the signal to park a call that changed nothing), which was logged as an ERROR with a traceback
    and noted as a failure, so the daemon checked its whole tables before the next call (a review's
    stress: concurrent clients with reservations while DRAM drained)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=32, admission=settings())
    a, r, b = mgr.attach("a"), mgr.attach("reader"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    if call == "release":
        cached = mgr.commit(a, mgr.allocate(a, lid, 8), keys=list(range(1, 9)))
        mgr.free(a, cached)
        assert mgr.acquire(r, cached) is not None
    else:  # (blocks being written, which a commit leaves preemptable for a head of higher priority)
        written = mgr.allocate(a, lid, 8)
    d = mgr.reserve(b, lid, tokens=16 * 2, priority=5)
    assert d.outcome is Outcome.DEFERRED
    mgr.placement._in_flight.append((_CopiesStillRunning(), lambda: None))
    mgr.placement.parking = True
    try:
        with caplog.at_level(logging.ERROR):
            if call == "release":
                mgr.release(r, cached)
            else:
                mgr.commit(a, written, keys=list(range(1, 9)))
    finally:
        mgr.placement.parking = False
        mgr.placement._in_flight.clear()
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not mgr.failures
    mgr.tick()
    assert mgr.reservation_status(b, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_commits_beside_a_head_whose_room_cannot_be_made_do_not_each_make_room(make_manager):
    """The head's room cannot be made (DRAM full of blocks being written, no NVMe) while commits of
    preemptable blocks go on: room-making is retried after twice as many each time it fails, not
    after every commit (each one scanned the whole table: 5.9 ms a one-block commit at 131,072
    blocks against 0.016 with no queue, a review's script)."""
    mgr = make_manager(hbm_blocks=256, dram_blocks=8, admission=settings())
    w, h = mgr.attach("w"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 8, tier=Tier.DRAM)  # DRAM full: nothing can go down
    mgr.commit(w, mgr.allocate(w, lid, 192, priority=0))
    pending = mgr.allocate(w, lid, 64, priority=0)
    d = mgr.reserve(h, lid, tokens=16, priority=5)
    assert d.outcome is Outcome.DEFERRED
    made = count_room_making(mgr)
    for v in pending:
        mgr.commit(w, [v])
    # About log2(64) retries, each up to three passes (idle blocks; its own size; any size).
    assert mgr.admission.deferred and len(made) <= 3 * 8, f"{len(made)} room-makings for 64 commits"


def _head_behind_running_blocks_with_no_room_below(mgr):
    """HBM full of a priority-0 request's running blocks, DRAM (the last tier) full of another
    client's: a priority-5 reservation may preempt the running blocks but they have nowhere to go."""
    w, d, h = mgr.attach("w"), mgr.attach("dram-writer"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    mgr.commit(w, mgr.allocate(w, lid, 8, priority=0), keys=list(range(1, 9)))
    below = mgr.allocate(d, lid, 8, tier=Tier.DRAM)
    res = mgr.reserve(h, lid, tokens=16 * 4, priority=5)
    assert res.outcome is Outcome.DEFERRED and "no room for them in the tiers below" in res.reason
    return d, h, below, res


@pytest.mark.parametrize("let_go", ["free", "release", "detach"])
def test_room_let_go_of_below_hbm_grants_a_head_that_may_preempt_at_once(make_manager, let_go):
    """The head waits on running blocks it may preempt but that the tier below has no room for; a
    free of that tier's blocks, a reader's release of its pins there (leaves of a chain: droppable
    then) or its client's detach makes that room. Granted in that call: it waited for the background
    step (2.4 s with `policy.rescore_interval_ms` 3000, a review's script), as only blocks let go of
    in HBM set off another try."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=8, admission=settings())
    d, h, below, res = _head_behind_running_blocks_with_no_room_below(mgr)
    if let_go == "release":
        cached = mgr.commit(d, below, keys=list(range(100, 108)))
        mgr.acquire(d, cached, up_to=Tier.DRAM)
        mgr.free(d, cached)
        mgr.release(d, cached[4:])  # the chain's last four: idle, and droppable from the last tier
    elif let_go == "free":
        mgr.free(d, below[:4])
    else:
        mgr.detach(d)
    assert res.reservation_id in mgr.admission.granted, "granted by that call, not at the next step"
    mgr.check_invariants()


@pytest.mark.parametrize("let_go", ["cancel", "take and free", "expiry"])
def test_a_granted_reservations_room_let_go_of_grants_the_head_beside_idle_blocks_at_once(make_manager, clock,
                                                                                           let_go):
    """HBM half one client's granted, untaken reservation, half idle cached blocks; a reservation of
    three quarters waits, told it waits until that client takes and frees those blocks or cancels
    them, or they expire. Nothing was moved at its try (not all of its room could be made); the
    cancel, the take and free, or a poll past the expiry grants it in that call, demoting the idle
    blocks. It waited for the background step: a free of slots moved nothing (a review's script,
    1.9 s with `policy.rescore_interval_ms` 3000)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=32, admission=settings())
    a, w, b = mgr.attach("a"), mgr.attach("w"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    held = mgr.reserve(a, lid, tokens=16 * 4, deadline=clock() + 1.0)
    assert held.outcome is Outcome.GRANTED
    mgr.free(w, mgr.commit(w, mgr.allocate(w, lid, 4), keys=[1, 2, 3, 4]))
    d = mgr.reserve(b, lid, tokens=16 * 6)
    assert d.outcome is Outcome.DEFERRED and "or cancel them" in d.reason, d
    if let_go == "cancel":
        mgr.cancel(a, held.reservation_id)
    elif let_go == "expiry":
        clock.advance(1.5)
        assert mgr.reservation_status(b, d.reservation_id).outcome is Outcome.GRANTED
    else:
        mgr.free(a, mgr.take(a, held.reservation_id, 4))
    assert d.reservation_id in mgr.admission.granted, "granted by that call, not at the next step"
    mgr.check_invariants()


def test_a_release_grants_the_head_in_that_call_however_many_background_steps_it_waited(make_manager):
    """Every block of HBM pinned by a reader; the head waits through background steps, each failing
    to make room. Each doubled what a release had to leave movable before room was made again: after
    six, more than HBM holds, and the release of every pin granted nothing until the next step (up to
    `policy.rescore_interval_ms`, a review). Only the retries a release asks for raise that bar."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=64, admission=settings())
    w, r, h = mgr.attach("w"), mgr.attach("r"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    vids = [int(v) for k in range(16) for v in mgr.commit(w, mgr.allocate(w, lid, 1), keys=[100 + k])]
    mgr.free(w, vids)
    mgr.acquire(r, vids)
    d = mgr.reserve(h, lid, tokens=16 * 4)
    assert d.outcome is Outcome.DEFERRED
    for _ in range(12):
        mgr.tick()  # the background step: room-making falls short each time
        assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.DEFERRED
    mgr.release(r, vids)
    assert d.reservation_id in mgr.admission.granted, "granted by the release, not at the next step"
    mgr.check_invariants()


def test_a_release_that_frees_a_pinned_copy_succeeds_while_a_reservation_waits(make_manager):
    """The writer pinned its block, and its commit deduplicated it onto a cached twin: the release
    frees that copy. With a reservation waiting, the release asked the table for the freed block's
    row afterwards and failed (UnknownBlock) although it had done its work, and so did a retry."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=16, admission=settings())
    a, b, h = mgr.attach("a"), mgr.attach("b"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1), keys=[7]))
    copy = mgr.allocate(b, lid, 1)
    mgr.acquire(b, copy)
    mgr.commit(b, copy, keys=[7])
    mgr.allocate(a, lid, 2)
    assert mgr.reserve(h, lid, tokens=16 * 4).outcome is Outcome.DEFERRED
    mgr.release(b, copy)
    mgr.check_invariants()


def test_room_freed_since_counts_toward_the_heads_shortfall(make_manager):
    """The head needs 8 blocks; nothing could move. A free gives 4 slots, then a commit leaves 4
    blocks it may preempt: granted by that commit (the shortfall counted from the first attempt
    kept it waiting for the background step)."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=64, admission=settings())
    w, y, h = mgr.attach("w"), mgr.attach("y"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    writing = mgr.allocate(w, lid, 8, priority=0)
    mine = mgr.commit(y, mgr.allocate(y, lid, 8, priority=9))
    d = mgr.reserve(h, lid, tokens=16 * 8, priority=5)
    assert d.outcome is Outcome.DEFERRED
    mgr.free(y, mine[:4])
    assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.DEFERRED
    mgr.commit(w, writing[:4])
    assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_blocks_room_making_moved_are_not_counted_movable_again(make_manager, clock):
    """A priority-0 reservation waits (its count of what could move taken); a priority-5 one
    preempts the only blocks it could and is still short: no wait estimate (it was told 0.0, the
    moved blocks counted as room and as movable, until the next step)."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=64, admission=settings())
    w, y, lo, hi = mgr.attach("w"), mgr.attach("y"), mgr.attach("lo"), mgr.attach("hi")
    lid = mgr.register_layout(SMALL)
    mgr.commit(w, mgr.allocate(w, lid, 4, priority=0))
    mgr.commit(y, mgr.allocate(y, lid, 4, priority=9))
    mgr.allocate(y, lid, 8, priority=9)
    assert mgr.reserve(lo, lid, tokens=16 * 8, priority=0).outcome is Outcome.DEFERRED
    d = mgr.reserve(hi, lid, tokens=16 * 8, priority=5)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None, d
    clock.advance(0.05)
    assert mgr.reservation_status(hi, d.reservation_id).est_wait_s is None


def test_only_blocks_the_head_could_move_make_room_for_it_again(make_manager):
    """Calls that leave blocks the waiting head cannot move (still pinned by another reader; of its
    own priority or higher; of another slot size) make no room for it; the call that leaves its
    blocks movable does, and grants it."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=64, admission=settings())
    r1, r2, w, h = mgr.attach("r1"), mgr.attach("r2"), mgr.attach("w"), mgr.attach("h")
    lid, fp8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    cached = mgr.commit(w, mgr.allocate(w, lid, 4), keys=[1, 2, 3, 4])
    mgr.free(w, cached)
    assert mgr.acquire(r1, cached) is not None and mgr.acquire(r2, cached) is not None
    same = mgr.allocate(w, lid, 4, priority=5)
    small = mgr.allocate(w, fp8, 8, priority=0)  # 8 KiB blocks: four pages
    lower = mgr.allocate(w, lid, 4, priority=0)
    d = mgr.reserve(h, lid, tokens=16 * 4, priority=5)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
    made = count_room_making(mgr)
    mgr.release(r1, cached)  # still pinned by r2
    mgr.commit(w, same)  # running at the head's own priority: not preemptable by it
    mgr.commit(w, small)  # preemptable, but 8 KiB: no 16 KiB slot of their own
    assert made == [] and mgr.reservation_status(h, d.reservation_id).outcome is Outcome.DEFERRED
    mgr.commit(w, lower)
    assert made and mgr.reservation_status(h, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_release_by_the_last_reader_makes_room_for_the_head(make_manager):
    mgr = make_manager(hbm_blocks=4, dram_blocks=16, admission=settings())
    r1, r2, w, h = mgr.attach("r1"), mgr.attach("r2"), mgr.attach("w"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    cached = mgr.commit(w, mgr.allocate(w, lid, 4), keys=[1, 2, 3, 4])
    mgr.free(w, cached)
    assert mgr.acquire(r1, cached) is not None and mgr.acquire(r2, cached) is not None
    d = mgr.reserve(h, lid, tokens=16 * 2)
    assert d.outcome is Outcome.DEFERRED
    mgr.release(r1, cached)
    assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.DEFERRED
    mgr.release(r2, cached)
    assert mgr.reservation_status(h, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_an_acquire_refused_by_granted_reservations_names_them(make_manager):
    """HBM is all one client's granted, untaken reservation; another's acquire of blocks cached in DRAM
    is refused (nothing can move: the slots are RESERVED). It was told HBM was full of blocks being
    written or pinned, of which there were none (a review): the reservations are named."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    w, r, h = mgr.attach("w"), mgr.attach("r"), mgr.attach("h")
    lid = mgr.register_layout(SMALL)
    cached = mgr.commit(w, mgr.allocate(w, lid, 2, tier=Tier.DRAM), keys=[11, 12])
    mgr.free(w, cached)
    assert mgr.reserve(h, lid, tokens=16 * 4).outcome is Outcome.GRANTED
    assert mgr.acquire(r, cached) is None
    slot = mgr.table.slot_bytes(lid, Tier.HBM)
    assert f"and of 1 granted reservation(s) not yet taken ({4 * slot} bytes)" in mgr.acquire_refusal, \
        mgr.acquire_refusal
    assert "released, freed, taken or cancelled" in mgr.acquire_refusal
    mgr.check_invariants()
