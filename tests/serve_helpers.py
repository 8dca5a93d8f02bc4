"""A block manager served by the daemon's loop in a thread of the test, and a ping that times its
answer: for tests of what the loop does between requests (drains, the background step)."""

from __future__ import annotations

import contextlib
import threading
import time

import zmq

from dflash2 import protocol as P
from dflash2.daemon.server import Server
from dflash2.daemon.service import Service
from dflash2.protocol import Op


@contextlib.contextmanager
def served(mgr, tmp_path, clock=time.monotonic, tick_interval_s: float = 30.0):
    """`mgr` behind a Server loop on ipc://tmp_path/d.sock; yields ping(), which returns how long its
    answer took. The loop is stopped and closed after."""
    svc = Service(mgr, lease_timeout_s=60.0, heartbeat_interval_s=10.0, clock=clock, pid_alive=lambda pid: True)
    srv = Server(svc, f"ipc://{tmp_path}/d.sock", tick_interval_s=tick_interval_s)
    loop = threading.Thread(target=srv.serve_forever)
    loop.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{tmp_path}/d.sock")

    def ping() -> float:
        started = time.monotonic()
        sock.send_multipart(P.encode_request(Op.PING, 1, None, {}))
        assert sock.poll(10_000), "no reply"
        sock.recv_multipart()
        return time.monotonic() - started
    try:
        yield ping
    finally:
        sock.close(0)
        ctx.term()
        srv.stop()
        loop.join(10)
        srv.close()
