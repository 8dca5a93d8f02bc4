"""Audit of the chain selection by pointer jumping (forest.py) as placement and the table use it.

A model-based test over prefix trees (metadata only, so that many steps run): chains and branches
of two layouts, pins, references, blocks lost (drop_lost) and their orphans, demotions and drops
through placement (make_room on HBM with and without lower tiers, the heat policy's admission
refusing into a full last tier), evictions of whole subtrees in any order or refused whole. After
every step the table's invariants hold, no pinned block moved, and no demotion or eviction put a
parent in a slower tier than its child (descendants leave a tier first).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dflash2.errors import NeverFits, PinnedBlock
from dflash2.manager import BlockManager
from dflash2.table import BlockState
from dflash2.table.columns import NO_ROW
from dflash2.tiers import Tier

from conftest import SMALL, SMALL_FP8, FakeClock, specs
from test_forest import leaving_by_levels

KIB = 1024
RESIDENT = int(BlockState.RESIDENT)


def inversions(table) -> set[tuple[int, int]]:
    """(parent vid, child vid) of every cached child that lies in a faster tier than its parent."""
    c = table.cols
    live = table.live_rows()
    linked = live[c.parent[live] != NO_ROW]
    par = c.parent[linked].astype(np.int64)
    bad = c.tier[par] > c.tier[linked]
    return set(zip(table.vids(par[bad]).tolist(), table.vids(linked[bad]).tolist()))


def subtree(table, row: int) -> list[int]:
    """The row and its cached descendants."""
    c = table.cols
    live = table.live_rows()
    out, front = [row], [row]
    while front:
        kids = live[np.isin(c.parent[live], front)].tolist()
        out += kids
        front = kids
    return out


class PrefixPlacementMachine(RuleBasedStateMachine):
    @initialize(below=st.sampled_from([(), (Tier.DRAM,), (Tier.DRAM, Tier.NVME)]),
                policy=st.sampled_from(["heat", "heat", "lru", "lfu"]), batch=st.sampled_from([2, 64]))
    def setup(self, below, policy, batch):
        self.clock = FakeClock()
        self.mgr = BlockManager(specs(hbm_blocks=8, dram_blocks=6 if below else 0,
                                      nvme_blocks=6 if Tier.NVME in below else 0),
                                policy=policy, swap_batch_size=batch, clock=self.clock)
        # A step's drain runs to its end, whatever the machine's load: cut short by its 50 ms of real
        # time, the steps made the runs differ, and a failure did not replay (Hypothesis: flaky).
        self.mgr.placement.REBALANCE_BUDGET_S = 60.0
        self.t = self.mgr.table
        self.layouts = [self.mgr.register_layout(SMALL), self.mgr.register_layout(SMALL_FP8)]
        self.clients = [self.mgr.attach("a"), self.mgr.attach("b")]
        self.held: dict[int, list[int]] = {c: [] for c in self.clients}  # one entry per reference
        self.pinned: dict[tuple[int, int], tuple[int, int]] = {}  # (client, vid) -> (tier, offset)
        self.next_key = 1
        self.rng = np.random.default_rng(0)

    def teardown(self):
        if hasattr(self, "mgr"):
            st_ = self.mgr.placement.stats
            for name in ("demoted", "evicted", "not_admitted", "lost"):
                event(f"{name}: {'some' if getattr(st_, name) else 'none'}")
            self.mgr.close()

    # -- helpers ---------------------------------------------------------------------------
    def _published(self, layout: int | None = None) -> np.ndarray:
        c = self.t.cols
        live = self.t.live_rows()
        live = live[c.key[live] != 0]
        if layout is not None:
            live = live[c.layout[live] == layout]
        return live

    def _placing(self, step):
        """Run a placement step: it must not put a parent below a child it did not already have there."""
        before = inversions(self.t)
        out = step()
        assert inversions(self.t) <= before, "a parent left for a slower tier before its child"
        return out

    # -- rules -----------------------------------------------------------------------------
    @rule(ci=st.integers(0, 1), li=st.integers(0, 1), n=st.integers(1, 5), parent=st.integers(-1, 60),
          keep=st.booleans())
    def grow(self, ci, li, n, parent, keep):
        """A chain of n published blocks, under a random cached block of its layout (or a root)."""
        c = self.clients[ci % len(self.clients)]
        lid = self.layouts[li]
        try:
            vids = self._placing(lambda: self.mgr.allocate(c, lid, n))
        except NeverFits:
            return
        if vids is None:
            return
        cands = self._published(lid)  # after the room made for the blocks, which may have dropped some
        par = None
        if parent >= 0 and len(cands):
            par = int(self.t.vids(cands[parent % len(cands): parent % len(cands) + 1])[0])
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        vids = self.mgr.commit(c, vids, keys=keys, parent=par)
        if keep:
            self.held[c] += [int(v) for v in vids]
        else:
            self.mgr.free(c, vids)
        self.clock.advance(0.01)

    @precondition(lambda self: any(self.held.values()))
    @rule(i=st.integers(0, 60))
    def free(self, i):
        c = next(c for c in self.clients if self.held[c])
        vid = self.held[c][i % len(self.held[c])]
        self.mgr.free(c, [vid])
        self.held[c].remove(vid)

    def _where(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's tier and offset: what a refused acquire must leave as it was."""
        return self.t.cols.tier.copy(), self.t.cols.offset.copy()

    def _assert_chain_exceeds_hbm(self, vids, before) -> None:
        """NeverFits for an acquire of `vids`: refused before anything moved (`before`: `_where`
        taken before the call), and they and their cached ancestors take more slots than the whole
        HBM tier has (6432d9e: the prefix a promotion brings up counts)."""
        tier, offset = self._where()
        assert np.array_equal(tier, before[0]) and np.array_equal(offset, before[1]), "a refused acquire moved blocks"
        chain = self.mgr.placement.with_ancestors(self.t.rows(vids), Tier.HBM)
        layouts = self.t.cols.layout[chain]
        too_many = int(self.t.slot_sizes(Tier.HBM)[layouts].sum()) > self.t.allocators[Tier.HBM].capacity_bytes
        assert too_many or len(set(layouts.tolist())) > 1  # (or blocks of two sizes that share no page)

    @rule(ci=st.integers(0, 1), i=st.integers(0, 60), up=st.booleans())
    def pin(self, ci, i, up):
        """Pin a cached block: in HBM (acquire, its prefix first) or where it lies (table.pin)."""
        c = self.clients[ci % len(self.clients)]
        rows = self._published()
        if not len(rows):
            return
        vid = int(self.t.vids(rows[i % len(rows): i % len(rows) + 1])[0])
        if (c, vid) in self.pinned:
            return
        if up:
            before = self._where()
            try:
                got = self.mgr.acquire(c, [vid])  # a promotion: may leave a pinned parent below it
            except PinnedBlock:  # the block itself is pinned below HBM: it cannot come up now
                assert self.t.cols.pins[self.t.rows([vid])[0]] > 0
                return
            except NeverFits:  # its cached prefix, which comes up first, is longer than HBM holds
                self._assert_chain_exceeds_hbm([vid], before)
                return
            if got is None:
                return
            assert got[0].tier == Tier.HBM
        else:
            self.t.pin(c, [vid])
        row = self.t.rows([vid])
        self.pinned[(c, vid)] = (int(self.t.cols.tier[row][0]), int(self.t.cols.offset[row][0]))

    @rule(ci=st.integers(0, 1), i=st.integers(0, 60), times=st.integers(1, 4))
    def reuse(self, ci, i, times):
        """A cached block's chain read again (acquire, release): its keys count as referenced more
        often, so that the heat policy's admission refuses colder blocks into a full last tier."""
        c = self.clients[ci % len(self.clients)]
        rows = self._published()
        if not len(rows):
            return
        vids = self.t.vids(np.asarray(subtree(self.t, int(rows[i % len(rows)]))[:4], dtype=np.int64)).tolist()
        for _ in range(times):
            before = self._where()
            try:
                if self.mgr.acquire(c, vids) is None:
                    return
            except NeverFits:  # with its cached prefix, which comes up first, longer than HBM holds
                self._assert_chain_exceeds_hbm(vids, before)
                return
            except PinnedBlock:  # a block of the chain is pinned below HBM
                rows = self.t.rows(vids)
                assert ((self.t.cols.tier[rows] > int(Tier.HBM)) & (self.t.cols.pins[rows] > 0)).any()
                return
            self.mgr.release(c, vids)
            self.clock.advance(0.01)

    @rule(ci=st.integers(0, 1), i=st.integers(0, 60), order=st.sampled_from(["prefix", "leaf-first", "tail"]))
    def read_prefix(self, ci, i, order):
        """A request reads a cached prefix: its whole chain as it reads it (each parent ahead of its
        child), the same leaf first, or only its tail (the walk adds the ancestors). When any of it
        lies below HBM it comes up prefix first: every ancestor of a block acquired is then in HBM
        with it (or pinned where it lies)."""
        c = self.clients[ci % len(self.clients)]
        rows = self._published()
        if not len(rows):
            return
        path = [int(rows[i % len(rows)])]
        while self.t.cols.parent[path[-1]] != NO_ROW:
            path.append(int(self.t.cols.parent[path[-1]]))
        path = path[::-1]  # root first
        if order == "leaf-first":
            path = path[::-1]
        elif order == "tail":
            path = path[len(path) // 2:]
        vids = self.t.vids(np.asarray(path, dtype=np.int64)).tolist()
        cols = self.t.cols
        promoting = bool((cols.tier[path] > int(Tier.HBM)).any())
        try:
            got = self.mgr.acquire(c, vids)
        except NeverFits:  # a chain longer than HBM holds
            return
        except PinnedBlock:  # a block of it is pinned below HBM (a host reader's): it cannot come up now
            assert ((cols.tier[path] > int(Tier.HBM)) & (cols.pins[path] > 0)).any()
            return
        if got is None:
            return
        if not promoting:  # all in HBM already: nothing moves (a parent below stays there)
            self.mgr.release(c, vids)
            return
        for r in path:
            p = int(cols.parent[r])
            while p != NO_ROW:
                assert cols.tier[p] == int(Tier.HBM) or cols.pins[p] > 0, "a prefix left below its reader"
                p = int(cols.parent[p])
        self.mgr.release(c, vids)

    @rule(n=st.integers(1, 6), times=st.integers(2, 4), li=st.integers(0, 1))
    def hot_chain_below(self, n, times, li):
        """A chain read several times, then sent to the last tier as far as it has room (leaves
        first): a full last tier of blocks referenced more often than the colder chains that come."""
        last = self.mgr.placement.tiers[-1]
        if last == Tier.HBM:
            return
        c = self.clients[0]
        try:
            vids = self.mgr.allocate(c, self.layouts[li], n)
        except NeverFits:
            return
        if vids is None:
            return
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        vids = self.mgr.commit(c, vids, keys=keys)
        self.mgr.free(c, vids)
        for _ in range(times):
            self.mgr.acquire(c, vids)
            self.mgr.release(c, vids)
        rows = self.t.rows(vids)[::-1]  # leaves first: a move cut short leaves no parent below its child
        while len(rows) and self.t.cols.tier[rows[0]] != int(last):
            before = inversions(self.t)
            self.mgr.mover.move(rows[:1], last)
            assert inversions(self.t) <= before
            if self.t.cols.tier[rows[0]] != int(last):
                break  # no room left there
            rows = rows[1:]
        self.clock.advance(0.01)

    @precondition(lambda self: self.pinned)
    @rule(i=st.integers(0, 60))
    def unpin(self, i):
        key = list(self.pinned)[i % len(self.pinned)]
        self.mgr.release(key[0], [key[1]])
        del self.pinned[key]

    @rule(tier=st.sampled_from([Tier.HBM, Tier.DRAM]), blocks=st.integers(1, 10), cold_only=st.booleans(),
          idle_only=st.booleans())
    def make_room(self, tier, blocks, cold_only, idle_only):
        if tier not in self.mgr.specs:
            return
        self._placing(lambda: self.mgr.placement.make_room(tier, blocks * 16 * KIB, cold_only=cold_only,
                                                           idle_only=idle_only))

    @rule(seconds=st.floats(0, 3))
    def tick(self, seconds):
        self.clock.advance(seconds)
        self._placing(self.mgr.tick)

    @rule(i=st.integers(0, 60), how=st.sampled_from(["whole", "shuffled", "short", "extra", "twice"]))
    def evict_subtree(self, i, how):
        """Evict a block with its cached descendants in one table call, in any order: it goes whole
        when nobody holds any of them; a set that leaves a cached child behind, names a held block
        or the same block twice is refused whole, and nothing changes."""
        rows = self._published()
        if not len(rows):
            return
        sub = subtree(self.t, int(rows[i % len(rows)]))
        if how == "shuffled":
            sub = self.rng.permutation(sub).tolist()
        elif how == "short" and len(sub) > 1:
            sub = sub[:1] + sub[2:]  # a child of the set's root, or deeper, stays
        elif how == "extra":
            others = np.setdiff1d(self.t.live_rows(), sub)
            if len(others):
                sub = sub + [int(others[i % len(others)])]
        elif how == "twice":
            sub = sub + sub[:1]
        sub = np.asarray(sub, dtype=np.int64)
        c = self.t.cols
        distinct = len(np.unique(sub)) == len(sub)
        among = np.array([int(np.count_nonzero(c.parent[sub] == r)) for r in sub.tolist()])
        ok = distinct and bool(((c.state[sub] == RESIDENT) & (c.refs[sub] == 0) & (c.pins[sub] == 0)
                                & (c.key[sub] != 0) & (c.nkids[sub] == among)).all())
        snapshot = {name: getattr(c, name).copy() for name in ("state", "tier", "parent", "nkids", "key")}
        if ok:
            before = inversions(self.t)
            self.mgr.placement._evict(sub)
            assert (c.state[sub] == int(BlockState.FREE)).all()
            assert inversions(self.t) <= before
        else:
            with pytest.raises((PinnedBlock, ValueError)):
                self.t.evict(sub)
            for name, was in snapshot.items():
                assert (getattr(c, name) == was).all(), f"a refused evict changed {name}"

    @rule(i=st.integers(0, 60))
    def lose(self, i):
        """A block's stored bytes fail their checksum: unpublished, cut out of its tree; its orphans
        nobody holds go, the rest stay cached as roots. (Only blocks nobody pins: a pinned block
        never moves, so it is never read back from NVMe.)"""
        rows = self._published()
        rows = rows[self.t.cols.pins[rows] == 0]
        if not len(rows):
            return
        vid = int(self.t.vids(rows[i % len(rows): i % len(rows) + 1])[0])
        self.mgr.mover.lost.append(vid)
        self.mgr.placement._drop_lost()

    @precondition(lambda self: len(self.clients) > 1)
    @rule(ci=st.integers(0, 1))
    def client_dies(self, ci):
        c = self.clients.pop(ci % len(self.clients))
        self.mgr.detach(c)
        del self.held[c]
        self.pinned = {k: v for k, v in self.pinned.items() if k[0] != c}

    @rule(seed=st.integers(0, 2**16))
    def leaving_is_the_level_walk(self, seed):
        """On whatever tree the steps left (pins, orphans, children below): pointer jumping picks
        the rows, in the order, of the walk one level per round."""
        rng = np.random.default_rng(seed)
        scores = rng.integers(0, 4, size=self.t.cols.capacity).astype(np.float32)
        for tier in self.mgr.placement.tiers:
            for evict in (False, True):
                reach = self.mgr.placement.movable(tier, evict=evict)
                below = reach & (scores <= rng.integers(0, 4))
                want = leaving_by_levels(self.mgr.placement, tier, below, evict, scores)
                got = self.mgr.placement._leaving(tier, np.flatnonzero(below), evict, scores)
                assert got.tolist() == want.tolist()
        refused = self.t.live_rows()
        refused = refused[rng.random(len(refused)) < 0.6]
        drop = self.mgr.placement._droppable(refused)
        c = self.t.cols
        # What the drop loop before did: evictable ones, then again while any became evictable.
        kept, want = refused, []
        nk = c.nkids.copy()
        while len(kept):
            ready = kept[(c.state[kept] == RESIDENT) & (c.refs[kept] == 0) & (c.pins[kept] == 0)
                         & (c.key[kept] != 0) & (nk[kept] == 0)]
            if not len(ready):
                break
            want += ready.tolist()
            up = c.parent[ready]
            np.subtract.at(nk, up[up != NO_ROW], 1)
            kept = kept[~np.isin(kept, ready)]
        assert sorted(drop.tolist()) == sorted(want)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def table_is_consistent(self):
        if hasattr(self, "mgr"):
            self.mgr.check_invariants()

    @invariant()
    def pinned_blocks_did_not_move(self):
        for (c, vid), place in self.pinned.items():
            row = self.t.rows([vid])
            assert (int(self.t.cols.tier[row][0]), int(self.t.cols.offset[row][0])) == place

    @invariant()
    def held_blocks_are_live(self):
        for c, vids in getattr(self, "held", {}).items():
            for v in vids:
                self.t.rows([v])  # UnknownBlock if it was freed under its holder


PrefixPlacementMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPrefixPlacement = PrefixPlacementMachine.TestCase
