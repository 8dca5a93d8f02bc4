"""A connection that sends calls and reads no reply holds at most REPLIES_QUEUED_PER_PEER replies of
the daemon's memory: ZeroMQ's default queue (1,000 messages of any size) let one such peer hold
1.9 GB (a review: `places` replies of 1.9 MB, never read). The rest are dropped, and logged."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import zmq

from dflash2 import protocol as P
from dflash2.daemon import server as server_mod
from dflash2.daemon.server import Server
from dflash2.daemon.service import Service
from dflash2.protocol import Op

from conftest import SMALL


def _call(sock, op, call_id, client=None, token=None, args=None, arrays=None):
    sock.send_multipart(P.encode_request(op, call_id, client, args, arrays, token=token))


class _NoReader:
    """A served daemon (a Service behind a Server on its own thread) and a peer attached on a socket
    that reads no reply unless asked: its receive queue is one message and 4 KiB of kernel buffer."""

    def __init__(self, make_manager, tmp_path, hbm_blocks: int):
        self.mgr = make_manager(hbm_blocks=hbm_blocks)
        self.svc = Service(self.mgr, lease_timeout_s=60.0, heartbeat_interval_s=10.0, pid_alive=lambda pid: True)
        self.srv = Server(self.svc, f"ipc://{tmp_path}/d.sock", tick_interval_s=30.0)
        self.loop = threading.Thread(target=self.srv.serve_forever)
        self.loop.start()
        self.ctx = zmq.Context()
        self.sock = sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(f"ipc://{tmp_path}/d.sock")

    def attach(self) -> tuple[int, str]:
        _call(self.sock, Op.ATTACH, 1, args={"name": "no-reader", "pid": 0, "layouts": [SMALL.to_dict()]})
        assert self.sock.poll(10_000)
        attached = P.decode_reply(self.sock.recv_multipart()).result
        return attached["client"], attached["token"]

    def answered(self, requests: int) -> None:
        """Wait until the daemon has taken `requests` requests (answered, or its reply dropped)."""
        deadline = time.monotonic() + 60
        while self.svc.counters["requests"] < requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.svc.counters["requests"] == requests, self.svc.counters

    def stop(self) -> None:
        self.srv.stop()
        self.loop.join(30)
        self.srv.close()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        if self.loop.is_alive():
            self.srv.stop()
            self.loop.join(10)


def test_replies_a_client_never_reads_are_dropped_not_queued_without_bound(make_manager, tmp_path, caplog):
    peer = _NoReader(make_manager, tmp_path, hbm_blocks=16)
    sock = peer.sock
    sent = 300
    try:
        with caplog.at_level("WARNING", logger="dflash2.daemon"):
            client, token = peer.attach()
            _call(sock, Op.ALLOCATE, 2, client, token, {"layout": 0, "n": 1})
            assert sock.poll(10_000)
            vid = np.frombuffer(P.decode_reply(sock.recv_multipart()).arrays[0], dtype=P.PLACE_DTYPE)["vid"][0]
            ids = np.full(65536, vid, dtype=P.VIDS_DTYPE).tobytes()  # each reply ~1.9 MB
            for i in range(sent):
                _call(sock, Op.PLACES, 3 + i, client, token, arrays=[ids])
            peer.answered(2 + sent)  # (every call answered, or its reply dropped, before the loop stops)
            peer.stop()
        dropped = sum(int(n) for n in re.findall(r"dropped (\d+) repl", caplog.text))
        # Queued: the peer's REPLIES_QUEUED_PER_PEER, and what the kernel's socket buffers took.
        assert dropped >= sent - server_mod.REPLIES_QUEUED_PER_PEER - 20, caplog.text
        assert "replies to one connection were queued unread" in caplog.text
        # The replies it did get are whole, and in order.
        got = []
        while sock.poll(100):
            got.append(P.decode_reply(sock.recv_multipart()))
        assert got and all(r.ok for r in got) and [r.call_id for r in got] == sorted(r.call_id for r in got)
    finally:
        peer.close()


def test_what_a_call_whose_reply_was_dropped_handed_out_is_given_back(make_manager, tmp_path, caplog):
    """A reply dropped for a full queue (or a gone connection) leaves its client without the ids its
    call handed out: those are given back, as a `forget` would. Before, 2,000 one-block allocations
    sent unread left every block whose reply was dropped held until detach (HBM full, a review)."""
    peer = _NoReader(make_manager, tmp_path, hbm_blocks=4096)
    mgr, svc, sock = peer.mgr, peer.svc, peer.sock
    sent = 1000
    try:
        with caplog.at_level("WARNING", logger="dflash2.daemon"):
            client, token = peer.attach()
            for i in range(sent):
                _call(sock, Op.ALLOCATE, 2 + i, client, token, {"layout": 0, "n": 1})
            peer.answered(1 + sent)
            got = []  # (read while the daemon runs: its queue's replies go with its socket)
            while sock.poll(500):
                got.append(P.decode_reply(sock.recv_multipart()))
            peer.stop()
        learned = [int(v) for r in got if r.ok for v in np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE)["vid"]]
        assert 0 < len(learned) < sent
        # The client holds the blocks it learned of, and no others.
        held, known = set(mgr.table.clients[client].refs), set(mgr.table.rows(np.array(learned)).tolist())
        assert held == known, (len(held), len(known))
        assert svc.counters["calls_undone"] == sent - len(learned)
        said = sum(int(n) for n in re.findall(r"what (\d+) of those calls handed out is given back",
                                              caplog.text))
        assert said == sent - len(learned), caplog.text
        mgr.check_invariants()
    finally:
        peer.close()


def test_what_a_call_whose_connection_went_handed_out_is_given_back_and_said(make_manager, tmp_path, caplog):
    """A reply whose connection is gone (a client that timed out resets its socket) is undelivered: what
    its call handed out is given back, and the minute's line says so (it was given back with a debug line
    alone, and the client's `forget` then found it settled: no word at the warning level, a read)."""
    peer = _NoReader(make_manager, tmp_path, hbm_blocks=16)
    svc = peer.svc
    began, go = threading.Event(), threading.Event()
    handle = svc.handle

    def slow(req, *args, **kw):
        if req.op == Op.ALLOCATE:
            began.set()
            assert go.wait(30)
        return handle(req, *args, **kw)

    svc.handle = slow
    try:
        with caplog.at_level("WARNING", logger="dflash2.daemon"):
            client, token = peer.attach()
            _call(peer.sock, Op.ALLOCATE, 2, client, token, {"layout": 0, "n": 3})
            assert began.wait(30)
            peer.sock.close(0)  # (gone before its reply)
            time.sleep(0.5)
            go.set()
            peer.answered(2)
            peer.stop()
        assert not peer.mgr.table.clients[client].refs  # the 3 blocks were given back
        assert svc.counters["calls_undone"] == 1
        said = ("1 undelivered: the connection was gone (a client that timed out), since the last such line; what 1 of "
                "those calls handed out is given back")
        assert said in caplog.text and "dropped" not in caplog.text, caplog.text
        peer.mgr.check_invariants()
    finally:
        peer.close()
