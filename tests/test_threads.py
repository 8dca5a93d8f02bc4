"""Stop signals reach the main thread: every thread the daemon starts blocks SIGTERM and SIGINT
(dflash2/threads.py). A thread that took them would leave a main thread blocked in a system call
during start-up deaf to its SIGTERM (tests/test_audit_config.py's FIFO test hung that way)."""

from __future__ import annotations

import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import SMALL
from mask_helpers import STOP_BITS, blocked_mask, other_threads, own_mask, taking_stop_signals
from observe_helpers import RawClient, fill_then_reuse, free_port, running_daemon

from dflash2 import threads
from dflash2.arena.staging import StagingRing
from dflash2.client import Client
from dflash2.transfer.host import HostTransferBackend

def test_a_started_thread_blocks_stop_signals_and_the_caller_keeps_its_mask():
    before = own_mask()
    seen: list[set[int]] = []
    t = threads.start(threading.Thread(target=lambda: seen.append(own_mask())))
    t.join()
    assert {signal.SIGTERM, signal.SIGINT} <= seen[0]
    assert own_mask() == before and signal.SIGTERM not in before


def test_a_stop_signal_during_the_block_reaches_the_caller_after_it():
    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with threads.stop_signals_blocked():
            signal.raise_signal(signal.SIGTERM)
            assert got == []  # pending while blocked
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_host_transfer_thread_blocks_stop_signals():
    backend = HostTransferBackend({})
    try:
        assert blocked_mask("self", backend._thread.native_id) & STOP_BITS == STOP_BITS
    finally:
        backend.close()


def test_the_staging_workers_block_stop_signals():
    ring = StagingRing(1 << 20, workers=2)
    try:
        masks = ring.run([], lambda chunk, offset: None, tasks=[own_mask, own_mask])
        assert all({signal.SIGTERM, signal.SIGINT} <= m for m in masks)
    finally:
        ring.close()


def test_every_thread_of_a_serving_daemon_but_the_main_one_blocks_stop_signals(tmp_path, config_file):
    """Metrics served (its server thread), history on, blocks moved between tiers (the transfer
    thread): only the main thread may take SIGTERM or SIGINT."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    cfg = config_file(metrics={"port": free_port(), "host": "127.0.0.1"}, daemon={"endpoint": endpoint},
                      history_enabled=True)
    with running_daemon(cfg, str(tmp_path / "daemon.log")) as proc:
        c = RawClient(endpoint)
        c.attach()
        fill_then_reuse(c)
        others = other_threads(proc.pid)
        assert len(others) >= 2, others  # at least the transfer thread and the metrics server's
        assert taking_stop_signals(proc.pid, others) == []
        assert blocked_mask(proc.pid, proc.pid) & STOP_BITS == 0
        c.close()
        with Client.connect(endpoint, name="heartbeats", layouts=[SMALL]) as client:  # a serving process's side
            assert blocked_mask("self", client._heartbeat_thread.native_id) & STOP_BITS == STOP_BITS
    assert proc.returncode == 0


if not Path("/proc/self/task").is_dir():  # the masks are read from Linux's /proc
    pytestmark = pytest.mark.skip(reason="needs Linux /proc")


def _failing_start(monkeypatch, nth: int, prefix: str = "dflash2-staging") -> None:
    """threading.Thread.start raises as under `ulimit -v` for the nth thread named `prefix...` (0: every one)."""
    real, seen = threading.Thread.start, [0]

    def start(self):
        if self.name.startswith(prefix):
            seen[0] += 1
            if not nth or seen[0] == nth:
                raise RuntimeError("can't start new thread")
        real(self)
    monkeypatch.setattr(threading.Thread, "start", start)


def test_the_staging_workers_start_with_the_ring_and_one_that_cannot_leaves_none_behind(monkeypatch):
    """Started at the pool's first tasks, one that could not start raised in the middle of a batch's
    submits while the daemon served: a task queued with none to run it, its partner waiting on it for
    good, the batch's blocks blamed on the disk and close hanging (a review, under `ulimit -v`)."""
    _failing_start(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        StagingRing(1 << 20, workers=2)  # (two slots: two workers)
    deadline = time.monotonic() + 5
    while any(t.name.startswith("dflash2-staging") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dflash2-staging")]
    monkeypatch.undo()
    ring = StagingRing(1 << 20, workers=2)
    try:
        _failing_start(monkeypatch, 0)  # (no thread starts from now on: the ring has all its own)
        assert ring.run([], lambda chunk, offset: None, tasks=[lambda: 1] * 16) == [1] * 16
    finally:
        ring.close()


@pytest.mark.parametrize("variant", ["ipc", "metrics+nvme", "tcp"])
def test_the_check_counts_the_threads_a_serving_daemon_starts(tmp_path, config_file, variant, monkeypatch):
    """`--check` weighs each thread's stack against an address-space limit: a count of 6 for every
    config was 2 short with a tcp endpoint (ZeroMQ's authenticator, the key gate), and the NVMe
    tier's workers started at its first batch (a review). Counted here in a serving daemon, beyond
    the threads the check's own imports start (numpy's)."""
    import os
    import subprocess
    import sys

    from dflash2.config import load_config
    from dflash2.daemon.roomnow import serving_threads
    from dflash2.plan import resolve_plan

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    port = free_port() if variant != "ipc" else 0
    endpoint = f"tcp://127.0.0.1:{free_port()}" if variant == "tcp" else f"ipc://{tmp_path}/d.sock"
    memory = {"nvme_capacity_mb": 8, "nvme_path": str(tmp_path / "n.cache")} if variant == "metrics+nvme" else \
        {"nvme_capacity_mb": 0, "nvme_path": None}
    cfg = config_file(metrics={"port": port, "host": "127.0.0.1"}, daemon={"endpoint": endpoint}, memory=memory)
    imported = subprocess.run([sys.executable, "-c", "import os, dflash2.daemon.main, dflash2.plan; "
                               "print(len(os.listdir('/proc/self/task')) - 1)"], capture_output=True, text=True)
    expected = serving_threads(resolve_plan(load_config(cfg)), port) + int(imported.stdout)
    with running_daemon(cfg, str(tmp_path / "daemon.log")) as proc:
        deadline = time.monotonic() + 5  # (a thread started right after the start-up line)
        while (serving := len(os.listdir(f"/proc/{proc.pid}/task")) - 1) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        serving = len(os.listdir(f"/proc/{proc.pid}/task")) - 1
    assert serving == expected, (serving, imported.stdout)


@pytest.mark.parametrize("cap", [True, False])
def test_under_an_address_space_limit_threads_share_one_malloc_arena(cap):
    """glibc gives each new thread's first malloc an arena of its own, 64 MiB of address space each: a
    serving daemon's threads took 256 MiB that way, and a later thread could not start (a review).
    Start-up caps them at one under a limit (`cap_malloc_arenas`): six threads then add their stacks."""
    import subprocess
    import sys

    script = textwrap.dedent("""
        import ctypes, resource, sys, threading, time
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        from dflash2.arena.shm import cap_malloc_arenas
        said = cap_malloc_arenas() if sys.argv[1] == "cap" else None
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        vm = lambda: [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")][0] << 10
        before, go = vm(), threading.Event()
        def work():
            libc.malloc(200)
            go.wait()
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        print(said, (vm() - before) >> 20)
        go.set()
    """)
    out = subprocess.run([sys.executable, "-c", script, "cap" if cap else "none"], capture_output=True, text=True,
                         timeout=60)
    from dflash2.arena.shm import thread_stack_bytes

    said, grown = out.stdout.rsplit(" ", 1)
    stacks = 6 * thread_stack_bytes() >> 20  # (MiB, as `grown`)
    if cap:
        assert said.startswith("the address space is limited (RLIMIT_AS): malloc's per-thread arenas capped at one")
        assert int(grown) <= stacks + 16, out.stdout
    else:
        assert int(grown) >= stacks + 4 * 64, out.stdout  # (the arenas: what the cap saves)
