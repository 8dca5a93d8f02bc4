"""Shared fixtures: a fake clock, small metadata-only managers, and small real (host) managers."""

from __future__ import annotations

import functools

import json
import shutil
import uuid
from pathlib import Path

import pytest

from dflash2.layout import Layout
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier

KIB = 1 << 10
MIB = 1 << 20


def _installed(binary: str) -> str:
    """The binary's path; the test is skipped when it is not installed (.ci/run installs Debian's
    `prometheus`, which brings both the server and promtool)."""
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (.ci/run installs Debian's `prometheus`)")
    return path


@pytest.fixture
def promtool() -> str:
    return _installed("promtool")


@pytest.fixture
def prometheus_binary() -> str:
    return _installed("prometheus")


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# 2 layers x 2 (K,V) x 16 tokens x 2 heads x 64 dims x 2 bytes = 16 KiB
SMALL = Layout("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
# the same geometry in fp8: 8 KiB; and an MLA layout of 2 x 16 x (64 + 16) x 2 = 5 KiB
SMALL_FP8 = Layout("small-fp8", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp8_e4m3", tokens_per_block=16)
MLA = Layout("mla", num_layers=2, num_kv_heads=0, head_dim=0, dtype="bf16", tokens_per_block=16,
             mla_latent_dim=64, mla_rope_dim=16)


def specs(hbm_blocks: int, dram_blocks: int = 0, nvme_blocks: int = 0, block: int = 16 * KIB) -> list[TierSpec]:
    """Tier specs sized in 16 KiB blocks, one block per page (no page tails)."""
    out = [TierSpec(Tier.HBM, hbm_blocks * block, block, 256)]
    if dram_blocks:
        out.append(TierSpec(Tier.DRAM, dram_blocks * block, block, 4096))
    if nvme_blocks:
        out.append(TierSpec(Tier.NVME, nvme_blocks * block, block, 4096))
    return out


@pytest.fixture
def make_manager(clock):
    """Metadata-only manager factory."""
    made = []

    def make(hbm_blocks=16, dram_blocks=0, nvme_blocks=0, **kw):
        kw.setdefault("clock", clock)
        mgr = BlockManager(specs(hbm_blocks, dram_blocks, nvme_blocks), **kw)
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.close()


def write_config(tmp_path: Path, **sections) -> str:
    """A small host-only config written into tmp_path; kwargs override sections (a dict updates
    that section, anything else replaces it). Returns its path."""
    cfg = {
        "enable": True,
        "device": {"kind": "host"},
        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 8, "dram_capacity_mb": 16,
                   "nvme_capacity_mb": 32, "nvme_path": "nvme.cache", "staging_buffer_size_mb": 4,
                   "page_kb": 64},
        "kv_block": {"block_size": 16, "prefetch_window": 2},
        "policy": {"name": "lru", "cold_threshold": 0.5, "swap_batch_size": 64},
        # The state folder in the test's tmp_path: the default, ~/.local/state/dflash2, is the user's
        # own (a test daemon with history on left its samples there, read back by the user's daemon).
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "state_dir": str(tmp_path / "state")},
        "logging": {"format": "text", "level": "info"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    path = tmp_path / "dflash2_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def config_file(tmp_path):
    """write_config into this test's tmp_path."""
    return functools.partial(write_config, tmp_path)


@pytest.fixture
def instance_name() -> str:
    return f"dflash2-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def connect(daemon):
    """Clients of the test module's `daemon` fixture (a DaemonProcess), closed at the end."""
    from dflash2.client import Client

    made = []

    def make(name="test", layouts=(SMALL,), **kw):
        c = Client.connect(daemon.endpoint, name=name, layouts=list(layouts), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# The GPU tests' daemon config (tests/test_gpu*.py): small tiers on GPU 0; keyword args override `memory`.
@pytest.fixture
def cuda_config(tmp_path):
    def write(**memory) -> str:
        mem = {"hbm_reserve_mb": 0, "hbm_capacity_mb": 64, "dram_capacity_mb": 64, "nvme_capacity_mb": 128,
               "nvme_path": "nvme.cache", "staging_buffer_size_mb": 8, "page_kb": 256}
        mem.update(memory)
        cfg = {"enable": True, "device": {"kind": "cuda", "gpu_ids": [0]}, "memory": mem,
               "kv_block": {"block_size": 16, "prefetch_window": 2},
               "policy": {"name": "lru", "swap_batch_size": 64},
               "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 2.0,
                          "heartbeat_interval_s": 0.5},
               "logging": {"format": "text"}}
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps(cfg))
        return str(path)
    return write


@pytest.fixture
def small_nvme_manager(config_file, instance_name):
    """A real host manager with every tier small: HBM and DRAM of 1 MiB (64 blocks of 16 KiB), NVMe a
    2 MiB file in tmp_path, a 1 MiB staging buffer, a prefetch window of 2. Closed after the test."""
    from dflash2.assemble import build_manager
    from dflash2.config import load_config

    cfg = load_config(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                          "staging_buffer_size_mb": 1},
                                  kv_block={"block_size": 16, "prefetch_window": 2}))
    m = build_manager(cfg, instance=instance_name)
    yield m
    m.close()


def gpu_node(tmp_path, monkeypatch, n: int, **memory) -> dict:
    """A raw config of a node of `n` GPUs (probe_gpus stood in for: 8 GiB each), NVMe file in tmp_path."""
    from dflash2 import plan as plan_module
    from dflash2.plan import Gpu

    monkeypatch.setattr(plan_module, "probe_gpus", lambda: [Gpu(i, "fake", 8 << 30) for i in range(n)])
    return {"enable": True, "device": {"kind": "cuda"},
            "memory": {"hbm_reserve_mb": 1024, "dram_capacity_mb": 64, "nvme_capacity_mb": 64,
                       "nvme_path": str(tmp_path / "nvme.cache"), "staging_buffer_size_mb": 16, **memory},
            "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "state_dir": str(tmp_path / "state")}}

