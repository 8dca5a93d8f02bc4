"""What-if room of a slot allocator: the room a tier would have were some blocks gone.

A mixin of `SlotAllocator` (alloc.py), read by placement to decide whether making room can succeed
before it moves anything: room in slots of one size once some slabs empty (`room_if_emptied`) or
once every block but some is gone (`room_without`), whether several sizes fit together
(`sizes_fit`), and the pages they need beyond their own slabs' free slots (`pages_needed`). Queries
only: nothing here changes the allocator. Slabs of several pages are counted in runs of contiguous
pages, as `SlotAllocator.blocks_free` counts them.
"""

from __future__ import annotations

import numpy as np

from dflash2.pageruns import slabs_in_runs


class RoomQueries:
    def room_if_emptied(self, slot: int, heads: np.ndarray) -> int:
        """Bytes of slots of `slot` bytes that emptying the slabs headed at `heads` (of other sizes)
        would add to what `blocks_free` finds now: in whole slabs of that size, which need their
        pages contiguous (a page freed among held ones holds no slab longer than a page, and a 64 KiB
        page holds one 40 KiB slot, not 1.6: counted by its bytes, a reservation that could never be
        granted was told a wait, a review)."""
        heads = np.unique(np.asarray(heads, dtype=np.int64))
        if not len(heads):
            return 0
        slab_pages, per_slab = self._slab_shape(slot)
        now = self._spare_pages(exclude=slot)
        spare = now.copy()
        for head in heads:
            spare[head:head + self._classes[int(self._page_class[head])].slab_pages] = True
        return (slabs_in_runs(spare, slab_pages) - slabs_in_runs(now, slab_pages)) * per_slab * slot

    def room_without(self, slot: int, kept: np.ndarray) -> int:
        """Bytes of slots of `slot` bytes that this arena would have free were every block gone but
        those in the slots at offsets `kept` (quarantined slots stay too): free pages and emptied
        slabs become slabs of this size, and a slab that keeps a block has room for this size only
        in its free slots, where it is of this size (a free 8 KiB slot beside a block being written
        holds no 16 KiB block: counted by its bytes, an allocate that could not succeed moved idle
        blocks, a review). Slabs of several pages are counted in runs, as `blocks_free` counts them
        (from the pages' number, two free pages apart were one 40 KiB slab: a review)."""
        slab_pages, per_slab = self._slab_shape(slot)
        if slab_pages == 1 and not self._quarantined and not self.other_sizes_used(slot):
            # Every block here is of this size, a slab a page: a count, without the pass over the
            # slabs (84 -> 2 ms at a million blocks, a review); page tails are no room (by bytes, a
            # 64 KiB page's 24 KiB tail beside a 40 KiB slot was, and an allocate that could never
            # succeed dropped an idle block first, a review).
            return (self.n_pages * per_slab - len(kept)) * slot
        user = np.asarray(kept, dtype=np.int64)
        per_head, heads, classes, kept_pages = self._kept_slabs(user)
        if slab_pages == 1:
            in_kept = int((per_slab - per_head[heads[classes == slot]]).sum())
            return ((self.n_pages - kept_pages) * per_slab + in_kept) * slot
        # As `blocks_free` counts: this size's slabs that keep a block have room in their free slots,
        # and new ones are cut from runs of the other pages no kept block holds (this size's emptied
        # slabs among them, which `alloc` cuts anew: kept as they were cut, an empty tier was short
        # of slabs of several pages, a review).
        spare = np.ones(self.n_pages, dtype=bool)
        for s, c in self._classes.items():
            theirs = heads[classes == s]  # slabs that keep a block
            if len(theirs):
                spare[(theirs[:, None] + np.arange(c.slab_pages)).ravel()] = False
        # Its free slots in the slabs that keep a block (a quarantined slot counted as kept).
        in_own = int((per_slab - per_head[heads[classes == slot]]).sum())
        return (slabs_in_runs(spare, slab_pages) * per_slab + in_own) * slot

    def sizes_fit(self, counts: dict[int, int], kept: np.ndarray) -> bool:
        """Whether blocks of several slot sizes (slot bytes -> count) could all lie here at once were
        every block gone but those at offsets `kept` (quarantined slots stay too): each size fills the
        free slots of its own slabs that keep a block, then needs whole slabs cut from the pages no
        kept block holds, and the sizes share those pages. A necessary condition (whether slabs of
        several pages find runs is not asked)."""
        per_head, heads, classes, held_pages = self._kept_slabs(np.asarray(kept, dtype=np.int64))
        need_pages = 0
        for slot, count in counts.items():
            spare = int((self._slab_shape(slot)[1] - per_head[heads[classes == slot]]).sum())  # (its slabs that stay)
            need_pages += self._new_pages(slot, count, spare)
        return need_pages <= self.n_pages - held_pages

    def _kept_slabs(self, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """For blocks kept at offsets `kept` (quarantined slots too): per page, the kept slots of the slab
        it heads; the heads of the slabs that keep any; their slot sizes; and the pages those slabs hold."""
        kept = np.concatenate([kept, self.quarantined_offsets()])
        per_head = np.bincount(self._head_of(kept), minlength=self.n_pages)  # (no sort of a million heads)
        heads = np.flatnonzero(per_head)
        classes = self._page_class[heads]
        pages = sum(int(np.count_nonzero(classes == s)) * c.slab_pages for s, c in self._classes.items())
        return per_head, heads, classes, pages

    def _new_pages(self, slot: int, count: int, spare: int) -> int:
        """Pages that `count` slots of `slot` bytes take in new slabs, `spare` of them held by slabs already."""
        slab_pages, per_slab = self._slab_shape(slot)
        return -(-max(0, count - spare) // per_slab) * slab_pages

    def pages_needed(self, counts: dict[int, int]) -> int:
        """Pages that blocks of several slot sizes (slot bytes -> count) need together beyond the free
        slots of their sizes' slabs that hold a block now: `Placement._make_room_for_rows` makes that
        many free, counted as `room_for` counts pages (an empty slab among them: counted here as its
        size's free slots too, the ask fell short, a review)."""
        pages = 0
        for slot, count in counts.items():
            own = self._classes.get(slot)
            spare = 0
            if own is not None and own.n_free:
                spare = int(np.count_nonzero(self._page_used[self._head_of(own.free[:own.n_free])] > 0))
            pages += self._new_pages(slot, count, spare)
        return pages
