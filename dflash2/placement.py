"""Placement mechanism: watermarks, demotion down the tiers, promotion on access, prefix order.

Policy apart from mechanism: the policy only scores blocks (policy/base.py). This module decides how
many bytes must leave a tier, which blocks may leave (unpinned, RESIDENT, no child in this tier or
a faster one: descendants leave a tier before their ancestors), and demotion.py moves them down or
drops them; a promotion (promotion.py) brings the prefix (ancestors) first.

A block is *cold* when its score's percentile among the blocks of its tier is below
`cold_threshold`. Background rebalancing moves only cold blocks, and only while a tier is above its
high watermark (down to its low watermark). Making room for an allocation may take any movable
block: the request would otherwise not run at all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from dflash2.backoff import WriteBackoff
from dflash2.coldcut import cold_mask
from dflash2.demotion import Demotion
from dflash2.drainorder import DrainCut, DrainSelection
from dflash2.forest import local_parents, lowest_levels, marked_or_above, reaches_marked, subtree_heights
from dflash2.kth import kth_lowest
from dflash2.mover import Mover
from dflash2.policy.base import Policy
from dflash2.promotion import Promotion
from dflash2.readcost import ReadCost
from dflash2.rebalance import Rebalancing
from dflash2.roombound import RoomBound
from dflash2.slabroom import SlabRoom
from dflash2.table import BlockState, BlockTable
from dflash2.table.columns import NO_CLIENT
from dflash2.tiers import Tier

log = logging.getLogger("dflash2.placement")
# A promotion's or a reservation's room is made a swap batch at a time, but no more than this share
# of the tier, and only where that is ROOM_BATCH_MIN blocks or more (`room_batch`): a tier under
# 65,536 blocks makes room for each call's own blocks, as before. Made in batches, it changed which
# blocks stay: up to the low watermark, as an allocation's, the policy bench's prefix hit rate fell
# 1.6% (synthetic trace, HBM 2,000 and DRAM 8,000 blocks); two blocks at a time, 0.7%. On small
# tiers a pass over the table is cheap (1 ms at 10,000 blocks); at a million, a call's 6.4 ms.
ROOM_BATCH_SHARE = 1024
ROOM_BATCH_MIN = 64


@dataclasses.dataclass(frozen=True)
class Watermark:
    high: float
    low: float


@dataclasses.dataclass
class PlacementStats:
    demoted: int = 0
    evicted: int = 0
    evicted_bytes: int = 0  # their blocks' bytes (the duel's miniatures turn over by bytes: duel.py)
    lost: int = 0  # read back from NVMe failed (I/O error or checksum): dropped, a miss
    orphaned: int = 0  # cached children dropped with a lost parent (nobody could find them by lookup)
    promoted: int = 0
    not_admitted: int = 0  # dropped instead of demoted: the tier below refused them (counted in `evicted` too)
    not_kept: int = 0  # dropped instead of demoted: reading them back from below costs more than a recompute (likewise)
    past_full: int = 0  # demoted past a tier that had no room it could make (counted in `demoted` too)
    write_backoffs: int = 0  # times a tier's writes failed and it took no blocks for a while (`lower`)
    read_backoffs: int = 0  # times a failing tier's reads failed and it was neither read nor written a while


class Placement(Demotion, Rebalancing, Promotion, RoomBound, WriteBackoff, SlabRoom, DrainSelection):
    # Selection rounds per call: each round can free the parents of the previous round's victims.
    MAX_ROUNDS = 4096  # a round takes what lies under one cut (see select); the next re-ranks
    # `_leaving` with a room to make peels this many levels from the leaves before it ranks every row,
    # where the room is at most 1/PEEL_SHARE of the rows' bytes (more: the peel would mostly fail).
    PEEL_LEVELS, PEEL_SHARE = 32, 4
    # The cut gathers the reachable rows' scores when they are at most 1/GATHER_BELOW of the table.
    GATHER_BELOW = 4
    # `leave_whole` walks up a level at a time until it has walked one level per this many rows of
    # its mask (a level's numpy calls cost about what a pass of pointer jumping costs over that many
    # rows), then jumps: a walk of thousands of levels of a few rows each took seconds.
    LEAVE_WHOLE_JUMP_AFTER = 256
    def __init__(self, table: BlockTable, mover: Mover, policy: Policy, tiers: list[Tier],
                 watermarks: dict[Tier, Watermark], cold_threshold: float):
        self.table = table
        self.mover = mover
        self.policy = policy
        self.tiers = sorted(tiers)  # present tiers, fastest first
        self.watermarks = watermarks
        self.cold_threshold = cold_threshold
        self.stats = PlacementStats()
        # (tier, evict, idle_only) -> the tier's `movable_epoch` when nothing could leave it that
        # way (before protect and priority, which only narrow the mask): until a call may have made
        # one of its blocks movable, a selection there finds nothing without a pass over every row
        # (a refused allocate, one held behind the queue, a promotion into an HBM all held, each
        # retried by its client, paid two or four such passes a call).
        self._nothing_movable: dict[tuple[int, bool, bool], int] = {}
        self._init_rebalancing()
        self._init_backoff()  # write_backoff, monotonic (backoff.py)
        # Sources of rows that background rebalancing leaves where they are: blocks just prefetched
        # for a reader that has not read them yet (the prefetcher registers itself). Their scores
        # are old (a prefetch is not a read), so they would be the tier's coldest, and the tick
        # after a prefetch would send them straight back down before their read.
        self.awaiting_read: list[Callable[[], np.ndarray]] = []
        # Whether a tier is worth holding a layout's blocks (cost-aware reuse, dflash2/readcost.py):
        # a block whose read back from the tier below would cost more than its engine recomputing it
        # is dropped instead of demoted there. None: every tier holds every block.
        self.read_cost: ReadCost | None = None

    # -- tier figures ----------------------------------------------------------------------
    def lower(self, tier: Tier) -> Tier | None:
        """The tier that blocks leaving `tier` go down to: the next one that takes writes now (a
        storage tier whose writes failed takes none while it backs off), or None (they are dropped)."""
        below = [t for t in self.tiers if t > tier and self.writable(t)]
        return below[0] if below else None

    def used_fraction(self, tier: Tier) -> float:
        """How full the tier is, as its watermarks weigh it: used slots and their slabs' page tails (tiers.fill)."""
        alloc = self.table.allocators[tier]
        return alloc.full_bytes / alloc.capacity_bytes if alloc.capacity_bytes else 1.0

    def free_bytes(self, tier: Tier, block_bytes: int | None = None) -> int:
        """Free bytes of the tier; with block_bytes, only what blocks of that size can use (free
        slots of other sizes do not hold them)."""
        alloc = self.table.allocators[tier]
        return alloc.free_bytes if block_bytes is None else alloc.room_for(block_bytes)

    # -- choosing victims ------------------------------------------------------------------
    def movable(self, tier: Tier, *, evict: bool, protect: np.ndarray | None = None,
                below_priority: int | None = None, idle_only: bool = False) -> np.ndarray:
        """Mask over every row: may leave `tier` once its descendants have (`_childless` says which
        may leave now). Whole-array operations, no gathers: this runs over a million blocks.
        Demotion needs the block unpinned (and nobody referencing it when idle_only); eviction needs
        it published and nobody holding it."""
        c = self.table.cols
        mask = (c.tier == int(tier)) & (c.state == int(BlockState.RESIDENT))
        if evict:
            # A published block has no owner: cheaper to test than the 64-bit key. (Two compares
            # cost less than one `refs | pins`, which writes a 32-bit temporary.)
            mask &= c.refs == 0
            mask &= c.pins == 0
            mask &= c.owner == NO_CLIENT
        else:
            mask &= c.pins == 0
            if idle_only:
                mask &= c.refs == 0
        return self._unprotected(mask, protect, below_priority)

    def leave_whole(self, tier: Tier, mask: np.ndarray, evict: bool) -> np.ndarray:
        """`mask` (rows of `tier` that may leave once their descendants have: `movable`) less the rows
        held back by a descendant that cannot leave (a block leaves a tier only after its children
        there, or for an eviction every cached child: the inner blocks of a chain whose leaf is
        pinned stay). A row with a holding child outside the mask is held, and so is every ancestor
        of it: walked up a level at a time from the held rows only (the pointer jumping of
        `subtree_heights` over every row cost 300 ms at a million blocks, an experiment), each
        level's repeats dropped by a scatter (a sort a level cost more), and past
        max(64, rows / LEAVE_WHOLE_JUMP_AFTER) levels the rest by pointer jumping over the rows still
        leaving (a level at a time, 4 chains 65,536 deep under pinned leaves took 0.5 s a call,
        twice a step while a reservation waited; one leaf held 32,768 deep 505 ms: two reviews)."""
        c = self.table.cols
        rows = np.flatnonzero(mask)
        holding = self._holding(tier, rows, evict, None)
        parents = c.parent[rows]
        leaving_kids = np.bincount(parents[parents >= 0], minlength=len(mask))[rows]
        held = rows[holding > leaving_kids]
        if not len(held):
            return mask
        out = mask.copy()
        out[held] = False
        up = c.parent[held]
        levels = 0
        first = np.empty(len(mask), dtype=np.int64)  # (one place of each row in a level: its repeats dropped, no sort)
        while len(up := up[up >= 0]):
            if levels > max(64, len(rows) // self.LEAVE_WHOLE_JUMP_AFTER):
                left = np.flatnonzero(out)
                marks = np.zeros(len(left), dtype=bool)
                marks[np.searchsorted(left, up[out[up]])] = True
                out[left[marked_or_above(local_parents(left, c.parent[left]), marks)]] = False
                return out
            up = up[out[up]]  # (an ancestor outside the mask holds its own ancestors: above)
            at = np.arange(len(up))
            first[up] = at  # (whichever write of a repeated row stays, one place of it matches)
            up = up[first[up] == at]
            out[up] = False
            up = c.parent[up]
            levels += 1
        return out

    def _childless(self, tier: Tier, evict: bool, through: Tier | None = None,
                   rows: np.ndarray | None = None) -> np.ndarray:
        """Mask: no cached child anywhere (eviction), or none in `tier` or a faster one (demotion;
        `through`: none down to that tier either, for a demotion that passes it). Over every row, or
        over `rows` only (gathered)."""
        c = self.table.cols
        at = slice(None) if rows is None else rows
        if evict:
            return c.nkids[at] == 0
        kids = c.kids[0, at]
        for t in range(1, max(tier, through or tier) + 1):
            kids = kids | c.kids[t, at]
        return kids == 0

    def _unprotected(self, mask: np.ndarray, protect: np.ndarray | None, below_priority: int | None) -> np.ndarray:
        if below_priority is not None:
            mask &= self.table.cols.priority < below_priority
        if protect is not None and len(protect):
            mask[protect] = False
        return mask

    def select(self, tier: Tier, need_bytes: int, *, evict: bool, cold: np.ndarray | None = None,
               protect: np.ndarray | None = None, below_priority: int | None = None,
               idle_only: bool = False, through: Tier | None = None, cut: DrainCut | None = None,
               block_bytes: int | None = None) -> np.ndarray:
        """Lowest-scored movable rows of `tier` whose slots add up to at least need_bytes (or all of
        them when there are not enough), in eviction order. `cold`: a mask of the rows that may go
        (the tier's cold blocks, fixed by the caller for the whole making of room); None: any.
        `block_bytes`: the room is for blocks of that size (need_bytes of their slots); where blocks
        in slots of other sizes lie in the tier, the victims empty whole slabs (`_select_slabs`).

        Prefix order lets only leaves leave, but the victims must be the lowest-scored blocks of the
        tier, not the lowest-scored leaves (that would push out a hot leaf while a cold chain waits
        above its own cold leaf). So the cut is the k-th lowest score among every row that could
        leave once its descendants have, and the rows at or below it whose descendants that hold them
        back are at or below it too are taken (`_leaving`: leaves first). What lies under the cut
        but is held back by a hotter descendant waits for the caller's next round (make_room).
        `cut`: a drain's cold cut kept in score order (drainorder.py), `cold` being its rows still
        in the tier: the same victims, found without passes over the whole table."""
        way = (int(tier), evict, idle_only)
        epoch = int(self.table.movable_epoch[int(tier)])
        if self._nothing_movable.get(way) == epoch:
            return np.empty(0, dtype=np.int64)
        # Whether blocks of another slot size than the room's lie here: a check of the tier's few
        # size classes, so a tier of one slot size keeps its one pass below.
        slabs = block_bytes is not None and self.table.allocators[tier].other_sizes_used(block_bytes)
        if (cut is not None and cut.usable and cut.tier == tier and cold is not None and need_bytes > 0
                and below_priority is None and not idle_only and not slabs):
            part = self._select_drain(cut, tier, need_bytes, evict, protect, through)
            if part is not None:
                return part
        reach = self.movable(tier, evict=evict, protect=protect, below_priority=below_priority,
                             idle_only=idle_only)
        n_reach = int(np.count_nonzero(reach))
        if not n_reach and protect is None and below_priority is None:
            self._nothing_movable[way] = epoch
        if not n_reach or need_bytes <= 0:
            return np.empty(0, dtype=np.int64)
        scores = self.policy.scores_all(self.table, self.table.clock())
        if cold is not None:
            reach &= cold
            n_reach = int(np.count_nonzero(reach))
            if not n_reach:
                return np.empty(0, dtype=np.int64)
        if slabs:
            return self._select_slabs(tier, need_bytes, block_bytes, reach, scores, evict, through)
        sizes = self.table.slot_sizes(tier)
        k = min(n_reach, int(np.ceil(need_bytes / max(1, int(sizes.min())))))
        part = self._leaving(tier, np.flatnonzero(self._at_or_below_cut(reach, n_reach, scores, k)), evict, scores,
                             through, need_bytes)
        if not len(part):
            # Everything below the cut waits on a child that cannot leave (pinned, held) or scores
            # above it: the lowest leaves go instead, together (ranking the blocks under them by their
            # subtree's highest score lowered heat's figures: docs/policy-experiments.md, "Victims").
            part = np.flatnonzero(reach & self._childless(tier, evict, through))
            if not len(part):
                return np.empty(0, dtype=np.int64)
            part = part[np.argsort(scores[part], kind="stable")]
        slot = sizes[self.table.cols.layout[part]]
        taken = int(np.searchsorted(np.cumsum(slot), need_bytes)) + 1
        return part[:taken].astype(np.int64)

    def _at_or_below_cut(self, reach: np.ndarray, n_reach: int, scores: np.ndarray, k: int) -> np.ndarray:
        """Mask of the reachable rows scored at or below the k-th lowest reachable score (k at most
        n_reach; `kth.py`: found among few even where thousands of scores tie at it). Where the
        reachable rows are a small share of the table (a tier's blocks among every tier's), they
        alone are gathered and compared: passes over every row cost a small tier's choice 1.8x
        (100 rows of a million, a review)."""
        if k >= n_reach:
            return reach  # (every reachable row: no partition needed)
        if n_reach * self.GATHER_BELOW > len(scores):
            return reach & (scores <= kth_lowest(scores, k, where=reach))
        rows = np.flatnonzero(reach)
        kept = scores[rows]
        below = np.zeros(len(reach), dtype=bool)
        below[rows[kept <= kth_lowest(kept, k)]] = True
        return below

    def _leaving(self, tier: Tier, rows: np.ndarray, evict: bool, scores: np.ndarray | None,
                 through: Tier | None = None, need_bytes: int | None = None) -> np.ndarray:
        """Those of `rows` (ascending: rows of `tier` that may leave, at or under the cut) that
        can leave together with their descendants, in the order they leave: a row qualifies when
        every child that holds it back qualifies (for a demotion its children in `tier` or a faster
        one, for an eviction every cached child). Ordered leaves first, by height in the subtree
        that leaves (then lowest score when `scores` are given, then row; for a policy of
        `strict_order`, Belady's, by the highest score in each subtree, then height): the order a demotion
        moves them in (a move cut short leaves no parent below its child) and an eviction drops
        them in. So a cold chain leaves whole, in one move of many blocks, instead of one level per
        round: a round per level made the demotions of a prefix-tree workload batches of one or two
        blocks (the tiered replays of `bench policy`: 2.5 blocks a batch, median 1; then 25-73, its
        `move_batches`).
        The heights come from pointer jumping (`forest.py`): a chain 1,024 deep takes 10 rounds of
        numpy calls, not 1,024. `need_bytes` (select's room): only the head of that order that holds
        it, where a few levels peeled from the leaves do (`forest.lowest_levels`; tried where the room is
        at most 1/PEEL_SHARE of the rows' bytes): the same victims."""
        if not len(rows):
            return rows
        parent, blocked = self._forest(tier, rows, evict, through)
        if scores is not None and self.policy.strict_order:
            # Strictly by score, a block no earlier than its descendants: by the highest score in
            # its subtree (an ancestor's is never below its descendants'), leaves first among equals.
            height, peak = subtree_heights(parent, blocked, scores[rows])
            go = height >= 0
            rows, height, peak = rows[go], height[go], peak[go]
            return rows[np.lexsort((rows, height, peak))]
        height = None
        if need_bytes is not None and scores is not None:  # the order's head only: the rows that go
            weight = self._slot_bytes(tier, rows)
            if need_bytes * self.PEEL_SHARE <= weight.sum():
                height = lowest_levels(parent, blocked, weight, need_bytes, self.PEEL_LEVELS)
        if height is None:
            height = subtree_heights(parent, blocked)
        go = height >= 0
        rows, height = rows[go], height[go]
        if scores is None:
            return rows[np.lexsort((rows, height))]
        return rows[np.lexsort((rows, scores[rows], height))]

    def _forest(self, tier: Tier, rows: np.ndarray, evict: bool,
                through: Tier | None) -> tuple[np.ndarray, np.ndarray]:
        """`rows` (ascending, rows of `tier`) as a forest: each one's parent among them (-1: none),
        and whether it waits on a child outside them (`_leaving`)."""
        c = self.table.cols
        holding = self._holding(tier, rows, evict, through)
        parent = local_parents(rows, c.parent[rows])
        # Every row of `rows` lies in `tier` and is a cached child of its parent, so it holds its
        # parent back; a row with more holding children than it has in `rows` waits on one outside.
        return parent, holding > np.bincount(parent[parent >= 0], minlength=len(rows))

    def _holding(self, tier: Tier, rows: np.ndarray, evict: bool, through: Tier | None) -> np.ndarray:
        """Per row, its children that hold it in `tier`: every cached child (eviction), or those in
        `tier` or a faster one (demotion; `through`: down to that tier too)."""
        c = self.table.cols
        if evict:
            return c.nkids[rows].astype(np.int64)
        holding = c.kids[0, rows].astype(np.int64)
        for t in range(1, max(int(tier), int(through or tier)) + 1):
            holding += c.kids[t, rows]
        return holding

    def _cold_mask(self, tier: Tier, scores: np.ndarray) -> np.ndarray:
        """Mask of the rows of `tier` below its `cold_threshold` percentile, each ranked by the
        highest score in its subtree in the tier (coldcut.py: no block is colder than one under it)."""
        return cold_mask(self.table.cols, int(tier), scores, self.cold_threshold)

    def _with_descendants(self, marked: np.ndarray, among: np.ndarray) -> np.ndarray:
        """Mask: `marked` (a mask over every row) and the rows of `among` (a mask) that descend from
        a marked row through rows of `among` (`forest.reaches_marked`: log2 of a chain's depth in
        rounds). A drop while a storage tier backs off takes its blocks' descendants on the tiers
        below (backoff.py)."""
        nodes = np.flatnonzero(among)
        out = marked.copy()
        if len(nodes) and marked.any():
            out[nodes[reaches_marked(self.table.cols.parent, marked, nodes)]] = True
        return out

    def _slot_bytes(self, tier: Tier, rows: np.ndarray) -> np.ndarray:
        return self.table.slot_sizes(tier)[self.table.cols.layout[rows]]

    def room_below(self, tier: Tier) -> int:
        """Bytes the tiers below `tier` could take of blocks that are never dropped (a running
        request's, which preemption demotes): their free bytes and the slots of the blocks they may
        drop, at most (a block going further down takes room counted already). Running blocks whose
        only way down is a last tier full of pinned or running blocks cannot leave: counted movable,
        a reservation behind them was told "not enough HBM free yet", 0 s, at every poll (a review).
        A pass over the table per tier below. While a slower tier backs off, a block there may be
        dropped with its descendants on it (`_drop_while_backing_off`): counted held by them, running
        blocks a DRAM of such parents would take were told "no room for them in the tiers below" (a
        review's script)."""
        room, below = 0, self.lower(tier)
        while below is not None:
            droppable = self.movable(below, evict=True)
            if self._backing_off_below(below):  # (with descendants below none of which is held: a review)
                for slower in (t for t in self.tiers if t > below):
                    droppable |= self.movable(slower, evict=True)
                droppable = self.leave_whole(below, droppable, True) & (self.table.cols.tier == int(below))
            else:
                droppable = self.leave_whole(below, droppable, True)
            room += self.free_bytes(below) + int(self._slot_bytes(below, np.flatnonzero(droppable)).sum())
            below = self.lower(below)
        return room

    # -- making room -----------------------------------------------------------------------
    def make_room(self, tier: Tier, need_bytes: int, *, cold_only: bool = False,
                  protect: np.ndarray | None = None, below_priority: int | None = None,
                  idle_only: bool = False, block_bytes: int | None = None,
                  cold: np.ndarray | None = None, until_backoff: bool = False, cut: DrainCut | None = None) -> bool:
        """Demote (or, on the last tier, evict) until `need_bytes` are free in `tier` (usable by
        blocks of `block_bytes` when given). True on success. `cold_only`: only the blocks below
        the tier's `cold_threshold` percentile when it starts; the cut is taken once, not again
        over what is left after each round (that would call the coldest of the rest cold, round
        after round, and the threshold would only set how many batches the same demotion takes).
        Victims go past a tier below that has no room it can make (`_free_some`). `cold`: that cut,
        taken already (a rebalance in pieces takes it once, when the tier's drain begins; `cut`: the
        same kept in score order, drainorder.py).
        `until_backoff`: stop when a tier below begins to back off after failed writes (a drain,
        which no request asked for: the next rounds would drop what would have gone down there)."""
        if cold_only and cold is None:
            cold = self._cold_mask(tier, self.policy.scores_all(self.table, self.table.clock()))
        pick = dict(cold=cold, protect=protect, below_priority=below_priority, idle_only=idle_only, cut=cut,
                    block_bytes=block_bytes)
        backoffs = self.stats.write_backoffs
        for _ in range(self.MAX_ROUNDS):
            short = need_bytes - self._free_or_leaving(tier, block_bytes)
            if short <= 0:
                return True
            if not self._free_some(tier, short, pick) or (until_backoff and self.stats.write_backoffs > backoffs):
                break
        return self._free_or_leaving(tier, block_bytes) >= need_bytes

    def _free_some(self, tier: Tier, short: int, pick: dict) -> bool:
        lower = self.lower(tier)
        protect = pick["protect"]
        victims = self.select(tier, short, evict=lower is None, **pick)
        if not len(victims):
            if self._into_room_only:
                return False  # (a drain into the room below drops nothing)
            # Nothing movable down, so nothing that may be dropped here either: dropping needs what
            # moving down does and more (nobody holding it, no cached child in any tier), and
            # select's fallback, the lowest leaves, finds none when moving down found none. (A
            # selection to drop here was made anyway, and came back empty in the whole test suite:
            # a pass over the table for nothing, a gather over a drain's cut.) While a tier below
            # backs off, blocks here go with their descendants there (backoff.py).
            return self._drop_while_backing_off(tier, short, pick)
        if lower is None:
            return self._evict(victims)
        backoffs, set_aside = self.stats.write_backoffs, self.mover.quarantine.slots
        moved, progress = self._demote(victims, tier, lower, protect)
        target = lower
        while not (moved or progress) and self.lower(target) is not None:
            # `target` has no room it can make: every block in it is pinned or held there by a
            # descendant in a faster tier (a chain extended in HBM under a parent just demoted
            # leaves DRAM runs each followed by HBM blocks; none of those runs may go down first).
            # Dropping the victims would lose them while a slower tier has room: blocks go past it.
            # Prefix order holds: they are chosen as if the passed tiers were this one (no victim
            # has a cached child there, so none lands below its child), and go only where they
            # would have gone (`hold_refused`: the policy admits them there, and reading them back
            # from there beats a recompute; the others stay).
            passed, target = target, self.lower(target)
            passing = self.select(tier, short, evict=False, through=passed, **pick)
            if len(passing):
                moved, progress = self._demote(passing, tier, target, protect, hold_refused=True)
                self.stats.past_full += moved
        if moved or self.stats.write_backoffs > backoffs or self.mover.quarantine.slots > set_aside:
            return True  # (a tier below failed its writes just now, or set bad slots aside: the next round plans again)
        if progress:
            # Refused blocks were dropped (`_admitted`), and the others could not go down: the next
            # round plans again over what is short now, and passes those past a full tier. Dropping
            # them here, as if no tier below had room, lost blocks the policy admitted below while
            # a slower tier had room (Belady with DRAM and NVMe: a block used again was dropped
            # beside one never used again, and the "optimum" found less than LRU).
            return True
        if self._into_room_only:
            return False  # a drain into the room below drops nothing here: what does not fit stays
        # Every tier below is full of blocks that cannot move: drop what may be dropped here. The
        # victims were chosen to go down, so they may have a cached child below, which bars dropping
        # them; then the lowest blocks that may be dropped go instead (before, every round chose the
        # same undroppable victims, and a read of one block was refused while idle chains with no
        # child anywhere waited in the tier: a review).
        droppable = victims[self.table.evictable(victims)]
        if not len(droppable):
            droppable = self.select(tier, short, evict=True, **pick)
        if self._evict(droppable):
            return True
        # ... and while a storage tier below backs off, drop what may be dropped here (backoff.py).
        return self._drop_while_backing_off(tier, short, pick)

    def room_batch(self, tier: Tier, need: int, slot: int, share: bool = False) -> int:
        """The room to make in `tier` for `need` bytes of blocks in slots of `slot` bytes: where its
        blocks go down (not dropped), a whole swap batch at once, up to the tier's low watermark
        (`share`: and no more than ROOM_BATCH_SHARE of the tier, where that is ROOM_BATCH_MIN blocks).
        Block by block, a stream of small allocations, reservations or promotions into a full tier
        paid a selection pass over the whole table each (reserve 32 blocks 6.4 ms at a million
        blocks against allocate's 0.4, a scale review), and a swap batch (a copy launch) each. On
        the last tier, making room drops blocks: never more than asked."""
        if self.lower(tier) is None:
            return need
        alloc = self.table.allocators[tier]
        most = int((1.0 - self.watermarks[tier].low) * alloc.capacity_bytes)
        if share:
            most = min(most, alloc.capacity_bytes // ROOM_BATCH_SHARE)
            if most < ROOM_BATCH_MIN * slot:
                return need  # (a small tier: ROOM_BATCH_SHARE)
        return max(need, min(self.mover.swap_batch_size * slot, most))

    def _make_room_for_rows(self, tier: Tier, rows: np.ndarray, protect: np.ndarray, **pick) -> None:
        """Room in `tier` for these rows' blocks, size by size: free slots of one size do not hold
        blocks of another, so bytes alone can be free yet unusable. Largest blocks first, each size
        asking for its own slots (a size of several-page slabs, which needs runs, the larger sizes'
        bytes too), then the pages the sizes need together (`SlotAllocator.pages_needed`: by slots plus
        the larger sizes' bytes for every size, which a larger block's whole pages are not, a read of a
        96 KiB and a 40 KiB block that fitted three free pages demoted an idle block, a review).
        `pick`: which blocks may go (make_room's idle_only, below_priority); idle blocks go a swap
        batch at a time (`room_batch`), a lower-priority request's only as many as needed."""
        block = self.table.block_bytes(rows)
        slot = self._slot_bytes(tier, rows)
        alloc, larger = self.table.allocators[tier], 0
        for size in sorted(set(block.tolist()), reverse=True):
            own = int(slot[block == size].sum())
            # A size whose slabs span several pages needs runs, which the pages below do not count:
            # it asks for the larger sizes' bytes too (by its own slots alone, a read of a 96 KiB and a
            # 40 KiB block found five scattered free pages enough, and was refused every retry: a review).
            need = own + (larger if alloc.slab_shape_of(size)[0] > 1 else 0)
            larger += own
            ask = need
            if pick.get("idle_only") and self._free_or_leaving(tier, size) < need:  # (room there: none made)
                ask = self.room_batch(tier, need, int(slot[block == size].max()), share=True)
            self.make_room(tier, ask, protect=protect, block_bytes=size, **pick)
        sizes = np.unique(slot)
        if len(sizes) > 1:
            # ... and the pages the sizes need together: each size's room counted the same free page,
            # and a read of a 40 KiB and an 8 KiB block beside one free page made no room, then failed
            # every retry (a review). Pages as slots of a page each (`room_for`).
            pages = alloc.pages_needed({int(s): int(np.count_nonzero(slot == s)) for s in sizes})
            if pages:
                self.make_room(tier, pages * alloc.page_bytes, protect=protect, block_bytes=alloc.page_bytes, **pick)
