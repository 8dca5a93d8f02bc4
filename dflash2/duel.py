"""The duel: the heat policy ranks as whichever of heat, LRU and LFU serves this node's requests best.

No one policy wins everywhere (README, Policies): heat where most blocks are used once and sessions
return (the Mooncake traces: up to +92% over LRU), LRU where every live session re-reads its whole
history (a chat shape: 0.5-1.9% ahead of heat), LFU where popularity does not change (document QA:
0.3-4.6% ahead). The duel finds out which, on the node's own requests, by replaying them in
miniature (SHARDS-style spatial sampling, Waldspurger et al., FAST '15 and USENIX ATC '17):

- each lookup's content keys are sampled by a hash of the key, 1 in `policy.duel_sample`, so that a
  sampled key is sampled in every request that names it;
- one small block manager per candidate, each tier 1/`duel_sample` of the real tier's bytes, serves
  the sampled chain as the real manager serves the full one (replay.py: lookup, read the hit prefix,
  write the rest), metadata only. A candidate is what the real policy does while it follows it: heat
  itself, or heat ranking every tier as LRU or LFU and admitting every block (with HBM alone, plain
  LRU and LFU: the same order, at less cost);
- each candidate's prefix hit rate, decayed with a half-life of HALF_LIFE miniature capacities of
  sampled references, estimates what it would find at full size;
- once a miniature has let go as many bytes as it holds (before that all three find whatever
  was asked for before; waiting for every one never judged where one keeps its working set), the
  candidate the real policy follows changes when another finds more
  blocks (by MARGIN, relative, and by Z standard deviations of their paired per-request difference)
  and no more than MARGIN fewer of them in HBM (`_judge`);
- the real heat policy then ranks its blocks as that candidate (HeatPolicy.follow) and keeps
  learning its own state meanwhile, so that following heat again takes effect at once;
- a miniature HBM of fewer than MIN_BLOCKS blocks (of the smallest layout registered) would judge
  by noise: where 1/`policy.duel_sample` of HBM holds fewer, the duel replays a finer sample, the
  coarsest that leaves MIN_BLOCKS (`_fit_sample`, said in the log); where even 1 in 2 leaves fewer,
  the duel stops, says so in the log, and heat ranks as heat; lookups of a layout of which it holds
  fewer than MIN_BLOCKS blocks are not replayed;
- nor are a host-side reader's lookups (reader=DRAM: served without HBM), those naming no layout
  while several are registered, and those a miniature refuses (a key cached for another layout,
  which the node refuses too): each counted by why (`not_replayed`, in `dflash2 status` and
  dflash2_policy_duel_not_replayed_total) and logged.

The miniatures' capacity is counted in bytes where it paces them (the half-life of their figures,
and when they have turned over): a node of several layouts (models) fills and turns over a cache's
bytes, whatever blocks they come in. Counted in blocks of the first layout looked up, as it once was, a
5-minute GPU soak whose first layout was its smallest (16 KiB, most traffic 64-256 KiB) never saw
its miniatures turn over (896 blocks of 16 KiB at 1 in 512 keys).

The bench's replays with the duel on and off are in docs/policy-experiments.md (the duel's figures).

Cost: the three miniatures take about as much CPU per request as the real manager (their chains are
short, but a call costs what it costs). A lookup only samples and queues (`offer`); the daemon
serves the queue between requests (the server's `_duel_slice` and `_duel_step`): once no request
has come for a while, one sampled lookup at a time while none waits (`run` with `yield_to`); and at
each background step, whatever waits, those expected to fit in a small share (`run` with `fits`,
their cost from `cost_s`). Served in one stretch on the tick (TICK_BUDGET_S, as the in-process
tick still does), it held every call that came meanwhile: 1024-block releases and commits waited
7-12 ms at p90 against 1-3 ms with LRU (`dflash2 bench calls`, the 2-core VM). A queue over
QUEUE_LIMIT drops its oldest requests, counted and logged (the miniatures then see fewer requests
than the node serves, with holes in each key's history). A loop that keeps falling behind
(COARSEN_AFTER dropped) makes the sample coarser instead (`_coarsen`): fewer keys replayed, each
with its whole history, in smaller miniatures, down to MIN_BLOCKS in HBM; it never grows finer
again while the daemon runs. The bench serves the queue after every request.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from dflash2.errors import DFlash2Error
from dflash2.manager import BlockManager, TierSpec
from dflash2.policy import make_policy
from dflash2.duelmini import Miniature as _Mini
from dflash2.keysample import sampled
from dflash2.tiers import Tier

log = logging.getLogger(__name__)

CANDIDATES = ("heat", "lru", "lfu")
# A challenger must lead the followed candidate by 3% of its hit rate... (heat's miniature trails
# full-size heat: its constants are absolute counts, which a miniature reaches 1/sample as often. On
# the Mooncake conversation trace at 32,000 and 52,000 blocks LRU's miniature led heat's by 2.0-2.7%
# while full-size heat found 0.4% more than LRU at 32,000: with a margin of 2% heat followed LRU
# there and found LRU's 0.3320 instead of its own 0.3332.)
MARGIN = 0.03
Z = 2.0  # ...and by 2 standard deviations of their paired per-request difference
HALF_LIFE = 32  # miniature capacities (blocks, all tiers) of sampled references
MIN_BLOCKS = 32  # a miniature HBM holding fewer blocks than this would judge by noise
MIN_PAGES = 8  # pages a miniature tier is cut into at least, while its alignment allows (`_specs`)
QUEUE_LIMIT = 4096  # sampled lookups waiting for the miniatures
# ... and sampled keys waiting, all lookups together (8 bytes each, kept as uint64 arrays): a lookup
# may name 65,536 keys, so a queue bounded by lookups alone could hold 4096 x 8,192 keys (over a
# GiB as Python ints) whenever the tick cannot keep up.
QUEUE_KEYS_LIMIT = 1 << 20
# Once COARSEN_AFTER sampled lookups were dropped since the sample last changed, the duel replays
# fewer keys (`_coarsen`): 1 in `sample` times the factor (a power of two) by which the lookups
# offered outnumbered those served meanwhile (a key in the coarser sample is in every finer one:
# multiples of the hash). A dropped lookup leaves a hole in the miniatures' history of its keys: one
# asked for again looks new there, and their figures lean toward misses the node did not have; a
# coarser sample replays fewer keys, each whole. A 5-minute GPU soak (six clients, a daemon busy
# all along) dropped 52,360 and served 2,043 at 1 in 8 keys; its miniatures never turned over.
COARSEN_AFTER = 1024
MAX_SAMPLE = 1 << 20  # as policy.duel_sample's bound
TICK_BUDGET_S = 0.01  # an in-process manager's tick serves the queue this long (the daemon's: server.py)
COST_DECAY = 0.9  # `cost_s` follows about the last ten sampled lookups served
DROP_LOG_INTERVAL_S = 60.0
MINI_ROWS_LOG2 = 14  # a miniature's table begins with at most 2^14 rows (it grows as it fills)
# Why a lookup is not replayed (`Duel.not_replayed`), with the words `dflash2 status` shows: a
# host-side reader's; one naming no layout while several are registered; one of a layout too large
# for the miniatures; one a miniature refused.
NOT_REPLAYED = {"host_reader": "by host-side readers", "no_layout": "naming no layout among several",
                "layout_too_large": "of layouts too large for the miniatures",
                "refused": "refused by a miniature (see the log)"}


def _leads(found: np.ndarray, sq: np.ndarray, a: int, b: int) -> bool:
    """Candidate a finds more than b: by MARGIN of b's figure and by Z standard deviations of the
    paired per-request difference (`sq`: its decayed squares)."""
    return found[a] > found[b] * (1 + MARGIN) and found[a] - found[b] > Z * math.sqrt(sq[a, b])


class _Reported:
    """A running count said in the log at most every DROP_LOG_INTERVAL_S, each time with how many
    since it was last said."""

    def __init__(self):
        self._said, self._at = 0, -math.inf

    def due(self, total: int) -> int | None:
        """How many since the last time, when `total` is to be said now; else None."""
        now = time.monotonic()
        if total <= self._said or now - self._at < DROP_LOG_INTERVAL_S:
            return None
        since, self._said, self._at = total - self._said, total, now
        return since


class Duel:
    """Attached to a block manager whose policy can follow another's ranking (heat): `offer` on
    every lookup, `run` to serve what was offered (the manager's tick does)."""

    def __init__(self, manager: BlockManager, sample: int, knob: str = "policy.duel_sample"):
        """`knob`: what a user sets the sample with, named where the duel turns off (the bench's
        --duel-sample: its hint named the config key, which the bench does not read, a review)."""
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 2:
            raise ValueError(f"duel sample must be an integer >= 2 (1 in N keys), got {sample!r}")
        if not hasattr(manager.policy, "follow"):
            raise ValueError(f"policy {manager.policy.name!r} cannot follow another ranking (only heat can)")
        self.manager = manager
        self._knob = knob
        # 1 in `sample` keys replayed now: finer than `first_sample` where HBM is small (`_fit_sample`),
        # coarser once the loop fell behind (`_coarsen`).
        self.sample = sample
        self.first_sample = sample
        self._fitted = False  # whether `sample` was fitted to HBM (at the first lookup offered; `_fit_sample`)
        self.coarsened = 0  # times the sample was made coarser (`_coarsen`)
        self._since_coarsened = (0, 0)  # (requests, dropped) when the sample last changed
        self.policy = manager.policy
        self.tick_budget_s = TICK_BUDGET_S
        self.following = 0  # index in CANDIDATES
        self.off: str | None = None  # why the duel stopped (None while it runs)
        # Stopped because the smallest layout then registered was too large for the miniatures: its
        # block bytes, and how many layouts were registered (a smaller one registered later starts
        # the duel again: `_reopen`). Before, the duel stayed off until a restart, so whether it ran
        # followed which client attached first (a review).
        self._too_large: tuple[int, int] | None = None
        self._queue: collections.deque = collections.deque()  # (clock, layout id, uint64 sampled keys)
        # (seconds, sampled keys) of the lookups served lately, decayed by COST_DECAY a lookup: `cost_s`.
        self._spent = (0.0, 0.0)
        self._queued_keys = 0
        self._now = 0.0
        self._minis: list[_Mini] | None = None  # made at the first sampled lookup
        # The layout id that sizes them (`_sizing_layout`), the same when they are built again.
        self._minis_layout: int | None = None
        self._capacity_blocks = 0  # the miniatures' capacity (all tiers) in blocks of that layout
        self._unit_bytes = 0  # ... those blocks' bytes: a lookup of another layout counts by its bytes
        self._largest_block = 0  # bytes of the largest block the miniatures replay lookups of (`_build`)
        self._hits = np.zeros(len(CANDIDATES))  # decayed hits per candidate (blocks found in some tier)
        self._hbm_hits = np.zeros(len(CANDIDATES))  # decayed blocks found in HBM per candidate
        self._refs = 0.0  # decayed sampled references
        self._sq = np.zeros((len(CANDIDATES), len(CANDIDATES)))  # decayed squared paired differences of hits
        self.requests = 0  # sampled lookups served by the miniatures
        self.sampled_refs = 0
        self.dropped = 0
        # Lookups the miniatures do not replay, by why (NOT_REPLAYED), each logged when it first
        # happens and then at most every DROP_LOG_INTERVAL_S (`_not_replayed`).
        self.not_replayed = dict.fromkeys(NOT_REPLAYED, 0)
        self._skips_said = {why: _Reported() for why in NOT_REPLAYED}
        self.switches = 0
        self.last_switch: dict | None = None  # when (sampled lookups served) and on what figures
        self._drops_said = _Reported()
        manager.duel = self

    # -- intake (on the lookup path: cheap) -------------------------------------------------
    def offer(self, keys: Sequence[int], layout_id: int | None, host_reader: bool = False) -> None:
        """A lookup of `keys` (a request's prefix chain): its sampled keys join the queue. Not a host-side
        reader's (reader=DRAM: the node serves it without HBM, which the miniatures would read into), nor one
        naming no layout while several are registered (which one its blocks are of is not known)."""
        if self.off is not None and not self._reopen():
            return
        if not len(keys):
            return
        if host_reader:
            self._not_replayed("host_reader")
            return
        if layout_id is None:
            layouts = self.manager.table.layouts
            if len(layouts) != 1:
                self._not_replayed("no_layout", lambda: f"it names no layout, and {len(layouts)} are registered "
                                   "(pass the layout to lookup)")
                return
            layout_id = 0  # the only one
        if not self._fitted:
            self._fit_sample()
        keys = np.asarray(keys, dtype=np.uint64)
        if not keys.all():  # key 0 is "no key": nothing is cached past it (the real lookup stops there too)
            keys = keys[:int(np.argmin(keys))]
        picked = sampled(keys, self.sample)
        if not len(picked):
            return
        self._queue.append((self.manager.table.clock(), layout_id, picked))
        self._queued_keys += len(picked)
        while len(self._queue) > QUEUE_LIMIT or (self._queued_keys > QUEUE_KEYS_LIMIT and len(self._queue) > 1):
            self._queued_keys -= len(self._queue.popleft()[2])
            self.dropped += 1
            if self.dropped - self._since_coarsened[1] >= COARSEN_AFTER:
                self._coarsen()

    # -- the miniatures ---------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether sampled lookups wait for the miniatures (the server serves them between requests)."""
        return bool(self._queue) and self.off is None

    def run(self, budget_s: float | None = None, yield_to: Callable[[], bool] | None = None,
            at_least_one: bool = False, fits: bool = False) -> None:
        """Serve the queued lookups through the miniatures (all of them, or for about `budget_s`),
        judging after each; heat's weights changed at run time reach heat's miniature first. With
        `yield_to` (whether a request waits), each lookup only while it says no: a request that
        comes meanwhile waits for one sampled lookup at most. `fits`: each only while its expected
        cost (`cost_s`) fits in what is left of `budget_s`, so that the budget bounds the time taken,
        not only when the last lookup may begin. `at_least_one`: the first whatever they say. A
        miniature that fails stops the duel (logged) and heat ranks as heat."""
        self._log_drops()
        if self.off is not None:
            return
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        if self._minis is not None:
            self._sync_weights()
        try:
            first = at_least_one
            while self._queue:
                if not first:
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and (left <= 0 or (fits and self.cost_s(len(self._queue[0][2])) > left)):
                        break
                    if yield_to is not None and yield_to():
                        break
                first = False
                now, layout_id, keys = self._queue.popleft()
                self._queued_keys -= len(keys)
                self._serve(now, layout_id, tuple(keys.tolist()))
        except Exception:
            log.exception("duel: a miniature replay failed; the duel stops and heat ranks as heat")
            self._stop("a miniature replay failed (see the log)")

    def cost_s(self, keys: int) -> float:
        """The expected seconds of serving a sampled lookup of `keys` keys: the recent seconds per
        sampled key (0 before the first)."""
        seconds, served = self._spent
        return keys * seconds / served if served else 0.0

    def _fit_sample(self) -> None:
        """Where 1/`sample` of HBM holds fewer than MIN_BLOCKS blocks of the smallest layout registered,
        replay the coarsest finer sample that leaves MIN_BLOCKS (down to 1 in 2), and say so. Before,
        the duel stopped there: HBM under 256 blocks at the default sample (a large model's blocks are
        tens of MB, so a GPU's HBM holds a few hundred) ranked as heat alone, and a review's re-read
        shape found 0.4220 of references at 200 blocks against LRU's 0.4496 (0.4464 at 1 in 4). Fitted
        once, before the first key is sampled, so that every key replayed is replayed with its whole
        history; the cost per lookup grows as the sample grows finer. Where even 1 in 2 leaves fewer,
        `sample` stays and `_build` stops the duel."""
        self._fitted = True
        layout = self.manager.table.layout(self._sizing_layout())

        def fits(sample: int) -> bool:
            return self._hbm_blocks(sample, layout) >= MIN_BLOCKS

        if fits(self.sample) or not fits(2):
            return
        # The coarsest fitting sample in [2, sample): a miniature's blocks never grow as the sample
        # grows coarser (its tier's bytes, in whole pages of a size that halves only below MIN_PAGES
        # pages, shrink with its share), so the fitting samples are those up to one bound.
        lo, hi = 2, self.sample - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        log.warning("duel: 1/%d of HBM would hold %d blocks of layout %r, fewer than %d to judge by: its "
                    "miniatures replay 1 in %d keys instead (%d blocks; about %.1f times as many keys replayed, and "
                    "their CPU, as at 1 in %d)", self.sample, self._hbm_blocks(self.sample, layout), layout.name,
                    MIN_BLOCKS, lo, self._hbm_blocks(lo, layout), self.sample / lo, self.sample)
        self.sample = lo

    def _coarsen(self) -> None:
        """The loop served too few of the sampled lookups (COARSEN_AFTER dropped since the sample last
        changed): replay 1 in `sample` x F keys, F the power of two that the lookups offered meanwhile
        outnumbered those served by (at least 2), no coarser than leaves MIN_BLOCKS blocks in a
        miniature HBM. The miniatures are built again at the new size and warm up again, and the
        queue is dropped (counted): both are of the old sample's keys. The ranking followed stays.
        At the coarsest sample the oldest lookups go on being dropped."""
        served = self.requests - self._since_coarsened[0]
        dropped = self.dropped - self._since_coarsened[1]
        offered = served + dropped + len(self._queue)
        factor = max(2, 1 << math.ceil(math.log2(offered / max(served, 1))))
        if self._minis_layout is None:
            self._minis_layout = self._sizing_layout()
        layout = self.manager.table.layout(self._minis_layout)
        while factor > 1 and (self.sample * factor > MAX_SAMPLE
                              or self._hbm_blocks(self.sample * factor, layout) < MIN_BLOCKS):
            factor //= 2
        if factor > 1:
            was, self.sample = self.sample, self.sample * factor
            self.coarsened += 1
            self.dropped += len(self._queue)
            self._queue.clear()
            self._queued_keys = 0
            self._minis = None
            self._hits[:] = self._hbm_hits[:] = self._sq[:] = 0.0
            self._refs = 0.0
            log.warning("duel: the daemon's loop served %d of %d sampled lookups lately; its miniatures now replay "
                        "1 in %d keys (1 in %d before) and warm up again", served, offered, self.sample, was)
        self._since_coarsened = (self.requests, self.dropped)

    def _serve(self, now: float, layout_id: int, keys: tuple[int, ...]) -> None:
        built = self._minis is None  # (the first lookup after a build warms them up: 4-8 times a later one's cost)
        if built:
            self._build(self._sizing_layout() if self._minis_layout is None else self._minis_layout)
            if self.off is not None:
                return
        layout = self.manager.table.layout(layout_id)
        if layout.block_bytes > self._largest_block:
            self._not_replayed("layout_too_large", lambda: f"layout {layout.name!r}'s blocks are too large for "
                               f"the miniatures (1/{self.sample} of HBM holds fewer than {MIN_BLOCKS} of them)")
            return
        began = time.perf_counter()  # (after the miniatures are built: their cost is not a lookup's)
        self._now = now
        for mini in self._minis:
            decay_to = getattr(mini.manager.policy, "decay_to", None)
            if decay_to is not None:
                decay_to(now)
        if any(m.holds_for_another(keys, layout_id) for m in self._minis):  # (before any serves it)
            self._not_replayed("refused", lambda: "a miniature holds one of its keys for another layout (the node "
                               "refuses such a commit too)")
            return
        try:
            found = np.array([m.serve(keys, layout, layout_id, now, self.requests) for m in self._minis],
                             dtype=np.float64)
        except (DFlash2Error, ValueError) as e:
            # A request the node refuses too (a key cached for another layout): skipped, not the
            # duel's end. Before, one such lookup, answered by the node without an error, turned the
            # duel off until a restart (a review's script).
            self._not_replayed("refused", lambda e=e: f"a miniature refused it ({type(e).__name__}: {e})")
            return
        hits, hbm = found[:, 0], found[:, 1]
        # The half-life in bytes referenced, in blocks of the sizing layout (a lookup of that layout
        # counts its keys: n * b / b is n exactly).
        units = len(keys) * layout.block_bytes / self._unit_bytes
        decay = 0.5 ** (units / (HALF_LIFE * self._capacity_blocks))
        self._hits = (self._hits + hits) * decay
        self._hbm_hits = (self._hbm_hits + hbm) * decay
        self._sq = (self._sq + np.square(hits[:, None] - hits[None, :])) * decay
        self._refs = (self._refs + len(keys)) * decay
        self.requests += 1
        self.sampled_refs += len(keys)
        if not built:
            self._spent = (COST_DECAY * self._spent[0] + time.perf_counter() - began,
                           COST_DECAY * self._spent[1] + len(keys))
        self._judge()

    def _specs(self, sample: int) -> list[TierSpec]:
        """The miniatures' tiers at 1/`sample` of the real ones' bytes, in whole pages: the real
        tier's, halved (down to its alignment) while the miniature would hold fewer than MIN_PAGES
        (a 16 MB tier of 2 MiB pages is one page at 1/8, none at 1/16)."""
        specs = []
        for spec in self.manager.specs.values():
            share, page = spec.capacity_bytes // sample, spec.page_bytes
            while share < MIN_PAGES * page and page // 2 >= spec.alignment and (page // 2) % spec.alignment == 0:
                page //= 2
            nbytes = share // page * page
            if nbytes:
                specs.append(TierSpec(spec.tier, nbytes, page, spec.alignment))
        return specs

    def _hbm_blocks(self, sample: int, layout) -> int:
        """Blocks of `layout` a miniature HBM holds at 1/`sample` of the real one."""
        return sum(s.capacity_bytes for s in self._specs(sample) if s.tier == Tier.HBM) // layout.block_bytes

    def _sizing_layout(self) -> int:
        """The layout whose blocks size the miniatures: the smallest registered when they are first
        built (and the same when they are built again). The first looked up, as it was, made
        whether the duel ran at all follow the order of the first lookups: a node of 4 KiB and
        512 KiB layouts whose first sampled lookup was of the large one stopped the duel for good,
        and the other way round replayed the large one in a miniature of 16 such blocks."""
        layouts = self.manager.table.layouts
        return min(range(len(layouts)), key=lambda lid: layouts[lid].block_bytes)

    def _build(self, layout_id: int) -> None:
        layout = self.manager.table.layout(layout_id)
        specs = self._specs(self.sample)
        hbm = self._hbm_blocks(self.sample, layout)
        if hbm < MIN_BLOCKS:
            # (`_fit_sample` made the sample as fine as HBM needs, down to 1 in 2: lowering it is no
            # remedy. The advice to lower it sent a node of 60 blocks at 1 in 8 to 2, to be told there
            # that HBM needs 64.)
            self._too_large = (layout.block_bytes, len(self.manager.table.layouts))
            self._stop(f"1/{self.sample} of HBM holds {hbm} blocks of layout {layout.name!r}, fewer than {MIN_BLOCKS}: "
                       f"too small a miniature to judge by (HBM needs {2 * MIN_BLOCKS} such blocks for the duel at "
                       f"the finest sample, 1 in 2; {self._knob} 0 turns it off)")
            return
        self._minis_layout = layout_id
        self._capacity_blocks = sum(s.capacity_bytes // layout.block_bytes for s in specs)
        self._unit_bytes = layout.block_bytes
        # Lookups of a layout whose blocks a miniature HBM holds fewer than MIN_BLOCKS of are not
        # replayed (`_serve`): they would judge by noise.
        self._largest_block = sum(s.capacity_bytes for s in specs if s.tier == Tier.HBM) // MIN_BLOCKS
        # Rows for what the miniatures hold, up to 2^MINI_ROWS_LOG2 to begin with (their tables grow as the
        # real one does): sized for every tier at once, a node of 80 GB of HBM and 1 TB of DRAM in
        # 128 KiB blocks took 1.1 s and about 530 MB at its first sampled lookup (a review's script).
        rows = 1 << max(10, min(MINI_ROWS_LOG2, math.ceil(math.log2(self._capacity_blocks * 2 + 1024))))
        # Rows reserved for what a miniature holds (four times its blocks of the sizing layout), not one
        # per KiB of its tiers: past a 2 TiB pool that was the real table's 2^28 rows, each (rowspace.py).
        reserve = max(rows, 1 << (4 * self._capacity_blocks).bit_length())
        self._minis = [_Mini(self._candidate(name, len(specs) > 1), specs, self._clock, rows, reserve)
                       for name in CANDIDATES]
        log.info("duel: miniatures of 1/%d of every tier (%d blocks of layout %r in all) judge heat, LRU and LFU",
                 self.sample, self._capacity_blocks, layout.name)

    def _candidate(self, name: str, tiered: bool):
        """What the real policy does while it follows `name`: heat ranking every tier as `name` and
        admitting every block (HeatPolicy.follow); with HBM alone `name`'s own policy, which costs the
        miniature less and ranks idle blocks in the same order (heat following adds its priority and
        holders' terms, and its float32 scores tie where float64 ones do not). With tiers the plain
        policies were tried and taken back while heat following ranked from stale cached scores
        (docs/policy-experiments.md, "Following in every tier")."""
        if name != "heat" and not tiered:
            return make_policy(name)
        sizes = self.policy.miniature_sizes(self.sample) if hasattr(self.policy, "miniature_sizes") else {}
        # (Its access counts halve by wall time as the real one's do: without it, the "heat" a node with
        # policy.decay_half_life_s set ran was not what its miniature judged. `_serve` applies it.)
        decay = getattr(self.policy, "decay_half_life_s", None)
        policy = type(self.policy)(dict(self.policy.weights), decay_half_life_s=decay, **sizes)
        policy.follow(name)
        return policy

    def _clock(self) -> float:
        return self._now

    def _sync_weights(self) -> None:
        for mini in self._minis:
            policy = mini.manager.policy
            if hasattr(policy, "set_weights") and getattr(policy, "weights", None) not in (None, self.policy.weights):
                policy.set_weights(self.policy.weights)  # changed at run time

    def _judge(self) -> None:
        """Follow another candidate when it finds more blocks (in some tier: by MARGIN and by Z
        standard deviations of the paired per-request difference) and no more than MARGIN fewer of
        them in HBM (with HBM alone, the first test implies the second). A block found in a lower
        tier costs a copy, one found nowhere a recompute: some tier is what counts, HBM a guard.
        While following ranked HBM alone (heat's admission kept below), candidates were asked for
        MARGIN more in HBM: asked for no fewer, heat followed LFU on the conversation trace's HBM
        2000 / DRAM 8000 row and found 0.2189 / 0.0970 in some tier / in HBM against 0.2198 / 0.0979,
        and the popularity shift whose old blocks heat's admission kept in the last tier (LRU's
        miniature finding more in some tier, as many in HBM) was never judged for LRU. Following in
        every tier, the Mooncake traces' tiered rows switch nowhere (docs/policy-experiments.md,
        "Following in every tier")."""
        if not self._turned_over():
            return
        now, hits, hbm = self.following, self._hits, self._hbm_hits
        for lead in sorted(range(len(CANDIDATES)), key=lambda c: (-hits[c], -hbm[c])):
            if lead == now:
                return  # none ahead of the followed one qualifies
            if _leads(hits, self._sq, lead, now) and hbm[lead] >= hbm[now] * (1 - MARGIN):
                break
        else:
            return
        self.following = lead
        self.switches += 1
        found, in_hbm = self.hit_rates(), self.hit_rates(hbm=True)
        self.last_switch = {"request": self.requests, "to": CANDIDATES[lead], "hit_rate": found, "hbm_hit_rate": in_hbm}
        self.policy.follow(CANDIDATES[lead])
        log.info("duel: heat now ranks as %s (miniature prefix hit rates %s; in HBM %s)", CANDIDATES[lead],
                 *(", ".join(f"{n} {r:.4f}" for n, r in rates.items()) for rates in (found, in_hbm)))

    def _turned_over(self) -> bool:
        """A miniature has let go (evicted) as many bytes as it holds (its capacity in blocks of the
        sizing layout): the candidates now differ in what they keep, not only in what they saw.
        Waiting for every miniature never judged where one candidate keeps what is asked for: after
        a popularity shift, LRU's miniature lets the old blocks go and holds the new working set,
        letting no more go, while heat's thrashed (a review: 0.891 against 0.961 in the miniatures,
        never judged; the full-size heat found 0.8711 of references at 600 blocks, LRU 0.9511)."""
        return self._refs > 0 and self.turned_over() >= 1.0

    def turned_over(self) -> float:
        """How far the miniatures are from judging: the greatest share, among them, of the bytes each
        holds that it has let go (1.0 once one has turned over; 0.0 before they are built). A duel
        warming up for long says here whether it is nearly there or has barely begun."""
        if self._minis is None:
            return 0.0
        held = self._capacity_blocks * self._unit_bytes
        return min(1.0, max(m.manager.placement.stats.evicted_bytes for m in self._minis) / held)

    def _not_replayed(self, why: str, detail: Callable[[], str] | None = None) -> None:
        """Count a lookup not replayed, and say so: the first of each kind at once, then how many
        more at most every DROP_LOG_INTERVAL_S (`detail` says why, built only then: this is the
        lookup path); a host-side reader's once, in the info log (a node of host-side readers,
        sglang's, has nothing else: a warning a minute said what is by design)."""
        n = self.not_replayed[why] = self.not_replayed[why] + 1
        if why == "host_reader":
            if n == 1:
                log.info("duel: lookups of host-side readers (reader=dram) are not replayed: the node serves them "
                         "without HBM, which the miniatures would read into (counted: dflash2 status, "
                         "dflash2_policy_duel_not_replayed_total)")
            return
        since = self._skips_said[why].due(n)
        if since is not None:
            log.warning("duel: a lookup not replayed: %s; %d not replayed so far for that reason (%d since the "
                        "last report)", detail(), n, since)

    def _reopen(self) -> bool:
        """Whether a duel stopped for too large a layout runs again: a smaller layout registered since
        (checked when the count of layouts changes)."""
        if self._too_large is None:
            return False
        block_bytes, seen = self._too_large
        layouts = self.manager.table.layouts
        if len(layouts) == seen:
            return False
        self._too_large = (block_bytes, len(layouts))
        smallest = min(layouts, key=lambda lay: lay.block_bytes)
        if smallest.block_bytes >= block_bytes:
            return False
        self.off, self._too_large, self._minis, self._minis_layout = None, None, None, None
        self.sample, self._fitted = self.first_sample, False  # (fitted again, to the smaller layout)
        log.info("duel on again: layout %r, registered since it stopped, has blocks smaller than the one it was sized "
                 "by (%d bytes against %d)", smallest.name, smallest.block_bytes, block_bytes)
        return True

    def _stop(self, why: str) -> None:
        if self.off is None:
            log.warning("duel off: %s", why)
        self.off = why
        self._queue.clear()
        self._queued_keys = 0
        self.following = 0
        self.policy.follow("heat")

    def _log_drops(self) -> None:
        since = self._drops_said.due(self.dropped)
        if since is not None:
            log.warning("duel: %d sampled lookups dropped so far (%d since the last report): the daemon's "
                        "loop left them too little time, so the miniatures see fewer requests than the node serves",
                        self.dropped, since)

    # -- reporting --------------------------------------------------------------------------
    def hit_rates(self, hbm: bool = False) -> dict[str, float | None]:
        """Each candidate's decayed miniature prefix hit rate, in some tier or (`hbm`) in HBM (None
        before the first sampled reference)."""
        if self._refs <= 0:
            return {name: None for name in CANDIDATES}
        return {name: float(h / self._refs) for name, h in zip(CANDIDATES, self._hbm_hits if hbm else self._hits)}

    def describe(self) -> dict:
        if self.off is not None:
            state = "off"
        elif not self._turned_over():
            state = "warming up"
        else:
            state = "judging"
        return {"sample": self.sample, "first_sample": self.first_sample, "coarsened": self.coarsened,
                "state": state, "off_reason": self.off,
                "following": CANDIDATES[self.following], "hit_rate": self.hit_rates(),
                "hbm_hit_rate": self.hit_rates(hbm=True),
                "turned_over": round(self.turned_over(), 4),
                "requests": self.requests, "sampled_refs": self.sampled_refs, "queued": len(self._queue),
                "dropped": self.dropped, "not_replayed": dict(self.not_replayed), "switches": self.switches,
                "last_switch": self.last_switch,
                "capacity_blocks": self._capacity_blocks}
