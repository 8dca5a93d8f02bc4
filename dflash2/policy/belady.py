"""Belady's offline optimum: evict the block whose next use lies furthest in the future.

It needs the future, so it exists only for the policy bench (`dflash2 bench policy`), as the ceiling
the online policies are measured against. The replay hands it the whole trace up front
(`set_future`) and tells it where it stands (`advance`) before each request; scores are then the
negated index of the next request that uses a block's content key (never used again: -inf), and
a tier below HBM admits only the blocks used again (`admit`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash2.policy.base import Policy, register


@register
class BeladyPolicy(Policy):
    name = "belady"
    strict_order = True  # the block used furthest ahead goes first, a leaf of another chain or not

    def __init__(self) -> None:
        self._keys = np.empty(0, dtype=np.uint64)  # sorted distinct content keys of the trace
        self._uses: np.ndarray = np.empty(0, dtype=np.int64)  # request indices, grouped by key
        self._start = np.empty(0, dtype=np.int64)  # where each key's uses begin in _uses
        self._cursor = np.empty(0, dtype=np.int64)  # each key's next use, as an index into _uses
        self._end = np.empty(0, dtype=np.int64)
        self._now = -1

    def set_future(self, keys_per_request: Sequence[Sequence[int]]) -> None:
        """The whole trace, in order: the content keys each request reads."""
        lens = np.fromiter((len(k) for k in keys_per_request), dtype=np.int64, count=len(keys_per_request))
        flat = np.fromiter((int(k) for ks in keys_per_request for k in ks), dtype=np.uint64, count=int(lens.sum()))
        req = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
        order = np.lexsort((req, flat))
        self._keys, first, counts = np.unique(flat[order], return_index=True, return_counts=True)
        self._uses = req[order]
        self._start = first.astype(np.int64)
        self._cursor = self._start.copy()
        self._end = self._start + counts
        self._now = -1

    def advance(self, request_index: int) -> None:
        """The replay is about to serve this request: every use before it is in the past."""
        self._now = request_index
        self._step(np.arange(len(self._keys)))

    def _step(self, kidx: np.ndarray) -> None:
        # Move each cursor past the uses that are not in the future any more (requests < now).
        while True:
            c = self._cursor[kidx]
            stale = (c < self._end[kidx]) & (self._uses[np.minimum(c, len(self._uses) - 1)] < self._now)
            if not stale.any():
                return
            self._cursor[kidx[stale]] += 1
            kidx = kidx[stale]

    def next_use(self, keys: np.ndarray) -> np.ndarray:
        """Index of the next request (≥ the current one) that reads each key; inf when none."""
        out = np.full(len(keys), np.inf)
        if not len(self._keys):
            return out
        pos = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        known = self._keys[pos] == keys
        c = self._cursor[pos]
        left = known & (c < self._end[pos])
        out[left] = self._uses[c[left]]
        return out

    def scores(self, table, rows, now):
        return -self.next_use(table.cols.key[rows])

    def scores_all(self, table, now):
        return -self.next_use(table.cols.key)

    def admit(self, table, rows, tier, now):
        """Only a block read again deserves a place in a tier below: one never used again, moved
        down, would push out (or take the slot of) a block used later, and the "optimum" then found
        fewer blocks than the online policies with DRAM and NVMe below HBM (placement.py asks only
        of the tiers below HBM: the HBM-only figures do not change). Into a full last tier, what it
        pushes out is lost: of the candidates and the tier's blocks they would push out, those read
        furthest ahead stay out, candidates or not (`_displaced`). Admitting every block used again
        there, one read at the 9th request pushed out one read at the 7th, and heat found more than
        the "optimum" (a review's hand-checked trace: 3 of 11 against 2). The next use counts from
        the request being served, whose blocks it holds while it runs."""
        rows = np.asarray(rows, dtype=np.int64)
        ok = np.isfinite(self.next_use(table.cols.key[rows]))
        if len(rows) and int(tier) == self._last_tier(table):
            ok &= ~self._displaced(table, rows, tier)
        return ok

    def _displaced(self, table, rows: np.ndarray, tier) -> np.ndarray:
        """Which candidates a full last tier should refuse: the bytes they would push out of it (their
        slots less its room) are taken from the candidates and the tier's published, unpinned blocks
        together, read furthest ahead first (room made by whole slabs is not modelled: the bench's
        replays use one block size)."""
        alloc = table.allocators[tier]
        c = table.cols
        slots = table.slot_sizes(tier)
        wanted = slots[c.layout[rows]].astype(np.int64)
        biggest = max(table.layouts[int(lid)].block_bytes for lid in np.unique(c.layout[rows]))
        push = int(wanted.sum()) - alloc.blocks_free(biggest) * alloc.slot_for(biggest)
        if push <= 0:
            return np.zeros(len(rows), dtype=bool)
        here = np.flatnonzero((c.tier == int(tier)) & (c.key != 0) & (c.pins == 0))
        uses = np.concatenate((self.next_use(c.key[rows]), self.next_use(c.key[here])))
        held = np.concatenate((wanted, slots[c.layout[here]].astype(np.int64)))
        # Furthest first; on a tie a candidate goes before a block already there (nothing moves).
        order = np.lexsort((np.arange(len(uses)), -uses))
        out = order[:int(np.searchsorted(np.cumsum(held[order]), push)) + 1]
        refused = np.zeros(len(rows), dtype=bool)
        refused[out[out < len(rows)]] = True  # (the candidates come first in `uses`)
        return refused
