"""A draining tier's cold cut, kept in score order across the drain's pieces (rebalance.py).

Each piece of a drain asks `Placement.select` for the lowest-scored movable blocks of the cut. Done
from scratch, that is 4-5 passes over every row of the table and a partition, whatever the piece's
size: 2-6 ms a piece at a million blocks, most of the piece. The cut is a fixed set of rows (taken
once, when the drain began), so its order can be kept instead: `select` then gathers over the cut's
rows and the few lowest of them (`Placement._select_drain`), and chooses the same victims.

Invariant (what makes the victims the same): the *prefix* holds, in (key, row) order, every row of
the cut whose key is at or below `bound`; every other row of the cut has a key above `bound`. A
row's key is its score while it is still the cut's block (its generation, in the tier), and +inf
once it is not. So when the prefix holds k movable rows, the k-th lowest of them is the k-th lowest
movable row of the whole cut, and the rows tied with it are all in the prefix. Policies never score
a block +inf or NaN; a score that is would pass for a block gone, so a cut that meets one is not
used (`usable` False: select's own pass decides). Nor is one whose scores change wholesale at every
refresh (LFU's follow the clock): keeping its order would cost more than select's own pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash2.kth import kth_lowest
from dflash2.table.columns import NO_CLIENT
from dflash2.table.states import BlockState
from dflash2.tiers import Tier


class DrainCut:
    MIN_PREFIX = 4096
    PREFIX_SHARE = 16  # the prefix holds at least this share of the cut (1/16)
    RESCORED_IN_A_ROW = 3  # refreshes in a row that rebuild the order before it is given up

    def __init__(self, tier: Tier, rows: np.ndarray, gens: np.ndarray):
        self.tier = tier
        self.rows, self.gens = rows, gens  # the cut: rows ascending, and their generations then
        self.size = max(self.MIN_PREFIX, len(rows) // self.PREFIX_SHARE)
        self.keys: np.ndarray | None = None  # each cut row's key when last looked at
        self.bound = -np.inf
        self.prefix = np.empty(0, dtype=np.int64)  # indices into `rows`, in (key, row) order
        self.builds = 0  # how often the prefix was built (a rescoring, a prefix too short)
        self._rescored_in_a_row = 0  # refreshes in a row that found most of the cut's keys changed
        self.usable = True
        # A piece (`here` .. `forget`): which rows `here` found gone, for the piece's first refresh
        # (nothing changes the table before it); then the scores that refresh used, which serve
        # the piece's later selections given the same array (module docstring).
        self._in_piece = False
        self._gone: np.ndarray | None = None
        self._fresh: np.ndarray | None = None

    def exclude(self, rows: np.ndarray) -> None:
        """Take `rows` out of the cut (blocks brought up for a read that has not come yet: the drain
        leaves them, rebalance.py `start_drains`); the order is built anew at the next use."""
        # `rows` are few (a prefetch window's), the cut ascending: found by search, not a pass over
        # the whole cut at every step while a block awaits its read.
        rows = np.asarray(rows, dtype=np.int64)
        at = np.searchsorted(self.rows, rows)
        found = at < len(self.rows)
        found[found] = self.rows[at[found]] == rows[found]
        at = np.unique(at[found])
        if not len(at):
            return
        self.rows, self.gens = np.delete(self.rows, at), np.delete(self.gens, at)
        self.keys, self.prefix, self.bound = None, np.empty(0, dtype=np.int64), -np.inf
        self._gone = self._fresh = None

    def _gone_now(self, table) -> np.ndarray:
        """Mask over the cut: the rows that are no longer its blocks in the tier."""
        c = table.cols
        return (c.gen[self.rows] != self.gens) | (c.tier[self.rows] != int(self.tier))

    def _current(self, table, scores: np.ndarray) -> np.ndarray:
        keys = scores[self.rows]  # (a copy: rows ascending, a near-sequential gather)
        if keys.dtype.kind != "f":
            keys = keys.astype(np.float64)
        gone, self._gone = self._gone, None  # (valid for the piece's first refresh only)
        if gone is None:
            gone = self._gone_now(table)
        if not (keys[~gone] < np.inf).all():
            self.usable = False  # a block scored +inf or NaN would pass for one gone (module docstring)
        keys[gone] = np.inf
        return keys

    def _build(self, keys: np.ndarray) -> None:
        self.builds += 1
        self.keys = keys
        n = len(keys)
        if self.size >= n:
            self.bound = np.inf
            idx = np.arange(n)
        else:
            # (kth.py: a cut's cold blocks tie at the bottom, where a partition of every key took 11 ms
            # at 500,000 rows against 1.6)
            self.bound = float(kth_lowest(keys, self.size))
            idx = np.flatnonzero(keys <= self.bound)
        # By key alone: the rows tied at the k-th key are all taken or none, and the lowest leaves are
        # ordered by (key, row) where they are taken (`Placement._select_drain`): ties' order is moot.
        self.prefix = idx[np.argsort(keys[idx])]

    def here(self, table) -> np.ndarray:
        """The cut's rows that are still its blocks in the tier (the drain's `cold` mask), at the
        start of a piece; the piece's selections follow (`forget` ends it). Only which rows are
        gone, no scores: a selection scores with its own (LFU makes a new array from the clock at
        every call: scores taken here too cost a piece two passes and two rebuilds of the order,
        twice the piece of the code before, a review's script).
        Within the piece, once a selection has refreshed the order, those of the piece given the same
        scores array use it as it is (a refresh is a gather over the whole cut: a piece whose first
        round moves few blocks selects several times, 0.4 ms each at 64,000 rows of a cut, a
        review's profile). That holds because within a piece the cut's blocks only leave the tier
        (moved down, dropped) or go in flight, which `movable_in_order` sees row by row, and no
        score of a block still there changes: nothing reads a block meanwhile, and a policy's
        cached scores change in place only for the blocks that moved (a rescoring makes a new array)."""
        self._gone = self._gone_now(table)
        self._in_piece, self._fresh = True, None
        return self.rows[~self._gone]

    def forget(self) -> None:
        """The piece that `here` began is over: the next use looks at the table anew."""
        self._in_piece, self._gone, self._fresh = False, None, None

    def _refresh(self, table, scores: np.ndarray) -> None:
        if self._fresh is not None and self._fresh is scores:
            return  # (within the piece: refreshed with these scores already)
        self._fresh = scores if self._in_piece else None
        keys = self._current(table, scores)
        if self.keys is None or len(keys) != len(self.keys):
            return self._build(keys)
        changed = np.flatnonzero(keys != self.keys)
        if not len(changed):
            self._rescored_in_a_row = 0
            return
        wholesale = len(changed) * 2 > len(keys)  # a rescoring: most of the cut's keys changed
        self._rescored_in_a_row = self._rescored_in_a_row + 1 if wholesale else 0
        if self._rescored_in_a_row >= self.RESCORED_IN_A_ROW:
            # At every refresh (a policy whose scores follow the clock, LFU): each a partition of
            # the whole cut, more than select's own pass. The order is given up for this drain.
            self.usable = False
        if wholesale:
            # A prefix grown for one selection (the lowest leaves, far up the cut) would cost every
            # later piece its gathers: with new scores it starts from its own size again.
            self.size = max(self.MIN_PREFIX, len(self.rows) // self.PREFIX_SHARE)
        if wholesale or len(changed) * 2 > max(len(self.prefix), self.MIN_PREFIX):
            return self._build(keys)  # (rebuilt: cheaper than moving that many rows in the prefix)
        self.keys = keys
        # The rows whose key changed leave the prefix, and those now at or below the bound join it
        # where their key puts them (linear: no sort of the prefix). Among equal keys a joining row
        # goes after those already there: tied rows are taken all or none (`_select_drain`), so
        # their order within the prefix does not matter.
        mark = np.zeros(len(keys), dtype=bool)
        mark[changed] = True
        prefix = self.prefix[~mark[self.prefix]]
        joined = changed[keys[changed] <= self.bound]
        if len(joined):
            joined = joined[np.argsort(keys[joined], kind="stable")]
            prefix = np.insert(prefix, np.searchsorted(keys[prefix], keys[joined], side="right"), joined)
        self.prefix = prefix

    def movable_in_order(self, table, scores: np.ndarray, k_of: Callable[[int], int], evict: bool,
                         protect: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int, bool]:
        """The prefix's movable rows and their keys, lowest first; select's k (`k_of(n_reach)`); and
        whether the prefix is the whole cut. At least k rows unless it is: the rows at or below the
        k-th of them are those `Placement._at_or_below_cut` finds over select's reach. The movable
        filter is `Placement.movable`'s (never `idle_only` or `below_priority`: those take select's
        own pass)."""
        self._refresh(table, scores)
        c = table.cols
        held = None
        while True:
            idx = self.prefix
            rows = self.rows[idx]
            ok = self.keys[idx] < np.inf
            ok &= c.tier[rows] == int(self.tier)  # (left within the piece: its keys are as at its start)
            ok &= c.state[rows] == int(BlockState.RESIDENT)
            ok &= c.pins[rows] == 0
            if evict:
                ok &= c.refs[rows] == 0
                ok &= c.owner[rows] == NO_CLIENT
            if protect is not None and len(protect):
                if held is None:
                    held = np.zeros(c.capacity, dtype=bool)  # (np.isin over a large prefix: ms)
                    held[protect] = True
                ok &= ~held[rows]
            n = int(np.count_nonzero(ok))
            complete = self.bound == np.inf
            k = k_of(n) if complete else k_of(1 << 62)  # (select's n_reach is at least n: the need sets k)
            if complete or n >= k:
                return rows[ok], self.keys[idx][ok], k, complete
            self.grow(k)  # too few movable rows in the prefix

    def grow(self, k: int) -> None:
        """A prefix at least twice as long, and four times k (the whole cut at most)."""
        self.size = max(2 * self.size, 4 * k)
        self._build(self.keys)


class DrainSelection:
    """`select` among a drain's cut (a mixin of Placement: needs its `policy`, `table`, `_leaving`
    and `_childless`)."""

    def _select_drain(self, cut: DrainCut, tier: Tier, need_bytes: int, evict: bool,
                      protect: np.ndarray | None, through: Tier | None) -> np.ndarray | None:
        """`select` among a drain's cut (`cold`) from its rows kept in score order (drainorder.py):
        the same victims, from gathers over the cut's rows and the few lowest of them, where select's
        own pass reads every row of the table (4-5 passes and a partition: 2-6 ms a piece at a
        million blocks). Where select would take the lowest leaves instead and too few of them lie
        in the kept prefix, the prefix grows (up to the whole cut) until they do. None where the cut
        turned out unusable (a score without bound): select's own pass decides."""
        scores = self.policy.scores_all(self.table, self.table.clock())
        sizes = self.table.slot_sizes(tier)
        layout = self.table.cols.layout
        k_need = int(np.ceil(need_bytes / max(1, int(sizes.min()))))
        while True:
            rows, keys, k, complete = cut.movable_in_order(self.table, scores, lambda n: min(n, k_need),
                                                           evict, protect)
            if not cut.usable:
                return None
            if not len(rows):
                return np.empty(0, dtype=np.int64)
            under = np.sort(rows[:int(np.searchsorted(keys, keys[k - 1], side="right"))])
            part = self._leaving(tier, under, evict, scores, through)
            if len(part):
                break
            # As select: everything under the cut waits on a child that cannot leave, so the lowest
            # leaves instead (by score, then row). Exact once the leaves kept in order cover the
            # need: every row of the cut beyond the prefix scores higher than those in it.
            leaf = self._childless(tier, evict, through, rows)
            if complete or int(sizes[layout[rows[leaf]]].sum()) >= need_bytes:
                part = rows[leaf][np.lexsort((rows[leaf], keys[leaf]))]
                break
            cut.grow(k)
        taken = int(np.searchsorted(np.cumsum(sizes[layout[part]]), need_bytes)) + 1
        return part[:taken].astype(np.int64)
