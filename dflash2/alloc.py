"""Slot allocation inside one tier arena, shared by every layout without fixed partitions.

The arena is cut into pages of `page_bytes`. A layout's block takes a slot of
`slot_bytes(block_bytes, alignment)`; a page belongs to one slot size at a time and goes back to the
shared page pool when its last slot is freed, so layouts share the arena without partitions. A slot
larger than a page takes a run of contiguous pages of its own.

Waste is measured, not guessed: per-block rounding (slot minus block bytes), page tails (a page's
bytes that no whole slot fits in) and free slots inside claimed pages.
"""

from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slot_bytes(block_bytes: int, alignment: int) -> int:
    """Bytes one block of `block_bytes` occupies in an arena of this alignment."""
    return round_up(block_bytes, alignment)


# A slab may span up to this many times the pages its first slot needs, when that cuts the tail waste.
MAX_SLAB_STRETCH = 4


# ... and never past this fraction of the arena, so that small arenas stay shareable.
MAX_SLAB_SHARE = 16


def slab_shape(slot: int, page_bytes: int, arena_pages: int | None = None) -> tuple[int, int]:
    """(pages per slab, slots per slab) for one slot size: the run of contiguous pages, among the
    shortest few that hold a slot, whose unusable tail is the smallest fraction of it."""
    base = max(1, -(-slot // page_bytes))
    longest = base * MAX_SLAB_STRETCH
    if arena_pages is not None:
        longest = max(base, min(longest, arena_pages // MAX_SLAB_SHARE))
    best = min(range(base, longest + 1),
               key=lambda k: ((k * page_bytes) % slot / (k * page_bytes), k))
    return best, (best * page_bytes) // slot


def blocks_that_fit(capacity_bytes: int, page_bytes: int, alignment: int, block_bytes: int) -> int:
    """How many blocks of one layout an empty arena holds when that layout has it alone."""
    arena_pages = capacity_bytes // page_bytes
    pages, per_slab = slab_shape(slot_bytes(block_bytes, alignment), page_bytes, arena_pages)
    whole_slabs = arena_pages // pages
    return whole_slabs * per_slab


import dataclasses  # noqa: E402  (kept below the pure helpers the CLI imports)

import numpy as np  # noqa: E402

from dflash2.allocroom import RoomQueries  # noqa: E402
from dflash2.counts import add_at  # noqa: E402
from dflash2.errors import ArenaError  # noqa: E402
from dflash2.pageruns import slabs_in_runs  # noqa: E402


SCAN_PAGES = 1 << 16  # pages read at a time by a first-fit search for single free pages


@dataclasses.dataclass
class _SizeClass:
    """Slots of one size. `free` is a stack of slot offsets (top at `n_free`)."""

    slot: int
    slab_pages: int  # pages one slab (a contiguous run) spans
    slots_per_slab: int
    free: np.ndarray
    # held[offset // slot] == offset % slot while the slot at that offset is handed out, else -1:
    # catches a double free and any offset that is not a slot start of this size (distinct slots of
    # one size never share offset // slot, and an offset inside a slot has another remainder than
    # the slot that shares its quotient). int32 while slots are under 2 GiB: 4 bytes per slot.
    held: np.ndarray
    n_free: int = 0
    n_used: int = 0
    block_bytes_used: int = 0  # exact bytes of the blocks in used slots (for the rounding waste)
    changes: int = 0  # bumped whenever a slot of the class is handed out, freed, quarantined or given back
    no_fit: tuple[int, int] = (-1, 0)  # (changes, n): `alloc_in_used_slabs` found fewer than n then

    def push(self, offsets: np.ndarray, room: int = 0) -> None:  # (`room`: the stack grown to hold as many more)
        need = self.n_free + max(len(offsets), room)
        if need > len(self.free):
            grown = np.empty(max(need, 2 * len(self.free), 64), dtype=np.int64)
            grown[: self.n_free] = self.free[: self.n_free]
            self.free = grown
        self.free[self.n_free: self.n_free + len(offsets)] = offsets
        self.n_free += len(offsets)

    def pop(self, n: int) -> np.ndarray:
        self.n_free -= n
        return self.free[self.n_free: self.n_free + n].copy()


class SlotAllocator(RoomQueries):
    """Hands out slot offsets in one arena of `capacity_bytes` for blocks of any size.

    Invariant: a page is free, or belongs to exactly one size class; the sum over classes of used
    slots times slot bytes equals `used_bytes`. Allocation is all-or-nothing: `alloc` returns None
    (no room; the caller must make room or defer) and changes nothing visible to the caller.

    A slot whose storage cannot be written (a bad region of the disk under NVMe) is quarantined: out
    of the free pool, never handed out again until it is given back (`give_back`, once its storage
    passed a re-test: quarantine.py). Its slab counts it as taken, so the slab never goes back to the
    page pool (no other size is cut from its pages) while it is quarantined.

    The room it would have were some blocks gone is asked of `RoomQueries` (allocroom.py).
    """

    def __init__(self, capacity_bytes: int, page_bytes: int, alignment: int):
        if page_bytes % alignment:
            raise ValueError(f"page size {page_bytes} is not a multiple of the alignment {alignment}")
        self.arena_bytes = capacity_bytes  # the arena's size; `capacity_bytes` is what blocks can use of it
        self.page_bytes = page_bytes
        self.alignment = alignment
        self.n_pages = capacity_bytes // page_bytes
        self.quarantined_bytes = 0
        self._quarantined: dict[int, int] = {}  # offset of each quarantined slot -> its slot bytes
        self._page_free = np.ones(self.n_pages, dtype=bool)
        self._n_free_pages = self.n_pages
        # Invariant: no page below this one is free. First-fit searches start here: a pass over the
        # whole page map per claim cost a drain piece 3 ms at two million NVMe pages (a profile).
        self._free_from = 0
        self._page_used = np.zeros(self.n_pages, dtype=np.int32)  # used slots in the slab headed here
        self._tails: tuple = (None, 0)  # (the changes they were counted at, the page tails of slabs in use)
        self._page_class = np.zeros(self.n_pages, dtype=np.int64)  # slot bytes of the slab's class
        self._page_head = np.zeros(self.n_pages, dtype=np.int64)  # head page of the slab holding it
        self._classes: dict[int, _SizeClass] = {}

    # -- queries -----------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Bytes blocks can use: the arena less its quarantined slots. Quarantined bytes reduce the
        capacity rather than count as used: they can never hold a block, and counted as used they
        would hold a tier with a bad region above its high watermark for good (its drain moving
        blocks out, round after round, for room that never comes). So used + free + waste still add
        up to the capacity, and the watermarks' used fraction is of what can hold blocks. Whole pages
        only: a tail past the last page holds no block, and counted (an HBM tier is not rounded to
        pages: a GPU's free memory is what it is) a full tier of 3 MiB in 2 MiB pages read 67% used,
        under its high watermark for good, and never drained (a review)."""
        return self.n_pages * self.page_bytes - self.quarantined_bytes

    def quarantined_offsets(self) -> np.ndarray:
        """Offsets of every quarantined slot (any size; distinct: a slot is quarantined once)."""
        return np.fromiter(self._quarantined, dtype=np.int64, count=len(self._quarantined))

    def quarantined_slot_bytes(self, offsets: np.ndarray) -> np.ndarray:
        """The slot size of each of these quarantined slots (KeyError for one that is not)."""
        return np.array([self._quarantined[int(o)] for o in np.asarray(offsets).reshape(-1)], dtype=np.int64)

    def slot_for(self, block_bytes: int) -> int:
        return slot_bytes(block_bytes, self.alignment)

    @property
    def used_bytes(self) -> int:
        return sum(c.n_used * c.slot for c in self._classes.values())

    @property
    def full_bytes(self) -> int:
        """Bytes that can hold no more blocks: used slots and the page tails of the slabs with a used
        or quarantined slot (what the watermarks weigh). An empty slab's tail is room once the slab
        goes back to the pages: counted full, an empty tier read 12.5% (a review). The tails are a
        scan of the pages, once a change (0.5 ms at 512k pages: asked after every request in a drain)."""
        key = (sum(c.changes for c in self._classes.values()), self._n_free_pages)
        if self._tails[0] != key:
            self._tails = (key, sum((c.slab_pages * self.page_bytes - c.slots_per_slab * c.slot)
                                    * int(np.count_nonzero((self._page_class == c.slot) & (self._page_used > 0)))
                                    for c in self._classes.values() if c.slab_pages * self.page_bytes % c.slot))
        return self.used_bytes + self._tails[1]

    @property
    def used_slots(self) -> int:
        """Slots handed out, of every size."""
        return sum(c.n_used for c in self._classes.values())

    @property
    def free_bytes(self) -> int:
        """Bytes that could still be handed out: free pages plus free slots in claimed slabs."""
        return self._n_free_pages * self.page_bytes + sum(c.n_free * c.slot for c in self._classes.values())

    def can_fit(self, block_bytes: int, n: int) -> bool:
        return self.blocks_free(block_bytes, enough=n) >= n

    def blocks_free(self, block_bytes: int, enough: int | None = None) -> int:
        """How many more blocks of this size fit now: free slots of their size, plus slabs from free
        pages and from other sizes' empty slabs (free slots of other sizes do not count). A slab of
        several pages needs them contiguous: scattered free pages are not counted as its room."""
        slot = self.slot_for(block_bytes)
        cls = self._classes.get(slot)
        have = cls.n_free if cls else 0
        if enough is not None and have >= enough:
            return have
        slab_pages, per_slab = self._slab_shape(slot)
        if slab_pages == 1:
            return have + (self._n_free_pages + self._reclaimable_pages(exclude=slot)) * per_slab
        # This size's empty slabs are pages again too (`alloc` cuts them anew): kept where they were
        # cut, each beside a page of another size's blocks, they held one slab each, and an empty
        # tier of 16 pages refused an eighth 2-page slot, "full of blocks that cannot move" (a review).
        empty = len(self._empty_slab_heads(cls)) * per_slab if cls else 0
        return have - empty + slabs_in_runs(self._spare_pages(exclude=slot), slab_pages) * per_slab

    def room_for(self, block_bytes: int) -> int:
        """Bytes of slots that blocks of this size could take now (see blocks_free)."""
        return self.blocks_free(block_bytes) * self.slot_for(block_bytes)

    def slab_shape_of(self, block_bytes: int) -> tuple[int, int]:
        """(pages per slab, slots per slab) of the slots that blocks of this size take here."""
        return self._slab_shape(self.slot_for(block_bytes))

    def other_sizes_used(self, block_bytes: int) -> bool:
        """Whether blocks in slots of another size than these blocks' lie here: then freeing slots
        makes room for these blocks only where a slab empties (placement's room by slabs). A look at
        each size class, no pass over the page map."""
        slot = self.slot_for(block_bytes)
        return any(c.n_used for s, c in self._classes.items() if s != slot)

    def slabs_of(self, offsets: np.ndarray) -> np.ndarray:
        """The head page of the slab holding each of these slot offsets (slots handed out)."""
        return self._head_of(np.asarray(offsets, dtype=np.int64))

    def page_slabs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per page: the head page of its slab (-1 where the page is free), that slab's slot bytes
        (0 where free) and its slots in use, quarantined ones included (a slab emptied of its blocks
        goes back to the page pool only when that count is 0)."""
        head = np.where(self._page_free, -1, self._page_head)
        at = np.maximum(head, 0)
        used = np.where(self._page_free, 0, self._page_used[at])
        return head, np.where(self._page_free, 0, self._page_class[at]), used

    def stats(self) -> dict:
        used = self.used_bytes
        block_bytes = sum(c.block_bytes_used for c in self._classes.values())
        claimed = (self.n_pages - self._n_free_pages) * self.page_bytes
        free_in_slabs = sum(c.n_free * c.slot for c in self._classes.values())
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": used,
            "block_bytes": block_bytes,
            "claimed_bytes": claimed,
            "rounding_waste_bytes": used - block_bytes,
            "page_tail_waste_bytes": claimed - used - free_in_slabs - self.quarantined_bytes,
            "free_in_claimed_bytes": free_in_slabs,
            "free_bytes": self.free_bytes,
            "full_bytes": self.full_bytes,  # (tiers.fill)
            "quarantined_bytes": self.quarantined_bytes,  # taken out of capacity_bytes (see there)
        }

    # -- allocation --------------------------------------------------------------------------
    def alloc(self, block_bytes: int, n: int) -> np.ndarray | None:
        """n slot offsets for blocks of `block_bytes`, or None when the arena cannot hold them."""
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        slot = self.slot_for(block_bytes)
        if not self.can_fit(block_bytes, n):
            return None
        cls = self._class(slot)
        short = n - cls.n_free
        if (short > 0 and cls.slab_pages > 1
                and slabs_in_runs(self._page_free, cls.slab_pages) * cls.slots_per_slab < short):
            # Free pages alone are too scattered: merge other sizes' empty slabs into the page pool
            # first, so that the slabs are cut from the runs `blocks_free` counted (claiming from the
            # free pages first could split such a run and leave too little).
            self._reclaim(exclude=slot)
        if cls.n_free < n:
            want = -(-(n - cls.n_free) // cls.slots_per_slab)  # slabs still needed
            want -= self._claim_slabs(cls, want)
            if want:
                self._reclaim(exclude=slot)
                if self._claim_slabs(cls, want) < want:
                    # This size's own empty slabs split the runs `blocks_free` counted: cut anew.
                    self._reclaim(exclude=None)
                    want = -(-(n - cls.n_free) // cls.slots_per_slab)
                    if self._claim_slabs(cls, want) < want:  # can_fit said yes: the runs must exist
                        return None
        return self._hand_out(cls, cls.pop(n), block_bytes)

    def alloc_in_used_slabs(self, block_bytes: int, n: int) -> np.ndarray | None:
        """n slot offsets for blocks of `block_bytes` from free slots of their size in slabs that hold
        a used slot already, or None when there are fewer: never a free page, nor an empty slab
        (which `blocks_free` counts as room for every other size). So what other sizes could take
        stays as it was: room for a reservation that passes waiting ones of other sizes."""
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        cls = self._classes.get(self.slot_for(block_bytes))
        if cls is None or cls.n_free < n or (cls.no_fit[0] == cls.changes and n >= cls.no_fit[1]):
            return None  # (nothing of the class changed since fewer were found: no pass over its free stack)
        free = cls.free[: cls.n_free]
        usable = np.flatnonzero(self._page_used[self._head_of(free)] > 0)
        if len(usable) < n:
            cls.no_fit = (cls.changes, n)
            return None
        taken = usable[-n:]  # nearest the top of the stack, as `pop` would take them
        offsets = free[taken].copy()
        rest = np.delete(free, taken)
        cls.free[: len(rest)] = rest
        cls.n_free = len(rest)
        return self._hand_out(cls, offsets, block_bytes)

    def _hand_out(self, cls: _SizeClass, offsets: np.ndarray, block_bytes: int) -> np.ndarray:
        """Mark these free slots of the class (off its free stack already) used."""
        cls.held[offsets // cls.slot] = offsets % cls.slot
        self._count_used(cls, offsets, 1)
        cls.n_used += len(offsets)
        cls.block_bytes_used += len(offsets) * block_bytes
        return offsets

    def free(self, block_bytes: int, offsets: np.ndarray) -> None:
        """Return slots. Each must be a slot of this size handed out by `alloc` and not freed since:
        a slot freed twice would later be handed to two blocks (their bytes overwriting each other),
        so a double free, or an offset that is not such a slot, raises ArenaError and frees none."""
        if len(offsets) == 0:
            return
        slot = self.slot_for(block_bytes)
        offsets = np.asarray(offsets, dtype=np.int64)
        cls = self._classes.get(slot)
        if cls is None:
            raise ArenaError(f"free of {len(offsets)} slots of {slot} bytes: no slot of that size was handed out")
        self._release_held(cls, offsets)
        self._count_used(cls, offsets, -1)
        cls.push(offsets)
        cls.n_used -= len(offsets)
        cls.block_bytes_used -= len(offsets) * block_bytes

    def quarantine(self, block_bytes: int, offsets: np.ndarray) -> int:
        """Take these free slots (of blocks of `block_bytes`) out of the free pool for good: their
        storage failed a write of its own. Each must be a free slot of that size (as after `free`),
        listed once; otherwise ArenaError naming the first that is not, and nothing changes.
        Returns the bytes set aside."""
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if not len(offsets):
            return 0
        slot = self.slot_for(block_bytes)
        cls = self._classes.get(slot)
        live = np.empty(0, dtype=np.int64) if cls is None else cls.free[: cls.n_free]
        uniq, counts = np.unique(offsets, return_counts=True)
        missing = offsets[~np.isin(offsets, live)]
        if len(missing) or (counts > 1).any():
            which = int(missing[0]) if len(missing) else int(uniq[int(np.argmax(counts > 1))])
            raise ArenaError(f"quarantine of slot {which} ({slot} bytes): it is not a free slot of that size "
                             f"(in use, quarantined already, listed twice, or never cut)")
        keep = live[~np.isin(live, offsets)]  # the free stack's order kept: pops still hand out ascending offsets
        cls.free[: len(keep)] = keep
        cls.n_free = len(keep)
        self._count_used(cls, offsets, 1)  # its slab is never empty again: never reclaimed for other sizes
        self._quarantined.update(dict.fromkeys(offsets.tolist(), slot))
        self.quarantined_bytes += len(offsets) * slot
        return len(offsets) * slot

    def requeue_quarantined(self, offsets: np.ndarray) -> None:
        """Move these quarantined slots to the end of `quarantined_offsets` (a re-test found them bad
        again: the next one takes others first)."""
        for o in np.asarray(offsets, dtype=np.int64).reshape(-1).tolist():
            self._quarantined[o] = self._quarantined.pop(o)

    def give_back(self, offsets: np.ndarray) -> int:
        """Return quarantined slots to the free pool (their storage passed a re-test). Each must be
        quarantined and listed once; otherwise ArenaError naming the first that is not, and nothing
        changes. Returns the bytes given back."""
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if not len(offsets):
            return 0
        uniq, counts = np.unique(offsets, return_counts=True)
        bad = [o for o in offsets.tolist() if o not in self._quarantined]
        if bad or (counts > 1).any():
            which = bad[0] if bad else int(uniq[int(np.argmax(counts > 1))])
            raise ArenaError(f"give back of slot {which}: it is not a quarantined slot (never quarantined, given "
                             "back already, or listed twice)")
        sizes = self.quarantined_slot_bytes(offsets)
        for slot in np.unique(sizes).tolist():
            mine = offsets[sizes == slot]
            cls = self._classes[slot]
            self._count_used(cls, mine, -1)  # (the slab may now be empty: reclaimable for other sizes)
            cls.push(mine)
        for o in offsets.tolist():
            del self._quarantined[o]
        given = int(sizes.sum())
        self.quarantined_bytes -= given
        return given

    def _count_used(self, cls: _SizeClass, offsets: np.ndarray, delta: int) -> None:
        """Add `delta` to the used-slot count of each offset's slab (offsets distinct: with one slot
        per slab, so are their slabs)."""
        add_at(self._page_used, self._head_of(offsets), delta, distinct=cls.slots_per_slab == 1)
        cls.changes += 1

    @staticmethod
    def _release_held(cls: _SizeClass, offsets: np.ndarray) -> None:
        """Mark the slots free; ArenaError naming the first offset that is not a handed-out slot of
        this class (or that comes twice), and then nothing is marked."""
        idx, rem = np.divmod(offsets, cls.slot)
        ok = (offsets >= 0) & (idx < len(cls.held))
        ok[ok] = cls.held[idx[ok]] == rem[ok]
        if ok.all():
            # Each position writes its own tag: a slot listed twice keeps only its last tag.
            tags = (-2 - np.arange(len(offsets))).astype(cls.held.dtype)
            cls.held[idx] = tags
            if (cls.held[idx] == tags).all():
                cls.held[idx] = -1
                return
            cls.held[idx] = rem  # a slot listed twice: every slot stays as it was
            uniq, counts = np.unique(offsets, return_counts=True)
            bad = int(uniq[int(np.argmax(counts > 1))])
        else:
            bad = int(offsets[int(np.argmin(ok))])
        raise ArenaError(f"free of slot {bad} ({cls.slot} bytes): it is not in use (freed twice, "
                         "never handed out, or a slot of another size or tier)")

    # -- slabs -------------------------------------------------------------------------------
    def _slab_shape(self, slot: int) -> tuple[int, int]:
        return slab_shape(slot, self.page_bytes, self.n_pages)

    def _head_of(self, offsets: np.ndarray) -> np.ndarray:
        return self._page_head[offsets // self.page_bytes]

    def _class(self, slot: int) -> _SizeClass:
        cls = self._classes.get(slot)
        if cls is None:
            pages, per_slab = self._slab_shape(slot)
            cls = _SizeClass(slot=slot, slab_pages=pages, slots_per_slab=per_slab,
                             free=np.empty(64, dtype=np.int64),
                             held=np.zeros(0, dtype=np.int32 if slot < 1 << 31 else np.int64))
            self._classes[slot] = cls
        return cls

    def _claim_slabs(self, cls: _SizeClass, k: int) -> int:
        """Claim up to `k` slabs for the class, first fit (the same slabs, in the same order, as `k`
        claims one at a time); how many were claimed. One pass over the page map for all of them: a
        promotion of blocks as large as a page claims a slab per block."""
        heads = self._find_runs(cls.slab_pages, k)
        if not len(heads):
            return 0
        # Every array made before the map changes: a MemoryError (ulimit -v) left pages claimed whose
        # slots were never added, lost until a restart (a review). Each slab's slots pushed in reverse,
        # slab after slab, so that pops hand out ascending offsets (sequential I/O on fresh tiers).
        pages, base = (heads[:, None] + np.arange(cls.slab_pages)).ravel(), heads * self.page_bytes
        owners, end = np.repeat(heads, cls.slab_pages), int(base[-1] + cls.slab_pages * self.page_bytes) // cls.slot + 1
        held = np.full(max(end, 2 * len(cls.held)), -1, dtype=cls.held.dtype) if end > len(cls.held) else None
        slots = (base[:, None] + cls.slot * np.arange(cls.slots_per_slab - 1, -1, -1, dtype=np.int64)).ravel()
        cls.push(slots[:0], room=len(slots))  # (its stack grown first)
        self._page_free[pages] = False
        self._n_free_pages -= len(pages)
        if cls.slab_pages == 1:  # the first free pages were taken: none is left below the last
            self._free_from = int(heads[-1]) + 1
        self._page_class[heads] = cls.slot
        self._page_head[pages] = owners
        if held is not None:  # the map covers the slabs claimed so far
            held[: len(cls.held)] = cls.held
            cls.held = held
        cls.push(slots)
        return len(heads)

    def _find_runs(self, length: int, k: int) -> np.ndarray:
        """Head pages of the first `k` disjoint runs of `length` free pages, in page order (fewer
        when there are not so many): what `k` first-fit searches, each after claiming the last, find."""
        if k <= 0 or self._n_free_pages < length:
            return np.empty(0, dtype=np.int64)
        lo = self._free_from
        if length == 1:
            return self._first_free_pages(lo, k)
        # Free pages in each window of `length`, from a running count (int64: a sum in the pages'
        # own small type would wrap for slabs of 128 pages or more, and no such slab would be found).
        count = np.concatenate(([0], np.cumsum(self._page_free[lo:], dtype=np.int64)))
        hits = np.flatnonzero(count[length:] - count[:-length] == length) + lo
        heads, i = [], 0
        while len(heads) < k and i < len(hits):
            heads.append(int(hits[i]))
            i = int(np.searchsorted(hits, hits[i] + length))  # the next run that does not overlap
        return np.asarray(heads, dtype=np.int64)

    def _first_free_pages(self, lo: int, k: int) -> np.ndarray:
        """The first k free pages from page `lo` on, read a window at a time: a claim of a few slabs
        reads as far as they lie, not the whole page map."""
        out, have = [], 0
        while have < k and lo < self.n_pages:
            found = np.flatnonzero(self._page_free[lo:lo + SCAN_PAGES])[: k - have] + lo
            out.append(found)
            have += len(found)
            lo += SCAN_PAGES
        return np.concatenate(out).astype(np.int64) if out else np.empty(0, dtype=np.int64)

    def _empty_slab_heads(self, cls: _SizeClass) -> np.ndarray:
        heads = np.flatnonzero((self._page_class == cls.slot) & (self._page_used == 0) & ~self._page_free)
        return heads

    def _spare_pages(self, exclude: int) -> np.ndarray:
        """Mask of the pages a slab of size `exclude` could take: free ones and those of every size's
        empty slabs (which `_reclaim` gives back; its own, where its slabs are several pages, too)."""
        spare = self._page_free.copy()
        for s, c in self._classes.items():
            if s != exclude or c.slab_pages > 1:
                heads = self._empty_slab_heads(c)
                if len(heads):
                    spare[(heads[:, None] + np.arange(c.slab_pages)).ravel()] = True
        return spare

    def _reclaimable_pages(self, exclude: int) -> int:
        return sum(len(self._empty_slab_heads(c)) * c.slab_pages
                   for s, c in self._classes.items() if s != exclude)

    def _reclaim(self, exclude: int | None) -> None:
        """Give the empty slabs of other size classes (of every one, with None) back to the page pool."""
        for slot, cls in self._classes.items():
            if slot == exclude:
                continue
            heads = self._empty_slab_heads(cls)
            if not len(heads):
                continue
            live = cls.free[: cls.n_free]
            keep = live[~np.isin(self._head_of(live), heads)]
            cls.free[: len(keep)] = keep
            cls.n_free = len(keep)
            for h in heads:
                self._page_free[h: h + cls.slab_pages] = True
                self._page_class[h] = 0
            self._free_from = min(self._free_from, int(heads[0]))
            self._n_free_pages += len(heads) * cls.slab_pages
