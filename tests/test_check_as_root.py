"""`dflash2d --check` by hand while the systemd unit's daemon runs: the unit runs it as User=dflash2
with RuntimeDirectory=dflash2, mode 0700, kept across restarts. The operator, as root, was told the
daemon's own owner-only folder was "shared" and to move the socket every serving process uses (exit
2, a review). It is told the folder belongs to the daemon's user, to run --check as that user, and
the daemon's own run passes as ever (its folder is its own: the other tests). Needs root (the folder belongs to another uid, as the service user's does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import write_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
SERVICE_UID = 65534  # stands for the `dflash2` system user


def test_check_as_root_on_the_units_layout_says_to_run_it_as_the_daemons_user():
    base = Path(tempfile.mkdtemp(prefix="dflash2-unit-", dir="/tmp"))
    try:
        base.chmod(0o755)
        run, state = base / "run", base / "state"
        for d in (run, state):
            d.mkdir()
            os.chown(d, SERVICE_UID, SERVICE_UID)
        run.chmod(0o700)
        cfg = write_config(base, daemon={"endpoint": f"ipc://{run}/dflash2.sock", "state_dir": str(state)},
                           memory={"nvme_capacity_mb": 0})
        os.chmod(cfg, 0o644)
        check = [sys.executable, "-m", "dflash2.daemon.main", "--config", cfg, "--check"]
        as_root = subprocess.run(check, capture_output=True, text=True, timeout=120)
        assert as_root.returncode == 2
        line = as_root.stderr.strip().splitlines()[-1]
        assert f"the socket's folder {run} belongs to uid {SERVICE_UID}" in line and "shared" not in line, line
        assert "run dflash2d as its owner, `--check` too" in line
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_check_as_root_tries_the_state_folder_where_the_access_check_passes_root(tmp_path):
    """Root passes os.access under /proc, where no folder or file can be made: `--check` passed such a
    `daemon.state_dir` with history on, and the daemon then kept its history in memory only (a review).
    A file (or the first missing folder) is made and removed; nothing is left by a check that passes."""
    cfg = write_config(tmp_path, history_enabled=True, daemon={"state_dir": "/proc/dflash2-none/state"})
    check = [sys.executable, "-m", "dflash2.daemon.main", "--config", cfg, "--check"]
    out = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("dflash2d: error: daemon.state_dir: cannot create ")
    fine = tmp_path / "state" / "a"
    cfg = write_config(tmp_path, history_enabled=True, daemon={"state_dir": str(fine)})
    assert subprocess.run(check[:-2] + [cfg, "--check"], capture_output=True, timeout=120).returncode == 0
    assert not (tmp_path / "state").exists()
