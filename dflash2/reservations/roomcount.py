"""What making room in HBM could free for a deferred reservation (`RoomCount`): the admission queue's
count behind its reasons and its grants.

A deferred reservation is told what it waits for (waits.py) from HBM's free room and the bytes that
making room for it could free: idle blocks, and with preemption and a tier below HBM the blocks of
running requests of lower priority, as far as the tiers below can take them. Where even every such
block gone would leave it short, no room is made for it (`could_make_room`), as for `allocate`.
Counted once a background step per slot size (`clear`): a scan of the table, tens of ms at a million
blocks, that polls would otherwise pay each.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dflash2.placement import Placement
from dflash2.reservations.records import PRIORITY_MAX, PRIORITY_MIN, AdmissionSettings, Reservation
from dflash2.table import BlockTable
from dflash2.tiers import Tier


class RoomCount:
    def __init__(self, table: BlockTable, placement: Placement, settings: AdmissionSettings):
        self.table = table
        self.placement = placement
        self.settings = settings
        # Movable HBM bytes per slot size: (idle, running by priority, room below for running ones).
        self._memo: dict[int, tuple[int, np.ndarray, int]] = {}

    def clear(self) -> None:
        """Blocks moved, or a background step began: which blocks could move is counted anew."""
        self._memo.clear()

    def preempts_below(self, res: Reservation) -> int | None:
        """`res`'s priority where making room for it may demote running requests' blocks of lower
        priority (`admission.preemption` on and a tier below HBM), else None."""
        preempts = self.settings.preemption and self.placement.lower(Tier.HBM) is not None
        return res.priority if preempts else None

    def could_make_room(self, res: Reservation, need: int) -> bool:
        """Whether HBM could hold `need` bytes of `res`'s slots were every block that making room for it
        may move gone (idle ones, and with preemption and a tier below HBM running ones of lower
        priority: `Admission._make_room`'s picks). Where it could not, nothing is moved, as for
        `allocate`: a reservation that blocks being written held back demoted every idle block, and
        preempted every running one of lower priority, and was still deferred (on a node whose HBM is
        its last tier the idle ones were dropped from the cache for nothing; a review's script)."""
        below = self.preempts_below(res)
        return self.placement.room_most(Tier.HBM, need, idle_only=below is None, slot=res.slot,
                                        below_priority=below) >= need

    def untaken_here(self, res: Reservation, movable: int, granted: Iterable[Reservation]) -> int | None:
        """The room for `res`'s slots that granted reservations' untaken blocks keep beyond `movable`
        (HBM's free and movable room for it), where one of them is of another slot size: their bytes
        are no measure of it (an 8 KiB reserved slot in the last page kept a 16 KiB block out, and the
        reservation was told it waited on blocks being written or pinned, a review). None where all
        are of its size: their bytes are. A pass over the table, asked only for a reservation that
        demoting cannot serve. The blocks that may leave are those `movable` counted (`movable_bytes`:
        with preemption, running ones of lower priority too; counted idle only, the room they free
        was taken off twice, and it was told it waited on blocks that cannot move, a review)."""
        held = [r for r in granted if r.remaining]
        if all(r.slot == res.slot for r in held):
            return None
        rows = self.table.rows([v for r in held for v in r.vids])
        below = self.preempts_below(res)
        gone = self.placement.room_most_without(Tier.HBM, rows, idle_only=below is None, slot=res.slot,
                                                below_priority=below)
        return max(0, gone - movable)

    def movable_bytes(self, res: Reservation) -> int:
        """HBM bytes that making room for this reservation could free for its blocks: idle blocks,
        and with preemption running requests' blocks of lower priority (as `Admission._make_room` picks them),
        by their slots: of its own slot size each block, of another size only the blocks of slabs
        whose every slot holds one (room is made by emptying whole slabs: slabroom.py), idle ones
        by their whole slab, free slots included (`room_freed_bytes`).
        Counted of its own size only, a reservation into an HBM of idle blocks of another size was
        told it waited on blocks that cannot move, with no estimate, and was granted at the next
        step; counted of every size whatever their slab, one whose every slab held a block being
        written was told to wait 0 s (two reviews). With no tier below HBM, making room drops
        blocks, and only idle published ones may be dropped: a running request's are not movable
        there, whatever their priority, and above a lower tier only as many as the tiers below can take
        (`Placement.room_below`). As of the last background step (`clear`)."""
        hbm = self.placement
        last = hbm.lower(Tier.HBM) is None
        preempts = self.preempts_below(res) is not None
        slot = self.table.slot_bytes(res.layout_id, Tier.HBM)
        if slot not in self._memo:
            # One pass per slot size and step, whatever the priorities waiting: keyed by priority,
            # each priority polled paid its own pass every step (64 clients waiting at as many
            # priorities: 277 ms of the loop per 100 ms step at a million blocks, a review's script).
            c = self.table.cols
            slots = self.table.slot_sizes(Tier.HBM)
            # Blocks that can leave with their descendants only (a block leaves HBM after its children
            # there): the inner blocks of chains whose leaves are pinned were counted, and a
            # reservation behind them was told "not enough HBM free yet", 0 s, at every poll (a
            # review). (One pass for every priority: a running child of the reservation's priority
            # or above, which its room may not demote, still lets its running parent count.)
            idle = hbm.leave_whole(Tier.HBM, hbm.movable(Tier.HBM, evict=last, idle_only=True), last)
            either = hbm.leave_whole(Tier.HBM, hbm.movable(Tier.HBM, evict=False), False) | idle
            idle &= self.table.frees_room_for(idle, Tier.HBM, slot)
            running = np.flatnonzero(either & ~idle & self.table.frees_room_for(either, Tier.HBM, slot))
            by_priority = np.bincount(c.priority[running].astype(np.int64) - PRIORITY_MIN,
                                      weights=slots[c.layout[running]].astype(np.float64),
                                      minlength=PRIORITY_MAX - PRIORITY_MIN + 1)
            idle_bytes = self.table.room_freed_bytes(np.flatnonzero(idle), Tier.HBM, slot)
            self._memo[slot] = (idle_bytes, np.concatenate(([0.0], np.cumsum(by_priority))),
                                hbm.room_below(Tier.HBM) if preempts and len(running) else 0)
        idle_bytes, below, room_below = self._memo[slot]  # below[p - PRIORITY_MIN]: running bytes of priority < p
        running = int(below[min(max(res.priority - PRIORITY_MIN, 0), len(below) - 1)])
        return idle_bytes + (min(running, room_below) if preempts else 0)
