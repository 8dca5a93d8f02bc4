"""Model-based test of the block manager with real host arenas (shared memory + an NVMe file).

Random sequences of attach, reserve, allocate, write, commit, pin, promote (all room first or in
pieces), demote, free, tick and
client death; after every step: the table's invariants hold (no block lost or owned twice, tier
usage adds up), no pinned block moved, and every block's bytes read back equal the bytes written.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dflash2.arena.nvme import NvmeArena
from dflash2.arena.shm import SharedMemoryArena
from dflash2.errors import NotOwner, PinnedBlock
from dflash2.manager import BlockManager
from dflash2.reservations import AdmissionSettings, Outcome
from dflash2.tiers import Tier
from dflash2.transfer.host import HostTransferBackend

from conftest import SMALL, SMALL_FP8, FakeClock, specs

KIB = 1024


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="dflash2-sm-")
        name = f"dflash2-sm-{uuid.uuid4().hex[:8]}"
        tier_specs = specs(hbm_blocks=6, dram_blocks=8, nvme_blocks=16)
        arenas = {
            Tier.HBM: SharedMemoryArena.create(f"{name}-hbm", tier_specs[0].capacity_bytes, Tier.HBM),
            Tier.DRAM: SharedMemoryArena.create(f"{name}-dram", tier_specs[1].capacity_bytes, Tier.DRAM,
                                                alignment=4096),
            Tier.NVME: NvmeArena.create(f"{self.tmp}/nvme.cache", tier_specs[2].capacity_bytes,
                                        staging_bytes=64 * KIB),
        }
        self.clock = FakeClock()
        self.mgr = BlockManager(tier_specs, arenas=arenas, backend=HostTransferBackend(arenas),
                                swap_batch_size=4, clock=self.clock,
                                admission=AdmissionSettings(burst_fraction=1.0, max_deferred=4))
        self.layouts = [self.mgr.register_layout(SMALL), self.mgr.register_layout(SMALL_FP8)]
        self.clients: list[int] = []
        self.expected: dict[int, bytes] = {}  # vid -> bytes written (committed or being written)
        self.writing: dict[int, int] = {}  # vid -> client, blocks not committed yet
        self.held: dict[int, list[int]] = {}  # client -> vids it holds a reference to (one per entry)
        self.pinned: dict[tuple[int, int], tuple] = {}  # (client, vid) -> place when pinned
        self.reservations: list[tuple[int, int]] = []
        self.next_key = 1
        self.rng = np.random.default_rng(0)

    def teardown(self):
        self.mgr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------
    def _write(self, vid: int) -> None:
        view = self.mgr.view(vid)
        data = self.rng.integers(0, 256, len(view), dtype=np.uint8)
        view[:] = data
        self.expected[vid] = data.tobytes()

    def _live(self) -> list[int]:
        return [v for v in self.expected if self._is_live(v)]

    def _is_live(self, vid: int) -> bool:
        try:
            self.mgr.table.rows([vid])
            return True
        except Exception:
            return False

    # -- rules -----------------------------------------------------------------------------
    @initialize()
    def two_clients(self):
        self.attach()
        self.attach()

    @rule()
    def attach(self):
        c = self.mgr.attach(f"c{len(self.clients)}")
        self.clients.append(c)
        self.held[c] = []

    @precondition(lambda self: self.clients)
    @rule(ci=st.integers(0, 7), li=st.integers(0, 1), n=st.integers(1, 3))
    def allocate_and_write(self, ci, li, n):
        c = self.clients[ci % len(self.clients)]
        vids = self.mgr.allocate(c, self.layouts[li], n)
        if vids is None:
            return
        for v in vids.tolist():
            self._write(v)
            self.writing[v] = c
            self.held[c].append(v)

    @precondition(lambda self: self.clients)
    @rule(ci=st.integers(0, 7), tokens=st.integers(1, 64), prio=st.integers(0, 2))
    def reserve_and_take(self, ci, tokens, prio):
        c = self.clients[ci % len(self.clients)]
        d = self.mgr.reserve(c, self.layouts[0], tokens, priority=prio)
        if d.outcome is Outcome.GRANTED:
            vids = self.mgr.take(c, d.reservation_id, 1)
            for v in vids.tolist():
                self._write(v)
                self.writing[v] = c
                self.held[c].append(v)
            self.reservations.append((c, d.reservation_id))

    @precondition(lambda self: self.writing)
    @rule(i=st.integers(0, 50), keyed=st.booleans())
    def commit(self, i, keyed):
        vid = list(self.writing)[i % len(self.writing)]
        c = self.writing.pop(vid)
        keys = None
        if keyed:
            keys = [self.next_key]
            self.next_key += 1
        out = int(self.mgr.commit(c, [vid], keys=keys)[0])
        assert out == vid  # fresh keys never deduplicate

    @precondition(lambda self: any(self.held.values()))
    @rule(i=st.integers(0, 50))
    def free(self, i):
        c = next(c for c in self.clients if self.held.get(c))
        vid = self.held[c][i % len(self.held[c])]
        try:
            self.mgr.free(c, [vid])
        except PinnedBlock:
            # only the owner's last reference to its own pinned private block is refused
            assert (c, vid) in self.pinned and self.held[c].count(vid) == 1
            return
        self.held[c].remove(vid)
        self.writing.pop(vid, None)

    @precondition(lambda self: self.clients and self.expected)
    @rule(ci=st.integers(0, 7), i=st.integers(0, 50))
    def acquire(self, ci, i):
        c = self.clients[ci % len(self.clients)]
        live = [v for v in self._live() if v not in self.writing]
        if not live:
            return
        vid = live[i % len(live)]
        try:
            got = self.mgr.acquire(c, [vid])
        except NotOwner:
            return  # another client's private block: refused, nothing changed
        if got is None:
            return
        assert got[0].tier == Tier.HBM
        assert bytes(self.mgr.view(vid)) == self.expected[vid], "bytes differ after promotion"
        if (c, vid) not in self.pinned:
            self.pinned[(c, vid)] = (got[0].tier, got[0].offset)
        else:
            self.mgr.release(c, [vid])  # keep one pin per (client, vid) in the model

    @precondition(lambda self: self.pinned)
    @rule(i=st.integers(0, 50))
    def release(self, i):
        key = list(self.pinned)[i % len(self.pinned)]
        self.mgr.release(*key[:1], [key[1]])
        del self.pinned[key]

    @precondition(lambda self: self.expected)
    @rule(i=st.integers(0, 50), to=st.sampled_from([Tier.HBM, Tier.DRAM, Tier.NVME]))
    def move(self, i, to):
        c = self.mgr.table.cols
        live = self._live()
        if not live:
            return
        vid = live[i % len(live)]
        row = self.mgr.table.rows([vid])
        if c.pins[row][0] or c.state[row][0] != 3 or c.tier[row][0] == to:
            return
        if to < c.tier[row][0]:
            self.mgr.placement.promote(row, to)
        else:
            self.mgr.mover.move(row, to)

    @precondition(lambda self: self.expected)
    @rule(picks=st.lists(st.integers(0, 50), min_size=2, max_size=6), below=st.sampled_from([Tier.DRAM, Tier.NVME]),
          pieces=st.booleans())
    def demote_then_promote_several(self, picks, below, pieces):
        """Several blocks down, then up together: in pieces of one small block, making room for
        each while the previous one comes up (the path of large blocks), or all room first (that of
        small ones)."""
        c = self.mgr.table.cols
        live = self._live()
        if not live:
            return
        rows = self.mgr.table.rows(sorted({live[i % len(live)] for i in picks}))
        rows = rows[(c.pins[rows] == 0) & (c.state[rows] == 3)]
        self.mgr.mover.move(rows[c.tier[rows] < int(below)], below)
        rows = rows[(c.tier[rows] > int(Tier.HBM)) & (c.state[rows] == 3)]
        if not len(rows):
            return
        placement = self.mgr.placement
        placement.PROMOTE_PIECES_MIN_BLOCK = 0 if pieces else type(placement).PROMOTE_PIECES_MIN_BLOCK
        placement.PROMOTE_PIECE_BYTES = SMALL.block_bytes
        try:
            placement.promote(rows, Tier.HBM)
        finally:
            del placement.PROMOTE_PIECES_MIN_BLOCK, placement.PROMOTE_PIECE_BYTES

    @rule(seconds=st.floats(0, 5))
    def tick(self, seconds):
        self.clock.advance(seconds)
        self.mgr.tick()

    @precondition(lambda self: self.clients)
    @rule(ci=st.integers(0, 7))
    def client_dies(self, ci):
        c = self.clients.pop(ci % len(self.clients))
        self.mgr.detach(c)
        self.held.pop(c, None)
        self.pinned = {k: v for k, v in self.pinned.items() if k[0] != c}
        self.writing = {v: o for v, o in self.writing.items() if o != c}

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def table_is_consistent(self):
        self.mgr.check_invariants()

    @invariant()
    def pinned_blocks_did_not_move(self):
        for (c, vid), place in self.pinned.items():
            p = self.mgr.place(vid)
            assert (p.tier, p.offset) == place, f"pinned block {vid:#x} moved"

    @invariant()
    def memory_bytes_match(self):
        for vid in self._live():
            p = self.mgr.place(vid)
            if p.tier != Tier.NVME:
                assert bytes(self.mgr.view(vid)) == self.expected[vid], f"bytes of {vid:#x} in {p.tier.label} differ"

    @invariant()
    def held_blocks_are_live(self):
        for c, vids in self.held.items():
            for v in vids:
                assert self._is_live(v), f"client {c} still holds {v:#x} but it was freed"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockManager = BlockManagerMachine.TestCase
