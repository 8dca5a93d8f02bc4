"""Leases are judged every heartbeat interval, whatever the background step's (a review of
2026-12-04: with `policy.rescore_interval_ms` at 60,000, a killed engine's session and blocks were
held until the next step, up to a minute; the key allows an hour)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.config import config_warnings, load_config

from conftest import SMALL

CHILD = """
import json, sys, time
from dflash2.client import Client
from dflash2.layout import Layout
c = Client.connect(sys.argv[1], name="victim", layouts=[Layout.from_dict(json.loads(sys.argv[2]))])
c.allocate(c.layout_ids[0], 4)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_killed_client_is_let_go_of_between_steps_a_minute_apart(config_file, tmp_path):
    path = config_file(policy={"rescore_interval_ms": 60_000},
                       daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 1.0,
                               "heartbeat_interval_s": 0.2, "set_aside_leases": 0})
    assert any("policy.rescore_interval_ms (60000 ms) is longer than daemon.lease_timeout_s" in w
               for w in config_warnings(load_config(path)))
    daemon = DaemonProcess(path).start()
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.endpoint, json.dumps(SMALL.to_dict())],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().startswith("ready")
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        with Client.connect(daemon.endpoint, name="watch") as watch:
            deadline = time.monotonic() + 20  # (the next step comes 60 s after the first)
            while "victim" in [c["name"] for c in watch.stats()["clients"]]:
                assert time.monotonic() < deadline, "the killed client is still attached: held until the next step"
                time.sleep(0.2)
            assert watch.stats()["tiers"]["hbm"]["blocks"] == 0  # (its blocks freed with it)
    finally:
        daemon.stop()
