"""Storage slots whose writes fail with an I/O error, or whose reads fail: set aside until a re-test
finds them sound.

A bad region of the disk under NVMe (EIO at some offsets only) fails every write into it. Its slots
went back to the free pool after each failed batch, and the next batch took them again: NVMe backed
off again and again (about a third of it in use in a helper's run with EIO injected through FUSE).
Now the NVMe tier writes a batch that failed with EIO again block by block and names the slots that
failed on their own (`StorageArena.write_blocks`, `CopyJob.unwritable`); the mover hands those here
once their batch is complete, and they leave the allocator's free pool for good
(`SlotAllocator.quarantine`: they come out of the tier's capacity, not into its used bytes). The
slots of a batch that failed as a whole (a full disk: ENOSPC) are not to blame and are used again.
A slot whose read failed (EIO, or bytes that failed their checksum: its block is dropped) is set
aside too, once its block is freed (`suspect`, `freed`): a sector that reads back wrong would lose
the next block written there as well.

A failure that a slot set aside explains says nothing of the disk as a whole: it starts no back-off
(backoff.py), and the next batch goes elsewhere at once (a bad region is crossed in a few batches,
not in a back-off per batch). Up to a ceiling: once more than FAILING_FRACTION of a tier is set
aside, the disk is taken to be failing (said once, as an error). Its slots that fail are still set
aside, but their failures then start back-offs as a full disk's do, so that a disk that fails every
write (dead, or for a while) does not lose all of its slots within seconds.

An EIO may pass (a controller reset, a path that failed over): the background step re-tests up to
RETEST_SLOTS of a tier's slots set aside (`retest`, the oldest first, round the list), writing a
pattern into each slot and reading it back (`StorageArena.test_slots`: slot by slot, on a thread of
its own and outside the arena's lock, so that a disk slow to answer EIO holds neither the daemon's
loop nor the tier's copies in the daemon; a disk that serialises its I/O still queues them behind
each slow answer); those that pass go back to the free pool (`SlotAllocator.give_back`). Before,
they stayed set aside until the daemon restarted.

When: RETEST_FIRST_S after the step first sees a tier's slots set aside, then after a wait that
doubles with each re-test in which one failed again (or the disk as a whole), up to RETEST_EVERY_S,
and from RETEST_FIRST_S again once none is left (a flat RETEST_EVERY_S kept a tier whose EIO passed
at once short of its slots for 5 minutes: soak11, 251-295 s after the disk healed). A re-test that
gave back a slot says the disk answers again, at least in part: the next one comes at the next step,
until none is left, one gives nothing back, or the run has tested as many slots as were set aside
when it began (a failed slot goes to the back of the list), and the run is said once, at its end
(one at a time, a reset that set aside the slots of a few drain batches, thousands, gave them back
over hours; soak11: 801 slots in 51 rounds in 6 s, 1,921 in 121 rounds in 15 s). Ended by the first
slot that failed again, as before, a region healed but for some slots among the rest gave back
about 9 slots a re-test, every 5 minutes: about 440 healed slots still set aside 200 s after the
heal, hours of them (soak12); now all were back 28 s after it. A re-test that is not such a follow-up is said at its
end too (one info line). Not while the tier backs off after failed writes (a full disk would fail
the test for its own reasons): the slots then wait for the next re-test after the back-off.

Policy here, mechanism in the allocator: a warning with the batch's count and the total so far, once
a minute per tier (RepeatLimit: the batches left out are counted in the next line); a bad region met
by every drain batch logged a warning a batch (241 in 90 s in soak4's EIO run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import numpy as np

from dflash2 import threads
from dflash2.arena.base import StorageArena
from dflash2.arena.nvme import HEADER_BYTES
from dflash2.errors import ArenaError
from dflash2.table import BlockTable
from dflash2.tiers import Tier
from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.quarantine")


def slot_place(tier: Tier, offset: int, nvme_path: str | None = None) -> str:
    """Where a slot's bytes are, for a log line: the NVMe file's byte (past its header) and the file
    (`nvme_path`: with several pools, which of the `nvme_path.gpuN` files a review could not tell),
    else the offset."""
    if tier == Tier.NVME:
        return f"byte {HEADER_BYTES + offset} of the NVMe file" + (f" {nvme_path}" if nvme_path else "")
    return f"offset {offset} of the {tier.label} tier"


class Quarantine:
    # Past this share of a tier's bytes set aside, the disk is taken to be failing (said once, as an
    # error): a few bad sectors are routine on a large disk, a twentieth of it is not.
    FAILING_FRACTION = 0.05
    # A re-test of slots set aside: the first this long after a tier's slots are first seen set aside,
    # then after a wait doubled by each re-test in which one fails again, at most RETEST_EVERY_S; this
    # many slots at a time (a few MB of writes and reads, where a re-test of every slot of a failing
    # disk could take seconds).
    RETEST_FIRST_S = 30.0
    RETEST_EVERY_S = 300.0
    RETEST_SLOTS = 16
    RETEST_WAIT_S = 0.05  # how long a step waits for a re-test's I/O (on its own thread) before moving on

    def __init__(self, table: BlockTable):
        self.table = table
        self.nvme_path: str | None = None  # the NVMe tier's file, named in the log (set by the manager)
        self.slots = 0  # set aside so far, every tier (room-making plans again after a batch that set some aside)
        self.given_back = 0  # slots given back after passing a re-test, every tier
        self._jobs: dict[Tier, _RetestJob] = {}  # a re-test whose I/O runs (or ran) on its own thread, per tier
        self._retested: dict[Tier, float] = {}  # when each tier's slots were last re-tested (or first seen set aside)
        self._wait: dict[Tier, float] = {}  # how long each tier's next re-test waits after its last (module docstring)
        # Per tier, a run of re-tests that each gave back a slot, each followed by the next at the
        # next step, so far (said at its end).
        self._run: dict[Tier, _Run] = {}
        self._said_failing: set[Tier] = set()
        self._said = RepeatLimit("batches")  # the warning, once a minute per tier
        # Per tier, slots whose read failed, still holding their (lost) blocks: offset -> block bytes.
        # Each is set aside when it is freed (`suspect`, `freed`).
        self._suspects: dict[Tier, dict[int, int]] = {}
        # Suspect slots freed inside `gathered` (one loss's drop), per tier: offset -> block bytes.
        self._gathered: dict[Tier, dict[int, int]] | None = None

    def failing(self, tier: Tier) -> bool:
        """Whether more than FAILING_FRACTION of the tier is set aside: its disk is taken to be failing."""
        alloc = self.table.allocators[tier]
        return alloc.quarantined_bytes > self.FAILING_FRACTION * alloc.arena_bytes

    def suspect(self, tier: Tier, offsets: np.ndarray, block_bytes: np.ndarray) -> None:
        """Slots of `tier` whose read failed (an I/O error, or bytes that failed their checksum): their
        blocks are dropped, and each slot is set aside once it is freed (`freed`), until a re-test
        writes and reads it back. Before, it went back to the free pool, and the next block written
        there was lost in turn when read: a sector that reads back wrong does so again."""
        held = self._suspects.setdefault(tier, {})
        for offset, size in zip(np.asarray(offsets).tolist(), np.asarray(block_bytes).tolist()):
            held[int(offset)] = int(size)

    def freed(self, tier: Tier, offsets: np.ndarray) -> None:
        """Slots of `tier` just freed (the table's `on_slots_freed`): the suspected ones are set aside."""
        held = self._suspects.get(tier)
        if not held:
            return
        bad = [o for o in np.asarray(offsets).tolist() if o in held]
        if not bad:
            return
        sizes = [held.pop(o) for o in bad]
        if self._gathered is not None:  # (set aside with the rest of their drop, at its end)
            self._gathered.setdefault(tier, {}).update(zip(bad, sizes))
            return
        self._set_aside_freed(tier, bad, sizes)

    @contextlib.contextmanager
    def gathered(self):
        """Suspect slots freed inside (the drop of one read's lost blocks, each freed by itself) are
        set aside together at its end, in one warning: before, each was set aside and said alone,
        and the once-a-minute warning said "1 nvme slots" where a batch had lost 16 blocks (a review).
        Nothing allocates inside a drop, so the slots freed there stay free until then."""
        if self._gathered is not None:  # (inside another: its end sets them aside)
            yield
            return
        self._gathered = {}
        try:
            yield
        finally:
            gathered, self._gathered = self._gathered, None
            for tier, slots in gathered.items():
                self._set_aside_freed(tier, list(slots), list(slots.values()))

    def _set_aside_freed(self, tier: Tier, bad: list[int], sizes: list[int]) -> None:
        try:
            self.set_aside(tier, np.array(bad, dtype=np.int64), np.array(sizes, dtype=np.int64),
                           failed="reads failed (an I/O error, or bytes that failed their checksum)")
        except ArenaError as exc:  # (runs inside a free: that call must not fail halfway for it)
            log.error("%d %s slots whose reads failed could not be set aside (%s): they stay in use", len(bad),
                      tier.label, exc)

    def set_aside(self, tier: Tier, offsets: np.ndarray, block_bytes: np.ndarray,
                  failed: str = "writes failed with an I/O error") -> bool:
        """Take these free slots of `tier` (the destination slots of blocks of `block_bytes` whose
        write failed by itself, freed as their move failed; or `suspect` slots, freed) out of use
        until a re-test finds them sound, and say so (`failed`: what failed there).
        Whether the slots alone are to blame: False once the tier's disk is taken to be failing
        (`failing`, before these), and then the failures count as the disk's (back-offs)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        block_bytes = np.asarray(block_bytes, dtype=np.int64)
        if len(offsets) != len(block_bytes):
            raise ValueError(f"{len(offsets)} slots to set aside but {len(block_bytes)} block sizes")
        if not len(offsets):
            return True
        slots_to_blame = not self.failing(tier)
        alloc = self.table.allocators[tier]
        taken = sum(alloc.quarantine(size, offsets[block_bytes == size]) for size in np.unique(block_bytes).tolist())
        share = alloc.quarantined_bytes / alloc.arena_bytes
        more = self._said.due(tier, blocks=len(offsets))
        if more is not None:
            log.warning("%d %s slots (%d bytes, the first at %s) whose %s: set aside, not used "
                        "again unless a re-test finds them sound; %d bytes (%.2f%% of %s) set aside so far%s",
                        len(offsets), tier.label, taken, slot_place(tier, int(offsets[0]), self.nvme_path), failed,
                        alloc.quarantined_bytes, 100 * share, tier.label, more)
        self.slots += len(offsets)
        if self.failing(tier) and tier not in self._said_failing:
            self._said_failing.add(tier)
            log.error("%.1f%% of %s is set aside after its writes or reads failed (more than %g%%): the disk "
                      "under it (memory.nvme_path) is failing; replace it. Its writes that fail from now on "
                      "make it back off as a full disk does", 100 * share, tier.label, 100 * self.FAILING_FRACTION)
        return slots_to_blame

    def retest(self, tier: Tier, arena: StorageArena, now: float) -> int:
        """RETEST_FIRST_S after the tier's slots are first seen set aside, then after a wait that doubles
        up to RETEST_EVERY_S, or at the next step after one that gave back a slot (module docstring;
        `now`: a monotonic clock): write a pattern into up to
        RETEST_SLOTS of the tier's slots set aside (the oldest first), read it back, and give back to
        the free pool those that held it. Returns the slots given back. A batch write that fails for
        the disk as a whole (ArenaError: a full disk) gives nothing back and is said; the slots wait
        for the next re-test. The caller runs it only while the tier takes writes (not backing off).

        The I/O runs on a thread of its own, not in the caller (the background step runs on the
        daemon's serving thread): a bad region that answers EIO slowly (a disk retrying a sector)
        would otherwise hold every client for a failed batch write plus one per slot. The step waits
        RETEST_WAIT_S for it; a re-test not done by then is settled by a later step. The slots stay
        set aside (out of the free pool, touched by nobody else) until it is."""
        alloc = self.table.allocators[tier]
        job = self._jobs.get(tier)
        if job is None:
            if not alloc.quarantined_bytes:
                self._retested.pop(tier, None)
                self._wait.pop(tier, None)
                return 0
            if now - self._retested.setdefault(tier, now) < self._wait.setdefault(tier, self.RETEST_FIRST_S):
                return 0
            self._retested[tier] = now
            offsets = alloc.quarantined_offsets()[: self.RETEST_SLOTS]  # oldest first (insertion order)
            job = _RetestJob(arena, offsets, alloc.quarantined_slot_bytes(offsets))
            self._jobs[tier] = job
        if not job.done.wait(self.RETEST_WAIT_S):
            return 0
        del self._jobs[tier]
        offsets = job.offsets
        if job.error is not None:
            # To the back of the list too: a region that fails every read would otherwise hold the
            # same slots at the head of every re-test, and the others would never be tried.
            alloc.requeue_quarantined(offsets)
            self._wait_longer(tier)
            if tier in self._run:
                self._say(tier, 0)  # the run of passing re-tests before it ends here
            log.warning("re-test of %d %s slots set aside failed for the disk as a whole (%s): they stay set aside "
                        "until a later re-test", len(offsets), tier.label, job.error)
            return 0
        sound = job.sound
        # The ones that failed again go to the back of the list: the next re-test takes others first.
        again = offsets[~sound]
        alloc.requeue_quarantined(again)
        given = alloc.give_back(offsets[sound])
        self.given_back += int(sound.sum())
        if not self.failing(tier):
            self._said_failing.discard(tier)  # said again if it fails that far again
        run = self._run.setdefault(tier, _Run(lap=int(sound.sum()) + len(alloc.quarantined_offsets())))
        run.rounds += 1
        run.tested += len(offsets)
        run.passed += int(sound.sum())
        run.given_bytes += given
        if sound.any() and alloc.quarantined_bytes and run.tested < run.lap:
            # The disk answers again, at least in part: the rest at the next step (module docstring),
            # said at the run's end, for one lap of the slots set aside when the run began at most. A
            # region that healed but for a few slots still bad (requeued to the back, among the rest)
            # no longer makes each round that meets one of them wait up to RETEST_EVERY_S (soak12).
            self._retested[tier] = now - self._wait[tier]
            return int(sound.sum())
        if len(again):
            self._wait_longer(tier)
        self._say(tier, len(again))
        return int(sound.sum())

    def _wait_longer(self, tier: Tier) -> None:
        """After a re-test in which a slot failed again (or the disk): the next waits twice as long."""
        self._wait[tier] = min(2 * self._wait[tier], self.RETEST_EVERY_S)

    def _say(self, tier: Tier, failed: int) -> None:
        """The end of a re-test, or of a run of them (`_run`), at info, with the slots of the run
        that failed again (`failed`, those of its last re-test, is kept for the callers)."""
        run = self._run.pop(tier)
        alloc = self.table.allocators[tier]
        log.info("re-test of %d %s slots set aside after failed writes or reads%s: %d wrote and read back their pattern and are "
                 "given back (%d bytes); %d failed again and stay set aside; %d bytes (%.2f%% of %s) set aside now",
                 run.tested, tier.label, "" if run.rounds == 1 else f", in {run.rounds} rounds", run.passed,
                 run.given_bytes, run.tested - run.passed,
                 alloc.quarantined_bytes, 100 * alloc.quarantined_bytes / alloc.arena_bytes, tier.label)

    def retests_pending(self) -> bool:
        """Whether a re-test's I/O is still running (its verdict waits for a later step)."""
        return any(not job.done.is_set() for job in self._jobs.values())


@dataclasses.dataclass
class _Run:
    """Re-tests in a row that each gave back a slot (the last may have given back none): how many, the
    slots they tested, those that passed, and the bytes given back."""
    lap: int = 0  # slots set aside when the run began: it follows up at most this many
    rounds: int = 0
    tested: int = 0
    passed: int = 0
    given_bytes: int = 0


class _RetestJob:
    """One re-test's I/O on a thread of its own: `sound` (per slot) or `error` once `done` is set."""

    def __init__(self, arena: StorageArena, offsets: np.ndarray, sizes: np.ndarray):
        self.offsets = offsets
        self.sound = np.zeros(len(offsets), dtype=bool)
        self.error: ArenaError | None = None
        self.done = threading.Event()
        self._arena, self._sizes = arena, sizes
        threads.start(threading.Thread(target=self._run, name="dflash2-retest", daemon=True))  # (threads.py)

    def _run(self) -> None:
        arena, offsets = self._arena, self.offsets
        try:
            patterns = [_pattern(o, n) for o, n in zip(offsets.tolist(), self._sizes.tolist())]
            # Not through write_blocks/read_blocks: those hold the arena's lock for the whole batch,
            # and the serving thread (forget) and the transfer thread wait on that lock (soak9).
            self.sound = np.asarray(arena.test_slots(offsets, patterns), dtype=bool)
        except ArenaError as e:
            self.error = e
        except Exception as e:  # anything else: nothing given back, said here and by the step
            log.exception("a re-test of slots set aside failed")
            self.error = ArenaError(f"re-test failed: {e!r}")
        finally:
            self.done.set()


def _pattern(offset: int, nbytes: int) -> np.ndarray:
    """A re-test's bytes for the slot at `offset`: neither zeros nor the same for every slot."""
    return ((np.arange(nbytes, dtype=np.int64) * 131 + offset // 512 + 7) % 251).astype(np.uint8)
