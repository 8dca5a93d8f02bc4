"""Per-row arrays that grow without a copy: each over memory reserved up front, untouched until used.

The block table's columns (and heat's per-row state) were numpy arrays of the table's capacity,
which doubles when a call needs more rows than are free: that call copied every array into one
twice as large, and faulted the new memory in there. The daemon's loop stood still meanwhile: on the
2-core development VM 63–270 ms at 1M → 2M rows and 445–528 ms at 2M → 4M (in process, the
allocation that doubled the table, heat; 2026-12-04), growing with the table, once per doubling
while a cache fills.

Here each array lies in a private anonymous mapping of its own, reserved for as many rows as the
table may come to hold (`RowArrays`, `reserve_rows`). The kernel gives such a mapping memory one page
at a time, the first time a page is written (zeros until then), so a reservation takes address space
but no memory; growing is taking a longer view of the same memory, with the new rows set to their
fill value (the only pages touched). Views taken before such a growth stay valid: they are
shorter views of the same memory, never of a copy left behind.

A table that outgrows its reservation (blocks smaller than `reserve_rows` assumed, or a mapping the
system refused: a strict overcommit policy, an address-space limit) copies its arrays into a
reservation four times as large, once, and says so in the log.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Iterable

import numpy as np

log = logging.getLogger("dflash2.table")

# The reservation assumes blocks of at least this many bytes in the tiers' arenas. Smaller ones
# outgrow it, and then cost one logged copy (above).
RESERVE_BLOCK_BYTES = 1024
# Bounds on a reservation, in rows. Below the floor the copies are cheap, and the tests' tables of a
# few hundred rows still grow in place. The ceiling keeps each mapping under a few GiB (2**28 rows:
# blocks of 16 KiB fill 4 TiB at that count); rows are int32 in the table (parent, free list).
RESERVE_MIN_ROWS = 1 << 16
RESERVE_MAX_ROWS = 1 << 28
ROW_LIMIT = 1 << 31  # (int32 row numbers)
HUGE_PAGES_FROM = 4 << 20  # mappings this large ask for transparent huge pages (numpy's threshold too)


def reserve_rows(arena_bytes: Iterable[int], capacity: int) -> int:
    """Rows to reserve for a table over arenas of these sizes: one per RESERVE_BLOCK_BYTES of them
    all, at least `capacity`, within [RESERVE_MIN_ROWS, RESERVE_MAX_ROWS] otherwise."""
    rows = sum(int(b) for b in arena_bytes) // RESERVE_BLOCK_BYTES
    return max(int(capacity), min(RESERVE_MAX_ROWS, max(RESERVE_MIN_ROWS, rows)))


def reserve(dtype, rows: int, lead: tuple[int, ...] = (), huge: bool = True) -> np.ndarray:
    """A zeroed array of shape `lead + (rows,)` over a private anonymous mapping of its own, whose
    pages take memory only once written. OSError when the system refuses the mapping. `huge` False:
    4 KiB pages only (writes at random over a fresh array then fault a page each, not a 2 MiB huge
    page each, which the kernel may compact memory for)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(lead, dtype=np.int64)) * rows
    nbytes = max(1, count * dtype.itemsize)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge and nbytes >= HUGE_PAGES_FROM and hasattr(mmap, "MADV_HUGEPAGE"):
        # As numpy asks for its own large arrays: calls index rows at random across a dozen
        # columns, and huge pages keep those reads out of page walks.
        buf.madvise(mmap.MADV_HUGEPAGE)
    elif not huge and hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)  # (where transparent huge pages are on for every mapping)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(lead + (rows,))


def reserve_or_plain(dtype, rows: int, plain_rows: int, what: str, unit: str, huge: bool = True,
                     after: str = "") -> np.ndarray:
    """`reserve` one array of `rows`; where the system refuses the mapping (a strict overcommit
    policy, an address-space limit), plain numpy zeros of the `plain_rows` in use, said in the log
    (`what` names the owner, `unit` the rows, `after` what the fallback costs)."""
    try:
        return reserve(dtype, rows, huge=huge)
    except OSError as exc:
        log.warning("%s: the system refused a reservation of %d %s (%s); taking plain memory for the %d in use%s",
                    what, rows, unit, exc, plain_rows, after)
        return np.zeros(plain_rows, dtype=dtype)


def is_mapped(array: np.ndarray) -> bool:
    """Whether `array` is a view of a reservation (`reserve`): memory that tracemalloc does not see."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)  # (frombuffer's base)


class RowArrays:
    """Named per-row arrays of one owner, grown together: `views()` are their first `capacity` rows.

    `fields`: name -> (dtype, fill value of a fresh row, leading shape: () for one value a row,
    (n,) for n, as the table's `kids[tier, row]`)."""

    def __init__(self, fields: dict[str, tuple[object, object, tuple[int, ...]]], capacity: int, rows: int,
                 owner: str):
        if rows < capacity:
            raise ValueError(f"{owner}: a reservation of {rows} rows is below the capacity of {capacity}")
        self.fields = {name: (np.dtype(dtype), fill, tuple(lead)) for name, (dtype, fill, lead) in fields.items()}
        self.owner = owner  # names the arrays in the log: "the block table's columns"
        self.capacity = 0
        self.reserved = 0
        self._bases: dict[str, np.ndarray] = {}
        self._mapped = True  # the bases lie in reservations (False: plain arrays, a refused mapping's)
        self._reserve(rows, need=capacity, keep=0)
        self._fill(0, capacity)
        self.capacity = capacity

    def views(self) -> dict[str, np.ndarray]:
        """Each array's first `capacity` rows (along its last axis)."""
        return {name: base[..., : self.capacity] for name, base in self._bases.items()}

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the first `capacity` rows of every array that lies in a reservation (not the
        plain arrays of a refused one): the memory in use, which tracemalloc does not see."""
        return sum(base[..., : self.capacity].nbytes for base in self._bases.values()) if self._mapped else 0

    def flat(self, name: str) -> np.ndarray:
        """The whole reservation of `name` as one contiguous 1-D array: with a leading shape, row
        r of lead index i is cell i * `reserved` + r (the views are not contiguous as a whole, and
        reshaping one copies: an add into the copy is lost). Valid until the next `grow`."""
        return self._bases[name].reshape(-1)

    def grow(self, capacity: int) -> None:
        """Take `capacity` rows (more than now): fresh rows hold their fill values, the others keep
        theirs. Past the reservation, the arrays are copied into one four times `capacity` (logged)."""
        old = self.capacity
        if capacity <= old:
            raise ValueError(f"{self.owner}: growing from {old} rows to {capacity}")
        if capacity > self.reserved:
            started = time.perf_counter()
            before = self.reserved
            self._reserve(max(capacity, min(4 * capacity, ROW_LIMIT)), need=capacity, keep=old)
            log.info("%s outgrew their reservation of %d rows (blocks smaller than %d bytes, or a smaller "
                     "reservation the system allowed): copied %d rows into a reservation of %d in %.1f ms",
                     self.owner, before, RESERVE_BLOCK_BYTES, old, self.reserved,
                     (time.perf_counter() - started) * 1e3)
        self._fill(old, capacity)
        self.capacity = capacity

    def _reserve(self, rows: int, need: int, keep: int) -> None:
        """New bases of `rows` rows, holding the first `keep` rows of the old ones. A mapping the
        system refuses falls back to plain arrays of the `need` rows wanted now: each later growth
        copies them again (said in the log)."""
        try:
            bases = {name: reserve(dtype, rows, lead) for name, (dtype, _, lead) in self.fields.items()}
            self._mapped = True
        except OSError as exc:
            log.warning("%s: the system refused a reservation of %d rows (%s); taking %d rows, so that the "
                        "arrays are copied each time the table grows", self.owner, rows, exc, need)
            rows = need
            self._mapped = False
            bases = {name: np.zeros(lead + (rows,), dtype=dtype) for name, (dtype, _, lead) in self.fields.items()}
        for name, base in bases.items():
            if keep:
                base[..., :keep] = self._bases[name][..., :keep]
        self._bases = bases
        self.reserved = rows

    def _fill(self, start: int, stop: int) -> None:
        for name, (_, fill, _) in self.fields.items():
            if fill != 0:  # (the reservation's pages are zero until written: left untouched)
                self._bases[name][..., start:stop] = fill
