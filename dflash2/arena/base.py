"""The tier-arena interface: one large region per tier, addressed by (offset, nbytes).

The block table never touches bytes; it hands (offset, nbytes) extents that its slot allocator chose
to an arena. Two kinds exist:

- a `MemoryArena` is byte-addressable memory that a process can map (host shared memory, pinned
  DRAM, later HBM): `view()` returns a zero-copy view;
- a `StorageArena` is a preallocated file (NVMe): blocks are written and read in batches through a
  staging buffer, each with a checksum; a block whose checksum fails reads as a miss.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Sequence

import numpy as np

from dflash2.errors import ArenaError
from dflash2.tiers import Tier


class Arena(abc.ABC):
    tier: Tier
    capacity_bytes: int
    # Every slot offset and slot size handed to this arena is a multiple of this.
    alignment: int

    @abc.abstractmethod
    def close(self) -> None:
        """Release the region (unlink shared memory, close the file). Idempotent."""

    def describe(self) -> dict:
        """What a client or the status command needs to know about this arena."""
        return {"tier": self.tier.label, "capacity_bytes": self.capacity_bytes, "alignment": self.alignment}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryArena(Arena):
    @abc.abstractmethod
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of [offset, offset + nbytes): no copy. Raises ArenaError out of range."""

    def _slice(self, whole, offset: int, nbytes: int, what: str):
        """[offset, offset + nbytes) of `whole` (the mapped arena), checked: the one bounds rule of
        every memory arena's `view`."""
        offset, nbytes = operator.index(offset), operator.index(nbytes)
        if whole is None:
            raise ArenaError(f"{what} is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity_bytes:
            raise ArenaError(f"view [{offset}, {offset + nbytes}) is outside {what} of {self.capacity_bytes} bytes")
        return whole[offset:offset + nbytes]


class StorageArena(Arena):
    @abc.abstractmethod
    def write_blocks(self, offsets: Sequence[int], sources: Sequence[memoryview | np.ndarray]) -> np.ndarray:
        """Write each source buffer at its offset (one batch, through the staging buffer) and record
        its checksum. Returns a bool array: False where the block's slot could not be written by
        itself (an I/O error there, EIO: a bad region; the slot is not to be used again), True where
        the block is written. Raises ArenaError on any other error (a full disk: ENOSPC); then no
        block of the batch counts as written, and no slot is to blame."""

    @abc.abstractmethod
    def read_blocks(self, offsets: Sequence[int], dests: Sequence[memoryview | np.ndarray]) -> np.ndarray:
        """Read each block into its destination buffer (same length as written). Returns a bool array:
        False where the checksum did not match (or the block was never written) — a miss, never wrong
        data: the caller must not use that destination's bytes."""

    @abc.abstractmethod
    def forget(self, offsets: Sequence[int]) -> None:
        """The blocks at these offsets are freed: drop their checksums."""

    def lost_to_cut(self, offsets: Sequence[int]) -> np.ndarray:
        """Whether each of these blocks was lost with its file cut short by another process: a miss
        that blames neither its slot nor the disk (NvmeArena; none here)."""
        return np.zeros(len(offsets), dtype=bool)

    @property
    def no_file(self) -> str:
        """Why the tier has no file now (removed and none can be made: NvmeArena), else ""."""
        return ""

    @property
    def forgets(self) -> int:
        """How many times blocks were lost with the tier's file (cut short, removed: NvmeArena), the
        background step dropping them from the cache after each (`BlockManager._drop_forgotten`)."""
        return 0

    def check_file(self) -> None:
        """(The background step) whether the tier's file is still the one its path names; one removed
        or replaced is made again (NvmeArena; nothing here)."""

    @abc.abstractmethod
    def test_slots(self, offsets: Sequence[int], patterns: Sequence[np.ndarray]) -> np.ndarray:
        """(The re-test of slots set aside, quarantine.py, on a thread of its own; nobody else uses
        these slots.) Write each pattern at its offset and read it back, without making the tier's
        other callers wait: whether each slot held it (False where its own I/O failed: EIO). A
        failure for the disk as a whole (a full disk) raises ArenaError. Records no checksum: a
        pattern is never read as a block."""
