"""The blocks that calls have left able to leave HBM for the head of the admission queue.

Room was made for the head and fell short; a commit or a release that leaves enough blocks of its
size able to leave HBM sets off another try in that call (`Admission.became_movable`), not at the
next background step. A block leaves HBM only after its children there (prefix order), so what
counts is not every block let go of, but those that can leave now: the childless ones, and up each
chain the parents whose children in HBM can all leave. Counted one call at a time, a reader that
let go of a chain from its root, one block a call, had each block counted though its leaf was
still held: tries fell short, each doubled what the next waited for, and when the leaf's release
left the whole chain free it counted one block, and the head waited for the step (a review's
script). So the blocks let go of since the last try are kept (`rows`), checked again at each call
(a block may have been pinned, moved or freed since), and counted up from the leaves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash2.table import BlockState, BlockTable
from dflash2.tiers import Tier

_EMPTY = np.zeros(0, dtype=np.int64)


class Loosened:
    def __init__(self, table: BlockTable):
        self.table = table
        self.rows = _EMPTY  # sorted: let go of since the last try (some may not leave yet)

    def clear(self) -> None:
        """A try made room (or a new head came): count from nothing again."""
        self.rows = _EMPTY

    def count(self, rows: np.ndarray, may_leave: Callable[[np.ndarray], np.ndarray], block_bytes: int,
              want: int) -> int:
        """Add `rows` (a call has just let go of them), then count the blocks of `block_bytes` among
        all kept that can leave HBM now, stopping once `want` are found. `may_leave`: mask over rows
        resident in HBM and unpinned, those the head may move (idle, or preemptible)."""
        c = self.table.cols
        hbm = int(Tier.HBM)
        rows = np.union1d(self.rows, rows)
        rows = rows[(c.tier[rows] == hbm) & (c.state[rows] == int(BlockState.RESIDENT)) & (c.pins[rows] == 0)]
        rows = rows[may_leave(rows)]
        self.rows = rows
        if not len(rows):
            return 0
        sized = self.table.block_bytes(rows) == block_bytes
        kids = c.kids[hbm, rows]
        freed = np.zeros(len(rows), dtype=kids.dtype)  # children of each kept row found free
        level = np.flatnonzero(kids == 0)
        found = int(np.count_nonzero(sized[level]))
        # Up from the leaves, a level at a time: a parent joins once its last child in HBM has.
        while len(level) and found < want:
            parents = c.parent[rows[level]]
            at = np.searchsorted(rows, parents)
            kept = (parents >= 0) & (at < len(rows))
            kept[kept] = rows[at[kept]] == parents[kept]
            at = at[kept]
            np.add.at(freed, at, 1)
            at = np.unique(at)
            level = at[freed[at] == kids[at]]
            found += int(np.count_nonzero(sized[level]))
        return found
