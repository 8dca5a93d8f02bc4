"""The most room a tier could make, before any is made (a mixin of Placement).

Room is made by moving blocks down (on the last tier, dropping them) before the call that needs it
runs; a call that cannot succeed even once every block that may leave has left would have moved or
dropped them for nothing. A review found three such calls: an allocate beside blocks being written
emptied an HBM-only cache (and the policy replay's requests longer than what their pinned prefix
left flushed HBM, Belady's optimum included); an acquire demoted another reader's idle block and
then answered "no room now"; a prefetch window that could not fit dropped idle blocks of a full last
tier and brought up nothing. Each now asks `room_most` first.

Invariant: `room_most` is an upper bound on what `make_room` could free with the same picks (the
tier's pages less the slots of the blocks that stay, and of those above them in the tier: page tails
and other sizes' slabs only lower what is usable; for blocks of one size, counted by slabs: see
`SlotAllocator.room_without`), so a call it refuses could never have succeeded.
Needs the Placement's `table`, `movable`, `_unprotected` and `_nothing_movable`.
"""

from __future__ import annotations

import numpy as np

from dflash2.counts import any_true, unique
from dflash2.tiers import Tier

WALK_LEVELS = 64  # levels walked up from the blocks that stay in whole-array rounds (`room_most`)
WALK_WIDE = 64  # and beyond those, each level of this many blocks or more (a round costs about as much as 40 single steps)


class RoomBound:
    """Placement's bound on the room a tier could make (the attributes it uses are Placement's)."""

    def room_most(self, tier: Tier, need_bytes: int, *, idle_only: bool, protect: np.ndarray | None = None,
                  below_priority: int | None = None, slot: int | None = None) -> int:
        """Bytes of slots `tier` could have free were every block that may leave it gone, with make_room's
        picks (`idle_only`: idle blocks; else a promotion's: idle blocks of any priority, then running
        ones under `below_priority`, any when None; never `protect`); `slot`: in slots of that size only
        (the call's blocks are all of it), else of any. Where the room now (for `slot`, its slots:
        `room_for`) holds `need_bytes`, or nothing may leave, that room: no pass over the table (a refused call,
        retried by its client, paid one each time: 0.13 → 3.7 ms at a million rows, a review)."""
        alloc = self.table.allocators[tier]
        way, epoch = (int(tier), False, idle_only), int(self.table.movable_epoch[int(tier)])
        # The room now: for one size, its slots (a page's tail holds none, and another size's empty
        # slab gives its whole page: by bytes, a call that could never fit dropped an idle block
        # first, and a read that fit with nothing moved was refused, two reviews).
        free = alloc.free_bytes if slot is None else alloc.room_for(slot)
        if free >= need_bytes or self._nothing_movable.get(way) == epoch:
            return free
        stay = self._staying(tier, idle_only, protect, below_priority)
        if stay is None:
            self._nothing_movable[way] = epoch
            return free
        return self._room_left(tier, stay, slot)

    def room_most_without(self, tier: Tier, rows: np.ndarray, *, idle_only: bool, slot: int | None = None,
                          below_priority: int | None = None) -> int:
        """`room_most` (its picks, no `protect`) were the blocks at `rows` gone too,
        though they cannot move (a granted reservation's RESERVED blocks, not yet taken): counted as
        `room_most` counts, by slots and slabs for one size (their untaken bytes, added to the room,
        said an allocate would fit where 8 KiB reserved slots beside blocks being written held no 16 KiB
        block, and it was still refused once the reservation was cancelled, a review). A pass over the
        table each call, asked by every refused HBM allocate while a granted reservation has blocks not
        yet taken (their bytes beside the free room are no bound on it: a reserved 8 KiB slot beside a
        free one makes a 16 KiB slot, and such a refusal was not said to be theirs, a review)."""
        stay = self._staying(tier, idle_only, None, below_priority)
        if stay is None:  # (none may leave: every block in the tier stays)
            stay = self.table.cols.tier == int(tier)
        stay[np.asarray(rows, dtype=np.int64)] = False
        return self._room_left(tier, stay, slot)

    def _room_left(self, tier: Tier, stay: np.ndarray, slot: int | None) -> int:
        """Bytes of slots `tier` has free once only the blocks of `stay` (a mask) lie in it: for `slot`,
        in slots of that size, by slots and slabs as the allocator counts them; else of any size."""
        alloc, c = self.table.allocators[tier], self.table.cols
        if slot is not None:
            return alloc.room_without(slot, c.offset[stay])
        return alloc.n_pages * alloc.page_bytes - int(self.table.slot_sizes(tier)[c.layout[stay]].sum())

    def sizes_could_fit(self, tier: Tier, counts: dict[int, int], *, idle_only: bool,
                        protect: np.ndarray | None = None, below_priority: int | None = None) -> bool:
        """Whether blocks of several slot sizes (slot bytes -> count) could lie in `tier` at once were
        every block that may leave it gone (`room_most`'s picks; `SlotAllocator.sizes_fit`, a
        necessary condition). Each size checked alone against the same room, a read of a 40 KiB and a
        16 KiB block where one page could be freed demoted its idle block, then was refused (a review)."""
        stay = self._staying(tier, idle_only, protect, below_priority)
        c = self.table.cols
        kept = c.offset[stay] if stay is not None else c.offset[c.tier == int(tier)]
        return self.table.allocators[tier].sizes_fit(counts, kept)

    def _staying(self, tier: Tier, idle_only: bool, protect: np.ndarray | None,
                 below_priority: int | None) -> np.ndarray | None:
        """Mask of the blocks that stay in `tier` were every block that may leave it gone (None: none
        may leave)."""
        c = self.table.cols
        go = self.movable(tier, evict=False, idle_only=idle_only)
        if not any_true(go):
            return None
        if below_priority is not None and not idle_only:
            go &= (c.refs == 0) | (c.priority < below_priority)
        here = c.tier == int(tier)
        stay = here & ~self._unprotected(go, protect, None)
        for faster in range(int(tier)):  # (a child in a faster tier holds its parent here: it stays there)
            stay |= here & (c.kids[faster] > 0)
        # Only leaves leave (prefix order): the blocks above one that stays, in this tier, stay too
        # (an idle parent of a pinned child was counted as room: an acquire then made room it could
        # never use, a review). Walked up from the blocks that stay, each block once: a level a round
        # of whole-array steps for WALK_LEVELS levels, then, for the few chains deeper than that, a
        # block a step (a round a level to the root took 270-300 ms a call above a leaf held 32,768
        # deep, a review; capped there, the bound counted the rest as room and a read made room for
        # nothing again, another).
        up = np.flatnonzero(stay)
        levels = 0
        # (Past WALK_LEVELS, whole-array rounds go on while a level has WALK_WIDE blocks or more: a
        # block a step was 270 ms a call under 1,024 chains 1,024 deep with pinned leaves, asked at
        # every status poll of a reservation waiting beside another slot size's, a review.)
        while len(up) and (levels < WALK_LEVELS or len(up) >= WALK_WIDE):
            levels += 1
            up = c.parent[up]
            up = unique(up[up >= 0])
            up = up[here[up] & ~stay[up]]
            stay[up] = True
        parent, inside, held = c.parent.item, here.item, stay.item
        for row in up.tolist():
            while (row := parent(row)) >= 0 and inside(row) and not held(row):
                stay[row] = True
        return stay

    def could_hold(self, tier: Tier, need_bytes: int, **picks) -> bool:
        """Whether `need_bytes` of slots could be free in `tier` (`room_most`, with its picks)."""
        return self.room_most(tier, need_bytes, **picks) >= need_bytes
