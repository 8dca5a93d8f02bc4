"""Whether admission's refusals pay: TinyLFU's rule at the last tier, on while the blocks it refuses
come back less often than the blocks the tier lets go.

A refusal (admission.py's rule: the block was referenced less often lately than the blocks it would
push out) keeps the block out and, in exchange, one block the tier would have let go stays for as
long as the refused one would have lived there. So the rule pays while a refused block is less
likely to be asked for again within that time than a block leaving the tier is. Both are measured
the same way, whether the rule is on or off: the keys of the blocks the rule refuses (or, while it
is off, would refuse: they are admitted and followed) and the keys of the blocks that leave the
tier are remembered as ghosts, and a ghost whose key is asked for again (read from the tier, or
written again) within as many departures from the tier as the tier holds counts a return. The rule
is on while

    returns of refused blocks / refused blocks  <=  returns of departed blocks / departed blocks

(on at start, as TinyLFU), past a hysteresis band (HYSTERESIS). All four counts halve each time as
many blocks left the tier as it holds, so the gate follows the workload.

Neither estimate is exact: on the Mooncake synthetic trace refused blocks came back more often than
departed ones (0.44 against 0.30 of them within the window, HBM 1000 / DRAM 4000 / NVMe 8000),
yet the rule was worth 0.5 points of prefix hit rate there; the gate kept it on for most of that
replay (docs/policy-experiments.md). Measuring the gain instead by the one block a refusal spared (read before
it leaves) counted 216 gains against 725 losses over 9,293 refusals on that replay, and turned the
rule off for most of it: a refusal spares every block of the tier a departure, not one block many.
Counting a ghost only once its window has passed (no lag between refusals and their returns) kept
the rule on for 48,000 refusals on the conversation trace with 52,000 blocks, a window being a
large part of that trace.

Two ghost tables (ghosts.py): the refused keys and the departed ones.
"""

from __future__ import annotations

import numpy as np

from dflash2.policy.ghosts import GhostKeys, GhostTable, ghost_bits

REFUSED, DEPARTED = 0, 1
WINDOW = 1.0  # a ghost speaks within this many times the tier's capacity in departures
# The rule goes off when refused blocks come back 25% more often than departed ones, and on again
# when 25% less: the departed blocks' rate depends on the rule (refusals keep colder blocks longer,
# admissions push warmer ones out), and without a band the gate went on and off every few hundred
# decisions. Conversation trace, HBM 2000 / DRAM 8000: 0.2115 of references found in some tier
# without the band, 0.2141 with it (the rule always on 0.2150, always off 0.2138).
HYSTERESIS = 0.25


class AdmissionGate:
    def __init__(self, rows: int):
        self._rows = rows
        self._ghosts = (GhostTable(rows), GhostTable(rows))  # refused, departed
        self.departures = 0  # blocks that left the cache from the tier
        self.capacity = 0  # the tier's blocks, as the last decision saw them (the ghosts' window)
        self._since_halving = 0
        self.on = True  # the rule applies (TinyLFU's default, until refused blocks come back more)
        # Decayed: [refused, departed] blocks, and how many of them came back within the window.
        self.seen = np.zeros(2)
        self.back = np.zeros(2)
        self.counts = {"refused": 0, "admitted_against_rule": 0, "refused_back": 0, "departed": 0,
                       "departed_back": 0}

    def grow(self, rows: int) -> None:
        """The block table grew to `rows`: ghost tables sized for it, the refused and departed keys
        so far kept (before, each doubling forgot them)."""
        if ghost_bits(rows) <= ghost_bits(self._rows):
            return
        self._rows = rows
        for g in self._ghosts:
            g.grow(ghost_bits(rows))

    def _update(self) -> None:
        """Compare the return rates (back[R] / seen[R] against back[D] / seen[D], multiplied out: no
        division by 0) past the hysteresis band."""
        refused = self.back[REFUSED] * self.seen[DEPARTED]
        departed = self.back[DEPARTED] * self.seen[REFUSED]
        if self.on and refused > (1.0 + HYSTERESIS) * departed:
            self.on = False
        elif not self.on and refused < (1.0 - HYSTERESIS) * departed:
            self.on = True

    @property
    def window(self) -> int:
        return max(1, int(WINDOW * self.capacity))

    # -- decisions -------------------------------------------------------------------------------
    def decide(self, keys: np.ndarray, rule: np.ndarray, capacity: int) -> np.ndarray:
        """The admitted mask for candidates with content `keys` whose rule verdict is `rule`, into a
        tier of `capacity` blocks."""
        self.capacity = max(int(capacity), 1)
        against = ~rule
        n = int(against.sum())
        if not n:
            return rule
        self._remember(REFUSED, keys[against])
        self._update()
        if self.on:
            self.counts["refused"] += n
            return rule
        self.counts["admitted_against_rule"] += n
        return np.ones(len(keys), dtype=bool)

    def going(self, n: int) -> None:
        """`n` blocks the rule refused, in the same call as `decide`, go into the tier all the same
        (held by their writer or a reader): not counted refused until their copies have ended,
        `overruled` or `stayed`. Taken back at their landing, a refusal counted first was seen by a
        /metrics snapshot taken while the copies ran (a call parked on them), and the counter went
        down (a review)."""
        self.counts["refused"] -= n

    def overruled(self, n: int) -> None:
        """`n` blocks the rule refused (`going`) went into the tier all the same, held by their
        writer or a reader: admitted against the rule, not refused. Their ghosts stay, as for the
        blocks admitted while the rule is off: the rule's would-be refusals are measured whatever
        became of them. (Counted as refusals, they showed refusals that never happened, a review.)"""
        self.counts["admitted_against_rule"] += n

    def stayed(self, n: int) -> None:
        """`n` blocks the rule refused (`going`) did not go into the tier after all (no room there):
        refused, as blocks that stay where they are."""
        self.counts["refused"] += n

    # -- events ----------------------------------------------------------------------------------
    def left(self, keys: np.ndarray | GhostKeys) -> None:
        """Blocks left the cache from the tier."""
        if not self.capacity:  # no decision yet: the tier was never full when a block came down
            return
        self._remember(DEPARTED, keys)
        self.counts["departed"] += len(keys)
        self.departures += len(keys)
        self._since_halving += len(keys)
        if self._since_halving >= self.capacity:
            self._since_halving = 0
            self.seen /= 2
            self.back /= 2
        self._update()

    def referenced(self, keys: np.ndarray | GhostKeys) -> None:
        """Keys were asked for again (read from the tier, or written because they were cached
        nowhere): their ghosts within the window count a return."""
        if not len(keys) or not self.capacity:
            return
        keys = GhostKeys.of(keys).keyed()
        if not len(keys):
            return
        now = np.uint32(self.departures & 0xFFFFFFFF)
        for kind, name in ((REFUSED, "refused_back"), (DEPARTED, "departed_back")):
            ghost = self._ghosts[kind]
            n = int(np.count_nonzero(now - ghost.recall(keys)[0] <= self.window))
            if not n:
                continue
            self.back[kind] += n
            self.counts[name] += n
        self._update()

    # -- internals -------------------------------------------------------------------------------
    def _remember(self, kind: int, keys: np.ndarray | GhostKeys) -> None:
        keys = GhostKeys.of(keys).keyed()
        if not len(keys):
            return
        self._ghosts[kind].remember(keys, self.departures & 0xFFFFFFFF)
        self.seen[kind] += len(keys)

    def describe(self) -> dict:
        """The rule's state, the decayed return rates that decide it, and totals since start."""
        rate = [round(float(b / s), 4) if s else None for b, s in zip(self.back, self.seen)]
        return {"rule_on": self.on, "refused_return_rate": rate[REFUSED],
                "departed_return_rate": rate[DEPARTED], **self.counts}
