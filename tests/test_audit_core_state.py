"""Model-based test of the block table alone (metadata only: allocators, no arenas), with moves left
in flight between other operations: random allocate, open, commit (chained, deduplicating), free,
reference, pin, unpin, begin and end moves (succeeding or failing), evict, drop as lost and client
death, over layouts whose slabs span one page or several. After every step: the table's invariants
(tier usage adds up with the in-flight destinations, refs and pins match the clients, parents are
cached, keys index exactly the published rows), no two blocks share bytes, pinned blocks stay put."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dflash2.alloc import SlotAllocator
from dflash2.errors import IllegalTransition, NotOwner, PinnedBlock, UnknownBlock
from dflash2.invariants import check_invariants
from dflash2.layout import Layout
from dflash2.table import BlockState, BlockTable
from dflash2.tiers import Tier

from conftest import MLA, SMALL, SMALL_FP8, FakeClock

KIB = 1024
PAGE = 32 * KIB
# 48 KiB + a bit: slabs of several 32 KiB pages
WIDE = Layout("wide", num_layers=3, num_kv_heads=1, head_dim=65, dtype="fp16", tokens_per_block=64)
S = BlockState


class TableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        allocators = {Tier.HBM: SlotAllocator(12 * PAGE, PAGE, 256),
                      Tier.DRAM: SlotAllocator(16 * PAGE, PAGE, 4096),
                      Tier.NVME: SlotAllocator(24 * PAGE, PAGE, 4096)}
        self.t = BlockTable(allocators, clock=FakeClock(), capacity=4)  # small: rows grow
        self.lids = [self.t.register_layout(lay) for lay in (SMALL, SMALL_FP8, MLA, WIDE)]
        self.clients: list[int] = []
        self.moves: list[tuple[np.ndarray, Tier, np.ndarray]] = []  # in flight
        self.pinned_at: dict[int, tuple[int, int]] = {}  # row -> (tier, offset) while pinned
        self.next_key = 1

    # -- helpers ---------------------------------------------------------------------------
    def _client(self, i: int) -> int:
        return self.clients[i % len(self.clients)]

    def _live(self, state: BlockState | None = None) -> np.ndarray:
        rows = self.t.live_rows()
        return rows if state is None else rows[self.t.cols.state[rows] == int(state)]

    def _pick(self, rows: np.ndarray, i: int) -> int:
        return int(rows[i % len(rows)])

    def _held(self, ci: int, i: int, kind: str) -> tuple[int, int]:
        """A client holding references (or pins), and one of the rows it holds them on."""
        holders = [c for c in self.clients if getattr(self.t.clients[c], kind)]
        c = holders[ci % len(holders)]
        rows = sorted(getattr(self.t.clients[c], kind))
        return c, rows[i % len(rows)]

    def _in_flight(self) -> set[int]:
        return {int(r) for rows, _, _ in self.moves for r in rows}

    # -- rules -----------------------------------------------------------------------------
    @initialize()
    def two_clients(self):
        self.attach()
        self.attach()

    @rule()
    def attach(self):
        self.clients.append(self.t.add_client(f"c{len(self.clients)}"))

    @precondition(lambda self: self.clients)
    @rule(ci=st.integers(0, 7), li=st.integers(0, 3), n=st.integers(0, 4),
          tier=st.sampled_from([Tier.HBM, Tier.DRAM]), reserved=st.booleans(), prio=st.integers(0, 3))
    def allocate(self, ci, li, n, tier, reserved, prio):
        self.t.allocate(self._client(ci), self.lids[li], n, tier=tier, priority=prio,
                        state=S.RESERVED if reserved else S.WRITING)

    @precondition(lambda self: len(self._live(S.RESERVED)))
    @rule(i=st.integers(0, 99))
    def open_write(self, i):
        r = self._pick(self._live(S.RESERVED), i)
        self.t.open_write(int(self.t.cols.owner[r]), self.t.vids(np.array([r])))

    @precondition(lambda self: len(self._live(S.WRITING)))
    @rule(i=st.integers(0, 99), n=st.integers(1, 3), keyed=st.booleans(), dedup=st.booleans(),
          chain=st.booleans())
    def commit(self, i, n, keyed, dedup, chain):
        c = self.t.cols
        writing = self._live(S.WRITING)
        owner = int(c.owner[self._pick(writing, i)])
        mine = writing[c.owner[writing] == owner][:n]
        vids = self.t.vids(mine)
        keys = None
        if keyed:
            keys = list(range(self.next_key, self.next_key + len(mine)))
            self.next_key += len(mine)
            published = self._live()[c.key[self._live()] != 0]
            if dedup and len(published):
                # a block whose key is cached already, in the same layout: deduplicated
                same = published[c.layout[published] == c.layout[mine[0]]]
                if len(same):
                    keys[0] = int(c.key[self._pick(same, i)])
        parent = None
        published = self._live()[(c.key[self._live()] != 0)]
        if keyed and chain and len(published):
            parent = int(self.t.vids(np.array([self._pick(published, i + 1)]))[0])
        self.t.commit(owner, vids, keys, parent)
        # A deduplicated copy its writer pinned stays where it is, pinned, until released: no pin
        # moves to another row (pinned_blocks_stay_put holds every pinned row to its place).

    @precondition(lambda self: len(self._live(S.MIGRATING)))
    @rule(i=st.integers(0, 99))
    def commit_in_flight_is_refused(self, i):
        c = self.t.cols
        r = self._pick(self._live(S.MIGRATING), i)
        owner = int(c.owner[r])
        if owner not in self.t.clients:
            return  # published, or its owner died mid-move (freed when the move ends)
        try:
            self.t.commit(owner, self.t.vids(np.array([r])), [self.next_key])
        except (IllegalTransition, UnknownBlock):
            return
        raise AssertionError("a block in flight was committed")

    @precondition(lambda self: any(self.t.clients[c].refs for c in self.clients))
    @rule(ci=st.integers(0, 7), i=st.integers(0, 99))
    def free(self, ci, i):
        c, r = self._held(ci, i, "refs")
        if self.t.cols.state[r] == int(S.RESERVED):
            return  # only its reservation frees a RESERVED block (the manager refuses it)
        try:
            self.t.free(c, self.t.vids(np.array([r])))
        except PinnedBlock:
            assert self.t.cols.pins[r] > 0

    @precondition(lambda self: self.clients and len(self._live()))
    @rule(ci=st.integers(0, 7), i=st.integers(0, 99), pin=st.booleans(), prio=st.none() | st.integers(0, 7))
    def reference_or_pin(self, ci, i, pin, prio):
        c = self._client(ci)
        r = self._pick(self._live(), i)
        if pin and self.t.cols.state[r] == int(S.MIGRATING):
            return  # moves run inside one call of the manager: no pin arrives mid-move
        vids = self.t.vids(np.array([r]))
        try:
            if pin:
                self.t.pin(c, vids)
                self.pinned_at.setdefault(r, (int(self.t.cols.tier[r]), int(self.t.cols.offset[r])))
            else:
                self.t.add_ref(c, vids)
        except (NotOwner, UnknownBlock):
            return
        except Exception as e:  # a RESERVED block: its reservation's alone
            assert self.t.cols.state[r] == int(S.RESERVED), e
            return
        if prio is not None:  # a request of that priority holds it now (lapses when nobody does)
            self.t.raise_priority(np.array([r]), prio)

    @precondition(lambda self: any(self.t.clients[c].pins for c in self.clients))
    @rule(ci=st.integers(0, 7), i=st.integers(0, 99))
    def unpin(self, ci, i):
        c, r = self._held(ci, i, "pins")
        self.t.unpin(c, self.t.vids(np.array([r])))
        if self.t.cols.pins[r] == 0:
            self.pinned_at.pop(r, None)

    @precondition(lambda self: len(self._live(S.RESIDENT)))
    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=4), dst=st.sampled_from(list(Tier)))
    def begin_move(self, picks, dst):
        c = self.t.cols
        ready = self._live(S.RESIDENT)
        ready = ready[c.pins[ready] == 0]
        if not len(ready):
            return
        first = self._pick(ready, picks[0])
        src = int(c.tier[first])
        if src == int(dst):
            return
        same = ready[c.tier[ready] == src]
        rows = np.unique(np.array([self._pick(same, p) for p in picks], dtype=np.int64))
        dst_off = self.t.begin_move(rows, dst)
        if dst_off is not None:
            self.moves.append((rows, dst, dst_off))

    @precondition(lambda self: self.moves)
    @rule(i=st.integers(0, 99), ok=st.lists(st.booleans(), min_size=4, max_size=4))
    def end_move(self, i, ok):
        rows, dst, dst_off = self.moves.pop(i % len(self.moves))
        self.t.end_move(rows, dst, dst_off, np.array(ok[: len(rows)], dtype=bool))

    @precondition(lambda self: len(self._live(S.RESIDENT)))
    @rule(i=st.integers(0, 99))
    def evict(self, i):
        rows = self._live(S.RESIDENT)
        rows = rows[self.t.evictable(rows)]
        if len(rows):
            self.t.evict(np.array([self._pick(rows, i)]))

    @precondition(lambda self: len(self._live(S.RESIDENT)))
    @rule(i=st.integers(0, 99))
    def drop_lost(self, i):
        c = self.t.cols
        rows = self._live(S.RESIDENT)
        rows = rows[(c.key[rows] != 0) & (c.pins[rows] == 0)]  # a failed read never lands on a pinned block
        if len(rows):
            self.t.drop_lost(np.array([self._pick(rows, i)]))

    @precondition(lambda self: self.clients)
    @rule(ci=st.integers(0, 7))
    def client_dies(self, ci):
        c = self.clients.pop(ci % len(self.clients))
        self.t.remove_client(c)
        self.pinned_at = {r: p for r, p in self.pinned_at.items() if self.t.cols.pins[r] > 0}

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def table_is_consistent(self):
        in_flight: dict[Tier, int] = {}
        arriving: dict[Tier, int] = {}
        for rows, dst, _ in self.moves:
            in_flight[dst] = in_flight.get(dst, 0) + sum(
                self.t.slot_bytes(int(lid), dst) for lid in self.t.cols.layout[rows].tolist())
            arriving[dst] = arriving.get(dst, 0) + len(rows)
        check_invariants(self.t, in_flight, arriving)

    @invariant()
    def no_two_blocks_share_bytes(self):
        c = self.t.cols
        live = self.t.live_rows()
        for tier in Tier:
            here = live[c.tier[live] == int(tier)]
            starts = [int(o) for o in c.offset[here]]
            sizes = [self.t.slot_bytes(int(lid), tier) for lid in c.layout[here].tolist()]
            for rows, dst, off in self.moves:
                if dst == tier:
                    starts += off.tolist()
                    sizes += [self.t.slot_bytes(int(lid), tier) for lid in c.layout[rows].tolist()]
            order = np.argsort(starts)
            ends = np.array(starts)[order] + np.array(sizes, dtype=np.int64)[order]
            assert (np.array(starts)[order][1:] >= ends[:-1]).all(), f"{tier.label}: slots overlap"
            assert not len(ends) or ends.max() <= self.t.allocators[tier].capacity_bytes

    @invariant()
    def pinned_blocks_stay_put(self):
        c = self.t.cols
        for r, place in self.pinned_at.items():
            assert (int(c.tier[r]), int(c.offset[r])) == place, f"pinned row {r} moved"
            assert c.state[r] != int(S.FREE)

    @invariant()
    def counts_are_never_negative(self):
        assert (self.t.cols.refs >= 0).all() and (self.t.cols.pins >= 0).all()
        assert (self.t.cols.kids >= 0).all() and (self.t.cols.nkids >= 0).all()

    @invariant()
    def room_promised_is_room_given(self):
        """blocks_free never promises more than alloc delivers (tried on a copy: allocating for real
        would change the machine's course)."""
        for alloc in self.t.allocators.values():
            for lay in self.t.layouts:
                n = alloc.blocks_free(lay.block_bytes)
                if n:
                    assert copy.deepcopy(alloc).alloc(lay.block_bytes, n) is not None, \
                        f"blocks_free said {n} blocks of {lay.name} fit, alloc found no room"


TableMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestTableMachine = TableMachine.TestCase
