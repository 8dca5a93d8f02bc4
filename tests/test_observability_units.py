"""Metrics, logs and `dflash2 status` in-process, over a small real host manager."""

from __future__ import annotations

import io
import json
import logging
import math

import numpy as np
import pytest

from dflash2 import protocol as P
from dflash2.daemon.service import Service
from dflash2.logs import JsonFormatter, TextFormatter, configure, event
from dflash2.metrics import DaemonMetrics
from dflash2.tiers import Tier
from conftest import SMALL
from observe_helpers import call_ok, load, scrape, service  # noqa: F401  (a fixture)


def test_metrics_mirror_the_stats_and_observe_events(service):
    metrics = DaemonMetrics(service)
    metrics.attach()
    load(service)
    metrics.after_tick(late_s=0.002, seconds=0.0005)
    st = service.stats()
    got = scrape(metrics)
    assert all(name.startswith("dflash2_") for name, _ in got)
    for tier, t in st["tiers"].items():
        assert got[("dflash2_tier_used_bytes", (("tier", tier),))] == t["used_bytes"]
        assert got[("dflash2_tier_blocks", (("tier", tier),))] == t["blocks"]
    reads = st["reads"]
    assert reads["dram"] > 0
    assert got[("dflash2_cache_hits_total", (("tier", "hbm"),))] == reads["hbm"]
    assert got[("dflash2_cache_misses_total", (("tier", "hbm"),))] == reads["dram"]
    assert got[("dflash2_cache_misses_total", (("tier", "dram"),))] == 0
    assert got[("dflash2_hbm_hit_ratio", ())] == pytest.approx(st["hbm_hit_ratio"])
    hbm = st["tiers"]["hbm"]
    assert got[("dflash2_gpu_memory_utilization", (("gpu", "0"),))] == hbm["used_bytes"] / hbm["capacity_bytes"]
    moved = st["moves"]["hbm->dram"]
    assert got[("dflash2_swap_bytes_total", (("direction", "hbm->dram"),))] == moved["bytes"]
    assert got[("dflash2_swap_batches_total", (("direction", "hbm->dram"),))] == moved["batches"] > 0
    # (a metadata-only manager's moves have no copy to time)
    assert got[("dflash2_swap_seconds_count", (("direction", "hbm->dram"),))] == moved["timed_batches"] == 0
    assert got[("dflash2_request_latency_seconds_count", (("op", "attach"),))] == 1
    assert got[("dflash2_scheduler_latency_microseconds_sum", ())] == pytest.approx(2000)
    assert got[("dflash2_rescore_seconds_count", ())] == 1
    assert got[("dflash2_clients", ())] == 1


def test_the_heat_policys_split_and_admission_gate_are_metrics_per_gpu_pool(make_manager, clock):
    service = Service(make_manager(hbm_blocks=8, dram_blocks=16, policy="heat"), lease_timeout_s=10,
                      heartbeat_interval_s=1, clock=clock)
    metrics = DaemonMetrics(service)
    load(service)
    metrics.refresh(force=True)
    policy = service.stats()["policy"]
    assert policy["name"] == "heat"
    got = scrape(metrics)
    for t in policy["split"]:
        tier = ("tier", t["tier"])
        assert got[("dflash2_policy_first_timer_target_blocks", (("gpu", "0"), tier))] == t["first_timer_target"]
        for lst in ("first_timers", "returning"):
            assert got[("dflash2_policy_list_blocks", (("gpu", "0"), ("list", lst), tier))] == t[lst]
            assert got[("dflash2_policy_ghost_hits_total", (("gpu", "0"), ("list", lst), tier))] == t["ghost_hits"][lst]
            assert got[("dflash2_policy_departures_total", (("gpu", "0"), ("list", lst), tier))] == t["departures"][lst]
            assert got[("dflash2_policy_ghosts_move_target", (("gpu", "0"), ("list", lst), tier))] == 1
            # Too few departures have left their window for a rate: NaN (not a made-up 0).
            assert t["recent_return_rate"][lst] is None
            assert math.isnan(got[("dflash2_policy_recent_return_ratio", (("gpu", "0"), ("list", lst), tier))])
    assert {t["tier"] for t in policy["split"]} == {"hbm", "dram"}
    inner = policy["returning_split"]
    assert inner and sum(t["seen_2_3"] for t in inner) == 6, "the load reads every block again"
    for t in inner:
        tier = ("tier", t["tier"])
        assert got[("dflash2_policy_seen_2_3_target_blocks", (("gpu", "0"), tier))] == t["seen_2_3_target"]
        for lst in ("seen_2_3", "seen_4_plus"):
            assert got[("dflash2_policy_returning_list_blocks", (("gpu", "0"), ("list", lst), tier))] == t[lst]
            assert got[("dflash2_policy_returning_ghost_hits_total", (("gpu", "0"), ("list", lst), tier))] \
                == t["ghost_hits"][lst]
            assert got[("dflash2_policy_returning_departures_total", (("gpu", "0"), ("list", lst), tier))] \
                == t["departures"][lst]
    gate = policy["admission"]
    assert got[("dflash2_policy_admission_rule_on", (("gpu", "0"),))] == int(gate["rule_on"])
    assert got[("dflash2_policy_admission_blocks_total", (("gpu", "0"), ("outcome", "refused")))] == gate["refused"]
    # A node of two GPU pools: each pool's policy under its own label, not the first pool's twice.
    one = json.loads(json.dumps(service.stats()))
    other = json.loads(json.dumps(one))
    other["policy"]["admission"].update(rule_on=False, refused=7, refused_return_rate=0.5, departed_return_rate=0.1)
    other["policy"]["split"][0].update(recent_return_rate={"first_timers": 0.05, "returning": 0.4},
                                       ghosts_move_target={"first_timers": False, "returning": True})
    metrics.snapshot["devices"] = {"0": one, "1": other}
    got = scrape(metrics)
    hbm1 = (("gpu", "1"), ("list", "first_timers"), ("tier", "hbm"))
    assert got[("dflash2_policy_recent_return_ratio", hbm1)] == 0.05
    assert got[("dflash2_policy_ghosts_move_target", hbm1)] == 0
    assert got[("dflash2_policy_admission_rule_on", (("gpu", "1"),))] == 0
    assert got[("dflash2_policy_admission_blocks_total", (("gpu", "1"), ("outcome", "refused")))] == 7
    assert got[("dflash2_policy_admission_return_ratio", (("gpu", "1"), ("kind", "departed")))] == 0.1
    assert ("dflash2_policy_admission_return_ratio", (("gpu", "0"), ("kind", "refused"))) not in got  # none yet


def test_policies_without_a_split_have_no_policy_families(service):
    assert service.stats()["policy"]["name"] == "lru"
    metrics = DaemonMetrics(service)
    load(service)
    metrics.refresh(force=True)
    assert not [k for k in scrape(metrics) if k[0].startswith("dflash2_policy_")]


def test_gpu_copy_mechanisms_are_counted_only_where_there_are_several(service):
    """A host pool moves one way (no family); a GPU pool's stats name each direction's batches by
    mechanism (tests/test_gpu_nodes.py checks them on a GPU), summed over the node's pools."""
    from dflash2.daemon.poolstats import sum_stats
    metrics = DaemonMetrics(service)
    load(service)
    metrics.refresh(force=True)
    assert service.stats()["copy_batches"] == {}
    assert not [k for k in scrape(metrics) if k[0].startswith("dflash2_copy_batches")]
    gpu0 = {"hbm->dram": {"kernel": 3, "engines": 2}, "dram->hbm": {"engines": 4}}
    gpu1 = {"hbm->dram": {"kernel": 1}}
    metrics.snapshot["copy_batches"] = sum_stats([{"copy_batches": gpu0}, {"copy_batches": gpu1}])["copy_batches"]
    got = scrape(metrics)
    assert got[("dflash2_copy_batches_total", (("direction", "hbm->dram"), ("mechanism", "kernel")))] == 4
    assert got[("dflash2_copy_batches_total", (("direction", "hbm->dram"), ("mechanism", "engines")))] == 2
    assert got[("dflash2_copy_batches_total", (("direction", "dram->hbm"), ("mechanism", "engines")))] == 4


def test_the_scrape_reads_the_snapshot_not_the_manager(service):
    metrics = DaemonMetrics(service, snapshot_interval_s=3600)
    metrics.refresh(force=True)
    load(service)  # changes after the snapshot are not seen until the owner refreshes it
    assert scrape(metrics)[("dflash2_tier_blocks", (("tier", "hbm"),))] == 0
    metrics.refresh(force=True)
    assert scrape(metrics)[("dflash2_tier_blocks", (("tier", "hbm"),))] > 0


def test_hit_ratio_is_nan_before_any_read(service):
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    assert math.isnan(scrape(metrics)[("dflash2_hbm_hit_ratio", ())])


def _record(msg, **extra):
    rec = logging.LogRecord("dflash2.swap", logging.INFO, __file__, 1, msg, None, None)
    rec.__dict__.update(extra)
    return rec


def test_json_log_lines_carry_the_event_and_its_fields():
    line = JsonFormatter().format(_record("dflash2_swap", event="dflash2_swap", direction="hbm->dram",
                                          blocks=4, bytes=65536, seconds=0.001))
    d = json.loads(line)
    assert d["event"] == "dflash2_swap" and d["direction"] == "hbm->dram" and d["blocks"] == 4
    assert d["level"] == "info" and d["logger"] == "dflash2.swap" and d["ts"].endswith("Z")
    assert json.loads(JsonFormatter().format(_record("plain")))["event"] == "log"


def test_json_log_lines_stay_strict_json_whatever_their_fields():
    # A review: a NaN field was written NaN (jq and other strict parsers refuse the line), a key
    # that is not a string raised inside logging, and a field named `ts` or `logger` replaced the record's.
    line = JsonFormatter().format(_record("hit ratio", ratio=float("nan"), rates={"hbm": float("inf"), 3: 1.0, None: 0},
                                          ts="spoofed", logger="spoofed", ok=0.5))
    d = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c} in {line}"))
    assert d["ratio"] == "nan" and d["rates"] == {"hbm": "inf", "3": 1.0, "null": 0} and d["ok"] == 0.5
    assert d["msg"] == "hit ratio" and d["ts"].endswith("Z") and d["field_ts"] == d["field_logger"] == "spoofed"
    assert d["logger"] == "dflash2.swap"


def test_text_log_lines_put_fields_after_the_message():
    line = TextFormatter().format(_record("dflash2_swap", event="dflash2_swap", blocks=4))
    assert line.endswith("dflash2.swap: dflash2_swap blocks=4")


def test_configure_routes_events_to_one_handler():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure("json", "info", stream)
        event(logging.getLogger("dflash2.daemon"), "dflash2_start", endpoint="ipc://x")
        logging.getLogger("dflash2.daemon").debug("hidden")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert lines == [{**lines[0], "event": "dflash2_start", "endpoint": "ipc://x"}] and len(lines) == 1


def test_node_totals_add_counts_but_not_settings_or_per_link_bandwidth(make_manager):
    from dflash2.daemon.service import Service
    from dflash2.policy.heat import HeatPolicy
    from dflash2.tiers import Tier
    pools = {0: make_manager(policy=HeatPolicy({"recency": 2.0}), prefetch_window=4),
             1: make_manager(policy=HeatPolicy({"recency": 2.0}), prefetch_window=4)}
    pools[1].prefetcher.window = 16  # grown on one GPU only
    for m in pools.values():
        m.access.reads[Tier.HBM] += 3
    st = Service(pools, lease_timeout_s=10.0, heartbeat_interval_s=2.0).stats()
    assert st["reads"]["hbm"] == 6
    assert st["policy"]["weights"]["recency"] == 2.0, "a weight is a setting, not a count"
    assert st["prefetch"]["window"] == 4
    assert "read_cost" not in st and "read_cost" in st["devices"]["1"], "bandwidth is per GPU link"


def test_status_shows_the_heat_policys_split_and_gate_per_gpu_pool(make_manager, clock):
    from dflash2.status import render
    service = Service(make_manager(hbm_blocks=8, dram_blocks=16, policy="heat"), lease_timeout_s=10,
                      heartbeat_interval_s=1, clock=clock)
    load(service)
    st = json.loads(json.dumps(service.stats()))
    hbm = st["policy"]["split"][0]
    view = render(st)
    left, hits = hbm["departures"], hbm["ghost_hits"]
    # The load pushes first-timers out of HBM and no returning block: a rate only where blocks left.
    assert left["first_timers"] and not left["returning"]
    assert (f"heat split: hbm first-timers {hbm['first_timers']} (target {hbm['first_timer_target']:.0f}), "
            f"returning {hbm['returning']} (back soon after leaving: "
            f"first-timers {hits['first_timers'] / left['first_timers']:.3f}); dram ") in view
    inner = st["policy"]["returning_split"][0]
    assert (f"returning blocks' split: {inner['tier']} seen 2-3 times {inner['seen_2_3']} "
            f"(target {inner['seen_2_3_target']:.0f}), seen 4+ times {inner['seen_4_plus']}") in view
    assert "last-tier admission: rule on; refused 0, admitted against the rule 0" in view
    other = json.loads(json.dumps(st))
    other["policy"]["admission"].update(rule_on=False, refused=7, refused_return_rate=0.5, departed_return_rate=0.1)
    st["devices"] = {"0": json.loads(json.dumps(st)), "1": other}
    view = render(st)
    assert "heat split (GPU 0): hbm" in view and "heat split (GPU 1): hbm" in view
    assert ("last-tier admission (GPU 1): rule off (gate); refused 7, admitted against the rule 0; "
            "asked for again: refused 0.500, departed 0.100") in view
    # Once both lists' recent rates are known, they show, with the lists whose ghosts are held.
    other["policy"]["split"][0].update(departures={"first_timers": 100, "returning": 10},
                                       ghost_hits={"first_timers": 5, "returning": 4},
                                       recent_return_rate={"first_timers": 0.05, "returning": 0.4},
                                       ghosts_move_target={"first_timers": False, "returning": True})
    assert ("(back soon after leaving: first-timers 0.050, returning 0.400, lately first-timers 0.050, "
            "returning 0.400, ghosts not moving the target: first-timers)") in render(st)
    assert "heat split" not in render({**st, "devices": None, "policy": {"name": "lru"}})


def test_metrics_and_status_show_the_duel_per_gpu_pool():
    from test_duel import chat
    from dflash2.bench.policy import ALIGN, LAYOUT, SLOT
    from dflash2.duel import Duel
    from dflash2.manager import BlockManager, TierSpec
    from dflash2.prefetch import Prefetcher
    from dflash2.replay import Tally, serve
    from dflash2.status import render
    from dflash2.tiers import Tier

    mgr = BlockManager([TierSpec(Tier.HBM, 256 * SLOT, SLOT, ALIGN)], policy="heat", clock=lambda: 0.0)
    duel = Duel(mgr, 2)
    lid = mgr.register_layout(LAYOUT)
    service = Service(mgr, lease_timeout_s=10, heartbeat_interval_s=1)
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    got = scrape(metrics)
    assert got[("dflash2_policy_duel_on", (("gpu", "0"),))] == 1
    assert math.isnan(got[("dflash2_policy_duel_hit_ratio", (("gpu", "0"), ("policy", "lru")))])  # none yet
    assert got[("dflash2_policy_ranking", (("gpu", "0"), ("policy", "heat")))] == 1
    assert "duel: heat ranks as heat (warming up, 0% turned over, 0 switches); miniatures of 1 in 2 keys found none yet" \
        in render(json.loads(json.dumps(service.stats())))
    assert got[("dflash2_policy_duel_turned_over", (("gpu", "0"),))] == 0
    client = mgr.attach("c")
    for i, req in enumerate(chat(300)):  # the chat shape served through the real manager
        serve(mgr, Prefetcher(mgr, 0), client, lid, req, i, Tally(), 16)
    duel.run()
    mgr.policy.follow("lfu")  # as if the duel had chosen it, to see the gauge move
    metrics.refresh(force=True)
    got = scrape(metrics)
    d = duel.describe()
    for c in ("heat", "lru", "lfu"):
        assert got[("dflash2_policy_duel_hit_ratio", (("gpu", "0"), ("policy", c)))] == pytest.approx(d["hit_rate"][c])
        assert got[("dflash2_policy_duel_hbm_hit_ratio", (("gpu", "0"), ("policy", c)))] == pytest.approx(d["hbm_hit_rate"][c])
    assert got[("dflash2_policy_duel_requests_total", (("gpu", "0"),))] == d["requests"] > 0
    assert got[("dflash2_policy_ranking", (("gpu", "0"), ("policy", "lfu")))] == 1
    assert got[("dflash2_policy_ranking", (("gpu", "0"), ("policy", "heat")))] == 0
    st = json.loads(json.dumps(service.stats()))
    rates = ", ".join(f"{c} {d['hit_rate'][c]:.3f}" for c in ("heat", "lru", "lfu"))
    switches = "1 switch" if d["switches"] == 1 else f"{d['switches']} switches"
    state = d["state"] if d["state"] == "judging" else f"warming up, {100 * d['turned_over']:.0f}% turned over"
    assert f"duel: heat ranks as lfu ({state}, {switches}); miniatures of 1 in 2 keys found {rates}" \
        in render(st)
    assert got[("dflash2_policy_duel_turned_over", (("gpu", "0"),))] == d["turned_over"] > 0
    assert got[("dflash2_policy_duel_sample", (("gpu", "0"),))] == 2
    coarse = json.loads(json.dumps(st))  # the loop fell behind: the duel replays fewer keys (duel.py _coarsen)
    coarse["duel"].update(sample=16, coarsened=1)
    assert "miniatures of 1 in 16 keys (coarser than the configured 1 in 2: the loop fell behind) found" in render(coarse)
    fine = json.loads(json.dumps(st))  # HBM too small for the configured sample (duel.py _fit_sample)
    fine["duel"].update(sample=3, first_sample=8)
    assert "miniatures of 1 in 3 keys (finer than the configured 1 in 8: HBM is small) found" in render(fine)
    metrics.snapshot = coarse
    assert scrape(metrics)[("dflash2_policy_duel_sample", (("gpu", "0"),))] == 16
    # Every family a heat daemon with its duel exports is in metrics.py's table and the README (a
    # review: dflash2_policy_duel_not_replayed_total was missing from the table).
    import re
    from pathlib import Path
    import dflash2.metrics as metrics_module
    def named(text: str) -> set[str]:  # the metric names a text gives, `a_{b,c}_total` as two
        out = set()
        for head, alts, tail in re.findall(r"(dflash2_[a-z0-9_]*)(?:\{([a-z0-9_]+(?:,[a-z0-9_]+)+)\}(_[a-z0-9_]*))?", text):
            out |= {re.sub(r"_total$", "", head + alt + tail) for alt in (alts.split(",") if alts else [""])}
        return out

    families = {re.sub(r"(_total|_bucket|_count|_sum|_created)$", "", name) for name, _ in scrape(metrics)}
    assert len(families) > 40
    assert families <= named(metrics_module.__doc__), f"not in metrics.py's table: {families - named(metrics_module.__doc__)}"
    readme = named((Path(__file__).parent.parent / "README.md").read_text())
    assert families <= readme, f"not in README.md: {families - readme}"
    # A node of two GPU pools: each pool's duel under its own label; the node's totals hold none.
    other = json.loads(json.dumps(st))
    other["duel"].update(state="off", off_reason="a miniature replay failed (see the log)")
    st["devices"] = {"0": json.loads(json.dumps(st)), "1": other}
    assert "duel (GPU 1): off (a miniature replay failed (see the log)); heat ranks as lfu" in render(st)
    metrics.snapshot = st
    got = scrape(metrics)
    assert got[("dflash2_policy_duel_on", (("gpu", "1"),))] == 0 and got[("dflash2_policy_duel_on", (("gpu", "0"),))] == 1



def test_gpu_memory_utilization_is_per_gpu_pool(make_manager, clock):
    service = Service({0: make_manager(hbm_blocks=8), 1: make_manager(hbm_blocks=8)}, lease_timeout_s=10,
                      heartbeat_interval_s=1, clock=clock)
    m0 = service.managers[0]
    c = m0.attach("full")
    m0.register_layout(SMALL)
    assert m0.allocate(c, 0, 8) is not None  # GPU 0 full, GPU 1 empty
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    got = scrape(metrics)
    assert got[("dflash2_gpu_memory_utilization", (("gpu", "0"),))] == 1.0
    assert got[("dflash2_gpu_memory_utilization", (("gpu", "1"),))] == 0.0
    assert got[("dflash2_tier_used_bytes", (("tier", "hbm"),))] == 8 * SMALL.block_bytes  # the node's total


def test_reservations_that_end_with_their_client_are_counted(service):
    m = service.manager
    c = m.attach("leaving")
    m.register_layout(SMALL)
    assert m.reserve(c, 0, tokens=32).outcome.value == "granted"
    m.detach(c)
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    got = scrape(metrics)
    assert got[("dflash2_reservations_total", (("outcome", "granted"),))] == 1
    assert got[("dflash2_reservations_total", (("outcome", "released"),))] == 1


def test_blocks_set_aside_for_a_lapsed_client_are_a_gauge(service):
    m = service.manager
    c = m.attach("stalled")
    m.register_layout(SMALL)
    m.allocate(c, 0, 3)
    w = m.attach("writer")
    published = m.commit(w, m.allocate(w, 0, 2), keys=[71, 72])
    m.free(w, published)
    assert m.acquire(c, published) is not None  # pinned by the client about to lapse
    m.detach(c, set_aside=True)
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    assert scrape(metrics)[("dflash2_set_aside_blocks", ())] == 3
    assert scrape(metrics)[("dflash2_set_aside_pinned_blocks", ())] == 2
    from dflash2.status import render
    assert ("set aside: 3 private blocks of 1 lapsed client(s) whose process may still write them, and 2 blocks "
            "they had pinned, kept pinned") in render(service.stats())
    m.detach(c)
    metrics.refresh(force=True)
    assert scrape(metrics)[("dflash2_set_aside_blocks", ())] == 0
    assert scrape(metrics)[("dflash2_set_aside_pinned_blocks", ())] == 0
    m.check_invariants()


def test_the_hbm_hit_rate_is_logged_once_a_minute_and_warned_about_below_095(service, clock, caplog):
    """DESIGN: the HBM hit rate "is exported and logged"; it was exported only. A line a minute over
    that minute, when blocks were read: a warning below 0.95 (HBM under pressure), else info."""
    from dflash2.daemon.hitlog import HIT_LOG_INTERVAL_S, HitRateLog

    hits = HitRateLog(service, clock=clock)
    caplog.set_level(logging.INFO, logger="dflash2.daemon")
    clock.advance(HIT_LOG_INTERVAL_S)
    hits.sample()
    assert not [r for r in caplog.records if "hit rate" in r.getMessage()], "nothing read: nothing said"
    c = load(service)  # six blocks acquired for HBM, four of them read from DRAM
    clock.advance(HIT_LOG_INTERVAL_S / 2)
    hits.sample()
    assert not [r for r in caplog.records if "hit rate" in r.getMessage()], "not before a minute"
    clock.advance(HIT_LOG_INTERVAL_S / 2)
    hits.sample()
    said = [r for r in caplog.records if "hit rate" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert said[0].getMessage() == ("HBM hit rate 0.333 over the last 60 s (6 block reads, dram 66.7%): below 0.95, "
                                    "HBM is under pressure")
    assert said[0].hbm_hit_ratio == 0.3333 and said[0].event == "dflash2_hbm_hit_rate"
    m = service.manager
    found = [p.vid for p in m.lookup(list(range(1, 7)), 0)]
    m.release(c, found)
    assert m.acquire(c, found) is not None  # all six in HBM now
    clock.advance(HIT_LOG_INTERVAL_S)
    hits.sample()
    said = [r for r in caplog.records if "hit rate" in r.getMessage()][1:]
    assert [(r.levelno, r.getMessage()) for r in said] == [(logging.INFO, "HBM hit rate 1.000 over the last 60 s "
                                                                           "(6 block reads)")]


def test_prefetches_are_counted_in_metrics_and_status_with_those_not_read_yet(make_manager, clock):
    """The prefetch's useful and wasted blocks were in the stats reply alone: now metrics and
    `dflash2 status` show them per GPU pool, with the window, and those prefetched but not read
    yet (pending: neither useful nor wasted until read or gone)."""
    from dflash2.status import render

    mgr = make_manager(hbm_blocks=16, dram_blocks=16, prefetch_window=2)
    svc = Service(mgr, lease_timeout_s=10, heartbeat_interval_s=1, clock=clock)
    c = call_ok(svc, P.Op.ATTACH, args={"name": "t", "pid": 0, "layouts": [SMALL.to_dict()]}).result["client"]
    keys = list(range(1, 9))
    vids = mgr.allocate(c, 0, 8, tier=Tier.DRAM)  # a chain in DRAM: a lookup's prefetch brings it up
    mgr.free(c, mgr.commit(c, vids, keys))
    found = mgr.lookup_rows(keys, 0, client=c)
    assert len(found) == 8 and mgr.prefetcher.pending >= 2  # the first window came up (doubled: HBM is empty)
    assert mgr.acquire(c, mgr.table.vids(found[:1])) is not None  # one of the two read
    metrics = DaemonMetrics(svc)
    metrics.attach()
    metrics.refresh(force=True)
    got = scrape(metrics)
    pre = svc.stats()["prefetch"]
    assert pre["useful"] >= 1 and pre["pending"] >= 1, pre
    for result in ("useful", "wasted"):
        assert got[("dflash2_prefetch_blocks_total", (("gpu", "0"), ("result", result)))] == pre[result]
    assert got[("dflash2_prefetch_pending_blocks", (("gpu", "0"),))] == pre["pending"]
    assert got[("dflash2_prefetch_window_blocks", (("gpu", "0"),))] == pre["window"] > 0
    st = svc.stats()
    assert (f"prefetch: window {pre['window']} blocks; useful {pre['useful']}, wasted {pre['wasted']}, "
            f"pending {pre['pending']}") in render(st)


def test_nvme_fullness_and_slots_set_aside_are_per_gpu_pool(make_manager, clock):
    """Each GPU's pool has its own NVMe file, judged on its own by the daemon: past 5% set aside it is
    failing. In the node's sums one such pool of two read as under 5%, and of eight as 0.75%: the
    alert on it never fired (a review's script, 2026-12-05)."""
    service = Service({0: make_manager(hbm_blocks=8, nvme_blocks=32), 1: make_manager(hbm_blocks=8, nvme_blocks=32)},
                      lease_timeout_s=10, heartbeat_interval_s=1, clock=clock)
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    pool = metrics.snapshot["devices"]["1"]["tiers"]["nvme"]
    whole = pool["capacity_bytes"]
    aside = whole // 16  # 6.25%: that pool's disk is failing
    pool.update(capacity_bytes=whole - aside, quarantined_bytes=aside, used_bytes=(whole - aside) // 2,
                full_bytes=(whole - aside) // 2)
    node = metrics.snapshot["tiers"]["nvme"]
    node.update(capacity_bytes=node["capacity_bytes"] - aside, quarantined_bytes=aside)
    got = scrape(metrics)
    assert got[("dflash2_gpu_nvme_set_aside_ratio", (("gpu", "1"),))] == pytest.approx(1 / 16)
    assert got[("dflash2_gpu_nvme_set_aside_ratio", (("gpu", "0"),))] == 0.0
    assert got[("dflash2_gpu_nvme_utilization", (("gpu", "1"),))] == pytest.approx(0.5)
    assert got[("dflash2_gpu_nvme_utilization", (("gpu", "0"),))] == 0.0
    summed = got[("dflash2_tier_quarantined_bytes", (("tier", "nvme"),))] / (
        got[("dflash2_tier_capacity_bytes", (("tier", "nvme"),))] + got[("dflash2_tier_quarantined_bytes", (("tier", "nvme"),))])
    assert summed < 0.05  # what the alert read before


def test_refused_allocates_and_acquires_are_counted_logged_and_told_why(service, caplog):
    """HBM full of blocks being written: another client's allocate and its acquire of a chain lying in
    DRAM are answered "no room now". Before, the operator saw nothing (no counter, no log line, a
    quiet `dflash2 status`), and an acquire's reason never said what held the room (a review)."""
    from dflash2.status import render
    m = service.manager
    attach = lambda name: call_ok(service, P.Op.ATTACH, args={"name": name, "pid": 0, "layouts": [SMALL.to_dict()]})
    w, r = attach("writer").result["client"], attach("reader").result["client"]
    chain = m.commit(r, m.allocate(r, 0, 2), [1, 2])
    m.free(r, chain)
    m.allocate(w, 0, 8)  # HBM (8 blocks) full of blocks being written; the chain goes down to DRAM
    assert {m.place(int(v)).tier for v in chain} == {Tier.DRAM}
    with caplog.at_level(logging.INFO, logger="dflash2.refusals"):
        for _ in range(3):
            assert m.allocate(r, 0, 1) is None
            assert m.acquire(r, chain, priority=0) is None
    assert m.acquire_refusal == ("HBM could not be given room for them now: it is full of blocks that cannot move now "
                                 "(being written or pinned, or used by requests of priority above 0), so nothing was "
                                 "moved; retry once they are released or freed, or acquire without a priority, or "
                                 "recompute them")
    reply = service.handle(P.decode_request(P.encode_request(P.Op.ACQUIRE, 9, r, {}, [np.asarray(chain, dtype=np.uint64)],
                                                             token=service.sessions[r].token)))
    assert reply.result == {"acquired": False, "reason": m.acquire_refusal.replace(
        ", or used by requests of priority above 0", "").replace(", or acquire without a priority", "")}
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "dflash2.refusals"]
    assert len(lines) == 2, lines  # once a minute per call and cause
    assert lines[0].startswith("allocate refused (tier_full): HBM is full of blocks that cannot move now")
    st = service.stats()
    assert st["refused"] == {"allocate": {"tier_full": 3, "reservations_ahead": 0},
                             "acquire": {"tier_full": 4, "copy_failed": 0}}
    metrics = DaemonMetrics(service)
    metrics.refresh(force=True)
    got = scrape(metrics)
    assert got[("dflash2_refused_calls_total", (("cause", "tier_full"), ("op", "acquire")))] == 4
    assert got[("dflash2_refused_calls_total", (("cause", "tier_full"), ("op", "allocate")))] == 3
    assert "refused (no room now): allocate 3, acquire 4" in render({**st, "endpoint": "x"})
    # An acquire whose copy up failed is no want of room: its own line, not summed under "no room now"
    # (a review).
    st["refused"]["acquire"]["copy_failed"] = 2
    shown = render({**st, "endpoint": "x"})
    assert "refused (no room now): allocate 3, acquire 4" in shown
    assert "refused (their copy up failed): acquire 2" in shown


@pytest.mark.parametrize("failing_first", [True, False])
def test_a_node_whose_one_gpu_lost_its_nvme_file_says_so(service, failing_first):
    """Several GPUs' pools: a pool whose NVMe file is gone (its stats carry `no_file`; a healthy
    pool's carry none) makes the node's dflash2_tier_no_file{tier="nvme"} 1, whichever GPU it is (a
    review read the first pool's alone: a test that set a healthy pool's to None)."""
    from dflash2.daemon.poolstats import sum_stats

    metrics = DaemonMetrics(service)
    load(service)
    metrics.refresh(force=True)
    one = service.manager.stats()
    assert "no_file" not in one["tiers"]["dram"]  # (a healthy tier names none)
    gone = {**one, "tiers": {**one["tiers"], "dram": {**one["tiers"]["dram"], "no_file": "its file was removed"}}}
    parts = [gone, one] if failing_first else [one, gone]
    metrics.snapshot["tiers"] = sum_stats(parts)["tiers"]
    assert scrape(metrics)[("dflash2_tier_no_file", (("tier", "dram"),))] == 1


def test_the_metrics_address_logged_is_a_url_for_an_ipv6_host(service, caplog):
    """`http://::1:P/metrics` was logged, which no browser or scraper takes (a review)."""
    import socket

    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 on this machine")
    metrics = DaemonMetrics(service)
    with caplog.at_level(logging.INFO, logger="dflash2"):
        try:
            metrics.serve("::1", 0)
        except OSError as e:
            pytest.skip(f"::1 cannot be bound here: {e}")
        try:
            assert f"metrics on http://[::1]:{metrics.port}/metrics" in caplog.text, caplog.text
        finally:
            metrics.close()
