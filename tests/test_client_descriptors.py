"""A serving process short of file descriptors, and a client used after detach (a review of the
client library, 2026-12-05): a socket that cannot be made is a DaemonUnavailable that loses no
`forget`, the heartbeat outlives any one failure, a connect with too few descriptors left is
refused instead of aborting the process, and misuse is named. Each failed before its fix."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zmq
from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.client import client as client_module
from dflash2.client import heartbeat as heartbeat_module
from dflash2.client.transport import Transport
from dflash2.errors import ArenaError, DaemonUnavailable
from dflash2.protocol import Op

from conftest import SMALL


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 1.5,
                                             "heartbeat_interval_s": 0.2})).start()
    yield proc
    proc.stop()


class NoDescriptors:
    """A ZeroMQ context whose next `fail` sockets cannot be made, as when the process has no
    descriptor left (EMFILE)."""

    def __init__(self, ctx, fail: int):
        self.ctx, self.fail = ctx, fail

    def socket(self, kind):
        if self.fail > 0:
            self.fail -= 1
            raise zmq.ZMQError(errno.EMFILE)
        return self.ctx.socket(kind)


def _hbm_blocks(endpoint) -> int:
    t = Transport(endpoint)
    try:
        return t.call(Op.STATS).result["tiers"]["hbm"]["blocks"]
    finally:
        t.close()


def test_a_timed_out_allocate_with_no_fresh_socket_keeps_its_forget(daemon):
    """The fresh socket after the timeout could not be made: the raw ZMQError reached the caller,
    the `forget` was never noted (the 8 blocks stayed held under ids the engine never learned, until
    detach), and every later call used the closed socket ("Socket operation on non-socket")."""
    c = Client.connect(daemon.endpoint, name="short", layouts=[SMALL], timeout_s=5.0, heartbeat=False)
    try:
        lid = c.layouts[0]
        t = c._transport
        t._ctx = NoDescriptors(t._ctx, fail=1)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailable, match="no fresh socket .*the next call asks it to give back"):
                c._call(Op.ALLOCATE, {"layout": lid, "n": 8}, timeout_s=0.3)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c.ping()  # makes the socket, the forget first on it
        assert _hbm_blocks(daemon.endpoint) == 0
        assert not t._forgets, "the forget was sent and answered"
        assert c.allocate(lid, 2) is not None
    finally:
        c.close()


def test_the_heartbeat_outlives_a_socket_it_cannot_make(daemon, monkeypatch):
    """The heartbeat thread died on the ZMQError of a socket it could not make, and the lease lapsed
    with `lease_lost` still False: the engine's next call found itself unknown."""
    made = []

    def transport(*args, **kwargs):
        made.append(args)
        if len(made) == 2:  # the heartbeat's first
            raise zmq.ZMQError(errno.EMFILE)
        return Transport(*args, **kwargs)

    monkeypatch.setattr(client_module, "Transport", transport)
    monkeypatch.setattr(heartbeat_module, "Transport", transport)
    c = Client.connect(daemon.endpoint, name="beats", layouts=[SMALL])
    try:
        time.sleep(3 * c.lease_timeout_s)
        assert c._heartbeat_thread.is_alive() and not c.lease_lost
        c.ping()  # still attached: the lease was renewed
        assert len(made) == 3
    finally:
        c.close()


def test_a_heartbeat_answered_with_an_internal_error_keeps_the_lease(daemon, monkeypatch):
    """A daemon that failed answering one beat (an InternalError: a MemoryError it served on past)
    still holds the lease. The heartbeat took any error reply for a lost lease: it stopped, views were
    refused ("this client's lease lapsed") while calls still ran, and close() sent no detach, so the
    daemon set the client's blocks aside at the lapse (a review, a real daemon's injected MemoryError)."""
    beats = []
    real_call = Transport.call

    def call(self, op, *args, **kwargs):
        if op == Op.HEARTBEAT and threading.current_thread().name.startswith("dflash2-heartbeat"):
            beats.append(op)
            if len(beats) == 2:
                from dflash2.errors import DaemonError

                raise DaemonError("InternalError", "MemoryError: one beat out of memory")
        return real_call(self, op, *args, **kwargs)

    monkeypatch.setattr(Transport, "call", call)
    c = Client.connect(daemon.endpoint, name="beats", layouts=[SMALL])
    try:
        lid = c.layout_ids[0]
        places = c.allocate(lid, 2)
        time.sleep(3 * c.lease_timeout_s)
        assert len(beats) > 3, "the heartbeat went on past the failed beat"
        assert c._heartbeat_thread.is_alive() and not c.lease_lost
        assert c.view(int(places["vid"][0])).numel() > 0
    finally:
        released = c.close()
    assert released.get("freed") == 2, released  # detached: its blocks freed, not set aside


def test_a_connect_with_too_few_descriptors_left_is_refused_not_an_abort(daemon):
    script = textwrap.dedent(f"""
        import os, resource
        from dflash2.client import Client
        from dflash2.errors import DaemonUnavailable
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            Client.connect({daemon.endpoint!r}, name="starved")
        except DaemonUnavailable as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]  # libzmq aborted the process (134), or a raw ZMQError
    assert "refused: cannot connect to" in out.stdout and "file descriptors left" in out.stdout


def test_use_after_detach_and_a_place_of_the_wrong_kind_are_named(daemon):
    c = Client.connect(daemon.endpoint, name="misuse", layouts=[SMALL], heartbeat=False)
    placed = c.allocate(c.layouts[0], 1)
    with pytest.raises(TypeError, match="a block is named by one place record .* not float 1.0"):
        c.view(1.0)
    with pytest.raises(TypeError, match="not bool True"):
        c.view_bytes(True)
    with pytest.raises(TypeError, match=r"one place record \(PLACE_DTYPE: places\[i\]\)"):
        c.view(placed)  # the whole array (was: "only 0-dimensional arrays can be converted", from numpy)
    c.detach()
    with pytest.raises(ArenaError, match="this client is detached"):
        c.view(int(placed["vid"][0]))  # (was: "not being written or acquired by this client")
    with pytest.raises(DaemonUnavailable, match="ping: this client is detached; connect a new Client"):
        c.ping()  # (was: "the connection to ... is closed")


def test_a_refused_attach_closes_its_socket(daemon, monkeypatch):
    """An attach the daemon refuses (or that times out) leaves no socket open: the Client never came to be,
    and its call socket stayed open until the garbage collector found it, a ResourceWarning ("Unclosed
    socket") each, and a serving loop retrying a refused attach held a descriptor a try meanwhile (a review:
    200 refused attaches, 14 to 59 descriptors open between collections)."""
    made = []

    class Recorded(Transport):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(client_module, "Transport", Recorded)
    with pytest.raises(client_module.DaemonError, match="more than 128"):
        Client.connect(daemon.endpoint, name="x" * 200, layouts=[SMALL])
    assert len(made) == 1 and made[0].closed and made[0]._sock is None
