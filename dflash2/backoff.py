"""Storage tiers whose writes fail: the back-off, and making room above them meanwhile. A part of
Placement (a mixin over its tiers, stats and room-making), apart because what a full or failing disk
changes is a job of its own.

A storage tier whose writes failed (a full or failing disk: ENOSPC, EIO) takes no blocks for
WRITE_BACKOFF_S, doubled after each failure that follows the last (up to WRITE_BACKOFF_MAX_S) and
ended by a write that works. Meanwhile the tier above it is the last (`Placement.lower`): what leaves
it is dropped. Before, every room-making retried the writes (a failed batch a few milliseconds), HBM
and DRAM refused every allocation (their demotion victims, parents of blocks below, may not be
dropped), and the log took a traceback a batch.

While it backs off, the background step probes it (`probe_writes`): one block moved down into it,
at most every WRITE_PROBE_EVERY_S. A probe that arrives ends the back-off, so a disk that has room
again takes blocks within about a second, not when a back-off of up to a minute runs out (the
drains above waited all of it). A write that fails because its slot alone is bad (EIO there) starts
no back-off: the slot is set aside (until a re-test finds it sound) and the next batch goes elsewhere (quarantine.py).

Reads that fail on a disk taken to be failing (more than Quarantine.FAILING_FRACTION of the tier set
aside) start the same back-off (`_note_reads`): the tier is neither written nor read meanwhile (a
lookup's prefix ends before its blocks, the engine recomputes them at once instead of waiting for a
read that fails), no write probe ends it (a disk that takes writes and reads nothing would end it
at once), and only a read that works does, once its period has run out and a lookup offers the
tier's blocks again; one that fails then starts the next, twice as long. Reads that fail while
failed writes hold the tier back (a dead disk) keep it from being read too; writes that fail once a
read back-off has run out start a plain write back-off, which the probe ends. Before, such a disk took
every block DRAM sent down and failed each read, a slot at a time, until the whole tier was set aside.

While a tier below backs off, a tier whose room cannot be made by moving blocks down drops what may
be dropped (`_drop_while_backing_off`): its own blocks nobody holds with no cached child, and failing
those, its blocks together with their descendants on the tiers below (dropping a block there needs
no write). Invariant kept: a block never outlives its parent in the cache (prefix order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from dflash2.table import BlockState
from dflash2.tiers import Tier

log = logging.getLogger("dflash2.placement")


class WriteBackoff:
    """Placement's write back-off (the attributes it uses are Placement's)."""

    WRITE_BACKOFF_S = 1.0
    WRITE_BACKOFF_MAX_S = 60.0
    # While a storage tier backs off, a write is tried there at most this often (seconds since the
    # last failed one): `probe_writes`, one block. A disk that has room again (a full disk emptied)
    # then takes blocks within about this long; one still full costs one failed block write this often.
    WRITE_PROBE_EVERY_S = 1.0

    def _init_backoff(self) -> None:
        # Storage tiers whose writes failed: tier -> (monotonic time until which it takes no blocks,
        # the back-off's length). Cleared by a write that works there.
        self.write_backoff: dict[Tier, tuple[float, float]] = {}
        self.monotonic: Callable[[], float] = time.monotonic  # the back-off's clock (tests set it)
        # Per tier in write_backoff: when its writes began to fail (the first failure since the last
        # write that worked), and when a write was last tried there (a failed batch or a probe).
        self._backoff_since: dict[Tier, float] = {}
        self._write_tried: dict[Tier, float] = {}
        # Tiers in write_backoff because their reads failed (`_note_reads`): a write that works does
        # not end it; a read that works does. And the NVMe reads seen so far: (arrived, failed).
        self._read_backoff: set[Tier] = set()
        self._reads_seen = (0, 0)
        # Why a storage tier has no file now ("" while it has one: nvmegone.py), set by the manager:
        # writes refused for want of a file were blamed on "a full or failing disk" (a review).
        self.why_no_file: Callable[[Tier], str] = lambda tier: ""

    def writable(self, tier: Tier) -> bool:
        """Whether blocks may go down into `tier` now (not backing off after failed writes)."""
        off = self.write_backoff.get(tier)
        return off is None or self.monotonic() >= off[0]

    def reads_back_off(self, tier: Tier) -> bool:
        """Whether `tier` is not to be read now: backing off after failed reads (`_note_reads`)."""
        return tier in self._read_backoff and not self.writable(tier)

    def _backing_off_below(self, tier: Tier) -> bool:
        return any(t > tier and not self.writable(t) for t in self.tiers)

    def _note_writes(self, tier: Tier, failed: int, moved: int) -> None:
        """After a move down into `tier`: NVMe writes that all failed start (or lengthen) its
        back-off (`lower`); one that worked ends it."""
        if tier != Tier.NVME:
            return  # memory tiers' copies do not fail for want of room (a lost GPU is fatal: fatal())
        if failed and not moved:
            if not self.writable(tier):
                # Backing off already: these writes began before it did (copies in flight, or a move
                # whose tier below was chosen before a settle in the same call began the back-off).
                # Each lengthened it again: two batches ending together took it from 8 s to 32 s
                # (soak11). The back-off stands as it is; the mover has said the failure.
                return
            # A read back-off that ran out is over as such: this one is the writes' (the probe ends
            # it once they land; reads that fail meanwhile make it the reads' again, `_note_reads`).
            # Kept, it withheld sound NVMe blocks from lookups and skipped the probe (a review).
            self._read_backoff.discard(tier)
            period = self._start_backoff(tier)
            self.stats.write_backoffs += 1
            why = self.why_no_file(tier)
            log.warning("writes to %s failed (%d blocks; the transfer log names the error): %s takes no blocks "
                        "for %g s, and blocks that would go down there are dropped instead, a miss when asked "
                        "for again (%s)", tier.label, failed, tier.label, period,
                        f"the tier has no file: {why}" if why else "a full or failing disk under memory.nvme_path?")
        elif moved and tier in self.write_backoff and tier not in self._read_backoff:
            self._writes_work_again(tier, "")

    def _note_reads(self) -> None:
        """After reads from NVMe (`_drop_lost`): ones that all failed, on a disk taken to be failing,
        start its back-off as failed writes do (or, in one that failed writes began, keep the tier
        from being read too); one that worked ends a back-off that failed reads began, whenever it
        comes (an acquire of blocks looked up before the back-off may read sooner). Reads failing on
        a sound disk are its bad slots' (set aside one by one, quarantine.py) and start none."""
        tier = Tier.NVME
        if tier not in self.tiers:
            return
        arrived, failed = self.mover.read_from(tier)
        new_arrived, new_failed = arrived - self._reads_seen[0], failed - self._reads_seen[1]
        self._reads_seen = (arrived, failed)
        if new_arrived and tier in self._read_backoff:
            self._read_backoff.discard(tier)
            log.info("reads from %s work again after %.1f s of failed reads: it is read and written again",
                     tier.label, self._end_backoff(tier))
        elif (new_failed and not new_arrived and self.mover.quarantine.failing(tier)
              and (self.writable(tier) or tier not in self._read_backoff)):
            if self.writable(tier):
                how = (f"is neither read nor written for {self._start_backoff(tier):g} s (its blocks are misses "
                       "meanwhile, and blocks that would go down there are dropped instead)")
            else:
                # Reads fail while the tier backs off after failed writes (a dead disk: both fail):
                # that back-off stands as it is. Before, lookups went on offering its blocks, and each
                # acquire lost them (a review's script: 12 blocks of 6 chains, where 2 are lost now).
                how = "backs off after failed writes already: it is not read either until a read works"
            self._read_backoff.add(tier)
            self.stats.read_backoffs += 1
            log.warning("reads from %s failed (%d blocks) on a disk taken to be failing: %s %s; replace the disk "
                        "under memory.nvme_path", tier.label, new_failed, tier.label, how)

    def _start_backoff(self, tier: Tier) -> float:
        """`tier` takes no blocks for a period, twice the last one's while it keeps failing: its length."""
        _, period = self.write_backoff.get(tier, (0.0, 0.0))
        period = self.WRITE_BACKOFF_S if not period else min(2 * period, self.WRITE_BACKOFF_MAX_S)
        now = self.monotonic()
        self.write_backoff[tier] = (now + period, period)
        self._backoff_since.setdefault(tier, now)
        self._write_tried[tier] = now
        return period

    def _end_backoff(self, tier: Tier) -> float:
        """`tier`'s back-off is over: the seconds since it began."""
        del self.write_backoff[tier]
        self._write_tried.pop(tier, None)
        return self.monotonic() - self._backoff_since.pop(tier, self.monotonic())

    def _writes_work_again(self, tier: Tier, how: str) -> None:
        """End `tier`'s back-off: a write there worked (`how` says which, when not a move's)."""
        log.info("writes to %s work again after %.1f s backing off%s: it takes blocks again", tier.label,
                 self._end_backoff(tier), how)

    # -- probes ----------------------------------------------------------------------------
    def probe_writes(self) -> None:
        """While a storage tier backs off, at most every WRITE_PROBE_EVERY_S (the background step
        calls this): try one real write there, a block moved down by the mover as any other (the
        transfer backend, the tier's own I/O path). One that arrives ends the back-off. One whose
        write fails stays where it was (a failed move loses nothing), and the back-off goes on as it
        was: not lengthened (that is for the writes of moves asked for) and not logged again (the
        mover and the transfer backend say failed batches once a minute)."""
        now = self.monotonic()
        for tier in self.tiers:
            # (A back-off with no write tried on record, set by hand, is probed a period after it is seen.)
            if self.writable(tier) or now - self._write_tried.setdefault(tier, now) < self.WRITE_PROBE_EVERY_S:
                continue
            if tier in self._read_backoff:
                continue  # (a write that works says nothing of reads: the back-off runs out)
            self._write_tried[tier] = now
            if self._probe(tier):
                self._writes_work_again(tier, " (a probe of one block's write worked)")

    def _probe(self, tier: Tier) -> bool:
        """Move one block down into `tier` from the tier just above it: the coldest there that may go
        alone (`_probe_block`), into a free slot. Where `tier` has no free slot of its size, its
        coldest block nobody holds is dropped for one (what the next move down would drop; the slot
        stays free for the next probe when this one fails). Whether the block arrived; False also
        when no block may go (then the back-off runs out as it would have)."""
        above = [t for t in self.tiers if t < tier]
        if not above:
            return False
        src = above[-1]
        rows = self._probe_block(src, tier)
        if not len(rows):
            return False
        size = int(self.table.block_bytes(rows)[0])
        if not self.make_room(tier, int(self._slot_bytes(tier, rows)[0]), block_bytes=size):
            return False
        if not self.policy.admit(self.table, rows, tier, self.table.clock()).all():
            return False  # (a tier with a free slot admits every block under every daemon policy so far)
        moved = self.mover.move(rows, tier)
        if not moved.all():
            return False
        self.stats.demoted += 1
        self.policy.on_insert(self.table, rows, self.table.clock())
        return True

    def _probe_block(self, src: Tier, dst: Tier) -> np.ndarray:
        """The coldest block of `src` that may go down to `dst` alone now, as a one-row array (empty
        when none): resident, unpinned, held by nobody, not awaiting its read (`awaiting_read`), with
        no cached child in `src` or a faster tier (prefix order: a parent never lands below its
        child), and one that `dst` keeps (`read_cost`: a block it would drop instead is no probe)."""
        held = [np.asarray(source(), dtype=np.int64) for source in self.awaiting_read]
        protect = np.concatenate(held) if held else None
        rows = self.select(src, 1, evict=False, idle_only=True, protect=protect)
        rows = rows[self._childless(src, evict=False)[rows]][:1]
        if len(rows) and self.read_cost is not None:
            if not self.read_cost.keeps(self.table.layouts, self.table.cols.layout[rows], dst).all():
                return rows[:0]
        return rows

    def _drop_while_backing_off(self, tier: Tier, short: int, pick: dict) -> bool:
        """While a tier below `tier` backs off, and no block can go down from `tier`: drop about
        `short` bytes of it. The tiers between may be full of parents of blocks on the storage tier,
        which may neither go down nor be dropped alone, and stay so while its disk is full: this
        tier would take nothing until the disk has room (the soak's disk-full run: a fresh client
        got 96 of 128 HBM blocks while every cached block was idle). So: its own blocks nobody holds
        with no cached child; failing those, the blocks that would leave it, each with its
        descendants below, where none of them is held. False when no tier below backs off (where
        the tiers below are held by their clients, keeping this tier's blocks finds more, as the
        tiered replays show) or nothing could be dropped."""
        if not self._backing_off_below(tier):
            return False
        if self._evict(self.select(tier, short, evict=True, **pick)):
            return True
        heads = self.select(tier, short, evict=False, **pick)
        if not len(heads):
            return False
        c = self.table.cols
        marked = np.zeros(c.capacity, dtype=bool)
        marked[heads] = True
        # A descendant lies in its parent's tier or a slower one: those below are found walking up
        # from the slower tiers' blocks.
        below = (c.tier > int(tier)) & (c.state != int(BlockState.FREE))
        return self._evict(self._droppable(np.flatnonzero(self._with_descendants(marked, below))))
