"""Model-based test of the daemon's service as its loop drives it, over a slow disk.

The block manager's own model test (test_state_machine.py) runs every call to its end. The daemon
does not (settling.py, rebalance.py, promotion.py): a promotion's reads from NVMe and the writes a
call's room takes are left in flight while the loop answers other calls; a call that meets copies
not yet ended is parked and run again, whole, once they have; drain pieces between requests leave
their copies in flight too. Here random sequences of several clients' calls (allocate, or reserve
and take, and write, blocks of two layouts; commit, free, lookup, acquire and check every byte read, release, detach,
attach), drain slices, background steps and the disk catching up run through
`Service.handle_frames` with parking on, on real host arenas whose NVMe file answers each read and
write only after DISK_S (or at once while the disk catches up). A client with a parked call sends
nothing else until it is answered, as a client waiting for its reply does; parked calls run again
in the order they came, as the server's `_answer_parked` runs them. After every step: the table's
invariants hold with copies in flight, every cached block in a memory tier holds its key's bytes,
a pinned block has not moved and holds its bytes, a parked call changed no pin or reference, and no
call failed with an internal error. (Runs of 300 to 500 examples of its versions ran clean on the
2-core VM when it was written; CI runs `max_examples`. Made to settle no call that names a block in
flight, it failed in each of three fresh runs: an acquire refused, IllegalTransition.)
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dflash2 import protocol as P
from dflash2.assemble import build_manager
from dflash2.config import parse_config
from dflash2.daemon.service import Parked, Service
from dflash2.layout import Layout
from dflash2.protocol import Op
from dflash2.table import BlockState
from dflash2.tiers import Tier

# Two models' layouts, as on a node that serves a bf16 and an fp8 model: blocks of 64 and 32 KiB share
# every tier (HBM, DRAM and NVMe of 1 MiB hold 16 of the larger each: a few chains fill them, and
# blocks go down and come back up). A chain's blocks are of one layout.
LAYOUTS = (Layout("sm-bf16", num_layers=8, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16),
           Layout("sm-fp8", num_layers=8, num_kv_heads=2, head_dim=64, dtype="fp8_e4m3", tokens_per_block=16))
DISK_S = 0.05  # each NVMe read or write answers this late (past PARK_AFTER_S: its callers are parked)
# Errors a call may answer in this model without a bug: a looked-up block evicted before its acquire
# (an engine's documented race), HBM without room for an allocation or a promotion now.
EXPECTED_ERRORS = {"UnknownBlock", "NoCapacity", "NeverFits"}
_PATTERNS: dict[tuple[int, int], np.ndarray] = {}


def pattern(key: int, nbytes: int) -> np.ndarray:
    """The bytes every block of content key `key` holds, in blocks of `nbytes`."""
    got = _PATTERNS.get((key, nbytes))
    if got is None:
        got = _PATTERNS[(key, nbytes)] = np.random.default_rng(key).integers(0, 256, nbytes, dtype=np.uint8)
    return got


def raw(m, tier: int, offset: int, nbytes: int) -> np.ndarray:
    """A block's bytes where the table says it lies, as a client reads them through its mapping:
    no settling of the copies in flight (`BlockManager.view` ends them first)."""
    return m.arenas[Tier(tier)].view(offset, nbytes)


class SlowDisk:
    """The NVMe arena's reads and writes, each answered DISK_S late, or at once while `catch_up` runs."""

    def __init__(self, nvme):
        self.fast = threading.Event()
        for what in ("read_blocks", "write_blocks"):
            io = getattr(nvme, what)

            def slow(offsets, buffers, io=io):
                self.fast.wait(DISK_S)
                return io(offsets, buffers)
            setattr(nvme, what, slow)


class Client:
    def __init__(self, cid: int, token: str):
        self.cid, self.token = cid, token
        self.busy = False  # a call of its is parked: it sends nothing else until answered
        self.writing: tuple[np.ndarray, list[int], int | None] | None = None  # allocated: (vids, keys, parent)
        self.held: list[np.ndarray] = []  # committed vids it still holds (free them)
        self.found: list[tuple[np.ndarray, list[int]]] = []  # lookups' hits: (vids, keys), to acquire
        self.pinned: list[tuple[np.ndarray, list[int], list[tuple[int, int]]]] = []  # (vids, keys, places)
        self.reservation: tuple[int, int, bool] | None = None  # (id, blocks, granted)


class ServingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="dflash2-serve-sm-")
        cfg = parse_config({
            "enable": True, "device": {"kind": "host"},
            "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 1,
                       "nvme_path": f"{self.tmp}/nvme.cache", "staging_buffer_size_mb": 1, "page_kb": 128},
            "kv_block": {"block_size": 16, "prefetch_window": 2},
            # (Low watermarks: the steps begin drains often, whose pieces leave copies in flight.)
            "policy": {"name": "heat", "swap_batch_size": 8, "duel_sample": 0,
                       "watermarks": {"hbm": {"high": 0.6, "low": 0.4}, "dram": {"high": 0.6, "low": 0.4}}},
            "daemon": {"endpoint": f"ipc://{self.tmp}/d.sock"},
            "logging": {"format": "text", "level": "warning"}})
        self.mgr = build_manager(cfg, instance=f"dflash2-serve-sm-{uuid.uuid4().hex[:8]}")
        self.disk = SlowDisk(self.mgr.arenas[Tier.NVME])
        self.svc = Service(self.mgr, lease_timeout_s=600.0, heartbeat_interval_s=60.0, pid_alive=lambda pid: True)
        self.svc.parking = True  # as the server's loop (server.py `_parking`)
        self.mgr.placement.read_later = True
        self.clients: list[Client] = []
        self.parked: list[tuple] = []  # (client, op, args, arrays, Parked, on_reply), in the order they came
        self.chains: list[tuple[int, list[int]]] = []  # committed chains (layout index, keys root first)
        self.next_key = 1
        self.call_id = 0
        self.layout_ids: list[int] = []  # the daemon's ids of LAYOUTS
        for _ in range(2):
            self.attach()

    def teardown(self):
        self.disk.fast.set()
        self.mgr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the loop ---------------------------------------------------------------------------
    def _call(self, client: Client | None, op: Op, args=None, arrays=(), on_reply=None, again: Parked | None = None):
        """One request through the service as the server hands it over; a Parked one waits in
        `parked` (its client busy), a reply goes to `on_reply(reply)`."""
        self.call_id += 1
        frames = P.encode_request(op, self.call_id, None if client is None else client.cid, args or {},
                                  list(arrays), token=None if client is None else client.token)
        cols = self.mgr.table.cols
        before = (int(cols.pins.sum()), int(cols.refs.sum()))
        out = self.svc.handle_frames(frames, again)
        if isinstance(out, Parked):
            assert (int(cols.pins.sum()), int(cols.refs.sum())) == before, f"a parked {op.value} pinned or held blocks"
            client.busy = True
            self.parked.append((client, op, args, arrays, out, on_reply))
            return
        reply = P.decode_reply(out)
        self.svc.after_reply()  # the reader's prefetch window (server.py `_answer`)
        assert reply.error_type != "InternalError", reply.error
        if client is not None:
            client.busy = False
        if on_reply is not None:
            on_reply(reply)

    def _idle(self, i: int) -> Client | None:
        idle = [c for c in self.clients if not c.busy]
        return idle[i % len(idle)] if idle else None

    # -- rules ------------------------------------------------------------------------------
    # (No rule has a precondition: whether a call was parked depends on the disk's timing, and
    # hypothesis wants the rules it may draw to be the same when it runs an example again.)
    @rule()
    def attach(self):
        if len(self.clients) >= 4:
            return
        reply = None

        def got(r):
            nonlocal reply
            reply = r
        self._call(None, Op.ATTACH, {"name": f"c{len(self.clients)}", "pid": 1,
                                     "layouts": [lay.to_dict() for lay in LAYOUTS]}, on_reply=got)
        assert reply.ok, reply
        self.layout_ids = reply.result["layouts"]
        self.clients.append(Client(reply.result["client"], reply.result["token"]))

    @rule(i=st.integers(0, 7), choice=st.integers(0, 5), n=st.integers(1, 6), pick=st.integers(-1, 30))
    def client_step(self, i, choice, n, pick):
        """An idle client's next call, as an engine's request goes: write a new chain (allocate and
        write, commit, free) or read a cached one (lookup, acquire, release)."""
        c = self._idle(i)
        if c is None:
            return
        if c.writing is not None:
            self._commit(c)
        elif c.reservation is not None:
            self._use_reservation(c, choice)
        elif c.found and choice < 4:
            self._acquire(c)
        elif c.pinned and choice % 2 == 0:
            self._release(c)
        elif c.held and choice % 2 == 1:
            self._free(c)
        elif self.chains and choice < 2:
            self._lookup(c, max(pick, 0))
        elif choice == 5:
            self._reserve(c, n, i % 2)
        else:
            self._allocate_and_write(c, n, pick, i % 2)

    # (As `client_step`: clients' calls are most of what the loop sees, and rules are drawn evenly.)
    @rule(i=st.integers(0, 7), choice=st.integers(0, 5), n=st.integers(1, 6), pick=st.integers(-1, 30))
    def client_step_2(self, i, choice, n, pick):
        self.client_step(i, choice, n, pick)

    @rule(i=st.integers(0, 7), choice=st.integers(0, 5), n=st.integers(1, 6), pick=st.integers(-1, 30))
    def client_step_3(self, i, choice, n, pick):
        self.client_step(i, choice, n, pick)

    @rule(i=st.integers(0, 7), choice=st.integers(0, 5), n=st.integers(1, 6), pick=st.integers(-1, 30))
    def client_step_4(self, i, choice, n, pick):
        self.client_step(i, choice, n, pick)

    def _allocate_and_write(self, c, n, extend, li):
        """Allocate n blocks of layout `li` for a new chain (or, of its layout, one extending a
        committed chain's last block) and write each with its key's bytes."""
        short = [ch for ch in self.chains if len(ch[1]) <= 4]  # (a read of the whole chain fits in HBM)
        li, base = short[extend % len(short)] if extend >= 0 and short else (li, [])
        nbytes = LAYOUTS[li].block_bytes
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += n

        def got(r):
            if not r.ok or not r.result.get("allocated"):
                assert r.ok or r.error_type in EXPECTED_ERRORS, r
                return
            rec = np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE)
            vids = rec["vid"].copy()
            for t, o, k in zip(rec["tier"].tolist(), rec["offset"].tolist(), keys):
                raw(self.mgr, t, o, nbytes)[:] = pattern(k, nbytes)
            c.writing = (vids, base + keys, len(base), li)
        self._call(c, Op.ALLOCATE, {"layout": self.layout_ids[li], "n": n}, on_reply=got)

    def _reserve(self, c, n, li):
        """Reserve room for n blocks of layout `li` (granted now, deferred to a later step, or refused)."""
        def got(r):
            self._expect_ok(r)
            if r.ok and r.result["outcome"] != "rejected":
                c.reservation = (r.result["reservation_id"], n, r.result["outcome"] == "granted", li)
        self._call(c, Op.RESERVE, {"layout": self.layout_ids[li], "tokens": n * LAYOUTS[li].tokens_per_block},
                   on_reply=got)

    def _use_reservation(self, c, choice):
        """Take a granted reservation's blocks and write them (a chain of their own); ask whether a
        deferred one was granted since; or give it up."""
        rid, n, granted, li = c.reservation
        if choice == 0:
            def cancelled(r):
                self._expect_ok(r)
                c.reservation = None
            self._call(c, Op.CANCEL, {"reservation": rid}, on_reply=cancelled)
        elif not granted:
            def status(r):
                self._expect_ok(r)
                outcome = r.result.get("outcome") if r.ok else "rejected"
                c.reservation = None if outcome not in ("granted", "deferred") else (rid, n, outcome == "granted", li)
            self._call(c, Op.RESERVATION, {"reservation": rid}, on_reply=status)
        else:
            keys = list(range(self.next_key, self.next_key + n))
            self.next_key += n

            def taken(r):
                assert r.ok, r  # granted: its blocks are the client's to take
                c.reservation = None
                rec = np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE)
                nbytes = LAYOUTS[li].block_bytes
                for t, o, k in zip(rec["tier"].tolist(), rec["offset"].tolist(), keys):
                    raw(self.mgr, t, o, nbytes)[:] = pattern(k, nbytes)
                c.writing = (rec["vid"].copy(), keys, 0, li)
            self._call(c, Op.TAKE, {"reservation": rid, "n": n}, on_reply=taken)

    def _commit(self, c):
        """Commit what the client wrote, under the chain it extends when that is still cached."""
        vids, keys, at, li = c.writing
        own = keys[at:]
        parent = None
        if at:
            # Its parent: the extended chain's last block, if a lookup still finds the whole of it.
            found = self.mgr.table.lookup(keys[:at], self.layout_ids[li])
            if len(found) < at:
                keys, at = own, 0  # the prefix is gone: a chain of its own
            else:
                parent = int(self.mgr.table.vids(found[-1:])[0])

        def got(r):
            c.writing = None
            if not r.ok:
                assert r.error_type in EXPECTED_ERRORS, r
                return
            c.held.append(np.frombuffer(r.arrays[0], dtype=P.VIDS_DTYPE).copy())
            self.chains.append((li, keys))
        args = {} if parent is None else {"parent": parent}
        self._call(c, Op.COMMIT, args, [vids.astype(P.VIDS_DTYPE).tobytes(),
                                        np.array(own, dtype=P.KEYS_DTYPE).tobytes()], on_reply=got)

    def _free(self, c):
        vids = c.held.pop(0)
        self._call(c, Op.FREE, {}, [vids.astype(P.VIDS_DTYPE).tobytes()],
                   on_reply=lambda r: self._expect_ok(r))

    def _lookup(self, c, pick):
        li, keys = self.chains[-1 - pick % len(self.chains)]

        def got(r):
            self._expect_ok(r)
            rec = np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE)
            if len(rec):
                c.found.append((rec["vid"].copy(), keys[:len(rec)], LAYOUTS[li].block_bytes))
        self._call(c, Op.LOOKUP, {"layout": self.layout_ids[li]}, [np.array(keys, dtype=P.KEYS_DTYPE).tobytes()],
                   on_reply=got)

    def _acquire(self, c):
        """Acquire the blocks a lookup found: each must come up holding its key's bytes."""
        vids, keys, nbytes = c.found.pop(0)

        def got(r):
            if not r.ok or not r.result.get("acquired"):
                assert r.ok or r.error_type in EXPECTED_ERRORS, r
                return
            rec = np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE)
            for v, t, o, k in zip(vids.tolist(), rec["tier"].tolist(), rec["offset"].tolist(), keys):
                assert t == int(Tier.HBM), f"acquired block {v:#x} answered in {Tier(t).label}"
                assert np.array_equal(raw(self.mgr, t, o, nbytes), pattern(k, nbytes)), \
                    f"acquired block {v:#x} (key {k}) holds other bytes"
            c.pinned.append((vids, keys, list(zip(rec["tier"].tolist(), rec["offset"].tolist())), nbytes))
        self._call(c, Op.ACQUIRE, {}, [vids.astype(P.VIDS_DTYPE).tobytes()], on_reply=got)

    def _release(self, c):
        vids = c.pinned.pop(0)[0]
        self._call(c, Op.RELEASE, {}, [vids.astype(P.VIDS_DTYPE).tobytes()], on_reply=lambda r: self._expect_ok(r))

    @rule(i=st.integers(0, 7), j=st.integers(0, 63))
    def acquire_a_block_in_flight(self, i, j):
        """A reader acquires a block whose copy is in flight now (as one whose lookup found it just
        before a drain piece or another reader's promotion began to move it)."""
        c = self._idle(i)
        if c is None or c.writing is not None:
            return
        cols = self.mgr.table.cols
        moving = np.flatnonzero((cols.state == int(BlockState.MIGRATING)) & (cols.key != 0))
        if not len(moving):
            self.drain_slice()  # a drain piece, if one is due: its copies are left in flight
            moving = np.flatnonzero((cols.state == int(BlockState.MIGRATING)) & (cols.key != 0))
        if not len(moving):
            return
        row = moving[j % len(moving)]
        nbytes = LAYOUTS[self.layout_ids.index(int(cols.layout[row]))].block_bytes
        c.found.insert(0, (self.mgr.table.vids(np.array([row])), [int(cols.key[row])], nbytes))
        self._acquire(c)

    @rule(i=st.integers(0, 7))
    def detach(self, i):
        c = self._idle(i)
        if c is None or len(self.clients) < 2:
            return

        def got(r):
            self._expect_ok(r)
            self.clients.remove(c)
        self._call(c, Op.DETACH, on_reply=got)

    @rule()
    def drain_slice(self):
        """A slice of the drain between requests (none begins while calls are parked: server.py)."""
        if self.mgr.draining() and not self.parked:
            self.mgr.drain_slice(0.005, lambda within_s=0.0: False)

    @rule()
    def background_step(self):
        """The server's step: the copies in flight end first (waiting for the disk), then the tick."""
        assert self.mgr.placement.settle_when_done(None, time.perf_counter() + 10), "copies did not end"
        self.mgr.tick(drain=False, duel=False)

    @rule()
    def disk_catches_up(self):
        """The copies in flight end; the parked calls run again, in order, until one parks again."""
        self.disk.fast.set()
        try:
            deadline = time.monotonic() + 10
            while self.mgr.copies_running():
                assert time.monotonic() < deadline, "copies did not end"
                time.sleep(0.001)
            while self.parked:
                client, op, args, arrays, parked, on_reply = self.parked.pop(0)
                waiting = len(self.parked)
                self._call(client, op, args, arrays, on_reply, again=parked)
                if len(self.parked) > waiting:  # parked again: back to the front, the rest behind it
                    self.parked.insert(0, self.parked.pop())
                    break
        finally:
            self.disk.fast.clear()

    def _expect_ok(self, r):
        assert r.ok or r.error_type in EXPECTED_ERRORS, r

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def table_is_consistent(self):
        self.mgr.check_invariants()

    @invariant()
    def cached_blocks_hold_their_keys_bytes(self):
        m = self.mgr
        c = m.table.cols
        keyed = np.flatnonzero((c.key != 0) & np.isin(c.state, [int(BlockState.RESIDENT), int(BlockState.MIGRATING)])
                               & np.isin(c.tier, [int(Tier.HBM), int(Tier.DRAM)]))
        nbytes = m.table.block_bytes(keyed).tolist()
        for row, tier, offset, key, n in zip(keyed.tolist(), c.tier[keyed].tolist(), c.offset[keyed].tolist(),
                                             c.key[keyed].tolist(), nbytes):
            assert np.array_equal(raw(m, tier, offset, n), pattern(int(key), n)), f"row {row} (key {key}) holds other bytes"

    @invariant()
    def pinned_blocks_stay_with_their_bytes(self):
        for c in self.clients:
            for vids, keys, places, nbytes in c.pinned:
                rows = self.mgr.table.rows(vids)  # UnknownBlock if a pinned block was dropped
                cols = self.mgr.table.cols
                for v, row, k, place in zip(vids.tolist(), rows.tolist(), keys, places):
                    assert (int(cols.tier[row]), int(cols.offset[row])) == place, f"pinned block {v:#x} moved"
                    assert np.array_equal(raw(self.mgr, *place, nbytes), pattern(k, nbytes)), \
                        f"pinned block {v:#x} holds other bytes"


ServingMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=250, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestServing = ServingMachine.TestCase
