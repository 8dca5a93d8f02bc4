"""A real dflash2d subprocess for integration tests (started on a config file, stopped at teardown)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 30.0


class DaemonProcess:
    def __init__(self, config_path: str):
        self.config_path = config_path
        cfg = json.loads(Path(config_path).read_text())
        self.endpoint = cfg["daemon"]["endpoint"]
        self.socket_path = Path(self.endpoint[len("ipc://"):])
        self.log_path = Path(config_path).with_name(f"dflash2d-{time.monotonic_ns()}.log")
        self.proc: subprocess.Popen | None = None
        self.startup_line = ""

    def start(self) -> "DaemonProcess":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", self.config_path],
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         cwd=str(Path(self.config_path).parent))
        # Lines are read on a thread: a daemon that hangs at start-up printing nothing would block a
        # readline here past the deadline, and with it the whole test run.
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith("DFlash2: enabled"):
                self.startup_line = line.strip()
                return self
            if not line:  # end of output: the daemon exited
                self.proc.wait(timeout=10)
                raise RuntimeError(f"dflash2d exited with {self.proc.returncode}: {self.log()}")
        self.stop()
        raise RuntimeError(f"dflash2d did not start within {STARTUP_TIMEOUT_S}s: {self.log()}")

    def _read_lines(self, lines: "queue.Queue[str]") -> None:
        for line in self.proc.stdout:
            lines.put(line)
        lines.put("")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self, timeout: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# Leases, heartbeats and calls short enough for a test to see a dead daemon within a second or two.
QUICK = {"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.2, "request_timeout_s": 0.5}


def quick_daemon(config_file, tmp_path):
    """A fixture's body: a host daemon without NVMe and with QUICK leases, yielded; stopped after,
    and the segments of one the test killed removed (no next daemon here removes them)."""
    from dflash2.arena.shm import remove_stale_segments

    proc = DaemonProcess(config_file(memory={"nvme_capacity_mb": 0},
                                     daemon={"endpoint": f"ipc://{tmp_path}/d.sock", **QUICK})).start()
    yield proc
    proc.stop()
    remove_stale_segments(f"dflash2-{proc.pid}-")


def mapped(names: list[str]) -> list[str]:
    """The shared-memory segments among `names` that this process maps now."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return [n for n in names if f"/dev/shm/{n}" in maps]
