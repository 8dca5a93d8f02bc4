"""What the figures are said to mean, against what they measure: the metrics table's utilization
rows, a return ratio that goes back to NaN, status's fullness column. Moved from
test_observability_units.py (past 600 lines)."""

from __future__ import annotations

import json

import numpy as np

from dflash2.daemon.service import Service
from dflash2.metrics import DaemonMetrics
from observe_helpers import load, scrape, service  # noqa: F401  (a fixture)


def test_the_tables_utilization_rows_say_what_the_gauges_measure(service):
    """A review: metrics.py's table called dflash2_gpu_memory_utilization and dflash2_gpu_nvme_utilization
    "used / capacity"; they are the watermarks' measure, used slots and the page tails of their slabs
    (full_bytes) over capacity: a full tier of 1.25 MiB blocks in 2 MiB pages reads 1.0, not 0.625."""
    import dflash2.metrics as metrics_module

    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    st = json.loads(json.dumps(metrics.snapshot))
    hbm = st["tiers"]["hbm"]
    hbm.update(capacity_bytes=16 << 20, used_bytes=10 << 20, full_bytes=16 << 20)
    st["tiers"]["nvme"] = dict(hbm)
    metrics.snapshot = st
    got = scrape(metrics)
    assert got[("dflash2_gpu_memory_utilization", (("gpu", "0"),))] == 1.0
    assert got[("dflash2_gpu_nvme_utilization", (("gpu", "0"),))] == 1.0
    rows = {line.split("|")[1].strip().split("{")[0]: line for line in metrics_module.__doc__.splitlines()
            if line.startswith("| dflash2_gpu_")}
    for name in ("dflash2_gpu_memory_utilization", "dflash2_gpu_nvme_utilization"):
        assert "used / capacity" not in rows[name], rows[name]
    assert "page tails" in rows["dflash2_gpu_memory_utilization"]


def test_a_recent_return_ratio_goes_back_to_nan_and_the_docs_say_so(make_manager, clock):
    """A review: the docs said the recent return ratios are NaN "until both lists have 32 such
    departures"; the counts are decayed (halved each time the tier's capacity in blocks left it), so a
    ratio once known goes back to NaN after a while in which one list lets few blocks go."""
    import dflash2.metrics as metrics_module
    from prometheus_client import generate_latest
    from dflash2.policy.split import AdaptiveSplit

    split = AdaptiveSplit(1, 10_000, rate_band=0.0)
    split.capacity[0] = 64
    keys = iter(range(1, 1 << 20))

    def leave(lst: int, n: int) -> None:
        split.left(np.full(n, lst, dtype=np.int64), np.array([next(keys) for _ in range(n)], dtype=np.uint64))

    for _ in range(10):
        leave(0, 20)
        leave(1, 20)
    assert split.recent_rates(0) is not None
    for _ in range(30):  # first-timers alone leave
        leave(0, 20)
    assert split.recent_rates(0) is None  # unknown again
    doc = metrics_module.__doc__
    row = next(line for line in doc.splitlines() if line.startswith("| dflash2_policy_recent_return_ratio"))
    assert "NaN until" not in row and "NaN while either list" in row, row
    service = Service(make_manager(hbm_blocks=8, dram_blocks=16, policy="heat"), lease_timeout_s=10,
                      heartbeat_interval_s=1, clock=clock)
    metrics = DaemonMetrics(service)
    load(service)
    metrics.refresh(force=True)
    helps = [line for line in generate_latest(metrics.registry).decode().splitlines()
             if line.startswith("# HELP dflash2_policy_") and "recent_return_ratio" in line]
    assert len(helps) == 2 and all("NaN while" in h and "NaN until" not in h for h in helps), helps


def test_status_names_the_share_the_watermarks_weigh_as_full_not_used():
    """Beside the tier's used bytes, the share shown is its fullness (used slots and their slabs'
    page tails, `tiers.fill`), not used / capacity: headed "used %", 40 KiB blocks in 64 KiB pages
    read "used 3.1 MiB" of 4.0 MiB at "84.2" (a review's status)."""
    from dflash2.status import render
    hbm = {"capacity_bytes": 4 << 20, "used_bytes": 80 * 40960, "full_bytes": 80 * 40960 + 40 * 6144 + 16384,
           "blocks": 80}
    view = render({"daemon": {}, "tiers": {"hbm": hbm}}).splitlines()
    head = next(line for line in view if line.startswith("tier "))
    assert head.split() == ["tier", "capacity", "used", "full", "%", "blocks"], head
    row = next(line for line in view if line.startswith("hbm "))
    assert row.split()[1:] == ["4.0", "MiB", "3.1", "MiB", f"{100 * hbm['full_bytes'] / hbm['capacity_bytes']:.1f}", "80"]


def test_the_prefetch_counters_help_names_every_wasted_prefetch(make_manager, clock):
    """A review: the scrape's HELP of dflash2_prefetch_blocks_total said wasted blocks are those
    "gone from HBM unread"; a block prefetched for a reader that detached is counted wasted at the
    next step while it still lies in HBM (prefetch.py `drop`, `settle`), as metrics.py's table and
    the README say."""
    from prometheus_client import generate_latest

    svc = Service(make_manager(hbm_blocks=8, dram_blocks=16), lease_timeout_s=10, heartbeat_interval_s=1, clock=clock)
    metrics = DaemonMetrics(svc)
    metrics.refresh(force=True)
    helps = [line for line in generate_latest(metrics.registry).decode().splitlines()
             if line.startswith("# HELP dflash2_prefetch_blocks_total ")]
    assert len(helps) == 1 and "reader detached" in helps[0], helps
