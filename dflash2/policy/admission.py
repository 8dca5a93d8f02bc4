"""Frequency sketch for admission (TinyLFU): how often a content key was asked for lately.

Most KV blocks are used once (more than half on the Mooncake traces) and only push out blocks that
would have been reused. The sketch remembers how often each content key was referenced, including
keys whose blocks were evicted long ago, so that a block recomputed for the third time is known to
be popular the moment it is written again. It is a count-min sketch: `depth` rows of small
counters indexed by independent hashes of the key; an estimate is the minimum over the rows (never
an undercount until aging). Every `sample` increments all counters are halved, so the counts decay
and old popularity fades. All operations are vectorised over numpy arrays of keys.

Heat consults the rule only at a full last tier: a tier with another below it admits every block,
what it pushes out moving down rather than out (`bench policy` on the Mooncake synthetic and
conversation traces with DRAM and NVMe below HBM: refusing at every full tier gave 0.7 and 0.4
points less prefix hit rate than refusing at the last one only; with DRAM alone below, no
difference), and the gate (gate.py) keeps the rule only while the blocks it refuses come back no
more often than those the tier lets go (the Mooncake conversation trace with HBM 4000 / DRAM 16000 /
NVMe 32000 blocks: the rule alone refused 65,000 blocks and found 0.3410 of references in some
tier, LRU 0.3553; gated, 0.3537).
"""

from __future__ import annotations

import numpy as np

from dflash2.counts import repeats
from dflash2.table.rowspace import is_mapped, reserve_or_plain

# Odd 64-bit multipliers (splitmix64 constants and friends): one independent hash per sketch row.
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93],
                  dtype=np.uint64)
COUNTER_MAX = 15  # 4-bit counters, as in Caffeine's FrequencySketch
DOUBLING_CHUNK = 1 << 20  # counters widened a step at a time (`_double`: 2 MB of scratch)
# A victim idle for this many times the cache's published blocks, in references (the policy's
# logical clock), counts as referenced 0 times lately, whatever the sketch still says: the sketch
# halves only after its sample of references or a half-life of wall time, and until then a once
# popular block that nobody reads kept out every newcomer that had not yet been read as often. A
# review's popularity shift (100 five-block prefixes read 15 times each, then 120 new ones read in a
# loop) over HBM 200 / DRAM 400 / NVMe 300 blocks: the last tier's 300 old blocks refused the new
# ones for 15 passes of the loop, heat 0.622 of references against LRU's 0.9511; 0.8387 at 4, 0.8724
# at 3, 0.9244 at 1, while the synthetic trace's tiered replays lost blocks at 2 and 1 (0.3529 and
# 0.3525 against 0.3571 at HBM 500 / DRAM 2000 / NVMe 4000) and none at 4 or 8
# (docs/policy-experiments.md, "Stale victims").
STALE_TURNOVERS = 4


def coldest_covering(scores: np.ndarray, held: np.ndarray, push: int) -> np.ndarray:
    """Positions of the lowest `scores`, lowest first, whose `held` slot bytes together cover `push`
    bytes: the blocks a full tier lets go for that many (of one slot size, push / slot of them)."""
    k = min(len(scores), -(-push // int(held.min())))
    low = np.argpartition(scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    low = low[np.argsort(scores[low], kind="stable")]
    return low[:int(np.searchsorted(np.cumsum(held[low]), push)) + 1]


def slab_ranks(alloc, offsets: np.ndarray, scores: np.ndarray, held: np.ndarray, slot: int) -> np.ndarray:
    """Each block's rank where room for `slot`-byte slots is made by whole slabs (slabroom.py): its
    slab's highest score, and a block of that slot size its own. Ranked by their own scores, the
    blocks an admission compared a large candidate with lay spread over every slab while the room
    was made by emptying a slab, hot blocks and all (a review: a block asked for once pushed out two
    asked for six times)."""
    heads = alloc.slabs_of(offsets)
    top = np.full(int(heads.max()) + 1, -np.inf)
    np.maximum.at(top, heads, scores.astype(np.float64))
    return np.where(held == slot, scores, top[heads])


class FrequencySketch:
    def __init__(self, width: int = 1 << 16, depth: int = 4, sample_factor: int = 10, max_width: int | None = None):
        """`max_width`: the width it may be widened to in place (`grow`), reserved up front and
        untouched until used (rowspace.py); past it a widening copies."""
        if width <= 0 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two, got {width}")
        if not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"sketch depth must be 1..{len(_SEEDS)}, got {depth}")
        self.depth = depth
        self._sample_factor = sample_factor
        self._seeds = _SEEDS[:depth, None].copy()
        # The counters, row after row (a table of width w is the first depth * w cells).
        self._cells_buf = self._buffer(depth * max(width, max_width or width), depth * width)
        self._use(width)
        self.additions = 0

    @staticmethod
    def _buffer(cells: int, need: int) -> np.ndarray:
        return reserve_or_plain(np.uint8, cells, need, "frequency sketch", "counters", after=", copied at each widening")

    @property
    def mapped_bytes(self) -> int:
        """The counters in use, where they lie in a reservation (unseen by tracemalloc)."""
        return self.table.nbytes if is_mapped(self._cells_buf) else 0

    def _use(self, width: int) -> None:
        """Count in the first depth x `width` cells: the width and what follows from it."""
        self.table = table = self._cells_buf[: self.depth * width].reshape(self.depth, width)
        self.width = width
        self.sample = self._sample_factor * width  # halve all counters after this many increments
        self._flat = table.reshape(-1)  # a view: row r's counter c is cell r * width + c
        self._row_base = np.arange(self.depth, dtype=np.int64)[:, None] * width
        self._shift = np.uint64(64 - int(np.log2(width)))

    def _cells(self, keys: np.ndarray) -> np.ndarray:
        """Each key's counter in each row, as cells of the flat table (depth x keys). (An array's
        uint64 products wrap without a warning: no `errstate` needed.)"""
        k = np.asarray(keys, dtype=np.uint64).reshape(1, -1)
        h = (k ^ (k >> np.uint64(31))) * self._seeds
        h >>= self._shift  # top bits: the best-mixed ones
        return h.astype(np.int64) + self._row_base

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Approximate recent reference count of each key (0 for a key never seen)."""
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        return self._flat[self._cells(keys)].min(axis=0).astype(np.int64)

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Count one reference of each key; returns the estimates after counting."""
        keys = np.asarray(keys, dtype=np.uint64)
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        cells = self._cells(keys)
        flat = self._flat
        counts = flat[cells]
        # Conservative update: only the counters at the current minimum grow (less overcounting).
        est = counts.min(axis=0)
        grow = (counts == est) & (est < COUNTER_MAX)
        cells = cells[grow]
        if not repeats(cells):
            # No counter named twice (the usual batch: distinct keys, no hash collision): each
            # grows by one from below COUNTER_MAX, so none saturates.
            flat[cells] = counts[grow] + 1
        else:
            # One saturating add per counter, however many keys of the batch hit it: counted in
            # uint8 (np.add.at), 256 references of one key in a batch would wrap its counters to 0.
            cells, times = np.unique(cells, return_counts=True)
            flat[cells] = np.minimum(flat[cells] + times, COUNTER_MAX)
        self.additions += len(keys)
        if self.additions >= self.sample:
            self.halve()
        return np.minimum(est.astype(np.int64) + 1, COUNTER_MAX)

    def grow(self, width: int) -> None:
        """Widen to `width` counters a row (a power of two, more than now), every key's estimate
        kept: a key's counter is the top bits of its hash, so one more bit splits each counter into
        two neighbours, and both start from the old count (an estimate never falls below the true
        count; the keys that shared the old counter each keep it until the halvings wear it off).
        Halving comes after as many more additions as the new width holds."""
        if width & (width - 1) or width <= self.width:
            raise ValueError(f"a sketch grows to a larger power of two than {self.width}, not {width}")
        if self.depth * width > len(self._cells_buf):
            buf = self._buffer(self.depth * width, self.depth * width)
            buf[: self.table.size] = self._cells_buf[: self.table.size]
            self._cells_buf = buf
        while self.width < width:
            self._double()

    def _double(self) -> None:
        """Twice the width, in place: row r's counter i goes to cells 2i and 2i+1 of the new row r,
        whose cells begin at 2rw. Rows from the last, each from its top, so that no write lands on
        a counter not yet read (new row r starts past old row r's cells and beyond, and within a
        row a chunk's new cells start at twice its old offset). A fresh array held the daemon's loop
        190 ms at 4 x 2**23 counters (its pages faulted in at once, on the 2-core VM)."""
        w, flat = self.width, self._cells_buf
        for r in range(self.depth - 1, -1, -1):
            for hi in range(w, 0, -DOUBLING_CHUNK):
                lo = max(0, hi - DOUBLING_CHUNK)
                # Each counter as both bytes of a uint16 (x * 0x0101): one pass, where np.repeat went
                # element by element (44 against 18 ms at 4 x 2**23 counters, on the 2-core VM).
                pair = flat[r * w + lo: r * w + hi].astype(np.uint16) * np.uint16(0x0101)
                flat[2 * r * w + 2 * lo: 2 * r * w + 2 * hi] = pair.view(np.uint8)
        self._use(2 * w)

    def halve(self, times: int = 1) -> None:
        """Age every count by half, `times` over (after `sample` additions, and every half-life of the
        policy): one shift, however many half-lives went by."""
        self.table >>= min(times, 8)  # eight clear any uint8 counter
        self.additions >>= min(times, 63)


class FrequencyAdmission:
    """TinyLFU's rule: a block enters a full tier only when its key was referenced more often lately
    than the block it would push out (the tier's coldest). Unlike a fixed second-hit bar it adapts:
    when the tier's coldest blocks are once-used too, a once-used newcomer (more recent) gets in."""

    def __init__(self, sketch: FrequencySketch):
        self.sketch = sketch

    def admit(self, keys: np.ndarray, victim_keys: np.ndarray, key_bytes: np.ndarray | None = None,
              victim_bytes: np.ndarray | None = None, stale: np.ndarray | None = None) -> np.ndarray:
        """Mask over `keys`: the i-th most frequent candidate is admitted when it beats the i-th
        least frequent victim; candidates beyond the victims (the tier has room) are admitted.
        With the slot bytes of each (`key_bytes`, `victim_bytes`): the candidates, most frequent
        first, take the victims' bytes, least frequent first, in turn, and each is admitted when it
        was referenced at least as often as every victim whose bytes it takes (the last of them, the
        most frequent); one past the victims' bytes is admitted. A block as large as many is
        compared with all of them: counted a block each, a 2 MiB block referenced once was compared
        with one of the 128 blocks of 16 KiB it pushed out, and pushed out 127 referenced six times.
        With equal sizes this is the rule above. `stale`: a mask over the victims idle too long for
        their counts to say anything (STALE_TURNOVERS): each counts as referenced 0 times."""
        cand = self.sketch.estimate(keys)
        ok = np.ones(len(keys), dtype=bool)
        if not len(victim_keys) or not len(keys):
            return ok
        if key_bytes is None or victim_bytes is None:
            key_bytes = np.ones(len(keys), dtype=np.int64)
            victim_bytes = np.ones(len(victim_keys), dtype=np.int64)
        order = np.argsort(-cand, kind="stable")
        against = self.sketch.estimate(victim_keys)
        if stale is not None:
            against[stale] = 0
        weak = np.argsort(against, kind="stable")
        weakest = against[weak]
        taken = np.cumsum(np.asarray(victim_bytes, dtype=np.int64)[weak])
        end = np.cumsum(np.asarray(key_bytes, dtype=np.int64)[order])
        start = end - np.asarray(key_bytes, dtype=np.int64)[order]
        pushing = start < taken[-1]  # (past the victims' bytes: the tier has room for it)
        last = np.minimum(np.searchsorted(taken, end[pushing], side="left"), len(taken) - 1)
        ok[order[pushing]] = cand[order[pushing]] >= weakest[last]
        return ok
