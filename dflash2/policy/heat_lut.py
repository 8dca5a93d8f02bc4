"""The heat policy's scoring lookup tables (heat.py): w_frequency·log2 density per tier, class and
age bin, lifted by each list's rank in its tier (the adaptive splits, split.py), and optionally one
copy per count of cached children with w_fanout·log2(1 + children) added (fan-out folded into one
gather). Rebuilt only when the density model refits, a weight changes, a split changes side or more
fan-out levels are needed."""

from __future__ import annotations

import numpy as np

from dflash2.policy.density import BINS_PER_OCTAVE, N_AGE, N_CLASS
from dflash2.tiers import Tier

# Age bins per class in the scoring lookup table: the density's N_AGE bins, the last one repeated up
# to the largest bin a float32 log-age can give (log2 of the largest float32 is 128), so that the
# full pass needs no clipping of the bin index (the same values as clipping to N_AGE - 1).
ROW = BINS_PER_OCTAVE * 129
TIERS = len(Tier)  # the lookup table holds one density per tier (lower tiers rank by their own lifetimes)
# Per rank of a block's list (0: the list that gives way first; split.py): above any score the other
# terms give at sensible weights (log2 densities reach -50, the recency term -8), small enough that
# float32 keeps recency steps of a thousandth within two of it.
SPLIT_BONUS = 1024.0
# Returning blocks of this frequency class and above (three or more references before: freq_class is
# log2(1 + count)) form the inner split's second list: seen four times or more; classes 1 below it,
# seen two or three times, the first.
INNER_CLASS = 2


def log2_1p(counts: np.ndarray) -> np.ndarray:
    return np.log2(counts.astype(np.float32) + np.float32(1.0))


def keep_ranks(split, inner) -> np.ndarray:
    """Per tier, the order in which first-timers, returning blocks seen 2-3 times and those seen
    more often give up blocks (0: first, each rank worth SPLIT_BONUS): the outer split puts
    first-timers before or after the returning blocks; in HBM the inner split orders those two
    lists, below HBM they are one (the same rank)."""
    first_out = split.first_out.astype(np.int64)
    ranks = np.empty((TIERS, 3), dtype=np.int64)
    ranks[:, 0] = np.where(first_out, 0, 1)
    ranks[:, 1] = ranks[:, 2] = first_out
    # HBM: first-timers first (0) or last (2); the inner split's first list next or first.
    twice_first = int(inner.first_out[0])
    ranks[0, 0] = 0 if first_out[0] else 2
    ranks[0, 1] = first_out[0] + 1 - twice_first
    ranks[0, 2] = first_out[0] + twice_first
    return ranks


class ScoreTables:
    def __init__(self):
        self._key: tuple | None = None  # (model version, weights, split sides) the table was built for
        self._lut = np.zeros(0, dtype=np.float32)
        self._fan: tuple[float, np.ndarray] | None = None

    def fanout(self, w_fanout: float, most: int) -> np.ndarray:
        """w_fanout·log2(1 + n) for n = 0..most (at least 0..255), float32 as heat's `_score` computes it."""
        if self._fan is None or self._fan[0] != w_fanout or len(self._fan[1]) <= most:
            n = max(256, 1 << int(most).bit_length())
            self._fan = (w_fanout, np.float32(w_fanout) * log2_1p(np.arange(n, dtype=np.int64)))
        return self._fan[1]

    def lookup(self, model, weights: dict, split, inner, fanout: int) -> np.ndarray:
        """w_frequency·log2 density as float32: per tier (its own density, density.py), one row of
        ROW age bins per class (the last bin repeated); with fanout > 0, (at least) fanout + 1 such
        tables in a row, the n-th plus w_fanout·log2(1 + n). `split`, `inner`: heat's splits (None
        before its first table)."""
        sides = (tuple(split.first_out.tolist()), tuple(inner.first_out.tolist())) if split is not None else ()
        key = (model.version, weights["frequency"], weights["fanout"], sides)
        have = len(self._lut) // (TIERS * N_CLASS * ROW) - 1  # fan-out levels the current table holds
        if self._key != key or have < fanout:
            # The plain table is the first block of the fused one: one table serves both.
            fanout = max(fanout, have) if self._key == key else fanout
            src = model.tier_log_density.astype(np.float32)
            if weights["frequency"] != 1.0:
                src *= np.float32(weights["frequency"])
            lut = np.empty((fanout + 1, TIERS, N_CLASS, ROW), dtype=np.float32)
            lut[0, :, :, :N_AGE] = src
            lut[0, :, :, N_AGE:] = src[:, :, N_AGE - 1: N_AGE]
            if split is not None:
                # Each list's rank in its tier (keep_ranks): the list that gives way first scores lowest.
                keep = np.zeros((TIERS, N_CLASS), dtype=np.float32)
                ranks = keep_ranks(split, inner)
                keep[:, 0] = ranks[:, 0] * SPLIT_BONUS
                keep[:, 1:INNER_CLASS] = ranks[:, 1:2] * SPLIT_BONUS
                keep[:, INNER_CLASS:] = ranks[:, 2:3] * SPLIT_BONUS
                lut[0] += keep[:, :, None]
            if fanout:
                fan = self.fanout(weights["fanout"], fanout)[1: fanout + 1]
                lut[1:] = lut[0][None] + fan[:, None, None, None]
            self._lut, self._key = lut.ravel(), key
        return self._lut
