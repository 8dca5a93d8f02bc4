"""Whether blocks could ever fit a tier: `refuse_never_fits` raises NeverFits where no amount of
demotion could make their room, so that "no room now" is never said of them; and which blocks'
leaving frees room for a slot size (`frees_room_for`). A part of BlockTable
(a mixin over its allocators and layouts), apart because what a tier can hold at all, by slabs, is a
question of its own."""

from __future__ import annotations

import numpy as np

from dflash2.alloc import blocks_that_fit, slab_shape
from dflash2.errors import NeverFits
from dflash2.tiers import Tier


class Capacity:
    """BlockTable's never-fits check (the attributes it uses are BlockTable's)."""

    def refuse_never_fits(self, tier: Tier, blocks: dict[int, int], what: str) -> None:
        """NeverFits when these blocks ({layout id: count}) exceed the tier's whole capacity: no
        amount of demotion could ever make room, so "no room now" would be a lie."""
        alloc = self.allocators[tier]
        need = sum(n * self.slot_bytes(lid, tier) for lid, n in blocks.items())
        capacity = alloc.capacity_bytes
        if need > capacity:
            raise NeverFits(f"{what} needs {need} bytes of {tier.label}, more than the whole {tier.label} tier "
                             f"({capacity} bytes): they can never fit")
        for lid, n in blocks.items():
            # Whole slabs, not bytes: page tails hold no block of this layout.
            fit = blocks_that_fit(capacity, alloc.page_bytes, alloc.alignment, self.layout(lid).block_bytes)
            if n > fit:
                raise NeverFits(f"{what} needs {n} blocks of layout {self.layout(lid).name!r} in "
                                 f"{tier.label}; the whole tier holds {fit} of them: they can never fit")
        if len(blocks) > 1:
            # Together: a page belongs to one slot size at a time, so the slabs each size needs add
            # up (40 and 48 KiB blocks, 5 and 4 of them, each a one-page slab: 9 pages of a tier of 8,
            # though the bytes fit and each layout alone would).
            by_slot: dict[int, int] = {}
            for lid, n in blocks.items():
                slot = self.slot_bytes(lid, tier)
                by_slot[slot] = by_slot.get(slot, 0) + n
            pages = sum(-(-n // per) * span for n, (span, per) in
                        ((n, slab_shape(slot, alloc.page_bytes, alloc.n_pages)) for slot, n in by_slot.items()))
            if pages > alloc.n_pages:
                raise NeverFits(f"{what} needs {pages} pages of {tier.label} for its blocks of "
                                f"{len(blocks)} layouts (a page holds blocks of one size), more than the whole "
                                f"tier's {alloc.n_pages}: they can never lie there together")

    def frees_room_for(self, movable: np.ndarray, tier: Tier, slot: int) -> np.ndarray:
        """Mask of the `movable` rows of `tier` whose leaving frees room for slots of `slot` bytes:
        of that size, or in a slab whose every used slot holds a movable row (another size's slot
        frees room only with its whole slab: alloc.py)."""
        alloc = self.allocators[tier]
        out = movable & (self.cols.tier == int(tier))
        other = np.flatnonzero(out & (self.slot_sizes(tier)[self.cols.layout] != slot))
        if len(other):
            heads = alloc.slabs_of(self.cols.offset[other])
            _, _, used = alloc.page_slabs()
            going = np.bincount(heads, minlength=len(used))
            out[other[going[heads] != used[heads]]] = False
        return out

    def room_freed_bytes(self, rows: np.ndarray, tier: Tier, slot: int) -> int:
        """Bytes of slots of `slot` bytes in `tier` that these rows' leaving makes, the rows as
        `frees_room_for` picks them: their own slots where of that size, and for another size's, the
        slabs of that size their whole slabs' pages (free slots with them) then hold. Counted by their
        used slots alone, a tier of idle blocks with one slab of another size partly used fell short
        of itself, and a reservation waiting on them was told they could not move (a review)."""
        rows = np.asarray(rows, dtype=np.int64)
        sizes = self.slot_sizes(tier)[self.cols.layout[rows]]
        own = int(sizes[sizes == slot].sum())
        other = rows[sizes != slot]
        if not len(other):
            return own
        alloc = self.allocators[tier]
        return own + alloc.room_if_emptied(slot, alloc.slabs_of(self.cols.offset[other]))
