"""What a deferred reservation that demoting cannot make room for is told it waits on
(`Admission._deferred_decision`), with no wait estimate: each cause below ends only when clients act.

The bytes it waits for (its own and those of the reservations queued ahead of it) are more than HBM's
free and movable room; three causes, told apart by the bytes each accounts for:

- its own bytes are more than free + movable room + granted reservations' untaken room: blocks that
  cannot move now (being written, pinned, or held by running requests it may not preempt or that have
  no room below) hold the rest;
- its own bytes need granted reservations' untaken room: it waits for their clients or their expiry;
- its own bytes fit: the reservations ahead of it take the room first, granted one after another, and
  it waits until their clients free that room.

All three were once one test on the queue's bytes up to it, so a reservation behind a head that waited
on another's granted room was told of blocks being written, pinned or of higher priority, where HBM
held none (a review's script).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dflash2.reservations.records import Reservation

IMMOVABLE = "HBM is held by blocks that cannot move now"


def immovable(preempts_below: int | None) -> str:
    """Blocks that cannot move now hold HBM: being written, pinned, or running requests' that the
    reservation may not preempt: of its priority or above (`preempts_below`: its priority), or of
    lower priority with no room for them in the tiers below (`Placement.room_below`); any running
    request's where none may leave for it (None: `admission.preemption` off, or no tier below HBM).
    It said "or of higher priority" whatever the priority and preemption, to a reservation held by
    running blocks of its own priority (a review's script)."""
    running = (f"held by running requests of priority {preempts_below} or above, or by running ones with no room "
               "for them in the tiers below" if preempts_below is not None
               else "held by running requests, none preempted here: admission.preemption off, or no tier below HBM")
    return f"{IMMOVABLE} (being written, pinned, or {running}): waits for their clients to release them"


def blocked_reason(pos: int, own: int, ahead: int, free: int, granted: Iterable[Reservation],
                   ttl_s: float, client: int | None = None, untaken_here: int | None = None,
                   preempts_below: int | None = None, set_aside: Callable[[], str] = str) -> str | None:
    """The reason for a reservation at index `pos` of the queue, of `own` HBM bytes, with `ahead`
    bytes of the queue up to and with it, where demoting can free `free` bytes for it (free room and
    movable blocks); None when that covers `ahead` (then only admission's pacing holds it back).
    `client`: the reservation's, whose own granted reservations are said as its own. `untaken_here`:
    the room for its slots that the granted reservations' untaken blocks keep, where that is not their
    bytes (slots of another size: `RoomCount.untaken_here`). `preempts_below`: the reservation's
    priority where preemption may demote running blocks of lower priority for it, else None (`immovable`).
    `set_aside`: what lapsed clients' set-aside blocks hold of HBM, said after blocks that cannot move
    (no client of theirs releases them: `AllocateRefusals.set_aside_note`; asked only then)."""
    if ahead <= free:
        return None
    granted = list(granted)
    count, untaken = untaken_room(granted)
    others = ahead - own
    queued = f"; {pos} reservation(s) queued ahead of it ({others} bytes) go first" if pos else ""
    if own > free + (untaken if untaken_here is None else untaken_here):
        return immovable(preempts_below) + queued + set_aside()
    if own > free:
        mine = untaken_room(r for r in granted if r.client == client)
        return f"{held_by_granted(count, untaken, *mine)}: waits {until_taken(ttl_s, mine[0], count)}" + queued
    return (f"waits behind {pos} reservation(s) queued ahead of it ({others} bytes): HBM's free and movable "
            f"room ({free} bytes) takes its own {own} bytes but not theirs too, so it waits until they are "
            "granted and their clients free that room or cancel them; no wait estimate, as that is up to "
            "those clients")


def untaken_room(granted: Iterable[Reservation]) -> tuple[int, int]:
    """How many granted reservations have blocks not yet taken, and those blocks' HBM bytes: room
    that no demotion frees (their blocks are RESERVED, not movable) and that no other call may use."""
    held = [r for r in granted if r.remaining]
    return len(held), sum(r.remaining * r.slot for r in held)


def held_by_granted(count: int, untaken: int, own: int = 0, own_bytes: int = 0) -> str:
    """The room of granted reservations not yet taken, said (a deferred reserve's reason, a refused
    allocate's: the allocate was told of blocks being written or pinned where none were, a review),
    with those of them that are the asking client's `own` (it was told to wait on their clients,
    itself, a review)."""
    mine = "" if not own else (", all this client's own" if own == count
                               else f", {own} of them this client's own ({own_bytes} bytes)")
    return f"HBM is held by {count} granted reservation(s) not yet taken ({untaken} bytes){mine}"


def until_taken(ttl_s: float, own: int = 0, count: int = 0) -> str:
    """Until when granted reservations' untaken room stays theirs (`own` of the `count` the asking
    client's: it frees that room itself)."""
    who = ("their clients take and free those blocks or cancel them" if not own else
           "this client takes (`take`) and frees those blocks or cancels them" if own == count else
           "their clients, this one among them (`take`), take and free those blocks or cancel them")
    return f"until {who}, or they expire (admission.reservation_ttl_s, {ttl_s:g} s at most)"
