"""What an allocate refused for room now is told (`allocate_refusal`) and how it is counted.

A mixin of `BlockManager` (manager.py): the tier full of blocks that cannot move, or (HBM) held by
granted reservations' untaken blocks, counted by slots and slabs as `room_most` counts (`_refused`,
`_held_by_granted`: which of them are the caller's own, and whether taking, cancelling or waiting
serves it), or held for reservations waiting ahead (`_held_back`). Each refusal is counted by cause
(refusals.py).
"""

from __future__ import annotations

import numpy as np

from dflash2.reservations import Reservation
from dflash2.reservations.waits import held_by_granted, until_taken, untaken_room
from dflash2.tiers import Tier


class AllocateRefusals:
    def _refused(self, tier: Tier, client: int, layout_id: int, need: int, room: int, slot: int) -> None:
        """`client`'s `need` bytes of slots of `slot` bytes (of layout `layout_id`) refused where `room`
        (free, and movable when that was counted) is all the tier could give now."""
        held = [r for r in self.admission.granted.values() if r.remaining] if tier == Tier.HBM else []
        # Granted reservations' untaken blocks hold the room, not blocks being written or pinned: an
        # allocate was told HBM was full of blocks that cannot move, where none were (a review; a
        # deferred reserve was already told this). Their room counted by slots and slabs, as
        # `room_most` counts, alone: by bytes, 8 KiB reserved slots beside blocks being written were
        # said to hold a 16 KiB block, and one beside a free 8 KiB slot, which makes one, was not
        # named (two reviews).
        if held and self._room_without(held, slot) >= need:
            self.allocate_refusal = self._held_by_granted(held, client, layout_id, need, room, slot)
        else:  # (reservations are of HBM: a host writer told to reserve could not, a review)
            self.allocate_refusal = (f"{tier.name} is full of blocks that cannot move now; "
                                     + ("reserve and wait" if tier == Tier.HBM else "blocks being written, held by "
                                        "clients' references (with the chains above them) or pinned by host "
                                        "readers: free or release them, or try again later")
                                     + self.set_aside_note(tier))
        self.refusals.note("allocate", "tier_full", self.allocate_refusal)
        return None

    def set_aside_note(self, tier: Tier) -> str:
        """Said in a refusal for room where lapsed clients' set-aside blocks hold part of `tier`
        (table/departure.py): no client of theirs releases them, they are let go when the process ends
        or its set-aside does (daemon/sessions.py SetAside). Told "waits for their clients to release
        them" alone, an operator looked for clients that were gone (a review). "" where none do."""
        if not self.set_aside_clients:
            return ""
        # Blocks that only they hold: a block also pinned (or referenced) by a live client stays after
        # their process ends (two lapsed and live readers' shared pinned prefix was counted, a review).
        rows, counts, pinned = [], [], []
        for client in self.set_aside_clients:
            holder = self.table.clients[client]
            for held in (holder.refs, holder.pins):
                rows.append(np.fromiter(held.keys(), dtype=np.int64, count=len(held)))
                counts.append(np.fromiter(held.values(), dtype=np.int64, count=len(held)))
                pinned.append(np.full(len(held), held is holder.pins))
        rows, counts, pinned = np.concatenate(rows), np.concatenate(counts), np.concatenate(pinned)
        held, at = np.unique(rows, return_inverse=True)
        refs = np.bincount(at[~pinned], weights=counts[~pinned], minlength=len(held))
        pins = np.bincount(at[pinned], weights=counts[pinned], minlength=len(held))
        c = self.table.cols
        here = int(np.count_nonzero((c.tier[held] == int(tier)) & (c.refs[held] == refs) & (c.pins[held] == pins)))
        if not here:
            return ""
        return (f"; {here} of {tier.name}'s blocks are set aside for {len(self.set_aside_clients)} client(s) "
                "whose lease lapsed while their process may still run (not released by any client: let go when that "
                "process ends, or daemon.set_aside_leases leases after the lapse)")

    def _room_without(self, held: list[Reservation], slot: int) -> int:
        """HBM's room for slots of `slot` bytes (by slots and slabs, as `room_most` counts) were the
        untaken blocks of the granted reservations `held` gone."""
        rows = self.table.rows([v for r in held for v in r.vids])
        return self.placement.room_most_without(Tier.HBM, rows, idle_only=True, slot=slot)

    def _held_by_granted(self, held: list[Reservation], client: int, layout_id: int, need: int, room: int,
                         slot: int) -> str:
        """An allocate's refusal where the granted reservations `held` hold its room. Some may be the
        caller's own: it was told to reserve and wait on their clients, itself (a review). Taking them
        serves it only where they are of its layout (`take` hands out blocks of the reservation's
        layout: taken, another layout's were blocks being written, and the allocate was refused
        again, a review); else cancelling them does. Beside others', its own are offered as the way
        only where their room alone holds the call, and named at all only where they add room once
        the others' is free: told to take or cancel its own, a client whose own held too little (or,
        8 KiB slots beside blocks being written, no 16 KiB room at all) was refused again (a review)."""
        count, untaken = untaken_room(held)
        own = [r for r in held if r.client == client]
        others = [r for r in held if r.client != client]
        wait = "reserve and wait " + until_taken(self.admission.settings.reservation_ttl_s)
        free_own = ("take those blocks (`take`) or cancel them" if all(r.layout_id == layout_id for r in own)
                    else "cancel them (or take and free them: they are of another layout than this allocate's)")
        # Beside others', each way is offered only where it serves alone: its own offered with "; or
        # wait" where the others' room alone would not hold the call (it waited, was refused again),
        # and told to free them where the others' alone would (two reviews).
        own_alone = bool(own) and self._room_without(own, slot) >= need
        others_alone = bool(others) and self._room_without(others, slot) >= need
        if not own or others_alone and not own_alone:
            act = wait  # (the others' room alone serves it: its own, if any, may stay)
        elif not others or not others_alone and own_alone:
            act = free_own if not others else f"this client's own: {free_own}"
        elif own_alone:
            act = f"this client's own: {free_own}; or {wait}"
        else:  # (neither alone: both)
            act = f"this client's own hold part of that room, too little alone: {free_own}, and {wait}"
        return (f"{held_by_granted(count, untaken, *untaken_room(own))}, without which HBM's free and movable room "
                f"({room} bytes) would hold the {need} bytes asked for; {act}")

    def _held_back(self, ahead: int, priority: int, held: int) -> None:
        self.allocate_refusal = (f"HBM is held for {ahead} reservation(s) waiting at priority {priority} "
                                 f"or above ({held} bytes): they are served first; reserve and wait")
        self.refusals.note("allocate", "reservations_ahead", self.allocate_refusal)
        return None
