"""Least recently used: the baseline that LMCache, vLLM and Mooncake ship."""

from __future__ import annotations

import numpy as np

from dflash2.policy.base import Policy, register


@register
class LRUPolicy(Policy):
    name = "lru"

    def scores(self, table, rows, now):
        return table.cols.last_access[rows].astype(np.float64, copy=False)

    def scores_all(self, table, now):
        return table.cols.last_access  # no copy: callers only read it
