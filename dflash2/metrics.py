"""Prometheus metrics of the daemon, served on `/metrics` (`metrics.host:metrics.port`; port 0 = off).

Two sources, no double bookkeeping:

- **State**, read from the manager and the service. The thread that owns the block manager takes a
  snapshot (`Service.stats()`, the same figures as the `stats` op) every `snapshot_interval_s`; a
  custom collector turns the latest snapshot into metric families at scrape time. The scrape thread
  never touches the manager: its tables are not safe to read while the owner changes them.
- **Events**, observed where they happen into histograms: request latency per op (Service.handle),
  seconds per batch move (Mover.complete), admission wait (Admission.tick), the background step.

Labels are bounded: tier (hbm|dram|nvme), direction (`hbm->dram`, ...), op (the protocol's ops),
state, outcome, action, kind, mechanism (kernel|engines), gpu (a GPU pool: 0, 1, ...), list
(first_timers|returning), policy (the policies' names), cause (tier_full|reservations_ahead|copy_failed). Never a
block, request or client id.

| metric | type | what |
| --- | --- | --- |
| dflash2_tier_capacity_bytes{tier} | gauge | bytes the tier holds |
| dflash2_tier_used_bytes{tier} | gauge | bytes in slots given to blocks |
| dflash2_tier_free_bytes{tier} | gauge | bytes free for new slots |
| dflash2_tier_full_bytes{tier} | gauge | bytes that can hold no more blocks: used slots and the page tails of their slabs (over capacity: how full the tier is, as its watermarks weigh it) |
| dflash2_tier_blocks{tier} | gauge | blocks in the tier |
| dflash2_tier_waste_bytes{tier,kind} | gauge | slot rounding / page tails |
| dflash2_tier_quarantined_bytes{tier} | gauge | NVMe slots set aside after their own writes failed with an I/O error, or a read of their block failed (an I/O error or its checksum: a bad region of the disk), until a re-test finds them sound; not in capacity, used or free |
| dflash2_tier_no_file{tier} | gauge | 1 while an NVMe tier has no file: its file was removed, moved or replaced and a new one cannot be made at memory.nvme_path (another process holds it, a full disk); its writes are refused and its reads miss |
| dflash2_cache_hits_total{tier} | counter | blocks acquired for HBM that were found in this tier (a block the reader's own lookup brought up counts under the tier it came from: the reader waited for it) |
| dflash2_cache_misses_total{tier} | counter | blocks acquired for HBM that were not in this tier or a faster one (they came from a slower tier) |
| dflash2_host_reads_total{tier} | counter | blocks acquired by host-side readers (tier dram: sglang's host pool), by the tier they were read from; not in the HBM hit ratio |
| dflash2_lookup_blocks_total{result} | counter | lookup keys found in the cached prefix (hit) or not (miss: past it, cached or not, or withheld: the engine recomputes them); a probe lookup (a question about blocks, not a request's prefix) is not counted |
| dflash2_hbm_hit_ratio | gauge | hits in HBM / blocks acquired, since start (NaN before the first) |
| dflash2_swap_blocks_total{direction} | counter | blocks moved (failed ones not counted) |
| dflash2_swap_failed_blocks_total{direction} | counter | blocks whose copy failed: left where they were, but a failed read from NVMe drops its block (a miss) |
| dflash2_swap_bytes_total{direction} | counter | bytes copied |
| dflash2_swap_batches_total{direction} | counter | batch moves |
| dflash2_swap_seconds{direction} | histogram | seconds of a batch's copy, as the backend timed it (every host and NVMe batch; a GPU HBM<->DRAM batch once a second per direction), not its wait behind other batches; _count = batches timed |
| dflash2_copy_batches_total{direction,mechanism} | counter | GPU nodes only: HBM<->DRAM batches by the mechanism that moved them (kernel, engines; a batch split between them counts under each) |
| dflash2_placement_blocks_total{action} | counter | demoted, promoted, evicted, lost, orphaned (cached children dropped with a lost parent), not_admitted (dropped: the tier below refused them), not_kept (dropped: the tier below reads back slower than a recompute; both also in evicted), past_full (demoted past a tier with no room it could make; also in demoted) |
| dflash2_prefetch_blocks_total{gpu,result} | counter | prefetched blocks read while still in HBM (useful) or gone from HBM unread, or still unread a step after their reader detached (wasted) |
| dflash2_prefetch_pending_blocks{gpu} / dflash2_prefetch_window_blocks{gpu} | gauge | prefetched blocks in HBM not read yet / the window now: the last prefetch's (kv_block.prefetch_window, doubled from one prefetch to the next while HBM is below its low watermark), or the configured one while HBM is at or above its high watermark |
| dflash2_write_backoffs_total | counter | times NVMe writes failed (a full or failing disk) and NVMe took no blocks for a while: 1 s, doubled while they keep failing, up to 60 s; meanwhile blocks leaving DRAM are dropped |
| dflash2_read_backoffs_total | counter | times NVMe reads failed on a disk taken to be failing (more than 5% of the tier set aside) and NVMe was neither read nor written for a while: 1 s, doubled each time a read fails again, up to 60 s, ended by a read that works; meanwhile lookups end before its blocks and blocks leaving DRAM are dropped |
| dflash2_refused_calls_total{op,cause} | counter | calls answered "no room now" (None): op allocate or acquire; cause tier_full (the tier cannot hold the blocks now: what is there cannot move, or the room made fell short) or reservations_ahead (allocate: HBM held for reservations waiting at its priority or above) or copy_failed (acquire: the copy up of its blocks failed after their source was read, a refused GPU launch or an out-of-memory; they stay where they were); the client is told why, the log says so once a minute per op and cause |
| dflash2_lookup_withheld_blocks_total | counter | cached blocks a lookup did not offer: loading them costs more than the client's engine recomputing them, or they lie on a failing NVMe disk backing off after failed reads (also counted as lookup misses) |
| dflash2_read_bandwidth_bytes_per_second{gpu,direction} | gauge | read bandwidth measured on each GPU pool's own moves up (dram->hbm, nvme->hbm, nvme->dram; absent until 1 MiB has moved that way) |
| dflash2_reservations_active{state} | gauge | reservations now granted (not all taken) / deferred |
| dflash2_reserved_blocks | gauge | HBM blocks granted and not yet taken |
| dflash2_reservations_total{outcome} | counter | decisions (granted, deferred, rejected) and endings (expired, cancelled, released: its client detached or its lease lapsed; displaced: pushed out of a full deferred queue, or of its client's share of its places) |
| dflash2_admission_wait_seconds | histogram | from reserve to grant, for reservations that waited |
| dflash2_rescore_seconds | histogram | the background step: expiry, admission, heat rescoring, rebalancing |
| dflash2_scheduler_latency_microseconds | histogram | how late the background step started after it was due, the requests answered ahead of it included (a busy request loop delays it) |
| dflash2_request_latency_seconds{op} | histogram | handling time per control op (a parked call's from its arrival) |
| dflash2_requests_total / dflash2_request_errors_total | counter | control messages / error replies |
| dflash2_leases_expired_total | counter | clients detached because their lease lapsed or their process was seen gone |
| dflash2_calls_parked_total | counter | calls parked until copies in flight ended (an NVMe read, a drain's writes) while the loop answered the others |
| dflash2_set_aside_blocks / dflash2_set_aside_pinned_blocks | gauge | private blocks of lapsed clients whose process may still write them, kept out of reuse until it is gone (or daemon.set_aside_leases leases) / blocks such clients had pinned, kept pinned as long |
| dflash2_clients | gauge | clients attached |
| dflash2_gpu_memory_utilization{gpu} | gauge | how full each GPU pool's device (HBM) tier is, as its watermarks weigh it: used slots and the page tails of their slabs (full_bytes), over capacity; on a host-only daemon, of its host-memory stand-in (gpu 0). The dflash2_tier_* gauges are the node's totals over its GPUs |
| dflash2_gpu_nvme_utilization{gpu} | gauge | how full each GPU pool's NVMe tier (its own file) is, measured as dflash2_gpu_memory_utilization |
| dflash2_gpu_nvme_set_aside_ratio{gpu} | gauge | share of each GPU pool's NVMe tier set aside after failed writes or reads (past 0.05 the daemon calls that disk failing) |
| dflash2_snapshot_age_seconds | gauge | age of the state the scrape saw (served by its own thread: it grows while the request loop is stuck, and `up` stays 1) |
| dflash2_info{device,policy,version} | gauge | 1 |
| dflash2_policy_first_timer_target_blocks{gpu,tier} | gauge | heat only: the adaptive split's target for first-timers (blocks whose key had no recent reference) |
| dflash2_policy_list_blocks{gpu,tier,list} | gauge | heat only: keyed blocks per split list (first_timers, returning) |
| dflash2_policy_ghost_hits_total{gpu,tier,list} | counter | heat only: keys asked for again soon after they left the tier, by the list they left |
| dflash2_policy_departures_total{gpu,tier,list} | counter | heat only: keyed blocks that left the tier, by list (ghost hits over departures: each list's return rate, what moves the target) |
| dflash2_policy_recent_return_ratio{gpu,tier,list} | gauge | heat only: ghost hits per departure whose window has closed or that came back (a share, at most 1), recent (decayed): the rates that decide whose ghosts move the target (NaN while either list has fewer than 32 such departures, decayed: it may go back to NaN where a list lets few blocks go for a while) |
| dflash2_policy_ghosts_move_target{gpu,tier,list} | gauge | heat only: 1 while the list's ghosts move the target, 0 while they are held (its recent return ratio below the split's rate band times the other list's: half, in HBM's split of first-timers and returning blocks) |
| dflash2_policy_seen_2_3_target_blocks{gpu,tier} | gauge | heat only: the returning blocks' split: the target for those whose key was referenced 2–3 times (the others 4 or more) |
| dflash2_policy_returning_list_blocks{gpu,tier,list} | gauge | heat only: returning blocks per list of their split (seen_2_3, seen_4_plus) |
| dflash2_policy_returning_ghost_hits_total{gpu,tier,list} | counter | heat only: returning blocks asked for again soon after they left the tier, by the list they left |
| dflash2_policy_returning_departures_total{gpu,tier,list} | counter | heat only: returning blocks that left the tier, by list |
| dflash2_policy_returning_recent_return_ratio{gpu,tier,list} / dflash2_policy_returning_ghosts_move_target{gpu,tier,list} | gauge | heat only: the same for the returning blocks' split |
| dflash2_policy_admission_rule_on{gpu} | gauge | heat only: 1 while TinyLFU's rule applies at the last tier, 0 while the admission gate holds it off or heat ranks as LRU or LFU (every block admitted) |
| dflash2_policy_admission_blocks_total{gpu,outcome} | counter | heat only: blocks the rule refused (refused) or would have refused (admitted_against_rule) |
| dflash2_policy_admission_return_ratio{gpu,kind} | gauge | heat only: share of refused and of departed blocks asked for again within a turnover of the tier |
| dflash2_policy_ranking{gpu,policy} | gauge | heat only: 1 for the ranking heat follows now (heat, lru, lfu; the duel chooses), 0 for the others |
| dflash2_policy_duel_on{gpu} | gauge | heat with `policy.duel_sample` > 0: 1 while the duel runs (warming up or judging), 0 once it stopped (the log and `dflash2 status` say why) |
| dflash2_policy_duel_hit_ratio{gpu,policy} / dflash2_policy_duel_hbm_hit_ratio{gpu,policy} | gauge | heat's duel: each candidate's miniature prefix hit rate in some tier / in HBM, recent (decayed; NaN before the first sampled lookup) |
| dflash2_policy_duel_turned_over{gpu} | gauge | heat's duel: the greatest share, among its miniatures, of the bytes each holds that it has let go; it judges once this reaches 1 (warming up before) |
| dflash2_policy_duel_sample{gpu} | gauge | heat's duel: it replays 1 in this many content keys (`policy.duel_sample`, finer where HBM is small, coarser once the daemon's loop fell behind: README, the duel) |
| dflash2_policy_duel_requests_total{gpu} / dflash2_policy_duel_dropped_total{gpu} / dflash2_policy_duel_switches_total{gpu} | counter | heat's duel: sampled lookups its miniatures served / dropped (a full queue, or the queue when the sample grew coarser) / changes of the ranking followed |
| dflash2_policy_duel_not_replayed_total{gpu,kind} | counter | heat's duel: lookups its miniatures did not replay, by why: host_reader, no_layout, layout_too_large, refused (the log says why) |
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dflash2 import protocol as P
from dflash2 import threads
from dflash2.policy.heat import INNER_LISTS, RANKINGS
from dflash2.policy.split import LISTS as SPLIT_LISTS
from dflash2.readcost import read_paths
from dflash2.tiers import Tier, fill

log = logging.getLogger("dflash2.metrics")

# The top buckets reach past the slowest figure worth telling apart, since histogram_quantile can
# answer no more than the largest finite bucket: a request up to `daemon.request_timeout_s` (5 s; a
# client gives up then), a batch move of swap_batch_size production blocks to NVMe (1024 x 32 MiB =
# 32 GiB: about 30 s at 1 GB/s).
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0,
                   2.5, 5.0, 10.0)
SWAP_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SCHEDULER_BUCKETS_US = (10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 1000000,
                        2500000, 5000000, 10000000, 30000000)
PLACEMENT_ACTIONS = ("demoted", "promoted", "evicted", "lost", "orphaned", "not_admitted", "not_kept", "past_full")
RESERVATION_OUTCOMES = ("granted", "deferred", "rejected", "expired", "cancelled", "released", "displaced")


class DaemonMetrics:
    """The metrics of one daemon, in a registry of its own (no process-global state)."""

    def __init__(self, service, *, device: str = "host", snapshot_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.service = service
        self.device = device
        self.snapshot_interval_s = snapshot_interval_s
        self.clock = clock
        self.snapshot: dict | None = None  # replaced whole by the owner thread: readers see one or the other
        self.snapshot_at = -math.inf
        # The state collector names no metric before a snapshot (they follow it): without the last
        # flag a name-filtered scrape (`/metrics?name[]=...`) never asked it and answered every state
        # metric with nothing (a review). prometheus-client 0.25 and later (pyproject.toml).
        self.registry = CollectorRegistry(auto_describe=True, support_collectors_without_names=True)
        r = self.registry
        self.request_seconds = Histogram("dflash2_request_latency_seconds", "Handling time per control op.",
                                         ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.swap_seconds = Histogram("dflash2_swap_seconds", "Seconds of a batch's copy between two tiers, as the "
                                      "backend timed it (not its wait behind other batches); _count = batches timed.",
                                      ["direction"], buckets=SWAP_BUCKETS, registry=r)
        self.admission_wait = Histogram("dflash2_admission_wait_seconds",
                                        "Seconds from reserve to grant, for reservations that were deferred.",
                                        buckets=WAIT_BUCKETS, registry=r)
        self.rescore_seconds = Histogram("dflash2_rescore_seconds",
                                         "Seconds per background step (expiry, admission, rescoring, rebalancing).",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.scheduler_latency = Histogram("dflash2_scheduler_latency_microseconds",
                                           "Microseconds the background step started after it was due.",
                                           buckets=SCHEDULER_BUCKETS_US, registry=r)
        for op in P.Op:
            self.request_seconds.labels(op.value)
        tiers = sorted(service.manager.specs)
        for a, b in itertools.permutations(tiers, 2):
            self.swap_seconds.labels(direction(a, b))
        r.register(_StateCollector(self))
        self._server = None

    # -- wiring ----------------------------------------------------------------------------
    def attach(self) -> None:
        """Hook the event histograms into the service, the mover and admission."""
        self.service.on_request = self.request_seconds_observe
        for manager in self.service.managers.values():  # every GPU's pool, summed
            manager.mover.on_batch = self.swap_observe
            manager.admission.on_wait = self.admission_wait.observe

    def request_seconds_observe(self, op: str, seconds: float) -> None:
        self.request_seconds.labels(op).observe(seconds)

    def swap_observe(self, src: Tier, dst: Tier, seconds: float) -> None:
        self.swap_seconds.labels(direction(src, dst)).observe(seconds)

    def after_tick(self, late_s: float, seconds: float) -> None:
        """Called by the owner thread after each background step."""
        self.scheduler_latency.observe(max(0.0, late_s) * 1e6)
        self.rescore_seconds.observe(seconds)
        self.refresh()

    def refresh(self, force: bool = False) -> dict | None:
        """Take a new snapshot when the last is older than the interval (owner thread only)."""
        now = self.clock()
        if force or now - self.snapshot_at >= self.snapshot_interval_s:
            self.snapshot = self.service.stats()
            self.snapshot_at = now
        return self.snapshot

    # -- HTTP ------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> None:
        """Serve /metrics from a daemon thread. OSError when the port cannot be bound."""
        with threads.stop_signals_blocked():  # its threads leave stop signals to the main thread (threads.py)
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, self.port)  # (IPv6: bracketed)

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def direction(src: Tier, dst: Tier) -> str:
    return f"{src.label}->{dst.label}"


class _StateCollector(Collector):
    """Metric families from the latest snapshot, built at scrape time."""

    def __init__(self, metrics: DaemonMetrics):
        self.metrics = metrics

    def describe(self):
        return []  # names follow the snapshot: a collector without names (asked by every filter)

    def collect(self):
        m = self.metrics
        st = m.snapshot
        if st is None:
            return
        yield from _tier_families(st)
        yield from _access_families(st)
        yield from _swap_families(st)
        yield from _reservation_families(st)
        yield from _policy_families(st)
        yield from _daemon_families(st, m.device, m.clock() - m.snapshot_at)


def _gauge(name, doc, labels=(), samples=()):
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    for label_values, value in samples:
        g.add_metric(list(label_values), value)
    return g


def _counter(name, doc, labels=(), samples=()):
    c = CounterMetricFamily(name, doc, labels=list(labels))
    for label_values, value in samples:
        c.add_metric(list(label_values), value)
    return c


def _tier_families(st: dict):
    tiers = st["tiers"]
    yield _gauge("dflash2_tier_capacity_bytes", "Bytes the tier holds.", ["tier"],
                 [((t,), s["capacity_bytes"]) for t, s in tiers.items()])
    yield _gauge("dflash2_tier_used_bytes", "Bytes in slots given to blocks.", ["tier"],
                 [((t,), s["used_bytes"]) for t, s in tiers.items()])
    yield _gauge("dflash2_tier_free_bytes", "Bytes free for new slots.", ["tier"],
                 [((t,), s["free_bytes"]) for t, s in tiers.items()])
    yield _gauge("dflash2_tier_full_bytes", "Bytes that can hold no more blocks: used slots and the page tails of "
                 "their slabs (over capacity: how full the tier is, as its watermarks weigh it).", ["tier"],
                 [((t,), s["full_bytes"]) for t, s in tiers.items()])
    yield _gauge("dflash2_tier_blocks", "Blocks in the tier.", ["tier"],
                 [((t,), s["blocks"]) for t, s in tiers.items()])
    yield _gauge("dflash2_tier_waste_bytes", "Bytes lost to slot rounding and page tails.", ["tier", "kind"],
                 [((t, k), s[f"{k}_waste_bytes"]) for t, s in tiers.items() for k in ("rounding", "page_tail")])
    yield _gauge("dflash2_tier_quarantined_bytes", "Bytes of slots set aside after their own writes, or "
                 "their block's reads, failed (not in capacity, used or free).", ["tier"],
                 [((t,), s["quarantined_bytes"]) for t, s in tiers.items()])
    yield _gauge("dflash2_tier_no_file", "1 while an NVMe tier has no file (removed and none can be made): "
                 "writes refused, reads miss.", ["tier"], [((t,), int(bool(s.get("no_file")))) for t, s in tiers.items()])
    # Per GPU pool, not the node's total: each GPU's pool fills on its own (no move crosses GPUs),
    # and one full GPU beside an empty one would read as half full.
    used = [(gpu, pool["tiers"].get(Tier.HBM.label)) for gpu, pool in _pools(st).items()]
    samples = [((gpu,), fill(hbm)) for gpu, hbm in used if hbm and hbm["capacity_bytes"]]
    if samples:
        yield _gauge("dflash2_gpu_memory_utilization", "How full each GPU pool's device (HBM) tier is, as its "
                     "watermarks weigh it: used slots and the page tails of their slabs, over capacity (the host "
                     "stand-in without a GPU: gpu 0).", ["gpu"], samples)
    # Each pool's NVMe file on its own too: the daemon judges each (its watermark, a failing disk past
    # 5% set aside), and one failing file among eight read as 0.75% in the node's sums.
    nvme = [(gpu, pool["tiers"].get(Tier.NVME.label)) for gpu, pool in _pools(st).items()]
    nvme = [(gpu, t) for gpu, t in nvme if t and t["capacity_bytes"] + t["quarantined_bytes"]]
    if nvme:
        yield _gauge("dflash2_gpu_nvme_utilization", "How full each GPU pool's NVMe tier (its own file) is, as "
                     "its watermarks weigh it: used slots and the page tails of their slabs, over capacity.",
                     ["gpu"], [((gpu,), fill(t)) for gpu, t in nvme])
        yield _gauge("dflash2_gpu_nvme_set_aside_ratio", "Share of each GPU pool's NVMe tier set aside after failed "
                     "writes or reads (the daemon calls the disk failing past 0.05).", ["gpu"],
                     [((gpu,), t["quarantined_bytes"] / (t["capacity_bytes"] + t["quarantined_bytes"]))
                      for gpu, t in nvme])


def _access_families(st: dict):
    present = [t for t in Tier if t.label in st["tiers"]]
    reads = {t: st["reads"].get(t.label, 0) for t in present}
    yield _counter("dflash2_cache_hits", "Blocks acquired that were found in this tier.", ["tier"],
                   [((t.label,), reads[t]) for t in present])
    # A miss at tier t: the block was in none of the tiers up to t, so it came from a slower one.
    yield _counter("dflash2_cache_misses", "Blocks acquired that were not in this tier or a faster one.",
                   ["tier"], [((t.label,), sum(n for u, n in reads.items() if u > t)) for t in present])
    found = st.get("lookup_blocks_found", 0)
    yield _counter("dflash2_lookup_blocks", "Lookup keys found in the cached prefix (hit) or not (miss: past it, "
                   "cached or not, or withheld).",
                   ["result"], [(("hit",), found), (("miss",), st.get("lookup_misses", 0))])
    host = st.get("host_reads", {})
    yield _counter("dflash2_host_reads", "Blocks acquired by host-side readers (tier dram), by the tier they were "
                   "read from: not in the HBM hits, misses or ratio.", ["tier"],
                   [((t.label,), host.get(t.label, 0)) for t in present])
    ratio = st["hbm_hit_ratio"]
    yield _gauge("dflash2_hbm_hit_ratio", "Blocks acquired found in HBM / all blocks acquired, since start.",
                 samples=[((), math.nan if ratio is None else ratio)])
    yield _counter("dflash2_placement_blocks", "Blocks moved by placement, by action.", ["action"],
                   [((a,), st["placement"].get(a, 0)) for a in PLACEMENT_ACTIONS])
    yield _counter("dflash2_write_backoffs", "Times NVMe writes failed and NVMe took no blocks for a while.",
                   samples=[((), st["placement"].get("write_backoffs", 0))])
    yield _counter("dflash2_read_backoffs", "Times reads of a failing NVMe disk failed and NVMe was neither read "
                   "nor written for a while.", samples=[((), st["placement"].get("read_backoffs", 0))])
    refused = st.get("refused", {})
    yield _counter("dflash2_refused_calls", "Calls answered no room now (None), by call and cause.", ["op", "cause"],
                   [((op, cause), n) for op, causes in refused.items() for cause, n in causes.items()])
    yield _counter("dflash2_lookup_withheld_blocks",
                   "Cached blocks a lookup did not offer: loading them costs more than recomputing them, "
                   "or they lie on a failing NVMe disk backing off after failed reads.",
                   samples=[((), st.get("lookup_withheld", 0))])
    pools = _pools(st)
    yield _counter("dflash2_prefetch_blocks", "Prefetched blocks read while still in HBM (useful), or gone from HBM "
                   "unread or still unread a step after their reader detached (wasted).", ["gpu", "result"],
                   [((gpu, r), pool["prefetch"][r]) for gpu, pool in pools.items() for r in ("useful", "wasted")])
    yield _gauge("dflash2_prefetch_pending_blocks", "Prefetched blocks in HBM not read yet.", ["gpu"],
                 [((gpu,), pool["prefetch"]["pending"]) for gpu, pool in pools.items()])
    yield _gauge("dflash2_prefetch_window_blocks", "Blocks a reader's prefetch brings up ahead of its reads now: "
                 "the last prefetch's (kv_block.prefetch_window, doubled while HBM is below its low watermark), or "
                 "the configured one while HBM is at or above its high watermark.", ["gpu"],
                 [((gpu,), pool["prefetch"]["window"]) for gpu, pool in pools.items()])
    # Per GPU pool (a node of several keeps one measurement per pool, under `devices`).
    yield _gauge("dflash2_read_bandwidth_bytes_per_second", "Read bandwidth measured on the daemon's own moves up a tier.",
                 ["gpu", "direction"], [((gpu, d), bw) for gpu, pool in _pools(st).items()
                                        for d, bw in read_paths(pool.get("read_cost", {}).get("bytes_per_s", {})).items()
                                        if bw is not None])


def _swap_families(st: dict):
    tiers = [t for t in Tier if t.label in st["tiers"]]
    moves = st["moves"]
    dirs = [direction(a, b) for a, b in itertools.permutations(tiers, 2)]

    def per_dir(field):
        return [((d,), moves.get(d, {}).get(field, 0)) for d in dirs]

    yield _counter("dflash2_swap_batches", "Batch moves between tiers.", ["direction"], per_dir("batches"))
    yield _counter("dflash2_swap_blocks", "Blocks moved between tiers.", ["direction"], per_dir("blocks"))
    yield _counter("dflash2_swap_failed_blocks", "Blocks whose copy failed (left where they were; a failed read "
                   "from NVMe drops its block: a miss).",
                   ["direction"], per_dir("failed_blocks"))
    yield _counter("dflash2_swap_bytes", "Bytes copied between tiers.", ["direction"], per_dir("bytes"))
    batches = st.get("copy_batches", {})
    if batches:  # a GPU node: HBM<->DRAM batches by the mechanism that moved them
        yield _counter("dflash2_copy_batches", "HBM<->DRAM batches started, by the GPU mechanism that moved them "
                       "(a batch split between them counts once under each).", ["direction", "mechanism"],
                       [((d, m), n) for d, per in batches.items() for m, n in per.items()])


def _reservation_families(st: dict):
    res = st["reservations"]
    yield _gauge("dflash2_reservations_active", "Reservations now granted (blocks not all taken) or deferred.",
                 ["state"], [(("granted",), res["granted"]), (("deferred",), res["deferred"])])
    yield _gauge("dflash2_reserved_blocks", "HBM blocks granted to reservations and not yet taken.",
                 samples=[((), res["reserved_blocks"])])
    yield _counter("dflash2_reservations", "Reservation decisions and endings, by outcome.", ["outcome"],
                   [((o,), res.get(f"total_{o}", 0)) for o in RESERVATION_OUTCOMES])


def _pools(st: dict) -> dict:
    """Each GPU pool's stats by GPU label ("0", "1", ...): a node's `devices`, or the one pool."""
    if st.get("devices"):
        return st["devices"]
    # A lone pool under its own key: GPU 3's when device.gpu_ids is [3] (every per-GPU series said
    # gpu="0" there); "0" for a host daemon and for samples from before the key was sent.
    return {(st.get("daemon", {}).get("pools") or ["0"])[0]: st}


def _policy_families(st: dict):
    """The heat policy's state per GPU pool (a node's totals hold only the first pool's policy):
    each tier's adaptive split and the last tier's admission gate. Absent for policies without them."""
    split, inner, gate, ranking, duels = [], [], [], [], []
    for gpu, pool in _pools(st).items():
        if isinstance(pool.get("duel"), dict):
            duels.append((gpu, pool["duel"]))
        policy = pool.get("policy")
        if not isinstance(policy, dict):
            continue
        if policy.get("ranking"):
            ranking.append((gpu, policy["ranking"]))
        split += [(gpu, t) for t in policy.get("split") or []]
        inner += [(gpu, t) for t in policy.get("returning_split") or []]
        if policy.get("admission"):
            gate.append((gpu, policy["admission"]))
    yield from _split_families(split, "", SPLIT_LISTS, "first_timer_target",
                               "blocks the first-timers may hold in the tier before they give way first",
                               "Heat's adaptive split")
    yield from _split_families(inner, "returning_", INNER_LISTS, "seen_2_3_target",
                               "blocks the returning blocks referenced 2-3 times may hold in the tier before they "
                               "give way first (among returning blocks)", "Heat's split of the returning blocks")
    if gate:
        yield _gauge("dflash2_policy_admission_rule_on",
                     "1 while the last tier's admission rule (TinyLFU's) applies, 0 while the gate holds it off "
                     "or heat ranks as LRU or LFU (every block admitted).",
                     ["gpu"], [((g, ), int(a["rule_on"])) for g, a in gate])
        yield _counter("dflash2_policy_admission_blocks",
                       "Blocks the last tier's admission rule refused: refused, or admitted while the gate held it off.",
                       ["gpu", "outcome"],
                       [((g, o), a[o]) for g, a in gate for o in ("refused", "admitted_against_rule")])
        yield _gauge("dflash2_policy_admission_return_ratio",
                     "Of the blocks the rule refused (would refuse) and of those that left the tier, the share "
                     "asked for again within a turnover of the tier (decayed).", ["gpu", "kind"],
                     [((g, k), a[f"{k}_return_rate"]) for g, a in gate for k in ("refused", "departed")
                      if a.get(f"{k}_return_rate") is not None])
    if ranking:
        yield _gauge("dflash2_policy_ranking", "1 for the ranking the heat policy follows now (the duel chooses), "
                     "0 for the others.", ["gpu", "policy"],
                     [((g, name), int(name == r)) for g, r in ranking for name in RANKINGS])
    yield from _duel_families(duels)


def _duel_families(duels: list):
    """The heat policy's duel per GPU pool (dflash2/duel.py): its miniatures' hit rates and counts."""
    if not duels:
        return
    yield _gauge("dflash2_policy_duel_on", "1 while the heat policy's duel runs, 0 once it stopped (the log says why).",
                 ["gpu"], [((g,), int(d["state"] != "off")) for g, d in duels])
    for key, name, what in (("hit_rate", "hit_ratio", "in some tier"), ("hbm_hit_rate", "hbm_hit_ratio", "in HBM")):
        yield _gauge(f"dflash2_policy_duel_{name}",
                     f"Each candidate's miniature prefix hit rate {what}, recent (decayed; NaN before the first "
                     "sampled lookup).", ["gpu", "policy"],
                     [((g, c), math.nan if r is None else r) for g, d in duels for c, r in d[key].items()])
    yield _gauge("dflash2_policy_duel_sample", "The duel replays 1 in this many content keys (policy.duel_sample, "
                 "finer where HBM is small, or coarser once the daemon's loop fell behind).", ["gpu"],
                 [((g,), d["sample"]) for g, d in duels])
    yield _gauge("dflash2_policy_duel_turned_over", "The greatest share, among the duel's miniatures, of the bytes each "
                 "holds that it has let go: it judges once this is 1.", ["gpu"],
                 [((g,), d.get("turned_over", math.nan)) for g, d in duels])
    for key, doc in (("requests", "Sampled lookups the duel's miniatures served."),
                     ("dropped", "Sampled lookups the duel dropped (its full queue, or its queue when the sample grew coarser): the daemon's loop could not keep up."),
                     ("switches", "Changes of the ranking the heat policy follows.")):
        yield _counter(f"dflash2_policy_duel_{key}", doc, ["gpu"], [((g,), d[key]) for g, d in duels])
    yield _counter("dflash2_policy_duel_not_replayed", "Lookups the duel's miniatures did not replay, by why (kind): "
                   "host_reader (reader=dram), no_layout (none named among several), layout_too_large, refused "
                   "(by a miniature: the log says why).", ["gpu", "kind"],
                   [((g, why), n) for g, d in duels for why, n in d["not_replayed"].items()])


def _split_families(split: list, prefix: str, lists: tuple, target: str, target_doc: str, what: str):
    """One split's families (the first-timers' split, or the returning blocks' split into those whose
    key was referenced 2-3 times and 4 or more): its first list's target, the lists' sizes, ghost hits and
    departures per GPU pool and tier."""
    if not split:
        return
    yield _gauge(f"dflash2_policy_{target}_blocks", f"{what}: {target_doc}.",
                 ["gpu", "tier"], [((g, t["tier"]), t[target]) for g, t in split])
    yield _gauge(f"dflash2_policy_{prefix}list_blocks", f"{what}: keyed blocks per tier and list.",
                 ["gpu", "tier", "list"], [((g, t["tier"], lst), t[lst]) for g, t in split for lst in lists])
    yield _counter(f"dflash2_policy_{prefix}ghost_hits",
                   f"{what}: keys asked for again soon after they left the tier, by the list they left.",
                   ["gpu", "tier", "list"],
                   [((g, t["tier"], lst), t["ghost_hits"][lst]) for g, t in split for lst in lists])
    yield _counter(f"dflash2_policy_{prefix}departures", f"{what}: keyed blocks that left the tier, by the list they left.",
                   ["gpu", "tier", "list"],
                   [((g, t["tier"], lst), t["departures"][lst]) for g, t in split for lst in lists])
    # NaN while unknown (as a summary's quantiles before any observation): the panel shows a gap.
    yield _gauge(f"dflash2_policy_{prefix}recent_return_ratio",
                 f"{what}: ghost hits per departure whose window closed, recent (decayed); NaN while "
                 "either list has too few such departures (decayed: it may go back to NaN).", ["gpu", "tier", "list"],
                 [((g, t["tier"], lst), math.nan if t["recent_return_rate"][lst] is None else t["recent_return_rate"][lst])
                  for g, t in split for lst in lists])
    yield _gauge(f"dflash2_policy_{prefix}ghosts_move_target",
                 f"{what}: 1 while the list's ghosts move the target, 0 while they are held (its recent "
                 "return ratio below the split's rate band times the other list's).", ["gpu", "tier", "list"],
                 [((g, t["tier"], lst), int(t["ghosts_move_target"][lst])) for g, t in split for lst in lists])


def _daemon_families(st: dict, device: str, age_s: float):
    d = st["daemon"]
    yield _gauge("dflash2_clients", "Clients attached.", samples=[((), len(st["clients"]))])
    yield _counter("dflash2_requests", "Control messages received.", samples=[((), d["requests"])])
    yield _counter("dflash2_request_errors", "Control messages answered with an error.", samples=[((), d["errors"])])
    yield _counter("dflash2_leases_expired", "Clients detached because their lease lapsed or their process was seen gone.",
                   samples=[((), d["leases_expired"])])
    yield _counter("dflash2_calls_parked", "Calls parked until copies in flight ended (an NVMe read, a drain's "
                   "writes), while the loop answered the others; each ran again, whole, once they had.",
                   samples=[((), d.get("calls_parked", 0))])
    aside = st.get("set_aside", {"clients": 0, "blocks": 0, "pinned": 0})
    yield _gauge("dflash2_set_aside_blocks", "Private blocks of lapsed clients whose process may still write them, "
                 "kept out of reuse until it is gone (or daemon.set_aside_leases leases).", samples=[((), aside["blocks"])])
    yield _gauge("dflash2_set_aside_pinned_blocks", "Blocks that lapsed clients whose process may still read them had "
                 "pinned, kept pinned (never moved) as long.", samples=[((), aside["pinned"])])
    yield _gauge("dflash2_snapshot_age_seconds", "Age of the daemon state this scrape saw.",
                 samples=[((), max(0.0, age_s))])
    policy = st.get("policy", {})
    name = policy.get("name", "") if isinstance(policy, dict) else str(policy)
    yield _gauge("dflash2_info", "The daemon: device kind, policy, protocol version.",
                 ["device", "policy", "version"], [((device, name, str(P.VERSION)), 1)])
