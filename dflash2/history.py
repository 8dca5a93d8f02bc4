"""The daemon's history: a bounded time series of its key figures, to read back after an incident.

With `history_enabled: true` the daemon's owner thread samples once per `interval_s` (1 s) from the
same snapshot the metrics use, keeps the last `max_samples` (3 hours) in memory, and appends each
sample as one JSON line to `STATE_DIR/history.jsonl` (rotated to `history.jsonl.1` past 64 MiB).
On start it reloads what that file still holds, so a restarted daemon still has the night before.

A sample holds gauges as they were and counters as running totals since the daemon started (a
restart shows as a counter going down; `rates` skips that interval):

    {"t": unix seconds, "tiers": {tier: {used_bytes, capacity_bytes, blocks}},
     "reads": {tier: blocks acquired from it}, "hbm_hit_ratio": since start or null,
     "lookup_misses": n, "swaps": {"hbm->dram": {blocks, bytes, seconds, failed_blocks}, ...},
     "reservations": {granted, deferred, reserved_blocks}, "clients": n, "requests": n, "errors": n}

Read it over the control protocol (op `history`, samples as JSON lines in one binary frame) or with
`dflash2 history [--since 30m] [--json] [--plot FILE.png]`, which also reads the file offline.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("dflash2.history")

FILE_NAME = "history.jsonl"
LOCK_NAME = "history.lock"  # held by the daemon that writes FILE_NAME
DEFAULT_INTERVAL_S = 1.0
DEFAULT_MAX_SAMPLES = 3 * 3600
DEFAULT_MAX_FILE_BYTES = 64 << 20


def sample_of(stats: dict, t: float) -> dict:
    """The key figures of a `Service.stats()` snapshot, compact."""
    res = stats["reservations"]
    daemon = stats.get("daemon", {})
    clients = stats.get("clients", 0)
    return {
        "t": round(t, 3),
        "tiers": {name: {"used_bytes": s["used_bytes"], "capacity_bytes": s["capacity_bytes"], "blocks": s["blocks"]}
                  for name, s in stats["tiers"].items()},
        "reads": dict(stats["reads"]),
        "hbm_hit_ratio": stats["hbm_hit_ratio"],
        "lookup_misses": stats.get("lookup_misses", 0),
        "swaps": {d: {k: m[k] for k in ("blocks", "bytes", "seconds", "failed_blocks")}
                  for d, m in stats["moves"].items()},
        "reservations": {k: res[k] for k in ("granted", "deferred", "reserved_blocks")},
        "clients": len(clients) if isinstance(clients, list) else clients,  # Service.stats() lists them
        "requests": daemon.get("requests", 0),
        "errors": daemon.get("errors", 0),
    }


class History:
    def __init__(self, *, interval_s: float = DEFAULT_INTERVAL_S, max_samples: int = DEFAULT_MAX_SAMPLES,
                 path: Path | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 clock: Callable[[], float] = time.time):
        if interval_s <= 0 or max_samples <= 0:
            raise ValueError("history needs a positive interval and room for at least one sample")
        self.interval_s = interval_s
        self.samples: collections.deque[dict] = collections.deque(maxlen=max_samples)
        self.path = path
        self.max_file_bytes = max_file_bytes
        self.clock = clock
        self.lock_fd = -1  # the state folder's history lock, when this daemon holds it (make_history)
        self._next = -float("inf")
        if path is not None:
            self.samples.extend(read_file(path, max_samples))

    def close(self) -> None:
        """Give the state folder's history lock back (the file stays)."""
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    def due(self) -> bool:
        return self.clock() >= self._next

    def record(self, stats: dict) -> dict:
        """Append a sample of `stats` now (and to the file)."""
        now = self.clock()
        self._next = now + self.interval_s
        s = sample_of(stats, now)
        self.samples.append(s)
        if self.path is not None:
            self._persist(s)
        return s

    def since(self, seconds: float | None = None) -> list[dict]:
        if seconds is None:
            return list(self.samples)
        cutoff = self.clock() - seconds
        return [s for s in self.samples if s["t"] >= cutoff]

    @staticmethod
    def encode(samples: Iterable[dict]) -> bytes:
        return "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in samples).encode()

    def _persist(self, sample: dict) -> None:
        try:
            if self.path.exists() and self.path.stat().st_size > self.max_file_bytes:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            with open(self.path, "a") as f:
                f.write(json.dumps(sample, separators=(",", ":")) + "\n")
        except OSError as e:  # a full disk must not stop the daemon: keep the in-memory series
            log.warning("history: cannot write %s (%s); keeping it in memory only", self.path, e)
            self.path = None


def decode(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def read_file(path: Path, max_samples: int | None = None) -> list[dict]:
    """Samples from a history file (and its rotated predecessor), oldest first; a torn last line is skipped."""
    out: collections.deque[dict] = collections.deque(maxlen=max_samples)
    for p in (path.with_name(path.name + ".1"), path):
        try:
            lines = p.read_text().splitlines()
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as e:  # unreadable: start without it, and say so
            logging.getLogger("dflash2.history").warning("history file %s cannot be read (%s): skipped", p, e)
            continue
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return list(out)


def rates(samples: list[dict]) -> list[dict]:
    """Per-interval figures between consecutive samples: HBM hit ratio of the blocks acquired in the
    interval, and swap bandwidth (bytes/s) per direction. A counter that went down (restart) gives
    no row for that interval."""
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        reads = {t: b["reads"].get(t, 0) - a["reads"].get(t, 0) for t in b["reads"]}
        dirs = set(a["swaps"]) | set(b["swaps"])
        moved = {d: b["swaps"].get(d, {}).get("bytes", 0) - a["swaps"].get(d, {}).get("bytes", 0) for d in dirs}
        if any(v < 0 for v in reads.values()) or any(v < 0 for v in moved.values()):
            continue
        total = sum(reads.values())
        out.append({"t": b["t"], "dt": dt, "reads": total,
                    "hbm_hit_ratio": reads.get("hbm", 0) / total if total else None,
                    "swap_bps": {d: v / dt for d, v in sorted(moved.items())}})
    return out


def make_history(cfg, state_dir: Path, **kw) -> History | None:
    """The daemon's history per the config (None when off); the file lives in the state folder.
    One daemon writes a state folder's file: it holds a lock beside it (`LOCK_NAME`) while it runs,
    and a second daemon given the same folder keeps its history in memory only, and says so
    (two daemons appending to one file would interleave their samples)."""
    if not cfg.history_enabled:
        return None
    path, lock_fd = None, -1
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(lock_fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(lock_fd)
            lock_fd = -1
            log.warning("history: %s is written by another daemon (pid %s); this one keeps its history in memory "
                        "only (give it a daemon.state_dir of its own)", state_dir / FILE_NAME, holder)
        else:
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
            path = state_dir / FILE_NAME
    except OSError as e:
        if lock_fd >= 0:
            os.close(lock_fd)
            lock_fd = -1
        log.warning("history: cannot create %s (%s); keeping it in memory only", state_dir, e)
    history = History(path=path, **kw)
    history.lock_fd = lock_fd
    return history
