"""Least frequently used, ties broken by recency."""

from __future__ import annotations

import numpy as np

from dflash2.policy.base import Policy, register


@register
class LFUPolicy(Policy):
    name = "lfu"

    def scores(self, table, rows, now):
        return lfu_score(table.cols.hits[rows], table.cols.last_access[rows], now)

    def scores_all(self, table, now):
        return lfu_score(table.cols.hits, table.cols.last_access, now)


def lfu_score(hits: np.ndarray, last: np.ndarray, now: float) -> np.ndarray:
    """LFU's score: the hit count, recency squashed into [0, 1) breaking ties between equal counts
    (age 0 -> 0.5, older -> toward 0)."""
    age = np.maximum(now - last, 0.0)
    return hits.astype(np.float64) + 1.0 / (2.0 + age)
