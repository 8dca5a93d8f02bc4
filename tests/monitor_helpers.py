"""What the tests of a tcp endpoint's monitoring key (test_tcp_monitor_key.py, test_tcp_monitor_socket.py)
share: an in-process server with keys, a monitoring client's raw socket, a real daemon on a port."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from conftest import write_config
from test_tcp_keys import free_port

from dflash2.tcpkeys import load_or_make


def served(tmp_path, make_manager):
    """An in-process Server on a tcp endpoint with keys, its loop not running (the test drives it)."""
    from dflash2.daemon.server import Server
    from dflash2.daemon.service import Service

    keys, _ = load_or_make(tmp_path / "k.key")
    svc = Service(make_manager(hbm_blocks=8, dram_blocks=16), lease_timeout_s=10, heartbeat_interval_s=1)
    return keys, Server(svc, f"tcp://127.0.0.1:{free_port()}", 30.0, keys=keys, key_file=str(tmp_path / "k.key"))


def monitoring_dealer(ctx, keys, port):
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.monitor.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.monitor.client_secret)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def next_message(gate, within_s=5.0):
    import time as _time

    deadline = _time.monotonic() + within_s
    while _time.monotonic() < deadline:
        frames = gate.next_monitoring(64)
        if frames is not None:
            return frames
        _time.sleep(0.01)
    return None


@contextmanager
def daemon_at(folder: Path, port: int, key_file: Path, runtime: Path, host: str = "127.0.0.1"):
    """A tcp daemon on `host`:`port` with `key_file`; yields its pid."""
    folder.mkdir(exist_ok=True)
    config = write_config(folder, daemon={"endpoint": f"tcp://{host}:{port}", "state_dir": str(folder / "s"),
                                          "tcp_key_file": str(key_file)})
    with open(folder / "daemon.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config], stdout=subprocess.PIPE,
                                stderr=log, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("DFlash2: enabled"), (line, (folder / "daemon.log").read_text())
        yield proc.pid
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()

