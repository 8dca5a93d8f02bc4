"""A daemon of several block pools (one per GPU), with host-memory pools standing for the GPUs (a
review of 2026-12-05): one pool's copies hold no other pool's parked calls, a drain slice stops for a
waiting request after the pool at hand and takes the pools in turn, and a lone pool's metrics carry
its own GPU's label. Each failed before its fix."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from conftest import SMALL, write_config
from observe_helpers import scrape
from test_parked_calls import CHAIN, LAYOUT, HeldDisk, chain_on_nvme, in_background

from dflash2.assemble import build_manager
from dflash2.client import Client
from dflash2.config import load_config
from dflash2.daemon.parking import Parked, ParkedCalls
from dflash2.daemon.server import Server
from dflash2.daemon.service import Service
from dflash2.daemon.sessions import Session
from dflash2.metrics import DaemonMetrics
from dflash2.status import render
from dflash2.tiers import Tier


def pools(tmp_path, n: int, **memory) -> dict:
    made = {}
    for d in range(n):
        folder = tmp_path / f"pool{d}"
        folder.mkdir()
        cfg = load_config(write_config(folder, memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                                       "staging_buffer_size_mb": 1, **memory},
                                       kv_block={"block_size": 16, "prefetch_window": 0}))
        made[d] = build_manager(cfg, instance=f"dflash2-test-{uuid.uuid4().hex[:8]}")
    return made


@pytest.mark.parametrize("tick_s, step_due", [(30.0, False), (2.0, True)])
def test_a_pools_parked_call_does_not_wait_for_another_pools_reads(tmp_path, monkeypatch, tick_s, step_due):
    """GPU 1's disk holds its promotion's reads; GPU 0's acquire, parked on its own 50 ms of reads,
    waited for GPU 1's too (the loop answered parked calls once no pool had copies in flight), and
    then, once the background step was due, up to a tick interval in the step's wait for every
    pool's copies (a review of the first fix: 2.0 s at a 2 s tick)."""
    mgrs = pools(tmp_path, 2)
    try:
        _, vids0 = chain_on_nvme(mgrs[0])
        _, vids1 = chain_on_nvme(mgrs[1])
        held = HeldDisk(mgrs[1], monkeypatch)
        nvme0 = mgrs[0].arenas[Tier.NVME]
        read0 = nvme0.read_blocks

        def slow(offsets, buffers):
            time.sleep(0.05)
            return read0(offsets, buffers)

        monkeypatch.setattr(nvme0, "read_blocks", slow)
        svc = Service(mgrs, lease_timeout_s=60.0, heartbeat_interval_s=10.0, pid_alive=lambda pid: True)
        srv = Server(svc, f"ipc://{tmp_path}/d.sock", tick_interval_s=tick_s)
        loop = threading.Thread(target=srv.serve_forever)
        loop.start()
        try:
            endpoint = f"ipc://{tmp_path}/d.sock"
            with Client.connect(endpoint, name="g0", layouts=[LAYOUT], device=0) as c0, \
                    Client.connect(endpoint, name="g1", layouts=[LAYOUT], device=1) as c1:
                t1, _ = in_background(lambda: c1.acquire([vids1[k] for k in CHAIN]))
                assert held.reading.wait(10)
                if step_due:
                    time.sleep(tick_s + 0.5)  # the step is due, GPU 1's reads still held
                began = time.monotonic()
                t0, got0 = in_background(lambda: c0.acquire([vids0[k] for k in CHAIN]))
                t0.join(5.0)
                took = time.monotonic() - began
                held.release()
                t0.join(10)
                t1.join(10)
                assert took < 0.5 * tick_s, f"GPU 0's acquire took {took:.2f} s, waiting for GPU 1's reads"
                assert [int(t) for t in got0["out"]["tier"]] == [int(Tier.HBM)] * len(CHAIN)
        finally:
            held.release()
            srv.stop()
            loop.join(10)
            srv.close()
    finally:
        for m in mgrs.values():
            m.close()


def test_a_drain_slice_stops_for_a_waiting_request_after_one_pool_and_takes_them_in_turn(tmp_path):
    """With a request queued, a slice started a piece in every draining pool (8 GPUs: 8 pieces
    before the request was read), and the first pool took every first piece."""
    mgrs = pools(tmp_path, 3, hbm_capacity_mb=2, dram_capacity_mb=32, nvme_capacity_mb=96, staging_buffer_size_mb=4)
    try:
        for m in mgrs.values():
            c = m.attach("w")
            m.register_layout(SMALL)
            key = 1
            while m.stats()["tiers"]["dram"]["used_bytes"] < 0.93 * m.stats()["tiers"]["dram"]["capacity_bytes"]:
                m.free(c, m.commit(c, m.allocate(c, 0, 32), list(range(key, key + 32))))
                key += 32
            m.settle()
            m.tick(drain=False)
            assert m.draining()
        srv = Server(Service(mgrs, lease_timeout_s=10, heartbeat_interval_s=1), f"ipc://{tmp_path}/s.sock", 0.05)
        srv._request_waits = lambda within_s=0.0: True  # a request is queued before each slice begins

        def moved() -> dict[int, int]:
            for m in mgrs.values():
                m.settle()
            return {d: m.stats()["moves"].get("dram->nvme", {}).get("blocks", 0) for d, m in mgrs.items()}

        before = moved()
        firsts = []
        for _ in range(3):
            srv._drain_slice(wait=True)
            now = moved()
            firsts.append([d for d in mgrs if now[d] > before[d]])
            before = now
        assert firsts == [[0], [1], [2]], firsts
        srv.close()
    finally:
        for m in mgrs.values():
            m.close()


def test_a_lone_pools_metrics_carry_its_gpus_label(make_manager, clock):
    """device.gpu_ids [3]: the one pool is GPU 3's; every per-GPU series said gpu="0"."""
    m = make_manager(hbm_blocks=8, dram_blocks=16, nvme_blocks=16, prefetch_window=2)
    svc = Service({3: m}, lease_timeout_s=10, heartbeat_interval_s=1, clock=clock, device="cuda")
    c = m.attach("full")
    m.register_layout(SMALL)
    assert m.allocate(c, 0, 8) is not None
    metrics = DaemonMetrics(svc, device="cuda")
    metrics.refresh(force=True)
    got = scrape(metrics)
    labels = {dict(k[1]).get("gpu") for k in got if "gpu" in dict(k[1])}
    assert labels == {"3"}, labels
    assert got[("dflash2_gpu_memory_utilization", (("gpu", "3"),))] == 1.0


def test_status_shows_each_gpus_tiers_and_each_clients_gpu(make_manager, clock):
    """`dflash2 status` showed the node's totals only: GPU 0's full HBM, refusing allocations, read
    as half full beside GPU 1's empty one, and nothing said which GPU a client used."""
    svc = Service({0: make_manager(hbm_blocks=8), 1: make_manager(hbm_blocks=8)}, lease_timeout_s=10,
                  heartbeat_interval_s=1, clock=clock)
    m0 = svc.managers[0]
    c = m0.attach("full")
    m0.register_layout(SMALL)
    assert m0.allocate(c, 0, 8) is not None
    svc.sessions[c] = Session(c, "engine0", 7, clock(), clock(), True, device=0)
    text = render(svc.stats())
    gpu_rows = [line.split() for line in text.splitlines() if line.startswith("  GPU ")]
    assert [(r[1], r[2], r[-2]) for r in gpu_rows] == [("0", "hbm", "100.0"), ("1", "hbm", "0.0")]
    header = next(line for line in text.splitlines() if line.startswith("id "))
    assert header.split() == ["id", "name", "pid", "GPU", "idle", "s"]


def test_the_drain_turn_goes_by_the_pool_that_ran(tmp_path):
    """8 pools, 0 and 7 draining, a request always waiting (a piece a slice): the turn went by
    index, past pools not draining, and pool 7 took 7 pieces of every 8 (a review of the fix)."""
    mgrs = pools(tmp_path, 8)
    try:
        srv = Server(Service(mgrs, lease_timeout_s=10, heartbeat_interval_s=1), f"ipc://{tmp_path}/s.sock", 0.05)
        srv._request_waits = lambda within_s=0.0: True
        pieces = []
        for d, m in mgrs.items():
            m.draining = lambda d=d: d in (0, 7)
            m.drain_slice = lambda budget, yield_to, d=d: pieces.append(d) or 0.0
        for _ in range(80):
            srv._drain_slice(wait=True)
        assert pieces.count(0) == pieces.count(7) == 40
        srv.close()
    finally:
        for m in mgrs.values():
            m.close()


def test_parked_calls_are_ready_only_when_one_would_run():
    """A call of no pool waits for every pool's copies and holds the calls behind it: ready() said
    True for an idle pool's call behind it, answer() ran nothing, and the loop would spin."""
    running = {0: True, 1: False}
    parked = ParkedCalls(lambda device: not any(running.values()) if device is None else not running[device])
    parked.append(([b"x"], Parked(device=None)))
    parked.append(([b"y"], Parked(device=1)))
    ran = []
    assert not parked.ready()
    parked.answer(lambda frames, p: ran.append(frames) or True)
    assert ran == [] and len(parked) == 2
    running[0] = False
    assert parked.ready()
    parked.answer(lambda frames, p: ran.append(frames) or True)
    assert ran == [[b"x"], [b"y"]] and not parked
