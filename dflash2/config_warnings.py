"""Warnings of a config that is legal but probably wrong (`config_warnings`), and of environment
variables that have no effect (`check_environment`): said by `dflash2d --check` and at start-up."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

from dflash2.config import MB, Config
from dflash2.endpoints import _bare_host, _every_address, numeric_address, xdg_dir

# Above this share of the machine's memory, a DRAM tier starves the serving processes themselves.
DRAM_WARN_FRACTION = 0.8
# Above this, nearly every block is "cold" and the daemon demotes constantly.
COLD_THRESHOLD_WARN = 0.95


def config_warnings(cfg: Config, mem_total_bytes: Optional[int] = None, device_kind: Optional[str] = None) -> list[str]:
    """One line per legal-but-suspect value; `mem_total_bytes` defaults to /proc/meminfo's MemTotal,
    `device_kind` (cuda or host: `auto` resolved, as the plan does) to the configured kind."""
    kind = device_kind or cfg.device.kind
    warnings = []
    if cfg.policy.cold_threshold > COLD_THRESHOLD_WARN:
        warnings.append(
            f"policy.cold_threshold is {cfg.policy.cold_threshold}: above {COLD_THRESHOLD_WARN} nearly every "
            "block counts as cold and the daemon will churn, demoting blocks that are about to be read")
    if cfg.policy.cold_threshold == 0:
        warnings.append("policy.cold_threshold is 0: no block counts as cold, so no tier drains in the background "
                        "and every allocation into a full tier makes its room on the request path")
    for tier in ("hbm", "dram", "nvme"):
        if getattr(cfg.policy.watermarks, tier).high >= 1.0:
            warnings.append(f"policy.watermarks.{tier}.high is 1.0: a tier is never more than full, so the {tier} "
                            "tier never drains in the background and every allocation into it, once full, makes "
                            "its room on the request path")
    if cfg.policy.rescore_interval_ms / 1000 > cfg.daemon.lease_timeout_s:
        warnings.append(f"policy.rescore_interval_ms ({cfg.policy.rescore_interval_ms} ms) is longer than "
                        f"daemon.lease_timeout_s ({cfg.daemon.lease_timeout_s} s): the background step (rescoring, "
                        "drains, reservations that expire) runs that seldom; leases are still judged every "
                        "daemon.heartbeat_interval_s")
    endpoint = cfg.daemon.endpoint or ""
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rpartition(":")[0]
        # (as the resolver reads it: `tcp://0:PORT` is every IPv4 address too, and went unsaid)
        everyone = _bare_host(host) in ("*", "0.0.0.0", "::") or _every_address(numeric_address(host) or "")
        if everyone:
            warnings.append(f"daemon.endpoint is {endpoint}: every address of this node (the monitoring port too), "
                            "so every host that reaches it can try to connect; only a client that holds the "
                            "endpoint's key file (daemon.tcp_key_file) can attach")
    elif cfg.daemon.tcp_key_file is not None:
        warnings.append("daemon.tcp_key_file is ignored: the endpoint is an ipc socket (its mode guards it)")
    if cfg.memory.nvme_path is not None and not cfg.memory.nvme_capacity_mb:
        # (the reverse, a capacity without a path, is an error: MemoryConfig)
        warnings.append(f"memory.nvme_path ({cfg.memory.nvme_path}) is ignored: memory.nvme_capacity_mb is 0 (its "
                        "default), so there is no NVMe tier; set memory.nvme_capacity_mb to use the file")
    if kind == "host" and cfg.device.gpu_ids is not None:  # (`auto` with no GPU too: --check said nothing, a review)
        why = "device.kind is host" if cfg.device.kind == "host" else f"device.kind {cfg.device.kind} found no GPU"
        warnings.append(f"device.gpu_ids is ignored: {why} (the device tier is in host memory)")
    # (duel_sample too, unless 0, off: it was said only in the log, once per GPU, never by --check, a review)
    heat_only = sorted(({"weights", "decay_half_life_s"} | ({"duel_sample"} if cfg.policy.duel_sample else set()))
                       & cfg.policy.model_fields_set)
    if heat_only and cfg.policy.name != "heat":
        warnings.append(f"{' and '.join(f'policy.{k}' for k in heat_only)} {'is' if len(heat_only) == 1 else 'are'} "
                        f"ignored: only the heat policy uses {'it' if len(heat_only) == 1 else 'them'}, and "
                        f"policy.name is {cfg.policy.name!r}")
    if mem_total_bytes is None:
        mem_total_bytes = machine_memory_bytes()
    dram_mb = cfg.memory.dram_capacity_mb
    # On a host device (configured, or `auto` without a GPU) the HBM stand-in is host memory too.
    stand_in_mb = (cfg.memory.hbm_capacity_mb or 0) if kind == "host" else 0
    host_mb = dram_mb + stand_in_mb
    if mem_total_bytes and host_mb * MB > DRAM_WARN_FRACTION * mem_total_bytes:
        what = (f"memory.dram_capacity_mb is {dram_mb} MB" if not stand_in_mb else
                f"memory.dram_capacity_mb ({dram_mb} MB) and the host stand-in for HBM (memory.hbm_capacity_mb, "
                f"{stand_in_mb} MB) come to {host_mb} MB")
        warnings.append(
            f"{what}, more than {DRAM_WARN_FRACTION:.0%} of this machine's {mem_total_bytes // MB} MB of memory; "
            "the serving processes and the OS need the rest")
    return warnings


def machine_memory_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """MemTotal in bytes, or None where /proc/meminfo is not available."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# First-generation environment variables and the config key that replaced each.
LEGACY_ENV = {
    "DFLASH_OFFLOAD_ENABLE": "enable",
    "DFLASH_DRAM_LIMIT": "memory.dram_capacity_mb",
    "DFLASH_HBM_RESERVE": "memory.hbm_reserve_mb",
    "DFLASH_NVME_PATH": "memory.nvme_path",
    "DFLASH_NVME_LIMIT": "memory.nvme_capacity_mb",
    "DFLASH_BLOCK_SIZE": "kv_block.block_size",
    "DFLASH_SWAP_BATCH": "policy.swap_batch_size",
}


def check_environment(environ: Mapping[str, str] = os.environ) -> list[str]:
    """One warning per first-generation `DFLASH_*` variable that is set (they have no effect), and one
    per relative XDG folder variable (ignored: xdg_dir)."""
    warnings = [f"environment variable {name} is relative ({environ[name]!r}): ignored, as the XDG base "
                f"directory spec says; the default folder stands in for it"
                for name in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME") if environ.get(name) and not xdg_dir(environ, name)]
    for name in sorted(environ):
        if not name.startswith("DFLASH_"):
            continue
        key = LEGACY_ENV.get(name)
        if key:
            warnings.append(f"environment variable {name} is ignored; set `{key}` in the config file instead")
        else:
            warnings.append(f"environment variable {name} has no effect; dflash2 is configured only by its "
                            "config file (dflash2d --config FILE)")
    return warnings
