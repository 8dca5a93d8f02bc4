"""Moves blocks between tiers in batches, two-phase: prepare in the table, copy, complete.

Mechanism only: which blocks move is decided elsewhere (placement.py, asking the policy). A batch is
at most `swap_batch_size` blocks from one tier to another. Prepare marks the blocks MIGRATING and
takes destination slots; the transfer backend copies; complete puts each block where its copy
succeeded, and leaves it where it was otherwise (a failed move loses nothing); a destination slot
that the storage could not write by itself (EIO) is then set aside (quarantine.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from dflash2.arena.base import StorageArena
from dflash2.counts import distinct
from dflash2.quarantine import Quarantine, slot_place
from dflash2.readcost import ReadCost
from dflash2.swaplog import SwapLog
from dflash2.table import BlockState, BlockTable
from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch, CopyJob, TransferBackend
from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.swap")


@dataclasses.dataclass
class DirectionStats:
    batches: int = 0
    blocks: int = 0
    bytes: int = 0
    # The copies' own time, summed over the batches the backend timed (`timed_batches`: every host
    # and NVMe batch, a GPU HBM<->DRAM batch once a second per direction). Before, each batch counted
    # from its move's start to its settling: the wait behind the earlier batches of its move and, for
    # a drain piece, until the loop settled it, 20-60x the copies' time (summed past the wall clock).
    seconds: float = 0.0
    timed_batches: int = 0
    failed_blocks: int = 0
    # ... of which their destination slot alone was to blame (set aside, quarantine.py): no sign of
    # a full or failing disk, so no back-off (backoff.py)
    slot_failed_blocks: int = 0


@dataclasses.dataclass
class PreparedMove:
    """A batch between prepare and complete: the table holds these rows MIGRATING."""

    rows: np.ndarray
    src: Tier
    dst: Tier
    dst_offsets: np.ndarray
    job: CopyJob | None
    started: float
    nbytes: int


@dataclasses.dataclass
class Flight:
    """The batches of one `Mover.start`, between start and finish: `prepared` pairs each batch with
    the indices of `rows` it holds (the batches stop at the first that found no room)."""

    rows: np.ndarray
    prepared: list[tuple[np.ndarray, PreparedMove]]

    @property
    def blocks(self) -> int:
        return sum(len(part) for part, _ in self.prepared)

    @property
    def nbytes(self) -> int:
        return sum(move.nbytes for _, move in self.prepared)

    def done(self) -> bool:
        """Whether every copy of the flight has ended (`finish` then waits for nothing)."""
        return all(move.job is None or move.job.done() for _, move in self.prepared)


class Mover:
    def __init__(self, table: BlockTable, backend: TransferBackend | None, swap_batch_size: int):
        """`backend` None means metadata only (simulation and policy replay): copies succeed at once."""
        self.table = table
        self.backend = backend
        self.swap_batch_size = swap_batch_size
        self.stats: dict[tuple[Tier, Tier], DirectionStats] = defaultdict(DirectionStats)
        # Blocks whose read back from NVMe failed (checksum or I/O): their stored bytes are not to be
        # trusted, so the caller drops them from the cache (a miss, never wrong data). Kept as vids,
        # not rows: a caller cut short by an exception drains them later, when a row may have been
        # freed and reused by another block, which must not be dropped in its place.
        self.lost: list[int] = []
        # The NVMe tier's arena, asked which failed reads were blocks lost with its file cut short by
        # another process (not the slots' fault: never set aside; None: metadata only, or no NVMe).
        self.storage: StorageArena | None = None
        # Observer of each finished batch (src, dst, seconds): the metrics histogram hooks in here.
        self.on_batch: Callable[[Tier, Tier, float], None] | None = None
        # Where each finished batch's bytes and time go to measure the tiers' read bandwidth
        # (dflash2/readcost.py); None: not measured (metadata-only replays have no copies to time).
        self.read_cost: ReadCost | None = None
        # Failed batches' warnings, once a minute per direction: a failing disk fails every batch that
        # reads it (a flaky one: 5,342 warnings in 4 minutes); the counts are in `stats` and the
        # metrics all the same.
        self._failure_log = RepeatLimit("batches")
        # The `dflash2_swap` lines: a direction's batches summed, a line every 10 s at most (swaplog.py).
        self.swap_log = SwapLog(log)
        # Destination slots whose own write failed with an I/O error (a bad region of the disk): set
        # aside for good, so that no later batch takes them again (dflash2/quarantine.py).
        self.quarantine = Quarantine(table)
        # Blocks (vids) whose last move into a memory tier failed for its copy (a refused launch, an
        # out-of-memory), not for room nor the disk: they stay where they were. An acquire whose
        # blocks these are was told "the room made fell short", counted tier_full with HBM empty, and
        # its promotion's second pass read and copied them again (a review): both ask here. A new try
        # of a block, or an acquire told so (`forget_copy_failed`), takes it out.
        self.copy_failed: set[int] = set()

    def prepare(self, rows: np.ndarray, dst: Tier) -> PreparedMove | None:
        """Phase one for one batch (all rows in one source tier). None: no room at dst, nothing changed."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) > self.swap_batch_size:
            raise ValueError(f"a batch of {len(rows)} blocks exceeds swap_batch_size {self.swap_batch_size}")
        cols = self.table.cols
        src_tiers = distinct(cols.tier[rows])
        if len(src_tiers) != 1:
            raise ValueError("one batch moves blocks out of one tier")
        src = Tier(src_tiers[0])
        dst_offsets = self.table.begin_move(rows, dst)
        if dst_offsets is None:
            return None
        self.forget_copy_failed(rows)  # (tried again: this try's outcome replaces the last's)
        nbytes = self.table.block_bytes(rows)
        job = None
        started = time.perf_counter()
        if self.backend is not None:
            try:  # (the batch made inside: its ValueError, a move into the tier the blocks lie in, raised
                # past begin_move and left them MIGRATING for good, their new slots taken, a review)
                batch = CopyBatch(src, dst, cols.offset[rows].copy(), dst_offsets, nbytes)
                job = self.backend.start(batch)
            except BaseException:
                # The copy never started: the blocks stay where they were, the destination slots go back.
                self.table.end_move(rows, dst, dst_offsets, np.zeros(len(rows), dtype=bool))
                raise
        return PreparedMove(rows, src, dst, dst_offsets, job, started, int(nbytes.sum()))

    def complete(self, move: PreparedMove) -> np.ndarray:
        """Phase two: wait for the copy and settle every block. Returns the per-block success mask."""
        ok = np.ones(len(move.rows), dtype=bool) if move.job is None else move.job.wait()
        if not ok.all():
            # A read's blocks the disk failed are dropped; the others (their GPU copy failed after the
            # read) stay on NVMe as any failed move's, their slots sound: every failed block of a read
            # was taken for unreadable, dropped and its slot suspected (a review).
            unread = np.zeros(len(ok), dtype=bool)
            if move.src == Tier.NVME:
                unread = ~ok if move.job is None or move.job.unreadable is None else move.job.unreadable & ~ok
            failed = move.rows[unread]
            if len(failed):
                vids = self.table.vids(failed)
                which = self._which(move.src, failed, vids)
                # Named before end_move, which frees a block whose last reference went mid-move.
                self.lost.extend(vids.tolist())
                offsets = self.table.cols.offset[failed]
                if self.storage is not None:  # (the arena said those lost to a cut as it found it)
                    failed = failed[~self.storage.lost_to_cut(offsets)]
                    offsets = self.table.cols.offset[failed]
                # Their slots are not to be trusted either: set aside as they are freed (quarantine.py).
                self.quarantine.suspect(move.src, offsets, self.table.block_bytes(failed))
                # None: one of its direction was logged in the last minute; counted in the next.
                more = self._failure_log.due((move.src, move.dst), blocks=len(failed)) if len(failed) else None
                if more is not None:
                    log.warning("%d of %d blocks read back from NVMe failed their checksum or read (%s): dropped from "
                                "the cache, a miss each, never wrong data; many of these mean the disk under "
                                "memory.nvme_path is failing%s", len(failed), len(move.rows), which, more)
            kept = move.rows[~ok & ~unread]
            if len(kept) and move.dst != Tier.NVME:  # (a write to NVMe that failed is the disk's)
                self._note_copy_failed(kept)
            if len(kept):
                which = self._which(move.src, kept, self.table.vids(kept))
                kind = (move.src, move.dst) if move.src != Tier.NVME else (move.src, move.dst, "copy")
                more = self._failure_log.due(kind, blocks=len(kept))
                # (A staged read that ended before some chunks: those were never read, not copied.)
                never = 0 if move.job is None or move.job.not_read is None else int(
                    (move.job.not_read & ~ok & ~unread).sum())
                if more is not None and move.src == Tier.NVME and never:
                    log.warning("%d of %d blocks from NVMe failed to move on to %s (%s): %d copied after the disk read "
                                "them failed, %d were not read (the batch ended before them), not the disk's fault "
                                "(the transfer log names the error); they stay on NVMe%s", len(kept), len(move.rows),
                                move.dst.label, which, len(kept) - never, never, more)
                elif more is not None and move.src == Tier.NVME:
                    log.warning("%d of %d blocks read from NVMe failed to move on to %s after the disk read them (%s): "
                                "their copy failed, not the disk (the transfer log names the error); they stay on "
                                "NVMe%s", len(kept), len(move.rows), move.dst.label, which, more)
                elif more is not None:
                    log.warning("%d of %d blocks failed to move %s->%s (%s): they stay where they were%s",
                                len(kept), len(move.rows), move.src.label, move.dst.label, which, more)
        # Sized before end_move, which frees a block whose last reference went mid-move.
        arrived = move.nbytes if ok.all() else int(self.table.block_bytes(move.rows)[ok].sum())
        unwritable = None if move.job is None or move.job.unwritable is None else move.job.unwritable & ~ok
        bad_sizes = None
        if unwritable is not None and unwritable.any():
            bad_sizes = self.table.block_bytes(move.rows[unwritable])
        self.table.end_move(move.rows, move.dst, move.dst_offsets, ok)
        slot_failed = 0
        if bad_sizes is not None:
            # Freed by end_move just now, and taken out of the free pool before anything else runs.
            if self.quarantine.set_aside(move.dst, move.dst_offsets[unwritable], bad_sizes):
                slot_failed = len(bad_sizes)
        seconds = None if move.job is None else move.job.seconds  # (DirectionStats.seconds)
        if self.read_cost is not None and seconds and arrived:
            self.read_cost.observe(move.src, move.dst, arrived, seconds)
        st = self.stats[(move.src, move.dst)]
        st.batches += 1
        st.blocks += int(ok.sum())
        st.failed_blocks += int((~ok).sum())
        st.slot_failed_blocks += slot_failed
        st.bytes += arrived  # bytes of the blocks that arrived: a failed copy moved nothing usable
        if seconds is not None:
            st.seconds += seconds
            st.timed_batches += 1
            if self.on_batch is not None:
                self.on_batch(move.src, move.dst, seconds)
        if self.backend is not None:
            self.swap_log.batch(f"{move.src.label}->{move.dst.label}", int(ok.sum()), int((~ok).sum()),
                                arrived, seconds)
        return ok

    def _note_copy_failed(self, rows: np.ndarray) -> None:
        if len(self.copy_failed) > 16 * self.swap_batch_size:  # (bounded: those freed since are let go)
            vids = np.fromiter(self.copy_failed, dtype=np.int64, count=len(self.copy_failed))
            self.copy_failed = set(vids[self.table.liveness(vids)[1]].tolist())
        self.copy_failed.update(self.table.vids(rows).tolist())

    def copy_failed_among(self, rows: np.ndarray) -> np.ndarray:
        """Mask of `rows` whose last move into a memory tier failed for its copy (`copy_failed`)."""
        if not self.copy_failed or not len(rows):
            return np.zeros(len(rows), dtype=bool)
        return np.isin(self.table.vids(rows), np.fromiter(self.copy_failed, dtype=np.int64))

    def forget_copy_failed(self, rows: np.ndarray) -> None:
        if self.copy_failed:  # (every new acquire asks: nothing to look up while none is on record)
            self.copy_failed.difference_update(self.table.vids(rows).tolist())

    def _which(self, src: Tier, failed: np.ndarray, vids: np.ndarray) -> str:
        """The first of a batch's failed blocks, named with its place, and how many more."""
        first = slot_place(src, int(self.table.cols.offset[failed[0]]), self.quarantine.nvme_path)
        return f"block {int(vids[0]):#x} at {first}" + ("" if len(failed) == 1 else f", and {len(failed) - 1} more")

    def failed_into(self, dst: Tier) -> int:
        """Blocks whose copy into `dst` failed, since start (every source tier)."""
        return sum(st.failed_blocks for (_, to), st in self.stats.items() if to == dst)

    def disk_failed_into(self, dst: Tier) -> int:
        """Those of `failed_into` that a slot set aside does not explain (a full disk, a failing one)."""
        return sum(st.failed_blocks - st.slot_failed_blocks for (_, to), st in self.stats.items() if to == dst)

    def read_from(self, src: Tier) -> tuple[int, int]:
        """Blocks copied out of `src` since start, every destination: (arrived, failed)."""
        out = [(st.blocks, st.failed_blocks) for (frm, _), st in self.stats.items() if frm == src]
        return sum(a for a, _ in out), sum(f for _, f in out)

    def with_lost_file(self, rows: np.ndarray) -> np.ndarray:
        """`rows` and the storage tier's other blocks lost with its file (removed, cut short: nvmegone.py,
        nvmecut.py), settled ones: one loss, so that a child among them is dropped as lost, in its turn,
        not as an orphan of a block read now (a review; `table.drop_lost`'s `lost_too`)."""
        if not len(rows) or self.storage is None or not self.storage.forgets:
            return rows
        c = self.table.cols
        ours = rows[c.tier[rows] == int(self.storage.tier)]
        if not self.storage.lost_to_cut(c.offset[ours]).any():  # (a read that failed for its disk, not the file:
            return rows  # no scan; after every batch, once a file had been lost, it cost each a column pass, a review)
        return np.union1d(rows, self.lost_file_rows())

    def lost_file_rows(self) -> np.ndarray:
        """The storage tier's settled blocks lost with its file (removed, cut short) and not yet dropped (one
        kept for its holders at an earlier drop is not again): a pass over the table's columns."""
        c = self.table.cols
        rows = np.flatnonzero((c.tier == int(self.storage.tier)) & (c.state == int(BlockState.RESIDENT)))
        rows = rows[self.storage.lost_to_cut(c.offset[rows])]
        return rows[~self.table.is_lost(rows)]

    def take_lost(self) -> np.ndarray:
        """Rows of the blocks whose read failed since the last call, those still live: a block
        freed since (its row perhaps reused by another block) was dropped already."""
        lost, self.lost = self.lost, []
        rows, live = self.table.liveness(np.asarray(sorted(set(lost)), dtype=np.int64))
        return rows[live]

    def move(self, rows: np.ndarray, dst: Tier,
             before_batch: Callable[[np.ndarray], object] | None = None,
             max_batch_bytes: int | None = None) -> np.ndarray:
        """Move rows to dst in batches, all in flight together. Batches follow the rows' order (a
        batch ends where the source tier changes), and the first batch that finds no room stops the
        rest: callers list ancestors first, so a partial move never puts a block above its prefix.
        `before_batch(batch_rows)`, when given, runs before each batch is prepared, while the
        earlier batches are in flight: a promotion makes room with it batch by batch, so that its
        demotions (the other direction of the link) run while its earlier batches come up.
        `max_batch_bytes` also ends a batch before its blocks pass that many bytes (a batch always
        holds at least one block).
        Returns a mask of the rows now in dst; the others stay where they were."""
        return self.finish(self.start(rows, dst, before_batch, max_batch_bytes))

    def start(self, rows: np.ndarray, dst: Tier,
              before_batch: Callable[[np.ndarray], object] | None = None,
              max_batch_bytes: int | None = None) -> Flight:
        """`move`'s first half: every batch prepared and its copy started; `finish` ends them. Until
        then the batches' blocks are MIGRATING (a drain piece leaves them so between requests)."""
        rows = np.asarray(rows, dtype=np.int64)
        prepared: list[tuple[np.ndarray, PreparedMove]] = []
        try:
            sizes = None if max_batch_bytes is None else self.table.block_bytes(rows)
            for part in self._batches(self.table.cols.tier[rows], sizes, max_batch_bytes):
                if before_batch is not None:
                    before_batch(rows[part])
                move = self.prepare(rows[part], dst)
                if move is None:
                    break
                prepared.append((part, move))
        except BaseException:
            # Every prepared batch is completed, even when preparing a later one raised.
            self.finish(Flight(rows, prepared))
            raise
        return Flight(rows, prepared)

    def start_leading(self, victims: np.ndarray, lower: Tier) -> Flight:
        """(`start` of `victims` having found no room for their first batch) start the move of a
        leading run of them that fits in `lower`: a flight with nothing prepared when not even the
        first fits. `leading_that_fit` is exact for blocks of one size, but for several only an upper bound:
        each size counts the free pages and empty slabs the others count too (a small block then a
        large one, into one free page, both counted: the retry with both failed as the whole had,
        nothing moved, and both were dropped). So the run counted is halved until its start
        prepares a batch, in a few tries; a start that prepares none changes nothing, so the next
        may follow it. Only a run shorter than the first batch, which failed, can prepare one (a
        batch is at most swap_batch_size long, shorter where the victims' source tier changes)."""
        fit = min(self.leading_that_fit(victims, lower), min(len(victims), self.swap_batch_size) - 1)
        while fit > 0:
            flight = self.start(victims[:fit], lower)
            if flight.prepared:
                return flight
            fit //= 2
        return Flight(victims, [])

    def leading_that_fit(self, rows: np.ndarray, tier: Tier) -> int:
        """How many of the leading rows `tier` has free slots for now, size by size: exact for
        blocks of one size, an upper bound for several (each size counts the shared free pages)."""
        alloc = self.table.allocators[tier]
        left: dict[int, int] = {}
        n = 0
        for size in self.table.block_bytes(rows).tolist():
            if size not in left:
                left[size] = alloc.blocks_free(size)
            if not left[size]:
                break
            left[size] -= 1
            n += 1
        return n

    def finish(self, flight: Flight) -> np.ndarray:
        """`move`'s second half: wait for each batch of `flight` and settle its blocks. Returns the
        mask of its rows now in their destination."""
        done = np.zeros(len(flight.rows), dtype=bool)
        for part, move in flight.prepared:
            done[part] = self.complete(move)
        return done

    def _batches(self, tiers: np.ndarray, sizes: np.ndarray | None = None, max_bytes: int | None = None):
        """Index runs of consecutive rows from one source tier, at most swap_batch_size long and,
        when given, at most max_bytes of `sizes` (but never empty)."""
        cuts = np.flatnonzero(np.diff(tiers)) + 1
        for run in np.split(np.arange(len(tiers)), cuts):
            start = 0
            while start < len(run):
                stop = min(len(run), start + self.swap_batch_size)
                if max_bytes is not None:
                    within = np.cumsum(sizes[run[start:stop]]) <= max_bytes
                    stop = start + max(1, int(np.count_nonzero(within)))
                yield run[start:stop]
                start = stop
