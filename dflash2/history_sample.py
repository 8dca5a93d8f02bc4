"""A history sample: its shape (`sample_of`), what makes a decoded line one (`is_sample`), and the
figures between two samples (`change`, `rates`).

Apart from dflash2/history.py, which keeps and writes the series (and re-exports these), so that
that module stays a size a reader can hold.
"""

from __future__ import annotations

import math


def sample_of(stats: dict, t: float) -> dict:
    """The key figures of a `Service.stats()` snapshot, compact."""
    res = stats["reservations"]
    daemon = stats.get("daemon", {})
    clients = stats.get("clients", 0)
    return {
        "t": round(t, 3),
        "tiers": {name: {"used_bytes": s["used_bytes"], "capacity_bytes": s["capacity_bytes"],
                         "full_bytes": s["full_bytes"], "blocks": s["blocks"]}  # (full: tiers.fill)
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
        "pid": daemon.get("pid"),
        "started": daemon.get("started"),  # the daemon's start (unix s): a restart as pid 1 keeps its pid
    }


# What the readers (rates, `dflash2 history`, the plot) index in every sample.
SAMPLE_KEYS = ("t", "tiers", "reads", "hbm_hit_ratio", "swaps", "reservations", "clients")
TIER_NAMES = ("hbm", "dram", "nvme")
# A sample's time (unix s) lies where the readers' clock conversion takes it, in any time zone (up
# to a day before the end of the year 9999): one bad byte can make it any number (1796354471e052),
# which that conversion refuses.
T_RANGE = (0.0, 253_402_300_799.0 - 2 * 86_400)


def _number(x) -> bool:
    """A figure: a finite float, or an int of 64 bits (JSON takes ints of up to 4300 digits, and
    `math.isfinite` raised OverflowError on one past a float's range: the daemon did not start on
    such a line in its history, nor did `dflash2 history --file` read it)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return -(1 << 63) <= x < (1 << 63)
    return isinstance(x, float) and math.isfinite(x)


def _direction(d) -> bool:
    return isinstance(d, str) and len(parts := d.split("->")) == 2 and all(p in TIER_NAMES for p in parts)


def is_sample(obj) -> bool:
    """Whether a decoded line is a sample that the readers can use: every figure they index there,
    each of its type. One bad byte in a line loses that line: before, a line that kept its top-level
    keys but not a nested one (`"deferrad"`), or whose time became 1796354471e052, was kept, and every
    `dflash2 history` of that daemon failed on it until the file rotated (a review's script)."""
    try:
        return (isinstance(obj, dict) and all(k in obj for k in SAMPLE_KEYS)
                and _number(obj["t"]) and T_RANGE[0] <= obj["t"] <= T_RANGE[1]
                and isinstance(obj["tiers"], dict)
                and all(t in TIER_NAMES and _number(v["used_bytes"]) and _number(v["capacity_bytes"])
                        and _number(v.get("full_bytes", 0)) for t, v in obj["tiers"].items())
                and isinstance(obj["reads"], dict)
                and all(t in TIER_NAMES and _number(n) for t, n in obj["reads"].items())
                and (obj["hbm_hit_ratio"] is None or _number(obj["hbm_hit_ratio"]))
                and isinstance(obj["swaps"], dict)
                and all(_direction(d) and _number(m.get("bytes", 0)) for d, m in obj["swaps"].items())
                and isinstance(obj["reservations"], dict)
                and all(_number(obj["reservations"][k]) for k in ("granted", "deferred"))
                and _number(obj["clients"]) and all(_number(obj.get(k, 0)) for k in ("requests", "errors")))
    except (KeyError, TypeError, AttributeError, OverflowError):
        return False


def change(a: dict, b: dict) -> tuple[dict[str, int], dict[str, int]] | None:
    """(blocks read per tier, bytes moved per direction) from sample `a` to `b`, or None when the
    daemon restarted between them: its start time or pid changed, or a counter went down. As pid 1
    in a container it keeps its pid, and a restart that served more than the daemon before it
    showed no counter going down: its figures were taken for the old daemon's (a review's script;
    samples before `started` was kept have none)."""
    if a.get("started") != b.get("started") or a.get("pid") != b.get("pid"):
        return None
    if b.get("requests", 0) < a.get("requests", 0):
        return None
    reads = {t: b["reads"].get(t, 0) - a["reads"].get(t, 0) for t in a["reads"].keys() | b["reads"].keys()}
    moved = {d: b["swaps"].get(d, {}).get("bytes", 0) - a["swaps"].get(d, {}).get("bytes", 0)
             for d in a["swaps"].keys() | b["swaps"].keys()}
    if any(n < 0 for n in reads.values()) or any(n < 0 for n in moved.values()):
        return None
    return reads, moved


def rates(samples: list[dict]) -> list[dict]:
    """Per-interval figures between consecutive samples: HBM hit ratio of the blocks acquired in the
    interval, and swap bandwidth (bytes/s) per direction. A daemon restart between two samples
    (`change`) gives no row for that interval."""
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        moves = change(a, b) if dt > 0 else None
        if moves is None:
            continue
        reads, moved = moves
        total = sum(reads.values())
        out.append({"t": b["t"], "dt": dt, "reads": total,
                    "hbm_hit_ratio": reads.get("hbm", 0) / total if total else None,
                    "swap_bps": {d: v / dt for d, v in sorted(moved.items())}})
    return out
