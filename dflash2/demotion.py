"""Demotion mechanism: blocks leaving a tier go down to the next (those it admits) or are dropped.

A mixin of `Placement` (placement.py), which chooses the victims; this module moves them: asks the
policy and the read cost whether the tier below takes each (`_admitted`), makes room there, starts
the batch move and ends it (`_move_down`), drops what may be dropped (`_droppable`, `_evict`) and the
blocks whose reads failed (`_drop_lost`). Invariant: a parent never lands below its child (victims
come leaves first, and a refused child held in place keeps its ancestors with it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash2.counts import unique
from dflash2.errors import CopiesRunning
from dflash2.table import BlockState
from dflash2.tiers import Tier


class Demotion:
    def _demote(self, victims: np.ndarray, tier: Tier, lower: Tier, protect,
                hold_refused: bool = False) -> tuple[int, bool]:
        """Move the victims down to `lower` (those it admits: `_admitted`). Returns how many moved
        (in a drain piece between requests, how many are on their way: `_move_down`), and whether
        any were dropped instead (refused)."""
        victims, progress, overruled = self._admitted(victims, lower, self.table.clock(), hold_refused)
        if not len(victims):
            return 0, progress
        if len(overruled):  # (refused, held, going all the same: counted once their copies end, below)
            self.policy.going(self.table, overruled)
        ran = []

        def landed(moved: np.ndarray) -> None:
            ran.append(True)
            self.stats.demoted += int(moved.sum())
            if moved.any():
                self.policy.on_insert(self.table, victims[moved], self.table.clock())
            if len(overruled):  # (gone all the same: counted so once gone, not at each try; else refused)
                went = np.isin(overruled, victims[moved])
                self.policy.overruled(self.table, overruled[went])
                self.policy.stayed(self.table, overruled[~went])
        try:
            return int(self._move_down(victims, lower, protect, landed).sum()), progress
        except CopiesRunning:
            raise  # (parked: `landed` runs when the copies end, or the call runs again and decides again)
        except BaseException:
            if len(overruled) and not ran:  # (they stay where they were: refused, as before)
                self.policy.stayed(self.table, overruled)
            raise

    def _admitted(self, victims: np.ndarray, lower: Tier, now: float,
                  hold_refused: bool = False) -> tuple[np.ndarray, bool, np.ndarray]:
        """The victims that go down to `lower` (in their order: leaves first), whether any were dropped
        instead (refused: the policy does not admit them there, or their read back from there would cost
        more than a recompute, `read_cost`), and those going the policy refused. A refused block nobody
        holds is dropped; a held one goes down anyway, or with `hold_refused` stays where it is (and so do
        its ancestors among the victims: a parent never lands below its child). A refused parent goes
        with its children when they are all refused and droppable too (one call)."""
        admitted = self.policy.admit(self.table, victims, lower, now)
        by_policy = ~admitted
        too_slow = np.zeros(len(victims), dtype=bool)
        if self.read_cost is not None:
            too_slow = ~self.read_cost.keeps(self.table.layouts, self.table.cols.layout[victims], lower)
            admitted &= ~too_slow
        refused = victims[~admitted]
        if not len(refused):
            return victims, False, refused
        progress = False
        drop = self._droppable(refused)
        if len(drop):
            slow = int(np.isin(drop, victims[too_slow]).sum())
            self.stats.not_kept += slow
            self.stats.not_admitted += len(drop) - slow
            progress = self._evict(drop)
        kept = refused[~np.isin(refused, drop)]
        if not hold_refused:
            return victims[admitted | np.isin(victims, kept)], progress, kept[np.isin(kept, victims[by_policy])]
        going = victims[admitted]
        if len(kept):
            going = self._without_ancestors_of(going, kept)
        return going, progress, refused[:0]

    def _without_ancestors_of(self, rows: np.ndarray, staying: np.ndarray) -> np.ndarray:
        """`rows` (leaves first) less the ancestors of `staying` among them."""
        c = self.table.cols
        index = {int(v): i for i, v in enumerate(rows.tolist())}
        out = np.ones(len(rows), dtype=bool)
        frontier = [int(c.parent[r]) for r in staying.tolist()]
        while frontier:
            p = frontier.pop()
            i = index.get(p)
            if i is not None and out[i]:
                out[i] = False
                frontier.append(int(c.parent[p]))
        return rows[out]

    def _move_down(self, victims: np.ndarray, lower: Tier, protect,
                   landed: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Move the victims (leaves first) down to `lower`, room made there first; the moved mask,
        once `landed(moved)` ran. In a drain piece between requests (`_deferring`, rebalance.py) the
        copies are left in flight: the mask is of the victims on their way, and what follows their
        end (`landed` too) runs when they are settled."""
        deferring, self._deferring = self._deferring, False  # the room below is made now, its copies ended
        try:
            if not self._into_room_only:  # (a drain into the room below as it is: rebalance.py)
                self._make_room_for_rows(lower, victims, protect)
        finally:
            self._deferring = deferring
        try:
            flight = self.mover.start(victims, lower)
            if not flight.prepared:
                # A batch moves whole or not at all, but the tier below may hold some of the
                # victims (the rest of it held): a block is dropped only when the tier below has
                # no room for it. Leaves come first, so the leading ones leave no parent below its child.
                flight = self.mover.start_leading(victims, lower)
        except BaseException:
            self._drop_lost()  # a block whose read failed is never found again
            raise

        def end() -> np.ndarray:
            disk_failed = self.mover.disk_failed_into(lower)  # (a slot set aside is no failure of the disk)
            try:
                arrived = self.mover.finish(flight)
            finally:
                self._drop_lost()  # also when a batch raised
            moved = np.zeros(len(victims), dtype=bool)
            moved[:len(arrived)] = arrived
            self._note_writes(lower, self.mover.disk_failed_into(lower) - disk_failed, int(arrived.sum()))
            if landed is not None:
                landed(moved)
            return moved
        if deferring and flight.prepared:
            return self._leave_in_flight(flight, end, len(victims))
        if (self._room_parks and lower == Tier.NVME and flight.prepared and self.parks_own()
                and not self.end_soon([flight])):
            # The writes to NVMe of a call's own room, still running PARK_AFTER_S after they began:
            # they go on while the loop answers other calls, and the call is parked on them
            # (rebalance.py `own_writes`). Before, the loop waited: 5-16 s an allocation when
            # writes met a slow region of the disk (soak13).
            self._leave_in_flight(flight, end, len(victims))
            raise CopiesRunning(own=True)
        return end()

    def _drop_lost(self, lost: np.ndarray | None = None, lost_too: np.ndarray | None = None) -> None:
        lost = self.mover.take_lost() if lost is None else lost  # (rows given: BlockManager._drop_forgotten)
        self.stats.lost += len(lost)

        def leaving(rows: np.ndarray, orphans: bool) -> None:
            # The policy lets them go as it does evicted blocks (its lists counted them on, and
            # their keys left no ghost); the children dropped with them are counted too.
            self.policy.on_remove(self.table, rows)
            if orphans:
                self.stats.orphaned += len(rows)
        # (a read's loss: with the others lost with the storage tier's file, if any, Mover.with_lost_file)
        with self.mover.quarantine.gathered():  # (their slots set aside, and said, together)
            self.table.drop_lost(lost, leaving, self.mover.with_lost_file(lost) if lost_too is None else lost_too)
        self._note_reads()  # (backoff.py: a failing disk's reads that failed)

    def _droppable(self, rows: np.ndarray) -> np.ndarray:
        """The rows that can be dropped now together: cached, nobody holds them, and each of their
        cached children among them and droppable too (leaves first)."""
        c = self.table.cols
        rows = np.asarray(rows, dtype=np.int64)
        free = ((c.state[rows] == int(BlockState.RESIDENT)) & (c.refs[rows] == 0) & (c.pins[rows] == 0)
                & (c.key[rows] != 0))
        # (ascending, each once, as `_leaving` takes them; evicting: every tier's children hold)
        return self._leaving(Tier.HBM, unique(rows[free]), True, None)

    def _evict(self, rows: np.ndarray) -> bool:
        """Drop these cached blocks, in one table call: a parent among them goes with its children
        among them (the table refuses a block with a cached child left behind)."""
        if not len(rows):
            return False
        self.policy.on_remove(self.table, rows)
        nbytes = int(self.table.block_bytes(rows).sum())
        self.table.evict(rows)
        self.stats.evicted += len(rows)
        self.stats.evicted_bytes += nbytes
        return True
