"""Blocks whose stored bytes failed their checksum (a corrupt NVMe read): `drop_lost` makes sure they
are never found again. A part of BlockTable (a mixin over its columns, key index and lost set), apart
because cutting a block out of the prefix tree, with its children, is a job of its own."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash2.counts import unique
from dflash2.table.columns import NO_ROW
from dflash2.table.states import BlockState

S = BlockState
NO_KIDS = np.empty(0, dtype=np.int64)  # read only: a row with no children to cut


class LostBlocks:
    """BlockTable's drop_lost and is_lost (the attributes they use are BlockTable's)."""

    def is_lost(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` are kept only for their holders after their read failed (`lost`)."""
        if not self.lost:
            return np.zeros(len(rows), dtype=bool)
        return np.isin(rows, np.fromiter(self.lost, dtype=np.int64, count=len(self.lost)))

    def drop_lost(self, rows: np.ndarray, leaving: Callable[[np.ndarray, bool], None] | None = None,
                  lost_too: np.ndarray | None = None) -> None:
        """These blocks' stored bytes failed their checksum: they must never be found again. Each is
        unpublished and cut out of the prefix tree; its cached children become roots nobody can
        reach by lookup: the childless ones nobody holds are evicted now, the others go through the
        policy like any cold block. One still referenced stays until its last reference.
        `leaving(rows, orphans)`: told of each group of rows before it leaves the cache, keys still
        set (the policy's `on_remove`: before, its lists went on counting them); `orphans` for the
        children dropped with a lost parent. `lost_too`: every row of this loss, of which `rows` may be
        a part (a lost file's blocks, dropped a part a step): a child among them is not dropped as an
        orphan here, but as lost, in its own part (`rows` itself by default).
        The children are found in one pass over the parent column for the whole call
        (`_children_of`), not one per lost block: a failed NVMe batch is up to a swap batch of
        blocks, and a pass per block held the loop for about half a second for 1,024 of them at a
        million blocks (476 us a block in the scale audit)."""
        rows = np.asarray(rows, dtype=np.int64)
        lost_too = rows if lost_too is None else lost_too
        also = None  # (a mask over the rows: a set test per child, never a sort of them all per block)
        if len(lost_too) > 1:
            also = np.zeros(len(self.cols.state), dtype=bool)
            also[lost_too] = True
        self._drop_lost(rows, leaving, False, also)

    def _drop_lost(self, rows: np.ndarray, leaving, orphans: bool, also: np.ndarray | None) -> None:
        c = self.cols
        if leaving is not None and len(rows):
            # (Not one found lost before and kept for its references: it left the cache then.)
            live = unique(rows[(c.state[rows] != int(S.FREE)) & ~self.is_lost(rows)])
            if len(live):
                leaving(live, orphans)
        children = self._children_of(rows)
        for r in rows.tolist():
            if c.state[r] == S.FREE:
                continue
            self.lost.add(r)
            if c.key[r]:
                self.keys.remove(int(c.key[r]))
                c.key[r] = 0
            p = int(c.parent[r])
            if p != NO_ROW:
                c.kids[c.tier[r], p] -= 1
                c.nkids[p] -= 1
                c.parent[r] = NO_ROW
            kids = children.get(r, NO_KIDS)
            # Still its children: one dropped earlier in this loop was cut from it (parent NO_ROW).
            kids = kids[(c.parent[kids] == r) & (c.state[kids] != int(S.FREE))]
            c.parent[kids] = NO_ROW
            c.kids[:, r] = 0
            c.nkids[r] = 0
            if c.refs[r] == 0 and c.pins[r] == 0:
                self.lost.discard(r)
                self._release_rows(np.array([r], dtype=np.int64))
            if len(kids) and also is not None:  # (a child lost too, in this call or a later one of the same
                kids = kids[~also[kids]]  # loss, `lost_too`, is dropped as lost, not orphaned)
            dropped = kids[self.evictable(kids)] if len(kids) else kids
            if len(dropped):
                self._drop_lost(dropped, leaving, True, also)

    def _children_of(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """The live children of each of `rows` that has any, in row order, from one pass over the
        parent column. Invariant (check_invariants): nkids[p] counts every live row linked to p,
        so a row with nkids 0 has none and a call whose rows have none makes no pass at all."""
        c = self.cols
        parents = rows[c.nkids[rows] > 0]
        if not len(parents):
            return {}
        wanted = np.zeros(c.capacity, dtype=bool)
        wanted[parents] = True
        linked = c.parent != NO_ROW
        kids = np.flatnonzero(linked & wanted[np.where(linked, c.parent, 0)] & (c.state != int(S.FREE)))
        of = c.parent[kids]
        order = np.argsort(of, kind="stable")  # grouped by parent, each group in row order
        kids, of = kids[order], of[order]
        starts = np.flatnonzero(np.r_[True, of[1:] != of[:-1]])
        return dict(zip(of[starts].tolist(), np.split(kids, starts[1:])))
