"""The heat policy's score formula (heat.py holds the formula's terms and when scores are taken).

A mixin of `HeatPolicy`: the full pass over every row in reused buffers (`_score_all`), the pass
over some rows (`_score`), the terms from the block table (`_add_terms`: priority, sharing, stage),
and the scores of a ranking the policy follows (`_followed`: LRU's or LFU's on heat's log
scale). Both passes compute the same formula; the full one folds fan-out into the density lookup
while no block has more than FUSE_FANOUT cached children.
"""

from __future__ import annotations

import numpy as np

from dflash2.policy.density import BINS_PER_OCTAVE, N_CLASS
from dflash2.policy.heat_lut import ROW, TIERS, log2_1p

RECENCY_SLOPE = 0.2  # heat lost per doubling of age, at weight 1 (log2 density units); LRU's when followed

# While no block has more cached children than this, the full pass folds fan-out into the density
# lookup (one gather instead of two); beyond it, a separate gather of its own table.
FUSE_FANOUT = 15


class HeatScoring:
    def _scratch(self, name: str, dtype) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or len(buf) != self._cap:
            buf = self._buffers[name] = np.empty(self._cap, dtype=dtype)
        return buf

    def _score_all(self, table) -> np.ndarray:
        """The full pass (every row): the same formula as `_score`, in reused float32 and int32
        buffers (on a million blocks a fresh array per step costs as much as the step), with as few
        passes as the formula allows: log-age once (it gives the age bin and the recency slope); the
        bin plus the row's stored class offset (plus, while no block has more than FUSE_FANOUT
        cached children, the fan-out times the table's stride) indexes one lookup table that holds
        w_frequency·log2 density (+ w_fanout·log2(1 + children)), padded so that no bin needs
        clipping. Ages are never negative (`_stamp` only stamps up to the clock): no clamp either."""
        c = table.cols
        w = self.weights
        log_age = self._scratch("log_age", np.float32)
        np.subtract(self.tick + 1.0, self._last, out=log_age, casting="same_kind")
        np.log2(log_age, out=log_age)
        scaled, idx = self._scratch("scaled", np.float32), self._scratch("idx", np.int32)
        np.multiply(log_age, np.float32(BINS_PER_OCTAVE), out=scaled)
        np.copyto(idx, scaled, casting="unsafe")  # truncation, as astype
        idx += self._off
        most = int(c.nkids.max()) if w["fanout"] and self._cap else 0
        fused = 0 < most <= FUSE_FANOUT
        if fused:
            kids = self._scratch("kids", np.int32)
            np.multiply(c.nkids, np.int32(TIERS * N_CLASS * ROW), out=kids)
            idx += kids
        # Two score buffers used in turn: a pass never writes the array the previous one returned
        # (callers use scores at once; none keeps them across two passes).
        self._flip ^= 1
        heat = self._scratch(f"heat{self._flip}", np.float32)
        # mode="clip": with `out`, the default mode writes through a temporary copy (3x slower); indices are in range.
        np.take(self._lookup(most if fused else 0), idx, out=heat, mode="clip")
        if most > FUSE_FANOUT:
            np.take(self.tables.fanout(self.weights["fanout"], most), c.nkids, out=scaled, mode="clip")
            heat += scaled
        if w["recency"] or w["recency_below"]:
            log_age *= self._slope  # per row: blocks below HBM may lose heat with age faster
            heat -= log_age
        self._add_terms(heat, c, slice(None))
        return heat

    def _add_terms(self, heat: np.ndarray, c, rows) -> None:
        """Priority, sharing and stage (fan-out is added with the density), each skipped when its
        inputs are all zero."""
        w = self.weights
        for name, column, fn in (("priority", c.priority, None), ("sharing", c.refs, log2_1p)):
            if not w[name]:
                continue
            values = column[rows]
            if not values.any():
                continue
            heat += np.float32(w[name]) * (values if fn is None else fn(values))
        if w["stage"]:
            # The request's stage, as the daemon sees it: a block a request holds (referenced or
            # pinned) is one it still decodes from; one that every request let go of, finished.
            # (A `stage` column that no call ever set stood here: the weight changed nothing.)
            held = (c.refs[rows] > 0) | (c.pins[rows] > 0)
            if held.any():
                heat += np.float32(w["stage"]) * held

    def _score(self, table, rows: np.ndarray | slice, now: float, tick: int | None = None) -> np.ndarray:
        """Vectorised over the given rows, in float32 (a million-block pass is dominated by
        transcendental and conversion passes: float32 halves both): log-age once (it gives the
        density's age bin and the recency slope), the density by one flat gather, and the terms whose
        inputs are all zero (no references, no priorities, ...) skipped after a cheap test."""
        c = table.cols
        w = self.weights
        ages = ((self.tick if tick is None else tick) + 1.0 - self._last[rows]).astype(np.float32)
        np.maximum(ages, np.float32(1.0), out=ages)
        log_age = np.log2(ages)
        idx = (log_age * np.float32(BINS_PER_OCTAVE)).astype(np.int64)
        np.minimum(idx, ROW - 1, out=idx)
        idx += self._off[rows]
        heat = np.take(self._lookup(0), idx)
        if w["fanout"]:
            kids = c.nkids[rows]
            if kids.any():
                heat += np.float32(w["fanout"]) * log2_1p(kids)
        if w["recency"] or w["recency_below"]:
            # Scale-free recency: a small slope in log-age, so that within a density level the
            # newer block wins (LRU), whatever the workload's time scale.
            log_age *= self._slope[rows]
            heat -= log_age
        self._add_terms(heat, c, rows)
        return heat

    def _lookup(self, fanout: int) -> np.ndarray:
        return self.tables.lookup(self.model, self.weights, self.split, self.inner, fanout)

    def _followed(self, table, rows: np.ndarray | slice, now: float) -> np.ndarray:
        """The followed ranking's scores of `rows` on heat's log scale, in its policy's order (lru.py,
        lfu.py) among blocks of no priority, references or holders: LRU's age as -0.2·log2(1 + age)
        (precise in float32, heat's score buffers' type; a monotonic clock's seconds since boot keep
        whole seconds there), LFU's score as log2(1 + score). Heat's priority, sharing and stage terms
        are added as to its own scores (followed alone, a high-priority tenant's blocks left HBM as
        any, and `set_weights` of those terms changed nothing while the duel followed, a review).
        LRU's age counts RECENCY_SLOPE a doubling, as heat's own recency does: at 1 a doubling, a
        running request's blocks (sharing and stage, +2) left HBM before idle ones a quarter as old
        (a review: 70 s against 10 s; heat ranking as heat kept them). Ages are signed, against
        `now`: the cache's time when `_patch` scores rows read since its pass, which rank above every
        row read before it and by their own order among themselves, as LRU and LFU rank them."""
        c = table.cols
        age = now - c.last_access[rows]  # negative: read after `now`, the cache's time (`_patch`)
        if self.ranking == "lru":
            out = -RECENCY_SLOPE * np.sign(age) * np.log2(1.0 + np.abs(age))
        else:  # LFU's tie-break term, 1 / (2 + age) in [0, 0.5] at ages >= 0, continued in (0.5, 1) below 0
            tie = 1.0 / (2.0 + np.abs(age))
            out = np.log2(1.0 + c.hits[rows] + np.where(age >= 0, tie, 1.0 - tie))
        self._add_terms(out, c, rows)
        return out
