"""Stop signals reach the main thread: every thread the daemon starts blocks SIGTERM and SIGINT
(dflash2/threads.py). A thread that took them would leave a main thread blocked in a system call
during start-up deaf to its SIGTERM (tests/test_audit_config.py's FIFO test hung that way)."""

from __future__ import annotations

import signal
import threading
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
