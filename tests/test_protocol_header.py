"""A request's header is read strictly (protocol.decode_request): a key named twice, at its top or in
its arguments, and a top-level field the protocol has not are refused, naming them, and run nothing.
json keeps the last of two equal keys and the daemon ignored fields it did not know: a review's
`{"op": "free", ..., "op": "ping"}` ran a ping, `"tier": "dram", "tier": "hbm"` allocated in HBM, and
`"arg"` for `"args"` ran a lookup with its defaults, all answered ok."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zmq
from conftest import SMALL
from daemon_proc import DaemonProcess
from monitor_helpers import served

from dflash2 import protocol as P
from dflash2.daemon.service import Service
from dflash2.errors import ProtocolError
from dflash2.protocol import Op

TOKEN = "0" * P.TOKEN_CHARS


def _decode(text: str) -> P.Request:
    return P.decode_request([P.MAGIC, P.VERSION_FRAME, text.encode()])


@pytest.mark.parametrize("text, where", [
    ('{"op":"free","id":5,"client":1,"token":null,"args":{},"op":"ping"}', "header.op"),
    ('{"op":"ping","id":5,"id":6}', "header.id"),
    ('{"op":"allocate","id":7,"client":1,"token":"%s","args":{"layout":0,"n":1,"tier":"dram","tier":"hbm"}}'
     % TOKEN, "header.args.tier"),
    ('{"op":"set_weights","id":7,"client":1,"token":"%s","args":{"weights":{"recency":1,"recency":2}}}'
     % TOKEN, "header.args.weights.recency"),
    ('{"op":"attach","id":1,"args":{"name":"x","pid":0,"layouts":[{"name":"a","name":"b"}]}}',
     "header.args.layouts[0].name"),
])
def test_a_key_named_twice_is_refused_naming_where(text, where):
    with pytest.raises(ProtocolError) as refused:
        _decode(text)
    assert str(refused.value).startswith(f"{where} is named twice: send each key once"), str(refused.value)


def test_a_header_field_the_protocol_has_not_is_refused_listing_those_it_has():
    with pytest.raises(ProtocolError) as refused:
        _decode('{"op":"lookup","id":9,"client":1,"token":"%s","arg":{"tier":"dram"},"prio":1}' % TOKEN)
    assert str(refused.value) == ("unknown header field(s) 'arg', 'prio' (a request's header has: args, client, "
                                  "id, op, token)")


def test_every_header_the_client_library_sends_still_decodes():
    """The client builds every header with encode_request (the transport, monitoring calls with
    `request_port`, the bench), and another language's client may leave fields out."""
    for op in Op:
        req = P.decode_request(P.encode_request(op, 1, 3, {"request_port": 5555}, [b""] * P.ARRAYS[op], token=TOKEN))
        assert req.op is op and req.args == {"request_port": 5555}
    assert _decode('{"op":"ping","id":1}').args == {}
    assert _decode(json.dumps({"op": "stats", "id": 2, "client": None, "token": None, "args": {}})).op is Op.STATS


def test_a_doubled_argument_allocates_nothing(make_manager, clock):
    svc = Service(make_manager(hbm_blocks=16, dram_blocks=16), lease_timeout_s=10.0, heartbeat_interval_s=2.0,
                  clock=clock, pid_alive=lambda pid: True)
    attached = P.decode_reply(svc.handle_frames(P.encode_request(
        Op.ATTACH, 1, None, {"name": "c", "pid": 0, "layouts": [SMALL.to_dict()]}))).result
    client, token = attached["client"], attached["token"]
    header = ('{"op":"allocate","id":7,"client":%d,"token":"%s","args":{"layout":0,"n":2,"tier":"dram","tier":"hbm"}}'
              % (client, token))
    reply = P.decode_reply(svc.handle_frames([P.MAGIC, P.VERSION_FRAME, header.encode()]))
    assert not reply.ok and reply.error_type == "ProtocolError" and "header.args.tier is named twice" in \
        reply.error_message, reply
    assert reply.call_id == 7
    stats = P.decode_reply(svc.handle_frames(P.encode_request(Op.STATS, 8, None))).result
    assert all(t["used_bytes"] == 0 for t in stats["tiers"].values()), stats["tiers"]


def test_the_monitoring_gate_and_the_loop_read_one_op_of_a_header_naming_op_twice(tmp_path, make_manager):
    """The tcp endpoint's gate decodes a monitoring call to refuse it by its op: a header naming `op`
    twice must not pass the gate as one op and run as another; both refuse it."""
    from dflash2.daemon import keygate

    _, srv = served(tmp_path, make_manager)
    try:
        for first, last in (("ping", "attach"), ("attach", "ping")):
            header = (f'{{"op":"{first}","id":7,"client":null,"token":null,"args":{{"request_port":'
                      f'{srv.service.request_port}}},"op":"{last}"}}')
            frames = keygate.ReadOnlyFrames([b"peer", P.MAGIC, P.VERSION_FRAME, header.encode()])
            frames.sock = srv._gate._monitoring
            refusal = srv._gate.refusal(frames)
            reply = P.decode_reply(refusal if refusal is not None else srv.service.handle_frames(frames[1:]))
            assert not reply.ok and "header.op is named twice" in reply.error_message, (first, last, reply)
        assert not srv.service.sessions
    finally:
        srv.close()


def test_a_daemon_refuses_a_misspelt_args_field_and_a_doubled_argument(tmp_path, config_file):
    """End to end, as a client in another language would send them: refused, nothing allocated."""
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(proc.endpoint)

    def call(header: str, arrays=()):
        sock.send_multipart([P.MAGIC, P.VERSION_FRAME, header.encode(), *arrays])
        return P.decode_reply(sock.recv_multipart())
    try:
        attach = {"op": "attach", "id": 1, "args": {"name": "raw", "pid": 0, "layouts": [SMALL.to_dict()]}}
        result = call(json.dumps(attach)).result
        head = f'"client":{result["client"]},"token":"{result["token"]}"'
        keys = np.array([1, 2, 3], dtype=P.KEYS_DTYPE).tobytes()
        misspelt = call(f'{{"op":"lookup","id":9,{head},"arg":{{"tier":"dram","probe":true}}}}', [keys])
        assert not misspelt.ok and "unknown header field(s) 'arg'" in misspelt.error_message, misspelt
        doubled = call(f'{{"op":"allocate","id":10,{head},"args":{{"layout":0,"n":1,"tier":"dram","tier":"hbm"}}}}')
        assert not doubled.ok and "header.args.tier is named twice" in doubled.error_message, doubled
        tiers = call('{"op":"stats","id":11}').result["tiers"]
        assert all(t["used_bytes"] == 0 for t in tiers.values()), tiers
    finally:
        sock.close(0)
        proc.stop()
    assert "Traceback" not in proc.log()


@pytest.mark.parametrize("bad", ["junk", "33870", 33870.0, [33870], None, True, 0, 65536, -1])
def test_a_request_port_that_is_no_port_number_is_refused_on_any_socket(bad):
    """A review: the request socket (and an ipc endpoint) ran `ping {"request_port": "junk"}` and
    `allocate` with `"request_port": [1]`, silently; only the monitoring socket's gate checked it."""
    for op in (Op.PING, Op.ALLOCATE):
        with pytest.raises(ProtocolError) as refused:
            P.decode_request(P.encode_request(op, 1, 3, {"request_port": bad}, token=TOKEN))
        assert str(refused.value) == (f"{op.value}: argument 'request_port' must be the tcp port (1-65535) of the "
                                      f"daemon the call asks about, got {bad!r}")
    assert P.decode_request(P.encode_request(Op.PING, 1, None, {"request_port": 65535})).args == {"request_port": 65535}


def test_a_header_with_an_integer_past_the_digit_limit_is_refused_as_such_and_answered_to_its_call():
    """A review: a number of 5,000 digits was refused as "not valid JSON" with Python's advice to call
    sys.set_int_max_str_digits() (the daemon's, not the sender's to act on), and answered as call 0."""
    header = f'{{"op":"ping","id":42,"client":null,"token":null,"args":{{"n":{"9" * 5000}}}}}'
    frames = [P.MAGIC, P.VERSION_FRAME, header.encode()]
    with pytest.raises(ProtocolError, match=r"^header holds an integer of more than 4300 digits: no argument takes one$"):
        P.decode_request(frames)
    assert P.peek_call_id(frames) == 42
    assert P.peek_call_id([P.MAGIC, P.VERSION_FRAME, b'{"op":"ping","id":43,"client":null,"args":{"n":}']) == 43


def test_a_call_id_that_is_no_integer_is_answered_as_call_0():
    """`"id": true` was refused, and the refusal carried `"id": true` back: no call id a client in a
    typed language can read (a review). Like any id that is not an integer, it is answered as call 0."""
    for raw in (b'{"op":"ping","id":true}', b'{"op":"ping","id":false}', b'{"op":"ping","id":5.0}'):
        frames = [P.MAGIC, P.VERSION_FRAME, raw]
        assert P.peek_call_id(frames) == 0
        with pytest.raises(ProtocolError, match=r"^header.id must be an integer call id"):
            P.decode_request(frames)
