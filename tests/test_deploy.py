"""deploy/: promtool accepts the rules and the scrape config; the dashboard, DaemonSet, systemd unit
and container file are well formed and agree with the daemon (job name, port, config schema)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from dflash2.config import load_config
from dflash2.quarantine import Quarantine

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _check(promtool: str, *args: str) -> str:
    r = subprocess.run([promtool, "check", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_promtool_accepts_the_alert_rules(promtool):
    assert "SUCCESS: 8 rules found" in _check(promtool, "rules", str(DEPLOY / "prometheus" / "dflash2_alerts.yml"))


def test_the_set_aside_alerts_fire_on_slots_set_aside_and_on_a_failing_disk(promtool, tmp_path):
    """promtool's rule unit test, on the shipped expressions (annotations left out: promtool compares
    them whole; `check rules` above covers their templates). Node a sets 4 KiB of a 1 MiB tier aside,
    b 64 KiB (over the daemon's 5%: the disk is failing), c nothing."""
    doc = yaml.safe_load((DEPLOY / "prometheus" / "dflash2_alerts.yml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc))
    mib = 1 << 20
    series = []
    for node, aside in (("a", 4096), ("b", 65536), ("c", 0)):
        labels = f'job="dflash2",instance="{node}",tier="nvme"'
        series.append({"series": f"dflash2_tier_quarantined_bytes{{{labels}}}", "values": f"0 0 {aside} {aside}"})
        series.append({"series": f"dflash2_tier_capacity_bytes{{{labels}}}",
                       "values": f"{mib} {mib} {mib - aside} {mib - aside}"})

    def fired(alert: str, *nodes: str) -> list[dict]:
        severity = "critical" if alert == "DFlash2NvmeDiskFailing" else "warning"
        return [{"eval_time": "1m", "alertname": alert, "exp_alerts": []},
                {"eval_time": "3m", "alertname": alert,
                 "exp_alerts": [{"exp_labels": {"severity": severity, "instance": n}} for n in nodes]}]

    test = {"rule_files": [str(rules)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "alert_rule_test": fired("DFlash2NvmeSlotsSetAside", "a", "b")
                       + fired("DFlash2NvmeDiskFailing", "b")}]}
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(test))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_accepts_the_scrape_config(promtool):
    _check(promtool, "config", str(DEPLOY / "prometheus" / "prometheus.yml"))


def test_the_alerts_asked_for_are_there():
    doc = yaml.safe_load((DEPLOY / "prometheus" / "dflash2_alerts.yml").read_text())
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    assert "< 0.95" in rules["DFlash2HbmHitRatioLow"]["expr"] and rules["DFlash2HbmHitRatioLow"]["for"] == "10m"
    assert "dflash2_gpu_memory_utilization" in rules["DFlash2GpuMemoryUtilizationHigh"]["expr"]
    assert "> 0.95" in rules["DFlash2GpuMemoryUtilizationHigh"]["expr"]
    assert 'tier="nvme"' in rules["DFlash2NvmeTierNearlyFull"]["expr"] and "> 0.9" in rules["DFlash2NvmeTierNearlyFull"]["expr"]
    assert "max by (instance, gpu)" in rules["DFlash2GpuMemoryUtilizationHigh"]["expr"]
    assert 'up{job="dflash2"}' in rules["DFlash2DaemonDown"]["expr"]
    assert 'absent(up{job="dflash2"})' in rules["DFlash2NotScraped"]["expr"]
    assert rules["DFlash2NvmeSlotsSetAside"]["labels"]["severity"] == "warning"
    assert float(rules["DFlash2NvmeDiskFailing"]["expr"].rsplit(">", 1)[1]) == Quarantine.FAILING_FRACTION
    assert rules["DFlash2NvmeDiskFailing"]["labels"]["severity"] == "critical"
    assert all(r["annotations"]["summary"] for r in rules.values())


def test_dashboard_has_the_panels_and_unique_ids():
    dash = json.loads((DEPLOY / "grafana" / "dflash2_dashboard.json").read_text())
    titles = [p["title"] for p in dash["panels"]]
    for want in ("Tier use", "HBM hit ratio", "Swap bandwidth", "Reservations", "Admission wait",
                 "Request latency p99 by op", "GPU memory utilization (device tier)", "Blocks per swap batch"):
        assert want in titles
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        assert all("dflash2_" in t["expr"] or t["expr"].startswith("up{") for t in p["targets"]), p["title"]


def test_daemonset_runs_one_daemon_per_gpu_node_with_host_ipc_shm_nvme_and_metrics(tmp_path):
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True and pod["nodeSelector"]
    c = pod["containers"][0]
    assert {"containerPort": 9464, "name": "metrics", "protocol": "TCP"} in c["ports"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"
    assert "hostPath" in volumes[mounts["/var/lib/dflash2"]]
    # The config in the ConfigMap is a valid dflash2 config whose files lie on the NVMe hostPath.
    path = tmp_path / "dflash2_config.json"
    path.write_text(docs["ConfigMap"]["data"]["dflash2_config.json"])
    cfg = load_config(path)
    assert cfg.metrics.port == 9464 and str(cfg.resolved_nvme_path).startswith("/var/lib/dflash2/")
    assert cfg.logging.format == "json" and cfg.history_enabled


def test_production_config_loads_and_matches_the_scrape_port():
    cfg = load_config(DEPLOY / "dflash2_config.production.json")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["job_name"] == "dflash2"
    assert job["static_configs"][0]["targets"][0].endswith(f":{cfg.metrics.port}")


def test_the_nvme_alert_sits_on_the_shipped_high_watermark():
    """A full last tier is a cache's steady state: the daemon keeps it at its high watermark. The
    alert's threshold must not be under it, or it fires on every healthy, idle node."""
    doc = yaml.safe_load((DEPLOY / "prometheus" / "dflash2_alerts.yml").read_text())
    expr = next(r["expr"] for g in doc["groups"] for r in g["rules"] if r["alert"] == "DFlash2NvmeTierNearlyFull")
    threshold = float(expr.rsplit(">", 1)[1])
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())}
    for text in (docs["ConfigMap"]["data"]["dflash2_config.json"], (DEPLOY / "dflash2_config.production.json").read_text()):
        assert json.loads(text)["policy"]["watermarks"]["nvme"]["high"] <= threshold


def test_every_reader_of_the_production_config_finds_the_systemd_daemon(monkeypatch):
    """The endpoint is named, not left to each process's XDG_RUNTIME_DIR: an operator's shell and a
    serving process resolve the socket the unit's daemon serves ($RUNTIME_DIRECTORY/dflash2.sock)."""
    unit = (DEPLOY / "systemd" / "dflash2d.service").read_text()
    assert "RuntimeDirectory=dflash2" in unit
    assert "RuntimeDirectoryPreserve=restart" in unit  # (the lock file that names a killed daemon)
    for runtime in ("/run", "/run/user/1000", None):
        if runtime is None:
            monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        else:
            monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
        assert load_config(DEPLOY / "dflash2_config.production.json").resolved_endpoint() == \
            "ipc:///run/dflash2/dflash2.sock"


def test_the_probes_wait_longer_than_the_command_does():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())}
    [c] = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        cmd = probe["exec"]["command"]
        timeout = float(cmd[cmd.index("--timeout") + 1])
        assert probe["timeoutSeconds"] >= timeout + 2, probe  # and the interpreter's start


def test_systemd_unit_and_dockerfile_run_dflash2d():
    unit = (DEPLOY / "systemd" / "dflash2d.service").read_text()
    # The unit runs the daemon from the virtual environment its own install steps make.
    assert "python3 -m venv /opt/dflash2 && /opt/dflash2/bin/pip install" in unit
    assert "ExecStart=/opt/dflash2/bin/dflash2d --config /etc/dflash2/dflash2_config.json" in unit
    assert "KillSignal=SIGTERM" in unit and "RestartPreventExitStatus=2 3" in unit
    docker = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["dflash2d"]' in docker and "EXPOSE 9464" in docker
