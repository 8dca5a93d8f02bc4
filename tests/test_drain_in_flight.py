"""A drain piece between requests leaves its copies in flight, and the daemon answers requests while
the disk writes (rebalance.py `settle_when_done`, settling.py).

Every test runs a real host manager (shared-memory HBM and DRAM, an NVMe file in tmp_path) whose
DRAM is over its high watermark with idle cached blocks of distinct bytes; a drain slice
(`BlockManager.drain_slice`, what the server runs between requests) starts moving them to NVMe.
The rules checked: until settled, the blocks are MIGRATING and the table's invariants hold; a call
that may touch them settles first and then sees them where they landed, bytes intact; a lookup
that does not meet them leaves the copies running; a request that arrives at the daemon while the
disk writes is answered without waiting for the write.
"""

import threading
import time

import numpy as np
import pytest
from serve_helpers import served

from dflash2 import protocol as P
from dflash2.layout import Layout
from dflash2.protocol import Op
from dflash2.table import BlockState
from dflash2.tiers import Tier

LAYOUT = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB
# DRAM: 64 blocks (1 MiB); its watermarks are the config's defaults, 0.90 / 0.80


@pytest.fixture
def mgr(small_nvme_manager):
    return small_nvme_manager


def pattern(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def stored_bytes(m, vid: int) -> np.ndarray:
    p = m.place(vid)
    if p.tier == Tier.NVME:
        buf = np.zeros(p.nbytes, np.uint8)
        assert m.arenas[Tier.NVME].read_blocks([p.offset], [buf])[0], f"block {vid:#x} reads back as a miss"
        return buf
    return np.array(m.view(vid))


def dram_over_its_high_watermark(m) -> tuple[int, int, dict[int, int]]:
    """62 of DRAM's 64 blocks cached and idle, each its own root (key k holds pattern(k)); one more
    in HBM (key 1000). Returns (client, layout id, key -> vid)."""
    a = m.attach("a")
    lid = m.register_layout(LAYOUT)
    vids = {}
    for key, tier in [(k, Tier.DRAM) for k in range(1, 63)] + [(1000, Tier.HBM)]:
        v = m.allocate(a, lid, 1, tier=tier)
        m.view(int(v[0]))[:] = pattern(key)
        v = m.commit(a, v, keys=[key])
        m.free(a, v)
        vids[key] = int(v[0])
    return a, lid, vids


def in_flight(m) -> np.ndarray:
    """Vids of the blocks whose copy is in flight."""
    c = m.table.cols
    return m.table.vids(np.flatnonzero(c.state == int(BlockState.MIGRATING)))


def start_a_piece(m) -> np.ndarray:
    """The step begins DRAM's drain; one slice between requests starts a piece. Returns the vids on
    their way to NVMe."""
    m.tick(drain=False)
    assert m.draining()
    m.drain_slice(0.5, lambda within_s: True)  # a request waits: one piece, its copies left running
    moving = in_flight(m)
    assert m.placement.in_flight and len(moving), "the piece's copies must be left in flight"
    assert m.placement._piece_cost_s[Tier.DRAM] > 0, "a piece left in flight measures its own cost (_piece_bytes)"
    return moving


def test_a_drain_piece_leaves_its_copies_in_flight_until_they_are_settled(mgr):
    _, _, vids = dram_over_its_high_watermark(mgr)
    key_of = {v: k for k, v in vids.items()}
    moving = start_a_piece(mgr)
    rows = mgr.table.rows(moving)
    assert (mgr.table.cols.tier[rows] == int(Tier.DRAM)).all(), "readable where they were until settled"
    demoted = mgr.stats()["placement"]["demoted"]
    mgr.check_invariants()  # two slots each while in flight, both counted
    mgr.settle()
    assert not mgr.placement.in_flight and not len(in_flight(mgr))
    assert all(mgr.place(int(v)).tier == Tier.NVME for v in moving)
    assert mgr.stats()["placement"]["demoted"] == demoted + len(moving), "counted when they land"
    for v in moving.tolist():
        assert np.array_equal(stored_bytes(mgr, v), pattern(key_of[v]))
    mgr.check_invariants()


def test_the_next_step_settles_the_copies_a_piece_left_in_flight(mgr):
    """The background step works on placement (prefetch, drains, grants, probes) only once the last
    piece's copies are settled: `tick` is `settled`. A mend moved the decorator onto a method put
    above it, and the step ran with the copies in flight (a review)."""
    dram_over_its_high_watermark(mgr)
    moving = start_a_piece(mgr)
    mgr.tick(drain=False)
    assert not mgr.placement.in_flight and not len(np.intersect1d(in_flight(mgr), moving))
    mgr.check_invariants()


def test_blocks_on_their_way_are_counted_once_where_they_lie(mgr):
    """stats (the `stats` op, `dflash2 status`, dflash2_tier_blocks) counts each block in the tier
    it lies in while its copy runs. Before, a piece left in flight between requests counted its
    blocks in both tiers: the destination's slots are taken at the copy's start."""
    from dflash2.metrics import _tier_families

    dram_over_its_high_watermark(mgr)
    moving = start_a_piece(mgr)
    tiers = mgr.stats()["tiers"]
    assert tiers["dram"]["blocks"] == 62 and tiers["hbm"]["blocks"] == 1 and tiers["nvme"]["blocks"] == 0, tiers
    family = next(f for f in _tier_families(mgr.stats()) if f.name == "dflash2_tier_blocks")
    assert sum(s.value for s in family.samples) == 63
    mgr.check_invariants()
    mgr.settle()
    tiers = mgr.stats()["tiers"]
    assert tiers["nvme"]["blocks"] == len(moving) and tiers["dram"]["blocks"] == 62 - len(moving), tiers
    mgr.check_invariants()


def test_a_lookup_that_does_not_meet_the_flight_leaves_it_running(mgr):
    a, lid, vids = dram_over_its_high_watermark(mgr)
    start_a_piece(mgr)
    places = mgr.lookup([1000], lid)
    assert [p.tier for p in places] == [Tier.HBM]
    assert mgr.placement.in_flight, "a lookup of a block in HBM has no reason to wait for the disk"


def test_a_lookup_that_meets_a_block_in_flight_answers_where_it_landed(mgr):
    a, lid, vids = dram_over_its_high_watermark(mgr)
    moving = start_a_piece(mgr)
    key = next(k for k, v in vids.items() if v == int(moving[0]))
    places = mgr.lookup([key], lid)
    assert not mgr.placement.in_flight
    assert len(places) == 1 and places[0].tier != Tier.DRAM, "never the DRAM slot the copy is leaving"
    assert places[0] == mgr.place(int(moving[0]))  # (on NVMe, or prefetched from there to HBM)


@pytest.mark.parametrize("call", ["acquire", "promote", "add_ref", "dedupe", "chain", "allocate_room",
                                  "free_waiting", "tick", "place", "close"])
def test_a_call_that_meets_the_flight_settles_it_first(mgr, call):
    """An acquire of a block in flight would pin it under its move (IllegalTransition); a call that
    meets a block in flight, or does placement work (makes room, promotes), settles first."""
    a, lid, vids = dram_over_its_high_watermark(mgr)
    key_of = {v: k for k, v in vids.items()}
    moving = start_a_piece(mgr)
    target = int(moving[0])
    if call == "acquire":
        places = mgr.acquire(a, [target])
        assert [p.tier for p in places] == [Tier.HBM]
        assert np.array_equal(stored_bytes(mgr, target), pattern(key_of[target]))
        mgr.release(a, [target])
    elif call == "promote":  # a DRAM block not in flight, read into HBM: a promotion
        still = next(v for v in vids.values() if v not in set(moving.tolist()) and v != vids[1000])
        assert [p.tier for p in mgr.acquire(a, [still])] == [Tier.HBM]
        mgr.release(a, [still])
    elif call == "add_ref":
        mgr.add_ref(a, [target])
        mgr.free(a, [target])
    elif call == "dedupe":  # the key of a block in flight, written again: deduplicated onto it
        mine = mgr.allocate(a, lid, 1, tier=Tier.HBM)
        assert mgr.placement.in_flight, "an allocation from free room leaves the flight running"
        assert mgr.commit(a, mine, keys=[key_of[target]]).tolist() == [target]
        mgr.free(a, [target])
    elif call == "chain":  # a new block chained under a block in flight
        mine = mgr.allocate(a, lid, 1, tier=Tier.HBM)
        mgr.free(a, mgr.commit(a, mine, keys=[5000], parent=target))
    elif call == "allocate_room":  # more blocks than DRAM has free: room is made
        free = mgr.stats()["tiers"]["dram"]["free_bytes"] // LAYOUT.block_bytes
        assert mgr.allocate(a, lid, free + 1, tier=Tier.DRAM) is not None
    elif call == "free_waiting":  # a reservation waits: granting it after the free may make room
        held = mgr.allocate(a, lid, 60, tier=Tier.HBM)  # HBM's 64 blocks: 60 held, 1 idle cached
        waiting = mgr.reserve(a, lid, 10 * LAYOUT.tokens_per_block)
        assert waiting.outcome.value == "deferred", waiting
        mgr.drain_slice(0.5, lambda within_s: True)  # (the reserve settled the first piece)
        assert mgr.placement.in_flight and mgr.admission.deferred
        mgr.free(a, held[:10])
        mgr.free(a, held[10:])
    elif call == "tick":
        mgr.tick(drain=False)
    elif call == "place":
        assert mgr.place(target).tier == Tier.NVME
    else:
        mgr.close()
        return
    assert not mgr.placement.in_flight
    mgr.check_invariants()


def test_the_calls_of_a_serving_step_leave_the_flight_running(mgr):
    """Allocations from free room, commits of new keys, frees of private blocks, reads of blocks
    already in HBM and their releases, references to blocks not in flight: none meets a drain
    piece's copies, and none waits for them (each waited for the disk: one-block allocations took
    0.8 ms on average and 15 ms at p99 beside a 48 GB drain on the H200 host). Settled afterwards,
    the blocks in flight land intact and the table's invariants hold throughout."""
    a, lid, vids = dram_over_its_high_watermark(mgr)
    key_of = {v: k for k, v in vids.items()}
    moving = start_a_piece(mgr)
    settled_s = mgr.placement.settled_s
    hot = vids[1000]  # in HBM
    for i in range(5):
        for tier in (Tier.HBM, Tier.DRAM):
            mine = mgr.allocate(a, lid, 1, tier=tier)
            assert mine is not None
            # Published in HBM (64 blocks, one used); private in DRAM (full: its cached blocks would need room)
            keyed = dict(keys=[7000 + i], parent=hot) if tier == Tier.HBM else {}
            mine = mgr.commit(a, mine, **keyed)
            mgr.check_invariants()
            mgr.free(a, mine)
        private = mgr.allocate(a, lid, 1)
        mgr.commit(a, private)
        mgr.free(a, private)
        assert [p.tier for p in mgr.acquire(a, [hot])] == [Tier.HBM]
        mgr.release(a, [hot])
        mgr.add_ref(a, [hot])
        mgr.free(a, [hot])
        mgr.check_invariants()
        assert mgr.placement.in_flight and (in_flight(mgr) == moving).all(), f"round {i} settled the flight"
    assert mgr.placement.settled_s == settled_s
    mgr.settle()
    for v in moving.tolist():
        assert mgr.place(v).tier == Tier.NVME
        assert np.array_equal(stored_bytes(mgr, v), pattern(key_of[v]))
    mgr.check_invariants()


def test_copies_that_fail_in_flight_leave_their_blocks_where_they_were(mgr, monkeypatch):
    _, _, vids = dram_over_its_high_watermark(mgr)
    key_of = {v: k for k, v in vids.items()}
    nvme = mgr.arenas[Tier.NVME]

    def failing(offsets, sources):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(nvme, "write_blocks", failing)
    moving = start_a_piece(mgr)
    mgr.settle()
    assert all(mgr.place(int(v)).tier == Tier.DRAM for v in moving)
    for v in moving.tolist():
        assert np.array_equal(stored_bytes(mgr, v), pattern(key_of[v]))
    assert not mgr.placement.writable(Tier.NVME), "NVMe backs off, as after a write that failed at once"
    mgr.check_invariants()


def test_a_drain_of_chains_in_pieces_left_in_flight_reaches_the_low_watermark(mgr):
    """DRAM over its high watermark with chains: a piece's tails are in flight when the next round
    of its room-making looks for leaves, and their parents cannot leave before them. That round
    finding nothing is no sign that the drain's cut is used up (it ended the drain at 0.80-0.92 of
    DRAM in `dflash2 bench drain`, 4 GB): the next slice settles the tails and goes on."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    keys = iter(range(1, 10_000))
    chains = []
    for _ in range(6):  # 6 chains of 10 blocks: 60 of DRAM's 64
        vids = mgr.allocate(a, lid, 10, tier=Tier.DRAM)
        group = [next(keys) for _ in range(10)]
        for v, k in zip(vids.tolist(), group):
            mgr.view(v)[:] = pattern(k)
        vids = mgr.commit(a, vids, keys=group)
        mgr.free(a, vids)
        chains.append((vids, group))
    # Each chain read last at its tail (LRU): its head is its coldest block, so the coldest blocks
    # cannot leave before their descendants, and each round of room-making finds only the 6 leaves.
    for vids, _ in chains:
        for i, row in enumerate(mgr.table.rows(vids).tolist()):
            mgr.table.touch(np.array([row]), now=mgr.table.clock() + i)
    # Pieces of 8 blocks: more than the 6 leaves a round finds (the tails, then in flight)
    mgr.placement._piece_bytes = lambda tier, seconds: 8 * LAYOUT.block_bytes
    mgr.tick(drain=False)
    for _ in range(200):
        if not mgr.draining():
            break
        mgr.drain_slice(0.5, lambda within_s: True)  # one piece each, as between back-to-back requests
        mgr.check_invariants()
    mgr.settle()
    used = mgr.stats()["tiers"]["dram"]["used_bytes"] / mgr.stats()["tiers"]["dram"]["capacity_bytes"]
    assert used <= 0.81, f"the drain stopped at {used:.2f} of DRAM"
    for vids, group in chains:
        for v, k in zip(vids.tolist(), group):
            assert np.array_equal(stored_bytes(mgr, v), pattern(k))
    mgr.check_invariants()


def test_the_daemon_answers_while_a_drain_piece_writes_to_a_slow_disk(mgr, tmp_path, monkeypatch):
    """Each NVMe batch takes 0.6 s to write. Before, the loop waited for each piece's copies, and a
    request that came meanwhile waited for the rest of the write; now it is answered while the
    disk writes, and the drain still ends where it would have."""
    dram_over_its_high_watermark(mgr)
    nvme = mgr.arenas[Tier.NVME]
    write = nvme.write_blocks
    writing = threading.Event()

    def slow(offsets, sources):
        writing.set()
        time.sleep(0.6)
        return write(offsets, sources)
    monkeypatch.setattr(nvme, "write_blocks", slow)
    mgr.tick(drain=False)  # the drain begins; the loop's idle slices run its pieces
    with served(mgr, tmp_path) as ping:
        assert writing.wait(10), "no piece began"
        waits = [ping() for _ in range(5)]
        assert max(waits) < 0.3, f"requests waited for the disk: {waits}"
        deadline = time.monotonic() + 30
        while (mgr.draining() or mgr.placement.in_flight) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not mgr.placement.in_flight
    used = mgr.stats()["tiers"]["dram"]["used_bytes"] / mgr.stats()["tiers"]["dram"]["capacity_bytes"]
    assert used <= 0.81, used
    mgr.check_invariants()


def test_a_call_that_waits_for_a_pieces_copies_puts_off_the_next_piece(mgr, monkeypatch):
    """A call that settles a drain piece's copies (an allocation, a free) waits for them: that wait
    is the piece's use of the loop, and the next piece comes PIECE_SPACING times the whole of it
    later. Before, only the slice's own time counted: a piece began right after each such answer,
    and calls back to back each waited for a piece's copies (one-block allocations at p50 2.0-6.5
    ms during a 48 GB drain on the H200 host)."""
    import zmq

    from dflash2.daemon import server as server_mod
    from dflash2.daemon.server import Server
    from dflash2.daemon.service import Service

    dram_over_its_high_watermark(mgr)
    nvme = mgr.arenas[Tier.NVME]
    write = nvme.write_blocks

    release = threading.Event()  # the disk writes the piece once the call has waited 0.2 s

    def slow(offsets, sources):
        release.wait(10)
        return write(offsets, sources)
    monkeypatch.setattr(nvme, "write_blocks", slow)
    monkeypatch.setattr(server_mod, "IDLE_AFTER_S", 5.0)  # no piece for being idle: the step's share only
    svc = Service(mgr, lease_timeout_s=60.0, heartbeat_interval_s=10.0, pid_alive=lambda pid: True)
    srv = Server(svc, "inproc://pacing", tick_interval_s=30.0)
    try:
        srv._tick()  # the drain begins: this step's share is owed
        srv._drain_slice(wait=False)  # a piece: its copies left in flight
        assert mgr.placement.in_flight and srv._drain_owed_s > 0
        piece_s = srv._piece_s
        handled = svc.handle_frames

        def a_call_that_settles(frames, *again):
            threading.Timer(0.2, release.set).start()
            mgr.settle()  # as an allocation does first (settling.py): waits for the disk
            return handled(frames, *again)
        monkeypatch.setattr(svc, "handle_frames", a_call_that_settles)
        peer = srv._ctx.socket(zmq.DEALER)
        peer.connect("inproc://pacing")
        peer.send_multipart(P.encode_request(Op.PING, 1, None, {}))
        frames = srv._sock.recv_multipart()
        before = mgr.placement.settled_s
        srv._answer(frames)
        peer.close(0)
        spent = mgr.placement.settled_s - before
        assert spent >= 0.2 and not mgr.placement.in_flight
        assert srv._piece_s == pytest.approx(piece_s + spent)
        assert srv._next_slice() >= srv._last_answer + server_mod.PIECE_SPACING * spent, \
            "the next piece would begin right after the call that waited for this one's copies"
    finally:
        srv.close()
    mgr.check_invariants()


def test_a_call_that_settles_nothing_does_not_put_off_the_next_piece(mgr, monkeypatch):
    """soak6: `settle` with no copies in flight (`places` settles unconditionally, as does a reply
    after which a prefetch window is due: manager.py `run_prefetch`) still added its microsecond to
    `settled_s`; the server took the answer for one that waited for a piece's copies and moved the
    last piece's end to it, so that calls coming back to back (readers' acquires, `places`) each put
    the next piece off by PIECE_SPACING times a piece, and the step's share of the drain never came."""
    from dflash2.daemon import server as server_mod
    from dflash2.daemon.server import Server
    from dflash2.daemon.service import Service
    import zmq

    dram_over_its_high_watermark(mgr)
    monkeypatch.setattr(server_mod, "IDLE_AFTER_S", 5.0)  # no piece for being idle: the step's share only
    svc = Service(mgr, lease_timeout_s=60.0, heartbeat_interval_s=10.0, pid_alive=lambda pid: True)
    srv = Server(svc, "inproc://pacing-nothing", tick_interval_s=30.0)
    try:
        srv._tick()
        srv._drain_slice(wait=False)  # a piece: its copies left in flight ...
        mgr.settle()  # ... and ended (by the step, or a call) before the next request
        assert not mgr.placement.in_flight and srv._drain_owed_s > 0
        ended, piece_s = srv._piece_ended, srv._piece_s
        handled = svc.handle_frames

        def a_call_that_settles_nothing(frames, *again):
            mgr.settle()  # as `places` does (service.py `_places`), and `run_prefetch` once a window is due
            return handled(frames, *again)
        monkeypatch.setattr(svc, "handle_frames", a_call_that_settles_nothing)
        peer = srv._ctx.socket(zmq.DEALER)
        peer.connect("inproc://pacing-nothing")
        before = mgr.placement.settled_s
        for _ in range(3):
            peer.send_multipart(P.encode_request(Op.PING, 1, None, {}))
            srv._answer(srv._sock.recv_multipart())
        peer.close(0)
        assert mgr.placement.settled_s == before, "settling nothing is no wait for a piece's copies"
        assert (srv._piece_ended, srv._piece_s) == (ended, piece_s)
        assert srv._next_slice() == ended + server_mod.PIECE_SPACING * piece_s, \
            "calls that waited for no copies put the next piece off"
    finally:
        srv.close()
    mgr.check_invariants()


def test_a_poll_that_makes_no_room_leaves_the_drain_copies_in_flight(small_nvme_manager):
    """A poll of a deferred reservation whose room was made already does no placement work: it
    leaves a drain piece's copies running (each poll settled them: the daemon's polls waited on, or
    parked behind, the disk; a review's test)."""
    mgr = small_nvme_manager
    a, lid, vids = dram_over_its_high_watermark(mgr)
    b = mgr.attach("b")
    mgr.allocate(a, lid, 62)  # HBM: being written, nothing to move
    d = mgr.reserve(b, lid, 3 * LAYOUT.tokens_per_block)
    assert d.outcome.value == "deferred"
    start_a_piece(mgr)
    assert mgr.placement.in_flight
    for _ in range(3):
        assert mgr.reservation_status(b, d.reservation_id).outcome.value == "deferred"
    assert mgr.placement.in_flight, "a poll with no room to make settled the drain piece's copies"
