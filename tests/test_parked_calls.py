"""While the daemon serves, a call that must wait for copies not yet ended is parked, not waited for:
the loop answers other calls meanwhile, and runs the parked call again, whole, once the copies have
ended (settling.py `CopiesRunning`, server.py `_answer_parked`). A promotion's reads from NVMe are
left in flight (promotion.py `promote_later`): an acquire of blocks on NVMe, a lookup's prefetch.

Every test runs a real host manager (shared-memory HBM and DRAM, an NVMe file in tmp_path) with a
chain of blocks of distinct bytes moved down to NVMe, and a disk whose reads wait until the test lets
them go (the arena's own `read_blocks`, called late). Before, the loop waited for those reads, and
every client's calls, pings included, waited with it (soak11: 1-3 s while 1.6% of the file answered
each I/O in 1 s).
"""

import threading
import time

import numpy as np
import pytest
from observe_helpers import scrape
from serve_helpers import served

from dflash2 import protocol as P
from dflash2.client import Client
from dflash2.daemon.server import Server
from dflash2.daemon.service import Parked, Service
from dflash2.errors import DaemonUnavailable
from dflash2.layout import Layout
from dflash2.metrics import DaemonMetrics
from dflash2.protocol import Op
from dflash2.status import render
from dflash2.table import BlockState
from dflash2.tiers import Tier

LAYOUT = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB
CHAIN = [11, 12, 13, 14]  # content keys, each block chained under the one before
HOT = 1000  # a block that stays in HBM


@pytest.fixture
def mgr(small_nvme_manager):
    return small_nvme_manager


def pattern(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def chain_on_nvme(m) -> tuple[int, dict[int, int]]:
    """CHAIN written, committed, idle and moved down to NVMe; HOT cached in HBM. Returns (layout id,
    key -> vid)."""
    a = m.attach("writer")
    lid = m.register_layout(LAYOUT)
    vids, parent = {}, None
    for key in CHAIN + [HOT]:
        v = m.allocate(a, lid, 1)
        m.view(int(v[0]))[:] = pattern(key)
        v = m.commit(a, v, keys=[key], parent=None if key == HOT else parent)
        m.free(a, v)
        vids[key] = parent = int(v[0])
    rows = m.table.rows([vids[k] for k in CHAIN])
    assert m.mover.move(rows, Tier.NVME).all()
    assert all(m.place(vids[k]).tier == Tier.NVME for k in CHAIN)
    return lid, vids


class HeldDisk:
    """The NVMe arena's reads (or, `what="write_blocks"`, its writes) wait until `release` (each is
    the arena's own, only later). `started` is set once one waits."""

    def __init__(self, m, monkeypatch, what: str = "read_blocks"):
        nvme = m.arenas[Tier.NVME]
        io = getattr(nvme, what)
        self.started = threading.Event()
        self.released = threading.Event()

        def held(offsets, buffers):
            self.started.set()
            assert self.released.wait(30), f"the test never let the disk go on ({what})"
            return io(offsets, buffers)
        monkeypatch.setattr(nvme, what, held)

    @property
    def reading(self) -> threading.Event:
        return self.started

    @property
    def writing(self) -> threading.Event:
        return self.started

    def release(self) -> None:
        self.released.set()


def in_background(fn) -> tuple[threading.Thread, dict]:
    """Run a client call on a thread of its own (it is parked: the test goes on meanwhile); its
    answer lands in the dict's "out" once it returns."""
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(out=fn()), daemon=True)
    thread.start()
    return thread, got


def in_process_service(m) -> tuple[Service, object]:
    """The service as the server drives it (parking on, reads left in flight) and a `call(op, ...)`
    that answers a Parked or the decoded reply."""
    svc = Service(m, lease_timeout_s=60.0, heartbeat_interval_s=10.0, pid_alive=lambda pid: True)
    svc.parking = True
    m.placement.read_later = True

    def call(op, client=None, token=None, args=None, arrays=(), again=None):
        out = svc.handle_frames(P.encode_request(op, 1, client, args or {}, list(arrays), token=token), again)
        return out if isinstance(out, Parked) else P.decode_reply(out)
    return svc, call


def timed(fn):
    started = time.monotonic()
    out = fn()
    return out, time.monotonic() - started


def test_an_acquire_of_blocks_on_nvme_is_parked_while_the_daemon_answers_other_calls(mgr, tmp_path, monkeypatch):
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    with served(mgr, tmp_path) as ping:
        endpoint = f"ipc://{tmp_path}/d.sock"
        with Client.connect(endpoint, name="reader", layouts=[LAYOUT]) as reader, \
                Client.connect(endpoint, name="other", layouts=[LAYOUT]) as other:
            acquiring, got = in_background(lambda: reader.acquire([vids[k] for k in CHAIN]))
            assert disk.reading.wait(10), "the acquire never read from NVMe"
            # The read is held: the acquire is parked, and every call that does not need its blocks goes on.
            assert ping() < 0.5
            hot, waited = timed(lambda: other.lookup([HOT]))
            assert waited < 0.5 and hot["tier"].tolist() == [int(Tier.HBM)]
            (mine, waited) = timed(lambda: other.allocate(other.layouts[0], 1))
            assert waited < 0.5 and mine is not None
            other.view_bytes(mine[0])[:] = pattern(2000)
            (kept, waited) = timed(lambda: other.commit(mine["vid"], keys=[2000]))
            assert waited < 0.5
            assert other.acquire(kept) is not None  # in HBM already: pinned at once
            other.release(kept)
            other.free(kept)
            assert acquiring.is_alive(), "the acquire answered before its blocks were read"
            assert mgr.placement.in_flight and mgr.table.cols.pins.sum() == 0, "a parked call pins nothing"
            disk.release()
            acquiring.join(10)
            places = got["out"]
            assert places["tier"].tolist() == [int(Tier.HBM)] * len(CHAIN)
            for key, place in zip(CHAIN, places):
                assert np.array_equal(reader.view_bytes(place), pattern(key)), f"block {key} read wrong bytes"
            reader.release(places["vid"])
            stats = reader.stats()["daemon"]
    assert stats["calls_parked"] >= 1
    mgr.check_invariants()


def test_a_call_that_meets_the_reads_waits_for_them_alone(mgr, tmp_path, monkeypatch):
    """A lookup of the chain while its reads run names blocks in flight (their copies end first): it
    is parked, and answered once the reads have ended, while a ping goes on."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    with served(mgr, tmp_path) as ping:
        endpoint = f"ipc://{tmp_path}/d.sock"
        with Client.connect(endpoint, name="reader", layouts=[LAYOUT]) as reader, \
                Client.connect(endpoint, name="other", layouts=[LAYOUT]) as other:
            in_background(lambda: reader.acquire([vids[k] for k in CHAIN]))
            assert disk.reading.wait(10)
            t1, found = in_background(lambda: other.lookup(CHAIN))
            time.sleep(0.3)
            assert t1.is_alive(), "a lookup of blocks in flight answered before their copies ended"
            assert ping() < 0.5
            disk.release()
            t1.join(10)
            assert len(found["out"]) == len(CHAIN)
            assert set(found["out"]["tier"].tolist()) == {int(Tier.HBM)}, "it answers where they landed"
    mgr.check_invariants()


def test_a_lookups_prefetch_from_nvme_is_answered_before_the_disk_reads(mgr, tmp_path, monkeypatch):
    """A lookup whose prefetch window lies on NVMe answers at once, with the blocks where they lie;
    the acquire that follows waits for their reads (parked), and gets them from HBM."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    with served(mgr, tmp_path):
        with Client.connect(f"ipc://{tmp_path}/d.sock", name="reader", layouts=[LAYOUT]) as reader:
            found, waited = timed(lambda: reader.lookup(CHAIN))
            assert disk.reading.wait(10), "the lookup's prefetch never read"
            assert waited < 0.5 and len(found) == len(CHAIN)
            assert set(found["tier"].tolist()) == {int(Tier.NVME)}, "named where they lie until they land"
            threading.Timer(0.3, disk.release).start()
            places, waited = timed(lambda: reader.acquire(found["vid"]))
            assert waited >= 0.2, "the acquire did not wait for the blocks it reads"
            assert places["tier"].tolist() == [int(Tier.HBM)] * len(CHAIN)
            for key, place in zip(CHAIN, places):
                assert np.array_equal(reader.view_bytes(place), pattern(key))
            reader.release(places["vid"])
            prefetch = reader.stats()["prefetch"]
    assert prefetch["useful"] >= 1, prefetch
    mgr.check_invariants()


def test_a_parked_acquire_whose_client_gave_up_pins_nothing(mgr, tmp_path, monkeypatch):
    """The client's call timed out while parked, and it sent `forget`: run again once the reads end,
    the acquire is refused (CallForgotten), and no block stays pinned for a reader that is gone."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    with served(mgr, tmp_path):
        with Client.connect(f"ipc://{tmp_path}/d.sock", name="reader", layouts=[LAYOUT], timeout_s=0.5) as reader:
            with pytest.raises(DaemonUnavailable):
                reader.acquire([vids[k] for k in CHAIN])
            assert reader.ping() is not None  # the fresh socket's first call carries the forget
            disk.release()
            deadline = time.monotonic() + 10
            while mgr.placement.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            reader.ping()  # (a turn of the loop after the copies ended: the parked call ran again)
            counters = reader.stats()["daemon"]
            # Refused, it leaves no record of what it waited for: the reader's next acquire is a new
            # call (a record left made it one run again, a review).
            assert not mgr._came_from, mgr._came_from
    assert counters["calls_refused_forgotten"] + counters["calls_undone"] == 1, counters
    assert mgr.table.cols.pins.sum() == 0, "a block stayed pinned for a call its client gave up on"
    mgr.check_invariants()


def test_a_parked_call_changed_nothing_and_runs_again_whole(mgr, monkeypatch):
    """In process (the service as the server drives it): the acquire starts its reads and is parked
    (`Parked(own_parks=1)`) with nothing pinned or counted; a detach meanwhile is parked too, its
    session kept; once the reads end, both run again and do their whole work."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    svc, call = in_process_service(mgr)
    att = call(Op.ATTACH, args={"name": "r", "pid": 1, "layouts": [LAYOUT.to_dict()]})
    cid, token = att.result["client"], att.result["token"]
    other = call(Op.ATTACH, args={"name": "o", "pid": 1, "layouts": [LAYOUT.to_dict()]}).result
    chain = np.array([vids[k] for k in CHAIN], dtype=P.VIDS_DTYPE).tobytes()
    reads = mgr.access.reads.copy()
    parked = call(Op.ACQUIRE, cid, token, arrays=[chain])
    assert parked == Parked(own_parks=1, client=cid)
    assert disk.reading.wait(10)
    rows = mgr.table.rows([vids[k] for k in CHAIN])
    assert (mgr.table.cols.state[rows] == int(BlockState.MIGRATING)).all()
    assert mgr.table.cols.pins.sum() == 0 and mgr.access.reads == reads, "a parked call pinned or counted"
    gone = call(Op.DETACH, other["client"], other["token"])
    assert isinstance(gone, Parked) and other["client"] in svc.sessions, "a parked detach dropped its session"
    time.sleep(0.2)  # (the parked acquire's latency counts this wait: it left it out before)
    disk.release()
    deadline = time.monotonic() + 10
    while mgr.copies_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    done = call(Op.ACQUIRE, cid, token, arrays=[chain], again=parked)
    assert done.ok and done.result["acquired"], done
    places = np.frombuffer(done.arrays[0], dtype=P.PLACE_DTYPE)
    assert places["tier"].tolist() == [int(Tier.HBM)] * len(CHAIN)
    assert (mgr.table.cols.pins[rows] == 1).all()
    assert call(Op.DETACH, other["client"], other["token"], again=gone).ok
    assert other["client"] not in svc.sessions
    assert svc.counters["calls_parked"] == 2
    assert svc.latency["acquire"][0] == 1 and svc.latency["acquire"][1] >= 0.2, svc.latency
    metrics = DaemonMetrics(svc)
    metrics.refresh(force=True)
    assert scrape(metrics)[("dflash2_calls_parked_total", ())] == 2
    assert "calls parked 2" in render(svc.stats())  # dflash2 status
    mgr.check_invariants()


@pytest.mark.parametrize("real_wait_s", [0.3, 1.5])
def test_a_client_whose_call_waits_parked_keeps_its_lease(mgr, tmp_path, monkeypatch, clock, real_wait_s):
    """A client without heartbeats whose acquire waits parked longer than a lease (a disk slower
    than that) is heard from while it waits, as one whose call runs is: its lease does not lapse
    under it, and the acquire is answered. Before the loop parked calls, it waited for the disk, and
    the step that judges leases waited with it. `real_wait_s` past STEP_LATE_MAX_S: leases are
    judged while the step is held off by the copies in flight, which judged them without hearing
    from the parked calls' clients (a review)."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    with served(mgr, tmp_path, clock=clock, tick_interval_s=0.02):
        with Client.connect(f"ipc://{tmp_path}/d.sock", name="reader", layouts=[LAYOUT], heartbeat=False) as reader:
            acquiring, got = in_background(lambda: reader.acquire([vids[k] for k in CHAIN]))
            assert disk.reading.wait(10)
            clock.advance(600.0)  # ten leases
            time.sleep(real_wait_s)  # steps run meanwhile
            assert acquiring.is_alive()
            mgr.table.client(reader.client_id)  # UnknownClient once its lease lapsed
            disk.release()
            acquiring.join(10)
            assert got["out"]["tier"].tolist() == [int(Tier.HBM)] * len(CHAIN)
            reader.release(got["out"]["vid"])
    mgr.check_invariants()


def test_a_copy_thread_rings_the_doorbell_when_it_ends_a_batch(mgr):
    """The loop learns at once that a parked call's copies have ended (transfer/doorbell.py): the
    host copy thread rings once the job is done; draining silences the bell."""
    import select

    from dflash2.transfer.doorbell import COMPLETIONS

    lid, vids = chain_on_nvme(mgr)
    COMPLETIONS.drain()
    assert not select.select([COMPLETIONS], [], [], 0)[0]
    rows = mgr.table.rows([vids[k] for k in CHAIN])
    flight = mgr.mover.start(rows, Tier.DRAM)
    # (The bell is one per process: another test's copy thread still ending a batch may ring it
    # too, so a ring before this job is done is waited past, not taken for this job's.)
    deadline = time.monotonic() + 10
    while True:
        assert select.select([COMPLETIONS], [], [], max(0.0, deadline - time.monotonic()))[0], \
            "no ring when the batch ended"
        COMPLETIONS.drain()
        if flight.done():
            break
    mgr.mover.finish(flight)
    COMPLETIONS.drain()
    assert not select.select([COMPLETIONS], [], [], 0)[0]
    mgr.check_invariants()


def hbm_and_dram_nearly_full(m, dram: int = 57, hbm: int = 60) -> dict[int, int]:
    """HBM `hbm` of its free blocks and DRAM `dram`, filled with idle cached ones (each its own root,
    key k holds pattern(k)): by default both under their high watermarks (no drain begins), too full
    for 20 more blocks in HBM without writes to NVMe. Returns key -> vid."""
    a = m.attach("filler")
    lid = m.register_layout(LAYOUT)
    vids = {}
    for key, tier in [(k, Tier.DRAM) for k in range(3000, 3000 + dram)] + [(k, Tier.HBM) for k in range(4000, 4000 + hbm)]:
        v = m.allocate(a, lid, 1, tier=tier)
        m.view(int(v[0]))[:] = pattern(key)
        v = m.commit(a, v, keys=[key])
        m.free(a, v)
        vids[key] = int(v[0])
    return vids


def test_an_allocation_whose_room_writes_to_nvme_is_parked_on_those_writes(mgr, tmp_path, monkeypatch):
    """An allocation in a full HBM demotes to DRAM, whose room takes writes to NVMe: they run while
    the loop answers other calls, and the allocation is parked on them (soak13: with writes meeting
    a slow region, the loop waited 5-16 s in such an allocation). Once they end, it runs again and
    gets its blocks; every block demoted on the way reads back its own bytes."""
    vids = hbm_and_dram_nearly_full(mgr)
    mgr.tick(drain=False)
    assert not mgr.placement.draining
    disk = HeldDisk(mgr, monkeypatch, "write_blocks")
    with served(mgr, tmp_path) as ping:
        with Client.connect(f"ipc://{tmp_path}/d.sock", name="writer", layouts=[LAYOUT]) as writer:
            allocating, got = in_background(lambda: writer.allocate(writer.layouts[0], 20))
            assert disk.writing.wait(10), "the allocation never wrote to NVMe"
            assert ping() < 0.5, "the loop waited for the allocation's writes"
            assert allocating.is_alive()
            disk.release()
            allocating.join(10)
            assert got["out"] is not None and len(got["out"]) == 20
            assert set(got["out"]["tier"].tolist()) == {int(Tier.HBM)}
            writer.free(got["out"]["vid"])
            parked = writer.stats()["daemon"]["calls_parked"]
    assert parked >= 1
    for key, vid in vids.items():
        place = mgr.place(vid)
        if place.tier == Tier.NVME:
            buf = np.zeros(place.nbytes, np.uint8)
            assert mgr.arenas[Tier.NVME].read_blocks([place.offset], [buf])[0]
        else:
            buf = np.array(mgr.view(vid))
        assert np.array_equal(buf, pattern(key)), f"block {key} ({place.tier.label}) holds other bytes"
    assert any(mgr.place(v).tier == Tier.NVME for v in vids.values()), "nothing went down to NVMe"
    mgr.check_invariants()


def test_an_acquire_is_parked_on_its_rooms_writes_then_on_its_reads_and_no_more(mgr, monkeypatch):
    """In process: an acquire of blocks on NVMe into an HBM and a DRAM both full parks first on the
    writes its room takes (DRAM to NVMe), then on its reads; each run again makes progress, and a
    call is parked on its own copies at most OWN_PARKS (2) times."""
    lid, vids = chain_on_nvme(mgr)
    hbm_and_dram_nearly_full(mgr, dram=64, hbm=63)
    writes, reads = HeldDisk(mgr, monkeypatch, "write_blocks"), HeldDisk(mgr, monkeypatch)
    svc, _ = in_process_service(mgr)
    att = P.decode_reply(svc.handle_frames(P.encode_request(
        Op.ATTACH, 1, None, {"name": "r", "pid": 1, "layouts": [LAYOUT.to_dict()]})))
    cid, token = att.result["client"], att.result["token"]
    frames = P.encode_request(Op.ACQUIRE, 2, cid, {}, [np.array([vids[k] for k in CHAIN], P.VIDS_DTYPE).tobytes()],
                              token=token)

    def ended(bell) -> None:
        bell.release()
        deadline = time.monotonic() + 10
        while mgr.copies_running() and time.monotonic() < deadline:
            time.sleep(0.01)
    first = svc.handle_frames(frames)
    assert first == Parked(own_parks=1, client=cid) and writes.writing.wait(10) and not reads.reading.is_set()
    ended(writes)
    second = svc.handle_frames(frames, first)
    assert second == Parked(own_parks=2, client=cid) and reads.reading.wait(10)
    assert svc.counters["calls_parked"] == 1  # (one call, parked twice: it counted parks before)
    ended(reads)
    done = P.decode_reply(svc.handle_frames(frames, second))
    assert done.ok and done.result["acquired"], done
    places = np.frombuffer(done.arrays[0], dtype=P.PLACE_DTYPE)
    assert places["tier"].tolist() == [int(Tier.HBM)] * len(CHAIN)
    for key, place in zip(CHAIN, places):
        assert np.array_equal(mgr.view(int(place["vid"])), pattern(key))
    assert mgr.access.reads[Tier.NVME] == len(CHAIN), "read once, counted once"
    mgr.check_invariants()


def slowed(m, monkeypatch, seconds: float) -> None:
    """Every NVMe read and write takes `seconds` longer (a healthy disk, only slower than the file)."""
    nvme = m.arenas[Tier.NVME]
    for what in ("read_blocks", "write_blocks"):
        io = getattr(nvme, what)
        monkeypatch.setattr(nvme, what, lambda offsets, buffers, io=io: (time.sleep(seconds), io(offsets, buffers))[1])


def test_copies_that_end_within_park_after_s_are_waited_for_not_parked(mgr, monkeypatch):
    """An acquire whose room takes writes to NVMe and whose blocks are read from NVMe, on a disk
    that answers each I/O in 50 ms, within PARK_AFTER_S (here 30 s): the call waits for them and
    answers at once, parked never (with a healthy disk, parking every such call and running it again
    cost the loop more than the copies: soaks on the 2-core VM). Counted and read as before."""
    monkeypatch.setattr(type(mgr.placement), "PARK_AFTER_S", 30.0)
    lid, vids = chain_on_nvme(mgr)
    hbm_and_dram_nearly_full(mgr, dram=64, hbm=63)
    slowed(mgr, monkeypatch, 0.05)
    svc, call = in_process_service(mgr)
    att = call(Op.ATTACH, args={"name": "r", "pid": 1, "layouts": [LAYOUT.to_dict()]}).result
    done = call(Op.ACQUIRE, att["client"], att["token"],
                arrays=[np.array([vids[k] for k in CHAIN], P.VIDS_DTYPE).tobytes()])
    assert not isinstance(done, Parked) and done.ok and done.result["acquired"], done
    places = np.frombuffer(done.arrays[0], dtype=P.PLACE_DTYPE)
    assert places["tier"].tolist() == [int(Tier.HBM)] * len(CHAIN)
    for key, place in zip(CHAIN, places):
        assert np.array_equal(mgr.view(int(place["vid"])), pattern(key))
    assert svc.counters["calls_parked"] == 0
    assert mgr.access.reads[Tier.NVME] == len(CHAIN), "read once, counted once"
    assert not mgr.placement.in_flight
    mgr.check_invariants()


def test_callers_of_a_flight_past_park_after_s_are_parked_without_a_wait(mgr, monkeypatch):
    """The loop waits at most PARK_AFTER_S a flight, not a call: once an acquire's reads have run
    past it (the disk held), the next call that meets them is parked without waiting at all."""
    from dflash2.transfer.doorbell import COMPLETIONS
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    svc, call = in_process_service(mgr)
    reader = call(Op.ATTACH, args={"name": "r", "pid": 1, "layouts": [LAYOUT.to_dict()]}).result
    other = call(Op.ATTACH, args={"name": "o", "pid": 1, "layouts": [LAYOUT.to_dict()]}).result
    chain = np.array([vids[k] for k in CHAIN], P.VIDS_DTYPE).tobytes()
    first = call(Op.ACQUIRE, reader["client"], reader["token"], arrays=[chain])
    assert first == Parked(own_parks=1, client=reader["client"]) and disk.reading.wait(10)
    waits = []
    real_wait = COMPLETIONS.wait
    monkeypatch.setattr(COMPLETIONS, "wait", lambda seconds: (waits.append(seconds), real_wait(seconds))[1])
    lookup = call(Op.LOOKUP, other["client"], other["token"], args={"layout": lid},
                  arrays=[np.array(CHAIN, P.KEYS_DTYPE).tobytes()])
    assert isinstance(lookup, Parked) and waits == [], "the loop waited again for a flight past its time"
    disk.release()
    deadline = time.monotonic() + 10
    while mgr.copies_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call(Op.ACQUIRE, reader["client"], reader["token"], arrays=[chain], again=first).ok
    found = call(Op.LOOKUP, other["client"], other["token"], args={"layout": lid},
                 arrays=[np.array(CHAIN, P.KEYS_DTYPE).tobytes()], again=lookup)
    assert found.ok and len(np.frombuffer(found.arrays[0], dtype=P.PLACE_DTYPE)) == len(CHAIN)
    mgr.check_invariants()


def test_a_call_parked_as_the_daemon_stops_is_answered_daemon_unavailable_not_run(mgr, tmp_path, monkeypatch):
    """Run whole at the stop, each parked call started NVMe reads of its own (seconds each on a slow
    disk); answered without running, it must reach the client as DaemonUnavailable (the daemon is
    going), not a DaemonError of that kind that code catching DaemonUnavailable misses (reviews)."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    svc = Service(mgr, lease_timeout_s=60.0, heartbeat_interval_s=10.0, pid_alive=lambda pid: True)
    endpoint = f"ipc://{tmp_path}/d.sock"
    srv = Server(svc, endpoint, tick_interval_s=30.0)
    loop = threading.Thread(target=srv.serve_forever)
    loop.start()
    try:
        reader = Client.connect(endpoint, name="reader", layouts=[LAYOUT], heartbeat=False)
        got = {}

        def acquire():
            try:
                got["out"] = reader.acquire([vids[k] for k in CHAIN])
            except BaseException as e:
                got["error"] = e
        t = threading.Thread(target=acquire, daemon=True)
        t.start()
        assert disk.reading.wait(10), "the acquire never read from NVMe"
        time.sleep(0.2)  # parked
        srv.stop()
        t.join(10)
        assert "error" in got, got
        err = got["error"]
        assert isinstance(err, DaemonUnavailable) and "dflash2d is stopping" in str(err), f"{type(err).__name__}: {err}"
    finally:
        srv.stop()
        disk.release()
        loop.join(10)
        srv.close()


def _parked_chain_acquire(mgr, monkeypatch):
    """A client's acquire of CHAIN parked on its NVMe reads: (send, client, token, chain bytes, Parked,
    the held disk, vids)."""
    lid, vids = chain_on_nvme(mgr)
    disk = HeldDisk(mgr, monkeypatch)
    svc, call = in_process_service(mgr)

    def send(op, call_id, client, token, args=None, arrays=(), again=None):
        out = svc.handle_frames(P.encode_request(op, call_id, client, args or {}, list(arrays), token=token), again)
        return out if isinstance(out, Parked) else P.decode_reply(out)
    att = call(Op.ATTACH, args={"name": "r", "pid": 1, "layouts": [LAYOUT.to_dict()]})
    cid, token = att.result["client"], att.result["token"]
    chain = np.array([vids[k] for k in CHAIN], dtype=P.VIDS_DTYPE).tobytes()
    assert send(Op.FORGET, 7, cid, token, args={"call": 5}).ok  # (call 5: given up, it may come late)
    parked = send(Op.ACQUIRE, 6, cid, token, arrays=[chain])
    assert parked == Parked(own_parks=1, client=cid)
    assert disk.reading.wait(10)
    return send, cid, token, chain, parked, disk, vids


@pytest.mark.parametrize("other", ["refused as it began", "forgotten, come late"])
def test_another_acquire_that_fails_leaves_the_parked_ones_record(small_nvme_manager, monkeypatch, other):
    """While a client's acquire is parked on its NVMe reads, another acquire of its own fails (an
    unknown block, refused as it began; or one it gave up that came late, refused CallForgotten):
    it dropped the parked call's record, whose run again counted its 4 reads from NVMe as HBM hits
    (a review). Only the call that set a record drops it."""
    mgr = small_nvme_manager
    send, cid, token, chain, parked, disk, vids = _parked_chain_acquire(mgr, monkeypatch)
    if other == "refused as it began":
        r = send(Op.ACQUIRE, 8, cid, token, arrays=[np.array([10**9], dtype=P.VIDS_DTYPE).tobytes()])
        assert not r.ok and r.error_type == "UnknownBlock", r
    else:
        r = send(Op.ACQUIRE, 5, cid, token, arrays=[np.array([vids[HOT]], dtype=P.VIDS_DTYPE).tobytes()])
        assert r.error_type == "CallForgotten", r
    disk.release()
    deadline = time.monotonic() + 10
    while mgr.copies_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    mgr.settle()  # (another call met the landed copies first: a lookup, a drain slice)
    done = send(Op.ACQUIRE, 6, cid, token, arrays=[chain], again=parked)
    assert done.ok and done.result["acquired"], done
    assert dict(mgr.access.reads) == {Tier.NVME: 4}, dict(mgr.access.reads)


def test_another_acquire_that_succeeds_leaves_the_parked_ones_record(small_nvme_manager, monkeypatch):
    """While a client's acquire (call 6) is parked on its NVMe reads, another acquire of its own (call 8:
    a raw-protocol client pipelines its calls) reads a block already in HBM and succeeds. The record of
    where the parked call's blocks came from was kept per client: the second call took it as its own,
    and the parked call's run again counted its 4 reads from NVMe as HBM hits. It is kept per call now."""
    mgr = small_nvme_manager
    send, cid, token, chain, parked, disk, vids = _parked_chain_acquire(mgr, monkeypatch)
    r = send(Op.ACQUIRE, 8, cid, token, arrays=[np.array([vids[HOT]], dtype=P.VIDS_DTYPE).tobytes()])
    assert r.ok and r.result["acquired"], r
    assert dict(mgr.access.reads) == {Tier.HBM: 1}, dict(mgr.access.reads)
    assert list(mgr._came_from) == [(cid, 6)], mgr._came_from  # (the parked call's, by its call id)
    disk.release()
    deadline = time.monotonic() + 10
    while mgr.copies_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    mgr.settle()
    done = send(Op.ACQUIRE, 6, cid, token, arrays=[chain], again=parked)
    assert done.ok and done.result["acquired"], done
    assert dict(mgr.access.reads) == {Tier.HBM: 1, Tier.NVME: 4}, dict(mgr.access.reads)
    assert not mgr._came_from, mgr._came_from  # (the call ran: its record is gone)
    mgr.check_invariants()


def test_a_client_gone_drops_the_records_of_its_parked_acquires(small_nvme_manager, monkeypatch):
    """A client detached while its acquire is parked: the call never runs again, and its record (kept
    per call) goes with the client."""
    mgr = small_nvme_manager
    send, cid, token, chain, parked, disk, vids = _parked_chain_acquire(mgr, monkeypatch)
    disk.release()
    mgr.settle()
    mgr.detach(cid)
    assert not mgr._came_from, mgr._came_from
    mgr.check_invariants()
