"""Fuzz the daemon's message handling over its real socket: random and mutated frames get an error
reply each, the daemon keeps serving, and its invariants hold afterwards."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import zmq
from daemon_proc import DaemonProcess

from dflash2 import protocol as P
from dflash2.client import Client, Transport, chain_keys
from dflash2.layout import Layout

SMALL = Layout("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
MESSAGES = 1500
TIME_BUDGET_S = 20.0
WEIRD = [None, True, False, -1, 0, 1, 2**31, 2**63, 2**64 + 5, -(2**70), 1e308, -0.0, float("inf"), "x",
         "", [], [1, 2], {}, {"a": 1}, "💥" * 10, 10**400]


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


class Fuzzer:
    def __init__(self, rng: random.Random, tokens: dict[int, str], vids: list[int], keys: list[int]):
        self.rng = rng
        self.tokens = tokens  # client id -> its session token
        self.clients = list(tokens)
        self.vids = vids
        self.keys = keys

    def value(self):
        r = self.rng
        return r.choice(WEIRD + [r.randint(-5, 40), r.choice(self.vids), r.getrandbits(64), r.random()])

    def array(self) -> bytes:
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            return np.array(r.sample(self.vids, r.randint(1, len(self.vids))), dtype="<i8").tobytes()
        if kind == 1:
            return np.array(self.keys[:r.randint(1, len(self.keys))], dtype="<u8").tobytes()
        if kind == 2:
            return r.randbytes(r.randint(0, 64))
        if kind == 3:  # oversized batch
            return np.zeros(P.MAX_BATCH + 1, dtype="<i8").tobytes()
        if kind == 4:  # stale / foreign / negative ids
            return np.array([r.getrandbits(63), -1, 0, r.choice(self.vids) + (1 << 32)], dtype="<i8").tobytes()
        return np.array([r.choice(self.vids)] * r.randint(2, 4), dtype="<i8").tobytes()  # duplicates

    def args(self) -> dict:
        names = ["layout", "tokens", "n", "reservation", "parent", "priority", "deadline_s", "request", "name",
                 "pid", "layouts", "weights", "pid_namespace", "tokens_per_s", "prefill_tokens_per_s", "bogus"]
        out = {name: self.value() for name in self.rng.sample(names, self.rng.randint(0, 5))}
        if self.rng.random() < 0.2:
            out["layout"] = SMALL.to_dict() if self.rng.random() < 0.5 else {"name": 3, "dtype": "fp99"}
        if self.rng.random() < 0.1:
            out["layouts"] = [SMALL.to_dict(), {"num_layers": -1}]
        if self.rng.random() < 0.1:
            out["weights"] = {"recency": self.value(), "x": self.value()}
        return out

    def valid_shaped(self, call_id: int) -> list[bytes]:
        r = self.rng
        op = r.choice([o for o in P.Op if o not in (P.Op.DETACH,)])
        client = r.choice(self.clients + [None, 0, 999, -3])
        arrays = [self.array() for _ in range(r.randint(0, 3))]
        token = self.tokens.get(client) if r.random() < 0.9 else None
        if token is None or r.random() < 0.05:  # missing, wrong or another client's token
            token = r.choice([None, "0" * P.TOKEN_CHARS, "x" * 40, *self.tokens.values()])
        return P.encode_request(op, call_id, client, self.args(), arrays, token=token)

    def mutate(self, frames: list[bytes]) -> list[bytes]:
        r = self.rng
        frames = list(frames)
        kind = r.randrange(9)
        if kind == 0:
            return frames[:r.randint(0, len(frames) - 1)] or [b""]  # truncated message
        if kind == 1:
            frames[0] = r.choice([b"", b"DFLASH1", b"dflash2", r.randbytes(7)])  # wrong magic
        elif kind == 2:
            frames[1] = r.choice([b"", b"0", b"2", b"-1", b"1.0", b"x", b"\xff", str(2**70).encode()])
        elif kind == 3:
            h = frames[2]
            frames[2] = h[:r.randint(0, len(h))]  # bad JSON
        elif kind == 4:
            frames[2] = json.dumps(r.choice([[], "op", 1, None, {"op": "lookup"}, {"op": self.value(), "id": 1},
                                             {"op": "ping", "id": self.value()},
                                             {"op": "free", "id": 1, "client": self.value(), "args": self.value()},
                                             {"op": "nope", "id": 2, "client": 1, "args": {}}])).encode()
        elif kind == 5:
            b = bytearray(frames[2])
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] = r.randrange(256)  # flipped bytes
            frames[2] = bytes(b)
        elif kind == 6:
            frames.append(r.randbytes(r.randint(0, 100)))
        elif kind == 7:
            frames[2] = json.dumps({"op": "lookup", "id": 1, "client": None, "args": {}, "pad": "x" * (P.MAX_HEADER_BYTES + 1)}).encode()
        else:
            frames = [r.randbytes(r.randint(0, 20)) for _ in range(r.randint(1, 6))]  # noise
        return frames


def test_fuzzed_frames_get_replies_and_the_daemon_survives(daemon):
    rng = random.Random(0xDF1A5)
    owner = Client.connect(daemon.endpoint, name="owner", layouts=[SMALL])
    other = Client.connect(daemon.endpoint, name="other", layouts=[SMALL])
    lid = owner.layouts[0]
    keys = chain_keys(range(4 * 16), 16, "fuzz")
    published = owner.commit(owner.allocate(lid, 4)["vid"], keys=keys)
    private = owner.allocate(lid, 3)["vid"]
    freed = other.allocate(lid, 2)["vid"]
    other.free(freed)  # stale ids
    fuzz = Fuzzer(rng, {c.client_id: c._token for c in (owner, other)}, [int(v) for v in (*published, *private, *freed)], keys)

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    internal, replies, started = [], 0, time.monotonic()
    for i in range(MESSAGES):
        if time.monotonic() - started > TIME_BUDGET_S:
            break
        frames = fuzz.valid_shaped(i + 1)
        if rng.random() < 0.6:
            frames = fuzz.mutate(frames)
        sock.send_multipart(frames)
        assert sock.poll(5000, zmq.POLLIN), f"no reply to message {i}: {frames[:3]!r}"
        reply = P.decode_reply(sock.recv_multipart())
        replies += 1
        if not reply.ok and reply.error_type == "InternalError":
            internal.append((frames[:3], reply.error_message))
    sock.close(0)
    assert replies >= 200
    assert not internal, f"{len(internal)} internal errors, first: {internal[0]}"

    # Still serving, invariants hold, and a normal round trip works for both old and new clients.
    t = Transport(daemon.endpoint)
    assert t.call(P.Op.PING).result["version"] == P.VERSION
    t.call(P.Op.CHECK)
    t.close()
    fresh = Client.connect(daemon.endpoint, name="fresh", layouts=[SMALL])
    found = fresh.lookup(keys)
    places = fresh.acquire(found["vid"]) if len(found) else fresh.allocate(lid, 1)
    assert places is not None
    fresh.check()
    for c in (fresh, owner, other):
        c.close()
    t = Transport(daemon.endpoint)
    t.call(P.Op.CHECK)
    st = t.call(P.Op.STATS).result
    t.close()
    # The clients that held anything are gone: nothing stays reserved.
    assert st["reservations"]["granted"] == 0 and st["reservations"]["reserved_blocks"] == 0


def test_an_oversized_header_is_refused_at_once_naming_its_size(daemon):
    """A call whose header is past the daemon's bound (1 MiB) fails at once saying so; before, the
    library sent it, dropped the daemon's refusal (sent under call id 0) and waited out its timeout
    to say the daemon was gone or stuck (a review)."""
    c = Client.connect(daemon.endpoint, name="big", timeout_s=3)
    try:
        for call in (lambda: c.set_weights({f"w{i}": 1.0 for i in range(100_000)}),  # a header of ~1.3 MB
                     lambda: Client.connect(daemon.endpoint, name="x" * (2 << 20), timeout_s=3)):
            began = time.monotonic()
            with pytest.raises(P.ProtocolError, match=rf"a header of \d+ bytes is more than the daemon accepts "
                                                      rf"\({P.MAX_HEADER_BYTES}"):
                call()
            assert time.monotonic() - began < 1.0
        assert c.ping()["version"] == P.VERSION  # and the daemon serves on
    finally:
        c.close()
