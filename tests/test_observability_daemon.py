"""The real dflash2d under a small load: its history reads back what happened, its JSON logs carry
the start-up, swap and shutdown events, and a real Prometheus scraping it answers every PromQL
expression of the Grafana dashboard and of the alert rules."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from observe_helpers import RawClient, fill_then_reuse, free_port, running_daemon

from dflash2 import cli
from dflash2 import protocol as P
from dflash2.history import decode, rates, read_file
from dflash2.history_cli import fetch

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
pytestmark = pytest.mark.slow


def _endpoint(tmp_path) -> str:
    return f"ipc://{tmp_path}/d.sock"


def _wait_for_sample(client: RawClient, after: float, timeout_s: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = client.call(P.Op.HISTORY)
        samples = decode(reply.arrays[0])
        if samples and samples[-1]["t"] > after:
            return samples
        time.sleep(0.1)
    raise AssertionError(f"no history sample after t={after}")


def test_history_reads_back_what_happened_and_logs_are_structured(tmp_path, config_file, capsys):
    cfg = config_file(history_enabled=True, daemon={"endpoint": _endpoint(tmp_path), "state_dir": str(tmp_path / "state")},
                      logging={"format": "json", "level": "info"})
    log_path = tmp_path / "daemon.log"
    with running_daemon(cfg, str(log_path)):
        c = RawClient(_endpoint(tmp_path))
        c.attach()
        # Phase 1: 128 blocks written and cached in HBM, nothing read yet.
        vids = c.allocate(128)
        c.commit(vids, list(range(1000, 1128)))
        phase1 = _wait_for_sample(c, time.time())
        # Phase 2: the fill-and-reuse load (demotions to DRAM, promotions back).
        fill_then_reuse(c)
        truth = c.stats()
        samples = _wait_for_sample(c, time.time())
        reply = c.call(P.Op.HISTORY, {"since_s": 3600})
        assert reply.result == {"enabled": True, "interval_s": 1.0, "count": len(decode(reply.arrays[0]))}
        over_cli = fetch(_endpoint(tmp_path), since_s=None)
        capsys.readouterr()
        assert cli.main(["status", "--watch", "--count", "2", "--interval", "0.2", "--endpoint", _endpoint(tmp_path)]) == 0
        watched = capsys.readouterr().out
        assert watched.count("since last frame") == 2 and "(first frame)" in watched and "requests/s" in watched
        c.close()

    seen1 = phase1[-1]
    assert seen1["tiers"]["hbm"]["blocks"] == 128 and seen1["tiers"]["hbm"]["used_bytes"] == 128 * 16384
    assert seen1["reads"] == {} and seen1["swaps"] == {} and seen1["clients"] == 1
    last = samples[-1]
    for tier, s in truth["tiers"].items():
        assert last["tiers"][tier] == {k: s[k] for k in ("used_bytes", "capacity_bytes", "full_bytes", "blocks")}
    assert last["reads"] == truth["reads"] and last["reads"].get("dram", 0) > 0
    assert last["hbm_hit_ratio"] == pytest.approx(truth["hbm_hit_ratio"]) and last["hbm_hit_ratio"] < 1
    assert {d: m["bytes"] for d, m in last["swaps"].items()} == {d: m["bytes"] for d, m in truth["moves"].items()}
    assert last["swaps"]["hbm->dram"]["blocks"] > 0 and last["swaps"]["dram->hbm"]["blocks"] > 0
    # Per-interval rates add up to the totals: every byte moved shows up in exactly one interval.
    moved = sum(r["swap_bps"].get("dram->hbm", 0) * r["dt"] for r in rates(samples))
    assert moved == pytest.approx(truth["moves"]["dram->hbm"]["bytes"])
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert over_cli[: len(samples)] == samples[: len(over_cli)]

    # The file under the state folder holds the same series, plus the last sample taken at shutdown.
    on_disk = read_file(tmp_path / "state" / "history.jsonl")
    assert on_disk[: len(samples)] == samples and on_disk[-1]["clients"] == 0

    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("dflash2_start") == 1 and kinds.count("dflash2_shutdown") == 1
    assert kinds.index("dflash2_start") < kinds.index("dflash2_swap") < kinds.index("dflash2_shutdown")
    swaps = [e for e in events if e["event"] == "dflash2_swap"]
    assert sum(e["blocks"] for e in swaps) == sum(m["blocks"] for m in truth["moves"].values())
    assert sum(e["failed"] for e in swaps) == sum(m["failed_blocks"] for m in truth["moves"].values())
    assert sum(e["bytes"] for e in swaps) == sum(m["bytes"] for m in truth["moves"].values())
    assert all({"ts", "level", "logger", "direction", "batches", "seconds", "over_s"} <= set(e) for e in swaps)
    # Every batch in one line (the last ones said before the shutdown line: dflash2/swaplog.py).
    assert sum(e["batches"] for e in swaps) == sum(m["batches"] for m in truth["moves"].values())
    assert max(i for i, k in enumerate(kinds) if k == "dflash2_swap") < kinds.index("dflash2_shutdown")


# -- Prometheus -------------------------------------------------------------------------------------
COMPARISON = re.compile(r"^(?P<measure>.*\S)\s*(==|!=|>=|<=|>|<)\s*[-+0-9.eE]+\s*$", re.S)


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "dflash2_dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "dflash2_alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Prometheus sees them once the dashboard picks 'All' nodes."""
    return expr.replace("$__rate_interval", "1m").replace('"$instance"', '".*"')


class PromAPI:
    def __init__(self, base: str):
        self.base = base

    def get(self, path: str, **params) -> dict:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}" if params else f"{self.base}{path}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait_for(self, expr: str, ok, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting on {expr}: {result}")
            time.sleep(0.25)


@pytest.fixture
def prometheus(tmp_path, prometheus_binary):
    """Start Prometheus with deploy/'s scrape config and rules, scraping `target`; yields a starter."""
    procs = []

    def start(target: str | None) -> PromAPI:
        """None: the job has no target at all (service discovery lists no daemon)."""
        scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        scrape["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        job = scrape["scrape_configs"][0]
        job.update(scrape_interval="1s", scrape_timeout="900ms",
                   static_configs=[{"targets": [] if target is None else [target]}])
        scrape["rule_files"] = [str(DEPLOY / "prometheus" / "dflash2_alerts.yml")]
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen([prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
        api = PromAPI(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{api.base}/-/ready", timeout=2).read()
                return api
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.2)

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# Exported only by GPU pools (tests/test_gpu_nodes.py checks their figures on a GPU).
GPU_ONLY_METRICS = ("dflash2_copy_batches_total",)


def test_prometheus_answers_every_dashboard_and_alert_expression(tmp_path, config_file, prometheus):
    port = free_port()
    # The heat policy (the shipped config's), so that its split and admission panels answer too.
    cfg = config_file(metrics={"port": port, "host": "127.0.0.1"}, daemon={"endpoint": _endpoint(tmp_path)},
                      logging={"format": "json", "level": "warning"}, policy={"name": "heat"})
    with running_daemon(cfg, str(tmp_path / "daemon.log")):
        api = prometheus(f"127.0.0.1:{port}")
        api.wait_for('count_over_time(up{job="dflash2"}[1m])', lambda r: r and float(r[0]["value"][1]) >= 2)
        c = RawClient(_endpoint(tmp_path))
        c.attach()
        fill_then_reuse(c)
        granted = c.call(P.Op.RESERVE, {"layout": c.layout, "tokens": 64})
        assert granted.result["outcome"] == "granted"
        truth = c.stats()
        # Wait until a scrape after the load is stored, plus a couple more for rate() windows.
        api.wait_for('dflash2_swap_bytes_total{direction="dram->hbm"}',
                     lambda r: r and float(r[0]["value"][1]) == truth["moves"]["dram->hbm"]["bytes"])
        time.sleep(2.5)

        assert float(api.query('up{job="dflash2"}')[0]["value"][1]) == 1
        empty, gpu_only_answered = [], []
        for expr in dashboard_exprs():
            answer = api.query(grafana_to_promql(expr))
            if any(name in expr for name in GPU_ONLY_METRICS):
                if answer:  # a host daemon has one way to copy: its panel stays empty
                    gpu_only_answered.append(expr)
            elif not answer:
                empty.append(expr)
        assert not gpu_only_answered, gpu_only_answered
        assert [e for e in dashboard_exprs() if any(n in e for n in GPU_ONLY_METRICS)], "the GPU panel is there"
        for rule in alert_rules():
            m = COMPARISON.match(rule["expr"].strip())
            assert m, f"alert {rule['alert']}: expression is not MEASURE OP THRESHOLD: {rule['expr']}"
            got = api.query(m.group("measure"))
            if m.group("measure").startswith("absent("):
                assert not got, f"{rule['alert']} holds while the daemon is scraped: {got}"
            elif not got:
                empty.append(f"{rule['alert']}: {m.group('measure')}")
        assert not empty, "expressions that returned no data:\n" + "\n".join(empty)

        # Blocks per batch: the moves' blocks over their batches, as the daemon counted them.
        per_batch = next(e for e in dashboard_exprs() if "dflash2_swap_batches_total" in e)
        got = {r["metric"]["direction"]: float(r["value"][1]) for r in api.query(grafana_to_promql(per_batch))}
        move = truth["moves"]["dram->hbm"]
        assert got["dram->hbm"] == pytest.approx(move["blocks"] / move["batches"]), got

        # The figures agree with the daemon, and the hit-ratio alert condition holds (75% < 95%).
        used = api.query('dflash2_tier_used_bytes{tier="hbm"}')
        assert float(used[0]["value"][1]) == truth["tiers"]["hbm"]["used_bytes"]
        ratio = api.query('dflash2_hbm_hit_ratio')
        assert float(ratio[0]["value"][1]) == pytest.approx(truth["hbm_hit_ratio"])
        hit_alert = next(r for r in alert_rules() if r["alert"] == "DFlash2HbmHitRatioLow")
        assert api.query(hit_alert["expr"]), "the hit ratio under load is below 0.95: the condition must hold"
        rules = api.get("/api/v1/rules")["groups"][0]["rules"]
        assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
        assert all(r["health"] == "ok" for r in rules), rules
        c.close()


def test_the_not_scraped_alert_fires_when_the_job_has_no_target(prometheus):
    """DFlash2DaemonDown needs an `up` series that is 0; with no dflash2 target at all there is none,
    and only DFlash2NotScraped's absent() sees it."""
    api = prometheus(None)
    down = next(r for r in alert_rules() if r["alert"] == "DFlash2DaemonDown")
    rule = next(r for r in alert_rules() if r["alert"] == "DFlash2NotScraped")
    got = api.wait_for(rule["expr"], lambda r: bool(r), timeout_s=30)
    assert float(got[0]["value"][1]) == 1
    assert not api.query(down["expr"])
    alerts = api.wait_for("ALERTS", lambda r: any(a["metric"]["alertname"] == "DFlash2NotScraped" for a in r))
    assert {a["metric"]["alertname"] for a in alerts} == {"DFlash2NotScraped"}


def test_start_up_records_no_background_step_that_never_ran(tmp_path, config_file):
    """Start-up recorded a step of 0 s, started 0 us late, in both step histograms: a made-up zero
    after every restart, which pulled their quantiles down (a review)."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    cfg = config_file(metrics={"port": port, "host": "127.0.0.1"}, policy={"name": "lru", "rescore_interval_ms": 60000},
                      memory={"nvme_path": str(tmp_path / "nvme.cache")})  # one step at once, the next in a minute
    with running_daemon(cfg, str(tmp_path / "daemon.log")):
        time.sleep(2.5)  # the snapshot (refreshed every second) has seen the first step
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counts = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    assert counts["dflash2_rescore_seconds_count"] == 1
    assert counts["dflash2_scheduler_latency_microseconds_count"] == 1


def test_a_name_filtered_scrape_answers_state_metrics_too(tmp_path, config_file):
    """`/metrics?name[]=NAME` (a scrape config's `params: {name[]: [...]}`) answered every state metric
    (tiers, hits, swaps, reservations, snapshot age) with nothing: the collector that builds them from
    the snapshot names none at registration, and the filter never asked it (a review)."""
    port = free_port()
    cfg = config_file(metrics={"port": port, "host": "127.0.0.1"}, memory={"nvme_path": str(tmp_path / "nvme.cache")})
    with running_daemon(cfg, str(tmp_path / "daemon.log")):
        url = f"http://127.0.0.1:{port}/metrics?name[]=dflash2_tier_used_bytes&name[]=dflash2_rescore_seconds_count"
        deadline = time.monotonic() + 10
        while True:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            if "dflash2_tier_used_bytes{" in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # (the first snapshot)
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert names == {"dflash2_tier_used_bytes", "dflash2_rescore_seconds_count"}, text
