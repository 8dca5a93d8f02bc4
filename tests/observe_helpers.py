"""Helpers for the observability tests: a real dflash2d subprocess, a raw protocol client, a load."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dflash2 import protocol as P

LAYOUT = {"name": "t", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16",
          "tokens_per_block": 16}  # 16 KiB blocks: the test config's 8 MiB HBM holds 512
START_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawClient:
    """The control protocol over a zmq DEALER, one call at a time (no client library needed)."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = iter(range(1, 1 << 62))
        self.timeout_s = timeout_s
        self.client: int | None = None
        self.token: str | None = None  # the session token attach returned

    def call(self, op: P.Op, args: dict | None = None, arrays: list[bytes] | None = None) -> P.Reply:
        cid = next(self._ids)
        self._sock.send_multipart(P.encode_request(op, cid, self.client, args, arrays, token=self.token))
        if not self._sock.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(f"{op.value}: no reply in {self.timeout_s}s")
        reply = P.decode_reply(self._sock.recv_multipart())
        assert reply.call_id == cid
        if not reply.ok:
            raise RuntimeError(f"{op.value}: {reply.error_type}: {reply.error_message}")
        return reply

    def attach(self, name: str = "load") -> int:
        r = self.call(P.Op.ATTACH, {"name": name, "pid": os.getpid(), "layouts": [LAYOUT]})
        self.client = r.result["client"]
        self.token = r.result["token"]
        self.layout = r.result["layouts"][0]
        return self.client

    def allocate(self, n: int) -> np.ndarray:
        r = self.call(P.Op.ALLOCATE, {"layout": self.layout, "n": n})
        assert r.result["allocated"], r.result
        return np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE)["vid"].copy()

    def commit(self, vids: np.ndarray, keys: list[int]) -> np.ndarray:
        r = self.call(P.Op.COMMIT, {}, [vids.astype(P.VIDS_DTYPE).tobytes(),
                                       np.asarray(keys, dtype=P.KEYS_DTYPE).tobytes()])
        return np.frombuffer(r.arrays[0], dtype=P.VIDS_DTYPE).copy()

    def lookup(self, keys: list[int]) -> np.ndarray:
        r = self.call(P.Op.LOOKUP, {"layout": self.layout}, [np.asarray(keys, dtype=P.KEYS_DTYPE).tobytes()])
        return np.frombuffer(r.arrays[0], dtype=P.PLACE_DTYPE).copy()

    def vids_call(self, op: P.Op, vids: np.ndarray) -> P.Reply:
        return self.call(op, {}, [np.asarray(vids, dtype=P.VIDS_DTYPE).tobytes()])

    def stats(self) -> dict:
        return self.call(P.Op.STATS).result

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


@contextlib.contextmanager
def running_daemon(config_path: str, log_path: str):
    """Start `dflash2d --config` and wait for its start-up line; SIGTERM it afterwards."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config_path],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        line = ""
        while "DFlash2: enabled" not in line:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise RuntimeError(f"dflash2d did not start (rc {proc.poll()}): {open(log_path).read()[-2000:]}")
            if select.select([proc.stdout], [], [], left)[0]:
                line = proc.stdout.readline()
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


def fill_then_reuse(c: RawClient, chain: int = 256, extra: int = 320) -> dict:
    """A small load: cache a chain of `chain` blocks, push part of it out of HBM with `extra` private
    blocks, free those, then look the chain up and acquire it again (promotions: reads below HBM)."""
    keys = list(range(1, chain + 1))
    vids = c.allocate(chain)
    held = c.commit(vids, keys)
    c.vids_call(P.Op.FREE, held)  # cached, idle: may be demoted
    private = c.allocate(extra)  # HBM makes room by demoting idle cached blocks
    c.vids_call(P.Op.FREE, private)
    found = c.lookup(keys)
    c.vids_call(P.Op.ADD_REF, found["vid"])
    r = c.vids_call(P.Op.ACQUIRE, found["vid"])
    assert r.result["acquired"], r.result
    c.vids_call(P.Op.RELEASE, found["vid"])
    return {"chain": chain, "extra": extra, "found": len(found)}


BOUNDED_LABELS = {"tier", "direction", "op", "state", "outcome", "action", "kind", "result", "le",
                  "device", "policy", "version", "mechanism", "gpu", "list", "cause"}


def scrape(metrics) -> dict:
    """A DaemonMetrics' scrape as {(name, sorted labels): value}; every label is a bounded one."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            assert set(s.labels) <= BOUNDED_LABELS, (s.name, s.labels)
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def service(make_manager, clock):
    """A Service over a small metadata-only manager (HBM 8 blocks, DRAM 16) on the test's clock."""
    from dflash2.daemon.service import Service

    mgr = make_manager(hbm_blocks=8, dram_blocks=16)
    return Service(mgr, lease_timeout_s=10, heartbeat_interval_s=1, clock=clock)


def call_ok(service, op, client=None, args=None, arrays=None):
    """A call through the service's request path, which must succeed."""
    token = service.sessions[client].token if client is not None else None
    reply = service.handle(P.decode_request(P.encode_request(op, 1, client, args, arrays, token=token)))
    assert reply.ok, reply.error_message
    return reply


def load(service) -> int:
    """Six blocks cached, four pushed to DRAM by a later allocation, then all six acquired."""
    from conftest import SMALL

    c = call_ok(service, P.Op.ATTACH, args={"name": "t", "pid": 0, "layouts": [SMALL.to_dict()]}).result["client"]
    m = service.manager
    vids = m.allocate(c, 0, 6)
    m.commit(c, vids, list(range(1, 7)))
    m.free(c, vids)
    m.free(c, m.allocate(c, 0, 6))
    found = [p.vid for p in m.lookup(list(range(1, 7)), 0)]
    m.add_ref(c, found)
    assert m.acquire(c, found) is not None
    return c
