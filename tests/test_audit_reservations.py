"""Audit of reservation and admission semantics: each test failed before its fix (dflash2/reservations/).

Metadata-only managers on the fake clock; no timing assertions."""

from __future__ import annotations

from dflash2.errors import ReservationError
from dflash2.alloc import blocks_that_fit
from dflash2.reservations import AdmissionSettings, Outcome
from dflash2.tiers import Tier

from conftest import MLA, SMALL

BLOCK = 16384  # SMALL's block and slot in the specs of conftest (one block per page)


def settings(**kw):
    base = dict(smoothing_window_s=1.0, burst_fraction=1.0, reservation_ttl_s=30.0, max_deferred=8)
    base.update(kw)
    return AdmissionSettings(**base)


def hbm_blocks_held(mgr, client) -> int:
    """Blocks in HBM that the client references or pins (its own, and published ones it holds)."""
    holder = mgr.table.clients[client]
    rows = set(holder.refs) | set(holder.pins)
    return sum(1 for r in rows if mgr.table.cols.tier[r] == int(Tier.HBM))


# -- max_client_share ------------------------------------------------------------------------

def test_deferred_reservations_of_a_client_count_toward_its_share(make_manager):
    """Each reservation within the share alone, but together past it: the second is rejected, not
    queued to be granted later with the first (a client then held the whole tier at share 0.5)."""
    mgr = make_manager(hbm_blocks=8, admission=settings(max_client_share=0.5))
    a, w, v = mgr.attach("a"), mgr.attach("w"), mgr.attach("v")
    lid = mgr.register_layout(SMALL)
    # The tier is full of other clients' blocks being written (each within its share).
    writing, other = mgr.allocate(w, lid, 4), mgr.allocate(v, lid, 4)
    first = mgr.reserve(a, lid, tokens=16 * 4)
    assert first.outcome is Outcome.DEFERRED
    second = mgr.reserve(a, lid, tokens=16 * 4)
    assert second.outcome is Outcome.REJECTED and "share" in second.reason
    mgr.free(w, writing)
    assert mgr.admission.status(first.reservation_id).outcome is Outcome.GRANTED
    assert hbm_blocks_held(mgr, a) <= 4
    snap = mgr.stats()["reservations"]
    assert (snap["granted"], snap["deferred"], snap["reserved_blocks"]) == (1, 0, 4)
    mgr.check_invariants()


def test_published_blocks_a_running_request_holds_count_toward_the_share(make_manager):
    """The normal flow publishes a request's blocks at commit (content keys) while the request still
    references them: they are held all the same, and a second reservation past the share is rejected."""
    mgr = make_manager(hbm_blocks=8, admission=settings(max_client_share=0.5))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, tokens=16 * 4)
    assert d.outcome is Outcome.GRANTED
    mgr.commit(a, mgr.take(a, d.reservation_id, 4), keys=[11, 12, 13, 14])
    assert hbm_blocks_held(mgr, a) == 4
    more = mgr.reserve(a, lid, tokens=16)
    assert more.outcome is Outcome.REJECTED and "share" in more.reason
    mgr.check_invariants()


def test_share_frees_up_when_the_client_lets_go_of_its_blocks(make_manager):
    """The share counts what is held: once the request frees its (published) blocks they stay cached
    but no longer count, and the client may reserve again."""
    mgr = make_manager(hbm_blocks=8, admission=settings(max_client_share=0.5))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    d = mgr.reserve(a, lid, tokens=16 * 4)
    vids = mgr.commit(a, mgr.take(a, d.reservation_id, 4), keys=[21, 22, 23, 24])
    mgr.free(a, vids)
    assert mgr.reserve(a, lid, tokens=16 * 4).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_the_share_walks_a_clients_references_only_when_their_bound_does_not_settle_it(make_manager, monkeypatch):
    """Each allocate and reserve under max_client_share < 1 walked every block the client references
    (3-5 ms a call at 100k references): the HBM slot bytes of what it references, kept as references
    change, bound what it holds of HBM from above. Under that bound no walk; past it, the walk
    decides as before (blocks referenced below HBM do not count)."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=16, admission=settings(max_client_share=0.5))
    a, host = mgr.attach("a"), mgr.attach("host")
    lid = mgr.register_layout(SMALL)
    walks = []
    walk = mgr.admission.shares.hbm_bytes
    monkeypatch.setattr(mgr.admission.shares, "hbm_bytes", lambda client: walks.append(client) or walk(client))
    running = mgr.allocate(a, lid, 3)
    mgr.commit(a, running[:2], keys=[1, 2])  # published, still referenced: held
    assert mgr.reserve(a, lid, tokens=16 * 2).outcome is Outcome.GRANTED  # 5 of 8 blocks
    assert walks == []
    below = mgr.commit(host, mgr.allocate(host, lid, 6, tier=Tier.DRAM), keys=[10, 11, 12, 13, 14, 15])
    mgr.add_ref(a, below)  # referenced in DRAM: not held in HBM, but the bound counts them
    assert mgr.reserve(a, lid, tokens=16 * 3).outcome is Outcome.GRANTED  # 3 + 2 + 3 in HBM: the walk says so
    assert walks == [a]
    assert mgr.reserve(a, lid, tokens=16).outcome is Outcome.REJECTED
    mgr.free(a, below)
    mgr.free(a, running)
    walks.clear()
    assert mgr.allocate(a, lid, 1) is not None  # 2 + 3 reserved + 1: under the bound again
    assert walks == []
    mgr.check_invariants()


# -- reservations that can never fit -----------------------------------------------------------

def test_reservation_beyond_the_blocks_the_tier_holds_is_rejected_not_queued(make_manager):
    """MLA blocks of 5 KiB take 3 slots of a 16 KiB page (the tail holds none): 64 pages hold 192
    blocks, though 200 blocks' bytes are under the tier's. Such a reservation can never be granted:
    it is rejected with the reason, instead of waiting at the head of the queue (est. wait 0) and
    holding back a one-block reservation of another client in an empty tier."""
    mgr = make_manager(hbm_blocks=64, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    mla = mgr.register_layout(MLA)
    small = mgr.register_layout(SMALL)
    fit = blocks_that_fit(64 * BLOCK, BLOCK, 256, MLA.block_bytes)
    assert fit == 192 and 200 * mgr.table.slot_bytes(mla, Tier.HBM) <= 64 * BLOCK
    d = mgr.reserve(a, mla, tokens=16 * 200)
    assert d.outcome is Outcome.REJECTED and "HBM tier holds" in d.reason and "192 blocks" in d.reason
    one = mgr.reserve(b, small, tokens=16)
    assert one.outcome is Outcome.GRANTED
    mgr.cancel(b, one.reservation_id)
    assert mgr.reserve(a, mla, tokens=16 * fit).outcome is Outcome.GRANTED  # what does fit is granted
    mgr.check_invariants()


# -- pacing: the token bucket ------------------------------------------------------------------

def test_deferred_reservation_is_granted_once_idle_blocks_can_make_its_room(make_manager, clock):
    """A small and a large reservation wait while a writer fills HBM. The writer finishes (its blocks
    are idle cache now, DRAM is empty): the small one is granted, and so must the large one be, within
    a few windows. The demand that queued them had decayed and what it paid in was cut at the cap
    while the small one waited, so the large one waited until it expired (est. wait ~1e14 s)."""
    mgr = make_manager(hbm_blocks=40, dram_blocks=80,
                       admission=settings(smoothing_window_s=0.2, burst_fraction=0.1, reservation_ttl_s=30.0))
    w, a = mgr.attach("w"), mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    writing = mgr.allocate(w, lid, 40)
    small = mgr.reserve(a, lid, tokens=16 * 2)
    large = mgr.reserve(a, lid, tokens=16 * 20)
    assert (small.outcome, large.outcome) == (Outcome.DEFERRED, Outcome.DEFERRED)
    for _ in range(20):  # the writer takes 2 s
        clock.advance(0.1)
        mgr.tick()
    mgr.free(w, mgr.commit(w, writing, keys=list(range(1, 41))))
    assert mgr.admission.status(small.reservation_id).outcome is Outcome.GRANTED
    waiting = mgr.admission.status(large.reservation_id)
    assert waiting.outcome is Outcome.DEFERRED and waiting.est_wait_s is not None
    assert waiting.est_wait_s <= 10 * 0.2, waiting
    for _ in range(20):  # 2 s: ten smoothing windows, far within the reservation's 30 s
        clock.advance(0.1)
        mgr.tick()
    assert mgr.admission.status(large.reservation_id).outcome is Outcome.GRANTED
    assert mgr.stats()["reservations"]["reserved_blocks"] == 22
    mgr.check_invariants()


def test_a_rejected_reservation_does_not_refill_the_bucket(make_manager, clock):
    """Only admitted demand paces demotions: a reservation rejected (here: larger than the tier) adds
    nothing to the demand rate, so it does not let the next reservation demote at once what the
    bucket has not refilled yet."""
    mgr = make_manager(hbm_blocks=40, dram_blocks=80,
                       admission=settings(smoothing_window_s=1.0, burst_fraction=0.1))
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 40), keys=list(range(1, 41))))  # HBM full of idle cache
    assert mgr.reserve(a, lid, tokens=16 * 4).outcome is Outcome.GRANTED  # spends the burst (4 blocks)
    rate = mgr.stats()["reservations"]["demand_rate_bps"]
    assert mgr.reserve(a, lid, tokens=16 * 1000).outcome is Outcome.REJECTED
    assert mgr.stats()["reservations"]["demand_rate_bps"] == rate
    clock.advance(0.1)
    demoted = mgr.placement.stats.demoted
    assert mgr.reserve(a, lid, tokens=16 * 4).outcome is Outcome.DEFERRED
    assert mgr.placement.stats.demoted == demoted
    mgr.check_invariants()



def test_an_allocate_held_behind_the_queue_scans_for_room_only_when_blocks_may_have_become_movable(
        make_manager, monkeypatch):
    """The head waits on blocks being written; a client with nothing running allocates, leaving the
    head's room to it, and makes room for both: a pass over every row for blocks that cannot move,
    on every retry (3.4 ms a call at a million blocks). Until a call lets blocks go (here a free
    that leaves cached blocks idle; not a free of a private block) the tier is known to have none."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=8, admission=settings())
    w, b, f = mgr.attach("w"), mgr.attach("b"), mgr.attach("f")
    lid = mgr.register_layout(SMALL)
    writing = mgr.allocate(w, lid, 6)
    scans = []
    movable = mgr.placement.movable
    monkeypatch.setattr(mgr.placement, "movable", lambda *args, **kw: scans.append(1) or movable(*args, **kw))
    assert mgr.reserve(b, lid, tokens=16 * 4).outcome is Outcome.DEFERRED  # its room-making found none
    assert mgr.allocate(f, lid, 1) is None and "held for 1 reservation" in mgr.allocate_refusal
    first = len(scans)
    assert first > 0
    for _ in range(5):
        assert mgr.allocate(f, lid, 1) is None
    mgr.free(w, writing[:1])  # a private block freed: room as it is, nothing newly movable
    assert mgr.allocate(f, lid, 1) is None
    assert len(scans) == first
    mgr.free(w, mgr.commit(w, writing[1:3], keys=[1, 2]))  # two cached blocks idle: room can be made
    assert mgr.allocate(f, lid, 1) is not None  # 3 free + 2 demoted: the head's 4 and this one
    assert len(scans) > first
    assert mgr.stats()["placement"]["demoted"] == 2
    mgr.check_invariants()




def test_an_allocate_behind_the_queue_does_not_make_the_queues_room_past_the_bucket(make_manager, clock):
    """A reservation waits for room that admission's token bucket pays out over its window; an
    allocate by a client with nothing running queues behind it. Before, that allocate made room for
    itself and the whole queue at once (31 blocks demoted by one allocate of one block, the bucket
    holding 10): the storm of demotions the smoothing is there to prevent. Now it is refused until
    the queue's room is there, and the room comes at the bucket's pace."""
    mgr = make_manager(hbm_blocks=100, dram_blocks=200, admission=settings(burst_fraction=0.1))
    a, b, f = mgr.attach("a"), mgr.attach("b"), mgr.attach("f")
    lid = mgr.register_layout(SMALL)
    for k in range(90):  # HBM 90% full of idle cached blocks
        mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1), keys=[k + 1]))
    waiting = mgr.reserve(b, lid, tokens=16 * 40)
    assert waiting.outcome is Outcome.DEFERRED
    demoted = mgr.placement.stats.demoted
    assert mgr.allocate(f, lid, 1) is None and "held for 1 reservation" in mgr.allocate_refusal
    assert mgr.placement.stats.demoted == demoted, "no room made for the queue outside the bucket"
    for _ in range(40):  # the window passes: the bucket pays, the reservation is granted
        clock.advance(0.1)
        mgr.tick()
    assert mgr.admission.status(waiting.reservation_id).outcome is Outcome.GRANTED
    assert mgr.allocate(f, lid, 1) is not None
    mgr.check_invariants()


def test_the_queue_ahead_of_an_allocate_is_read_without_a_layout_lookup_per_reservation(make_manager, monkeypatch):
    """An allocate by a client with nothing running sums the room of the reservations waiting ahead
    of it, of its block size: each reservation keeps its block size, so the walk over a deep queue
    (3.4 ms with 4,000 waiting at a million blocks) asks the table nothing per reservation."""
    mgr = make_manager(hbm_blocks=8, admission=settings(max_deferred=64))
    w, f = mgr.attach("w"), mgr.attach("f")
    lid = mgr.register_layout(SMALL)
    fp8 = mgr.register_layout(MLA)
    writing = mgr.allocate(w, lid, 8)  # HBM full of blocks being written: every reservation waits
    waiting = [mgr.attach(f"r{i}") for i in range(40)]
    for i, c in enumerate(waiting):
        assert mgr.reserve(c, lid if i % 2 else fp8, tokens=16).outcome is Outcome.DEFERRED
    asked = []
    layout = mgr.table.layout
    monkeypatch.setattr(mgr.table, "layout", lambda i: asked.append(i) or layout(i))
    assert mgr.admission.held_ahead(0, f, BLOCK) == (20, 20 * BLOCK) and len(asked) == 0
    assert mgr.allocate(f, lid, 1) is None and "held for 20 reservation(s)" in mgr.allocate_refusal
    assert len(asked) < 5
    mgr.free(w, writing)
    mgr.check_invariants()


def test_a_polls_position_follows_every_change_of_the_queue(make_manager, clock):
    """A poll's position and bytes ahead are looked up (waiting.py; a scan of the queue per poll
    cost 549 ms a round of 4,000 polls, a review), worked out again at each change of the queue:
    joins at several priorities, grants, cancels and expiries, checked against the queue itself."""
    import random

    rng = random.Random(7)
    mgr = make_manager(hbm_blocks=16, admission=settings(max_deferred=64, reservation_ttl_s=5.0))
    lid = mgr.register_layout(SMALL)
    holder = mgr.attach("holder")
    clients = [mgr.attach(f"c{i}") for i in range(4)]
    held = mgr.allocate(holder, lid, 16)
    waiting = []
    for step in range(300):
        op = rng.random()
        if op < 0.5:
            d = mgr.reserve(rng.choice(clients), lid, tokens=16 * rng.randint(1, 3), priority=rng.randint(0, 2))
            if d.outcome is Outcome.DEFERRED:
                waiting.append(d.reservation_id)
        elif op < 0.65 and waiting:
            rid = waiting.pop(rng.randrange(len(waiting)))
            res = mgr.admission.find(rid)
            if res is not None and not res.granted:
                mgr.cancel(res.client, rid)
        elif op < 0.75 and len(held):
            mgr.free(holder, held[:2])  # room: the head is granted
            held = held[2:]
        else:
            clock.advance(0.4)  # some expire
        for rid in [r.id for r in mgr.admission.deferred]:
            try:
                d = mgr.admission.status(rid)  # (a poll may grant, or expire others: the queue after it)
            except ReservationError:
                continue
            if d.outcome is Outcome.DEFERRED:
                queue = mgr.admission.deferred
                i = [r.id for r in queue].index(rid)
                assert d.position == i, (step, d.position, i)
                assert queue.position(queue[i])[1] == sum(r.hbm_bytes for r in queue[:i + 1])
        mgr.check_invariants()
