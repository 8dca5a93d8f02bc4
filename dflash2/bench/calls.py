"""`dflash2 bench calls`: what a serving engine waits for per call when its calls name many blocks.

Starts `dflash2d` on a temporary config (the GPU's HBM with `--device cuda`, or `auto` where one is
visible; else the host stand-ins) whose HBM holds `--hbm-chains` prefix chains of `--blocks` blocks
of `--block-kib` and whose DRAM holds every chain the run writes (no NVMe). It writes HBM's chains
and `--dram-chains` more (HBM full, the older chains demoted to DRAM), then per round, as an engine
serving a request whose long prefix lies in DRAM:

- `lookup` the oldest chain not read yet, `acquire` it (every block comes up into a full HBM, as many
  bytes going down to DRAM), `release` it;
- `allocate` as many new blocks (room made in HBM), `commit` them under content keys, `free` them
  (published, they stay cached).

One line: per call, `p50_ms` and `p90_ms` of the client's round trips, and `daemon_ms`, the
daemon's own time a call over the timed rounds (its stats); `promoted_per_acquire`, the median
blocks that came up per acquire (every block: `--blocks`); `device`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash2.argtypes import block_kib
from dflash2.bench import OptionError, daemon_policy, non_negative_int, positive_int, visible_gpu
from dflash2.bench.control import _start, _stop
from dflash2.layout import Layout

OPS = ("lookup", "acquire", "release", "allocate", "commit", "free")
WARMUP_ROUNDS = 3  # rounds before the timed ones (first copies, first batches of each size)
MIB = 1 << 20


def layout(block_kib: int) -> Layout:
    """The bench's blocks: 1 KiB a token (2 layers, 2 KV heads of 64 bf16), `block_kib` tokens."""
    return Layout("bench-calls", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=block_kib)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=positive_int, default=1024,
                        help="blocks a call names, at most 65536 (default %(default)s)")
    parser.add_argument("--block-kib", type=block_kib, default=64,
                        help="block size in KiB, a power of two from 16 to 4096 (default %(default)s)")
    parser.add_argument("--rounds", type=positive_int, default=30, help="timed rounds (default %(default)s)")
    parser.add_argument("--hbm-chains", type=positive_int, default=4,
                        help="chains of --blocks that HBM holds (default %(default)s)")
    parser.add_argument("--dram-chains", type=positive_int, default=8,
                        help="chains written beyond HBM's before the rounds, demoted to DRAM (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cuda", "host"), default="auto",
                        help="auto: the GPU where one is visible, else the host stand-ins")
    parser.add_argument("--gpu", type=non_negative_int, default=0, help="which GPU (default 0)")
    parser.add_argument("--policy", default="heat", help="policy.name of the daemon (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    from dflash2.client import Client
    from dflash2.cuda import cuda_available
    from dflash2.protocol import MAX_BATCH

    if args.blocks > MAX_BATCH:
        raise OptionError(f"--blocks: {args.blocks} is more than a call may name ({MAX_BATCH})")
    daemon_policy(args.policy)
    kind = args.device if args.device != "auto" else ("cuda" if cuda_available() else "host")
    if kind == "cuda":
        visible_gpu(args.gpu, "bench calls --device cuda")
    blocks = layout(args.block_kib)
    held = _hbm_mb(args, blocks)[0] * MIB // blocks.block_bytes
    if held >= (args.hbm_chains + args.dram_chains) * args.blocks:
        # (HBM, in whole MB with a page of slack, held every chain written before the rounds: each
        # acquire found its chain there and promoted nothing)
        raise OptionError(f"--blocks {args.blocks} of {args.block_kib} KiB: HBM, sized in whole MB with a page of "
                          f"slack, holds {held} blocks, all the chains written before the rounds (--hbm-chains + "
                          "--dram-chains), so no chain would come up from DRAM; give longer chains, larger blocks "
                          "or more --dram-chains")
    with tempfile.TemporaryDirectory(prefix="dflash2-bench-") as tmp:
        folder = Path(tmp)
        endpoint = f"ipc://{folder}/d.sock"
        daemon = _start_daemon(folder, endpoint, kind, args, blocks)
        try:
            with Client.connect(endpoint, name="bench-calls", layouts=[blocks], timeout_s=60.0,
                                device=args.gpu if kind == "cuda" else None) as client:
                return {"bench": "calls", "device": kind, "blocks": args.blocks, "block_kib": args.block_kib,
                        "rounds": args.rounds, "policy": args.policy, **_rounds(client, args)}
        finally:
            _stop(daemon)


def _hbm_mb(args, blocks: Layout) -> tuple[int, int]:
    """(HBM's MB, its page's KiB): --hbm-chains chains and a partly cut page of each size."""
    page_kb = max(2048, args.block_kib)
    return -(-args.hbm_chains * args.blocks * blocks.block_bytes // MIB) + 2 * page_kb // 1024, page_kb


def _dram_mb(held_bytes: int) -> int:
    """DRAM's MB for `held_bytes` of chains, below the tier's high watermark: above it the background
    step drops DRAM's coldest blocks (no NVMe below), the oldest chains, the very ones the rounds read
    next (a review: `--rounds 400` ended in "chain 365 was looked up with 60 of its 256 blocks cached")."""
    from dflash2.config import Watermarks

    high = Watermarks().dram.high
    return -(-held_bytes * 100 // (MIB * int(high * 100 - 1)))  # (a percent under it)


def _start_daemon(folder: Path, endpoint: str, kind: str, args, blocks: Layout):
    chain_bytes = args.blocks * blocks.block_bytes
    hbm_mb, page_kb = _hbm_mb(args, blocks)
    slack_mb = 2 * page_kb // 1024  # a partly cut page of each size
    chains_written = args.hbm_chains + args.dram_chains + WARMUP_ROUNDS + args.rounds
    device = {"kind": kind} if kind == "host" else {"kind": kind, "gpu_ids": [args.gpu]}
    cfg = {"enable": True, "device": device,
           "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": hbm_mb,
                      "dram_capacity_mb": _dram_mb(chains_written * chain_bytes) + slack_mb,
                      "nvme_capacity_mb": 0, "staging_buffer_size_mb": 16, "page_kb": page_kb},
           # No prefetch: each acquire's promotion is its own, not begun by the lookup before it.
           "kv_block": {"block_size": blocks.tokens_per_block, "prefetch_window": 0},
           "policy": {"name": args.policy, "swap_batch_size": min(args.blocks, 4096)},
           "daemon": {"endpoint": endpoint, "state_dir": str(folder / "state"), "request_timeout_s": 60.0},
           "logging": {"format": "text", "level": "warning"}}
    path = folder / "dflash2_config.json"
    path.write_text(json.dumps(cfg))
    return _start(["-m", "dflash2.daemon.main", "--config", str(path)], "DFlash2: enabled", folder / "daemon.log",
                  tiers_mb=hbm_mb + cfg["memory"]["dram_capacity_mb"])


def _rounds(client, args) -> dict:
    lid = client.layouts[0]
    n = args.blocks
    written: list[list[int]] = []

    def write() -> dict[str, float]:
        keys = list(range(1 + n * len(written), 1 + n * (len(written) + 1)))  # distinct from every chain's
        t0 = time.perf_counter()
        placed = client.allocate(lid, n)
        t1 = time.perf_counter()
        if placed is None:
            raise RuntimeError(f"allocate of {n} blocks found no room: {client.stats()['tiers']}")
        vids = client.commit(placed["vid"], keys=keys)
        t2 = time.perf_counter()
        client.free(vids)
        t3 = time.perf_counter()
        written.append(keys)
        return {"allocate": t1 - t0, "commit": t2 - t1, "free": t3 - t2}

    for _ in range(args.hbm_chains + args.dram_chains):
        write()
    seconds: dict[str, list[float]] = {op: [] for op in OPS}
    promoted = []
    before = None
    for r in range(WARMUP_ROUNDS + args.rounds):
        if r == WARMUP_ROUNDS:
            before = client.stats()["daemon"]["latency"]
        keys = written[r]  # the oldest chain not read yet: in DRAM, every later chain written after it
        t0 = time.perf_counter()
        found = client.lookup(keys)
        t1 = time.perf_counter()
        if len(found) != n:
            raise RuntimeError(f"chain {r} was looked up with {len(found)} of its {n} blocks cached")
        below = int(np.count_nonzero(found["tier"] != 0))
        held = client.acquire(found["vid"])
        t2 = time.perf_counter()
        if held is None:
            raise RuntimeError(f"acquire of chain {r} found no room in HBM")
        client.release(found["vid"])
        t3 = time.perf_counter()
        wrote = write()
        if r >= WARMUP_ROUNDS:
            promoted.append(below)
            for op, s in (("lookup", t1 - t0), ("acquire", t2 - t1), ("release", t3 - t2), *wrote.items()):
                seconds[op].append(s)
    after = client.stats()["daemon"]["latency"]
    return {"p50_ms": {op: _ms(np.percentile(v, 50)) for op, v in seconds.items()},
            "p90_ms": {op: _ms(np.percentile(v, 90)) for op, v in seconds.items()},
            "daemon_ms": {op: _daemon_ms(before, after, op) for op in OPS},
            "promoted_per_acquire": int(np.median(promoted))}


def _daemon_ms(before: dict, after: dict, op: str) -> float | None:
    """The daemon's own time per call of `op` between two stats replies (count and mean each)."""
    a, b = after.get(op), before.get(op, {"count": 0, "mean_us": 0.0})
    if a is None or a["count"] == b["count"]:
        return None
    total_us = a["count"] * a["mean_us"] - b["count"] * b["mean_us"]
    return round(total_us / (a["count"] - b["count"]) / 1000, 3)


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1000, 3)
