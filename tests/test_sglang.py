"""dflash2 as sglang's HiCache storage backend, against the real sglang package (0.5.23) and the real
daemon subprocess, on the CPU: sglang's own host KV pool, its own storage-backend factory (`dynamic`)
and its own plugin loader.

sglang pins a torch of its own (about 11 GB with its dependencies), so these tests run in a separate
environment; see README, "sglang". Where sglang is not importable the whole module is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import subprocess
import sys

import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as exc:  # not installed, or installed without its dependencies
    pytest.skip(f"sglang is not importable here ({type(exc).__name__}: {exc}); run these tests in the sglang "
                "environment (README, 'sglang')", allow_module_level=True)

from dflash2.client.sglang.backend import DFlash2Storage
from dflash2.client.sglang.identity import server_args
from dflash2.client.sglang.plugin import backend_extra_config
from daemon_proc import DaemonProcess

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 4
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2  # bf16


def host_pool(layout: str = "page_first", tokens: int = 64, start_layer: int = 0) -> MHATokenToKVPoolHost:
    """sglang's host KV pool on the CPU (not pinned), over a CPU device pool (of a pipeline stage
    whose first layer is `start_layer`)."""
    dev = MHATokenToKVPool(tokens, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                           start_layer=start_layer, end_layer=start_layer + LAYERS - 1)
    info = dev.get_device_pool_infos()[0]
    return MHATokenToKVPoolHost(info.buffer_info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                end_layer=dev.end_layer)


def storage_config(config_path: str, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False,
                   **extra) -> HiCacheStorageConfig:
    # (The model's server arguments, as the flag passes them: test/llama is no local path, nor in the
    # Hugging Face cache, so its files are not read, as the backend says.)
    model = server_args(argparse.Namespace(model_path="test/llama"))
    extra_config = json.loads(backend_extra_config(config_path, None, model=model))
    # (A launch token of its own, as each server launch draws: clears.py; unless `dflash2_launch` is given.)
    extra_config.update({"dflash2_timeout_s": 1.0, "dflash2_launch": secrets.token_hex(8), **extra})
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=True,
                                is_page_first_layout=True, model_name="test/llama", extra_config=extra_config)


def make_backend(config_path: str, pool, **kw):
    """Through sglang's factory, then registered with the pool, as sglang's cache controller does."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(config_path, **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend


def fill(pool, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        page = pool.get_data_page(p * PAGE, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def page_bytes(pool, p: int) -> bytes:
    return pool.get_data_page(p * PAGE, flat=True).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def daemon(config_file):
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    yield path, proc
    proc.stop()


@pytest.fixture(autouse=True)
def a_process_of_its_own(monkeypatch):
    """Each test is a server's process of its own: the clears' per-process state (clears.py) starts
    empty (a rank of a process that has cleared never goes back to epoch 0: one test's clears moved
    the next one's backends)."""
    from dflash2.client.sglang import clears
    for name in ("_epochs", "_last", "_seen"):
        monkeypatch.setattr(clears, name, {})
    monkeypatch.setattr(clears, "_own", [])


@contextlib.contextmanager
def another_process(monkeypatch):
    """The calls within run as in another server's process: the clears' per-process state of its own
    (the state this test's process had stays, and is back after)."""
    from dflash2.client.sglang import clears
    state = {name: getattr(clears, name) for name in ("_epochs", "_last", "_seen", "_own")}
    for name, value in state.items():
        monkeypatch.setattr(clears, name, type(value)())
    try:
        yield
    finally:
        for name, value in state.items():
            monkeypatch.setattr(clears, name, value)


@pytest.fixture
def backends():
    made = []
    yield made
    for b in made:
        b.close()


KEYS = [f"page-{i:04d}" for i in range(8)]


def test_round_trip_through_sglang_factory(daemon, backends):
    path, _ = daemon
    pool = host_pool()
    backend = make_backend(path, pool)
    backends.append(backend)
    assert isinstance(backend, DFlash2Storage) and backend.fallback_reason is None
    src = [1, 2, 3, 4, 5, 6, 7, 8]
    fill(pool, src, seed=1)
    want = [page_bytes(pool, p) for p in src]
    assert backend.batch_exists(KEYS) == 0
    assert backend.batch_set_v1(KEYS, indices(src)) == [True] * 8
    assert backend.batch_exists(KEYS) == 8
    assert backend.batch_exists(KEYS[:3] + ["missing"] + KEYS[4:]) == 3  # the cached prefix
    dst = [9, 10, 11, 12, 13, 14, 15, 3]  # into other host pages (the last overwrites a source page)
    assert backend.batch_get_v1(KEYS, indices(dst)) == [True] * 8
    assert [page_bytes(pool, p) for p in dst] == want
    stats = backend.get_stats()
    assert stats.backup_pgs == [8] and stats.prefetch_pgs == [8]


def test_calls_time_out_as_the_config_says_unless_the_server_sets_its_own(config_file, backends):
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64}, daemon={"request_timeout_s": 1.25})
    proc = DaemonProcess(path).start()
    try:
        for own, want in ((None, 1.25), (0.75, 0.75)):
            config = storage_config(path)
            if own is None:
                del config.extra_config["dflash2_timeout_s"]
            else:
                config.extra_config["dflash2_timeout_s"] = own
            pool = host_pool()
            backend = StorageBackendFactory.create_backend("dynamic", config, pool)
            backends.append(backend)
            backend.register_mem_pool_host(pool)
            assert backend.fallback_reason is None and backend.client.timeout_s == want
    finally:
        proc.stop()


def test_generic_calls(daemon, backends):
    path, _ = daemon
    pool = host_pool()
    backend = make_backend(path, pool)
    backends.append(backend)
    fill(pool, [1, 2], seed=2)
    values = [pool.get_data_page(p * PAGE, flat=True) for p in (1, 2)]
    assert not backend.exists("a")
    assert backend.set("a", values[0]) and backend.batch_set(["a", "b"], values)
    assert backend.exists("a") and backend.exists("b")
    got = backend.get("b")
    assert torch.equal(got, values[1])
    targets = [pool.get_dummy_flat_data_page() for _ in range(3)]
    out = backend.batch_get(["a", "b", "c"], targets)
    assert torch.equal(out[0], values[0]) and torch.equal(out[1], values[1]) and out[2] is None
    assert backend.clear()


def test_two_instances_share_one_copy(daemon, backends):
    path, proc = daemon
    pool_a, pool_b = host_pool(), host_pool()
    a, b = make_backend(path, pool_a), make_backend(path, pool_b)
    backends += [a, b]
    fill(pool_a, [1, 2, 3, 4], seed=3)
    want = [page_bytes(pool_a, p) for p in (1, 2, 3, 4)]
    assert a.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    assert b.batch_exists(KEYS[:4]) == 4  # the second instance finds the first one's pages
    assert b.batch_get_v1(KEYS[:4], indices([5, 6, 7, 8])) == [True] * 4
    assert [page_bytes(pool_b, p) for p in (5, 6, 7, 8)] == want
    fill(pool_b, [1, 2, 3, 4], seed=3)  # the same content computed again by the second instance
    assert b.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    assert b.counters["pages_deduplicated"] == 4 and b.counters["pages_set"] == 0
    stats = a.client.stats()
    assert sum(t["blocks"] for t in stats["tiers"].values()) == 4  # one copy in the daemon
    a.client.check()


def test_tp_ranks_and_layouts_never_share(daemon, backends):
    path, _ = daemon
    pool0, pool1, pool_lf = host_pool(), host_pool(), host_pool("layer_first")
    rank0 = make_backend(path, pool0, tp_rank=0, tp_size=2)
    rank1 = make_backend(path, pool1, tp_rank=1, tp_size=2)
    layer_first = make_backend(path, pool_lf, tp_rank=0, tp_size=2)
    backends += [rank0, rank1, layer_first]
    fill(pool0, [1, 2], seed=4)
    assert rank0.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert rank1.batch_exists(KEYS[:2]) == 0  # another rank's shard
    assert layer_first.batch_exists(KEYS[:2]) == 0  # another byte format


def test_pipeline_stages_holding_other_layers_never_share(daemon, backends):
    """Two servers of one model, --pp-size 3, with other SGLANG_PP_LAYER_PARTITION (10,10,12 and
    12,10,10): stage 1 holds 10 layers in both, layers 10-19 and 12-21. With the pp rank and the layer
    count alone in the namespace, one stage read the other's pages, KV of other layers, as hits (a
    review): the stage's first layer (the host pool's start_layer) is in it now."""
    path, _ = daemon

    def stage(start_layer, pp_rank=1):
        pool = host_pool(start_layer=start_layer)
        config = storage_config(path)
        config.pp_rank, config.pp_size = pp_rank, 3
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backends.append(backend)
        backend.register_mem_pool_host(pool)
        return pool, backend

    (pool_a, a), (_, b), (_, same) = stage(10), stage(12), stage(10)
    fill(pool_a, [1, 2], seed=5)
    assert a.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert b.batch_exists(KEYS[:2]) == 0  # layers 12-13 are not layers 10-11
    assert same.batch_exists(KEYS[:2]) == 2 and "pp=1/3@layer10" in same.keys.namespace  # the same stage shares


def test_clear_moves_this_server_to_a_fresh_key_space(daemon, backends, caplog, monkeypatch):
    """sglang's /clear_hicache_storage_backend (after update_weights_from_disk / _from_tensor, whose
    flush resets only sglang's radix tree) calls clear() on every rank and logs success. It changed
    nothing: the server read the KV of its old weights as hits (a review). Now its pages are keyed
    in its next clear epoch; another server's pages, the same ones, stay hits for it. (Another server
    is another process: this process's backends of the rank follow its clear, clears.follow.)"""
    path, _ = daemon
    pool, other_pool = host_pool(), host_pool()
    with another_process(monkeypatch):
        other = make_backend(path, other_pool)
    backend = make_backend(path, pool)
    backends += [backend, other]
    fill(pool, [1, 2, 3, 4], seed=1)  # KV of the old weights
    old = [page_bytes(pool, p) for p in (1, 2, 3, 4)]
    assert backend.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    with caplog.at_level(logging.INFO, logger="dflash2.sglang"):
        assert backend.clear() is True
    assert "clear epoch 1" in caplog.text
    assert backend.batch_exists(KEYS[:4]) == 0
    assert backend.batch_get_v1(KEYS[:4], indices([9, 10, 11, 12])) == [False] * 4
    fill(pool, [1, 2, 3, 4], seed=2)  # KV of the new weights, under the same sglang keys
    new = [page_bytes(pool, p) for p in (1, 2, 3, 4)]
    assert backend.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    assert backend.batch_get_v1(KEYS[:4], indices([9, 10, 11, 12])) == [True] * 4
    assert [page_bytes(pool, p) for p in (9, 10, 11, 12)] == new
    with another_process(monkeypatch):
        assert other.batch_get_v1(KEYS[:4], indices([9, 10, 11, 12])) == [True] * 4  # the others' hits stay
    assert [page_bytes(other_pool, p) for p in (9, 10, 11, 12)] == old


def test_a_ranks_second_backend_in_the_process_follows_its_clear(daemon, backends, caplog):
    """sglang's PD decode with --disaggregation-decode-enable-offload-kvcache makes two backends of one
    rank from one extra config (the tree cache's and its offload manager's); /clear_hicache_storage_backend
    reaches only the tree cache's. The offload backend kept writing the new weights' KV under the old
    weights' namespace (a review): it follows the rank's clear, says so, and its pages are the tree's hits."""
    path, _ = daemon
    pool, offload_pool, launch = host_pool(), host_pool(), secrets.token_hex(8)
    tree = make_backend(path, pool, dflash2_launch=launch)
    offload = make_backend(path, offload_pool, dflash2_launch=launch)
    backends += [tree, offload]
    fill(offload_pool, [1, 2], seed=1)  # KV of the old weights
    assert offload.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert tree.clear() is True
    fill(offload_pool, [1, 2], seed=2)  # KV of the new weights, under the same sglang keys
    new = [page_bytes(offload_pool, p) for p in (1, 2)]
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        assert offload.batch_exists(KEYS[:2]) == 0  # (the old weights' pages are no hits for it)
        assert offload.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert caplog.text.count("its rank cleared through another storage backend") == 1
    assert offload.keys.namespace == tree.keys.namespace and offload.space == tree.space
    assert tree.batch_get_v1(KEYS[:2], indices([9, 10])) == [True, True]
    assert [page_bytes(pool, p) for p in (9, 10)] == new


def test_a_batch_call_during_a_clear_is_not_taken_for_another_backends_clear(daemon, backends, caplog, monkeypatch):
    """clear() recorded the rank's new key space (clears.bump) before it moved to it: a batch call of
    the backend's in between took the clear for another backend's, moved too and said so, falsely (a
    review). The move is made under the backend's lock: one clear, one move, one line."""
    import threading

    from dflash2.client.sglang import clears

    path, _ = daemon
    backend = make_backend(path, host_pool())
    backends.append(backend)
    bump, calls = clears.bump, []

    def bump_then_a_batch_call(space, rank):
        moved = bump(space, rank)
        calls.append(threading.Thread(target=backend.batch_exists, args=(KEYS[:1],)))
        calls[0].start()
        calls[0].join(0.5)  # (it waits for the clear's lock, or, without it, moves at once)
        return moved
    monkeypatch.setattr(clears, "bump", bump_then_a_batch_call)
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        assert backend.clear() is True
        calls[0].join(10)
    assert "clear():" in caplog.text and "its rank cleared through another" not in caplog.text, caplog.text
    assert backend.space == clears.KeySpace(backend.space.launch, 1)


def test_an_mla_writer_and_its_readers_clear_in_step(daemon, backends):
    """sglang clears every rank together: each bumps its own epoch, and an MLA model's readers find
    what its one writer stores after the clear."""
    path, _ = daemon
    pool_w, pool_r, launch = host_pool(), host_pool(), secrets.token_hex(8)  # (one server: one launch, every rank)
    writer = make_backend(path, pool_w, tp_rank=0, tp_size=2, is_mla=True, dflash2_launch=launch)
    reader = make_backend(path, pool_r, tp_rank=1, tp_size=2, is_mla=True, dflash2_launch=launch)
    backends += [writer, reader]
    assert writer.is_writer and not reader.is_writer  # (sglang's: one writer of a replicated shard)
    for b in (writer, reader):
        assert b.clear() is True
    fill(pool_w, [1, 2], seed=6)
    assert writer.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert reader.batch_exists(KEYS[:2]) == 2 and reader.keys.namespace == writer.keys.namespace


def test_two_servers_of_one_identity_that_each_cleared_once_do_not_share(daemon, backends, monkeypatch):
    """Servers A and B of one identity: A cleared after an update to W2, B after its own update to
    W3 (or its PD role switch, which clears too). Each clear counted from 0 in its process, both
    landed on `|clear=1`, and B read A's KV of W2 as its hits (a review). Each launch has its own
    token now. (B runs in a process of its own: this process's backends of the rank follow its clears.)"""
    path, _ = daemon
    pool_a, pool_b = host_pool(), host_pool()
    a = make_backend(path, pool_a)
    with another_process(monkeypatch):
        b = make_backend(path, pool_b)
    backends += [a, b]
    assert a.clear() is True
    fill(pool_a, [1, 2, 3, 4], seed=2)  # KV of W2
    assert a.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    with another_process(monkeypatch):
        assert b.clear() is True
        assert b.keys.namespace != a.keys.namespace
        assert b.batch_exists(KEYS[:4]) == 0


def test_a_backend_made_again_in_a_cleared_server_keeps_its_key_space(daemon, backends):
    """sglang's detach + attach of its storage backend makes a new DFlash2Storage in the same process;
    it started at clear epoch 0 again and read the KV of the weights before the update as hits (a
    review). It continues from the process's clears; a clear of it moves on from there."""
    path, _ = daemon
    pool, launch = host_pool(), secrets.token_hex(8)
    before = make_backend(path, pool, dflash2_launch=launch)
    backends.append(before)
    fill(pool, [1, 2, 3, 4], seed=1)  # KV of the old weights
    assert before.batch_set_v1(KEYS[:4], indices([1, 2, 3, 4])) == [True] * 4
    assert before.clear() is True
    again = make_backend(path, host_pool(), dflash2_launch=launch)
    backends.append(again)
    assert again.keys.namespace == before.keys.namespace and again.batch_exists(KEYS[:4]) == 0
    assert again.clear() is True and again.keys.namespace.endswith(f"|clear={launch}.2")


def test_an_attach_config_without_the_launch_token_keeps_the_cleared_key_space(daemon, backends, caplog):
    """An operator's own attach config has no `dflash2_launch`: the new backend takes this process's
    last key space (it has cleared), and says so."""
    path, _ = daemon
    pool = host_pool()
    before = make_backend(path, pool)
    backends.append(before)
    fill(pool, [1, 2], seed=3)
    assert before.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]
    assert before.clear() is True
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        again = make_backend(path, host_pool(), dflash2_launch=None)
    backends.append(again)
    assert "gives no dflash2_launch" in caplog.text and "keeps the last one" in caplog.text
    assert again.keys.namespace == before.keys.namespace and again.batch_exists(KEYS[:2]) == 0


def test_fallback_when_the_daemon_is_down(config_file, caplog):
    path = config_file()  # no daemon started on its endpoint
    pool = host_pool()
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        backend = make_backend(path, pool)
    assert backend.fallback_reason and "fallback to default" in caplog.text
    assert backend.batch_exists(KEYS) == 0
    assert backend.batch_set_v1(KEYS[:2], indices([1, 2])) == [True, True]  # accepted and dropped
    assert backend.batch_get_v1(KEYS[:2], indices([1, 2])) == [False, False]


def test_fallback_when_disabled(config_file, caplog):
    path = config_file(enable=False)
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        backend = make_backend(path, host_pool())
    assert "fallback to default" in caplog.text and "disabled" in backend.fallback_reason


def test_daemon_gone_mid_run_is_a_miss(daemon, backends):
    path, proc = daemon
    pool = host_pool()
    backend = make_backend(path, pool)
    backends.append(backend)
    fill(pool, [1], seed=5)
    assert backend.batch_set_v1(KEYS[:1], indices([1])) == [True]
    proc.stop()
    assert backend.batch_get_v1(KEYS[:1], indices([2])) == [False]
    assert backend.batch_exists(KEYS[:1]) == 0  # within RETRY_S: no call at all
    assert backend.counters["failed_calls"] == 1


def test_hicache_file_reads_what_it_wrote(tmp_path):
    """The bench's baseline: sglang's own file backend on the same pool (sanity of the harness)."""
    pool = host_pool()
    cfg = storage_config(str(tmp_path / "unused.json"))
    file_backend = HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    fill(pool, [1], seed=6)
    assert file_backend.set("k", pool.get_data_page(PAGE, flat=True))
    assert torch.equal(file_backend.get("k", pool.get_dummy_flat_data_page()), pool.get_data_page(PAGE, flat=True))


# -- the flag, through sglang's real plugin loading ---------------------------------------------------

PLUGIN_SCRIPT = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", "/nonexistent/model", "--dflash2-config", sys.argv[1]])
print("RESULT " + json.dumps([args.enable_hierarchical_cache, args.hicache_storage_backend,
                              args.hicache_storage_backend_extra_config]))
"""


def run_plugin(config_path: str) -> tuple[list, str]:
    env = {**os.environ, "SGLANG_PLUGINS": "dflash2"}
    out = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT, config_path], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out.stdout + out.stderr


def test_flag_turns_on_hicache_with_dflash2(daemon):
    path, _ = daemon
    (enabled, backend, extra), _ = run_plugin(path)
    assert enabled is True and backend == "dynamic"
    extra = json.loads(extra)
    assert extra["module_path"] == "dflash2.client.sglang.backend" and extra["class_name"] == "DFlash2Storage"
    assert extra["interface_v1"] == 1 and extra["dflash2_config"] == os.path.abspath(path)


def test_flag_falls_back_when_the_daemon_is_down(config_file):
    (enabled, backend, extra), output = run_plugin(config_file())
    assert (enabled, backend, extra) == (False, None, None)
    assert output.count("fallback to default") == 1 and "cannot be reached" in output


def test_help_shows_the_flag():
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "SGLANG_PLUGINS": "dflash2"})
    assert "--dflash2-config" in out.stdout
