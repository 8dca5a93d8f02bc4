"""`dflash2 bench drain`: lookups while a tier drains, the latency a serving engine sees then.

Starts `dflash2d` on a temporary host-only config (DRAM of `--dram-mb`, NVMe of `--nvme-mb`, twice
DRAM by default, in the temporary folder, blocks of `--block-kib`, 64 KiB by default, DRAM's
watermarks 0.9 / 0.5), and for each phase fills DRAM to 0.97 with idle cached blocks and times a
one-key lookup until the drain has brought DRAM down to its low watermark (or `--seconds` passed):

- `back_to_back`: each lookup sent when the last was answered;
- `random_times`: lookups due at Poisson times `--gap-ms` apart on average, each timed from when it
  was due (a late one makes the next late, as an engine's requests would be);
- `allocate_back_to_back`: instead of a lookup, a one-block allocation in HBM (freed at once), each
  sent when the last was answered: a call that may move blocks, which waits for a drain piece's
  copies in flight (a lookup does not).

One line per phase: `n`, `p50_ms`, `p90_ms`, `p99_ms`, `max_ms`, `mean_ms`, `drain_s` (until DRAM
was at 0.51 or less, looked at every 20 ms, between calls and while the next is not yet due, or the
phase's time was up: `drained` says which; no call due after that is counted) and
`dram_end`; and from the
daemon's stats over the phase, `moved_mb` and `batches` (DRAM to NVMe) and `step_late_max_ms` (the
latest its background step ran after it was due, over its last steps).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash2.argtypes import block_kib
from dflash2.bench import OptionError, positive_float, positive_int
from dflash2.bench.control import _start, _stop
from dflash2.layout import Layout
from dflash2.tiers import fill

HIGH = 0.9  # DRAM's high watermark
FILL = 0.97  # DRAM filled to this fraction of idle cached blocks (over its high watermark) ...
DRAINED = 0.51  # ... and drained once at this (its low watermark, 0.5, and a block's rounding)
# How often DRAM's fill is looked at (a stats call, about 0.6 ms on the 2-core VM): `drain_s` is
# known to within it. Every 200 calls, as before, a phase could not end before 200 calls: at a 10 ms
# gap a drain of 0.2 s read 2.1 s, and nine in ten of its samples came after the drain had ended.
CHECK_EVERY_S = 0.02
PHASES = ("back_to_back", "random_times", "allocate_back_to_back")


def layout(block_kib: int) -> Layout:
    """The bench's blocks: 1 KiB a token (2 layers, 2 KV heads of 64 fp16), `block_kib` tokens."""
    return Layout("bench-drain", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=block_kib)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dram-mb", type=positive_int, default=1024, help="DRAM tier in MB (default %(default)s)")
    parser.add_argument("--nvme-mb", type=positive_int, default=None,
                        help="NVMe tier in MB, a file in a temporary folder (default: twice --dram-mb)")
    parser.add_argument("--block-kib", type=block_kib, default=64,
                        help="block size in KiB, a power of two from 16 to 4096 (default %(default)s): a large "
                        "tier of large blocks has few blocks to choose from, a drain piece's fixed cost")
    parser.add_argument("--gap-ms", type=positive_float, default=1.0,
                        help="mean gap between lookups at random times, in ms (default %(default)s)")
    parser.add_argument("--seconds", type=positive_float, default=30.0,
                        help="most seconds a phase lasts if its drain does not end first (default %(default)s)")


def run(args: argparse.Namespace) -> list[dict]:
    from dflash2.client import Client

    block_kib = args.block_kib
    nvme_mb = 2 * args.dram_mb if args.nvme_mb is None else args.nvme_mb
    blocks = layout(block_kib)
    if int(args.dram_mb * FILL * 2**20) // blocks.block_bytes * blocks.block_bytes <= HIGH * args.dram_mb * 2**20:
        # (4 MB of 4 MiB blocks: a fill of 3 blocks, never over the watermark: no drain began, and
        # an empty phase raised an IndexError)
        raise OptionError(f"--dram-mb {args.dram_mb} holds too few blocks of {block_kib} KiB to fill it past "
                          f"its high watermark ({HIGH}) in whole blocks: give it more DRAM or smaller blocks")
    with tempfile.TemporaryDirectory(prefix="dflash2-bench-") as tmp:
        folder = Path(tmp)
        endpoint = f"ipc://{folder}/d.sock"
        daemon = _start_daemon(folder, endpoint, args.dram_mb, nvme_mb, blocks)
        try:
            with Client.connect(endpoint, name="bench-writer", layouts=[blocks]) as writer:
                probe = _probe(writer, blocks)
                rows = []
                for phase in PHASES:
                    _fill(writer, args.dram_mb, blocks)
                    with Client.connect(endpoint, name="bench-looker", layouts=[blocks]) as looker:
                        rows.append({"phase": phase, "dram_mb": args.dram_mb, "nvme_mb": nvme_mb,
                                     "block_kib": block_kib, **_lookups(looker, probe, phase, args)})
                    _wait_drained(writer, args.seconds)
                return rows
        finally:
            _stop(daemon)


def _start_daemon(folder: Path, endpoint: str, dram_mb: int, nvme_mb: int, blocks: Layout):
    block_mb = blocks.block_bytes >> 20
    cfg = {"enable": True, "device": {"kind": "host"},
           "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": max(32, 32 * block_mb), "dram_capacity_mb": dram_mb,
                      "nvme_capacity_mb": nvme_mb, "nvme_path": str(folder / "nvme.cache"),
                      "staging_buffer_size_mb": max(8, 8 * block_mb), "page_kb": max(256, blocks.block_bytes >> 10)},
           "kv_block": {"block_size": blocks.tokens_per_block, "prefetch_window": 4},
           "policy": {"name": "heat", "watermarks": {"dram": {"high": HIGH, "low": 0.5}}},
           "daemon": {"endpoint": endpoint, "state_dir": str(folder / "state")},
           "logging": {"format": "text", "level": "warning"}}
    path = folder / "dflash2_config.json"
    path.write_text(json.dumps(cfg))
    # Its wait for the ready line grows with the tiers the daemon takes as it starts, as calls' does
    # (a review: --dram-mb 14336 took more than the 30 s it was given on the 2-core VM, 20 s at 8192).
    return _start(["-m", "dflash2.daemon.main", "--config", str(path)], "DFlash2: enabled", folder / "daemon.log",
                  tiers_mb=cfg["memory"]["hbm_capacity_mb"] + dram_mb)


def _dram_used(client) -> float:
    return fill(client.stats()["tiers"]["dram"])  # (as the watermarks weigh it)


def _probe(writer, blocks: Layout) -> list[int]:
    """One cached block in HBM: the key every lookup asks for."""
    from dflash2.client import chain_keys

    keys = chain_keys(np.arange(blocks.tokens_per_block) + 99, blocks.tokens_per_block, "bench-drain-probe")
    placed = writer.allocate(writer.layouts[0], 1)
    writer.view_bytes(placed[0])[:] = 1
    writer.free(writer.commit(placed["vid"], keys=keys))
    return keys


def _fill(writer, dram_mb: int, blocks: Layout) -> None:
    """DRAM up to FILL with idle cached blocks (their bytes are not written: the drain copies what is there)."""
    from dflash2.client import chain_keys

    lid = writer.layouts[0]
    # In bytes, rounded once: whole MB of the fill fell under the high watermark for a tier of 8-10
    # MB (7 of 8 MB is 0.875), and no drain began.
    want = int(dram_mb * FILL * 2**20) // blocks.block_bytes - int(_dram_used(writer) * dram_mb * 2**20) // blocks.block_bytes
    keys = chain_keys(np.arange(blocks.tokens_per_block * max(want, 0)) + time.monotonic_ns(),
                      blocks.tokens_per_block, "bench-drain-fill")
    for start in range(0, max(want, 0), 8192):
        n = min(8192, want - start)
        placed = writer.allocate(lid, n, tier="dram")
        if placed is None or len(placed) != n:
            raise RuntimeError(f"bench drain: DRAM took {0 if placed is None else len(placed)} of {n} blocks")
        writer.free(writer.commit(placed["vid"], keys=keys[start:start + n]))


def _moved(client) -> tuple[int, int]:
    """(bytes, batches) the daemon has moved from DRAM to NVMe."""
    st = client.stats()["moves"].get("dram->nvme", {})
    return st.get("bytes", 0), st.get("batches", 0)


def _lookups(client, keys: list[int], phase: str, args) -> dict:
    """The phase's calls, timed, until DRAM is drained or the phase's time is up (module doc)."""
    rng = np.random.default_rng(1)
    random_times = phase == "random_times"
    waits, used = [], _dram_used(client)
    moved, batches = _moved(client)
    started = due = time.perf_counter()
    check = started + CHECK_EVERY_S
    while time.perf_counter() - started < args.seconds and used > DRAINED:
        if random_times:
            due += rng.exponential(args.gap_ms / 1000)
            # Until the lookup is due, DRAM's fill is looked at every CHECK_EVERY_S as between calls:
            # slept through whole, a gap of seconds made `drain_s` the first lookup's due time (3.22 s
            # for a drain of 0.2 s at --gap-ms 3000), not the drain's length.
            used, check = _wait_until(client, min(due, started + args.seconds), used, check)
            if used <= DRAINED or due - started >= args.seconds:
                break  # drained while it waited (that lookup is not counted), or it falls past the phase
        sent = due if random_times else time.perf_counter()
        if phase == "allocate_back_to_back":
            placed = client.allocate(client.layouts[0], 1)
            waits.append(time.perf_counter() - sent)
            if placed is None:
                raise RuntimeError("bench drain: HBM refused a one-block allocation")
            client.free(placed["vid"])
        else:
            client.lookup(keys)
            waits.append(time.perf_counter() - sent)
        if time.perf_counter() >= check:
            used = _dram_used(client)
            check = time.perf_counter() + CHECK_EVERY_S
    ms = np.asarray(waits) * 1e3
    moved_now, batches_now = _moved(client)
    late = client.stats()["daemon"]["background"]["late_max_s"]

    def pct(q: float) -> float | None:  # (no call in the phase: none)
        return _r(np.percentile(ms, q)) if len(ms) else None
    return {"n": len(ms), "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "max_ms": _r(ms.max()) if len(ms) else None, "mean_ms": _r(ms.mean()) if len(ms) else None,
            "drain_s": round(time.perf_counter() - started, 2), "drained": used <= DRAINED,
            "dram_end": round(used, 3), "moved_mb": round((moved_now - moved) / 2**20, 1),
            "batches": batches_now - batches, "step_late_max_ms": None if late is None else _r(late * 1e3)}


def _wait_until(client, until: float, used: float, check: float) -> tuple[float, float]:
    """Sleep until `until` (perf_counter) in slices that end at each `check`, when DRAM's fill is
    looked at; stop early once it is drained. The fill last seen and the next check's time."""
    while (now := time.perf_counter()) < until and used > DRAINED:
        if now >= check:
            used = _dram_used(client)
            check = time.perf_counter() + CHECK_EVERY_S
        else:
            time.sleep(min(until, check) - now)
    return used, check


def _wait_drained(client, seconds: float) -> None:
    """Before the next phase fills DRAM again: the drain of this one ends (or its time is up)."""
    deadline = time.monotonic() + seconds
    while _dram_used(client) > DRAINED and time.monotonic() < deadline:
        time.sleep(0.05)


def _r(x) -> float:
    return round(float(x), 3)
