"""Promotion: bring blocks (their cached prefix first) up to the tier a reader reads them from. A
part of Placement (a mixin over its table, mover, room-making and flights in flight), apart because
how a promotion moves (whole, in pieces, or with its reads left in flight) is a job of its own.

While the daemon serves (`read_later`, rebalance.py), a promotion that reads blocks from NVMe leaves
its copies in flight (`promote_later`), as a drain piece does: the disk reads while the loop answers
other calls, and the call that needs the blocks waits for them alone (the server parks it). Before,
the loop waited for the reads: with 1.6% of an NVMe file answering each I/O in 1 s, every client's
calls, pings included, waited 1-3 s (soak11).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from dflash2.ancestry import Ancestry
from dflash2.counts import unique
from dflash2.forest import local_parents, marked_or_above
from dflash2.table import BlockState
from dflash2.tiers import Tier


class Promotion:
    """Placement's promotion (the attributes it uses are Placement's)."""

    # A promotion into a full tier moves in pieces of at most this many bytes, making room for each
    # while the previous one comes up: only the first piece's demotions run alone. 256 MiB is ~5 ms
    # of PCIe Gen5 one way, longer than a selection pass over a million blocks (~2 ms), which runs
    # while the previous piece moves.
    PROMOTE_PIECE_BYTES = 256 << 20
    # ... but only when its blocks are at least this large. Smaller blocks are bound by the CPU
    # (~3 us of bookkeeping a block each way against 1.3 us of link time at 64 KiB): `dflash2 bench
    # swap` on an H200, 1 GiB each way, room first vs in pieces: 64 KiB blocks 48-63 vs 63-109 ms
    # (more selection passes and engine submissions), 128 KiB 45 vs 46, 256 KiB 46 vs 45, 2 MiB
    # 42 vs 30-31.
    PROMOTE_PIECES_MIN_BLOCK = 256 << 10

    def promote(self, rows: np.ndarray, dst: Tier = Tier.HBM, protect: np.ndarray | None = None, *,
                below_priority: int | None = None, idle_only: bool = False,
                chain: np.ndarray | None = None) -> np.ndarray:
        """Bring rows (and their cached ancestors, first) up to `dst`. Returns the mask of `rows`
        that are in dst afterwards; the rest could not be given room. The room is never made by
        moving out the rows' own prefix (ancestors already in dst): that would leave the promoted
        blocks above their prefix, and their reader waiting for the prefix to come back up; nor
        from `protect` (a prefetch's reader: the rest of the chain it is about to read). It is made
        from idle blocks first, not from the blocks brought up for a read that has not come yet
        (`awaiting_read`: another reader's window, whose score is old and would make it the first to
        go); then, unless `idle_only` (a prefetch, a guess itself), from those too, and last from
        running requests' blocks, only those under `below_priority` when given. `chain`:
        `with_ancestors(rows, dst)` when the caller has it already (an acquire's check took it: the walk up a chain of 32,768 blocks,
        twice an acquire, was most of its cost, a review)."""
        rows = np.asarray(rows, dtype=np.int64)
        c = self.table.cols
        away, room_for, beyond = self._promotion(rows, dst, protect, below_priority, idle_only, chain)
        if len(away):
            try:
                moved = self._promote_away(away, dst, room_for)
            finally:
                # Also when a batch (or the room made for it) raised: a block whose read failed
                # is unpublished now, never found again (a miss, never wrong data).
                self._drop_lost()
            self._promoted(away, moved)
        if len(beyond) and (c.tier[away] <= int(dst)).all():
            # The prefix only above rows already in dst: where room is left, no room made for it. In the
            # read's batch, a 40 KiB ancestor that did not fit beside it failed the whole batch, every
            # retry alike (a review).
            try:
                lead = self.mover.leading_that_fit(beyond, dst)
                if lead:
                    self._promoted(beyond[:lead], self.mover.move(beyond[:lead], dst))
            finally:
                self._drop_lost()
        # A row freed on the way (its NVMe copy failed its checksum) has tier -1: not in dst.
        return (c.tier[rows] >= 0) & (c.tier[rows] <= int(dst))

    def promote_later(self, rows: np.ndarray, dst: Tier, landed: Callable[[np.ndarray], object] | None = None,
                      protect: np.ndarray | None = None, *, below_priority: int | None = None,
                      idle_only: bool = False) -> bool:
        """`promote`, its copies left in flight, where it reads from NVMe and the daemon serves
        (`read_later`): the room is made now, the blocks come up while the loop answers other calls,
        and `settle` ends the copies (then `landed(mask of rows now in dst)` runs). False when nothing
        to move lies on a storage tier (memory copies take no disk's time: the caller promotes at
        once; within `own_writes`, the room is made first, which the call may be parked on), with
        nothing done when copies are in flight already (the room made here must not meet theirs: no
        placement work runs while copies are in flight, rebalance.py). False too when not even the
        first batch found room (the caller's own promotion says so)."""
        if not self.read_later or self._in_flight:
            return False
        rows = np.asarray(rows, dtype=np.int64)
        c = self.table.cols
        away, room_for, _ = self._promotion(rows, dst, protect, below_priority, idle_only)  # (the read's part)
        if not len(away):
            return False
        if not (c.tier[away] == int(Tier.NVME)).any():
            if self._room_parks:
                room_for(away)  # (the call's own room, which it may be parked on: `own_writes`)
            return False
        try:
            if int(self._slot_bytes(dst, away).min()) >= self.PROMOTE_PIECES_MIN_BLOCK:
                # Room made piece by piece while earlier pieces are on their way: its writes are not
                # a call's to be parked on (the pieces started would be waited for, uncounted).
                with self.own_writes(parks=False):
                    flight = self.mover.start(away, dst, before_batch=room_for,
                                              max_batch_bytes=self.PROMOTE_PIECE_BYTES)
            else:
                room_for(away)
                flight = self.mover.start(away, dst)
        except BaseException:
            self._drop_lost()
            raise
        if not flight.prepared:
            return False

        def end() -> None:
            try:
                moved = self.mover.finish(flight)
            finally:
                self._drop_lost()  # a block whose read failed is never found again (a miss)
            self._promoted(away, moved)
            if landed is not None:
                landed((c.tier[rows] >= 0) & (c.tier[rows] <= int(dst)))
        self._leave_in_flight(flight, end, len(away))
        return True

    def _promotion(self, rows: np.ndarray, dst: Tier, protect: np.ndarray | None, below_priority: int | None,
                   idle_only: bool, chain: np.ndarray | None = None) -> tuple[np.ndarray, Callable, np.ndarray]:
        """What a promotion of `rows` to `dst` moves (the chain's blocks below dst that may move,
        ancestors first), how it makes room for a part of them (`promote`), and the movable blocks of
        the prefix the read does not need there (`beyond_read`), brought up after it where room is left."""
        chain = self.with_ancestors(rows, dst) if chain is None else chain
        away, keep, beyond = self._away_and_kept(rows, dst, protect, chain)
        demand = keep if idle_only else self._kept(chain, protect, awaiting=False)

        def room_for(part: np.ndarray) -> None:
            self._make_room_for_rows(dst, part, keep, idle_only=True)
            if not idle_only:
                if len(demand) < len(keep):
                    # A read asked for beats a guess: where idle blocks alone leave no room, an unread
                    # prefetch's blocks go next, before running requests' (kept from the room, they
                    # refused the read "full of blocks being written or pinned" until the next step
                    # sent them down unread, a review).
                    self._make_room_for_rows(dst, part, demand, idle_only=True)
                self._make_room_for_rows(dst, part, demand, below_priority=below_priority)
        return away, room_for, beyond

    def _away_and_kept(self, rows: np.ndarray, dst: Tier, protect: np.ndarray | None,
                       chain: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a promotion of `rows` moves up to `dst` for the read, the rows its room is never made
        from, and the movable blocks of the prefix the read does not need there (`beyond_read`)."""
        chain = self.with_ancestors(rows, dst) if chain is None else chain
        away, beyond = self._read_away(chain, rows, dst)
        return away, self._kept(chain, protect), beyond

    def _kept(self, chain: np.ndarray, protect: np.ndarray | None, awaiting: bool = True) -> np.ndarray:
        """The rows a promotion's room is never made from: the chain, `protect`, and (`awaiting`) the
        blocks awaiting their read. Only what adds rows is merged (a sort of the chain): with no read
        awaiting, the chain itself (distinct: `with_ancestors`), whose two sorts were 1.4 ms of an
        acquire of 64 blocks under a prefix 32,768 deep (in process, the 2-core VM)."""
        extra = [np.asarray(source(), dtype=np.int64) for source in self.awaiting_read] if awaiting else []
        if protect is not None:
            extra.append(np.asarray(protect, dtype=np.int64))
        extra = [k for k in extra if len(k)]
        return unique(np.concatenate([chain, *extra])) if extra else chain

    def _read_away(self, chain: np.ndarray, rows: np.ndarray, dst: Tier) -> tuple[np.ndarray, np.ndarray]:
        """The chain's blocks a promotion moves up for the read of `rows`, and those it may move after
        them (the movable part of `beyond_read`)."""
        away = self._away(chain, dst)
        beyond = self.beyond_read(chain, rows, dst)
        if not len(beyond):
            return away, beyond
        last = np.isin(away, beyond)
        return away[~last], away[last]

    def beyond_read(self, chain: np.ndarray, rows: np.ndarray, dst: Tier) -> np.ndarray:
        """The blocks of `chain` below `dst` that the read of `rows` does not need there: ancestors only
        of rows already in dst (a chain extended in HBM under a parent demoted). Counted with the
        read, a read of blocks that fit was refused "nothing was moved", or NeverFits, and listed
        first (the chain is ancestors first), they took the room the read's own blocks needed (a
        review's model-based test). Empty where every row lies below dst, or the chain is the rows."""
        c = self.table.cols
        if chain is rows or (c.tier[rows] > int(dst)).all():
            # (the rows are the chain, or each block of the chain is a row below dst or an ancestor of
            # one: every block below dst is one the read needs; no sort of the chain on an acquire's path)
            return chain[:0]
        below = c.tier[chain] > int(dst)
        if not below.any():
            return chain[:0]
        needed = marked_or_above(local_parents(chain, c.parent[chain]), np.isin(chain, rows) & below)
        return chain[below & ~needed]

    def _away(self, chain: np.ndarray, dst: Tier) -> np.ndarray:
        # A pinned block stays put (it is in use where it is); everything else of the chain comes up.
        c = self.table.cols
        return chain[(c.tier[chain] > int(dst)) & (c.pins[chain] == 0) & (c.state[chain] == int(BlockState.RESIDENT))]

    def could_promote(self, rows: np.ndarray, dst: Tier, *, below_priority: int | None = None,
                      chain: np.ndarray | None = None) -> bool:
        """Whether `dst` could hold all that `promote` (not idle_only) would bring up were every block
        its room may be made from gone (`could_hold`). False: the room made would move (on the last
        tier, drop) other blocks for a read that fails anyway (an acquire beside blocks being
        written demoted another reader's idle block, then answered "no room now": a review)."""
        rows = np.asarray(rows, dtype=np.int64)
        chain = self.with_ancestors(rows, dst) if chain is None else chain
        away = self._read_away(chain, rows, dst)[0]  # (the read's part: `promote` moves the rest after it)
        if not len(away):
            return True
        sizes = self._slot_bytes(dst, away)
        need, one, alloc = int(sizes.sum()), one_size(sizes), self.table.allocators[dst]
        if one is not None and alloc.can_fit(one, len(away)):
            return True  # (the usual read: no walk of what its room is kept from; by its slots)
        keep = self._kept(chain, None, awaiting=False)  # (a read's room may take an unread prefetch's: `_promotion`)
        if one is None:
            # Several slot sizes: each size's blocks need slots of their own, which free bytes (free
            # slots of another size among them) and the bound's bytes do not say. Counted in bytes
            # alone, a read whose large block could never come up demoted idle blocks, brought the
            # small ones up, then was refused "the room made fell short; retry later" (a review).
            counts = dict(zip(*(x.tolist() for x in np.unique(sizes, return_counts=True))))
            for size, count in counts.items():
                if not alloc.can_fit(size, count) and not self.could_hold(
                        dst, size * count, idle_only=False, protect=keep, below_priority=below_priority, slot=size):
                    return False
            if not self.sizes_could_fit(dst, counts, idle_only=False, protect=keep, below_priority=below_priority):
                return False  # (each size fits alone, not all together)
        return self.could_hold(dst, need, idle_only=False, protect=keep, below_priority=below_priority, slot=one)

    def fitting_prefix(self, rows: np.ndarray, dst: Tier, protect: np.ndarray | None = None) -> int:
        """How many of `rows` (blocks below `dst`, in read order), from the first, an idle-only
        promotion (a prefetch) could bring up to `dst`, with the ancestors that come up before them
        (`room_most`): 0 when not even the first could. A window that could not fit dropped idle
        blocks of a full last tier for its room, then brought up nothing (a review)."""
        rows = np.asarray(rows, dtype=np.int64)
        chain = self.with_ancestors(rows, dst)
        away, keep, _ = self._away_and_kept(rows, dst, protect, chain)
        sizes = self._slot_bytes(dst, away)
        total = int(sizes.sum())
        room = self.room_most(dst, total, idle_only=True, protect=keep, slot=one_size(sizes))
        if room >= total:
            return len(rows)
        first = int(sizes[~np.isin(away, rows)].sum())  # (ancestors come up first: all counted)
        return int(np.searchsorted(first + np.cumsum(self._slot_bytes(dst, rows)), room, side="right"))

    def _promoted(self, away: np.ndarray, moved: np.ndarray) -> None:
        self.stats.promoted += int(moved.sum())
        if moved.any():
            self.policy.on_insert(self.table, away[moved], self.table.clock())

    def _promote_away(self, away: np.ndarray, dst: Tier, room_for) -> np.ndarray:
        """Move `away` (ancestors first) up to dst, making room with `room_for`; the moved mask."""
        c = self.table.cols
        if int(self._slot_bytes(dst, away).min()) >= self.PROMOTE_PIECES_MIN_BLOCK:
            # Room is made piece by piece while the earlier pieces come up, so the demotions
            # (device to host) overlap the promotions (host to device): both ways of the link.
            # Ancestors come first in `chain`, so a partial promotion never strands a child above its parent.
            return self.mover.move(away, dst, before_batch=room_for, max_batch_bytes=self.PROMOTE_PIECE_BYTES)
        room_for(away)
        # Only the leading part the room made holds is moved: a batch moves whole or not at all, and
        # the room may fall short of the bound it was asked for (`room_most` counts a parent held in
        # place by a child that stays; a prefetch cut to that bound then moved nothing, a review).
        moved = np.zeros(len(away), dtype=bool)
        lead = self.mover.leading_that_fit(away, dst)
        if lead:
            moved[:lead] = self.mover.move(away[:lead], dst)
        if not moved.all():
            # Blocks of several sizes: the room made for the whole may not have been
            # usable by every size once the first batches took their slots. Once more for
            # the rest, against the tier as it is now (not for blocks whose read failed:
            # they are dropped first).
            self._drop_lost()
            rest = np.flatnonzero(~moved)
            still = rest[(c.tier[away[rest]] > int(dst)) & (c.state[away[rest]] == int(BlockState.RESIDENT))]
            # (One kept for its holders after its read failed is not read again; nor one whose copy
            # failed after its read, the disk read and the copy run again for nothing, a review.)
            still = still[~self.table.is_lost(away[still]) & ~self.mover.copy_failed_among(away[still])]
            if len(still):
                room_for(away[still])
                moved[still] = self.mover.move(away[still], dst)
        return moved

    @functools.cached_property
    def _ancestry(self) -> Ancestry:
        return Ancestry(self.table)

    def with_ancestors(self, rows: np.ndarray, dst: Tier) -> np.ndarray:
        """The rows and all their cached ancestors, ancestors first. Those already in `dst` are
        kept in the list too: it is what the room made for the others protects, and an ancestor
        demoted to make that room would leave its promoted descendants above their prefix. Walked to
        the root: a walk cut where it met `dst` left unprotected, and unpromoted, the prefix above a
        block that stays below its child (pinned there by a host reader), and counted the prefix of
        another layout short for NeverFits (a review). An acquire walks once (`promote`'s `chain`);
        a chain read in pieces is walked once for all of them (ancestry.py)."""
        return self._ancestry.with_ancestors(rows)


def one_size(sizes: np.ndarray) -> int | None:
    """The slot size all of `sizes` share, None where they differ (or there are none)."""
    return int(sizes[0]) if len(sizes) and (sizes == sizes[0]).all() else None
