"""Indices that may repeat: adding to counters at them (the table's per-tier child counts, the slot
allocator's used slots per slab), and finding whether any does. `np.add.at` is exact; on numpy 2
it is the fastest way for a few indices, while from a few hundred sorting the indices once and doing
one indexed add is several times faster. `np.unique` with counts or first positions costs about 7 us
even for a handful of values (its sort path in Python): a sort and one comparison say whether any
value repeats in about 2."""

from __future__ import annotations

import numpy as np

# Indices up to this many are added with np.add.at; more, by np.unique's counts (an experiment on
# the 2-core VM, numpy 2.4: 1.6-7.3 us against 7-9 for 1-128 indices; 24 against 10 for 512).
ADD_AT_MOST = 128


def add_at(counts: np.ndarray, index: np.ndarray, delta: int, *, distinct: bool = False) -> None:
    """counts[index] += delta, once for each time an index occurs. `distinct`: the caller knows that
    no index repeats (one plain indexed add, no sort)."""
    if distinct:
        counts[index] += delta
        return
    if len(index) <= ADD_AT_MOST:
        np.add.at(counts, index, delta)
        return
    cells, times = np.unique(index, return_counts=True)
    counts[cells] += delta * times.astype(counts.dtype)


def any_true(mask: np.ndarray) -> bool:
    """`mask.any()` for a boolean mask: count_nonzero is C all the way, where `.any()` goes through
    numpy's Python-level reduction wrapper, several times the cost on the few-element masks of a
    client's call."""
    return bool(np.count_nonzero(mask))


def repeats(values: np.ndarray) -> bool:
    """Whether some value occurs more than once in a 1-d array."""
    if len(values) < 2:
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def unique(values: np.ndarray) -> np.ndarray:
    """`np.unique(values)` of a 1-d integer array of many possible values (rows, vids, keys; not
    for 0-d or 2-d arrays, which np.unique would flatten, nor NaNs, which it merges): a sort and
    one comparison. numpy 2's np.unique hashes instead, 10x slower at 1,024 rows (65 against 6 us)
    and 50x at a million distinct int64 (463 against 9 ms; the 2-core VM, numpy 2.4); for a handful
    of possible values (tiers, layouts) hashing is faster: `distinct`."""
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    first = np.empty(len(ordered), dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values of a 1-d integer array (tiers, layouts, list codes: a handful), ascending,
    as Python ints. Most batches hold one value: then one comparison, not `np.unique`."""
    if not len(values):
        return []
    first = values[0]
    if (values == first).all():
        return [int(first)]
    return np.unique(values).tolist()
