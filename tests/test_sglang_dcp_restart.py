"""The sglang backend with decode context parallelism and across a daemon restart, against the real
sglang and the real daemon (skipped where sglang is not importable; README, "sglang"). A review
found: an MLA server with `--dcp-size 2` never stored or read a page (the backend checked sglang's
host indices, whole logical pages of page_size x dcp_size tokens, against the rank's page); and after
a restart and a successful reattach, a storage thread's error on the replaced client took the whole
backend down for another 10 s."""

from __future__ import annotations

import argparse
import json
import threading
import time

import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as exc:  # not installed, or installed without its dependencies
    pytest.skip(f"sglang is not importable here ({type(exc).__name__}: {exc}); run these tests in the sglang "
                "environment (README, 'sglang')", allow_module_level=True)

import dflash2.client.sglang.backend as backend_module
from daemon_proc import DaemonProcess
from dflash2.client.sglang.identity import server_args
from dflash2.client.sglang.plugin import backend_extra_config
from test_sglang import backends, daemon, fill, host_pool, indices, make_backend  # noqa: F401

LOGICAL_PAGE, DCP = 8, 2


def dcp_pool():
    dev = MLATokenToKVPool(64, LOGICAL_PAGE, torch.bfloat16, 32, 8, 2, "cpu", False, start_layer=0, end_layer=1)
    return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, LOGICAL_PAGE, "page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=dev.layer_num,
                                override_kv_cache_dim=dev.kv_cache_dim, dcp_size=DCP, dcp_rank=0)


def test_an_mla_server_with_decode_context_parallelism_stores_and_reads_its_pages(daemon, backends):
    path = daemon[0]
    pool = dcp_pool()
    assert pool.page_size == LOGICAL_PAGE // DCP and pool.logical_page_size == LOGICAL_PAGE
    extra = json.loads(backend_extra_config(path, None, model=server_args(argparse.Namespace(model_path="test/ds"))))
    extra["dflash2_timeout_s"] = 2.0
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="test/ds", extra_config=extra, dcp_size=DCP, dcp_rank=0,
                               logical_page_size=LOGICAL_PAGE)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    backends.append(b)
    assert b.active and b.is_writer
    # two logical pages (1 and 2), filled through sglang's own page view
    for p in (1, 2):
        page = pool.get_data_page(p * LOGICAL_PAGE, flat=False)
        page.copy_(torch.randn(page.shape).to(page.dtype) + p)
    want = [pool.get_data_page(p * LOGICAL_PAGE, flat=True).clone() for p in (1, 2)]
    # as sglang's _page_backup slices them: page_size (logical) host indices per key
    idx = torch.arange(1 * LOGICAL_PAGE, 3 * LOGICAL_PAGE, dtype=torch.int64)
    assert b.batch_set_v1(["d1", "d2"], idx) == [True, True]
    dst = torch.arange(5 * LOGICAL_PAGE, 7 * LOGICAL_PAGE, dtype=torch.int64)
    assert b.batch_get_v1(["d1", "d2"], dst) == [True, True]
    for p, w in zip((5, 6), want):
        assert torch.equal(pool.get_data_page(p * LOGICAL_PAGE, flat=True), w)


def test_an_error_on_the_client_replaced_at_a_reattach_does_not_take_the_backend_down(config_file, backends, monkeypatch):
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        monkeypatch.setattr(backend_module, "RETRY_S", 0.5)
        pool = host_pool()
        b = make_backend(path, pool, dflash2_timeout_s=2.0)
        backends.append(b)
        fill(pool, [1, 2], seed=1)
        assert b.batch_set_v1(["a"], indices([1])) == [True]

        in_copy, go = threading.Event(), threading.Event()
        real = backend_module.load_page

        def slow_load(pool_, page, raw):  # a large page being copied out (8 MiB pages: tens of ms)
            real(pool_, page, raw)
            in_copy.set()
            go.wait(10)
        monkeypatch.setattr(backend_module, "load_page", slow_load)
        got = {}
        reader = threading.Thread(target=lambda: got.update(a=b.batch_get_v1(["a"], indices([3]))))
        reader.start()
        assert in_copy.wait(10)

        proc.stop()                       # the daemon restarts (an upgrade, a crash and restart)
        proc = DaemonProcess(path).start()
        # another storage thread (backup) finds the lease lost, attaches to the new daemon, stores
        # (RETRY_S shortened to 0.5 s: the documented misses after the daemon went away, then the attach)
        deadline = time.monotonic() + 10
        while b.batch_set_v1(["z"], indices([2])) != [True]:
            assert time.monotonic() < deadline, b.counters
            time.sleep(0.1)
        assert b.batch_exists(["z"]) == 1
        go.set()                          # the first thread's copy ends; it releases on the old client
        reader.join()
        # the new daemon is up, attached and holds "z": nothing should be down now
        # (within RETRY_S of the reader's end: a backend marked down answers 0 without asking)
        assert b.batch_exists(["z"]) == 1, (got, b.counters)
    finally:
        proc.stop()
