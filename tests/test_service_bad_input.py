"""Service without sockets: bad input gets an error reply naming the problem and changes nothing;
leases lapse on a fake clock (the client transport's replies: test_transport_replies.py)."""

from __future__ import annotations


import numpy as np
import pytest
from conftest import SMALL

from dflash2 import protocol as P
from dflash2.daemon.service import Service
from dflash2.layout import Layout
from dflash2.protocol import Op


@pytest.fixture
def service(make_manager, clock):
    dead: set[int] = set()
    svc = Service(make_manager(hbm_blocks=16, dram_blocks=16), lease_timeout_s=10.0, heartbeat_interval_s=2.0,
                  clock=clock, pid_alive=lambda pid: pid not in dead)
    svc.dead_pids = dead
    return svc


def token_of(svc, client):
    """The session token of an attached client (a well-formed wrong one for any other id)."""
    session = svc.sessions.get(client)
    return session.token if session is not None else (None if client is None else "0" * P.TOKEN_CHARS)


def call(svc, op, client=None, args=None, arrays=None, version=P.VERSION, call_id=7, token=...):
    token = token_of(svc, client) if token is ... else token
    return P.decode_reply(svc.handle_frames(P.encode_request(op, call_id, client, args, arrays, version=version,
                                                             token=token)))


def attach(svc, name="c", pid=0, pid_ns=None):
    args = {"name": name, "pid": pid, "layouts": [SMALL.to_dict()]}
    if pid_ns is not None:
        args["pid_namespace"] = pid_ns
    return call(svc, Op.ATTACH, args=args).result["client"]


V = str(P.VERSION).encode()  # frames of this version: their other faults are the ones named


def vids(*v):
    return [np.asarray(v, dtype=P.VIDS_DTYPE).tobytes()]


@pytest.mark.parametrize("frames, problem", [
    ([b"DFLASH2", b"1"], "at least 3 frames"),
    ([b"NOTDFL", b"1", b"{}"], "bad magic"),
    ([P.MAGIC, b"x", b"{}"], "not a decimal"),
    ([P.MAGIC, V, b"{not json"], "not valid JSON"),
    ([P.MAGIC, V, b"[1]"], "JSON object"),
    ([P.MAGIC, V, b'{"op": "teleport", "id": 1}'], "unknown op"),
    ([P.MAGIC, V, b'{"op": "free", "id": 1, "client": null}'], "needs an attached client"),
    ([P.MAGIC, V, b'{"op": "ping", "id": "one"}'], "call id"),
    ([P.MAGIC, V, b"[" * 100_000 + b"]" * 100_000], "nested too deeply"),  # 200 KB: under the header bound
    ([P.MAGIC, V, b'{"op": "ping", "id": 1, "args": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"],
     "nested too deeply"),
    # The frame bound is per frame: more frames than any op uses are refused, whatever they hold.
    ([P.MAGIC, V, b'{"op": "ping", "id": 1}', b"", b"", b""], "at most 5 frames (magic, version, header and up "
                                                             "to 2 arrays), got more"),
])
def test_malformed_frames_get_a_named_error(service, frames, problem):
    reply = P.decode_reply(service.handle_frames(frames))
    assert not reply.ok and problem in reply.error_message


def test_an_oversized_header_is_refused_to_the_call_that_sent_it(service):
    """A header past the bound (a raw client's, or an older library's) gets its refusal under its own
    call id: under id 0 the client library dropped it as not its own and waited out its timeout."""
    header = b'{"op":"set_weights","id":4242,"client":null,"args":{"pad":"' + b"x" * P.MAX_HEADER_BYTES + b'"}}'
    reply = P.decode_reply(service.handle_frames([P.MAGIC, V, header]))
    assert not reply.ok and reply.call_id == 4242 and f"exceeds {P.MAX_HEADER_BYTES}" in reply.error_message
    with pytest.raises(P.ProtocolError, match=rf"set_weights: a header of \d+ bytes is more than the daemon accepts "
                                              rf"\({P.MAX_HEADER_BYTES}"):
        P.encode_request(Op.SET_WEIGHTS, 1, None, {"pad": "x" * P.MAX_HEADER_BYTES})  # said before it is sent


@pytest.mark.parametrize("version", [1, P.VERSION + 1])
def test_version_mismatch_reply(service, version):
    """Version 1 clients (before GPUs went by UUID) and newer ones get a named error, not a wrong pool."""
    reply = call(service, Op.PING, version=version)
    assert reply.error_type == "VersionMismatch" and "version mismatch" in reply.error_message


def test_bad_arguments_change_nothing(service):
    c = attach(service)
    before = call(service, Op.STATS).result["tiers"]
    bad = [
        (Op.ALLOCATE, {"layout": 0, "n": "3"}, None, "must be int"),
        (Op.ALLOCATE, {"layout": 0, "n": -1}, None, "outside"),
        (Op.ALLOCATE, {"layout": 0, "n": 10**30}, None, "outside"),
        (Op.RESERVE, {"layout": 0, "tokens": True}, None, "must be int"),
        (Op.RESERVE, {"layout": 5, "tokens": 16}, None, "layout id 5"),
        (Op.LOOKUP, {}, [np.zeros(P.MAX_BATCH + 1, P.KEYS_DTYPE).tobytes()], "more than"),
        (Op.FREE, {}, [b"\x01\x02\x03"], "whole number"),
        (Op.FREE, {}, None, "missing array"),
        (Op.FREE, {}, vids(12345), "not live"),
        (Op.SET_WEIGHTS, {"weights": {"recency": "hot"}}, None, "must be numbers"),
        (Op.SET_WEIGHTS, {"weights": {"recency": 10**400}}, None, "recency"),  # past float's range
        (Op.SET_WEIGHTS, {"weights": {"recency": float("nan")}}, None, "got {'recency': nan}"),  # (was "-inf")
        # A misspelt argument ran the call with the default, silently (a review: "teir" took HBM)
        (Op.ALLOCATE, {"layout": 0, "n": 1, "teir": "dram"}, None, "allocate: unknown argument(s) 'teir' (it takes: "),
        (Op.ACQUIRE, {"prio": 3}, vids(1), "acquire: unknown argument(s) 'prio' (it takes: priority, tier)"),
        (Op.FREE, {"all": True}, vids(1), "free: unknown argument(s) 'all' (it takes: none)"),
    ]
    for op, args, arrays, problem in bad:
        reply = call(service, op, c, args, arrays)
        assert not reply.ok, (op, args)
        assert problem in reply.error_message or problem in reply.error_type, (op, reply.error_message)
    assert call(service, Op.STATS).result["tiers"] == before
    assert call(service, Op.CHECK).ok


def test_array_frames_an_op_does_not_read_are_refused_and_change_nothing(service):
    """A release of [a] and [b] as two frames released a, answered ok and left b pinned; a ping or an
    allocate with a frame answered ok (a review). More frames than the op reads: refused, naming both."""
    c = attach(service)
    placed = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 2}).arrays[0], P.PLACE_DTYPE)["vid"]
    a, b = (v.tobytes() for v in np.split(placed.astype(P.VIDS_DTYPE), 2))
    assert call(service, Op.ACQUIRE, c, {}, [a + b]).result["acquired"]
    for op, args, arrays in [(Op.RELEASE, {}, [a, b]), (Op.PING, {}, [b""]), (Op.ALLOCATE, {"layout": 0, "n": 1}, [a]),
                             (Op.FORGET, {"call": 5}, [a, b])]:
        reply = call(service, op, c, args, arrays)
        n = P.ARRAYS[op]
        assert reply.error_type == "ProtocolError" and reply.error_message == \
            f"{op.value} reads {n} array frame{'' if n == 1 else 's'} at most, got {len(arrays)}", reply
    assert call(service, Op.RELEASE, c, {}, [a + b]).ok  # both still pinned: one release of both lets them go
    assert not call(service, Op.RELEASE, c, {}, [a]).ok  # (and no pin was left to release)
    assert call(service, Op.CHECK).ok


@pytest.mark.parametrize("call_id", [0, -1, P.INT64_MAX + 1, 2 ** 64 + 5])
def test_a_call_id_forget_could_not_name_is_refused(service, call_id):
    """`forget` names a call by an id in [1, 2**63-1]: an allocate run under id 0 or 2**64 + 5 held its
    blocks until detach (a review); 0 is also the id of the daemon's answer to an unreadable message."""
    c = attach(service)
    header = ('{"op":"allocate","id":%d,"client":%d,"token":"%s","args":{"layout":0,"n":2}}'
              % (call_id, c, token_of(service, c))).encode()
    reply = P.decode_reply(service.handle_frames([P.MAGIC, V, header]))
    assert reply.error_type == "ProtocolError" and f"header.id must be an integer call id in [1, {P.INT64_MAX}], " \
        f"got {call_id}" in reply.error_message, reply
    assert all(t["used_bytes"] == 0 for t in call(service, Op.STATS).result["tiers"].values())


def test_foreign_blocks_and_double_free(service):
    a, b = attach(service, "a"), attach(service, "b")
    reply = call(service, Op.ALLOCATE, a, {"layout": 0, "n": 2})
    mine = np.frombuffer(reply.arrays[0], P.PLACE_DTYPE)["vid"]
    for op in (Op.FREE, Op.ACQUIRE, Op.ADD_REF, Op.COMMIT):
        reply = call(service, op, b, {}, [mine.tobytes()])
        assert reply.error_type == "NotOwner", (op, reply)
    assert call(service, Op.FREE, a, {}, [mine[:1].tobytes()]).result == {"freed": 1}
    reply = call(service, Op.FREE, a, {}, [mine[:1].tobytes()])
    assert not reply.ok and reply.error_type in ("UnknownBlock", "NotOwner")
    assert call(service, Op.CHECK).ok


def test_a_commit_naming_a_block_twice_is_refused_naming_it(service):
    """A commit of its own block listed twice is refused naming that block (it said "the same block",
    which of a batch of 1,024 it did not say: a review), and commits nothing."""
    a = attach(service, "a")
    reply = call(service, Op.ALLOCATE, a, {"layout": 0, "n": 3})
    mine = np.frombuffer(reply.arrays[0], P.PLACE_DTYPE)["vid"]
    listed = np.array([mine[0], mine[2], mine[1], mine[2]], dtype=P.VIDS_DTYPE)
    reply = call(service, Op.COMMIT, a, {}, [listed.tobytes(), np.arange(1, 5, dtype=P.KEYS_DTYPE).tobytes()])
    assert reply.error_type == "ValueError"
    assert reply.error_message == f"commit: block {int(mine[2]):#x} is listed twice (each block once a call)"
    reply = call(service, Op.COMMIT, a, {}, [mine.tobytes(), np.arange(1, 4, dtype=P.KEYS_DTYPE).tobytes()])
    assert reply.ok  # (all three were still being written)
    assert call(service, Op.CHECK).ok


def test_a_weight_past_its_bound_is_refused_as_it_was_sent(make_manager, clock):
    """A finite weight past heat's bound is named as sent: 1e308 was refused as "got {'recency': inf}"
    (a review); only an integer past float's range is taken as infinite."""
    svc = Service(make_manager(policy="heat"), lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock,
                  pid_alive=lambda pid: True)
    c = attach(svc)
    for weight, said in ((1e308, "1e+308"), (-1e302, "-1e+302"), (10**400, "inf")):
        reply = call(svc, Op.SET_WEIGHTS, c, {"weights": {"recency": weight}})
        assert reply.error_type == "ValueError" and reply.error_message.endswith(f"got {{'recency': {said}}}"), reply
    assert svc.manager.policy.weights["recency"] == 1.0


def test_a_parent_given_to_a_commit_without_keys_is_refused_not_ignored(service):
    """A commit's parent chains the blocks it publishes; a commit without content keys publishes none,
    and its parent, even one not live, was ignored without a word (a review)."""
    a = attach(service, "a")
    reply = call(service, Op.ALLOCATE, a, {"layout": 0, "n": 2})
    mine = np.frombuffer(reply.arrays[0], P.PLACE_DTYPE)["vid"]
    for arrays in ([mine.tobytes()], [mine.tobytes(), b""]):
        reply = call(service, Op.COMMIT, a, {"parent": -5}, arrays)
        assert reply.error_type == "ProtocolError" and reply.error_message.startswith(
            "commit: argument 'parent' (-0x5) chains published blocks under it, and a commit without content keys "
            "publishes none"), reply
    reply = call(service, Op.COMMIT, a, {}, [mine.tobytes(), np.array([7, 8], dtype=P.KEYS_DTYPE).tobytes()])
    assert reply.ok  # (still being written: the refused commits changed nothing)
    assert call(service, Op.CHECK).ok


def test_reserve_beyond_every_tier_is_rejected(service):
    c = attach(service)
    d = call(service, Op.RESERVE, c, {"layout": 0, "tokens": 10**9}).result
    assert d["outcome"] == "rejected" and "HBM" in d["reason"]


@pytest.mark.parametrize("op,args", [
    (Op.ALLOCATE, {"layout": 0, "n": 1, "request": 1 << 70}),
    (Op.RESERVE, {"layout": 0, "tokens": 16, "request": -(1 << 70)}),
    (Op.RESERVE, {"layout": 0, "tokens": 16, "deadline_s": float("nan")}),
    (Op.RESERVE, {"layout": 0, "tokens": 16, "deadline_s": float("inf")}),
    (Op.LOOKUP, {"layout": 1 << 64}),
])
def test_out_of_range_numbers_are_refused_before_any_change(service, op, args):
    c = attach(service)
    arrays = [np.ones(1, P.KEYS_DTYPE).tobytes()] if op is Op.LOOKUP else None
    reply = call(service, op, client=c, args=args, arrays=arrays)
    assert not reply.ok and reply.error_type == "ProtocolError"
    assert service.manager.stats()["tiers"]["hbm"]["blocks"] == 0
    assert not service.manager.admission.deferred
    assert call(service, Op.CHECK).ok


def test_an_absurd_pid_is_refused_and_the_background_step_survives(service):
    reply = call(service, Op.ATTACH, args={"name": "x", "pid": 1 << 40, "layouts": []})
    assert not reply.ok and "pid" in reply.error_message
    assert service.expire_leases() == []


def test_host_readers_get_no_prefetch_into_hbm(make_manager, clock):
    svc = Service(make_manager(hbm_blocks=8, dram_blocks=16, prefetch_window=2), lease_timeout_s=10.0,
                  heartbeat_interval_s=2.0, clock=clock)
    c = attach(svc)
    placed = call(svc, Op.ALLOCATE, client=c, args={"layout": 0, "n": 3, "tier": "dram"})
    vids = np.frombuffer(placed.arrays[0], P.PLACE_DTYPE)["vid"]
    call(svc, Op.COMMIT, client=c, arrays=[vids.tobytes(), np.array([1, 2, 3], P.KEYS_DTYPE).tobytes()])
    keys = np.array([1, 2, 3], P.KEYS_DTYPE).tobytes()
    found = call(svc, Op.LOOKUP, client=c, args={"tier": "dram"}, arrays=[keys])
    assert set(np.frombuffer(found.arrays[0], P.PLACE_DTYPE)["tier"].tolist()) == {1}, "still in DRAM"
    call(svc, Op.LOOKUP, client=c, arrays=[keys])  # an HBM reader: the window comes up
    assert svc.manager.stats()["tiers"]["hbm"]["blocks"] > 0


def test_two_pools_route_by_device_and_stats_add_up(make_manager, clock):
    """The multi-GPU routing on a CPU: one pool per device, a client's calls reach its pool only,
    and the top-level figures are the node's totals."""
    svc = Service({0: make_manager(hbm_blocks=8), 1: make_manager(hbm_blocks=8)}, lease_timeout_s=10.0,
                  heartbeat_interval_s=2.0, clock=clock)
    c0 = call(svc, Op.ATTACH, args={"name": "g0", "pid": 0, "layouts": [SMALL.to_dict()], "device": 0}).result
    c1 = call(svc, Op.ATTACH, args={"name": "g1", "pid": 0, "layouts": [SMALL.to_dict()], "device": 1}).result
    assert c0["client"] != c1["client"]
    placed = call(svc, Op.ALLOCATE, client=c1["client"], args={"layout": 0, "n": 3})
    vids = np.frombuffer(placed.arrays[0], P.PLACE_DTYPE)["vid"]
    call(svc, Op.COMMIT, client=c1["client"], arrays=[vids.tobytes(), np.array([7, 8, 9], P.KEYS_DTYPE).tobytes()])
    keys = np.array([7, 8, 9], P.KEYS_DTYPE).tobytes()
    assert len(np.frombuffer(call(svc, Op.LOOKUP, client=c1["client"], arrays=[keys]).arrays[0], P.PLACE_DTYPE)) == 3
    assert len(np.frombuffer(call(svc, Op.LOOKUP, client=c0["client"], arrays=[keys]).arrays[0], P.PLACE_DTYPE)) == 0
    bad = call(svc, Op.FREE, client=c0["client"], arrays=[vids.tobytes()])
    assert not bad.ok, "a block of GPU 1's pool is unknown to GPU 0's client"
    st = call(svc, Op.STATS).result
    assert st["tiers"]["hbm"]["blocks"] == 3 and st["tiers"]["hbm"]["capacity_bytes"] == 2 * 8 * 16384
    assert st["devices"]["1"]["tiers"]["hbm"]["blocks"] == 3 and st["devices"]["0"]["tiers"]["hbm"]["blocks"] == 0
    assert not call(svc, Op.ATTACH, args={"name": "x", "pid": 0, "device": 5}).ok
    assert call(svc, Op.CHECK).ok


@pytest.mark.parametrize("op, args", [
    (Op.COMMIT, {"parent": None}),
    (Op.LOOKUP, {"layout": None}),
    (Op.RESERVE, {"layout": 0, "tokens": 16, "deadline_s": None}),
    (Op.ACQUIRE, {"priority": None}),
    (Op.ADD_REF, {"priority": None}),
    (Op.HISTORY, {"since_s": None}),
    (Op.ATTACH, {"name": "n", "pid": 0, "pid_namespace": None, "gpu_uuid": None, "device": None}),
])
def test_an_argument_the_op_table_gives_as_null_by_default_takes_an_explicit_null(service, op, args):
    """The op table writes these defaults as `=null`; a raw client that spelled one out was refused
    "commit: argument 'parent' must be int, got NoneType" (a review)."""
    c = attach(service)
    placed = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}).arrays[0], P.PLACE_DTYPE)
    vid, keys = placed["vid"].astype(P.VIDS_DTYPE).tobytes(), np.array([5], P.KEYS_DTYPE).tobytes()
    if op is not Op.COMMIT:
        assert call(service, Op.COMMIT, c, arrays=[vid, keys]).ok
    arrays = {Op.COMMIT: [vid, keys], Op.LOOKUP: [keys], Op.ACQUIRE: [vid], Op.ADD_REF: [vid]}.get(op)
    reply = call(service, op, c, args, arrays)
    assert reply.ok, f"{reply.error_type}: {reply.error_message}"


def test_a_null_device_beside_a_gpu_uuid_is_not_both(make_manager, clock):
    """`device: null` is the device left out: beside a `gpu_uuid` it is not "both"; a number is."""
    svc = Service({0: make_manager(hbm_blocks=8), 1: make_manager(hbm_blocks=8)}, lease_timeout_s=10.0,
                  heartbeat_interval_s=2.0, clock=clock)
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    base = {"name": "g", "pid": 0, "layouts": [SMALL.to_dict()]}
    assert call(svc, Op.ATTACH, args={**base, "gpu_uuid": uuid, "device": None}).ok
    both = call(svc, Op.ATTACH, args={**base, "gpu_uuid": uuid, "device": 1})
    assert not both.ok and "give `gpu_uuid` or `device`, not both" in both.error_message
    c = call(svc, Op.ATTACH, args={**base, "device": None}).result["client"]
    assert svc.sessions[c].device == 0  # the first pool, as with no `device` at all


def test_every_op_names_the_arguments_it_takes_and_a_monitoring_port_goes_with_any():
    assert set(P.ARGS) == set(Op) and set(P.ARRAYS) == set(Op)
    assert all(P.decode_request(P.encode_request(op, 1, 3, {"request_port": 5555}, token="0" * P.TOKEN_CHARS))
               for op in Op)


def test_a_client_name_may_not_be_empty(service):
    """An empty name showed blank in `dflash2 status` and the log (a review)."""
    for name in ("", "  ", "\u200b", "\u200b \u200d", "\u200e\u200f", "\ufeff", "\u00ad"):
        reply = call(service, Op.ATTACH, args={"name": name, "pid": 0})
        assert not reply.ok and "argument 'name' is empty" in reply.error_message, name
    assert not service.sessions
    assert call(service, Op.ATTACH, args={"name": "a\u200db", "pid": 0}).ok  # (a joiner among letters is fine)


def test_a_client_name_is_bounded(service):
    """Every `stats` reply lists every client's name: an unbounded one would make it unreadable."""
    reply = call(service, Op.ATTACH, args={"name": "x" * (P.MAX_NAME_CHARS + 1), "pid": 0})
    assert not reply.ok and f"argument 'name' has {P.MAX_NAME_CHARS + 1} characters, more than" in reply.error_message
    assert not service.sessions
    assert call(service, Op.ATTACH, args={"name": "x" * P.MAX_NAME_CHARS, "pid": 0}).ok


@pytest.mark.parametrize("name, shown", [("x\ud800", "'\\ud800'"), ("evil\x1b[2J\n FAKE LINE", "'\\x1b'"),
                                         ("a\tb", "'\\t'"), ("a\u202eb", "'\\u202e'"), ("a\u2028b", "'\\u2028'")])
def test_a_client_or_layout_name_that_does_not_print_is_refused(service, name, shown):
    """Names are printed by `dflash2 status` and written into the log: a lone surrogate made `dflash2
    status` fail for everyone while that client was attached, and a newline or an escape forged log
    lines and rewrote operators' terminals (a review)."""
    reply = call(service, Op.ATTACH, args={"name": name, "pid": 0})
    assert not reply.ok and f"argument 'name' holds a control character or one that does not print ({shown})" \
        in reply.error_message
    assert not service.sessions
    layout = {"name": name, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "bf16", "tokens_per_block": 16}
    reply = call(service, Op.ATTACH, args={"name": "fine", "pid": 0, "layouts": [layout]})
    assert not reply.ok and "holds a control character or one" in reply.error_message and not service.sessions
    # Spaces of every kind, joiners and every script are names (isprintable refused a model path with a
    # full-width space, and sglang then ran without dflash2, a review).
    for fine in ("sglang:名前 with spaces:tp0", "sglang:/data/モデル\u3000v2:tp0", "a\u00a0b", "\U0001f468\u200d\U0001f469"):
        assert call(service, Op.ATTACH, args={"name": fine, "pid": 0}).ok, fine
        Layout(f"{fine}:mha", num_layers=1, num_kv_heads=1, head_dim=8, dtype="bf16", tokens_per_block=16)


def test_layouts_are_bounded_and_a_refused_one_changes_nothing(service):
    """A client that registers a new layout per call (a name with a counter in it) is refused past
    MAX_LAYOUTS by name; before, ids ran past the layout column's uint16 and an allocation then
    failed half way, leaving two blocks on one slot."""
    from dflash2.layout import Layout
    from dflash2.table.table import MAX_LAYOUTS

    def lay(i):
        return Layout(f"per-call-{i}", num_layers=1, num_kv_heads=1, head_dim=8, dtype="bf16", tokens_per_block=16)

    c = attach(service)
    table = service.manager.table
    for i in range(MAX_LAYOUTS - len(table.layouts)):
        assert table.register_layout(lay(i)) == i + 1
    assert table.register_layout(lay(5)) == 6  # one already known is no new one
    reply = call(service, Op.REGISTER_LAYOUT, c, {"layout": lay(MAX_LAYOUTS).to_dict()})
    assert not reply.ok and reply.error_type == "LayoutError"
    assert f"past {MAX_LAYOUTS} layouts" in reply.error_message and "'per-call-1024'" in reply.error_message
    reply = call(service, Op.ATTACH, args={"name": "late", "pid": 0, "layouts": [SMALL.to_dict(), lay(-1).to_dict()]})
    assert not reply.ok and reply.error_type == "LayoutError"
    assert len(table.layouts) == MAX_LAYOUTS and sorted(service.sessions) == [c]  # nobody attached
    reply = call(service, Op.ALLOCATE, c, {"layout": MAX_LAYOUTS - 1, "n": 1})
    assert reply.ok and reply.result["allocated"]
    assert table.block_bytes(table.rows(np.frombuffer(reply.arrays[0], dtype=P.PLACE_DTYPE)["vid"])).tolist() == \
        [lay(0).block_bytes]
    service.manager.check_invariants()


def test_a_request_takes_numpy_numbers_as_numbers_and_a_reply_refuses_them():
    """A prefill rate computed with numpy goes as the number it is (the JSON encoder refused it);
    a numpy bool, or anything else JSON has no form for, still fails in the client, by its type.
    A reply is encoded strictly: a numpy number in one is the daemon's bug, not sent."""
    frames = P.encode_request(P.Op.PREFILL_RATE, 1, 7, {"layout": np.int64(0), "tokens_per_s": np.float32(1e5)},
                              token="0" * P.TOKEN_CHARS)
    assert P.decode_request(frames).args == {"layout": 0, "tokens_per_s": 100000.0}
    for bad in (np.bool_(True), np.datetime64("2026-01-01"), object()):
        with pytest.raises(TypeError, match="is not JSON serializable"):
            P.encode_request(P.Op.PREFILL_RATE, 1, 7, {"layout": 0, "tokens_per_s": bad})
    with pytest.raises(TypeError, match="is not JSON serializable"):
        P.encode_reply(P.Reply(1, True, {"blocks": np.int64(3)}))


def test_a_layout_registered_after_attach_without_a_rate_is_a_client_of_it_that_gave_none(service):
    """README: placement drops a layout's blocks rather than demote them to a tier slower than a
    recompute only while every attached client of the layout has given a rate. A client that
    registered the layout after attach, without a rate, was not counted as one (its layout was judged
    by another engine's rate alone, and its blocks dropped, a review); one that attached with it was."""
    mgr = next(iter(service.managers.values()))
    a = call(service, Op.ATTACH, args={"name": "a", "pid": 0, "layouts": [SMALL.to_dict()],
                                       "prefill_tokens_per_s": [1e9]}).result["client"]
    assert mgr.read_cost.keeping_rate(0) == 1e9
    b = call(service, Op.ATTACH, args={"name": "b", "pid": 0}).result["client"]
    assert call(service, Op.REGISTER_LAYOUT, b, {"layout": SMALL.to_dict()}).result["layout"] == 0
    assert mgr.read_cost.keeping_rate(0) is None  # b's engine gave none
    # Registered again without a rate, a rate given before stays (test_client_daemon.py):
    call(service, Op.PREFILL_RATE, b, {"layout": 0, "tokens_per_s": 5e8})
    assert call(service, Op.REGISTER_LAYOUT, b, {"layout": SMALL.to_dict()}).result["layout"] == 0
    assert mgr.read_cost.keeping_rate(0) == 5e8
    assert mgr.read_cost.rate(a, 0) == 1e9
