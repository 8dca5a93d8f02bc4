"""A node's totals over its GPUs' block pools: the `stats` op and the metrics of a daemon serving
several GPUs add up each pool's figures."""

from __future__ import annotations


# Per-pool figures that do not add up over pools: settings (the policy's weights, the prefetch
# window) are the first pool's; measured read bandwidth is per GPU's link, under "devices" only.
SETTINGS_STATS = frozenset({"policy", "window"})
PER_POOL_STATS = frozenset({"read_cost", "duel"})  # per GPU only: rates that do not add up


def sum_stats(parts: list[dict]) -> dict:
    """Node totals of several pools' stats: counts add up, ratios are recomputed from the sums,
    anything else (names, settings) is taken from the first pool."""
    def merge(values: list):
        first = values[0]
        if isinstance(first, dict):
            keys = [k for k in dict.fromkeys(k for v in values for k in v) if k not in PER_POOL_STATS]
            return {k: first[k] if k in SETTINGS_STATS and k in first else merge([v[k] for v in values if k in v])
                    for k in keys}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return sum(v for v in values if isinstance(v, (int, float)))
        return first
    total = merge(parts)
    reads = total.get("reads", {})
    all_reads = sum(reads.values())
    total["hbm_hit_ratio"] = reads.get("hbm", 0) / all_reads if all_reads else None
    return total
