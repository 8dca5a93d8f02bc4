"""sglang's tensor-parallel ranks on a node of several GPUs, and its storage threads while the daemon
is gone (a review of 2026-12-04). The daemon keeps one block pool per GPU; on this machine two host
pools behind one in-process daemon stand for a two-GPU node (as `build_managers` makes them), and
CUDA's current device, which CUDA keeps per host thread, is emulated per thread. Runs where sglang is
importable (README, "sglang"), like test_sglang.py."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

try:
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
except Exception as exc:  # not installed, or installed without its dependencies
    pytest.skip(f"sglang is not importable here ({type(exc).__name__}: {exc}); run these tests in the sglang "
                "environment (README, 'sglang')", allow_module_level=True)

import dflash2.client.client as client_module
import dflash2.client.sglang.backend as backend_module
from daemon_proc import DaemonProcess
from dflash2.assemble import build_manager
from dflash2.config import load_config
from dflash2.daemon.server import Server
from dflash2.daemon.service import Service
from test_sglang import backends  # noqa: F401  (a fixture)
from test_sglang import fill, host_pool, indices, make_backend

MEMORY = {"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0, "nvme_path": None, "page_kb": 64}


def mla_pool():
    dev = MLATokenToKVPool(64, 4, torch.bfloat16, 32, 8, 2, "cpu", False, start_layer=0, end_layer=1)
    return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 4, "page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer,
                                target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim)


@pytest.fixture
def two_gpu_node(config_file, monkeypatch):
    """(config path, {device: manager}, service): one daemon loop over two host pools, as a two-GPU
    node's; CUDA's current device per thread (0 until a thread sets it), no GPU UUIDs."""
    path = config_file(memory=MEMORY)
    cfg = load_config(path)
    managers = {d: build_manager(cfg, instance=f"dflash2-test-{uuid.uuid4().hex[:8]}-{d}") for d in (0, 1)}
    service = Service(managers, lease_timeout_s=1.0, heartbeat_interval_s=0.2, pid_alive=lambda pid: True)
    server = Server(service, cfg.client_endpoint(), tick_interval_s=0.1)
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    current = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(current, "device", d))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "device", 0))
    monkeypatch.setattr(client_module, "_uuid_of_local_device", lambda device: None)
    try:
        yield path, managers, service
    finally:
        server.stop()
        loop.join(5)
        server.close()
        for m in managers.values():
            m.close()


def pool_of(service, b) -> int:
    return next(s.device for s in service.sessions.values() if s.client == b.client.client_id)


def test_an_mla_models_ranks_on_two_gpus_share_the_writers_pages(two_gpu_node, backends):
    """Only the writer rank stores an MLA model's pages; a reader rank on another GPU looked in its own
    GPU's pool and found nothing, and sglang, which takes the least of the ranks' hits, had none."""
    path, managers, service = two_gpu_node
    pools = [mla_pool(), mla_pool()]
    ranks = []
    for rank in (0, 1):
        torch.cuda.set_device(rank)
        ranks.append(make_backend(path, pools[rank], tp_rank=rank, tp_size=2, is_mla=True))
        backends.append(ranks[-1])
    writer, reader = ranks
    assert writer.is_writer and not reader.is_writer
    fill(pools[0], [1, 2, 3], seed=7)
    keys = ["m0", "m1", "m2"]
    assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    assert reader.batch_exists(keys) == writer.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, indices([4, 5, 6])) == [True] * 3
    for src, dst in ((1, 4), (2, 5), (3, 6)):
        assert torch.equal(pools[1].get_data_page(dst * 4, flat=True), pools[0].get_data_page(src * 4, flat=True))
    assert pool_of(service, writer) == pool_of(service, reader)
    assert writer.client.host_only and reader.client.host_only  # (neither maps that pool's GPU arena)


def test_a_rank_attaches_again_to_its_own_gpus_pool_from_sglangs_storage_thread(two_gpu_node, backends):
    """The attach after a lost lease runs in one of sglang's storage threads, whose current CUDA
    device is 0: rank 1 moved into GPU 0's pool (and its share of DRAM)."""
    path, managers, service = two_gpu_node
    torch.cuda.set_device(1)  # the scheduler of TP rank 1
    pool = host_pool()
    b = make_backend(path, pool, tp_rank=1, tp_size=2)
    backends.append(b)
    assert pool_of(service, b) == 1
    b.client._stop.set()  # its heartbeat stops: the lease lapses, as after a daemon restart
    deadline = time.monotonic() + 10
    while b.client.client_id in service.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    fill(pool, [1], seed=1)

    def storage_thread():
        b.batch_exists(["x"])  # finds the lease lost
        b.batch_set_v1(["x"], indices([1]))
    t = threading.Thread(target=storage_thread)
    t.start()
    t.join()
    assert pool_of(service, b) == 1
    assert managers[1].stats()["tiers"]["dram"]["blocks"] >= 1 and managers[0].stats()["tiers"]["dram"]["blocks"] == 0


def test_storage_threads_waiting_on_an_attach_that_failed_miss_at_once(config_file, backends, monkeypatch):
    """The daemon is gone: after RETRY_S one storage thread tries to attach again, and the others,
    waiting for it, each tried again in turn, a whole timeout each (sglang's threads held 2, 4 and
    6 s at a 2 s timeout)."""
    monkeypatch.setattr(backend_module, "RETRY_S", 1.0)
    path = config_file(memory=MEMORY)
    proc = DaemonProcess(path).start()
    pool = host_pool()
    b = make_backend(path, pool, tp_rank=0, tp_size=1, dflash2_timeout_s=2.0)
    backends.append(b)
    fill(pool, [1, 2], seed=1)
    b.batch_set_v1(["a"], indices([1]))
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait()
    b.batch_exists(["a"])  # finds the daemon gone
    time.sleep(1.1)  # past RETRY_S
    tries = []
    attach = b._attach
    b._attach = lambda: tries.append(1) or attach()
    got = {}
    threads = [threading.Thread(target=lambda: got.update(exists=b.batch_exists(["a"]))),
               threading.Thread(target=lambda: got.update(get=b.batch_get_v1(["a"], indices([2])))),
               threading.Thread(target=lambda: got.update(set=b.batch_set_v1(["a"], indices([1]))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tries) == 1, f"{len(tries)} attaches, each a whole timeout, one after the other"
    assert got == {"exists": 0, "get": [False], "set": [False]}
    proc.stop()


def test_an_mla_rank_of_a_daemon_without_dram_maps_hbm_to_store_there(config_file, backends, caplog):
    """A daemon with HBM alone takes sglang's pages in HBM, which a host_only client cannot view on a
    GPU daemon: every write of an MLA rank failed (a review; on this machine HBM is host memory, so
    the test checks that the rank attached again mapping it, and stores and reads)."""
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 0, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        pools = [mla_pool(), mla_pool()]
        with caplog.at_level("WARNING", logger="dflash2.sglang"):
            writer, reader = (make_backend(path, pools[r], tp_rank=r, tp_size=2, is_mla=True) for r in (0, 1))
        backends.extend([writer, reader])
        assert not writer.client.host_only and writer.tier == "hbm"
        assert "the daemon has no DRAM tier: this MLA rank maps the HBM" in caplog.text
        fill(pools[0], [1, 2], seed=3)
        assert writer.batch_set_v1(["k1", "k2"], indices([1, 2])) == [True, True]
        assert reader.batch_get_v1(["k1", "k2"], indices([3, 4])) == [True, True]
        assert torch.equal(pools[1].get_data_page(3 * 4, flat=True), pools[0].get_data_page(1 * 4, flat=True))
    finally:
        proc.stop()
