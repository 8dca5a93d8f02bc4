"""Prefetch: promote the blocks a request will read next before it asks for them.

While a request reads its cached prefix, the prefetcher keeps `kv_block.prefetch_window` blocks
beyond the read position on their way up to HBM, so the next read is served from HBM without
waiting for a swap-in. The window doubles (up to `max_factor` × the configured value) each time it
is used while HBM is filled below its low watermark, and falls back to the configured value as soon
as HBM is above its high watermark: prefetching into a full tier only pushes out blocks that other
requests are about to read.

Accounting: a prefetched block is *useful* when it is read while still in HBM, *wasted* when it left
HBM (demoted, evicted) before its read or was never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash2.table import BlockState
from dflash2.table.table import ROW_MASK
from dflash2.tiers import Tier


class Prefetcher:
    def __init__(self, manager, window: int, *, max_factor: int = 16):
        if window < 0:
            raise ValueError(f"prefetch window must be >= 0, got {window}")
        self.manager = manager
        self.base = window
        self.window = window
        self.max_window = window * max_factor
        self.useful = 0
        self.wasted = 0
        self._pending: set[int] = set()  # vids promoted by the prefetcher, not yet read

    # -- window ----------------------------------------------------------------------------
    def _adapt(self) -> int:
        """The window for this step, from HBM's fill against its watermarks."""
        placement = self.manager.placement
        used = placement.used_fraction(Tier.HBM)
        wm = placement.watermarks[Tier.HBM]
        if used >= wm.high:
            self.window = self.base
        elif used < wm.low:
            self.window = min(self.max_window, max(self.base, 2 * self.window))
        return self.window

    # -- the request's read loop -----------------------------------------------------------
    def ahead(self, vids: Sequence[int], position: int) -> int:
        """The request will read vids[position:] next: bring the window's blocks up to HBM.
        Returns the number of blocks promoted."""
        if not self.base or position >= len(vids):
            return 0
        window = list(vids[position: position + self._adapt()])
        rows, live = self._rows(window)
        table = self.manager.table
        c = table.cols
        rows = rows[live]
        want = rows[(c.tier[rows] > int(Tier.HBM)) & (c.pins[rows] == 0)
                    & (c.state[rows] == int(BlockState.RESIDENT))]
        if not len(want):
            return 0
        ok = self.manager.placement.promote(want, Tier.HBM)
        done = table.vids(want[ok]).tolist()
        self._pending.update(done)
        return len(done)

    def reading(self, vids: Sequence[int]) -> None:
        """The request is about to read these blocks: settle the prefetches among them."""
        mine = [v for v in vids if v in self._pending]
        if not mine:
            return
        rows, live = self._rows(mine)
        in_hbm = live & (self.manager.table.cols.tier[rows] == int(Tier.HBM))
        self.useful += int(in_hbm.sum())
        self.wasted += len(mine) - int(in_hbm.sum())
        self._pending.difference_update(mine)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def settle(self) -> None:
        """Between reads (the daemon's tick): a prefetched block that left HBM unread was wasted."""
        if not self._pending:
            return
        mine = list(self._pending)
        rows, live = self._rows(mine)
        gone = ~(live & (self.manager.table.cols.tier[rows] == int(Tier.HBM)))
        self.wasted += int(gone.sum())
        self._pending.difference_update(v for v, g in zip(mine, gone.tolist()) if g)

    def finish(self) -> None:
        """The request is done reading: whatever it did not read was prefetched for nothing."""
        self.wasted += len(self._pending)
        self._pending.clear()

    def _rows(self, vids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the vids and a mask of those still live (an evicted block's vid is stale)."""
        v = np.asarray(vids, dtype=np.int64)
        rows = v & ROW_MASK
        c = self.manager.table.cols
        live = (rows < c.capacity)
        live[live] = (c.gen[rows[live]] == ((v[live] >> 32) & ROW_MASK)) & (c.state[rows[live]] != int(BlockState.FREE))
        return np.where(live, rows, 0), live
