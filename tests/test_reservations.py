import pytest

from dflash2.errors import NotOwner, ReservationError
from dflash2.reservations import Outcome
from dflash2.tiers import Tier

from conftest import SMALL
from reservation_helpers import settings

BLOCK = 16384


def test_granted_blocks_are_reserved_then_taken(make_manager):
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, tokens=40)  # 16 tokens per block -> 3 blocks
    assert d.outcome is Outcome.GRANTED
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 3
    vids = mgr.take(a, d.reservation_id, 2)
    mgr.commit(a, vids)
    with pytest.raises(ReservationError, match="1 blocks left"):
        mgr.take(a, d.reservation_id, 2)
    mgr.check_invariants()


def test_a_commit_of_a_block_still_in_its_reservation_says_to_take_it_first(make_manager):
    """As free, acquire and add_ref say (refuse_reserved); before, commit answered that RESERVED ->
    RESIDENT is no legal transition."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, tokens=32)
    guessed = mgr.admission.granted[d.reservation_id].vids[:1]
    with pytest.raises(ReservationError, match="take it from the reservation"):
        mgr.commit(a, guessed, keys=[7])
    assert list(mgr.take(a, d.reservation_id, 2))[:1] == guessed, "still the reservation's to hand out"
    mgr.check_invariants()


def test_a_free_of_a_block_in_another_clients_reservation_is_not_owner(make_manager):
    """Told to take the block from the reservation first, a client whose reservation it is not
    could not: it is another client's block (a review). Its owner still hears to take it first."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, tokens=32)
    guessed = mgr.admission.granted[d.reservation_id].vids[:1]
    with pytest.raises(NotOwner, match="in a reservation of another client"):
        mgr.free(b, guessed)
    with pytest.raises(ReservationError, match="take it from the reservation"):
        mgr.free(a, guessed)
    assert list(mgr.take(a, d.reservation_id, 2))[:1] == guessed
    mgr.check_invariants()


def test_reject_when_it_can_never_fit_and_names_why(make_manager):
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, tokens=16 * 9)
    assert d.outcome is Outcome.REJECTED and "HBM tier holds" in d.reason
    with pytest.raises(ValueError):
        mgr.reserve(a, lid, tokens=0)


def test_client_share_is_enforced(make_manager):
    mgr = make_manager(hbm_blocks=8, admission=settings(max_client_share=0.5))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    assert mgr.reserve(a, lid, tokens=16 * 4).outcome is Outcome.GRANTED
    d = mgr.reserve(a, lid, tokens=16)
    assert d.outcome is Outcome.REJECTED and "share" in d.reason


def test_deferred_when_full_then_granted_after_release(make_manager):
    mgr = make_manager(hbm_blocks=4, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    held = mgr.allocate(a, lid, 4)  # private blocks being written: not movable
    d = mgr.reserve(b, lid, tokens=32)
    assert d.outcome is Outcome.DEFERRED and d.position == 0
    d2 = mgr.reserve(b, lid, tokens=16)
    assert d2.outcome is Outcome.DEFERRED and d2.position == 1
    mgr.free(a, held[:2])  # frees two blocks; the queue is served in order
    assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
    assert mgr.admission.status(d2.reservation_id).outcome is Outcome.DEFERRED
    mgr.free(a, held[2:])
    assert mgr.admission.status(d2.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_reservation_behind_blocks_that_cannot_move_has_no_wait_estimate(make_manager):
    """HBM full of blocks being written: demotion cannot make room, so no wait can be estimated
    (the bucket's credit says nothing about it) and the reason says what it waits for."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    held = mgr.allocate(a, lid, 4)
    d = mgr.reserve(b, lid, tokens=32)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
    assert "cannot move now" in d.reason and "waits for their clients to release them" in d.reason
    mgr.commit(a, held[:2])
    mgr.free(a, held[:2])  # two idle blocks now: demoting them makes the room
    assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
    d = mgr.reserve(b, lid, tokens=16)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None  # the other two are still written


def test_a_reservation_behind_running_blocks_it_may_not_preempt_is_told_so(make_manager):
    """Running blocks of its own priority (or any, with preemption off) hold HBM: the reason said
    "being written, pinned, or of higher priority", where none was any of those (a review's script)."""
    for preemption, priority, says in ((True, 0, "held by running requests of priority 0 or above"),
                                       (False, 5, "held by running requests, none preempted here")):
        mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings(preemption=preemption))
        a, b = mgr.attach("a"), mgr.attach("b")
        lid = mgr.register_layout(SMALL)
        mgr.commit(a, mgr.allocate(a, lid, 4), keys=[11, 12, 13, 14])  # running, priority 0, not pinned
        d = mgr.reserve(b, lid, tokens=32, priority=priority)
        assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
        assert says in d.reason and "of higher priority" not in d.reason, d.reason
        mgr.check_invariants()


def test_no_room_is_made_for_a_reservation_that_could_not_be_granted(make_manager):
    """Blocks being written hold the rest of HBM: making room for the reservation demoted every idle
    block (dropped them from the cache, where HBM is the last tier) and preempted the running ones of
    lower priority, and it still waited; as for `allocate`, nothing moves until the room could be
    made in full (a review's script)."""
    for dram_blocks in (0, 8):
        mgr = make_manager(hbm_blocks=8, dram_blocks=dram_blocks, admission=settings())
        a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
        lid = mgr.register_layout(SMALL)
        written = mgr.allocate(a, lid, 5)  # being written: they cannot move
        held = mgr.commit(c, mgr.allocate(c, lid, 3), keys=[101, 102, 103])  # running, priority 0
        if not dram_blocks:
            mgr.free(c, held)  # idle, cached: the last tier drops them to make room
        d = mgr.reserve(b, lid, tokens=64, priority=5)  # 4 blocks: 3 may move, 5 may not
        assert d.outcome is Outcome.DEFERRED and "cannot move now" in d.reason
        assert mgr.reservation_status(b, d.reservation_id).outcome is Outcome.DEFERRED
        rows = mgr.lookup_rows([101, 102, 103], lid, client=c)
        assert len(rows) == 3 and (mgr.table.cols.tier[rows] == int(Tier.HBM)).all()
        mgr.free(a, written[:1])  # one slot free: with the three that may move, the room can be made
        mgr.tick()
        assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
        mgr.check_invariants()


def test_running_blocks_may_go_where_a_backing_off_tier_below_lets_parents_be_dropped(make_manager):
    """NVMe backs off; DRAM (the last tier meanwhile) holds 4 idle cached parents of blocks on NVMe and
    4 running blocks. Making room in DRAM drops such parents with their children (backoff.py), so 4 of
    HBM's running blocks may go down: a priority-5 reservation of 4 was told "no room for them in
    the tiers below", no estimate, where only pacing held it back (a review's script); unpaced, it
    is granted."""
    for paced in (True, False):
        admission = settings(burst_fraction=0.01, smoothing_window_s=100.0) if paced else settings()
        mgr = make_manager(hbm_blocks=8, dram_blocks=8, nvme_blocks=8, admission=admission)
        a, w, b, o = mgr.attach("a"), mgr.attach("w"), mgr.attach("b"), mgr.attach("o")
        lid = mgr.register_layout(SMALL)
        for i in range(4):
            chain = mgr.commit(o, mgr.allocate(o, lid, 2, tier=Tier.DRAM), keys=[1000 + i, 2000 + i])
            mgr.free(o, chain)
            mgr.placement._demote(mgr.table.rows(chain[1:]), Tier.DRAM, Tier.NVME, None)
        mgr.commit(w, mgr.allocate(w, lid, 4, tier=Tier.DRAM), keys=list(range(500, 504)))  # running in DRAM
        rows = mgr.table.rows(mgr.commit(a, mgr.allocate(a, lid, 6), keys=list(range(100, 106))))
        mgr.allocate(w, lid, 2)  # being written
        mgr.placement._start_backoff(Tier.NVME)
        d = mgr.reserve(b, lid, tokens=16 * 4, priority=5)
        if paced:
            assert d.outcome is Outcome.DEFERRED and d.reason == "not enough HBM free yet", d
            assert d.est_wait_s is not None and d.est_wait_s > 0, d
        else:
            assert d.outcome is Outcome.GRANTED, d
            assert int((mgr.table.cols.tier[rows] == int(Tier.HBM)).sum()) == 2
        mgr.check_invariants()


def test_parents_whose_descendants_below_are_held_are_not_counted_droppable_while_a_tier_backs_off(make_manager):
    """As above, but each parent's child on NVMe is still referenced by its writer: neither may be
    dropped (`_droppable`), so the 4 parents give no room; counted droppable, the reservation was
    told "not enough HBM free yet", 0 s, at every poll (a review)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=8, nvme_blocks=8, admission=settings())
    a, w, b, o = mgr.attach("a"), mgr.attach("w"), mgr.attach("b"), mgr.attach("o")
    lid = mgr.register_layout(SMALL)
    for i in range(4):
        chain = mgr.commit(o, mgr.allocate(o, lid, 2, tier=Tier.DRAM), keys=[1000 + i, 2000 + i])
        mgr.free(o, chain[:1])  # (the child, still referenced, goes down)
        mgr.placement._demote(mgr.table.rows(chain[1:]), Tier.DRAM, Tier.NVME, None)
    mgr.commit(w, mgr.allocate(w, lid, 4, tier=Tier.DRAM), keys=list(range(500, 504)))  # running in DRAM
    mgr.commit(a, mgr.allocate(a, lid, 6), keys=list(range(100, 106)))
    mgr.allocate(w, lid, 2)  # being written
    mgr.placement._start_backoff(Tier.NVME)
    assert mgr.placement.room_below(Tier.HBM) == 0
    d = mgr.reserve(b, lid, tokens=16 * 4, priority=5)
    assert d.outcome is Outcome.DEFERRED and "no room for them in the tiers below" in d.reason, d
    mgr.check_invariants()


def test_a_reservation_behind_the_queue_is_told_it_waits_behind_it(make_manager):
    """HBM of 8 blocks: a's reservation of 2 granted, untaken; b's of 8 waits on it; c's of 4 fits in
    the 6 free blocks but waits behind b. c was told of blocks being written, pinned or of higher
    priority, of which HBM held none (a review's script): it waits behind b, and b on a."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=8, admission=settings())
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    assert mgr.reserve(a, lid, tokens=16 * 2).outcome is Outcome.GRANTED
    head = mgr.reserve(b, lid, tokens=16 * 8)
    assert head.outcome is Outcome.DEFERRED and head.est_wait_s is None
    assert head.reason.startswith(f"HBM is held by 1 granted reservation(s) not yet taken ({2 * BLOCK} bytes)")
    behind = mgr.reserve(c, lid, tokens=16 * 4)
    assert behind.outcome is Outcome.DEFERRED and behind.position == 1 and behind.est_wait_s is None
    assert "cannot move" not in behind.reason, behind.reason
    assert behind.reason.startswith(f"waits behind 1 reservation(s) queued ahead of it ({8 * BLOCK} bytes)")
    assert "no wait estimate" in behind.reason
    assert mgr.admission.status(behind.reservation_id).reason == behind.reason  # a poll says the same
    mgr.check_invariants()


def test_a_reservation_behind_its_own_clients_granted_room_is_told_they_are_its_own(make_manager):
    """HBM of 4 blocks: a's reservation of 3 granted, untaken; a's next of 2 waits on it. It was told
    it waits until "their clients" take and free those blocks, its own client (a review): it is told
    they are its client's own, which takes (`take`) and frees them or cancels them."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    assert mgr.reserve(a, lid, tokens=16 * 3).outcome is Outcome.GRANTED
    d = mgr.reserve(a, lid, tokens=16 * 2)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
    ttl = mgr.admission.settings.reservation_ttl_s
    assert d.reason == (
        f"HBM is held by 1 granted reservation(s) not yet taken ({3 * BLOCK} bytes), all this client's own: waits "
        "until this client takes (`take`) and frees those blocks or cancels them, or they expire "
        f"(admission.reservation_ttl_s, {ttl:g} s at most)")
    mgr.check_invariants()


def test_idle_cached_blocks_are_demoted_to_make_room(make_manager):
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 4), keys=[1, 2, 3, 4]))
    d = mgr.reserve(a, lid, tokens=32)
    assert d.outcome is Outcome.GRANTED
    assert mgr.stats()["tiers"]["dram"]["blocks"] == 2
    mgr.check_invariants()


def test_priority_preempts_running_lower_priority_blocks(make_manager):
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    lo, hi = mgr.attach("lo"), mgr.attach("hi")
    lid = mgr.register_layout(SMALL)
    running = mgr.commit(lo, mgr.allocate(lo, lid, 4, priority=0))  # referenced, committed, unpinned
    same = mgr.reserve(lo, lid, tokens=16, priority=0)
    assert same.outcome is Outcome.DEFERRED, "equal priority does not preempt running requests"
    mgr.cancel(lo, same.reservation_id)
    d = mgr.reserve(hi, lid, tokens=32, priority=5)
    assert d.outcome is Outcome.GRANTED
    assert sorted(mgr.place(int(v)).tier for v in running).count(Tier.DRAM) == 2
    mgr.check_invariants()


def test_pinned_blocks_are_never_preempted(make_manager):
    mgr = make_manager(hbm_blocks=2, dram_blocks=8, admission=settings())
    lo, hi = mgr.attach("lo"), mgr.attach("hi")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(lo, mgr.allocate(lo, lid, 2))
    mgr.acquire(lo, v)
    assert mgr.reserve(hi, lid, tokens=16, priority=9).outcome is Outcome.DEFERRED


def test_burst_is_smoothed(make_manager, clock):
    """A spike of reservations that each need demotions is paced, not granted all at once."""
    mgr = make_manager(hbm_blocks=40, dram_blocks=80,
                       admission=settings(burst_fraction=0.1, smoothing_window_s=1.0))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 40), keys=list(range(1, 41))))
    outcomes = [mgr.reserve(a, lid, tokens=32).outcome for _ in range(10)]
    granted_now = outcomes.count(Outcome.GRANTED)
    assert 1 <= granted_now < 10, outcomes
    demoted_at_once = mgr.placement.stats.demoted
    assert demoted_at_once <= 0.1 * 40 * 1.5
    deferred = [r.id for r in mgr.admission.deferred]
    d = mgr.admission.status(deferred[0])
    assert d.est_wait_s is not None and d.est_wait_s > 0
    for _ in range(20):
        clock.advance(0.5)
        mgr.tick()
    assert not mgr.admission.deferred, "all granted as the bucket refilled"
    mgr.check_invariants()


def test_expiry_and_client_death(make_manager, clock):
    mgr = make_manager(hbm_blocks=4, admission=settings(reservation_ttl_s=10))
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    g = mgr.reserve(a, lid, tokens=32)
    clock.advance(3)
    d = mgr.reserve(b, lid, tokens=48, deadline=clock() + 100)  # the TTL bounds it: 10 s from now
    assert g.outcome is Outcome.GRANTED and d.outcome is Outcome.DEFERRED
    clock.advance(8)
    mgr.tick()  # a's reservation expired: its blocks went back, b's fits now
    with pytest.raises(ReservationError):
        mgr.take(a, g.reservation_id, 1)
    assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
    with pytest.raises(NotOwner):
        mgr.cancel(a, d.reservation_id)
    assert mgr.detach(b)["reservations"] == 1
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 0
    mgr.check_invariants()


def test_a_reservation_past_its_time_ends_at_once_not_at_the_next_step(make_manager, clock):
    """Past its deadline (or TTL) a reservation is neither granted nor taken, whenever the next
    background step comes (`policy.rescore_interval_ms` may be minutes); its room is free for the
    next reservation. Before, it stayed granted, and was taken, until that step."""
    mgr = make_manager(hbm_blocks=4, admission=settings(reservation_ttl_s=10))
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    short = mgr.reserve(a, lid, tokens=32, deadline=clock() + 0.2)
    ttl = mgr.reserve(b, lid, tokens=32)
    assert short.outcome is Outcome.GRANTED and ttl.outcome is Outcome.GRANTED
    clock.advance(1)
    with pytest.raises(ReservationError, match="expired"):
        mgr.take(a, short.reservation_id, 1)
    with pytest.raises(ReservationError, match="expired"):
        mgr.admission.status(short.reservation_id)
    clock.advance(10)
    with pytest.raises(ReservationError, match="expired"):
        mgr.admission.status(ttl.reservation_id)
    assert mgr.admission.counters["expired"] == 2
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 0, "their blocks went back"
    mgr.check_invariants()


def test_a_new_reservation_takes_the_room_of_one_past_its_time(make_manager, clock):
    mgr = make_manager(hbm_blocks=4, admission=settings(reservation_ttl_s=10))
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    assert mgr.reserve(a, lid, tokens=64, deadline=clock() + 0.2).outcome is Outcome.GRANTED
    clock.advance(1)
    assert mgr.reserve(b, lid, tokens=64).outcome is Outcome.GRANTED, "no step needed to end the first"
    mgr.check_invariants()


def test_deferred_queue_has_a_limit(make_manager):
    mgr = make_manager(hbm_blocks=1, admission=settings(max_deferred=2))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(a, lid, 1)
    assert [mgr.reserve(a, lid, tokens=16).outcome for _ in range(3)] == [
        Outcome.DEFERRED, Outcome.DEFERRED, Outcome.REJECTED]


def test_a_decision_on_the_wire_carries_every_field():
    """The reply of reserve / reservation: every field of the decision, the outcome by its value."""
    import dataclasses

    from dflash2.reservations import Decision
    d = Decision(Outcome.DEFERRED, 7, "HBM is full", position=2, est_wait_s=0.5)
    wire = d.to_dict()
    assert set(wire) == {f.name for f in dataclasses.fields(Decision)}
    assert wire == {"outcome": "deferred", "reservation_id": 7, "reason": "HBM is full", "position": 2,
                    "est_wait_s": 0.5}


def test_polls_of_a_deferred_reservation_scan_the_table_once_per_background_step(make_manager, monkeypatch):
    """Counting the blocks that could move scans the whole table (tens of ms at a million blocks):
    a client polling its deferred reservation reads the count of the last step, not a new scan per
    poll (nor per free, cancel or detach of other clients), and the next step counts again (and
    sees what changed)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    held = mgr.allocate(a, lid, 4)
    mgr.commit(a, held[:2], keys=[1, 2])  # published, still referenced
    scans = []
    movable = mgr.placement.movable
    monkeypatch.setattr(mgr.placement, "movable", lambda *args, **kw: scans.append(1) or movable(*args, **kw))
    d = mgr.reserve(b, lid, tokens=32)
    assert d.est_wait_s is None
    first = len(scans)
    assert first > 0
    for _ in range(10):
        assert mgr.admission.status(d.reservation_id).est_wait_s is None
    assert len(scans) == first
    mgr.detach(c)  # another client's call that grants what fits: not a new count
    assert mgr.admission.status(d.reservation_id).est_wait_s is None
    assert len(scans) == first
    mgr.table.free(a, held[:2])  # idle now, behind the manager's back: no step has run
    assert mgr.admission.status(d.reservation_id).est_wait_s is None  # the last step's count
    mgr.tick()
    assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED


def test_a_free_makes_room_for_the_queue_only_when_it_left_cached_blocks_idle(make_manager, monkeypatch):
    """The head reservation waits on blocks being written: a free of another private block is room
    as it is (no room-making: that would scan the whole table, on every free, for blocks it could
    not move), while a free that leaves a cached block idle makes room from it at once."""
    mgr = make_manager(hbm_blocks=6, dram_blocks=8, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    writing = mgr.allocate(a, lid, 4)
    shared = mgr.commit(a, mgr.allocate(a, lid, 2), keys=[1, 2])  # cached, still referenced
    d = mgr.reserve(b, lid, tokens=16 * 3)
    assert d.outcome is Outcome.DEFERRED
    made = []
    make_room = mgr.placement.make_room
    monkeypatch.setattr(mgr.placement, "make_room", lambda *args, **kw: made.append(1) or make_room(*args, **kw))
    mgr.free(a, writing[:1])  # one slot free: not enough, and nothing newly movable
    assert made == [] and mgr.admission.status(d.reservation_id).outcome is Outcome.DEFERRED
    mgr.free(a, shared)  # two cached blocks idle: demoted for the reservation now, not at the next step
    assert made and mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_cancel_ahead_makes_room_for_the_next_in_line_at_once(make_manager):
    """The head waits on blocks being written; the next in line needs room that demoting idle
    blocks makes. A cancel of the head grants the next one in that call, not a step later (the
    calls that make no block newly movable make room only for a head it was not yet made for)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    held = mgr.allocate(a, lid, 4)
    published = mgr.commit(a, held[:2], keys=[1, 2])
    first = mgr.reserve(b, lid, tokens=16 * 4)
    second = mgr.reserve(c, lid, tokens=16 * 2)
    assert first.outcome is second.outcome is Outcome.DEFERRED
    mgr.table.free(a, published)  # idle now, behind the manager's back (no call has made room since)
    mgr.cancel(b, first.reservation_id)
    assert mgr.admission.status(second.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_free_of_blocks_below_hbm_makes_no_room_for_the_queue(make_manager, monkeypatch):
    """A host-side writer (sglang's store: DRAM blocks committed, then freed) leaves cached blocks
    idle in DRAM: no HBM room comes of them, so the queue's head is not tried again for it."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a, b, host = mgr.attach("a"), mgr.attach("b"), mgr.attach("host")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(a, lid, 4)
    assert mgr.reserve(b, lid, tokens=16 * 2).outcome is Outcome.DEFERRED
    made = []
    make_room = mgr.placement.make_room
    monkeypatch.setattr(mgr.placement, "make_room", lambda *args, **kw: made.append(1) or make_room(*args, **kw))
    for k in range(3):
        stored = mgr.commit(host, mgr.allocate(host, lid, 2, tier=Tier.DRAM), keys=[10 + 2 * k, 11 + 2 * k])
        mgr.free(host, stored)
    assert made == []
    mgr.check_invariants()


@pytest.mark.parametrize("large", [True, False])
def test_reserves_and_promotions_into_a_full_large_hbm_make_room_a_batch_at_a_time(make_manager, clock, monkeypatch,
                                                                                   large):
    """HBM full of idle cached blocks, DRAM with room: on a large tier, reservations and promotions
    of a few blocks each make room a batch at a time (a 1/1024 share of the tier, a swap batch at
    most). Each made room for its own blocks only before: one selection pass over the whole table
    per call (reserve of 32 blocks 6.4 ms at a million blocks against allocate's 0.4, a scale
    review). A small tier (under 65,536 blocks; here the share is patched to make 64 blocks large)
    still makes room for each call's blocks alone: batches changed which blocks stay."""
    import dflash2.placement as placement

    if large:
        monkeypatch.setattr(placement, "ROOM_BATCH_SHARE", 8)  # 8 blocks of the 64
        monkeypatch.setattr(placement, "ROOM_BATCH_MIN", 8)
    m = make_manager(hbm_blocks=64, dram_blocks=256, swap_batch_size=16, admission=settings(burst_fraction=0.5))
    c = m.attach("a")
    lid = m.register_layout(SMALL)
    for k in range(1, 65):  # HBM full of idle cached blocks, aged one tick apart
        clock.advance(1)
        m.free(c, m.commit(c, m.allocate(c, lid, 1), keys=[k]))
    passes = []
    select = m.placement.select
    m.placement.select = lambda *a, **kw: passes.append(1) or select(*a, **kw)
    for i in range(8):
        d = m.reserve(c, lid, tokens=2 * SMALL.tokens_per_block)
        assert d.outcome == Outcome.GRANTED, d
        m.free(c, m.commit(c, m.take(c, d.reservation_id, 2), keys=[1000 + 2 * i, 1001 + 2 * i]))
    assert len(passes) <= 3 if large else len(passes) == 8, f"{len(passes)} selection passes for 8 reservations"
    down = [p.vid for p in m.lookup(list(range(1, 65))) if p.tier == Tier.DRAM]
    assert len(down) >= 8
    passes.clear()
    for v in down[:8]:  # one block at a time up from DRAM into the full HBM
        assert m.acquire(c, [v]) is not None
        m.release(c, [v])
    assert len(passes) <= 3 if large else len(passes) == 8, f"{len(passes)} selection passes for 8 promotions"
    m.check_invariants()
