"""A tier's cold cut: the blocks below its `cold_threshold` percentile, each block ranked by the
hottest block under it in the tier (its *peak*), for a drain (rebalance.py).

A block is read only through its chain, so it is needed as long as any block under it is. Ranked by
their own scores, a chain written in pieces (each committed under the last block of the one before)
has its root side coldest: the cut took that side with its descendants, and the drain moved them
leaves first, so the block written last, the parent of the next piece, went down first, beside the
tips of old chains (tests/test_rebalance.py; room made for allocations still takes such tips under
heavy writes: docs/known-gaps.md, "A chain's freed tip"). Ranked by peaks the cut is closed downward (a block's
descendants in the tier peak no higher than it does, so they are cold with it), no block is colder
than one under it (the blocks a writer adds under a prefix go together, after or with the prefix's
other branches' cold blocks), and the cut still holds the threshold's share of the tier.

Peaks differ from scores only at or above a *rising* edge, a block in the tier scored above its
parent there (under `lru`, every block written after its prefix was read: its first block rises
above the prefix). So the peaks are pushed up over the blocks at or above rising edges only, found
by a climb from their parents (a level a round, and a row at a time in Python once few chains are
left: a rise under a prefix 32,768 deep is 32,768 steps of a walk), and over the whole tier
(`forest.subtree_peaks`: 100-200 ms at a million rows) only where the climb would cost more (its
budget: a cap of 64 levels sent a single rise under a prefix 256 deep through the whole tier, 182 ms
at a million rows against 29 for the climb, a review). A climb that runs out of its budget has cost
about half that pass before the pass: the worst case, 1.5-2 times the pass (1.6-1.7 in a review's
case of 31 chains 8,100 deep in a million rows).
"""

from __future__ import annotations

import math

import numpy as np

from dflash2.forest import local_parents, subtree_peaks
from dflash2.kth import kth_lowest

# The climb's budget, in rows gathered by a numpy round (15-30 ns each on the 2-core VM): CLIMB_SHARE x
# the tier's rows (the pass over the whole tier gathers each row about 10 times), a round counted as
# LEVEL_ROWS besides its rows (its dozen numpy calls, 7-15 us), and a step of the walk in Python (once
# fewer than WALK_BELOW rows climb: 0.35-0.65 us a step, slower in a larger table) as WALK_ROWS (at 16
# a review's 31 chains 8,100 deep spent twice their share walking: 1.8-2.7x the pass in all).
CLIMB_SHARE, LEVEL_ROWS, WALK_ROWS, WALK_BELOW = 4, 512, 32, 16


def peak_scores(cols, tier: int, scores: np.ndarray) -> np.ndarray:
    """`scores` (one per table row), each row of `tier` raised to the highest score in its subtree
    in the tier: `scores` itself where no block of the tier scores above its parent there, else a
    copy."""
    return _peaks(cols.parent, cols.tier == tier, scores)


def _peaks(parent: np.ndarray, in_tier: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """`peak_scores` of the tier whose rows are `in_tier` (a mask over the table)."""
    child = np.flatnonzero(in_tier & (parent >= 0))
    up = parent[child].astype(np.int64)
    inner = in_tier[up]
    child, up = child[inner], up[inner]  # every edge of the tier: child -> parent, both in it
    rising = scores[child] > scores[up]
    if not rising.any():
        return scores
    child, up = child[rising], up[rising]
    above = _at_or_above(parent, in_tier, up)
    if above is None:
        above = in_tier  # the whole tier: its rising edges lie under most of it, or deep
    rows = np.flatnonzero(above)
    # A row's children outside `rows` peak at their own scores (no rising edge under them): those
    # above their parent are the rising edges whose child is outside; the others change nothing.
    start = scores[rows].astype(np.float64)  # (a copy)
    outside = ~above[child]
    if outside.any():
        at = np.searchsorted(rows, up[outside])
        np.maximum.at(start, at, scores[child[outside]])
    out = np.array(scores, dtype=np.float64, copy=True)
    out[rows] = subtree_peaks(local_parents(rows, parent[rows]), start)
    return out


def _at_or_above(parent: np.ndarray, in_tier: np.ndarray, start: np.ndarray) -> np.ndarray | None:
    """Mask of the tier's rows at or above `start` (rows of it), climbing a level a round, then, once
    fewer than WALK_BELOW rows climb, a row at a time in Python; None where the climb would cost more
    than its budget (module docstring: the pass over the whole tier is then cheaper)."""
    budget = CLIMB_SHARE * int(np.count_nonzero(in_tier))
    seen = np.zeros(len(in_tier), dtype=bool)
    last = np.empty(len(in_tier), dtype=np.int64)  # which entry of a level wrote each row last
    frontier = start
    while len(frontier) and len(frontier) >= WALK_BELOW:
        # Each row once a level: the children of one parent would climb together, all of them,
        # to the root (a long trunk under many rising leaves made the climb leaves x depth).
        last[frontier] = np.arange(len(frontier))
        frontier = frontier[last[frontier] == np.arange(len(frontier))]
        budget -= len(frontier) + LEVEL_ROWS
        if budget < 0:
            return None
        seen[frontier] = True
        up = parent[frontier]
        up = up[up >= 0]
        frontier = up[in_tier[up] & ~seen[up]].astype(np.int64)
    # A few chains left (a rise under a deep prefix): each walked up to a row already seen, the top
    # of the tier or the root.
    for row in frontier.tolist():
        while not seen[row]:
            budget -= WALK_ROWS
            if budget < 0:
                return None
            seen[row] = True
            row = int(parent[row])
            if row < 0 or not in_tier[row]:
                break
    return seen


def cold_mask(cols, tier: int, scores: np.ndarray, threshold: float) -> np.ndarray:
    """Mask of the rows of `tier` whose peak's percentile among all the tier's blocks is below
    `threshold` (ties at the cutoff count as cold). The i-th lowest of n blocks stands at
    percentile i/n, below the threshold t while i < t*n: ceil(t*n) blocks (rounded down, a
    threshold of 0.05 left a tier of 16 blocks with none cold, and over its high watermark it
    never drained). The small slack keeps 0.1 * 30 (3.0000000000000004) at 3."""
    in_tier = cols.tier == tier
    peaks = _peaks(cols.parent, in_tier, scores)
    tier_peaks = peaks[in_tier]
    k = math.ceil(threshold * len(tier_peaks) - 1e-9)
    if k <= 0:
        return np.zeros(len(scores), dtype=bool)
    cutoff = kth_lowest(tier_peaks, k)  # (a low threshold under a tie at the bottom: kth.py)
    return in_tier & (peaks <= cutoff)
