"""An allocate refused where granted reservations' untaken room holds the room it needs is told so:
their number and bytes, counted by slots and slabs as the allocator counts them, which of them are
the client's own, and whether taking or cancelling those serves it (dflash2/allocrefusal.py `_refused`,
dflash2/reservations/waits.py). Split from test_room_bound.py."""

from conftest import SMALL, SMALL_FP8
from test_room_bound import _halves

from dflash2.tiers import Tier

def test_an_allocate_refused_for_granted_reservations_room_names_them(make_manager):
    """HBM of 4, 3 of them a granted reservation's, none taken: an allocate of 2 was told HBM was
    "full of blocks that cannot move now", blocks being written or pinned, where none were (a review;
    a deferred reserve was already told of granted room). Where such blocks do hold it, it still is."""
    mgr = make_manager(hbm_blocks=4)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    assert mgr.reserve(a, lid, tokens=16 * 3).outcome.name == "GRANTED"
    slot = mgr.table.slot_bytes(lid, Tier.HBM)
    ttl = mgr.admission.settings.reservation_ttl_s
    for n in (2, 4):  # (4: the whole tier, counted by the bound before any room is made)
        assert mgr.allocate(b, lid, n) is None
        assert mgr.allocate_refusal == (
            f"HBM is held by 1 granted reservation(s) not yet taken ({3 * slot} bytes), without which HBM's free "
            f"and movable room ({slot} bytes) would hold the {n * slot} bytes asked for; reserve and wait until "
            "their clients take and free those blocks or cancel them, or they expire "
            f"(admission.reservation_ttl_s, {ttl:g} s at most)")
    mgr.allocate(b, lid, 1)  # being written: the rest is no longer the reservation's to give
    assert mgr.allocate(b, lid, 4) is None
    assert mgr.allocate_refusal == "HBM is full of blocks that cannot move now; reserve and wait"
    mgr.check_invariants()


def test_a_clients_own_reservation_is_not_told_to_reserve_and_wait_on_itself(make_manager):
    """HBM of 4, 3 of them client a's granted reservation, none taken: a's allocate of 2 was told to
    reserve and wait until "their clients" took and freed those blocks, itself (a review): it is told
    they are its own, to take them or cancel them; beside another's, it is told which part is its own."""
    mgr = make_manager(hbm_blocks=4)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    slot = mgr.table.slot_bytes(lid, Tier.HBM)
    d = mgr.reserve(a, lid, tokens=16 * 3)
    assert d.outcome.name == "GRANTED"
    assert mgr.allocate(a, lid, 2) is None
    assert mgr.allocate_refusal == (
        f"HBM is held by 1 granted reservation(s) not yet taken ({3 * slot} bytes), all this client's own, without "
        f"which HBM's free and movable room ({slot} bytes) would hold the {2 * slot} bytes asked for; take those "
        "blocks (`take`) or cancel them")
    mgr.cancel(a, d.reservation_id)
    d = mgr.reserve(a, lid, tokens=16 * 2)
    assert mgr.reserve(b, lid, tokens=16).outcome.name == "GRANTED"
    assert mgr.allocate(a, lid, 2) is None
    ttl = mgr.admission.settings.reservation_ttl_s
    assert mgr.allocate_refusal == (
        f"HBM is held by 2 granted reservation(s) not yet taken ({3 * slot} bytes), 1 of them this client's own "
        f"({2 * slot} bytes), without which HBM's free and movable room ({slot} bytes) would hold the {2 * slot} "
        "bytes asked for; this client's own: take those blocks (`take`) or cancel them; or reserve and wait until "
        "their clients "
        f"take and free those blocks or cancel them, or they expire (admission.reservation_ttl_s, {ttl:g} s at most)")
    assert len(mgr.take(a, d.reservation_id, 2)) == 2  # (what it is told to do serves it)
    mgr.check_invariants()



def test_a_reserved_half_beside_a_free_half_is_named_when_it_holds_the_call(make_manager):
    """HBM of two 16 KiB pages: one a 16 KiB block being written, the other an 8 KiB slot of a granted
    reservation beside a free 8 KiB slot. A 16 KiB allocate is refused, and the reservation alone
    holds it (cancelled, the allocate is served): told of blocks that cannot move, as its bytes with
    the free room's (8 KiB) fell short of the call before its slots were counted (a review)."""
    mgr = make_manager(hbm_blocks=2)
    w, b, r = mgr.attach("w"), mgr.attach("b"), mgr.attach("r")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    assert mgr.allocate(w, big, 1) is not None
    d = mgr.reserve(r, small, tokens=16)
    assert d.outcome.name == "GRANTED"
    assert mgr.allocate(b, big, 1) is None
    refusal = mgr.allocate_refusal
    assert refusal.startswith("HBM is held by 1 granted reservation(s) not yet taken"), refusal
    mgr.cancel(r, d.reservation_id)
    assert mgr.allocate(b, big, 1) is not None
    mgr.check_invariants()


def test_an_own_reservation_of_another_layout_is_not_told_to_take_for_the_allocate(make_manager):
    """A client's own granted reservation of 8 KiB blocks fills HBM; its 16 KiB allocate was told to
    take those blocks, which `take` hands out of the reservation's layout: taken, they were blocks
    being written, and the allocate was refused again (a review). It is told to cancel them."""
    mgr = make_manager(hbm_blocks=2)
    a = mgr.attach("a")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    d = mgr.reserve(a, small, tokens=16 * 4)
    assert d.outcome.name == "GRANTED"
    assert mgr.allocate(a, big, 1) is None
    assert "take those blocks" not in mgr.allocate_refusal and mgr.allocate_refusal.endswith(
        "cancel them (or take and free them: they are of another layout than this allocate's)"), mgr.allocate_refusal
    mgr.cancel(a, d.reservation_id)
    assert mgr.allocate(a, big, 1) is not None
    mgr.check_invariants()


def test_reserved_halves_beside_writes_are_not_said_to_hold_a_whole_page_block(make_manager):
    """HBM of 3 pages of 16 KiB: the halves' free 8 KiB slots a granted reservation's, the third page a
    16 KiB block being written. The refusal of a 16 KiB block said the reservation's 16 KiB untaken
    (by bytes) would hold it, and once it was cancelled the allocate was still refused (a review).
    Where the reserved slots fill a page of their own, that page would hold it, and it is said."""
    mgr = make_manager(hbm_blocks=3)
    w, b, r = mgr.attach("w"), mgr.attach("b"), mgr.attach("r")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    _halves(mgr, w, small)
    d = mgr.reserve(r, small, tokens=16 * 2)
    assert d.outcome.name == "GRANTED"
    assert mgr.allocate(w, big, 1) is not None  # the third page, being written
    assert mgr.allocate(b, big, 1) is None
    assert mgr.allocate_refusal == "HBM is full of blocks that cannot move now; reserve and wait"
    mgr.cancel(r, d.reservation_id)
    assert mgr.allocate(b, big, 1) is None  # (what the refusal says is so)
    mgr.check_invariants()

    mgr = make_manager(hbm_blocks=3)
    w, b, r = mgr.attach("w"), mgr.attach("b"), mgr.attach("r")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.allocate(w, big, 1)
    d = mgr.reserve(r, small, tokens=16 * 2)  # both halves of one page
    assert d.outcome.name == "GRANTED"
    mgr.allocate(w, big, 1)
    assert mgr.allocate(b, big, 1) is None
    assert mgr.allocate_refusal.startswith("HBM is held by 1 granted reservation(s) not yet taken")
    mgr.cancel(r, d.reservation_id)
    assert len(mgr.allocate(b, big, 1)) == 1
    mgr.check_invariants()


def test_an_own_reservation_too_small_alone_is_not_offered_as_the_way(make_manager):
    """HBM of 4: client a's granted reservation of 2, b's of 2, none taken. a's allocate of 3 was told
    to take or cancel its own "; or reserve and wait", and cancelled, its own 2 blocks were too little:
    it was refused again (a review). Neither alone holds it: it is told to free its own, and wait."""
    mgr = make_manager(hbm_blocks=4)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    slot = mgr.table.slot_bytes(lid, Tier.HBM)
    ttl = mgr.admission.settings.reservation_ttl_s
    own = mgr.reserve(a, lid, tokens=16 * 2)
    theirs = mgr.reserve(b, lid, tokens=16 * 2)
    assert own.outcome.name == theirs.outcome.name == "GRANTED"
    assert mgr.allocate(a, lid, 3) is None
    assert mgr.allocate_refusal == (
        f"HBM is held by 2 granted reservation(s) not yet taken ({4 * slot} bytes), 1 of them this client's own "
        f"({2 * slot} bytes), without which HBM's free and movable room (0 bytes) would hold the {3 * slot} bytes "
        "asked for; this client's own hold part of that room, too little alone: take those blocks (`take`) or "
        "cancel them, and reserve and wait until their clients take and free those blocks or cancel them, or "
        f"they expire (admission.reservation_ttl_s, {ttl:g} s at most)")
    mgr.cancel(a, own.reservation_id)
    assert mgr.allocate(a, lid, 3) is None  # (its own alone: what the refusal says is so)
    mgr.cancel(b, theirs.reservation_id)
    assert len(mgr.allocate(a, lid, 3)) == 3
    mgr.check_invariants()


def test_each_way_is_offered_only_where_it_serves_alone(make_manager):
    """HBM of 4. a's own reservation of 1 beside b's of 3: b's alone holds a's allocate of 2, yet a was
    told to give up its own too; a's own of 3 beside b's of 1: a was offered "; or reserve and wait",
    and once b cancelled it was refused again (a review). Now: wait (a keeps its own), and take or
    cancel its own (no waiting offered)."""
    ttl_said = "or they expire (admission.reservation_ttl_s"
    mgr = make_manager(hbm_blocks=4)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    own = mgr.reserve(a, lid, tokens=16)
    theirs = mgr.reserve(b, lid, tokens=16 * 3)
    assert mgr.allocate(a, lid, 2) is None
    refusal = mgr.allocate_refusal
    assert refusal.endswith("bytes asked for; reserve and wait until their clients take and free those blocks or "
                            f"cancel them, {ttl_said}, 60 s at most)"), refusal
    mgr.cancel(b, theirs.reservation_id)
    assert len(mgr.allocate(a, lid, 2)) == 2 and own.reservation_id in mgr.admission.granted
    mgr.cancel(a, own.reservation_id)
    mgr.free(a, mgr.table.vids(mgr.table.live_rows()))
    own = mgr.reserve(a, lid, tokens=16 * 3)
    theirs = mgr.reserve(b, lid, tokens=16)
    assert mgr.allocate(a, lid, 2) is None
    assert mgr.allocate_refusal.endswith("this client's own: take those blocks (`take`) or cancel them"), \
        mgr.allocate_refusal
    assert len(mgr.take(a, own.reservation_id, 2)) == 2
    mgr.check_invariants()


def test_an_own_reservation_that_holds_none_of_the_room_is_not_offered(make_manager):
    """HBM of two 16 KiB pages: one an 8 KiB block being written beside client a's own reserved 8 KiB
    slot (no 16 KiB room, whatever becomes of that slot), the other r's reserved 16 KiB block. a's
    16 KiB allocate was told to take or cancel its own, which serves nothing (a review): it is told
    to reserve and wait on the others, and is served once theirs is cancelled."""
    mgr = make_manager(hbm_blocks=2)
    w, a, r = mgr.attach("w"), mgr.attach("a"), mgr.attach("r")
    big, small = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    ttl = mgr.admission.settings.reservation_ttl_s
    assert mgr.allocate(w, small, 1) is not None
    assert mgr.reserve(a, small, tokens=16).outcome.name == "GRANTED"
    theirs = mgr.reserve(r, big, tokens=16)
    assert theirs.outcome.name == "GRANTED"
    assert mgr.allocate(a, big, 1) is None
    assert mgr.allocate_refusal.endswith(
        "bytes asked for; reserve and wait until their clients take and free those blocks or cancel them, or "
        f"they expire (admission.reservation_ttl_s, {ttl:g} s at most)"), mgr.allocate_refusal
    mgr.cancel(r, theirs.reservation_id)
    assert len(mgr.allocate(a, big, 1)) == 1
    mgr.check_invariants()
