"""deploy/ against the daemon it deploys: the container's health check asks the daemon, the DaemonSet
runs the production config, and the histograms' buckets reach the slowest figures that config gives."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml
from observe_helpers import running_daemon

from dflash2.config import load_config
from dflash2.metrics import LATENCY_BUCKETS, SWAP_BUCKETS

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PRODUCTION = DEPLOY / "dflash2_config.production.json"


def _healthcheck(config: str) -> list[str]:
    m = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert m, "the Dockerfile has no HEALTHCHECK CMD [...]"
    return [config if arg == "/etc/dflash2/dflash2_config.json" else arg for arg in json.loads(m.group(1))]


def test_the_containers_health_check_fails_when_the_daemon_is_not_there(tmp_path, config_file):
    cfg = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})
    cmd = _healthcheck(cfg)
    down = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert down.returncode != 0, f"{cmd} says healthy with no daemon running: {down.stdout[-300:]}"
    with running_daemon(cfg, str(tmp_path / "d.log")):
        up = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr


def test_the_daemonsets_config_is_the_production_config():
    # It differs only where a pod needs it to: metrics on the node's address, the socket's path named.
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())}
    pod = json.loads(docs["ConfigMap"]["data"]["dflash2_config.json"])
    prod = json.loads(PRODUCTION.read_text())
    for cfg in (pod, prod):
        cfg["metrics"].pop("host")
        cfg["daemon"].pop("endpoint")
    assert pod == prod


def test_the_top_buckets_reach_the_slowest_figures_worth_telling_apart():
    # histogram_quantile answers at most the largest finite bucket: a p99 stuck at it hides how slow
    # things are. Requests: up to the timeout after which a client gives up. Batch moves: a full
    # batch of the production config's largest blocks to NVMe at 1 GB/s.
    cfg = load_config(PRODUCTION)
    assert LATENCY_BUCKETS[-1] >= cfg.daemon.request_timeout_s
    block = max(layout.block_bytes for layout in cfg.layout_objects().values())
    assert SWAP_BUCKETS[-1] >= cfg.policy.swap_batch_size * block / 1e9
