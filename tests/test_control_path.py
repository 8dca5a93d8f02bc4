"""The control path's shortcuts (dflash2/zmqio.py, protocol.py's header coding, the client's receive
slices): each gives what the general form gave, on the inputs that take its other branch too."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import zmq

from dflash2 import protocol as P
from dflash2.client import transport
from dflash2.client.transport import Transport
from dflash2.counts import any_true
from dflash2.errors import DaemonUnavailable, ProtocolError, VersionMismatch
from dflash2.zmqio import NOBLOCK, recv_frames, send_frames


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://control-path")
    b.connect("inproc://control-path")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


@pytest.mark.parametrize("frames", [[b"one"], [b"id", b"", b"DFLASH2", b"3", b"{}"], [b"x" * 200_000, b"tail"]])
def test_frames_arrive_as_send_multipart_sends_them(pair, frames):
    a, b = pair
    send_frames(a, frames)
    assert recv_frames(b) == frames
    a.send_multipart(frames)
    assert recv_frames(b) == frames
    send_frames(a, frames, NOBLOCK, copy=False)
    assert b.recv_multipart() == frames


def test_frames_past_the_most_a_caller_uses_are_received_but_not_kept(pair):
    a, b = pair
    send_frames(a, [b"id", b"magic", b"x" * 100, b"y" * 100_000, b"z"])
    assert recv_frames(b, most=3) == [b"id", b"magic", b"x" * 100, b""]  # one b"" stands for the rest
    send_frames(a, [b"next"])  # the whole message was taken: the next one comes whole
    assert recv_frames(b, most=3) == [b"next"]
    send_frames(a, [b""] * 100_000)  # (a b"" each held 8 bytes a frame: 64 MB for 8 million, a review)
    assert recv_frames(b, most=3) == [b""] * 4


def test_a_receive_without_a_message_raises_again(pair):
    _, b = pair
    with pytest.raises(zmq.Again):
        recv_frames(b, NOBLOCK)
    b.setsockopt(zmq.RCVTIMEO, 1)
    with pytest.raises(zmq.Again):
        recv_frames(b)


def _header_frames(raw: bytes, version: bytes = P.VERSION_FRAME) -> list[bytes]:
    return [P.MAGIC, version, raw]


def test_headers_decode_as_json_loads_of_bytes_decoded_them():
    header = {"op": "attach", "id": 7, "client": None, "token": None, "args": {"name": "é"}}
    text = json.dumps(header)
    for raw in (text.encode(), b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), text.encode("utf-32")):
        assert P.decode_request(_header_frames(raw)).args == {"name": "é"}
    for bad in (b"{", b"\xff\xfe\xfd", b"[1]"):
        with pytest.raises(ProtocolError):
            P.decode_request(_header_frames(bad))


def test_the_version_frame_is_read_as_a_number_when_it_is_not_this_version_s_bytes():
    raw = json.dumps({"op": "ping", "id": 1}).encode()
    assert P.decode_request(_header_frames(raw, f"0{P.VERSION}".encode())).op == P.Op.PING
    with pytest.raises(VersionMismatch):
        P.decode_request(_header_frames(raw, str(P.VERSION - 1).encode()))
    with pytest.raises(ProtocolError, match="not a decimal number"):
        P.decode_request(_header_frames(raw, b"three"))


@pytest.mark.parametrize("op", ["no-such-op", ["lookup"], {"op": 1}, 3, None])
def test_an_op_that_names_no_op_is_refused_with_what_it_named(op):
    raw = json.dumps({"op": op, "id": 1}).encode()
    with pytest.raises(ProtocolError, match="unknown op"):
        P.decode_request(_header_frames(raw))


def test_headers_encode_to_the_bytes_json_dumps_gave():
    frames = P.encode_request(P.Op.LOOKUP, 12, 34, {"tier": "dram", "x": 1.5}, [b"k"], token="ab" * 16)
    header = {"op": "lookup", "id": 12, "client": 34, "token": "ab" * 16, "args": {"tier": "dram", "x": 1.5}}
    assert frames == [P.MAGIC, b"3", json.dumps(header, separators=(",", ":")).encode(), b"k"]
    assert P.encode_request(P.Op.PING, 1, None, version=2)[1] == b"2"
    reply = P.Reply(5, True, {"withheld": 0, "é": [1, None]}, arrays=[b"r"])
    expected = {"id": 5, "ok": True, "result": {"withheld": 0, "é": [1, None]}}
    assert P.encode_reply(reply) == [P.MAGIC, b"3", json.dumps(expected, separators=(",", ":")).encode(), b"r"]


def _answer_once(router: zmq.Socket) -> None:
    frames = router.recv_multipart()
    req = P.decode_request(frames[1:])
    router.send_multipart([frames[0], *P.encode_reply(P.Reply(req.call_id, True, {"pong": True}))])


@pytest.fixture
def router(tmp_path):
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{tmp_path}/r.sock")
    yield sock
    sock.close(0)


def test_a_call_receives_in_slices_and_its_last_slice_waits_only_what_is_left(router, monkeypatch):
    """A waiting call receives in slices of GONE_CHECK_S (the socket's RCVTIMEO), and its last slice
    waits only what is left of its timeout: answered in it, the socket receives in whole slices
    again; unanswered, the call ends at its timeout (not a slice later), on a fresh socket."""
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    monkeypatch.setattr(transport, "GONE_CHECK_S", 2.0)  # a slice longer than the calls' timeouts
    t = Transport(endpoint, timeout_s=1.0)
    try:
        assert t._sock.getsockopt(zmq.RCVTIMEO) == 2000
        answering = threading.Thread(target=_answer_once, args=(router,))
        answering.start()
        assert t.call(P.Op.PING).result == {"pong": True}  # (its only slice is its last: 1 s)
        answering.join()
        assert t._sock.getsockopt(zmq.RCVTIMEO) == 2000, "the last slice's timeout stayed on the socket"
        old, started = t._sock, time.monotonic()
        with pytest.raises(DaemonUnavailable, match="no reply"):
            t.call(P.Op.PING, timeout_s=0.1)
        assert time.monotonic() - started < 1.0, "the call waited a whole slice past its timeout"
        assert t._sock is not old and t._sock.getsockopt(zmq.RCVTIMEO) == 2000
    finally:
        t.close()


@pytest.mark.parametrize("size", [0, 1, 3, 64, 1000])
def test_any_true_is_any(size):
    rng = np.random.default_rng(size)
    for p in (0.0, 0.01, 0.5, 1.0):
        mask = rng.random(size) < p
        assert any_true(mask) == bool(mask.any())
