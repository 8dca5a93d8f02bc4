"""The client transport against a socket that is not a daemon's loop: it never mistakes a late reply
for a new one, names the pid holding an endpoint it got no reply from, and reads or refuses replies
(moved from test_service_bad_input.py, past 600 lines)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from dflash2 import protocol as P
from dflash2.client import DaemonUnavailable, Transport
from dflash2.protocol import Op


def test_transport_drops_late_replies_after_a_timeout(tmp_path):
    """A server that answers the first call too late: that reply must never answer the second."""
    endpoint = f"ipc://{tmp_path}/slow.sock"
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    stop = threading.Event()

    def serve():
        first = True
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, *frames = router.recv_multipart()
            req = P.decode_request(frames)
            if first:
                time.sleep(0.4)
                first = False
            router.send_multipart([ident, *P.encode_reply(P.Reply(req.call_id, True, {"op": req.op.value}))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        t = Transport(endpoint, timeout_s=0.2)
        with pytest.raises(DaemonUnavailable, match=f"stats: no reply from dflash2d at {endpoint}"):
            t.call(Op.STATS)
        time.sleep(0.4)  # the late reply to `stats` is sent now, to the old socket
        assert t.call(Op.PING).result == {"op": "ping"}
        t.close()
    finally:
        stop.set()
        thread.join()
        router.close(0)


def test_a_call_that_times_out_on_a_daemon_that_holds_the_endpoint_names_its_pid(tmp_path):
    """One sent as the daemon began to stop (or before it served: taking its tiers) waited out its
    timeout and said "daemon gone or stuck", though the daemon held the endpoint's lock, its pid
    named there (a review). A serving daemon holds it too (busy, stuck): the words say both."""
    import fcntl
    import os

    endpoint = f"ipc://{tmp_path}/d.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)  # (bound, never answering: a loop that stopped reading)
    router.bind(endpoint)
    lock = os.open(f"{tmp_path}/d.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(lock, b"4242")
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = Transport(endpoint, timeout_s=0.3)
        try:
            with pytest.raises(DaemonUnavailable) as e:
                t.call(Op.STATS)
        finally:
            t.close()
        assert str(e.value).startswith(f"stats: no reply from dflash2d at {endpoint} within 0.3s (dflash2d pid 4242 holds "
                                       "the endpoint: stuck or busy, or starting or stopping"), str(e.value)
    finally:
        os.close(lock)
        router.close(0)


def test_a_reply_larger_than_a_request_may_be_still_reads():
    big = P.Reply(1, True, {"clients": ["x" * 1000] * 2000})  # 2 MB: the stats of many clients
    assert len(P.encode_reply(big)[2]) > P.MAX_HEADER_BYTES
    assert P.decode_reply(P.encode_reply(big)).result == big.result


def test_a_reply_that_is_neither_ok_nor_an_error_is_not_dflash2ds():
    """Another program on the endpoint that echoes frames back (zguide's simplest server) sends the
    request itself: taken for an error reply, `dflash2 status` said `Error: ` and nothing more."""
    import json

    from dflash2.errors import ProtocolError
    request = P.encode_request(P.Op.STATS, 7, None)
    with pytest.raises(ProtocolError, match="not a dflash2d reply"):
        P.decode_reply(request)
    for header in ({"id": 1, "ok": False}, {"id": 1, "ok": "yes"}, {"id": 1, "ok": False, "error": "x"}):
        with pytest.raises(ProtocolError, match="not a dflash2d reply"):
            P.decode_reply([P.MAGIC, P.VERSION_FRAME, json.dumps(header).encode()])
    reply = P.decode_reply(P.encode_reply(P.error_reply(1, ValueError("bad"))))
    assert (reply.ok, reply.error_type, reply.error_message) == (False, "ValueError", "bad")


def test_an_unreadable_reply_is_a_daemon_error_naming_the_op(tmp_path):
    """A reply this side cannot decode raises DaemonError (which every command reports in one line),
    never a bare ProtocolError with a traceback."""
    from dflash2.client import DaemonError

    endpoint = f"ipc://{tmp_path}/odd.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)

    def serve():
        ident, *_ = router.recv_multipart()
        router.send_multipart([ident, P.MAGIC, str(P.VERSION).encode(), b"[" * 100_000])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    t = Transport(endpoint, timeout_s=5.0)
    try:
        with pytest.raises(DaemonError, match=f"stats: the reply from {endpoint} cannot be read") as e:
            t.call(Op.STATS)
        assert e.value.kind == "ProtocolError"
    finally:
        t.close()
        thread.join()
        router.close(0)
