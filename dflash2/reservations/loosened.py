"""The blocks that calls have left able to leave HBM for the head of the admission queue.

Room was made for the head and fell short; a commit or a release that leaves enough blocks of its
size able to leave HBM sets off another try in that call (`Admission.became_movable`), not at the
next background step. A block leaves HBM only after its children there (prefix order), so what
counts is not every block let go of, but those that can leave now: the childless ones, and up each
chain the parents whose children in HBM can all leave. Counted one call at a time, a reader that
let go of a chain from its root, one block a call, had each block counted though its leaf was
still held: tries fell short, each doubled what the next waited for, and when the leaf's release
left the whole chain free it counted one block, and the head waited for the step (a review's
script). So a block let go of with children still held waits here (`_waiting`) for them, and a
block found free credits its parent (`_credit`), whichever comes first; a parent already idle before
the try, held back only by its children, is free once they all are.

The work is a few steps per block let go of, once each, until the next try clears it all; a call
stops counting once the head's bar is met (the caller tries then). As before, a block counted is not
checked again: one pinned again since makes a try fall short, and the next try's bar doubles.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash2.table import BlockState, BlockTable
from dflash2.tiers import Tier


class Loosened:
    def __init__(self, table: BlockTable):
        self.table = table
        self.clear()

    def clear(self) -> None:
        """A try made room (or a new head came): count from nothing again."""
        self.found = 0  # blocks of the head's size found able to leave since the last try
        self._free: set[int] = set()
        self._waiting: dict[int, list] = {}  # row -> [its children in HBM not yet free, of the head's size?, parent]
        self._credit: dict[int, int] = {}  # row not let go of yet -> its children found free

    def count(self, rows: np.ndarray, slot: int, want: int,
              may_leave: Callable[[np.ndarray], np.ndarray]) -> int:
        """Add `rows` (a call has just let go of them: resident in HBM, unpinned, movable for the
        head), and answer how many blocks in HBM slots of `slot` bytes (the head's: layouts of other
        block bytes may share them) can leave HBM now among all let go of since
        the last try; counting stops once `want` are found. `may_leave`: that mask over rows resident
        in HBM and unpinned (a parent let go of before the try, held only by its child, counts once
        its children are free)."""
        c = self.table.cols
        kids = c.kids[int(Tier.HBM), rows].tolist()
        parents = c.parent[rows].tolist()
        slots = self.table.slot_sizes(Tier.HBM)
        sized = (slots[c.layout[rows]] == slot).tolist()
        free, waiting, credit = self._free, self._waiting, self._credit
        for r, k, p, s in zip(rows.tolist(), kids, parents, sized):
            if self.found >= want:
                break
            if r in free or r in waiting:
                continue
            k -= credit.pop(r, 0)
            if k > 0:
                waiting[r] = [k, s, p]
                continue
            # Free: so is each parent waiting only on it, up the chain.
            while True:
                free.add(r)
                self.found += s
                if p < 0:
                    break
                up = waiting.get(p)
                if up is None:
                    credit[p] = credit.get(p, 0) + 1
                    if p in free or not self._idle_parent(p, credit[p], may_leave):
                        break
                    del credit[p]
                    r, s, p = p, bool(slots[c.layout[p]] == slot), int(c.parent[p])
                    continue
                up[0] -= 1
                if up[0] > 0:
                    break
                del waiting[p]
                r, s, p = p, up[1], up[2]
        return self.found

    def _idle_parent(self, row: int, free_kids: int, may_leave) -> bool:
        """Whether `row`, not let go of since the last try, can leave HBM once its `free_kids`
        children do: resident there, unpinned, movable for the head, and no other child there."""
        c = self.table.cols
        return (int(c.tier[row]) == int(Tier.HBM) and int(c.state[row]) == int(BlockState.RESIDENT)
                and int(c.pins[row]) == 0 and int(c.kids[int(Tier.HBM), row]) == free_kids
                and bool(may_leave(np.array([row]))[0]))
