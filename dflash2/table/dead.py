"""Rows dead to new holders though not free yet: a private block whose last reference went mid-move
(freed when the move ends: a new reference or pin would outlive its row and later stand for the row's
next block), a block whose bytes failed their checksum (kept only for the references held before: a
pin taken now would not stop its last reference from freeing it), and a pinned copy (kept for its
pins: a commit deduplicated it, or gave it up unrun). A part of BlockTable (a mixin over its sets)."""

from __future__ import annotations

import numpy as np

from dflash2.errors import UnknownBlock


class DeadRows:
    _free_after_move: set[int]
    lost: set[int]
    pinned_copies: dict[int, int]

    def refuse_dead(self, rows: np.ndarray) -> None:
        """UnknownBlock naming the first of `rows` dead to new holders, and why (for a pinned copy of
        a deduplicated commit, the id to use instead)."""
        if not (self._free_after_move or self.lost or self.pinned_copies):
            return
        gone = self._dead_rows(rows)
        if len(gone):
            row = int(gone[0])
            twin = self.pinned_copies.get(row)
            why = ("freed while in flight, or its bytes failed their checksum or were lost with the NVMe file cut "
                   "short or removed (the daemon's log says which): look the chain up again" if twin is None else
                   "its commit was given up, and not run" if not twin else
                   f"it was committed under a key already cached: use the id commit returned for it, {twin:#x}")
            why += "" if twin is None else "; it is kept only until the pins on it are released"
            raise UnknownBlock(f"block {int(self.vids(np.array([row]))[0]):#x} is not live ({why})")

    def _dead_rows(self, rows: np.ndarray) -> np.ndarray:
        """The rows among `rows` that are dead to new holders, in O(min(len(rows), dead)) set
        operations: a call of a few blocks must not pay for every pinned copy kept meanwhile."""
        sets = (self._free_after_move, self.lost, self.pinned_copies)
        if len(rows) <= sum(len(d) for d in sets):
            return np.array([r for r in rows.tolist() if any(r in d for d in sets)], dtype=np.int64)
        return rows[np.isin(rows, np.fromiter(set().union(*sets), dtype=np.int64))]
