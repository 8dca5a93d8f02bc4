"""Runs of pages: where a mask of pages holds contiguous runs, and how many slabs of a length they hold
(the slot allocator's and the room-by-slabs bound's, alloc.py and slabroom.py)."""

from __future__ import annotations

import numpy as np


def runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the maximal runs of True in a boolean mask, ends exclusive."""
    edges = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def slabs_in_runs(free: np.ndarray, slab_pages: int) -> int:
    """Slabs of `slab_pages` contiguous pages that the pages marked in `free` hold, first fit: each
    maximal run of free pages holds its length // slab_pages (free pages scattered between used ones
    hold no slab longer than a page)."""
    if slab_pages == 1:
        return int(np.count_nonzero(free))
    starts, ends = runs(free)
    return int(((ends - starts) // slab_pages).sum())
