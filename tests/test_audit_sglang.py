"""dflash2 as sglang's storage backend under misuse and sglang's real calling conventions (sglang
0.5.23, the real daemon subprocess): a hit query longer than one protocol call, tensors that are not
one page, a strided target, and a hybrid model's extra host pools. Runs where sglang is importable
(README, "sglang"), like test_sglang.py."""

from __future__ import annotations

import logging
import time

import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as exc:  # not installed, or installed without its dependencies
    pytest.skip(f"sglang is not importable here ({type(exc).__name__}: {exc}); run these tests in the sglang "
                "environment (README, 'sglang')", allow_module_level=True)

from daemon_proc import DaemonProcess
from dflash2.protocol import MAX_BATCH
from test_sglang import backends, daemon  # noqa: F401  (fixtures)
from test_sglang import PAGE, fill, host_pool, indices, make_backend, storage_config

KEYS = [f"page-{i:04d}" for i in range(4)]


def one_page(daemon, backends, seed: int):
    """A backend over test_sglang's daemon, and page 1 of its host pool filled from `seed`."""
    pool = host_pool()
    backend = make_backend(daemon[0], pool)
    backends.append(backend)
    fill(pool, [1], seed=seed)
    return backend, pool.get_data_page(PAGE, flat=True)


def page_of_4k(tokens: int) -> MHATokenToKVPoolHost:
    """A host pool of 4 KiB pages (2 layers x K,V x 4 tokens x 2 heads x 64 dims x bf16): one
    aligned block each, so that a DRAM tier of 288 MiB holds more pages than one call carries."""
    dev = MHATokenToKVPool(tokens, PAGE, torch.bfloat16, 2, 64, 2, "cpu", False, start_layer=0, end_layer=1)
    info = dev.get_device_pool_infos()[0]
    return MHATokenToKVPoolHost(info.buffer_info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=1)


def test_hit_query_longer_than_one_call_counts_every_cached_page(config_file, backends):
    """sglang 0.5.23's HybridCacheController (every model's cache controller) asks `batch_exists` for
    all the pages of a prompt in one call (hybrid_cache_controller.py, `_storage_hit_query`: one
    `batch_exists(hash_value, extra_info)`); at its default page size of 1 a 70,000-token prompt is
    70,000 keys, more than one dflash2 call carries."""
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 288, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        pool = page_of_4k(1024)
        backend = make_backend(path, pool)
        backends.append(backend)
        keys = [f"long-{i}" for i in range(MAX_BATCH + 2)]
        src = indices(list(range(1, 129)))
        for lo in range(0, len(keys), 128):  # stored as sglang's backup does: 128 pages a call
            batch = keys[lo:lo + 128]
            assert all(backend.batch_set_v1(batch, src[:len(batch) * PAGE]))
        assert backend.batch_exists(keys + ["never-stored"]) == MAX_BATCH + 2
        assert backend.batch_exists(keys[:3] + ["never-stored"] * MAX_BATCH) == 3
        assert backend.counters["failed_calls"] == 0
    finally:
        proc.stop()


def test_batch_set_refuses_a_value_that_is_not_one_page(daemon, backends):
    backend, page = one_page(daemon, backends, seed=1)
    with pytest.raises(ValueError, match=r"'one-byte'.* 1 bytes .*holds 1024"):
        backend.batch_set(["one-byte"], [torch.ones(1, dtype=torch.uint8)])  # would broadcast to a page
    with pytest.raises(ValueError, match=r"'as-fp32'.* 2048 bytes .*torch.float32.*holds 1024"):
        backend.batch_set(["as-fp32"], [page.float()])
    with pytest.raises(TypeError, match=r"'none'.* NoneType"):
        backend.set("none", None)
    assert backend.batch_exists(["one-byte"]) == 0 and backend.batch_exists(["as-fp32"]) == 0
    assert backend.client.stats()["tiers"]["dram"]["blocks"] == 0  # nothing allocated and left behind


def test_batch_get_fills_a_strided_target(daemon, backends):
    backend, page = one_page(daemon, backends, seed=2)
    assert backend.batch_set(["k"], [page])
    target = torch.zeros(2 * page.numel(), dtype=page.dtype)[::2]  # a strided view of a larger buffer
    out = backend.batch_get(["k"], [target])
    assert out[0] is target and torch.equal(target, page)
    with pytest.raises(ValueError, match=r"'k'.* 512 bytes"):
        backend.batch_get(["k"], [torch.zeros(page.numel() // 2, dtype=page.dtype)])


def test_hybrid_model_pools_fall_back_and_v2_calls_answer(daemon, backends, caplog):
    """The calls sglang 0.5.23's HybridCacheController makes (hybrid_cache_controller.py): at attach,
    `register_mem_host_pool_v2(entry.host_pool, entry.name)` for every entry of its host pool group,
    the KV anchor first; with extra pools, `batch_exists_v2(hash_value, pool_transfers, extra_info)`,
    `batch_set_v2(transfers, extra_info=...)` and `batch_get_v2(transfers, extra_info=...)`."""
    kv_only = host_pool()
    plain = make_backend(daemon[0], kv_only)
    backends.append(plain)
    plain.register_mem_host_pool_v2(kv_only, PoolName.KV)  # a KV-only model: its anchor alone
    assert plain.fallback_reason is None and plain.active

    kv, swa = host_pool(), host_pool()
    hybrid = make_backend(daemon[0], kv)
    backends.append(hybrid)
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        hybrid.register_mem_host_pool_v2(kv, PoolName.KV)
        hybrid.register_mem_host_pool_v2(swa, PoolName.SWA)
    assert "fallback to default" in caplog.text and "swa host pool" in hybrid.fallback_reason
    transfers = [PoolTransfer(name=PoolName.SWA, host_indices=indices([1, 2]), keys=KEYS[:2])]
    info = HiCacheStorageExtraInfo()
    assert hybrid.batch_set_v2(transfers, extra_info=info) == {PoolName.SWA: [True, True]}
    assert hybrid.batch_set_v1(KEYS[:2], indices([1, 2]), info) == [True, True]  # accepted and dropped
    assert hybrid.batch_exists_v2(KEYS[:2], transfers, info).kv_hit_pages == 0
    assert hybrid.batch_get_v2(transfers, extra_info=info) == {PoolName.SWA: [False, False]}


def test_the_engines_prefill_rate_reaches_the_daemon_and_a_bad_one_falls_back(daemon, backends, caplog):
    """`dflash2_prefill_tokens_per_s` in the extra config: the daemon's lookups for this backend then
    offer no page that reads back more slowly than sglang recomputes it (cost-aware reuse)."""
    backend = make_backend(daemon[0], host_pool(), dflash2_prefill_tokens_per_s=20000.0)
    backends.append(backend)
    assert backend.active and backend.prefill_rate == 20000.0
    assert backend.client.stats()["read_cost"]["prefill_rates"] == 1
    for bad in (0, -3.0, "fast", True):
        with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
            broken = make_backend(daemon[0], host_pool(), dflash2_prefill_tokens_per_s=bad)
        backends.append(broken)
        assert not broken.active
        assert "dflash2_prefill_tokens_per_s: must be a positive number" in broken.fallback_reason
    config = storage_config(daemon[0])
    config.extra_config["dflash2_timeout_s"] = "soon"
    broken = StorageBackendFactory.create_backend("dynamic", config, host_pool())
    backends.append(broken)
    assert "dflash2_timeout_s: must be a positive number" in broken.fallback_reason


def test_a_later_chunk_that_fails_keeps_the_pages_already_stored_and_read(config_file, backends):
    """The daemon dies between two chunks of one call: the pages of the first chunk were stored (or
    read), and the answer says so, instead of False for every page."""
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    pool = host_pool()
    fill(pool, [1, 2, 3, 4], seed=5)
    pages = [pool.get_data_page(p * PAGE, flat=True) for p in (1, 2, 3, 4)]
    keys = [f"chunked-{i}" for i in range(4)]

    def attached(proc):
        backend = make_backend(path, pool)
        backends.append(backend)
        backend.chunk_pages = 2
        return backend

    def write(proc):
        def copy(i, raw):
            if proc is not None and i == 2:
                proc.stop()  # after the first chunk's commit, before the second's
            torch.from_dlpack(raw).view(pages[i].dtype).copy_(pages[i])
        return copy

    def read(proc):
        def check(i, raw):
            if i == 2:
                proc.stop()  # after the first chunk's release, before the second's
            assert bytes(torch.from_dlpack(raw).view(torch.uint8).numpy()) == bytes(pages[i].view(torch.uint8).numpy())
        return check

    proc = DaemonProcess(path).start()
    try:
        backend = attached(proc)
        assert backend._store(backend.client, keys, write(proc), None) == [True, True, False, False]
    finally:
        proc.stop()
    proc = DaemonProcess(path).start()
    try:
        backend = attached(proc)
        assert backend._store(backend.client, keys, write(None), None) == [True] * 4
        assert backend._load(backend.client, keys, read(proc)) == [True, True, False, False]
    finally:
        proc.stop()


def test_pages_whose_parent_was_evicted_meanwhile_are_stored_unlinked_and_counted(daemon, backends, caplog,
                                                                                  monkeypatch):
    """The parent found for a batch is gone by its commit (evicted in between: here a block freed
    before): the pages are stored without the link, and the fallback is logged and counted."""
    pool = host_pool()
    backend = make_backend(daemon[0], pool)
    backends.append(backend)
    client = backend.client
    gone = client.allocate(backend.layout_id, 1, tier=backend.tier)["vid"]
    client.free(gone)
    monkeypatch.setattr(backend, "_prefix_parent", lambda client, extra_info: int(gone[0]))
    fill(pool, [1, 2], seed=5)
    with caplog.at_level(logging.INFO, logger="dflash2.sglang"):
        assert backend.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert backend.counters["commits_unlinked"] == 1
    assert "2 pages committed without their parent link" in caplog.text
    assert backend.batch_exists(KEYS[:2]) == 2


def test_a_daemon_restarted_on_another_config_gets_pages_in_the_tiers_it_has(config_file, backends, monkeypatch,
                                                                             caplog):
    """A daemon killed and restarted with a changed config (here without its DRAM tier): the backend
    attaches again and writes pages where the new daemon can take them, with its prefill rate;
    before, it kept asking for the old DRAM tier, and every write and read failed until sglang
    restarted. The log says it is back (it said only that reads miss and writes fail, a review)."""
    from dflash2.client.sglang import backend as backend_module

    monkeypatch.setattr(backend_module, "RETRY_S", 0.2)
    memory = {"hbm_capacity_mb": 8, "nvme_capacity_mb": 0, "nvme_path": None, "page_kb": 64}
    with_dram = config_file(memory={**memory, "dram_capacity_mb": 16})
    proc = DaemonProcess(with_dram).start()
    try:
        pool = host_pool()
        backend = make_backend(with_dram, pool, dflash2_prefill_tokens_per_s=20000.0)
        backends.append(backend)
        assert backend.tier == "dram"
        proc.proc.kill()
        proc.proc.wait()
        config_file(memory={**memory, "dram_capacity_mb": 0})  # the same file, rewritten
        proc = DaemonProcess(with_dram).start()
        fill(pool, [1, 2], seed=5)
        deadline = time.monotonic() + 10
        with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
            while backend.batch_set_v1(KEYS[:2], indices([1, 2])) != [True, True]:
                assert time.monotonic() < deadline, backend.counters
                time.sleep(0.1)
        back = [r.getMessage() for r in caplog.records if "attached again" in r.getMessage()]
        assert len(back) == 1 and "pages to its hbm tier" in back[0] and "stored before are gone" in back[0], back
        assert backend.tier == "hbm"
        assert backend.batch_get_v1(KEYS[:2], indices([3, 4])) == [True, True]
        assert torch.equal(pool.get_data_page(3 * PAGE, flat=True), pool.get_data_page(PAGE, flat=True))
        assert backend.client.stats()["read_cost"]["prefill_rates"] == 1
    finally:
        proc.stop()


def test_a_page_larger_than_the_whole_dram_tier_falls_back_once(config_file, backends, caplog):
    """A 2 MiB page and a DRAM tier of 1 MiB: no page can ever be stored. The backend stayed active and
    every backup batch was refused NeverFits, a warning each, for the server's life (a review); now it
    falls back at registration, saying why in the one fallback line."""
    layers, heads, head_dim = 32, 32, 128  # a page of PAGE (4) tokens: 2 * 32 * 4 * 32 * 128 * 2 bytes = 2 MiB
    dev = MHATokenToKVPool(128, PAGE, torch.bfloat16, heads, head_dim, layers, "cpu", False,
                           start_layer=0, end_layer=layers - 1)
    info = dev.get_device_pool_infos()[0]
    pool = MHATokenToKVPoolHost(info.buffer_info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=layers - 1)
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 1, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
            backend = make_backend(path, pool)
            backends.append(backend)
            for n in range(3):
                backend.batch_set_v1([f"k{n}"], indices([1]))  # (sglang's default storage now)
        assert not backend.active
        assert "more than the daemon's whole dram tier (1048576 bytes)" in backend.fallback_reason
        lines = [r.getMessage() for r in caplog.records if "fall" in r.getMessage() or "NeverFits" in r.getMessage()]
        assert len(lines) == 1 and "memory.dram_capacity_mb" in lines[0], lines
    finally:
        proc.stop()


def fp8_pool(dtype) -> MHATokenToKVPoolHost:
    """A host pool over an fp8 device pool: sglang stores every fp8 format as uint8 on the host."""
    dev = MHATokenToKVPool(64, PAGE, dtype, 2, 16, 2, "cpu", False, start_layer=0, end_layer=1)
    info = dev.get_device_pool_infos()[0]
    return MHATokenToKVPoolHost(info.buffer_info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=1)


def test_fp8_formats_of_one_model_never_share_pages(daemon, backends, caplog):
    """fp8_e4m3 and fp8_e5m2 pages of one model hold the same bytes for different values, and both
    pools show uint8: their namespaces were equal, and an e5m2 server read e4m3 pages as hits (1.0
    came back as 0.5). The logical dtype (`--kv-cache-dtype`, passed by the flag) keeps them apart;
    a uint8 pool without it falls back rather than guess."""
    e4m3, e5m2 = fp8_pool(torch.float8_e4m3fn), fp8_pool(torch.float8_e5m2)
    a = make_backend(daemon[0], e4m3, dflash2_kv_cache_dtype="fp8_e4m3")
    b = make_backend(daemon[0], e5m2, dflash2_kv_cache_dtype="fp8_e5m2")
    backends += [a, b]
    assert a.keys.namespace != b.keys.namespace and a.keys.namespace.endswith("/kv=fp8_e4m3")
    e4m3.get_data_page(PAGE, flat=False).copy_(torch.ones(e4m3.get_data_page(PAGE, flat=False).shape)
                                               .to(torch.float8_e4m3fn).view(torch.uint8))
    assert a.batch_set_v1(KEYS[:1], indices([1])) == [True]
    assert b.batch_exists(KEYS[:1]) == 0 and b.batch_get_v1(KEYS[:1], indices([2])) == [False]
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        unknown = make_backend(daemon[0], fp8_pool(torch.float8_e4m3fn))
    backends.append(unknown)
    assert unknown.fallback_reason and "dtype is not known" in unknown.fallback_reason
    assert "fallback to default" in caplog.text


def test_a_pool_without_flat_pages_falls_back_instead_of_failing_sglangs_start(daemon, backends, caplog):
    """An asymmetric-head MHA model's host pool raises NotImplementedError from the flat-page calls:
    it went up into sglang's attach_storage_backend and stopped the scheduler."""
    from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost

    dev = MHATokenToKVPool(64, PAGE, torch.bfloat16, 2, 16, 2, "cpu", False, v_head_dim=8, start_layer=0, end_layer=1)
    pool = AsymmetricMHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                          pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                          start_layer=0, end_layer=1)
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        backend = make_backend(daemon[0], pool)
    backends.append(backend)
    assert "has no flat data pages" in backend.fallback_reason and "fallback to default" in caplog.text
    assert backend.client is None and backend.batch_exists(KEYS) == 0


def test_a_commit_the_daemon_answers_late_leaves_no_reference(daemon, backends):
    """The daemon stalls (SIGSTOP: slow, not dead) past the call's timeout while a batch commits; one
    page of it was cached already by another server. The clean-up free named ids the late commit had
    replaced, or was lost with the socket it was queued on: the writer held references on published
    pages for its whole life. The commit is now forgotten, and the daemon drops what it left."""
    import os
    import signal
    import threading

    path, proc = daemon
    pool = host_pool()
    fill(pool, [1, 2], seed=3)
    other = make_backend(path, pool, dflash2_timeout_s=5.0)
    writer = make_backend(path, pool, dflash2_timeout_s=0.5)
    backends += [other, writer]
    assert other.batch_set_v1(KEYS[1:2], indices([2])) == [True]
    commit = writer.client.commit

    def stalled(*a, **kw):
        os.kill(proc.pid, signal.SIGSTOP)
        threading.Timer(1.2, lambda: os.kill(proc.pid, signal.SIGCONT)).start()
        return commit(*a, **kw)

    writer.client.commit = stalled
    assert writer.batch_set_v1(KEYS[:2], indices([1, 2])) == [False, False]
    writer.client.commit = commit
    time.sleep(1.5)
    writer.client.ping()  # after the forget, on the socket it went on
    assert writer.client.detach()["dereferenced"] == 0


def test_a_long_model_path_still_attaches(config_file, daemon, backends):
    """sglang's model name is the model path by default; a local snapshot's path made the client
    name longer than the daemon takes (128 characters), and every scheduler fell back."""
    from dflash2.client.sglang.identity import client_name
    from dflash2.protocol import MAX_NAME_CHARS

    model = "/models/" + "snapshots/" * 12 + "Meta-Llama-3-8B-Instruct"
    name = client_name(model, 3)
    assert len(name) <= MAX_NAME_CHARS and name.endswith("Meta-Llama-3-8B-Instruct:tp3") and "..." in name
    assert client_name("meta-llama/Meta-Llama-3-8B-Instruct", 0) == "sglang:meta-llama/Meta-Llama-3-8B-Instruct:tp0"
    longer = "/mnt/shared/team/models/" + "checkpoints/" * 40 + "Meta-Llama-3-8B-Instruct"  # (a review: 516)
    for served in (model, longer):
        cfg = storage_config(daemon[0])
        cfg.model_name = served
        pool = host_pool()
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        backend.register_mem_pool_host(pool)
        backends.append(backend)
        assert backend.fallback_reason is None and backend.active, served


def test_long_model_paths_never_share_a_layout_name():
    """The layout's name holds the model cut to a bound, with a digest of the whole: two long paths
    of one tail, or a model spelled as another's cut form, still differ."""
    from dflash2.client.sglang.pages import page_layout

    a, b = ("/a" + "/checkpoints" * 40 + "/llama", "/b" + "/checkpoints" * 40 + "/llama")
    cut = page_layout(host_pool(), a).name
    names = {page_layout(host_pool(), m).name for m in (a, b, cut.split(":")[1])}
    assert len(names) == 3 and all(len(n) <= 512 for n in names) and "/checkpoints/llama#" in cut
    assert page_layout(host_pool(), "meta-llama/Llama-3-8B").name.startswith("sglang:meta-llama/Llama-3-8B:mha-")


METRIC_KEYS = [f"m-{i}" for i in range(8)]


def test_deduplicated_pages_are_not_reported_as_backed_up(daemon, backends):
    """sglang's storage metrics counted every key of a call as a page moved, at len(keys) * page
    bytes / call time: pages deduplicated against another server's copy (nothing written), writes
    that failed with the daemon down (no call made), reads that missed (a review)."""
    path, _ = daemon
    pool_a, pool_b = host_pool(), host_pool()
    a, b = make_backend(path, pool_a), make_backend(path, pool_b)
    backends += [a, b]
    fill(pool_a, list(range(1, 9)), seed=1)
    fill(pool_b, list(range(1, 9)), seed=1)
    assert a.batch_set_v1(METRIC_KEYS, indices(list(range(1, 9)))) == [True] * 8
    assert b.batch_set_v1(METRIC_KEYS, indices(list(range(1, 9)))) == [True] * 8  # all found cached: nothing written
    assert b.counters["pages_set"] == 0 and b.counters["pages_deduplicated"] == 8
    stats = b.get_stats()
    written = sum(stats.backup_pgs)
    gbps = stats.backup_bandwidth
    assert written == b.counters["pages_set"] == 0, f"backup_pgs says {written} pages at {gbps} GB/s; none was"
    assert a.get_stats().backup_pgs == [8]


def test_a_write_that_failed_with_the_daemon_down_is_not_reported_as_backed_up(daemon, backends):
    path, proc = daemon
    pool = host_pool()
    b = make_backend(path, pool)
    backends.append(b)
    fill(pool, [1, 2, 3, 4], seed=2)
    assert b.batch_set_v1(METRIC_KEYS[:1], indices([1])) == [True]
    b.get_stats()  # (drain)
    proc.stop()
    assert b.batch_set_v1(METRIC_KEYS[1:4], indices([2, 3, 4])) == [False] * 3  # the daemon is gone: nothing stored
    assert b.batch_set_v1(METRIC_KEYS[1:4], indices([2, 3, 4])) == [False] * 3  # within RETRY_S: not even asked
    stats = b.get_stats()
    assert sum(stats.backup_pgs) == 0, (
        f"backup_pgs {stats.backup_pgs} at {stats.backup_bandwidth} GB/s for writes that all failed")
