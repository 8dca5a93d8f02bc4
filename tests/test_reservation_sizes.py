"""Reservations of two block sizes: one of a size that no reservation ahead of it waits with is
granted out of its turn from room free now, when that room is none of theirs (free slots of its
own size in slabs already cut); blocks of one size still queue in order."""

from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.reservations import Outcome
from dflash2.tiers import Tier

from conftest import SMALL, SMALL_FP8
from reservation_helpers import settings


def _held_and_split(make_manager, small_pages: int = 2):
    """HBM of 8 pages of 16 KiB: four 16 KiB blocks being written (nothing can move them), and
    `small_pages` pages of 8 KiB blocks (two to a page), being written too, of which the second of
    each of the first two pages is freed again: two free 8 KiB slots in slabs already cut. The rest of
    HBM is free pages. Reservation A of four 16 KiB blocks waits at the head of the queue."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=64, admission=settings())
    w, a, b = mgr.attach("writer"), mgr.attach("a"), mgr.attach("b")
    big, fp8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.allocate(w, big, 4)
    small = mgr.allocate(w, fp8, 2 * small_pages)
    mgr.free(w, small[[1, 3]])
    head = mgr.reserve(a, big, tokens=16 * 4)
    assert head.outcome is Outcome.DEFERRED, head
    return mgr, (w, a, b), (big, fp8), small, head


def _room(mgr, block_bytes):
    return mgr.placement.free_bytes(Tier.HBM, block_bytes)


def test_a_reservation_of_another_size_passes_a_waiting_head_on_slots_it_cannot_use(make_manager):
    """A review's script: reservation B of two 8 KiB blocks stayed deferred behind A (position 1, no
    estimate) until A was granted or expired, 30 s, while an `allocate` of the same blocks was
    given them at once. Two free 8 KiB slots are no room for A: B is granted now, and A's room is
    what it was."""
    mgr, (w, a, b), (big, fp8), small, head = _held_and_split(make_manager)
    before = _room(mgr, 16 * 1024)
    d = mgr.reserve(b, fp8, tokens=16 * 2)
    assert d.outcome is Outcome.GRANTED, d
    assert _room(mgr, 16 * 1024) == before
    assert mgr.reservation_status(a, head.reservation_id).outcome is Outcome.DEFERRED
    assert mgr.admission.check_invariants() is None
    mgr.check_invariants()


def test_one_that_would_take_pages_the_head_may_use_waits(make_manager):
    """Three 8 KiB blocks need a page beyond the two free slots: a page A could use, so B waits
    behind A; once A is cancelled, B is granted on that call."""
    mgr, (w, a, b), (big, fp8), small, head = _held_and_split(make_manager)
    before = _room(mgr, 16 * 1024)
    d = mgr.reserve(b, fp8, tokens=16 * 3)
    assert d.outcome is Outcome.DEFERRED and d.position == 1, d
    assert _room(mgr, 16 * 1024) == before  # (nothing was kept of a try)
    mgr.cancel(a, head.reservation_id)
    assert mgr.reservation_status(b, d.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_a_waiting_reservation_of_another_size_is_granted_once_slots_of_its_own_free_up(make_manager):
    """B (three 8 KiB blocks) waits behind A; the writer frees one more 8 KiB block, in a slab still
    in use: three free slots of B's size that A cannot use. B's next poll grants it; A still waits."""
    mgr, (w, a, b), (big, fp8), small, head = _held_and_split(make_manager, small_pages=3)
    d = mgr.reserve(b, fp8, tokens=16 * 3)
    assert d.outcome is Outcome.DEFERRED, d
    before = _room(mgr, 16 * 1024)
    mgr.free(w, small[[5]])  # the third page's second slot (its first still being written)
    assert mgr.reservation_status(b, d.reservation_id).outcome is Outcome.GRANTED
    assert mgr.reservation_status(a, head.reservation_id).outcome is Outcome.DEFERRED
    assert _room(mgr, 16 * 1024) == before
    mgr.check_invariants()


def test_blocks_of_one_size_still_queue_in_order(make_manager):
    """B1 (three 8 KiB blocks, which would take a page) waits behind A; B2 of two 8 KiB blocks,
    which the free slots would hold, waits behind B1: a reservation passes only those of other sizes."""
    mgr, (w, a, b), (big, fp8), small, head = _held_and_split(make_manager)
    c = mgr.attach("c")
    first = mgr.reserve(b, fp8, tokens=16 * 3)
    second = mgr.reserve(c, fp8, tokens=16 * 2)
    assert first.outcome is second.outcome is Outcome.DEFERRED, (first, second)
    assert mgr.reservation_status(c, second.reservation_id).position == 2
    mgr.check_invariants()


def _same_slot_layouts(clock, request, other: Layout, hbm_bytes: int, page: int):
    """A manager whose HBM takes `other`'s blocks in the slots of SMALL's (alignment 256), though their
    block bytes differ; (manager, three clients, SMALL's layout id, `other`'s)."""
    mgr = BlockManager([TierSpec(Tier.HBM, hbm_bytes, page, 256), TierSpec(Tier.DRAM, 64 * page, page, 4096)],
                       clock=clock, admission=settings())
    request.addfinalizer(mgr.close)
    clients = mgr.attach("writer"), mgr.attach("a"), mgr.attach("b")
    big, odd = mgr.register_layout(SMALL), mgr.register_layout(other)
    assert other.block_bytes != SMALL.block_bytes
    assert mgr.table.slot_bytes(odd, Tier.HBM) == mgr.table.slot_bytes(big, Tier.HBM)
    return mgr, clients, big, odd


def test_layouts_of_one_slot_size_queue_in_order(clock, request):
    """An MLA layout of 16,256-byte blocks takes the same 16 KiB slots as SMALL's 16,384 (alignment
    256): a later reservation of it is no other size for a waiting SMALL head, and passing would take
    the very slot the head waits for (a review's script: it did, and the head waited on)."""
    mla16 = Layout("mla16", num_layers=2, num_kv_heads=0, head_dim=0, dtype="bf16", tokens_per_block=16,
                   mla_latent_dim=254)
    page = 32 * 1024  # two 16 KiB slots a page: a free slot beside a used one is in a slab in use
    mgr, (w, a, b), big, mla = _same_slot_layouts(clock, request, mla16, 4 * page, page)
    held = mgr.allocate(w, big, 8)  # HBM full of blocks being written
    mgr.free(w, held[[1]])
    head = mgr.reserve(a, big, tokens=16 * 2)
    assert head.outcome is Outcome.DEFERRED
    d = mgr.reserve(b, mla, tokens=16)
    assert d.outcome is Outcome.DEFERRED and d.position == 1, d
    mgr.free(w, held[[3]])
    assert mgr.reservation_status(a, head.reservation_id).outcome is Outcome.GRANTED
    mgr.check_invariants()


def test_an_allocation_of_a_layout_of_the_same_slot_size_is_held_back_too(clock, request):
    """A review's script: with a SMALL reservation waiting, an allocation of SMALL was held back
    (as documented) but one of a 16,256-byte layout, which takes the same 16 KiB slots, was given
    the very room the reservation waited for (`ahead_of` compared block bytes, not slots)."""
    odd = Layout("odd", num_layers=1, num_kv_heads=1, head_dim=254, dtype="fp16", tokens_per_block=16)
    page = 16 * 1024
    mgr, (w, a, c), big, other = _same_slot_layouts(clock, request, odd, 8 * page, page)
    mgr.allocate(w, big, 6)  # blocks being written: two slots free
    assert mgr.reserve(a, big, tokens=16 * 4).outcome is Outcome.DEFERRED
    assert mgr.allocate(c, big, 2) is None
    assert mgr.allocate(c, other, 2) is None, "an allocation of the same slot size took the waiting room"
    assert "waiting" in mgr.allocate_refusal
    assert _room(mgr, SMALL.block_bytes) == 2 * page
    mgr.check_invariants()


def test_a_reservation_behind_preemptable_blocks_and_another_sizes_granted_slot_is_told_so(clock):
    """HBM of 16 pages of 64 KiB: 14 being written, one of a priority-0 request's running blocks, and one
    cut in 8 KiB slots by another client's granted reservation of one block. A priority-5 reservation of
    five 16 KiB blocks needs the running page (preemption) and the reserved one: it waits on that
    reservation. Its room counted idle blocks only, less the running ones counted as movable, it was
    told it waited on blocks that cannot move (a review); one reserved slot of its own size was said."""
    page = 64 * 1024
    mgr = BlockManager([TierSpec(Tier.HBM, 16 * page, page, 256), TierSpec(Tier.DRAM, 64 * page, page, 4096)],
                       clock=clock, admission=settings(burst_fraction=0.01))  # (no room made: the bucket)
    try:
        w, r, g, c = (mgr.attach(n) for n in ("writer", "runner", "granted", "late"))
        big, fp8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
        mgr.allocate(w, big, 56)
        running = mgr.allocate(r, big, 4)
        assert mgr.reserve(g, fp8, tokens=16).outcome is Outcome.GRANTED
        d = mgr.reserve(c, big, tokens=16 * 5, priority=5)
        assert d.outcome is Outcome.DEFERRED and "cannot move" in d.reason, d  # (being written: so)
        mgr.commit(r, running, keys=[100, 101, 102, 103])  # running now, of priority 0
        mgr.tick()
        d = mgr.reservation_status(c, d.reservation_id)
        assert d.outcome is Outcome.DEFERRED, d
        assert "1 granted reservation(s) not yet taken (8192 bytes)" in d.reason, d.reason
        mgr.check_invariants()
    finally:
        mgr.close()
