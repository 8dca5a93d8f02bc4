"""Room for one slot size among blocks of others, made slab by slab (a mixin of Placement, which
calls `_select_slabs` from `select`).

A block frees room for blocks of another slot size only once every slot of its slab is free (its
pages go back to the pool: alloc.py), so victims chosen by score alone, spread over every slab,
emptied none until most of the tier had gone. Needs the Placement's `table`, `_leaving`,
`_childless`, `_forest`, `_slot_bytes` and `_with_descendants`.
"""

from __future__ import annotations

import numpy as np

from dflash2.pageruns import runs, slabs_in_runs
from dflash2.forest import subtree_heights
from dflash2.tiers import Tier


class SlabRoom:
    def _select_slabs(self, tier: Tier, need_bytes: int, block_bytes: int, reach: np.ndarray,
                      scores: np.ndarray, evict: bool, through: Tier | None) -> np.ndarray:
        """`select` for room for blocks of `block_bytes` in a tier that holds blocks in slots of other
        sizes: such a block frees room for them only once every slot of its slab is free (its pages
        go back to the pool: alloc.py), and the lowest-scored blocks lie spread over every slab. Taken
        by score alone, they emptied no slab until most of the tier had gone (HBM of 64 MiB full of
        16 KiB blocks, half of them read again: one 1 MiB block dropped 2,079 of its 4,096 blocks
        with heat, 3,488 with lru, where one 2 MiB page was needed).
        So the victims are whole slabs, and blocks of the room's own slot size one by one: among the
        slabs whose every slot holds a block that may leave now (with the descendants that hold it
        back, as `_leaving` finds them: prefix order kept), those whose hottest block is coldest
        (`_slab_victims`). A slab is ranked by the highest score among its blocks and the
        descendants that leave with them, not by their sum: scores only rank blocks (policy/base.py;
        lru's are times, heat's logarithms, below zero too), and by the highest, the slabs emptied
        lose the coldest hottest block there is to lose. Returns the victims in leaving order
        (leaves first), all of them: a slab emptied in part frees nothing.
        First without the descendants: each slab ranked by its own blocks' scores. Where the slabs
        so chosen leave whole by themselves (no block of theirs waits on a child elsewhere), that is
        the choice the descendants would give too (they only raise a slab's rank, and these slabs'
        not at all), found without the passes over every movable row that prefix order costs
        (pointer jumping: 85-150 ms at 262,144 blocks of 16 KiB in chains, against 10 without)."""
        rows = np.flatnonzero(reach)
        # Among blocks of the room's size scored alike, leaves first (0) and the others after (1): a
        # chain committed at once has one score under lru, and its head, which cannot leave first,
        # was taken. (Taken last whatever their score, a review found hot slabs emptied while a cold
        # chain stayed, and a chain leaving a block per round.)
        slot = self.table.allocators[tier].slot_for(block_bytes)
        own = self._slot_bytes(tier, rows) == slot
        inner = np.zeros(len(rows), dtype=np.int64)
        inner[own] = ~self._childless(tier, evict, through, rows[own])
        marked = np.flatnonzero(self._slab_victims(tier, need_bytes, block_bytes, rows, scores[rows], inner))
        first = self._leaving(tier, marked, evict, scores, through)
        if len(first) and np.isin(marked, first).all():
            # Every block chosen leaves now, each slab emptying: the choice the full pass makes too.
            return first.astype(np.int64)
        parent, blocked = self._forest(tier, rows, evict, through)
        height, peak = subtree_heights(parent, blocked, scores[rows])
        go = height >= 0  # may leave now, with the descendants that hold it back
        rows = rows[go]
        marked = self._slab_victims(tier, need_bytes, block_bytes, rows, peak[go], height[go])
        leaving = np.zeros(len(reach), dtype=bool)
        leaving[rows] = True
        victims = np.flatnonzero(self._with_descendants(marked, leaving))
        return self._leaving(tier, victims, evict, scores, through).astype(np.int64)

    def _slab_victims(self, tier: Tier, need_bytes: int, block_bytes: int, rows: np.ndarray,
                      cost: np.ndarray, height: np.ndarray | None = None) -> np.ndarray:
        """Mask over every row: the blocks (of `rows`, ascending, each costing `cost`) to let go for
        need_bytes of slots of `block_bytes`: of the room's slot size one by one (a slot each), of
        the others slab by slab, among the slabs whose every used slot holds one of `rows` (a
        quarantined slot holds none: its slab never empties), ranked by their highest cost, coldest
        first (ties: blocks of the room's size, then pages in order); where a slot of the room's
        size spans several pages, runs of that many contiguous pages, each free or such a slab.
        Free pages and empty slabs already count as room (alloc.room_for). `height`:
        each row's levels of descendants leaving with it (or 0 for a leaf and 1 for another block),
        which breaks ties among blocks of the room's size (leaves first)."""
        alloc = self.table.allocators[tier]
        c = self.table.cols
        slot = alloc.slot_for(block_bytes)
        span, per_slab = alloc.slab_shape_of(block_bytes)
        own = self.table.slot_sizes(tier)[c.layout[rows]] == slot
        other = rows[~own]
        head, page_slot, used = alloc.page_slabs()
        n_pages = len(head)
        heads = alloc.slabs_of(c.offset[other])
        going = np.bincount(heads, minlength=n_pages)  # per slab head: its slots whose block may leave
        top = np.full(n_pages, -np.inf)
        np.maximum.at(top, heads, cost[~own].astype(np.float64))
        at = np.maximum(head, 0)
        of_other = (head >= 0) & (page_slot != slot)
        # Room already: free pages, and empty slabs of other sizes and, where a slot spans several
        # pages, of its own (alloc cuts them anew, as `blocks_free` counts them).
        free = room = (head < 0) | (((page_slot != slot) | (span > 1)) & (head >= 0) & (used[at] == 0))
        clear = of_other & (used[at] > 0) & (going[at] == used[at])
        page_cost = np.where(clear, top[at], -np.inf)
        if span > n_pages:  # (no run of pages that long: room for none)
            windows, win_cost = np.empty(0, dtype=np.int64), np.empty(0)
            win_clear = windows
        elif span == 1:
            windows, win_cost = np.flatnonzero(clear), page_cost[clear]
            win_clear = np.ones(len(windows), dtype=np.int64)
        else:
            # Free pages already counted as room (alloc.room_for: whole runs of `span` in each run
            # of free pages) join no window: counted again beside one clear slab, each such window
            # emptied a slab for no room (a review: 36 blocks dropped where 20 made the room).
            free = free & ~_counted_runs(free, clear, span)
            view = np.lib.stride_tricks.sliding_window_view
            whole = view(free | clear, span).all(axis=1) & view(clear, span).any(axis=1)
            windows = np.flatnonzero(whole)
            win_cost = view(page_cost, span).max(axis=1)[windows]
            win_clear = view(clear, span).sum(axis=1)[windows]
        need_slots = -(-need_bytes // slot)
        # Ties (a window's cost is its hottest slab's) go to the window of fewer slabs to empty: over
        # [clear, clear, free] and [clear, free, free] the first was taken, a slab emptied for no room.
        order = np.lexsort((win_clear, win_cost))
        windows, win_cost = windows[order], win_cost[order]
        want = -(-need_slots // per_slab)
        if span > 1:  # (disjoint runs: two that share a page free it once)
            keep, busy = [], np.zeros(n_pages, dtype=bool)
            for i, w in enumerate(windows.tolist()):
                if len(keep) == want:
                    break
                if not busy[w:w + span].any():
                    busy[w:w + span] = True
                    keep.append(i)
            windows, win_cost = windows[keep], win_cost[keep]
        windows, win_cost = windows[:want], win_cost[:want]
        joined, joined_runs, joined_cost = np.empty(0, dtype=np.int64), 0, np.empty(0)
        if span > 1 and len(windows) < want:
            # Runs that only clear slabs apart from each other make, joining free pages that room
            # counts already: 6 pages, 1-3 and 5 free, 0 and 4 clear, make a second run of 3 only
            # both emptied (no window is free or clear throughout). An allocation the bound let
            # through demoted most of HBM, then found no victims and was refused (a review).
            joined, joined_runs = _joined_slabs(room, clear, head, top, span, want)
            if joined_runs > len(windows):
                windows, win_cost = windows[:0], win_cost[:0]
                joined_cost = np.array([top[joined].max()])
            else:
                joined, joined_runs = joined[:0], 0
        # Blocks of the room's size: no more than need_slots of the cheapest can be taken.
        mine, mine_cost = rows[own], cost[own]
        if height is not None:
            # Among equal costs, blocks of fewer levels below them first (leaves before their
            # parents): a chain's blocks scored alike went from its head, each taking the chain below
            # it along (a reservation of 16 blocks demoted 32, a whole chain, where 16 of its tail did).
            first = np.lexsort((height[own], mine_cost))[:need_slots]
            mine, mine_cost = mine[first], mine_cost[first]
        elif len(mine) > need_slots:
            low = np.argpartition(mine_cost, need_slots - 1)[:need_slots]
            low.sort()  # (rows in order: ties go as a stable sort of them all would take them)
            mine, mine_cost = mine[low], mine_cost[low]
        unit_cost = np.concatenate((mine_cost.astype(np.float64), win_cost, joined_cost))
        gain = np.concatenate((np.ones(len(mine), dtype=np.int64), np.full(len(windows), per_slab, dtype=np.int64),
                               np.full(len(joined_cost), joined_runs * per_slab, dtype=np.int64)))
        pick = np.argsort(unit_cost, kind="stable")
        pick = pick[:int(np.searchsorted(np.cumsum(gain[pick]), need_slots)) + 1]
        marked = np.zeros(len(c.tier), dtype=bool)
        marked[mine[pick[pick < len(mine)]]] = True
        at_runs = pick[(pick >= len(mine)) & (pick < len(mine) + len(windows))] - len(mine)
        runs = windows[at_runs]
        emptied = head[(runs[:, None] + np.arange(span)).ravel()]
        if (pick == len(mine) + len(windows)).any():
            emptied = np.concatenate((emptied, joined))
        marked[other[np.isin(heads, emptied[emptied >= 0])]] = True
        return marked


def _counted_runs(free: np.ndarray, clear: np.ndarray, span: int) -> np.ndarray:
    """Mask of the free pages that room already counts for slots of `span` pages: in each maximal
    run of free pages, (length // span) * span of them (pageruns.slabs_in_runs counts as many), the
    pages left over at the end where a clear slab adjoins its start, else at its start (left over
    only at the end, a clear slab before a run could join none: room that emptying it made was not
    found, and an allocation was refused, a review)."""
    starts, ends = runs(free)
    counted = np.zeros(len(free), dtype=bool)
    for start, end in zip(starts.tolist(), ends.tolist()):
        over = (end - start) % span
        if over and start > 0 and clear[start - 1]:
            counted[start + over:end] = True
        else:
            counted[start:end - over] = True
    return counted


def _joined_slabs(room: np.ndarray, clear: np.ndarray, head: np.ndarray, top: np.ndarray, span: int,
                  want: int) -> tuple[np.ndarray, int]:
    """The head pages of clear slabs to empty, coldest hottest block first (`top`), for up to `want`
    more runs of `span` pages than the pages in `room` hold (pageruns.slabs_in_runs), and how many more
    they make: the fewest of the coldest that make the most they can, then less those the count does
    not need (the dearest first). A pass over the pages per count: taken only where no window makes
    the room (`_slab_victims`)."""
    base = slabs_in_runs(room, span)
    slabs = np.unique(head[clear])
    slabs = slabs[np.argsort(top[slabs], kind="stable")]

    def more(chosen: np.ndarray) -> int:
        return slabs_in_runs(room | np.isin(head, chosen), span) - base
    goal = min(want, more(slabs)) if len(slabs) else 0
    if goal <= 0:
        return slabs[:0], 0
    lo, hi = 1, len(slabs)  # the fewest of the coldest that make `goal` (the count only grows with more)
    while lo < hi:
        mid = (lo + hi) // 2
        if more(slabs[:mid]) >= goal:
            hi = mid
        else:
            lo = mid + 1
    chosen = list(slabs[:lo].tolist())
    for h in reversed(chosen[:-1][-PRUNE_SLABS:]):  # (the last one taken is needed: one fewer fell short)
        rest = [x for x in chosen if x != h]
        if more(np.array(rest, dtype=np.int64)) >= goal:
            chosen = rest
    return np.array(chosen, dtype=np.int64), goal


PRUNE_SLABS = 64  # the most slabs `_joined_slabs` tries to do without, one pass over the pages each
