"""Storage slots whose writes fail with an I/O error: set aside for the rest of the daemon's life.

A bad region of the disk under NVMe (EIO at some offsets only) fails every write into it. Its slots
went back to the free pool after each failed batch, and the next batch took them again: NVMe backed
off again and again (about a third of it in use in a helper's run with EIO injected through FUSE).
Now the NVMe tier writes a batch that failed with EIO again block by block and names the slots that
failed on their own (`StorageArena.write_blocks`, `CopyJob.unwritable`); the mover hands those here
once their batch is complete, and they leave the allocator's free pool for good
(`SlotAllocator.quarantine`: they come out of the tier's capacity, not into its used bytes). The
slots of a batch that failed as a whole (a full disk: ENOSPC) are not to blame and are used again.

A failure that a slot set aside explains says nothing of the disk as a whole: it starts no back-off
(backoff.py), and the next batch goes elsewhere at once (a bad region is crossed in a few batches,
not in a back-off per batch). Up to a ceiling: once more than FAILING_FRACTION of a tier is set
aside, the disk is taken to be failing (said once, as an error). Its slots that fail are still set
aside, but their failures then start back-offs as a full disk's do, so that a disk that fails every
write (dead, or for a while) does not lose all of its slots within seconds.

Policy here, mechanism in the allocator: a warning with the batch's count and the total so far, once
a minute per tier (RepeatLimit: the batches left out are counted in the next line); a bad region met
by every drain batch logged a warning a batch (241 in 90 s in soak4's EIO run).
"""

from __future__ import annotations

import logging

import numpy as np

from dflash2.table import BlockTable
from dflash2.tiers import Tier
from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.quarantine")


class Quarantine:
    # Past this share of a tier's bytes set aside, the disk is taken to be failing (said once, as an
    # error): a few bad sectors are routine on a large disk, a twentieth of it is not.
    FAILING_FRACTION = 0.05

    def __init__(self, table: BlockTable):
        self.table = table
        self.slots = 0  # set aside so far, every tier (room-making plans again after a batch that set some aside)
        self._said_failing: set[Tier] = set()
        self._said = RepeatLimit("batches")  # the warning, once a minute per tier

    def failing(self, tier: Tier) -> bool:
        """Whether more than FAILING_FRACTION of the tier is set aside: its disk is taken to be failing."""
        alloc = self.table.allocators[tier]
        return alloc.quarantined_bytes > self.FAILING_FRACTION * alloc.arena_bytes

    def set_aside(self, tier: Tier, offsets: np.ndarray, block_bytes: np.ndarray) -> bool:
        """Take these free slots of `tier` (the destination slots of blocks of `block_bytes` whose
        write failed by itself, freed as their move failed) out of use for good, and say so.
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
            log.warning("%d %s slots (%d bytes, the first at offset %d) failed their writes with an I/O error: set "
                        "aside for good, never used again; %d bytes (%.2f%% of %s) set aside so far%s",
                        len(offsets), tier.label, taken, int(offsets[0]), alloc.quarantined_bytes, 100 * share,
                        tier.label, more)
        self.slots += len(offsets)
        if self.failing(tier) and tier not in self._said_failing:
            self._said_failing.add(tier)
            log.error("%.1f%% of %s is set aside after writes failed with I/O errors (more than %g%%): the disk "
                      "under it (memory.nvme_path) is failing; replace it. Its writes that fail from now on "
                      "make it back off as a full disk does", 100 * share, tier.label, 100 * self.FAILING_FRACTION)
        return slots_to_blame
