"""Client misbehaviour and bad input against a real dflash2d process: each gets an error that names
what is wrong, and other clients' state is left as it was."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from daemon_proc import DaemonProcess

from dflash2 import protocol as P
from dflash2.client import Client, DaemonError, DaemonUnavailable, Transport, chain_keys
from dflash2.layout import Layout
from dflash2.protocol import Op

SMALL = Layout("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
HBM_BLOCKS = 512  # the test config: 8 MiB of HBM stand-in in 16 KiB blocks (and 16 MiB of DRAM)


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


def tiers_of(client, keys) -> list[int]:
    return client.lookup(keys, tier="dram")["tier"].tolist()  # a host reader: nothing moves


def publish(client, keys, chunk=64) -> None:
    """Publish a chain of blocks (in chunks, as an engine would) and hold none of them."""
    lid, parent = client.layouts[0], None
    for i in range(0, len(keys), chunk):
        vids = client.commit(client.allocate(lid, len(keys[i:i + chunk]))["vid"], keys=keys[i:i + chunk],
                             parent=parent)
        parent = int(vids[-1])
        client.free(vids)


def test_blocks_still_in_a_reservation_cannot_be_pinned_referenced_or_freed(connect):
    """A reservation's untaken blocks belong to it: a client that names one by id (a stale or made-up
    id) is refused, and the reservation, the client's detach and other clients are unaffected."""
    a, observer = connect("a", heartbeat=False), connect("observer")
    lid = a.layouts[0]
    d = a.reserve(lid, 4 * 16)
    taken = int(a.take(d.reservation_id, 1)["vid"][0])
    reserved = []
    for vid in (v for v in range(taken - 15, taken + 16) if v != taken):  # the reservation's other ids
        with pytest.raises(DaemonError) as e:  # (the reservation's blocks are a's: `places` refuses them)
            observer.places([vid])
        if e.value.kind == "NotOwner":
            reserved.append(vid)
    assert len(reserved) == 3
    for call in (a.acquire, a.add_ref, a.free):
        with pytest.raises(DaemonError) as e:
            call(reserved[:1])
        assert e.value.kind == "ReservationError" and f"{reserved[0]:#x}" in str(e.value), call
    assert len(a.take(d.reservation_id, 3)) == 3  # the reservation is intact
    released = a.detach()
    assert released["freed"] == 4, released
    st = observer.stats()
    assert [c["name"] for c in st["clients"]] == ["observer"]
    assert st["tiers"]["hbm"]["blocks"] == 0 and st["reservations"]["granted"] == 0
    observer.check()


def test_places_tells_no_client_where_another_ones_private_blocks_lie(connect):
    """`places` answered any live block's place: another client learned where a private block lay,
    its layout and size, before its writer published it."""
    a, b = connect("a"), connect("b")
    vids = a.allocate(a.layouts[0], 2)["vid"]
    with pytest.raises(DaemonError) as e:
        b.places(vids)
    assert e.value.kind == "NotOwner" and f"{int(vids[0]):#x} is a private block of another client" in str(e.value)
    assert len(a.places(vids)) == 2  # its own
    published = a.commit(vids, keys=chain_keys(range(2 * 16), 16, "seen"))
    assert b.places(published)["vid"].tolist() == published.tolist()  # published: anyone's to find


def test_allocate_that_can_never_fit_is_refused_and_demotes_nothing(connect):
    x, y = connect("x"), connect("y")
    keys = chain_keys(range(100 * 16), 16, "hot")
    publish(x, keys)
    assert tiers_of(x, keys) == [0] * 100
    with pytest.raises(DaemonError) as e:
        y.allocate(y.layouts[0], HBM_BLOCKS + 1)
    assert e.value.kind == "NeverFits" and "never fit" in str(e.value) and "hbm" in str(e.value)
    assert tiers_of(x, keys) == [0] * 100, "another client's cache was pushed out of HBM"
    assert len(y.allocate(y.layouts[0], 8)) == 8  # a request that fits still works
    y.check()


def test_acquire_that_can_never_fit_is_refused_and_moves_nothing(connect):
    x, y = connect("x"), connect("y")
    big = chain_keys(range((HBM_BLOCKS + 88) * 16), 16, "big")
    publish(x, big)
    hot = chain_keys(range(20 * 16), 16, "hot")
    publish(x, hot)
    assert tiers_of(x, hot) == [0] * 20
    found = y.lookup(big, tier="dram")
    assert len(found) == len(big)
    with pytest.raises(DaemonError) as e:
        y.acquire(found["vid"])
    assert e.value.kind == "NeverFits" and "never fit" in str(e.value)
    assert tiers_of(x, hot) == [0] * 20, "another client's cache was pushed out of HBM"
    assert y.acquire(found["vid"][:4]) is not None  # a prefix that fits still comes up
    y.release(found["vid"][:4])
    y.check()


@pytest.mark.parametrize("field, value", [
    ("num_layers", 10**30),      # a block of more bytes than any 64-bit number
    ("num_layers", True),        # a bool is not a count
    ("head_dim", 64.0),          # nor is a float
    ("name", ["small"]),         # a name is a string
    ("name", 5),
])
def test_malformed_layouts_are_refused_and_other_clients_keep_working(connect, daemon, field, value):
    x = connect("x")
    keys = chain_keys(range(20 * 16), 16, "other")
    publish(x, keys)
    t = Transport(daemon.endpoint, timeout_s=5.0)
    try:
        bad = {**SMALL.to_dict(), "name": "bad", field: value}
        with pytest.raises(DaemonError) as e:
            t.call(Op.ATTACH, None, {"name": "evil", "pid": 0, "layouts": [bad]})
        assert e.value.kind == "LayoutError" and field in str(e.value)
        attached = t.call(Op.ATTACH, None, {"name": "evil", "pid": 0, "layouts": []}).result
        client, t.token = attached["client"], attached["token"]
        with pytest.raises(DaemonError) as e:
            t.call(Op.REGISTER_LAYOUT, client, {"layout": bad})
        assert e.value.kind == "LayoutError" and field in str(e.value)
    finally:
        t.close()
    assert len(x.lookup(keys)) == 20  # batch calls of others still work
    assert len(x.allocate(x.layouts[0], 10)) == 10
    x.check()


def test_lookup_with_an_unregistered_layout_id_is_an_error_not_a_miss(connect):
    c = connect("c")
    keys = chain_keys(range(4 * 16), 16, "k")
    publish(c, keys)
    assert len(c.lookup(keys, layout=c.layouts[0])) == 4
    with pytest.raises(DaemonError) as e:
        c.lookup(keys, layout=99)
    assert e.value.kind == "UnknownLayout" and "99" in str(e.value)


def test_client_without_a_pid_namespace_can_attach(daemon, monkeypatch):
    """Where /proc/self/ns/pid cannot be read the client knows no pid namespace: it still attaches
    (the daemon then relies on the lease alone)."""
    import dflash2.client.client as client_module

    monkeypatch.setattr(client_module, "pid_namespace", lambda: None)
    with Client.connect(daemon.endpoint, name="no-ns", layouts=[SMALL]) as c:
        assert c.allocate(c.layouts[0], 1) is not None


def test_an_hbm_arena_that_will_not_map_says_when_the_daemon_is_in_another_pid_namespace(daemon, monkeypatch):
    """CUDA's IPC handles do not open between two pid namespaces of their own (a DaemonSet pod and a
    serving pod, neither with hostPID: tests/test_gpu_pid_namespaces.py, on the H200 host): the attach
    reply names the daemon's pid namespace, and a GPU arena that will not map says so and what to do."""
    import dflash2.client.transport as transport_module
    from dflash2.client.views import pid_namespace_hint

    own = os.stat("/proc/self/ns/pid").st_ino
    transport = Transport(daemon.endpoint, 5.0)
    try:
        r = transport.call(Op.ATTACH, None, {"name": "raw", "pid": os.getpid(), "layouts": []}).result
        transport.token = r["token"]
        transport.call(Op.DETACH, r["client"])
    finally:
        transport.close()
    assert r["pid_namespace"] == own  # (the daemon runs in this test's namespace)
    assert pid_namespace_hint(own) == "" and pid_namespace_hint(None) == ""
    hint = pid_namespace_hint(own + 1)
    assert f"this process runs in another pid namespace (pid:[{own}]) than the daemon (pid:[{own + 1}])" in hint
    assert "run the daemon there (Kubernetes: hostPID: true in the DaemonSet" in hint
    monkeypatch.setattr(transport_module, "pid_namespace", lambda: None)
    assert pid_namespace_hint(own + 1) == ""  # (this process's unknown: nothing to say)


def test_a_forked_child_gets_a_clear_error_and_leaves_the_parents_session_alone(connect):
    parent = connect("parent", heartbeat=False, timeout_s=2.0)
    parent.allocate(parent.layouts[0], 3)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: uses the parent's client, then closes it
        try:
            try:
                parent.stats()
                outcome = "no error"
            except DaemonUnavailable as e:
                outcome = "fork" if "fork" in str(e) else f"other: {e}"
            except Exception as e:  # noqa: BLE001 - reported to the parent
                outcome = f"{type(e).__name__}: {e}"
            parent.close()
            os.write(write_end, outcome.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 10
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in its call to the daemon")
        time.sleep(0.02)
    outcome = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert outcome == "fork", outcome
    st = parent.stats()  # the child's close did not detach the parent
    assert [c["name"] for c in st["clients"]] == ["parent"] and st["tiers"]["hbm"]["blocks"] == 3


def test_reservation_status_of_another_clients_reservation_is_refused(connect):
    hog, waiter, other = connect("hog"), connect("waiter"), connect("other")
    lid = hog.layouts[0]
    while hog.allocate(lid, 64) is not None:  # private blocks being written: they cannot move
        pass
    deferred = waiter.reserve(lid, 16)
    assert deferred.deferred
    with pytest.raises(DaemonError) as e:
        other.reservation(deferred.reservation_id)
    assert e.value.kind == "NotOwner"
    assert waiter.reservation(deferred.reservation_id).deferred


def test_a_frame_larger_than_the_daemon_takes_never_reaches_it(connect, daemon):
    x = connect("x")
    keys = chain_keys(range(20 * 16), 16, "kept")
    publish(x, keys)
    huge = np.arange(1, 2 * P.MAX_FRAME_BYTES // 8, dtype=np.uint64)  # 8 MiB of keys
    # Our client refuses at once, naming the bound (no send, no wait for a timeout).
    with pytest.raises(P.ProtocolError, match=f"more than the daemon accepts \\({P.MAX_FRAME_BYTES}"):
        x.lookup(huge)
    # A peer that sends one anyway is dropped by the daemon's socket without a reply; the daemon
    # never copies or parses it, and serves everyone else as before.
    import zmq

    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    header = b'{"op":"lookup","id":1,"client":null,"args":{}}'
    raw.send_multipart([P.MAGIC, str(P.VERSION).encode(), header, huge.tobytes()])
    assert len(x.lookup(keys)) == 20
    assert raw.poll(500, zmq.POLLIN) == 0, "the daemon answered a frame larger than MAX_FRAME_BYTES"
    raw.close()
    ctx.term()
    assert x.stats()["daemon"]["errors"] == 0  # neither frame was ever parsed (parsing would refuse it)
    x.check()


def test_close_in_a_forked_child_does_not_hang_when_a_call_was_in_flight(connect):
    """The call lock, held by a parent's thread at the fork, is held in the child for good: close()
    (and a `with` block's exit) hung there for ever (a review). A child only drops its copy."""
    c = connect("parent")
    stop = threading.Event()

    def busy():  # another thread of the serving process, calling as it serves
        while not stop.is_set():
            c.lookup(list(range(1, 20000)))

    th = threading.Thread(target=busy)
    th.start()
    time.sleep(0.3)
    # fork until the call lock is held at fork time (almost always at once)
    while True:
        held = not c._lock.acquire(blocking=False)  # (another thread's call holds it)
        if not held:
            c._lock.release()
        pid = os.fork()
        if pid == 0:
            try:
                c.close()  # "a forked child must not detach its parent's session: it only drops its copy"
            finally:
                os._exit(0)
        if held:
            break
        os.waitpid(pid, 0)
    stop.set()
    th.join()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's close() of its parent's Client hung (killed after 5 s)")
    assert c.ping()["pid"]  # the parent's session is untouched
