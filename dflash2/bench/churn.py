"""`dflash2 bench churn`: what the daemon's own work costs per request while its clients churn a full cache.

Starts `dflash2d` on a temporary host-only config (HBM of `--hbm-mb`, DRAM of `--dram-mb`, NVMe of
`--nvme-mb` in the temporary folder, blocks of 16 tokens, 16 KiB each, in 2 MiB pages as the default
config's (smaller for a tier under 16 MB), policy `--policy`) and
`--clients` processes that each serve requests back to back, as an engine would: a
request is a document (one asked for lately with probability RECENT, else any of `--docs`; every
DOCS_PER_FAMILY documents share a prefix of FAMILY_BLOCKS blocks, and a document has 3 to 8
blocks), and serving it is four or five calls: look up its prefix chain, acquire the blocks found,
allocate the rest, write and commit them under the found prefix and free them (published, they stay
cached), then check every byte of the blocks read (each block's bytes are a function of its key) and
release them. Tiers this small fill during the first `--warmup` seconds; the figures are those of
the `--seconds` after, while calls make room, promote and demote, as a busy node's do.

One line: `requests`, `requests_per_s`, `calls_per_s`; `daemon_cpu_ms_per_request` and
`daemon_cpu_ms_per_call` (the daemon process's CPU time over the timed window, from
/proc/PID/stat: Linux only, null elsewhere) and `daemon_cpu_share` (its CPU seconds per second);
per call, `p50_ms` and `p99_ms`; `hit_ratio` (blocks found over blocks asked, and acquired:
`acquires_gone` counts lookups whose blocks were evicted before the acquire, as an engine may see
them; they count as misses); `blocks_checked` (the blocks read in the window, each byte-checked)
and `wrong_blocks` (0, unless dflash2 has a bug; blocks are checked in the warm-up too, and a wrong
one there counts); `calls_parked`;
the daemon's `moves` (blocks per direction) over the window; and, with heat, its duel's sampled
lookups `duel_served` and `duel_dropped` over the window (dropped: the daemon's loop could not
keep up), and at its end `duel_sample` (1 in N keys replayed: finer than `policy.duel_sample`
where HBM is small, coarser once the loop fell behind), `duel_state` (warming up, judging, off)
and `duel_turned_over` (how far along a warming duel is: it judges at 1); `log_level` and
`log_bytes_per_s` (the daemon's log, its stderr, over the window: at the default config's `info`
since 2026-12-04's last session; the figures before were taken at `warning`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash2.argtypes import non_negative_int, positive_int, seconds
from dflash2.bench.control import _start, _stop
from dflash2.bench.workers import ANSWER_MARGIN_S, Workers
from dflash2.layout import Layout

LAYOUT = Layout("bench-churn", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
RECENT = 0.35  # a request asks for a document asked for lately (one of the client's last RECENT_KEPT)
RECENT_KEPT = 300
DOCS_PER_FAMILY = 8
FAMILY_BLOCKS = 2
START_DELAY_S = 1.0  # spawned clients attach before the timed window opens
LATE_START_S = 0.1  # a client that began serving later than this into the timed window: no figures
OPS = ("lookup", "acquire", "allocate", "commit", "free", "release")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=positive_int, default=3, help="client processes (default %(default)s)")
    parser.add_argument("--warmup", type=non_negative_int, default=10,
                        help="seconds of requests before the timed window, to fill the tiers (default %(default)s)")
    parser.add_argument("--seconds", type=seconds, default=20.0, help="timed window (default %(default)s)")
    parser.add_argument("--docs", type=positive_int, default=9000, help="distinct documents (default %(default)s)")
    parser.add_argument("--policy", default="heat", help="policy.name of the daemon (default %(default)s)")
    parser.add_argument("--hbm-mb", type=positive_int, default=16, help="HBM tier (host memory) in MB (default %(default)s)")
    parser.add_argument("--dram-mb", type=positive_int, default=32, help="DRAM tier in MB (default %(default)s)")
    parser.add_argument("--nvme-mb", type=non_negative_int, default=128,
                        help="NVMe tier in MB, a file in a temporary folder; 0 for none (default %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="the daemon's logging.level (default %(default)s, the default config's)")


def run(args: argparse.Namespace) -> dict:
    from dflash2.bench import BenchFailed, daemon_policy
    from dflash2.client import Client

    daemon_policy(args.policy)
    with tempfile.TemporaryDirectory(prefix="dflash2-bench-") as tmp:
        folder = Path(tmp)
        endpoint = f"ipc://{folder}/d.sock"
        daemon = _start_daemon(folder, endpoint, args)
        try:
            with Client.connect(endpoint, name="bench-churn-stats") as watcher:
                start_at = time.time() + START_DELAY_S + 0.3 * args.clients
                window = (start_at + args.warmup, start_at + args.warmup + args.seconds)
                with Workers(_client, [(endpoint, i, args.docs, start_at, window) for i in range(args.clients)],
                             "bench churn") as workers:
                    workers.sleep_until(window[0])
                    # The clock and CPU first, the stats after: timed from after the stats call, the
                    # window the requests were counted in was cut by its reply's wait (a busy daemon's:
                    # 0.1-0.2 s of 2-3 s, requests_per_s 6-7% high, a review).
                    cpu0, t0 = _cpu_s(daemon.pid), time.perf_counter()
                    before = watcher.stats()
                    log0 = (folder / "daemon.log").stat().st_size
                    workers.sleep_until(window[1])
                    cpu1, t1, after = _cpu_s(daemon.pid), time.perf_counter(), watcher.stats()
                    logged = (folder / "daemon.log").stat().st_size - log0
                    results = workers.results(deadline=window[1] + ANSWER_MARGIN_S)
        finally:
            _stop(daemon)
    # A client whose start took past the window's opening (a loaded node's interpreter start, with a
    # short --warmup) served part of the window or none of it: its figures counted the whole window,
    # and a run whose clients never began said 0 requests a second, exit 0 (a review).
    late = [(i, r["began"] - window[0]) for i, r in enumerate(results) if r["began"] > window[0] + LATE_START_S]
    if late:
        raise BenchFailed(f"bench churn: client process(es) {', '.join(f'{i} ({s:.1f} s late)' for i, s in late)} "
                          f"began serving after the timed window opened (their start took longer than the "
                          f"{START_DELAY_S + 0.3 * args.clients:g} s allowed and --warmup {args.warmup}): no figures; "
                          "give a longer --warmup")
    out = _figures(args, results, before, after, None if cpu0 is None else cpu1 - cpu0, t1 - t0)
    out["log_bytes_per_s"] = round(logged / (t1 - t0), 1)
    return out


def _start_daemon(folder: Path, endpoint: str, args: argparse.Namespace):
    # The default config's 2 MiB pages, halved while the smallest tier would hold fewer than 8.
    page_kb, smallest_mb = 2048, min(mb for mb in (args.hbm_mb, args.dram_mb, args.nvme_mb) if mb)
    while page_kb > 64 and smallest_mb * 1024 < 8 * page_kb:
        page_kb //= 2
    cfg = {"enable": True, "device": {"kind": "host"},
           "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": args.hbm_mb, "dram_capacity_mb": args.dram_mb,
                      "nvme_capacity_mb": args.nvme_mb, "nvme_path": str(folder / "nvme.cache"),
                      "staging_buffer_size_mb": 16, "page_kb": page_kb},
           "kv_block": {"block_size": LAYOUT.tokens_per_block, "prefetch_window": 4},
           "policy": {"name": args.policy},
           "daemon": {"endpoint": endpoint, "state_dir": str(folder / "state")},
           "logging": {"format": "text", "level": args.log_level}}
    path = folder / "dflash2_config.json"
    path.write_text(json.dumps(cfg))
    return _start(["-m", "dflash2.daemon.main", "--config", str(path)], "DFlash2: enabled", folder / "daemon.log")


def _cpu_s(pid: int) -> float | None:
    """A process's user + system CPU seconds (Linux /proc), None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# -- a client ------------------------------------------------------------------------------------
def _pattern(key: int) -> np.ndarray:
    """A block's bytes as a function of its key (word 0 is the key: a wrong block names whose it holds)."""
    words = np.arange(LAYOUT.block_bytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return words ^ np.uint64(key)


def _doc_keys(doc: int, cache: dict) -> list[int]:
    from dflash2.client import chain_keys

    keys = cache.get(doc)
    if keys is None:
        tpb = LAYOUT.tokens_per_block
        family = doc // DOCS_PER_FAMILY
        blocks = 3 + (doc * 7919) % 6  # 3..8 blocks
        tokens = [family * 100_000 + i for i in range(FAMILY_BLOCKS * tpb)]
        tokens += [10_000_000 + doc * 1000 + i for i in range((blocks - FAMILY_BLOCKS) * tpb)]
        keys = cache[doc] = chain_keys(tokens, tpb, "bench-churn")
    return keys


def _client(endpoint: str, index: int, docs: int, start_at: float, window: tuple[float, float]) -> dict:
    """One engine's requests back to back from `start_at` to the window's end (module doc): the
    counts and each call's seconds, per op, of the requests begun within the window."""
    from dflash2.client import Client, DaemonError

    rng = np.random.default_rng(1000 + index)
    cache: dict = {}
    recent: list[int] = []
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    counts = {"requests": 0, "asked": 0, "found": 0, "checked": 0, "wrong": 0, "written": 0, "gone": 0}

    counting = False

    def call(op, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if counting:
                lat[op].append(time.perf_counter() - t)

    with Client.connect(endpoint, name=f"bench-churn-{index}", layouts=[LAYOUT]) as client:
        lid = client.layouts[0]
        time.sleep(max(0.0, start_at - time.time()))
        began = time.time()  # (after the window opened: `run` gives no figures)
        while True:
            now = time.time()
            if now >= window[1]:
                break
            counting = now >= window[0]
            doc = recent[int(rng.integers(len(recent)))] if recent and rng.random() < RECENT else int(rng.integers(docs))
            keys = _doc_keys(doc, cache)
            found = call("lookup", client.lookup, keys)
            n = len(found)
            try:
                held = call("acquire", client.acquire, found["vid"]) if n else None
            except DaemonError as e:
                if e.kind != "UnknownBlock":
                    raise
                held = None  # evicted since the lookup (not pinned until acquired): a miss
                counts["gone"] += counting
            if held is None:
                n = 0
            if n < len(keys):
                new = call("allocate", client.allocate, lid, len(keys) - n)
                if new is not None:
                    for place, key in zip(new, keys[n:]):
                        client.view_bytes(place).view(np.uint64)[:] = _pattern(key)
                    vids = call("commit", client.commit, new["vid"], keys=keys[n:],
                                parent=int(held["vid"][-1]) if n else None)
                    call("free", client.free, vids)
                    counts["written"] += counting * len(new)
            if held is not None:
                for place, key in zip(held, keys[:n]):
                    # (checked in the warm-up too: a wrong block is a bug whenever it is read)
                    counts["wrong"] += not np.array_equal(client.view_bytes(place).view(np.uint64), _pattern(key))
                counts["checked"] += counting * n  # (of the window, as every other count: the warm-up's were in)
                call("release", client.release, held["vid"])
            if counting:
                counts["requests"] += 1
                counts["asked"] += len(keys)
                counts["found"] += n
            recent.append(doc)
            del recent[:-RECENT_KEPT]
    return {"counts": counts, "lat": lat, "began": began}


# -- figures -------------------------------------------------------------------------------------
def _figures(args, results: list[dict], before: dict, after: dict, cpu_s: float | None, window_s: float) -> dict:
    totals = {k: sum(r["counts"][k] for r in results) for k in results[0]["counts"]}
    lat = {op: np.concatenate([np.asarray(r["lat"][op]) for r in results]) for op in OPS}
    calls = sum(len(v) for v in lat.values())
    requests = totals["requests"]
    out = {"bench": "churn", "clients": args.clients, "warmup": args.warmup, "seconds": args.seconds,
           "policy": args.policy, "log_level": args.log_level,
           "hbm_mb": args.hbm_mb, "dram_mb": args.dram_mb, "nvme_mb": args.nvme_mb,
           "requests": requests, "calls": calls,
           "requests_per_s": round(requests / window_s, 1), "calls_per_s": round(calls / window_s, 1),
           "daemon_cpu_ms_per_request": None if cpu_s is None or not requests else round(1000 * cpu_s / requests, 3),
           "daemon_cpu_ms_per_call": None if cpu_s is None or not calls else round(1000 * cpu_s / calls, 3),
           "daemon_cpu_share": None if cpu_s is None else round(cpu_s / window_s, 3),
           "p50_ms": {op: _pct(v, 50) for op, v in lat.items()},
           "p99_ms": {op: _pct(v, 99) for op, v in lat.items()},
           "hit_ratio": round(totals["found"] / totals["asked"], 4) if totals["asked"] else None,
           "acquires_gone": totals["gone"],
           "blocks_written": totals["written"], "blocks_checked": totals["checked"], "wrong_blocks": totals["wrong"],
           "calls_parked": after["daemon"]["calls_parked"] - before["daemon"]["calls_parked"],
           "moves": {d: m["blocks"] - before["moves"].get(d, {}).get("blocks", 0) for d, m in after["moves"].items()}}
    duel_before, duel_after = before.get("duel") or {}, after.get("duel") or {}
    if duel_after:
        out["duel_served"] = duel_after.get("requests", 0) - duel_before.get("requests", 0)
        out["duel_dropped"] = duel_after.get("dropped", 0) - duel_before.get("dropped", 0)
        out["duel_sample"], out["duel_state"] = duel_after.get("sample"), duel_after.get("state")
        out["duel_turned_over"] = duel_after.get("turned_over")
    return out


def _pct(seconds: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(seconds, q)) * 1000, 3) if len(seconds) else None
