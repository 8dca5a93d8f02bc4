"""Whether admission's refusals pay: TinyLFU's rule at the last tier, switched on and off by what it
gains and loses on this workload.

Refusing a block a place in the full last tier (admission.py's rule: it was referenced less often
lately than the blocks it would push out) *gains* a hit when a block it spared is read again before
it leaves, and *loses* one when the refused key is written again (recomputed) soon after. Which
wins depends on the workload: on the Mooncake synthetic trace the rule was worth up to a point of
prefix hit rate; on the conversation trace with 52,000 blocks of HBM, DRAM and NVMe it refused
65,000 blocks and cost 1.4 points, 4% below LRU (`bench policy`, README Policies).

Both sides are measured in both states, so that the gate can change its mind:
- rule on (refusing): a spared block read from the tier counts a gain; a refused key written again
  within the tier's capacity in departures counts a loss;
- rule off (admitting every block): a block the rule would have refused that is read from the tier
  counts a loss (refusing it would have lost that hit); a block it pushed out instead of one the
  rule would have spared, written again within the same window, counts a gain.

The rule applies while the decayed gains are at least the losses (on at start, as TinyLFU); both
halve every time as many blocks left the tier as it holds, so the gate follows the workload.

Per row: a mark (spared, admitted against the rule, or pushed out by such an admission), cleared
when the row's block counts or leaves; per key that left: a hashed ghost (32-bit tag, what it was,
its departure number), one slot per key (a slot taken by another key forgets the older one: a
missed count, never a wrong one).
"""

from __future__ import annotations

import numpy as np

from dflash2.keys import fib_slots

NONE, SPARED, AGAINST, DOOMED = 0, 1, 2, 3  # row marks
REFUSED, PUSHED = 1, 2  # ghost kinds
MIN_GHOST_BITS, MAX_GHOST_BITS = 12, 22


class AdmissionGate:
    def __init__(self, rows: int):
        bits = int(np.clip(int(np.ceil(np.log2(max(rows, 1)))) + 1, MIN_GHOST_BITS, MAX_GHOST_BITS))
        self._bits = bits
        self._tag = np.zeros(1 << bits, dtype=np.uint32)
        self._kind = np.zeros(1 << bits, dtype=np.int8)
        self._seq = np.zeros(1 << bits, dtype=np.uint32)
        self._stay = np.zeros(1 << bits, dtype=np.uint32)  # departures within which the ghost speaks
        self.mark = np.zeros(rows, dtype=np.int8)
        self.departures = np.uint32(0)  # blocks that left the cache from the tier
        self.capacity = 0  # the tier's blocks, as the last decision saw them (the ghosts' window)
        self._since_halving = 0
        self.gained = 0.0
        self.lost = 0.0
        self.counts = {"gained": 0, "lost": 0, "refused": 0, "admitted_against_rule": 0}

    @property
    def on(self) -> bool:
        return self.gained >= self.lost

    def grow(self, rows: int) -> None:
        mark = np.zeros(rows, dtype=np.int8)
        mark[: len(self.mark)] = self.mark
        self.mark = mark

    # -- decisions -------------------------------------------------------------------------------
    def decide(self, rows: np.ndarray, keys: np.ndarray, rule: np.ndarray, victims: np.ndarray,
               capacity: int, stays: np.ndarray | None = None) -> np.ndarray:
        """The admitted mask for candidate `rows` (with their `keys`) whose rule verdict is `rule`,
        against `victims`, the tier's blocks they would push out, best-scored first. `stays`: per
        candidate, how many departures from the tier it would have outlasted had it been admitted
        (default: the tier's capacity)."""
        self.capacity = max(int(capacity), 1)
        against = ~rule
        n = int(against.sum())
        if not n:
            return rule
        spared = victims[:n]  # the best of the blocks pushed out keep their places when n are refused
        if self.on:
            self.mark[spared] = SPARED
            self._remember(keys[against], REFUSED,
                           None if stays is None else np.asarray(stays)[against])
            self.counts["refused"] += n
            return rule
        self.mark[rows[against]] = AGAINST
        self.mark[spared] = DOOMED
        self.counts["admitted_against_rule"] += n
        return np.ones(len(rows), dtype=bool)

    # -- events ----------------------------------------------------------------------------------
    def read(self, rows: np.ndarray) -> None:
        """Blocks were read from the tier (moved up for a read)."""
        mark = self.mark[rows]
        self._count(int((mark == SPARED).sum()), int((mark == AGAINST).sum()))
        self.mark[rows] = NONE

    def left(self, rows: np.ndarray, keys: np.ndarray) -> None:
        """Blocks left the cache from the tier: ones pushed out instead of spared become ghosts."""
        doomed = self.mark[rows] == DOOMED
        if doomed.any():
            self._remember(keys[doomed], PUSHED)
        self._departed(len(rows))
        self.mark[rows] = NONE

    def clear(self, rows: np.ndarray) -> None:
        """Rows left the tier another way (moved up without a read, freed, reused)."""
        self.mark[rows] = NONE

    def written(self, keys: np.ndarray) -> None:
        """Keys were written again (they were cached nowhere): the ghosts among them count."""
        keys = keys[keys != 0]
        if not len(keys):
            return
        slot, tag = self._slot_tag(keys)
        found = (self._tag[slot] == tag) & (self.departures - self._seq[slot] <= self._stay[slot])
        if not found.any():
            return
        kind = self._kind[slot[found]]
        self._tag[slot[found]] = 0  # a ghost speaks once
        self._count(int((kind == PUSHED).sum()), int((kind == REFUSED).sum()))

    # -- internals -------------------------------------------------------------------------------
    def _count(self, gained: int, lost: int) -> None:
        self.gained += gained
        self.lost += lost
        self.counts["gained"] += gained
        self.counts["lost"] += lost

    def _departed(self, n: int) -> None:
        self.departures = np.uint32((int(self.departures) + n) & 0xFFFFFFFF)
        self._since_halving += n
        if self.capacity and self._since_halving >= self.capacity:
            self._since_halving = 0
            self.gained /= 2
            self.lost /= 2

    def _slot_tag(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = np.asarray(keys, dtype=np.uint64)
        tag = np.maximum((k & np.uint64(0xFFFFFFFF)).astype(np.uint32), np.uint32(1))  # 0: empty
        return fib_slots(k ^ (k >> np.uint64(29)), self._bits), tag

    def _remember(self, keys: np.ndarray, kind: int, stays: np.ndarray | None = None) -> None:
        keyed = keys != 0
        if not keyed.any():
            return
        slot, tag = self._slot_tag(keys[keyed])
        self._tag[slot] = tag
        self._kind[slot] = kind
        self._seq[slot] = self.departures
        self._stay[slot] = self.capacity if stays is None else np.asarray(stays)[keyed]

    def describe(self) -> dict:
        """The rule's state, the decayed counts that decide it, and totals since start."""
        return {"rule_on": self.on, "gained_recently": round(self.gained, 1),
                "lost_recently": round(self.lost, 1), **self.counts}
