"""`--dflash2-config` through sglang's real plugin loading and argument parsing (sglang 0.5.23, a
subprocess each): a flag that names no file, and arguments sglang does not allow beside the
hierarchical cache the flag turns on. Skipped where sglang is not importable (test_sglang.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import config_file  # noqa: F401  (fixture)
from test_sglang import daemon  # noqa: F401  (fixture; skips this module without sglang)

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
