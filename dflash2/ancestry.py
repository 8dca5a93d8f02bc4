"""A block's cached ancestors, ancestors first: the list a promotion brings up and protects
(`Promotion.with_ancestors`). Apart from Promotion because it keeps the chains it walked.

The walk up a chain is a Python step a block (the parent column is a pointer chase, which numpy
cannot run as one call). A reader that reads a long chain in pieces, each not listed from the root
(sglang's backend acquires 64 pages a call), paid the chain's depth on every piece: 6.4 ms an
acquire of 64 blocks under a prefix 32,768 deep, 2.3 ms under 8,192 (in process, the 2-core VM).
So the paths walked from a root are kept (`ChainMemo`), each under its last row, and a piece that
hangs as one path under a kept one is listed from it after a vectorised check of every link on it;
the prefix above a walked piece is kept on its own too, for other requests' pieces under it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from dflash2.forest import local_parents, ranked
from dflash2.table import BlockTable
from dflash2.table.columns import NO_ROW


class ChainMemo:
    """Paths from a root down to a row (ancestors first), each kept under its last row, the ones
    used last kept longest. A kept path is never trusted as it was: `path_to` checks each of its
    links against the table's parent column as it is now, so a block dropped, a row reused or a
    link cut since (a lost parent) makes it a miss, never a wrong list."""

    # At most this many rows kept in all paths together (8 MiB of int64), and at most this many
    # paths: a reader's pieces each keep the path down to their last row.
    KEEP_ROWS = 1 << 20
    KEEP_PATHS = 256

    def __init__(self) -> None:
        self._paths: OrderedDict[int, np.ndarray] = OrderedDict()
        self._rows = 0  # rows in all kept paths (invariant: the sum of their lengths)

    def __len__(self) -> int:
        return len(self._paths)

    def path_to(self, row: int, parent: np.ndarray) -> np.ndarray | None:
        """The kept path from a root down to `row`, if each of its links still holds in `parent`
        (the table's parent column); None otherwise (a stale one is let go)."""
        path = self._paths.get(row)
        if path is None:
            return None
        if path[-1] != row or parent[path[0]] != NO_ROW or not is_path(path, parent):
            self._forget(row)
            return None
        self._paths.move_to_end(row)
        return path

    def keep(self, path: np.ndarray) -> None:
        """Keep `path` (a root's path down to its last row) under its last row."""
        if len(path) > self.KEEP_ROWS // 4:
            return  # (one path would crowd out the others: walked again, once per acquire)
        last = int(path[-1])
        if last in self._paths:
            if np.array_equal(self._paths[last], path):
                self._paths.move_to_end(last)
                return  # (kept already: a prefix read from its root again)
            self._forget(last)
        self._paths[last] = np.array(path, dtype=np.int64)  # (its own copy: the caller's may change)
        self._rows += len(path)
        while self._rows > self.KEEP_ROWS or len(self._paths) > self.KEEP_PATHS:
            self._forget(next(iter(self._paths)))

    def _forget(self, row: int) -> None:
        self._rows -= len(self._paths.pop(row))


def is_path(rows: np.ndarray, parent: np.ndarray) -> bool:
    """Whether each of `rows` after the first is the child of the one before it."""
    return bool((parent[rows[1:]] == rows[:-1]).all())


class Ancestry:
    """The rows a promotion of some rows lists: they and all their cached ancestors, ancestors
    first, in the order a walk from each row up to the root gives (`walk`), found through the
    paths walked before where the rows hang under one (`ChainMemo`)."""

    def __init__(self, table: BlockTable):
        self.table = table
        self.memo = ChainMemo()

    def with_ancestors(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        parent = self.table.cols.parent
        if not len(rows) or rows.min() < 0 or not is_path(rows, parent):
            # (Only a piece in chain order can hang under a kept path; no row is negative, and
            # the walk reads none as a row, as before this memo.)
            return rows if closed_upward(rows, parent) else walk(rows, parent)
        top = int(parent[rows[0]])
        if top == NO_ROW:  # a request's prefix as it reads it, from the root: its own list
            self.memo.keep(rows)  # (a reader's first piece)
            return rows
        kept = self.memo.path_to(int(rows[-1]), parent)  # (the same piece again: a call run again)
        if kept is not None and len(kept) > len(rows) and (kept[len(kept) - len(rows):] == rows).all():
            return kept.copy()
        above = self.memo.path_to(top, parent)
        if above is None:
            out = walk(rows, parent)
            # The prefix above the piece too: the next piece of another request that shares it (a
            # system prompt's chain, each request's own blocks under it) is listed from it.
            self.memo.keep(out[:len(out) - len(rows)])
        else:  # (rows distinct: a path in a forest repeats no row)
            out = np.concatenate([above, rows])
        self.memo.keep(out)
        return out


def closed_upward(rows: np.ndarray, parent: np.ndarray) -> bool:
    """Whether `rows` (distinct) already hold each one's parent, ahead of it: then they are their
    own list with ancestors, in the order `walk` would give, found without a Python step per
    block."""
    rank = ranked(rows)
    if (rank[1][1:] == rank[1][:-1]).any():
        return False  # listed twice: the walk lists it once
    up = parent[rows]
    local = local_parents(rows, up)
    linked = up != NO_ROW
    if (local[linked] < 0).any():
        return False  # an ancestor outside the list: the walk adds it
    return bool((local[linked] < np.flatnonzero(linked)).all())  # each parent ahead of its child


def walk(rows: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Each of `rows` and its ancestors up to the root, each listed once, a row's ancestors ahead of
    it, the rows' own order kept otherwise: a Python step per block."""
    seen: dict[int, None] = {}
    up = parent.item  # (a Python int a step: int(parent[p]) took 3x as long, 12 ms at depth 32,768)
    for r in rows.tolist():
        path = []
        p = r
        while p >= 0 and p not in seen:
            path.append(p)
            p = up(p)
        for q in reversed(path):
            seen[q] = None
    return np.fromiter(seen, dtype=np.int64, count=len(seen))
