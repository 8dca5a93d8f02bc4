"""Integration: the real dflash2d subprocess on an ipc:// endpoint in tmp_path, and the real client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from daemon_proc import DaemonProcess

from dflash2.client import Client, DaemonError, DaemonUnavailable, Transport, VersionMismatch, chain_keys
from dflash2.errors import ArenaError
from dflash2.layout import Layout
from dflash2.protocol import Op

SMALL = Layout("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
LEASE = {"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.3}


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock", **LEASE})).start()
    yield proc
    proc.stop()


def run_child(script: str, *args, timeout=30) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


READER = """
    import json, sys
    import torch  # before attaching: loading it holds the GIL, and on a loaded machine that starved
                  # the heartbeat thread past this module's 1 s lease (views import it on first use)
    from dflash2.client import Client
    from dflash2.layout import Layout
    endpoint, layout, keys = sys.argv[1], Layout.from_dict(json.loads(sys.argv[2])), json.loads(sys.argv[3])
    with Client.connect(endpoint, name="reader", layouts=[layout]) as c:
        found = c.lookup(keys)
        places = c.acquire(found["vid"])
        firsts = [float(c.view(p).flatten()[0]) for p in places]
        c.view(places[0]).flatten()[1] = -7.0  # the writer sees this byte change too
        c.release(found["vid"])
        print(json.dumps({"found": len(found), "firsts": firsts, "vids": found["vid"].tolist()}))
"""


def test_startup_line_says_host_memory(daemon):
    assert "no GPU" in daemon.startup_line and "committed" in daemon.startup_line


def test_two_processes_share_a_prefix_by_content_key(connect, daemon):
    writer = connect("writer")
    lid = writer.layouts[0]
    places = writer.allocate(lid, 3)
    for i, p in enumerate(places):
        t = writer.view(p)
        assert t.shape == SMALL.shape and t.dtype == torch.float16
        t.fill_(float(i + 1))
    keys = chain_keys(range(3 * 16), 16, "small-model")
    vids = writer.commit(places["vid"], keys=keys)
    got = run_child(READER, daemon.endpoint, json.dumps(SMALL.to_dict()), json.dumps(keys))
    assert got == {"found": 3, "firsts": [1.0, 2.0, 3.0], "vids": vids.tolist()}
    # The reader's write through its own view is in our mapping and in the daemon's segment file.
    pinned = writer.acquire(vids[:1])
    assert float(writer.view(pinned[0]).flatten()[1]) == -7.0
    arena = next(a for a in writer.arena_info if a["tier"] == "hbm")
    with open(f"/dev/shm/{arena['name']}", "rb") as f:
        f.seek(int(pinned[0]["offset"]))
        raw = np.frombuffer(f.read(SMALL.block_bytes), dtype=np.float16)
    assert raw[0] == 1.0 and raw[1] == -7.0
    assert np.shares_memory(writer.view_bytes(pinned[0]), writer.view_bytes(int(vids[0])))
    writer.release(vids[:1])
    writer.check()


def test_views_cover_every_dtype(connect):
    layouts = [Layout(f"l-{d}", 2, 2, 64, d, 16) for d in ("bf16", "fp32", "int8", "fp8_e4m3", "fp8_e5m2", "int4")]
    c = connect("dtypes", layouts=layouts)
    expected = [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]
    for lid, lay, dtype in zip(c.layouts, layouts, expected):
        p = c.allocate(lid, 1)[0]
        t = c.view(p)
        assert t.dtype == dtype and t.untyped_storage().nbytes() == lay.block_bytes
        assert t.shape == (lay.shape if lay.dtype != "int4" else (*lay.shape[:-1], 32))


def test_reservation_deferred_until_another_client_frees(connect):
    hog, waiter = connect("hog"), connect("waiter")
    lid = hog.layouts[0]
    held = []
    while (p := hog.allocate(lid, 32)) is not None:  # private blocks being written: they cannot move
        held.append(p["vid"])
    d = waiter.reserve(lid, tokens=4 * 16)
    assert d.deferred and d.position == 0, d
    hog.free(np.concatenate(held)[:8])
    deadline = time.monotonic() + 5
    while not (d2 := waiter.reservation(d.reservation_id)).granted:
        assert time.monotonic() < deadline, d2
        time.sleep(0.05)
    places = waiter.take(d.reservation_id, 4)
    assert len(places) == 4 and (places["tier"] == 0).all()
    waiter.check()


def test_a_polled_reservation_is_granted_when_the_bucket_pays_for_its_room_not_at_the_next_step(config_file, tmp_path):
    """HBM full of idle cached blocks, and no background step for ten minutes: reservations that
    the bucket holds back are granted to the client polling them once it refilled (they waited for
    the next step before: serial reservations got about one grant per `policy.rescore_interval_ms`)."""
    cfg = config_file(policy={"name": "lru", "swap_batch_size": 64, "rescore_interval_ms": 600_000},
                      admission={"burst_fraction": 0.1, "smoothing_window_ms": 500}, daemon=LEASE)
    proc = DaemonProcess(cfg).start()
    try:
        with Client.connect(proc.endpoint, name="serial", layouts=[SMALL]) as c:
            lid = c.layouts[0]
            for first in range(1, 512, 32):  # 512 blocks of 16 KiB: HBM full, then idle
                p = c.allocate(lid, 32)
                assert p is not None and (p["tier"] == 0).all()
                c.free(c.commit(p["vid"], keys=list(range(first, first + 32))))
            deferred = 0
            for _ in range(6):  # 32 blocks each; the bucket holds 51 and refills 51 per 0.5 s window
                d = c.reserve(lid, tokens=32 * 16)
                start = time.monotonic()
                while not d.granted:
                    assert d.deferred and d.est_wait_s is not None, d
                    assert time.monotonic() - start < 10, f"still waiting after 10 s: {d}"
                    time.sleep(0.02)
                    d = c.reservation(d.reservation_id)
                deferred += time.monotonic() > start + 0.02  # held: the next one needs room made again
            assert deferred, "no reservation was held back by the bucket: the test shows nothing"
    finally:
        proc.stop()


def test_error_replies_keep_the_daemon_error_kind(connect):
    a, b = connect("a"), connect("b")
    p = a.allocate(a.layouts[0], 2)
    with pytest.raises(DaemonError) as e:
        b.free(p["vid"])
    assert e.value.kind == "NotOwner"
    assert a.free(p["vid"][:1]) == 1
    with pytest.raises(DaemonError) as e:
        a.free(p["vid"][:1])
    assert e.value.kind in ("NotOwner", "UnknownBlock")
    with pytest.raises(DaemonError) as e:
        a.reserve(99, 16)
    assert e.value.kind == "UnknownLayout"
    a.check()


CRASHER = """
    import json, sys, time
    from dflash2.client import Client, chain_keys
    from dflash2.layout import Layout
    endpoint, layout = sys.argv[1], Layout.from_dict(json.loads(sys.argv[2]))
    c = Client.connect(endpoint, name="crasher", layouts=[layout])
    lid = c.layouts[0]
    c.allocate(lid, 2)                                  # private, being written
    pub = c.allocate(lid, 2)
    keys = chain_keys(range(32), 16, "crash")
    vids = c.commit(pub["vid"], keys=keys)              # published
    c.acquire(vids)                                     # pinned
    d = c.reserve(lid, 64)                              # 4 blocks reserved
    print(json.dumps({"keys": keys, "reserved": d.granted}), flush=True)
    time.sleep(60)
"""


def test_sigkilled_client_resources_come_back_within_the_lease(connect, daemon):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CRASHER), daemon.endpoint,
                              json.dumps(SMALL.to_dict())], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        assert info["reserved"]
        observer = connect("observer")
        st = observer.stats()
        assert st["tiers"]["hbm"]["blocks"] == 8 and st["reservations"]["granted"] == 1
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        child.kill()
        child.wait()
    while True:
        st = observer.stats()
        if [c["name"] for c in st["clients"]] == ["observer"]:
            break
        assert time.monotonic() - killed < LEASE["lease_timeout_s"] + 1.0, st["clients"]
        time.sleep(0.05)
    assert st["reservations"]["granted"] == 0 and st["reservations"]["reserved_blocks"] == 0
    assert st["tiers"]["hbm"]["blocks"] == 2  # only the published blocks stay
    found = observer.lookup(info["keys"])
    assert len(found) == 2
    places = observer.acquire(found["vid"])  # usable, and no longer pinned by the dead client
    assert places is not None
    observer.release(found["vid"])
    observer.free(observer.allocate(observer.layouts[0], 1)["vid"])
    observer.check()


def test_silent_client_loses_its_lease(connect):
    quiet = connect("quiet", heartbeat=False)
    placed = quiet.allocate(quiet.layouts[0], 1)
    quiet.view_bytes(placed[0])
    time.sleep(LEASE["lease_timeout_s"] + 0.5)
    with pytest.raises(DaemonError) as e:
        quiet.allocate(quiet.layouts[0], 1)
    assert e.value.kind == "UnknownClient"
    assert quiet.lease_lost
    with pytest.raises(ArenaError, match="lease lapsed"):  # its blocks are no longer its own: no new view
        quiet.view_bytes(placed[0])
    beating = connect("beating")
    time.sleep(LEASE["lease_timeout_s"] + 0.5)
    assert beating.allocate(beating.layouts[0], 1) is not None and not beating.lease_lost


def test_version_mismatch_is_a_clear_error(daemon):
    t = Transport(daemon.endpoint, timeout_s=2.0, version=99)
    started = time.monotonic()
    with pytest.raises(VersionMismatch, match="version mismatch"):
        t.call(Op.PING)
    assert time.monotonic() - started < 1.0
    t.close()


def test_second_daemon_on_the_endpoint_refuses(daemon):
    out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", daemon.config_path],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 4
    assert f"another dflash2d (pid {daemon.pid})" in out.stderr and daemon.endpoint in out.stderr
    Transport(daemon.endpoint).call(Op.PING)  # the first one still serves


def test_sigterm_removes_socket_and_segments(connect, daemon):
    c = connect("leaver")
    segments = [Path(f"/dev/shm/{a['name']}") for a in c.arena_info]
    assert segments and all(s.exists() for s in segments) and daemon.socket_path.exists()
    assert daemon.terminate() == 0
    assert not daemon.socket_path.exists()
    assert not any(s.exists() for s in segments)
    with pytest.raises(DaemonUnavailable, match="ping"):
        c._transport.timeout_s = 0.3
        c.ping()


def test_daemon_gone_is_daemon_unavailable(tmp_path):
    with pytest.raises(DaemonUnavailable, match="does not exist"):
        Client.connect(f"ipc://{tmp_path}/none.sock")


def test_status_table_and_json(connect, daemon, capsys):
    from dflash2.cli import main

    c = connect("engine-7")
    c.allocate(c.layouts[0], 2)
    assert main(["status", "--config", daemon.config_path]) == 0
    table = capsys.readouterr().out
    assert "hbm" in table and "engine-7" in table and "reservations" in table and "hit ratio" in table
    assert main(["status", "--endpoint", daemon.endpoint, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["tiers"]["hbm"]["blocks"] == 2 and st["clients"][0]["name"] == "engine-7"
    assert "GPU copy batches" not in table, "a host daemon moves one way only"
    from dflash2.status import render
    st["copy_batches"] = {"hbm->dram": {"kernel": 3, "engines": 2}}  # what a GPU pool reports
    assert "GPU copy batches: hbm->dram kernel 3, engines 2" in render(st)


def test_status_without_daemon_exits_1(tmp_path, config_file, capsys):
    from dflash2.cli import main

    assert main(["status", "--config", config_file()]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no dflash2d" in err


def test_a_view_asked_for_while_another_thread_detaches_says_the_client_is_detached(daemon, connect):
    """A view asked for on one thread while another detaches the client: "detached", never that the
    block's tier "is not mapped (acquire it to bring it to HBM first)", which acquiring cannot help
    (a review's script: 129 of 300 races said that)."""
    import threading

    c = connect("v")
    place = c.allocate(c.layout_ids[0], 1)[0]
    arenas = c._arenas  # as a viewing thread holds them while the detach runs
    c.detach()
    with pytest.raises(ArenaError, match="this client is detached: its arena mappings are gone"):
        arenas.bytes_view(place)
    said = []
    for _ in range(30):
        c = connect("v")
        place = c.allocate(c.layout_ids[0], 1)[0]
        started = threading.Event()

        def view():
            started.set()
            while True:
                try:
                    c.view_bytes(place)
                except ArenaError as e:
                    said.append(str(e))
                    return
        viewer = threading.Thread(target=view)
        viewer.start()
        started.wait()
        c.detach()
        viewer.join(10)
    assert said and all("this client is detached" in s for s in said), set(said)


def test_threads_sharing_a_client_each_fail_within_their_own_timeout(daemon, connect):
    """Eight threads on a stopped daemon: each call fails about its timeout after it was made, its
    wait behind the others' calls counted. Before, the last failed after eight timeouts."""
    import threading

    c = connect("t", timeout_s=0.5, heartbeat=False)
    took = []

    def one():
        began = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            c.stats()
        took.append(time.monotonic() - began)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert len(took) == 8 and max(took) < 1.5, took


@pytest.mark.parametrize("stopped_after_s", [0.0, 2.5])
def test_a_close_on_a_stopped_daemon_after_a_timeout_still_detaches_once_it_runs(daemon, connect, stopped_after_s):
    """A call timed out on a stopped daemon (SIGSTOP, a frozen container), so the client's socket is
    a fresh one that cannot connect until the daemon runs; then close(): its detach timed out too,
    and went with that socket (closed at once, its queued message dropped). The daemon, run again,
    let the lease lapse a lease later and set the live process's private blocks aside
    (`daemon.set_aside_leases` leases: 5 minutes by default), though the client had closed (a
    review). That socket now lingers until the detach is sent, once the daemon runs: with the daemon
    stopped for more than a lease past the close (2.5 s, the lease 1 s) too, where a linger of a lease
    dropped it (the daemon counts none of that time against the lease, a review)."""
    c = connect("closing", timeout_s=0.3)
    other = connect("other")
    assert c.allocate(c.layouts[0], 3) is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailable):
            c.lookup(chain_keys(range(16), 16, "x"))
        c.close()
        time.sleep(stopped_after_s)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 0.6  # (under the 1 s lease)
    while any(x["name"] == "closing" for x in other.stats()["clients"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    st = other.stats()
    assert not any(x["name"] == "closing" for x in st["clients"]), "the detach never arrived"
    assert st["set_aside"]["blocks"] == 0
    if not stopped_after_s:
        assert "detached: released {'reservations': 0, 'unpinned': 0, 'dereferenced': 3, 'freed': 3}" in daemon.log()


def test_a_close_after_the_daemon_was_killed_leaves_no_detach_for_the_next_daemon(config_file, tmp_path):
    """A close() after the daemon was killed (its end found by the waiting detach): the detach's socket
    lingered until sent, which a dead daemon never lets happen: kept for the process's life (a
    descriptor each, `zmq.Context.instance().term()` hung for good), then sent to the next daemon on
    the endpoint, an error there (a review: 50 such closes, 50 descriptors kept and 50 errors)."""
    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock", **LEASE})
    first = DaemonProcess(path).start()
    try:
        c = Client.connect(config=path, name="c", layouts=[SMALL], heartbeat=False, timeout_s=2.0)
        first.proc.kill()
        first.proc.wait(10)
        c.close()
    finally:
        first.stop()
    second = DaemonProcess(path).start()
    try:
        other = Client.connect(config=path, name="other", heartbeat=False)
        time.sleep(0.5)  # (a lingering socket connects within ZeroMQ's 100 ms reconnect interval)
        assert other.stats()["daemon"]["errors"] == 0, "the dead daemon's detach reached the new daemon"
        other.close()
    finally:
        second.stop()


def test_client_arguments_are_checked_by_name_and_numpy_numbers_taken(daemon, connect):
    """Keys that are not integers in [0, 2^64) are refused by name (a float key was truncated, a
    negative numpy key wrapped around, silently); numpy numbers as rates and layout fields go as
    numbers (they failed in the JSON encoder); a commit of n blocks with another number of keys is
    refused, an empty list too (it committed the blocks unkeyed)."""
    from dflash2.errors import LayoutError

    c = connect("args", layouts=[Layout("np", np.int64(2), np.int64(2), np.int64(64), "fp16", np.int64(16))],
                prefill_tokens_per_s=[np.float32(1e5)])
    lid = c.layout_ids[0]
    c.set_prefill_rate(lid, np.float64(2e5))
    assert c.register_layout(SMALL, np.float32(3e5)) >= 0
    for bad in ([7.9], [-5], np.array([-5], dtype=np.int64), [2**64 + 3], [True]):
        with pytest.raises(ValueError, match="content keys must be integers"):
            c.lookup(bad, lid)
    assert len(c.lookup([2**64 - 1, 5], lid)) == 0 and len(c.lookup(np.array([5], dtype=np.uint64), lid)) == 0
    places = c.allocate(lid, 2)
    for keys in ([], [1]):
        with pytest.raises(ValueError, match="commit of 2 blocks with"):
            c.commit(places["vid"], keys=keys)
    assert len(c.commit(places["vid"], keys=[1, 2])) == 2
    with pytest.raises(LayoutError, match="num_layers must be an integer"):
        Layout("f", 2.0, 2, 64, "fp16", 16)


def test_registering_a_layout_again_without_a_rate_keeps_the_rate_given(daemon, connect):
    """Another part of an engine asking for a layout's id withdrew the prefill rate given at connect
    (its lookups were no longer judged, a review); `set_prefill_rate(lid, None)` withdraws it."""
    c = connect("rate", layouts=[SMALL], prefill_tokens_per_s=[5e4])
    rates = lambda: c.stats()["read_cost"]["prefill_rates"]  # noqa: E731
    assert rates() == 1
    assert c.register_layout(SMALL) == c.layout_ids[0]
    assert rates() == 1
    c.set_prefill_rate(c.layout_ids[0], None)
    assert rates() == 0


def test_an_allocation_refused_for_now_says_why(daemon, connect):
    """README: an allocation held back for waiting reservations is told so by the reply's reason;
    the Client returned None and dropped it."""
    a, b = connect("a"), connect("b")
    lid = a.layout_ids[0]
    hbm = a.stats()["tiers"]["hbm"]["capacity_bytes"] // SMALL.block_bytes
    held = b.allocate(lid, hbm - 2)  # b's blocks being written: nothing to demote
    assert held is not None and b.reserve(lid, 4 * SMALL.tokens_per_block).outcome == "deferred"
    assert a.allocate(lid, 2) is None
    assert "reservation" in a.last_refusal, a.last_refusal


def test_a_client_lets_go_of_a_dead_daemons_memory_when_a_restarted_one_answers(config_file, tmp_path, monkeypatch):
    """The daemon killed and restarted at once on its endpoint (systemd Restart=always): the next call
    reaches the new daemon (UnknownClient). The client let go of the dead daemon's mappings only when
    no daemon answered; here it kept its segments mapped for as long as it lived. (The waiting call
    asks whether its daemon ended every 2 s here, not 50 ms: the new daemon answers first.)"""
    import dflash2.client.transport as transport
    monkeypatch.setattr(transport, "GONE_CHECK_S", 2.0)
    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock", **LEASE})
    first = DaemonProcess(path).start()
    c = Client.connect(config=path, name="c", layouts=[SMALL], heartbeat=False)
    try:
        assert c._arenas.arenas
        first.proc.kill()
        first.proc.wait(10)
        second = DaemonProcess(path).start()
        try:
            with pytest.raises(DaemonError, match="UnknownClient"):
                c.allocate(c.layout_ids[0], 1)
            assert c.lease_lost and not c._arenas.arenas, "the dead daemon's segments are let go"
        finally:
            second.stop()
    finally:
        c.close()
        first.stop()


def test_many_allocations_timed_out_on_a_stopped_daemon_leave_nothing_held(config_file, tmp_path):
    """Twelve allocations time out while the daemon is stopped; once it runs again, the one it
    received (the others' sockets never connected) is given back. With 8 forgets kept, the client
    dropped the oldest, which was that one's: its block stayed held until detach. (A lease long
    enough to outlast the stop: the heartbeats sent meanwhile are lost with their sockets.)"""
    daemon = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 60.0,
                                               "heartbeat_interval_s": 0.3})).start()
    c = Client.connect(daemon.endpoint, name="t", layouts=[SMALL], timeout_s=0.2)
    lid = c.layout_ids[0]
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(12):
            with pytest.raises(DaemonUnavailable):
                c.allocate(lid, 1)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    c.timeout_s = c._transport.timeout_s = 5.0
    deadline = time.monotonic() + 10
    while c.stats()["tiers"]["hbm"]["blocks"] and time.monotonic() < deadline:
        c.ping()  # (each call sends the forgets still unanswered again, and takes their answers)
        time.sleep(0.05)
    try:
        assert c.stats()["tiers"]["hbm"]["blocks"] == 0
        assert not c.lease_lost, "given back by the forgets, not by a lapsed lease"
        assert c.detach()["freed"] == 0
    finally:
        c.close()
        daemon.stop()


def test_a_client_without_a_timeout_works(daemon):
    """timeout_s=inf (wait as long as it takes): every call failed at the lock's wait, which takes no
    timeout past threading.TIMEOUT_MAX, and detach failed at the heartbeat's join."""
    c = Client.connect(daemon.endpoint, name="patient", layouts=[SMALL], timeout_s=float("inf"))
    assert len(c.lookup([1, 2], c.layout_ids[0])) == 0
    c.detach()


def test_a_stale_place_record_of_a_pinned_block_never_views_another_block(connect):
    """A lookup's record of a block in DRAM, then an acquire that moved it up: viewed by the record,
    the old slot showed (and let write) another client's block (a review). A record is viewed where
    this client holds the block now; one it holds not is refused."""
    w, r = connect("writer"), connect("reader")
    lid = w.layouts[0]
    p = w.allocate(lid, 1, tier="dram")
    w.view_bytes(p[0])[:] = 7
    (vid,) = w.commit(p["vid"], keys=[555])
    w.free([vid])
    found = r.lookup([555], tier="dram")        # its place: DRAM
    got = r.acquire(found["vid"])               # pinned, promoted into HBM
    assert got is not None and got["tier"][0] != found["tier"][0]
    other = w.allocate(lid, 1, tier="dram")     # another client's block takes the freed DRAM slot
    w.view_bytes(other[0])[:] = 99
    assert (r.view_bytes(int(vid)) == 7).all()  # by vid: the pinned block
    assert (np.asarray(r.view_bytes(found[0])) == 7).all()  # where it lies now
    r.release(got["vid"])
    with pytest.raises(ArenaError, match="not being written or acquired by this client; acquire it first"):
        r.view_bytes(found[0])
