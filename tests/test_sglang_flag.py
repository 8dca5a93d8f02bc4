"""`--dflash2-config` through sglang's real plugin loading and argument parsing (sglang 0.5.23, a
subprocess each): a flag that names no file, arguments sglang does not allow beside the hierarchical
cache the flag turns on, the extra config it passes (prefix keys, the model's identity). Skipped where
sglang is not importable (test_sglang.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import config_file  # noqa: F401  (fixture)
from test_sglang import backends, daemon  # noqa: F401  (fixtures; skips this module without sglang)

SCRIPT = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(sys.argv[1:])
print("RESULT hicache=%s backend=%s" % (args.enable_hierarchical_cache, args.hicache_storage_backend))
"""


def parse(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, "--model-path", "/nonexistent/model", *argv],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "SGLANG_PLUGINS": "dflash2"})


def test_a_flag_that_names_no_file_falls_back_with_the_line():
    """(`--dflash2-config "$UNSET"`: sglang ran on its own cache and no line said so.)"""
    out = parse("--dflash2-config", "")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT hicache=False backend=None" in out.stdout
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "dflash2:" in ln]
    assert len(lines) == 1 and "fallback to default" in lines[0] and "names no file" in lines[0]


@pytest.mark.parametrize("flag", ["--disable-radix-cache", "--enable-kv-cache-sharding"])
def test_a_flag_sglang_forbids_beside_hicache_is_refused_naming_both(daemon, flag):
    """(sglang refused to start naming --enable-hierarchical-cache or --hicache-storage-backend.)"""
    path, _ = daemon
    out = parse("--dflash2-config", path, flag)
    assert out.returncode != 0 and "RESULT" not in out.stdout
    assert "ValueError: --dflash2-config keeps sglang's KV cache in dflash2" in out.stderr
    assert f"which sglang does not allow with {flag}" in out.stderr


def test_sglang_reads_the_flags_extra_config_as_asking_for_prefix_keys(tmp_path):
    """sglang's cache reads `hicache_storage_pass_prefix_keys` out of the extra config (popped: the
    backend never sees it) and only then passes each backup batch the keys of the pages before it
    (cache_controller `_page_backup`), which the backend links the batch under (`_prefix_parent`)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from dflash2.client.sglang.plugin import backend_extra_config

    extra, *_, pass_prefix_keys = HybridCacheController.parse_storage_backend_extra_config(
        backend_extra_config(str(tmp_path / "c.json"), None))
    assert pass_prefix_keys is True and "hicache_storage_pass_prefix_keys" not in extra
    assert extra["class_name"] == "DFlash2Storage"


IDENTITY_SCRIPT = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
for argv in json.loads(sys.argv[1]):
    args = prepare_server_args(argv)
    print("RESULT " + json.dumps([args.served_model_name or args.model_path, args.hicache_storage_backend_extra_config]))
"""


def test_servers_of_one_served_name_with_other_weights_share_no_pages(daemon, tmp_path, backends):
    """One checkpoint with and without --quantization fp8, and a new checkpoint under the old served
    name: each read the bf16 server's pages as hits (its KV, computed by other weights)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from test_sglang import fill, host_pool, indices, page_bytes, storage_config

    path, _ = daemon
    old, new = tmp_path / "llama3-8b", tmp_path / "llama3-8b-ft-v2"
    for folder in (old, new):
        folder.mkdir()
        (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        (folder / "model.safetensors").write_bytes(folder.name.encode())
    flag = ["--dflash2-config", path]
    runs = {"bf16": ["--model-path", str(old), *flag],
            "fp8-weights": ["--model-path", str(old), "--quantization", "fp8", *flag],
            "v2-same-name": ["--model-path", str(new), "--served-model-name", str(old), *flag],
            "bf16-again": ["--model-path", str(old), *flag]}
    out = subprocess.run([sys.executable, "-c", IDENTITY_SCRIPT, json.dumps(list(runs.values()))], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "SGLANG_PLUGINS": "dflash2"})
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = [json.loads(ln[len("RESULT "):]) for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    made = {}
    for name, (served, extra) in zip(runs, parsed):
        config = storage_config(path)
        config.model_name = served  # what sglang passes the backend: the served name
        config.extra_config = {**json.loads(extra), "dflash2_timeout_s": 1.0}
        pool = host_pool()
        made[name] = (StorageBackendFactory.create_backend("dynamic", config, pool), pool)
        made[name][0].register_mem_pool_host(pool)
        backends.append(made[name][0])
    first, pool = made["bf16"]
    fill(pool, [1], seed=1)
    assert first.batch_set_v1(["page-0"], indices([1])) == [True]
    for name in ("fp8-weights", "v2-same-name"):
        b, _ = made[name]
        assert b.keys.namespace != first.keys.namespace and b.batch_get_v1(["page-0"], indices([2])) == [False], name
    again, again_pool = made["bf16-again"]  # the same model, another server: shares them
    assert again.batch_get_v1(["page-0"], indices([2])) == [True] and page_bytes(again_pool, 2) == page_bytes(pool, 1)


def test_sglangs_cache_controller_still_refuses_a_dynamic_backend_with_decode_context_parallelism(monkeypatch):
    """Why the flag refuses `--dcp-size` above 1 (plugin.conflicting_flag): sglang 0.5.23 attaches
    HiCache storage with DCP only from its file and Mooncake backends, and every scheduler of an MLA
    server started with the flag failed (a review). Should sglang lift that, this fails: lift the
    refusal then."""
    import types

    import sglang.srt.managers.cache_controller as cc

    monkeypatch.setattr(cc, "get_parallel", lambda: types.SimpleNamespace(attn_dcp_size=2, attn_dcp_rank=0))
    controller = types.SimpleNamespace(enable_storage=False, host_memory_mode="layer_first")
    with pytest.raises(NotImplementedError, match="requires file or Mooncake storage"):
        cc.HiCacheController.attach_storage_backend(controller, "dynamic")
