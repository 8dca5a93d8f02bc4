"""ARC's adaptive split: how much of a tier blocks seen for the first time may hold.

A tier's keyed blocks fall in two lists: *first-timers* (frequency class 0: their content key had no
recent reference before the write that made them) and *returning* blocks (class 1 and up: read
again while cached, or written again after they left). ARC (Megiddo and Modha, FAST '03) keeps a
target size for the first list and learns it from *ghosts*, the keys that recently left each list:
a key that comes back soon after it left as a first-timer says first-timers deserved more room (the
target grows); one that comes back soon after it left as a returning block says the returning ones
did (the target shrinks). While the first list holds more than its target it gives up blocks first;
otherwise the returning list does. The ranking policy orders blocks within a list.

So a cache that is small for its workload keeps what was asked for twice (most first-timers are never
asked for again: a second-hit filter), and one that holds most of the reuse keeps the first-timers
that come back (a multi-turn session's newest turn) instead of thrashing them.

Where this differs from ARC: what moves the target is how often each list's departures come back,
per departure, not how many come back. A room of one block more for a list keeps its departing
blocks a little longer, and wins the hits of those asked for again soon after they left: the list
whose departures come back more often per departure deserves the room. So a ghost speaks while
no more than WINDOW_SHARE of the tier's capacity in departures from the tier (either list)
followed it, one window for both lists, and a hit weighs the mean of the two lists' (decayed) departures
over its own list's. ARC counts hits in windows of each list's own departures (|B1| = c - |T1|,
|B2| = c - |T2|) and weighs them by the windows' ratio; when one list lets few blocks go, its
window spans a far longer time, and its hits count the same as the other's. On the Mooncake
synthetic trace with 32,000 blocks of HBM (an experiment following ARC's evictions), returning
blocks that left came back 56% of the time and first-timers 10%, yet the first-timers' ghosts hit
more often (1,197 against 977: they left seven times as often), ARC's target swung between 10,000
and 31,000 blocks, and heat found 0.6218 of references, below LRU's 0.6281
(docs/policy-experiments.md).

A second difference: a list whose departures lately came back less than RATE_BAND times as often as
the other list's (per departure whose window has closed or that came back) has its ghosts held: they count, but do
not move the target. A list that lets no block go has silent ghosts, and without the band the
other list's ghosts would grow its room unopposed whatever the rates said when both lists last let
blocks go.

The heat policy uses a second split of this kind in HBM, between returning blocks whose key was
referenced 2-3 times (its first list) and those referenced more often (`lists` names them).

Per tier: the target (a share of the tier's capacity in blocks, the most keyed blocks it has held),
the lists' sizes (kept by the policy from its events), each list's departures (in all, and decayed:
halved each time a capacity's worth left the tier), its recent ghost hits and departures whose
window has closed or that came back (halved at the same time), and a hashed ghost table: per slot a 32-bit tag
of the key, the list it left and the tier's departure number; a slot taken by another key forgets
the older one (a missed adaptation step, never a wrong answer).
"""

from __future__ import annotations

import numpy as np

from dflash2.counts import distinct, repeats
from dflash2.invariants import InvariantViolation
from dflash2.policy.ghosts import GhostKeys, GhostTable, ghost_bits
from dflash2.tiers import Tier

FIRST, RETURNING = 0, 1
START_SHARE = 0.0  # first-timers' target share of a tier before any ghost has spoken (ARC's)
# The side that gives up blocks changes only once the first list is this share of the tier (and at
# least one block) past its target: each change rescores every block, and ARC's own per-eviction
# alternation would change it at every eviction near the target.
HYSTERESIS = 0.01
# ARC moves the target by about one block per ghost hit: a tier of c blocks then needs c hits to
# cross, more than a large cache sees in hours (the Mooncake conversation trace, 32,000 blocks:
# 11,000 in the whole trace, and the target had not got halfway). Steps are scaled so that the
# same crossing takes about STEP_BLOCKS hits in a tier of any size (unit steps up to that size).
STEP_BLOCKS = 512
# A ghost speaks while no more departures from its tier than this share of the tier's capacity
# followed it ("soon after it left"; an experiment replaying both Mooncake traces at 2,000–52,000
# blocks: 0.25, 0.5 and 1 within 0.5% of each other, 2 lower at 2,000 blocks of the conversation trace).
WINDOW_SHARE = 0.5
# A hit weighs the mean of the lists' recent departures over its own list's, within these bounds: a
# list that let (almost) no block go lately has no measured rate, and its first returns must move the
# target without one of them crossing the tier.
MAX_HIT_WEIGHT = 64.0
# A list's ghosts move the target only while its departures come back at least RATE_BAND times as
# often as the other list's lately (per departure whose window has closed or that came back, decayed
# like the weights' departures, so that a list that stopped leaving keeps its last rate). Without
# it, while one list lets no block go its ghosts stay silent and the other's grow its room
# unopposed: on the Mooncake synthetic trace at 20,000 blocks returning blocks that left came back
# 32% of the time and first-timers 13%, yet the target rose from 0 to 3,000-6,000 blocks again and
# again, and each time bursts of returning blocks left. The band keeps a list whose rate is about
# the other's moving (the conversation trace at 16,000 blocks: 5.4% against 5.6%).
RATE_BAND = 0.5
# Until both lists have this many (decayed) departures whose window has closed (or that came back),
# every ghost moves it. The counts halve each capacity of departures, so in a tier of fewer than
# MIN_RESOLVED / 2 blocks they never get there, and the band never holds a ghost.
MIN_RESOLVED = 32
# Which list gives way first is judged against a tier's capacity (in blocks, the most keyed blocks it
# has held) cut to what it holds over this share: a tier's blocks may change size (a node serving a
# layout of 16 KiB blocks, then one of 2 MiB: 4,096 blocks, then 32), and at the old count the
# hysteresis margin (41 blocks) was larger than the whole tier, so the returning list gave way first
# for good and a hot set thrashed (a review). One layout's tier holds far more than this share of
# its capacity, and is judged as before.
CAPACITY_FALL = 0.1
LISTS = ("first_timers", "returning")  # the lists' names in `describe` (stats, metrics labels)


class AdaptiveSplit:
    def __init__(self, tiers: int, rows: int, start_share: float | None = None,
                 lists: tuple[str, str] = LISTS, target: str = "first_timer_target",
                 rate_band: float | list[float] = RATE_BAND):
        """`lists`: the names of the first list (the one with a target) and the second in `describe`;
        `target`: the name of the first list's target there; `rate_band`: RATE_BAND for every tier, or
        one per tier (0: every ghost moves the target)."""
        band = np.broadcast_to(np.asarray(rate_band, dtype=float), (tiers,)).copy() \
            if np.ndim(rate_band) == 0 or len(rate_band) == tiers else None
        if band is None or not ((band >= 0.0) & (band <= 1.0)).all():
            raise ValueError(f"rate_band must be within [0, 1], one value or one per tier ({tiers}), got {rate_band}")
        self.rate_band = band
        start_share = START_SHARE if start_share is None else start_share
        if not 0.0 <= start_share <= 1.0:
            raise ValueError(f"start_share must be within [0, 1], got {start_share}")
        self.lists, self.target_name = lists, target
        self.tiers = tiers
        self.share = np.full(tiers, float(start_share))
        self.sizes = np.zeros((tiers, 2), dtype=np.int64)  # keyed blocks per (tier, list)
        self.capacity = np.zeros(tiers, dtype=np.int64)  # most keyed blocks each tier has held
        self.first_out = np.ones(tiers, dtype=bool)  # per tier: the first list gives up blocks first
        self.ghost_hits = np.zeros((tiers, 2), dtype=np.int64)
        self.departures = np.zeros((tiers, 2), dtype=np.int64)  # per (tier, list), in all
        # Per (tier, list), halved each time `capacity` blocks left the tier (the hits' weights).
        self.recent_departures = np.zeros((tiers, 2))
        self._since_halved = np.zeros(tiers, dtype=np.int64)
        # Per (tier, list), halved with `recent_departures`: ghost hits, and departures whose window
        # has closed or that came back (RATE_BAND's rates); per (tier, list), the departures still in
        # their window that have not come back as [first departure number, count] runs, oldest first.
        self.recent_returns = np.zeros((tiers, 2))
        self.resolved = np.zeros((tiers, 2))
        self._open: list[tuple[list, list]] = [([], []) for _ in range(tiers)]
        # Per tier, made when a block first leaves it: the list each key left as its payload.
        self._rows = rows
        self._ghosts: list[GhostTable | None] = [None] * tiers

    def _ghost(self, tier: int) -> GhostTable:
        if self._ghosts[tier] is None:
            self._ghosts[tier] = GhostTable(self._rows, payload=True)
        return self._ghosts[tier]

    def grow(self, rows: int) -> None:
        """The block table grew to `rows`: ghost tables sized for it (twice its rows), their ghosts
        kept (before, each doubling forgot the recent departures: ghost hits missed for a while)."""
        if ghost_bits(rows) <= ghost_bits(self._rows):
            return
        self._rows = rows
        for g in self._ghosts:
            if g is not None:
                g.grow(ghost_bits(rows))

    # -- list sizes ----------------------------------------------------------------------------
    def recount(self, old: np.ndarray, new: np.ndarray) -> None:
        """Rows changed list or tier: `old` and `new` codes (tier * 2 + list, -1: not counted)."""
        n = 2 * self.tiers + 1  # code -1 (not counted) in bin 0
        flat = self.sizes.reshape(-1)
        flat += (np.bincount(new + 1, minlength=n) - np.bincount(old + 1, minlength=n))[1:]
        if flat.min() < 0:  # invariant: each counted row is uncounted once, under its own code
            raise InvariantViolation(f"adaptive split: a list size went negative ({self.sizes.tolist()}): "
                                     "a row was uncounted twice")
        np.maximum(self.capacity, self.sizes.sum(axis=1), out=self.capacity)

    def recount_rows(self, codes: np.ndarray, rows: np.ndarray, new: np.ndarray) -> bool:
        """Rows whose code (`codes`: the list each row is counted in, kept by the policy) changes to
        `new` move between the lists; True when any did."""
        changed = new != codes[rows]
        if not changed.any():
            return False
        rows, new = rows[changed], new[changed]
        if repeats(rows):  # a row named twice must count once
            rows, first = np.unique(rows, return_index=True)
            new = new[first]
        self.recount(codes[rows], new)
        codes[rows] = new
        return True

    # -- ghosts --------------------------------------------------------------------------------
    def left(self, codes: np.ndarray, keys: np.ndarray) -> None:
        """Keyed blocks left their tier (moved away or dropped), with the codes they were counted
        under: their keys become ghosts of that tier's list."""
        counted = codes >= 0
        codes, keys = codes[counted], GhostKeys.of(keys).take(counted)
        for code in distinct(codes):
            tier, lst = divmod(code, 2)
            mine = keys.take(codes == code)
            n, before = len(mine), self._total(tier)
            seq = np.uint32(before & 0xFFFFFFFF) + np.arange(1, n + 1, dtype=np.uint32)
            self._open_run(tier, lst, before + 1, n)
            self.departures[tier, lst] += n
            self.recent_departures[tier, lst] += n
            self._since_halved[tier] += n
            if self._since_halved[tier] >= max(1, self.capacity[tier]):
                self.recent_departures[tier] *= 0.5
                self.recent_returns[tier] *= 0.5
                self.resolved[tier] *= 0.5
                self._since_halved[tier] = 0
            self._close_windows(tier, before + n)
            self._ghost(tier).remember(mine, seq, lst)

    def _window(self, tier: int) -> float:
        """Departures from the tier after which a ghost no longer speaks."""
        return max(1.0, WINDOW_SHARE * self.capacity[tier])

    def _open_run(self, tier: int, lst: int, first: int, n: int) -> None:
        """`n` departures from `lst`, numbered from `first`, enter their window. A run counts as
        closed once its first departure's window has closed (a batch that left at once closes at
        once), and runs that began within a 64th of a window merge, so a list keeps at most about 65
        runs and a departure counts as closed at most that much, or its batch's length, early."""
        runs = self._open[tier][lst]
        if runs and first - runs[-1][0] < self._window(tier) / 64:
            runs[-1][1] += n
        else:
            runs.append([first, n])

    def _close_windows(self, tier: int, total: int) -> None:
        """Departures that a window's worth of departures followed count in their list's rate
        (`total`: the tier's departures so far)."""
        done = total - self._window(tier)
        for lst, runs in enumerate(self._open[tier]):
            while runs and runs[0][0] < done:
                self.resolved[tier, lst] += runs.pop(0)[1]

    def _returned(self, tier: int, lst: np.ndarray, since: np.ndarray) -> None:
        """Ghost hits (their lists, and the departures from the tier since each left) count in their
        list's recent returns, and their departures as resolved at once: a departure comes back at
        most once (its ghost is forgotten), so one that came back needs no window to close. Hits
        counted at once over departures counted only once their window closed read above 1 per
        departure (1.62 on a live daemon's dflash2_policy_recent_return_ratio, a review). Holding
        the hits back until their window closed instead cost heat 0.0051 of references at 2,000
        blocks of HBM on the Mooncake synthetic trace (0.1546 to 0.1495); this way moved no figure
        of `bench policy` by more than 0.0002 (docs/policy-experiments.md)."""
        number = self._total(tier) - since.astype(np.int64)  # each hit's departure number
        for l in distinct(lst):
            runs, mine = self._open[tier][l], number[lst == l]
            self.recent_returns[tier, l] += len(mine)
            if not runs:
                continue
            # A list's runs hold its departures numbered from their first to the next run's first;
            # one before the oldest open run is resolved already.
            at = np.searchsorted([r[0] for r in runs], mine, side="right") - 1
            for i, n in zip(*np.unique(at[at >= 0], return_counts=True)):
                runs[i][1] -= int(n)
                self.resolved[tier, l] += int(n)

    def recent_rates(self, tier: int) -> np.ndarray | None:
        """Each list's recent return rate (ghost hits per departure whose window has closed or that
        came back: a share, at most 1), or None while either list has fewer than MIN_RESOLVED such
        departures."""
        if (self.resolved[tier] < MIN_RESOLVED).any():
            return None
        return self.recent_returns[tier] / self.resolved[tier]

    def _moving(self, tier: int) -> np.ndarray:
        """Per list: whether its ghosts move the target now (RATE_BAND)."""
        rate = self.recent_rates(tier)
        if rate is None:
            return np.ones(2, dtype=bool)
        return rate >= self.rate_band[tier] * rate[::-1]

    def _total(self, tier: int) -> int:
        """The tier's departures so far (either list)."""
        return int(self.departures[tier].sum())

    def _departed(self, tier: int) -> np.uint32:
        """The tier's departures so far, mod 2**32: the ghosts' departure numbers."""
        return np.uint32(self._total(tier) & 0xFFFFFFFF)

    def referenced_from(self, sources: np.ndarray, keys: np.ndarray) -> None:
        """Keyed blocks were referenced again, each found in tier `sources[i]` (a read from a lower
        tier) or nowhere (`self.tiers`: written again after it left the cache): the ghosts of every
        tier above the one it was found in speak (key 0: unkeyed, ignored).

        A ghost speaks when its key is referenced, not when the key next arrives in its tier: a key
        that left the last tier comes back by a write into HBM, and one that left DRAM by a read from
        NVMe into HBM; neither arrives in the tier it left, whose target then never moved (`bench
        policy`, Mooncake conversation trace, HBM 1000 / DRAM 4000 / NVMe 8000: 0.2362 of references
        found in some tier with ghosts checked on arrival, 0.2430 on reference, LRU 0.2394)."""
        keys = GhostKeys.of(keys)
        keyed = keys.keys != 0
        sources, keys = np.asarray(sources)[keyed], keys.take(keyed)
        found_in = distinct(sources)
        for source in found_in:
            mine = keys if len(found_in) == 1 else keys.take(sources == source)
            for tier in range(min(int(source), self.tiers)):
                self.referenced(tier, mine)

    def referenced(self, tier: int, keys: np.ndarray | GhostKeys) -> None:
        """Keyed blocks that are not in `tier` or a faster one were referenced: ghosts of `tier`'s
        lists among them move its first-timers' target, each hit weighed by how few blocks its list
        lets go (a return rate per departure, above)."""
        cap = int(self.capacity[tier])
        if not len(keys) or cap == 0 or self._ghosts[tier] is None:
            return
        ghost = self._ghosts[tier]
        seq, lst = ghost.recall(keys)
        if not len(seq):
            return
        lst = lst.astype(np.int64)
        # Departures from the tier since each left (uint32 arithmetic wraps with the counter).
        since = self._departed(tier) - seq
        recent = since <= self._window(tier)
        hits = np.bincount(lst[recent], minlength=2)
        if not hits.any():
            return
        self.ghost_hits[tier] += hits
        self._returned(tier, lst[recent], since[recent])
        left = np.maximum(self.recent_departures[tier], 1.0)
        weight = np.clip(left.mean() / left, 1.0 / MAX_HIT_WEIGHT, MAX_HIT_WEIGHT)
        weight *= self._moving(tier)
        scale = max(1.0, cap / STEP_BLOCKS)
        step = scale * (hits[FIRST] * weight[FIRST] - hits[RETURNING] * weight[RETURNING])
        self.share[tier] = float(np.clip(self.share[tier] * cap + step, 0.0, cap)) / cap

    # -- the side that gives up blocks ---------------------------------------------------------
    def update_sides(self) -> bool:
        """Recompute, per tier, which list gives up blocks first; True when one changed."""
        changed = False
        # Per tier in Python floats (float64, as numpy's): a split has one to three tiers, and this
        # runs after every change of a list's size, where a dozen numpy steps on arrays of three
        # cost several times more.
        for t, (share, cap, first, held, out) in enumerate(zip(self.share.tolist(), self.capacity.tolist(),
                                                               self.sizes[:, FIRST].tolist(), self.sizes.sum(axis=1).tolist(),
                                                               self.first_out.tolist())):
            cap = min(cap, held / CAPACITY_FALL)  # (CAPACITY_FALL)
            target, margin = share * cap, max(1.0, HYSTERESIS * cap)
            if out != (first > target + margin or (out and first >= target - margin)):
                self.first_out[t] = not out
                changed = True
        return changed

    def describe(self) -> list[dict]:
        """Per tier that has held blocks: the first list's target and the lists' sizes, the ghost
        hits and departures so far (hits per departure: each list's return rate), the recent return
        rates that decide whose ghosts move the target (None until known, RATE_BAND) and whether
        each list's do now, and whether the first list gives up blocks first now."""
        first, second = self.lists
        out = []
        for t in range(self.tiers):
            if not self.capacity[t]:
                continue
            rate, moving = self.recent_rates(t), self._moving(t)
            out.append({"tier": Tier(t).label, self.target_name: round(float(self.share[t] * self.capacity[t]), 1),
                        first: int(self.sizes[t, FIRST]), second: int(self.sizes[t, RETURNING]),
                        "ghost_hits": {first: int(self.ghost_hits[t, FIRST]), second: int(self.ghost_hits[t, RETURNING])},
                        "departures": {first: int(self.departures[t, FIRST]), second: int(self.departures[t, RETURNING])},
                        "recent_return_rate": {name: None if rate is None else round(float(rate[i]), 4)
                                               for i, name in enumerate(self.lists)},
                        "ghosts_move_target": {name: bool(moving[i]) for i, name in enumerate(self.lists)},
                        f"{first}_leave_first": bool(self.first_out[t])})
        return out
