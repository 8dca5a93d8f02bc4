"""A GPU daemon killed under a live client, and its restart (marked `gpu`). Its HBM arena is most of
the GPU: while the client still maps the dead daemon's arena (CUDA IPC) and pinned DRAM, the next
daemon's HBM may not fit; the client lets go once it finds the daemon gone: by its DRAM segments, or,
with HBM alone, by its liveness object (tests/test_daemon_restart.py and tests/test_daemon_liveness.py
cover the host side)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gpu_helpers import GPU

pytestmark = GPU

LAYOUT = ("bf16", 4, 2, 64, "bf16", 16)


def start(path: str) -> subprocess.Popen:
    """dflash2d in this interpreter (its PYTHONPATH: the build under test), up once it printed its
    start-up line, or exited."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while True:
        lines.append(proc.stdout.readline())
        if lines[-1].startswith("DFlash2: enabled") or not lines[-1]:
            proc.lines = lines
            return proc


def test_a_daemon_restarted_after_a_kill_takes_its_hbm_again_under_a_live_client(cuda_config):
    import cupy as cp

    from dflash2.client import Client
    from dflash2.layout import Layout
    free, total = cp.cuda.runtime.memGetInfo()
    hbm_mb = int(0.6 * free) >> 20  # two of these do not fit on the GPU
    path = cuda_config(hbm_capacity_mb=hbm_mb)
    cfg = json.loads(open(path).read())
    cfg["daemon"].update(request_timeout_s=0.5, heartbeat_interval_s=0.2)
    open(path, "w").write(json.dumps(cfg))
    first = start(path)
    assert first.lines[-1].startswith("DFlash2: enabled"), "".join(first.lines)
    second = None
    c = Client.connect(config=path, name="engine", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)], device=0)
    try:
        place = c.allocate(c.layout_ids[0], 1)[0]
        c.view(place).fill_(7)  # the arena mapped and used; the view itself is dropped
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        deadline = time.monotonic() + 10.0
        while not c.lease_lost:
            assert time.monotonic() < deadline, "the client did not find its daemon gone"
            time.sleep(0.05)
        second = start(path)
        assert second.lines[-1].startswith("DFlash2: enabled"), "".join(second.lines)
        with Client.connect(config=path, name="again", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)],
                            device=0) as again:
            assert again.allocate(again.layout_ids[0], 1) is not None
    finally:
        c.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def test_an_hbm_only_daemon_killed_under_a_client_is_found_gone_and_its_hbm_taken_again(cuda_config):
    # No DRAM tier, no NVMe: no shared-memory segment that the client could test. Before the liveness
    # object, the client learned of the kill only when a restarted daemon answered UnknownClient, and
    # until then kept the dead daemon's HBM mapped, which the restart (60% of the GPU) needs.
    import cupy as cp

    from dflash2.client import Client, DaemonUnavailable
    from dflash2.errors import ArenaError
    from dflash2.layout import Layout
    free, total = cp.cuda.runtime.memGetInfo()
    hbm_mb = int(0.6 * free) >> 20  # two of these do not fit on the GPU
    path = cuda_config(hbm_capacity_mb=hbm_mb, dram_capacity_mb=0, nvme_capacity_mb=0)
    cfg = json.loads(open(path).read())
    cfg["daemon"].update(request_timeout_s=0.5, heartbeat_interval_s=0.2)
    open(path, "w").write(json.dumps(cfg))
    first = start(path)
    assert first.lines[-1].startswith("DFlash2: enabled"), "".join(first.lines)
    second = None
    c = Client.connect(config=path, name="engine", layouts=[Layout(*LAYOUT)], device=0, heartbeat=False)
    try:
        assert [a["kind"] for a in c.arena_info] == ["cuda"], c.arena_info  # HBM alone: no segment to test
        assert c._arenas.liveness is not None
        place = c.allocate(c.layout_ids[0], 1)[0]
        c.view(place).fill_(7)  # the arena mapped and used; the view itself is dropped
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        with pytest.raises(DaemonUnavailable):
            c.lookup([1])  # the next call finds the daemon gone
        assert c.lease_lost and c._arenas.arenas == {}
        with pytest.raises(ArenaError):
            c.view_bytes(place)
        deadline = time.monotonic() + 10.0
        while cp.cuda.runtime.memGetInfo()[0] < free - (free >> 3):  # the IPC mapping closed: HBM back
            assert time.monotonic() < deadline, ("the dead daemon's HBM is still held", cp.cuda.runtime.memGetInfo())
            time.sleep(0.1)
        second = start(path)
        assert second.lines[-1].startswith("DFlash2: enabled"), "".join(second.lines)
        assert not os.path.exists(f"/dev/shm/dflash2-{first.pid}-alive"), "the restart removes the dead one's"
        with Client.connect(config=path, name="again", layouts=[Layout(*LAYOUT)], device=0) as again:
            assert again.allocate(again.layout_ids[0], 1) is not None
    finally:
        c.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
