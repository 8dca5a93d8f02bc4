"""Storage tiers whose writes fail: the back-off, and making room above them meanwhile. A part of
Placement (a mixin over its tiers, stats and room-making), apart because what a full or failing disk
changes is a job of its own.

A storage tier whose writes failed (a full or failing disk: ENOSPC, EIO) takes no blocks for
WRITE_BACKOFF_S, doubled after each failure that follows the last (up to WRITE_BACKOFF_MAX_S) and
ended by a write that works. Meanwhile the tier above it is the last (`Placement.lower`): what leaves
it is dropped. Before, every room-making retried the writes (a failed batch a few milliseconds),
HBM and DRAM refused every allocation (their demotion victims, parents of blocks below, may not be
dropped), and the log took a traceback a batch.

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

    def _init_backoff(self) -> None:
        # Storage tiers whose writes failed: tier -> (monotonic time until which it takes no blocks,
        # the back-off's length). Cleared by a write that works there.
        self.write_backoff: dict[Tier, tuple[float, float]] = {}
        self.monotonic: Callable[[], float] = time.monotonic  # the back-off's clock (tests set it)

    def writable(self, tier: Tier) -> bool:
        """Whether blocks may go down into `tier` now (not backing off after failed writes)."""
        off = self.write_backoff.get(tier)
        return off is None or self.monotonic() >= off[0]

    def _backing_off_below(self, tier: Tier) -> bool:
        return any(t > tier and not self.writable(t) for t in self.tiers)

    def _note_writes(self, tier: Tier, failed: int, moved: int) -> None:
        """After a move down into `tier`: NVMe writes that all failed start (or lengthen) its
        back-off (`lower`); one that worked ends it."""
        if tier != Tier.NVME:
            return  # memory tiers' copies do not fail for want of room (a lost GPU is fatal: fatal())
        if failed and not moved:
            _, period = self.write_backoff.get(tier, (0.0, 0.0))
            period = self.WRITE_BACKOFF_S if not period else min(2 * period, self.WRITE_BACKOFF_MAX_S)
            self.write_backoff[tier] = (self.monotonic() + period, period)
            self.stats.write_backoffs += 1
            log.warning("writes to %s failed (%d blocks; the transfer log names the error): %s takes no blocks "
                        "for %g s, and blocks that would go down there are dropped instead, a miss when asked "
                        "for again (a full or failing disk under memory.nvme_path?)",
                        tier.label, failed, tier.label, period)
        elif moved and tier in self.write_backoff:
            del self.write_backoff[tier]
            log.info("writes to %s work again: it takes blocks again", tier.label)

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
