"""Hit density learned from the reuse distances of content keys (uncensored LHD).

LHD (NSDI'18) ranks a block by its expected hits per unit of space-time, conditioned on its class
and age, learned from the hits and evictions the cache itself observes. Learned that way the model
is censored by its own decisions: a block the cache evicts at age a never shows the hit it would
have had at age 2a, so the model never learns that waiting pays and keeps evicting at age a. In a
KV cache most reuse distances exceed the cache (multi-turn sessions come back minutes later), so
this matters.

Here the evidence comes from the reference stream instead: a small hashed *ghost* table remembers,
for each content key, the logical time and class of its last reference, whether or not the block is
still cached. Each reference of a key seen before is a reuse at a known age; each reference starts
a new life. Lives that are never reused are counted as ending at the horizon (the oldest reuse age
seen). density[c, a] = reuses still to come after age a / space-time those lives still spend.
Histograms decay so the model follows the workload. Ages are logical (block references), so the
model adapts to load instead of wall-clock rates.

Tiers below the first rank by their own lifetimes: a tier's density ends the lives that are never
reused where *that tier* lets blocks go (demoted further down, or dropped), not where the whole
cache does, so DRAM ranks by how long a block lasts in DRAM. The reuses are the same for every tier.
The first tier (HBM) keeps the whole cache's ends: ranked by its own demotion ages it served fewer
reads from HBM (`dflash2 bench policy` replays with DRAM and NVMe below,
docs/policy-experiments.md).
"""

from __future__ import annotations

import numpy as np

from dflash2.keys import fib_slots

BINS_PER_OCTAVE = 4
N_AGE = BINS_PER_OCTAVE * 40  # logical ages up to 2^40 block references
N_CLASS = 6  # frequency classes (log2(1 + count)): 0, 1-2, 3-6, 7-14, 15-30, 31+ prior references
FLOOR = 1e-15


def age_bin(age: np.ndarray) -> np.ndarray:
    return np.minimum((BINS_PER_OCTAVE * np.log2(1.0 + np.maximum(age, 0.0))).astype(np.int64), N_AGE - 1)


def freq_class(count: np.ndarray) -> np.ndarray:
    return np.minimum(np.log2(1.0 + np.asarray(count, dtype=np.float64)).astype(np.int64), N_CLASS - 1)


_EDGES = 2.0 ** (np.arange(N_AGE + 1) / BINS_PER_OCTAVE) - 1.0
_WIDTH = np.diff(_EDGES)


class HitDensityModel:
    def __init__(self, ghost_bits: int = 20, period: int = 8192, decay: float = 0.95, tiers: int = 1):
        # Refit after 256 references, then twice as many each time up to `period`: a young cache
        # learns fast, a warm one keeps a long memory (decay per fit).
        self.max_period = period
        self.period = min(256, period)
        self.decay = decay
        self._ghost_bits = ghost_bits
        self.ghost_key = np.zeros(1 << ghost_bits, dtype=np.uint64)
        self.ghost_tick = np.zeros(1 << ghost_bits)
        self.ghost_cls = np.zeros(1 << ghost_bits, dtype=np.int8)
        self.reuses = np.zeros((N_CLASS, N_AGE))
        self.lives = np.zeros(N_CLASS)
        self.evictions = np.zeros((N_CLASS, N_AGE))  # ages at which the cache let blocks go
        self.tier_exits = np.zeros((tiers, N_CLASS, N_AGE))  # ages at which each tier let blocks go
        self._since_fit = 0
        self.version = 0  # bumped whenever log_density changes (users cache tables built from it)
        # Before any evidence: density falls with age and rises with class (LRU, then LFU).
        self.log_density = np.log2((1.0 + np.arange(N_CLASS))[:, None] / (1.0 + _EDGES[None, :-1])) - 10.0
        # Per tier: the first is always `log_density`; a lower tier has its own once it has let blocks go.
        self.tier_log_density = np.repeat(self.log_density[None], tiers, axis=0)

    def observe(self, keys: np.ndarray, classes: np.ndarray, tick: float) -> None:
        """References of content keys (non-zero) at logical time `tick`, with the class each key has
        now (after counting this reference)."""
        keys = np.asarray(keys, dtype=np.uint64)
        if not len(keys):
            return
        slot = fib_slots(keys, self._ghost_bits)
        seen = self.ghost_key[slot] == keys
        if seen.any():
            s = slot[seen]
            np.add.at(self.reuses, (self.ghost_cls[s].astype(np.int64), age_bin(tick - self.ghost_tick[s])), 1.0)
        self.ghost_key[slot] = keys
        self.ghost_tick[slot] = tick
        self.ghost_cls[slot] = classes
        np.add.at(self.lives, classes, 1.0)
        self._since_fit += len(keys)
        if self._since_fit >= self.period:
            self.fit()

    def evicted(self, classes: np.ndarray, ages: np.ndarray) -> None:
        """Blocks left the cache at these ages: where the lives that are never reused end."""
        np.add.at(self.evictions, (np.asarray(classes, dtype=np.int64), age_bin(ages)), 1.0)

    def left_tier(self, tier: int, classes: np.ndarray, ages: np.ndarray) -> None:
        """Blocks left `tier` at these ages (moved down, or dropped from it)."""
        if 0 < tier < len(self.tier_exits):
            np.add.at(self.tier_exits[tier], (np.asarray(classes, dtype=np.int64), age_bin(ages)), 1.0)

    def fit(self) -> None:
        self._since_fit = 0
        self.period = min(2 * self.period, self.max_period)
        if not self.reuses.sum():
            return
        self.log_density = self._density(self.evictions, self.log_density)
        self.tier_log_density[0] = self.log_density
        for t in range(1, len(self.tier_exits)):
            if self.tier_exits[t].sum():
                self.tier_log_density[t] = self._density(self.tier_exits[t], self.log_density)
            else:  # nothing has left the tier yet: the whole cache's ends are the best guess
                self.tier_log_density[t] = self.log_density
        self.version += 1
        self.reuses *= self.decay
        self.lives *= self.decay
        self.evictions *= self.decay
        self.tier_exits *= self.decay

    def _density(self, exits: np.ndarray, previous: np.ndarray) -> np.ndarray:
        """log2 density per (class, age bin) with the lives that are never reused ending as `exits`
        says; a class without evidence keeps its `previous` row."""
        reused = self.reuses.sum(axis=1)
        ends = self.reuses.copy()
        never = np.maximum(self.lives - reused, 0.0)
        # Lives never reused end where the cache lets such blocks go (its eviction ages for the
        # class); a class never evicted yet ends at the horizon, the oldest reuse age on record.
        horizon = int(np.flatnonzero(self.reuses.sum(axis=0))[-1])
        exited = exits.sum(axis=1)
        for c in range(N_CLASS):
            if exited[c] > 0:
                ends[c] += never[c] * exits[c] / exited[c]
            else:
                ends[c, horizon] += never[c]
        hits_above = np.cumsum(self.reuses[:, ::-1], axis=1)[:, ::-1]
        alive_above = np.cumsum(ends[:, ::-1], axis=1)[:, ::-1]
        life_above = np.cumsum((alive_above * _WIDTH)[:, ::-1], axis=1)[:, ::-1]
        density = hits_above / np.maximum(life_above, 1e-300)
        out = previous.copy()
        known = alive_above[:, 0] > 0
        out[known] = np.log2(np.maximum(density[known], FLOOR))
        return out
