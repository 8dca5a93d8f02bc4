"""Several serving processes on one daemon (the multi-tenant audit): priority protects running
requests, not cache; the deferred queue holds its room against `allocate`; the operator's TTL and
share bound every client. Metadata-only managers on the fake clock; each test failed before its fix."""

from __future__ import annotations

import pytest

from dflash2.errors import QuotaExceeded, ReservationError
from dflash2.reservations import AdmissionSettings, Outcome
from dflash2.tiers import Tier

from conftest import SMALL


def settings(**kw):
    base = dict(smoothing_window_s=1.0, burst_fraction=1.0, reservation_ttl_s=30.0, max_deferred=8)
    base.update(kw)
    return AdmissionSettings(**base)


def cached(mgr, client, lid, keys, priority=0):
    """A finished request's blocks: written at `priority`, published, its references dropped."""
    vids = mgr.commit(client, mgr.allocate(client, lid, len(keys), priority=priority), keys=keys)
    mgr.free(client, vids)
    return vids


def tiers(mgr, vids):
    return [Tier(int(mgr.table.cols.tier[r])).label for r in mgr.table.rows(vids)]


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_a_finished_high_priority_requests_cache_does_not_shut_lower_priorities_out(make_manager, clock, policy):
    """A priority-1 tenant fills HBM with one-shot requests and detaches: a priority-0 tenant must
    still get HBM, by allocate and by reserve (its idle blocks are cache, not a running request)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, policy=policy, admission=settings())
    high, low = mgr.attach("high"), mgr.attach("low")
    lid = mgr.register_layout(SMALL)
    for k in range(2):
        clock.advance(1)
        cached(mgr, high, lid, [10 * k + i for i in range(1, 5)], priority=1)
    mgr.detach(high)
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 8
    assert mgr.allocate(low, lid, 4, priority=0) is not None
    assert mgr.reserve(low, lid, tokens=16 * 4, priority=0).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_running_higher_priority_request_keeps_its_blocks_against_a_lower_reservation(make_manager):
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, admission=settings())
    high, low = mgr.attach("high"), mgr.attach("low")
    lid = mgr.register_layout(SMALL)
    running = mgr.commit(high, mgr.allocate(high, lid, 8, priority=5), keys=list(range(1, 9)))  # still referenced
    d = mgr.reserve(low, lid, tokens=16 * 4, priority=0)
    assert d.outcome is Outcome.DEFERRED and d.est_wait_s is None
    assert mgr.allocate(low, lid, 1, priority=0) is None
    assert set(tiers(mgr, running)) == {"hbm"}


def test_an_acquire_does_not_demote_a_higher_priority_running_request(make_manager, clock):
    """A priority-0 reader's promotion takes room from idle blocks and from running requests of its
    priority or lower; a running priority-5 request's blocks stay (its own reserve could not take them)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, admission=settings())
    high, low = mgr.attach("high"), mgr.attach("low")
    lid = mgr.register_layout(SMALL)
    mine = cached(mgr, low, lid, [101, 102])
    clock.advance(1)
    running = mgr.commit(high, mgr.allocate(high, lid, 8, priority=5), keys=list(range(1, 9)))
    assert set(tiers(mgr, mine)) == {"dram"}
    assert mgr.acquire(low, mine, priority=0) is None  # no room it may take: no answer rather than preemption
    assert set(tiers(mgr, running)) == {"hbm"}
    assert mgr.acquire(low, mine, priority=5) is not None  # a reader of that priority may
    assert set(tiers(mgr, mine)) == {"hbm"}
    mgr.check_invariants()


def test_an_acquire_takes_idle_blocks_before_a_running_requests(make_manager, clock):
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    wanted = cached(mgr, a, lid, [101, 102])
    clock.advance(1)
    running = mgr.commit(b, mgr.allocate(b, lid, 4), keys=[1, 2, 3, 4])  # older than the idle ones
    clock.advance(1)
    idle = cached(mgr, a, lid, [201, 202, 203, 204])
    assert set(tiers(mgr, wanted)) == {"dram"}
    assert mgr.acquire(a, wanted) is not None
    assert set(tiers(mgr, running)) == {"hbm"}, "the idle blocks made the room"
    assert tiers(mgr, idle).count("dram") == 2


def test_a_prefetch_never_demotes_a_running_request(make_manager, clock):
    """A prefetch is a guess: its room comes from idle blocks only. HBM holds a running request's
    blocks and nothing idle: the window ahead of a reader stays below, the request's blocks stay."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=32, prefetch_window=4, admission=settings())
    reader, busy = mgr.attach("reader"), mgr.attach("busy")
    lid = mgr.register_layout(SMALL)
    keys = list(range(1000, 1008))
    mgr.free(reader, mgr.commit(reader, mgr.allocate(reader, lid, len(keys)), keys))
    assert mgr.placement.make_room(Tier.HBM, 8 * SMALL.block_bytes)  # the whole chain down to DRAM
    clock.advance(1)
    running = mgr.commit(busy, mgr.allocate(busy, lid, 6), keys=list(range(2, 8)))
    chain = mgr.table.vids(mgr.lookup_rows(keys, lid, client=reader)).tolist()
    assert len(chain) == 8
    assert mgr.acquire_rows(reader, chain[:2]) is not None  # a read: it may take the 2 free slots
    mgr.run_prefetch()
    assert set(tiers(mgr, running)) == {"hbm"}
    assert set(tiers(mgr, chain[2:])) == {"dram"}
    mgr.check_invariants()


def test_allocate_leaves_a_deferred_reservation_its_room(make_manager):
    """Two tenants free and allocate in turn, with a reservation of their priority waiting: their
    allocations must not take the room it waits for, or it is passed until it expires."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    g1, g2, b, filler = (mgr.attach(n) for n in ("g1", "g2", "b", "filler"))
    lid = mgr.register_layout(SMALL)
    hold = mgr.allocate(filler, lid, 4)
    one, two = mgr.allocate(g1, lid, 2), mgr.allocate(g2, lid, 2)
    d = mgr.reserve(b, lid, tokens=16 * 4)
    assert d.outcome is Outcome.DEFERRED and d.position == 0
    mgr.free(g1, one)
    refused = mgr.allocate(g1, lid, 2)
    assert refused is None and "waiting" in mgr.allocate_refusal
    mgr.free(g2, two)  # now the reservation's room is free: granted on the free
    assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
    assert mgr.allocate(g1, lid, 2) is None  # the tier is full: the filler still writes
    mgr.free(filler, hold)
    assert mgr.allocate(g1, lid, 2) is not None  # no reservation waits: allocate as before
    mgr.check_invariants()


def test_a_higher_priority_allocate_is_not_held_back_by_a_lower_reservation(make_manager):
    mgr = make_manager(hbm_blocks=8, admission=settings())
    w, b, urgent = mgr.attach("w"), mgr.attach("b"), mgr.attach("urgent")
    lid = mgr.register_layout(SMALL)
    mgr.allocate(w, lid, 6)
    assert mgr.reserve(b, lid, tokens=16 * 4, priority=0).outcome is Outcome.DEFERRED
    assert mgr.allocate(urgent, lid, 2, priority=1) is not None


def test_a_clients_deadline_cannot_outlive_the_operators_ttl(make_manager, clock):
    mgr = make_manager(hbm_blocks=8, admission=settings(reservation_ttl_s=2))
    x, z = mgr.attach("x"), mgr.attach("z")
    lid = mgr.register_layout(SMALL)
    g = mgr.reserve(x, lid, tokens=16 * 6, deadline=clock() + 3600)
    assert g.outcome is Outcome.GRANTED
    clock.advance(3)
    mgr.tick()
    assert mgr.stats()["reservations"]["reserved_blocks"] == 0, "the TTL freed the untaken blocks"
    assert mgr.reserve(z, lid, tokens=16 * 8).outcome is Outcome.GRANTED
    short = mgr.reserve(x, lid, tokens=16, deadline=clock() + 0.5)  # a deadline may shorten it
    clock.advance(1)
    mgr.tick()
    with pytest.raises(ReservationError, match="expired"):
        mgr.admission.status(short.reservation_id)


def test_the_share_bounds_allocate_too(make_manager):
    mgr = make_manager(hbm_blocks=8, admission=settings(max_client_share=0.25))
    x, y = mgr.attach("x"), mgr.attach("y")
    lid = mgr.register_layout(SMALL)
    assert mgr.allocate(x, lid, 2) is not None
    with pytest.raises(QuotaExceeded, match="over its share 0.25.*admission.max_client_share"):
        mgr.allocate(x, lid, 1)
    assert mgr.reserve(y, lid, tokens=16 * 2).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_an_hbm_only_reservation_behind_referenced_blocks_has_no_wait_estimate(make_manager):
    """With no tier below, referenced blocks can never make room (making room drops, and only idle
    published blocks may be dropped): the wait has no estimate, and the reason says why."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    low, high = mgr.attach("low"), mgr.attach("high")
    lid = mgr.register_layout(SMALL)
    mgr.commit(low, mgr.allocate(low, lid, 6), keys=list(range(1, 7)))  # a running request's blocks
    d = mgr.reserve(high, lid, tokens=16 * 4, priority=5)
    assert d.outcome is Outcome.DEFERRED
    assert d.est_wait_s is None and "cannot move" in d.reason


@pytest.fixture
def daemon(config_file, tmp_path):
    from daemon_proc import DaemonProcess
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"},
                                     admission={"max_client_share": 0.5})).start()
    yield proc
    proc.stop()


def test_the_daemon_says_why_and_carries_a_readers_priority(connect):
    """Over the wire: allocate past the share is a QuotaExceeded error naming the setting, an
    allocate held back by a waiting reservation says so, and acquire carries the reader's priority."""
    from dflash2.client import DaemonError, chain_keys
    a, b, c, d = connect("a"), connect("b"), connect("c"), connect("d")
    lid = a.layouts[0]
    probe = a.allocate(lid, 1)
    a.free(probe["vid"])
    blocks = a.stats()["tiers"]["hbm"]["capacity_bytes"] // int(probe["nbytes"][0]) // 2  # a share each
    with pytest.raises(DaemonError) as e:
        a.allocate(lid, blocks + 1)
    assert e.value.kind == "QuotaExceeded" and "admission.max_client_share" in str(e.value)
    held = [a.allocate(lid, blocks)["vid"], b.allocate(lid, blocks)["vid"]]  # HBM full, being written
    r = c.reserve(lid, tokens=16)
    assert r.outcome == "deferred"
    b.free(held[1][:1])
    assert d.allocate(lid, 1) is None  # the freed slot is the waiting reservation's
    assert c.reservation(r.reservation_id).outcome == "granted"
    keys = chain_keys(range(16), 16, "c")
    [vid] = c.commit(c.take(r.reservation_id, 1)["vid"], keys=keys)
    assert c.acquire([vid], priority=3) is not None
    c.release([vid])


def test_a_running_request_may_grow_past_a_waiting_reservation(make_manager):
    """A reservation waits on a running request's blocks; that request needs more to finish. Held
    back by the queue it could never finish, and the reservation would wait until it expired: a
    client writing blocks (a request of it running) is not held back."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    running, waiting, newcomer = mgr.attach("running"), mgr.attach("waiting"), mgr.attach("new")
    lid = mgr.register_layout(SMALL)
    first = mgr.allocate(running, lid, 4)
    d = mgr.reserve(waiting, lid, tokens=16 * 8)
    assert d.outcome is Outcome.DEFERRED
    assert mgr.allocate(newcomer, lid, 2) is None  # a new request queues behind the reservation
    more = mgr.allocate(running, lid, 2)
    assert more is not None, "the running request grows"
    mgr.free(running, mgr.commit(running, [*first, *more], keys=list(range(1, 7))))
    assert mgr.admission.status(d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


# -- the review of 73f6fc6 ---------------------------------------------------------------------
def test_a_clients_own_reservation_and_other_block_sizes_do_not_hold_its_allocate(make_manager):
    from conftest import SMALL_FP8
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a, w, small = mgr.attach("a"), mgr.attach("w"), mgr.attach("small")
    lid, lid8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.allocate(w, lid, 5)
    assert mgr.reserve(a, lid, tokens=16 * 6).outcome is Outcome.DEFERRED
    assert mgr.allocate(a, lid, 1, request=7) is not None  # its own reservation is not ahead of it
    assert mgr.allocate(small, lid8, 1) is not None  # 8 KiB slots are no room for 16 KiB blocks
    mgr.check_invariants()


def test_a_running_request_grows_whatever_its_blocks_request_ids_and_an_idle_client_queues(make_manager):
    """A request whose blocks are all committed (referenced, resident: between decode blocks), or
    are another request's (deduplicated, found cached), is running: it grows past the waiting
    reservation (the review of 6dea78d: tied to the blocks' request ids it was held until the TTL).
    A client that references nothing has nothing running: its new request queues."""
    mgr = make_manager(hbm_blocks=8, admission=settings())
    a, b, c = mgr.attach("a"), mgr.attach("b"), mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    shared = mgr.commit(c, mgr.allocate(c, lid, 3, request=9), keys=[1, 2, 3])
    mgr.free(c, shared)
    mgr.add_ref(a, shared)  # a's request 1 found this prefix cached (written by c's request 9)
    assert mgr.reserve(b, lid, tokens=16 * 6).outcome is Outcome.DEFERRED
    assert mgr.allocate(a, lid, 1, request=1) is not None
    assert mgr.allocate(c, lid, 1, request=10) is None and "waiting" in mgr.allocate_refusal


def test_an_acquire_without_a_priority_may_still_take_running_requests_room(make_manager, clock):
    """Engines that give no priority (every caller before it existed), all at priority 1: their
    acquire may demote running requests as before, not answer None."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, admission=settings())
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    mine = cached(mgr, a, lid, [101, 102], priority=1)
    clock.advance(1)
    running = mgr.commit(b, mgr.allocate(b, lid, 4, priority=1), keys=[1, 2, 3, 4])
    assert set(tiers(mgr, mine)) == {"dram"}
    assert mgr.acquire(a, mine) is not None
    assert tiers(mgr, running).count("dram") == 2


def test_a_shared_prefix_is_protected_as_its_highest_priority_user(make_manager, clock):
    """A priority-5 request shares (add_ref) a prefix written at priority 0: a priority-0 reader's
    promotion and a priority-1 reservation must not demote it while that request runs."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, admission=settings())
    writer, high, low = mgr.attach("writer"), mgr.attach("high"), mgr.attach("low")
    lid = mgr.register_layout(SMALL)
    mine = cached(mgr, low, lid, [101, 102])
    clock.advance(1)
    prefix = cached(mgr, writer, lid, [1, 2, 3, 4], priority=0)
    mgr.add_ref(high, prefix, priority=5)
    own = mgr.commit(high, mgr.allocate(high, lid, 4, priority=5), keys=[5, 6, 7, 8], parent=int(prefix[-1]))
    assert set(tiers(mgr, mine)) == {"dram"}
    assert mgr.acquire(low, mine, priority=0) is None
    assert mgr.reserve(low, lid, tokens=16 * 2, priority=1).outcome is Outcome.DEFERRED
    assert set(tiers(mgr, [*prefix, *own])) == {"hbm"}
    mgr.check_invariants()


def test_a_promotion_from_nvme_passes_a_dram_full_of_pinned_blocks(make_manager, clock):
    """The blocks come up from NVMe and DRAM is full of blocks a host reader pinned: HBM's victims
    go past DRAM to NVMe (which has room), not dropped, and the acquire succeeds."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=16, admission=settings())
    a, reader = mgr.attach("a"), mgr.attach("reader")
    lid = mgr.register_layout(SMALL)
    wanted = cached(mgr, a, lid, [101, 102])
    assert mgr.mover.move(mgr.table.rows(wanted), Tier.NVME).all()
    pinned = [mgr.commit(a, mgr.allocate(a, lid, 1, tier=Tier.DRAM), keys=[k]) for k in (11, 12, 13, 14)]
    for v in pinned:
        mgr.free(a, v)
        mgr.acquire(reader, v, up_to=Tier.DRAM)
    clock.advance(1)
    idle = cached(mgr, a, lid, [1, 2, 3, 4])
    assert mgr.acquire(reader, wanted) is not None
    assert tiers(mgr, idle).count("nvme") == 2 and mgr.placement.stats.past_full == 2
    assert len(mgr.lookup([1, 2, 3, 4], lid)) == 4  # none dropped
    mgr.check_invariants()


def test_pinning_a_shared_prefix_does_not_count_toward_the_share(make_manager):
    mgr = make_manager(hbm_blocks=8, admission=settings(max_client_share=0.5))
    writer, a = mgr.attach("writer"), mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    prefix = cached(mgr, writer, lid, [1, 2, 3, 4])
    mgr.acquire(a, prefix)  # reads the shared prefix: half of HBM
    assert mgr.allocate(a, lid, 1) is not None


def test_a_raised_priority_lapses_when_its_request_lets_go(make_manager, clock):
    """A priority-5 request shares a prefix written at priority 0, then finishes; a priority-0
    request uses the prefix next: a priority-1 reservation may preempt it as it may any priority-0
    request's blocks (the prefix kept priority 5 for as long as it stayed cached). A reader's pin
    with a priority lapses alike at its release."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, admission=settings(preemption=True))
    writer, high, low, other = (mgr.attach(n) for n in ("writer", "high", "low", "other"))
    lid = mgr.register_layout(SMALL)
    prefix = cached(mgr, writer, lid, [1, 2, 3, 4], priority=0)
    rows = mgr.table.rows(prefix)
    mgr.add_ref(high, prefix, priority=5)
    assert mgr.table.cols.priority[rows].tolist() == [5] * 4
    mgr.free(high, prefix)
    assert mgr.table.cols.priority[rows].tolist() == [0] * 4
    assert mgr.acquire(high, prefix, priority=7) is not None
    assert mgr.table.cols.priority[rows].tolist() == [7] * 4
    mgr.release(high, prefix)
    assert mgr.table.cols.priority[rows].tolist() == [0] * 4
    reader = mgr.attach("reader")  # a reader that detaches holding its pins, and references
    mgr.add_ref(reader, prefix[:2], priority=6)
    assert mgr.acquire(reader, prefix, priority=6) is not None
    mgr.detach(reader)
    assert mgr.table.cols.priority[rows].tolist() == [0] * 4
    mgr.check_invariants()
    mgr.add_ref(low, prefix, priority=0)
    own = mgr.commit(low, mgr.allocate(low, lid, 4, priority=0), keys=[5, 6, 7, 8], parent=int(prefix[-1]))
    assert set(tiers(mgr, [*prefix, *own])) == {"hbm"}
    assert mgr.reserve(other, lid, tokens=16 * 8, priority=1).outcome is Outcome.GRANTED
    assert set(tiers(mgr, [*prefix, *own])) == {"dram"}
    mgr.check_invariants()
