"""The k-th lowest of many scores, in the time of a pass over them even where thousands tie.

Placement's cut is the k-th lowest score among a tier's movable blocks (1% of a million when room is
made for a long prompt). numpy's partition finds it in 5-7 ms over a million random float32, but a
served cache's scores tie: a fifth of the blocks written and never read again score alike, at the
bottom, and a partition for a k inside that tie took 25 ms over the tier's scores gathered and 106
over the whole table with the other rows set to +inf (2026-12-06, 2-core VM; `bench table`'s heat
choice of 1% took 146 ms, 107 of them in that partition).

So the k-th is looked for among few: a sample of the scores sets a bar somewhat above the
k-th's expected place, one comparison over every score keeps those at or under it, and the bar's own
tie is never partitioned: where fewer than k lie strictly under the bar, the bar is the k-th. Where
the sample misjudged (fewer than k at or under the bar, or most of the scores), the scores are
partitioned whole, as before. Either way the answer is the k-th lowest exactly: the same cut, so the
same victims. Pure numpy: no table, no policy.
"""

from __future__ import annotations

import math

import numpy as np

SAMPLE = 4096  # scores in the sample that sets the bar
WORTH = 8 * SAMPLE  # fewer scores than this are partitioned whole: the sample would cost as much
MARGIN = 2.0  # the bar's place in the sample, in multiples of the k-th's expected place ...
SLACK = 8  # ... plus this many samples: a bar just under the k-th means a second pass
# Where the sample lies, as shares of the scores: drawn once, uniform, from a fixed seed (sorted, so
# the gather reads forward). A stride aliased with a table of equal chains in consecutive rows (16
# deep with a stride of 256: every sampled row a root, the hottest), and so did a golden-ratio
# sequence with a count of chains near a Fibonacci number (75,025 chains of 16: every sample a root):
# the bar stood above most of the scores and the whole partition followed the wasted pass (make_room
# 1.85x, reviews). Draws of no arithmetic order have no such count.
SPREAD = np.sort(np.random.default_rng(0x6B7468).random(SAMPLE))


def kth_lowest(values: np.ndarray, k: int, where: np.ndarray | None = None):
    """The k-th lowest of `values` (1 <= k <= their count), or of `values[where]` (a mask of the same
    length): what `np.partition(values[where], k - 1)[k - 1]` answers. NaN counts above every
    number, as in numpy's partition."""
    n = len(values) if where is None else int(np.count_nonzero(where))
    if not 1 <= k <= n:
        raise ValueError(f"kth_lowest: k={k} of {n} values")
    # The bar stands near MARGIN * k of n: past a quarter of them, the pass under it keeps so many
    # that its gather and partition, or the whole partition after it, cost more than the whole
    # partition alone (k of 30% 1.7x, of 25% 1.75x, reviews).
    if n >= WORTH and len(values) >= WORTH and 4 * MARGIN * k <= n:
        found = _under_a_bar(values, k, n, where)
        if found is not None:
            return found
    kept = values if where is None else values[where]
    return np.partition(kept, k - 1)[k - 1]


def _under_a_bar(values: np.ndarray, k: int, n: int, where: np.ndarray | None):
    """The k-th lowest found among the values at or under a bar set from a sample, or None where the
    sample set the bar too low (fewer than k under it) or so high that a pass over most of the
    values would follow anyway."""
    at = (SPREAD * len(values)).astype(np.int64)
    sample = values[at]
    if where is not None:
        sample = sample[where[at]]
    if not len(sample):
        return None
    place = min(len(sample) - 1, math.ceil(len(sample) * k / n * MARGIN) + SLACK)
    bar = np.partition(sample, place)[place]
    under = values <= bar  # (a NaN bar: none, fewer than k, the whole partition below)
    if where is not None:
        under &= where
    kept = values[under]
    if len(kept) < k or len(kept) > n // 2:
        return None
    below = kept[kept < bar]
    if len(below) < k:
        return kept.dtype.type(bar)  # the k-th lies in the bar's own tie
    return np.partition(below, k - 1)[k - 1]
