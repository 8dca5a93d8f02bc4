"""The block table's storage: one numpy array per field (struct of arrays), indexed by row.

About 82 bytes a row of capacity all told (which doubles as the table grows: up to twice that a
block just past a power of two), and every policy pass is a handful of vectorised operations over
these arrays instead of a walk over a million Python objects. The arrays lie in memory reserved for
the rows the table may come to hold, so that growing copies nothing (rowspace.py).
"""

from __future__ import annotations

import numpy as np

from dflash2.counts import add_at, repeats
from dflash2.table.rowspace import RowArrays, reserve_rows
from dflash2.tiers import TIERS

NO_ROW = -1
NO_CLIENT = -1
# A row whose generation reaches this is retired, never handed out again: one more reuse would wrap
# the uint32 generation back to 0 and an id from 2**32 reuses ago would name the row's new block.
GEN_LAST = np.iinfo(np.uint32).max
# The first generation is at most 2**30: a row is reused 2**30 times or more before its ids, whose
# generation is their top 32 bits, turn negative (past 2**31), and three times that before it retires.
MAX_FIRST_GEN = 1 << 30

# name -> (dtype, fill value for a fresh row)
FIELDS: dict[str, tuple[np.dtype, object]] = {
    # generation (from Columns.first_gen, at least 1: no virtual id is 0): bumps when a row is reused, so
    # stale virtual ids are caught
    "gen": (np.uint32, 1),
    "state": (np.uint8, 0),  # BlockState
    "tier": (np.int8, -1),
    "layout": (np.uint16, 0),
    "refs": (np.int32, 0),  # references: the owner's, and those added by requests that share it
    "pins": (np.int32, 0),  # pins: a pinned block is never moved or freed
    "owner": (np.int32, NO_CLIENT),  # client of a private block; NO_CLIENT once published
    "request": (np.int64, 0),  # owning request (client-local id)
    "key": (np.uint64, 0),  # content key; 0 = none (private)
    "parent": (np.int32, NO_ROW),  # row of the block holding the previous prefix block
    "nkids": (np.int32, 0),  # cached children in any tier (== kids.sum(axis=0), kept for speed)
    "offset": (np.int64, -1),  # slot offset in the tier's arena
    "last_access": (np.float64, 0.0),
    "hits": (np.float32, 0.0),  # accesses since the block was written
    "priority": (np.int8, 0),  # its writer's, raised while requests of higher priority hold it
    "base_priority": (np.int8, 0),  # its writer's (the higher one if a commit deduplicated it)
}


_RESET = [(name, spec) for name, spec in FIELDS.items() if name != "gen"]


class Columns:
    def __init__(self, capacity: int = 1024, first_gen: int = 1, reserve: int | None = None):
        """`first_gen`: every row's first generation. A daemon draws it at each start (assemble.py):
        from 1 every time, the first blocks of a restarted daemon had the very ids of the killed
        one's, and an id kept across the restart read another block without an error (a review's
        kill loop). `reserve`: rows reserved up front, to grow into without a copy (rowspace.py;
        by default `reserve_rows` of no arenas)."""
        if capacity < 1:  # growth doubles the capacity: from 0 it would never grow
            raise ValueError(f"a block table needs a capacity of at least 1 row, got {capacity}")
        if not 1 <= first_gen <= MAX_FIRST_GEN:
            raise ValueError(f"a block table's first generation is in [1, {MAX_FIRST_GEN}], got {first_gen}")
        self.capacity = capacity
        self.first_gen = first_gen
        # Invariant: a free row's fields mean nothing but its generation, its state (FREE, 0) and its
        # tier (-1: whole-table passes select by tier). `give_rows` sets those three and leaves the
        # rest as they were, and `take_rows` resets the rest; so fresh rows are filled in those three
        # only, the others left at the reservation's zeros (a growth touches no page of theirs).
        fresh = {"gen": first_gen, "state": 0, "tier": -1}
        fields = {name: (dtype, fresh.get(name, 0), ()) for name, (dtype, _) in FIELDS.items()}
        # kids[tier, row]: cached children of the row that lie in each tier (prefix-aware order);
        # tier-major so that "no child in this tier" is one contiguous comparison. A view of the
        # first `capacity` rows of each tier's reserved row: not contiguous as a whole (flatten a
        # tier at a time, never the whole array).
        fields["kids"] = (np.int32, 0, (len(TIERS),))
        fields["_free_rows"] = (np.int32, 0, ())  # a stack of the free rows, the next one on top
        self._arrays = RowArrays(fields, capacity, reserve_rows((), capacity) if reserve is None else reserve,
                                 "the block table's columns")
        self._bind()
        self._free_rows[:] = np.arange(capacity - 1, -1, -1, dtype=np.int32)
        self._n_free = capacity
        self.retired = 0  # rows whose generation ran out (GEN_LAST): neither live nor free

    def _bind(self) -> None:
        """Each column as an attribute (`self.state`, ...), over the first `capacity` rows."""
        for name, view in self._arrays.views().items():
            setattr(self, name, view)
        self._kids_flat = self._arrays.flat("kids")

    def add_kids(self, tiers: np.ndarray, parents: np.ndarray, delta: int) -> None:
        """kids[tiers[i], parents[i]] += delta for each i, a pair given twice counted twice."""
        add_at(self._kids_flat, tiers.astype(np.int64) * self._arrays.reserved + parents, delta)

    @property
    def reserved(self) -> int:
        """Rows the table can grow to without a copy (rowspace.py)."""
        return self._arrays.reserved

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the columns in use that lie in reserved mappings (rowspace.py): unseen by tracemalloc."""
        return self._arrays.mapped_bytes

    @property
    def nbytes(self) -> int:
        total = self.kids.nbytes + self._free_rows.nbytes
        return total + sum(getattr(self, name).nbytes for name in FIELDS)

    @property
    def live(self) -> int:
        return self.capacity - self._n_free - self.retired

    def take_rows(self, n: int) -> np.ndarray:
        while self._n_free < n:
            self._grow()
        self._n_free -= n
        rows = self._free_rows[self._n_free: self._n_free + n][::-1].copy()
        self.reset(rows)
        return rows.astype(np.int64)

    def give_rows(self, rows: np.ndarray) -> None:
        self.gen[rows] += 1
        self.state[rows] = 0
        self.tier[rows] = -1
        spent = self.gen[rows] == GEN_LAST
        if spent.any():  # invariant: a generation never wraps (see GEN_LAST)
            self.retired += int(spent.sum())
            rows = rows[~spent]
        self._free_rows[self._n_free: self._n_free + len(rows)] = rows
        self._n_free += len(rows)

    def reset(self, rows: np.ndarray) -> None:
        if len(rows) <= 4:  # scalar stores beat sixteen fancy-index assignments for a few rows
            for r in rows.tolist():
                for name, (_, fill) in _RESET:
                    getattr(self, name)[r] = fill
                self.kids[:, r] = 0
            return
        for name, (_, fill) in _RESET:
            getattr(self, name)[rows] = fill
        self.kids[:, rows] = 0

    def _grow(self) -> None:
        old = self.capacity
        new = 2 * old
        self._arrays.grow(new)  # the fresh rows hold their fill values; no copy within the reservation
        self._bind()
        free = self._free_rows
        added = np.arange(new - 1, old - 1, -1, dtype=np.int32)
        # New rows go below the existing free ones so that low rows are reused first.
        free[len(added): len(added) + self._n_free] = free[: self._n_free].copy()
        free[: len(added)] = added
        self._n_free += len(added)
        self.capacity = new


def no_repeats(rows: np.ndarray, op: str, vids=None) -> None:
    """A call that changes each listed block once refuses a block listed twice (named by its id with
    `vids`, the table's rows -> vids: a client's commit was told only "the same block", a review)."""
    if repeats(rows):
        if vids is None:
            raise ValueError(f"{op}: the same block is listed twice")
        ordered = np.sort(rows)
        twice = ordered[1:][ordered[1:] == ordered[:-1]][:1]
        raise ValueError(f"{op}: block {int(vids(twice)[0]):#x} is listed twice (each block once a call)")
