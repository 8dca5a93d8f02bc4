"""Each client's share of HBM and of the deferred queue (`admission.max_client_share`), found by a
review of several engines on one daemon: a process whose lease lapsed while it lived attached again
with a whole share on top of its set-aside blocks, and one client's small reservations took every
place in the deferred queue while far inside its share. Each failed before its fix."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2.client import Client, DaemonError
from dflash2.errors import ReservationError
from dflash2.reservations import AdmissionSettings, Outcome


@pytest.fixture
def daemon(config_file, tmp_path):
    # HBM 1 MB: 64 blocks of 16 KiB, half of it a client's share; no tier below (blocks stay in HBM).
    proc = DaemonProcess(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 0, "nvme_capacity_mb": 0},
                                     admission={"max_client_share": 0.5},
                                     daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "lease_timeout_s": 1.0,
                                             "heartbeat_interval_s": 0.2})).start()
    yield proc
    proc.stop()


def test_a_process_that_attaches_again_carries_its_set_aside_blocks_in_its_share(daemon):
    """Its first session's 32 blocks (half of HBM) stay set aside while it lives; its new session
    got 32 more, HBM was full, and every other client's allocate and reserve waited for the
    set-aside period (30 leases by default)."""
    stalled = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], heartbeat=False)
    other = Client.connect(daemon.endpoint, name="other", layouts=[SMALL])
    again = None
    try:
        lid = stalled.layouts[0]
        assert stalled.allocate(lid, 32) is not None  # being written: private
        time.sleep(2.0)  # its lease lapses while this process lives: the blocks are set aside
        assert other.stats()["set_aside"]["blocks"] == 32
        again = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL])  # the same process
        with pytest.raises(DaemonError, match="QuotaExceeded: .*set aside from its process's earlier session"):
            again.allocate(lid, 1)
        assert other.allocate(lid, 32) is not None  # the rest of HBM is the other client's to take
    finally:
        for c in (again, other, stalled):
            if c is not None:
                c.close()


@pytest.mark.parametrize("stall", [False, True])
def test_a_session_set_aside_after_its_process_attached_again_counts_in_the_later_ones_share(daemon, stall):
    """A process drops a client (or its engine reconnects) and attaches a new one before the old lease
    lapses: the old one's 32 blocks were set aside after the new session attached, were carried into
    no share, and the process held them and a whole share on top, HBM full (a review). `stall`: the
    daemon stopped (0.8 s) after the new session attached and before the old lease lapsed: the
    stall's credit moved the old session's `last_seen` past the new one's attach, which was then taken
    for another engine of the process beside it, and carried nothing (a review)."""
    first = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], heartbeat=False)
    other = Client.connect(daemon.endpoint, name="other", layouts=[SMALL])
    again = None
    try:
        lid = first.layouts[0]
        assert first.allocate(lid, 32) is not None  # being written: private
        again = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL])  # the same process, first still attached
        if stall:
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(0.8)  # (over stalls.STALL_MIN_S)
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10.0
        while other.stats()["set_aside"]["blocks"] != 32:  # the first one's lease lapses after the new attach
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(DaemonError, match="QuotaExceeded: .*set aside from its process's earlier session"):
            again.allocate(lid, 1)
        if not stall:
            assert other.allocate(lid, 32) is not None  # the rest of HBM is the other client's to take
    finally:
        for c in (again, other, first):
            if c is not None:
                c.close()


def test_one_client_takes_at_most_its_share_of_the_queues_places(make_manager):
    """Share 0.25, 16 places: a client's one-block reservations (within its share of HBM) took all 16, and the
    next client's reservation of the same priority was rejected ("the deferred queue is full")."""
    mgr = make_manager(hbm_blocks=64, dram_blocks=0, admission=AdmissionSettings(
        smoothing_window_s=1.0, burst_fraction=1.0, reservation_ttl_s=30.0, max_deferred=16, max_client_share=0.25))
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    for _ in range(4):
        assert mgr.allocate(mgr.attach("w"), lid, 16) is not None  # HBM full of blocks being written
    decisions = [mgr.reserve(a, lid, tokens=16) for _ in range(5)]
    assert [d.outcome for d in decisions] == [Outcome.DEFERRED] * 4 + [Outcome.REJECTED]
    assert "4 reservations waiting, its share of the deferred queue's 16 places" in decisions[-1].reason
    assert mgr.reserve(b, lid, tokens=16).outcome is Outcome.DEFERRED
    mgr.check_invariants()


def test_a_client_at_its_share_of_places_displaces_its_own_lower_priority_for_a_higher(make_manager):
    """An engine is one client: its interactive request must not be turned away by its own batch
    backlog filling its share of the places (a review of the rule above: REJECTED, while a full
    queue displaces the lowest priority for a higher one)."""
    mgr = make_manager(hbm_blocks=64, dram_blocks=0, admission=AdmissionSettings(
        smoothing_window_s=1.0, burst_fraction=1.0, reservation_ttl_s=30.0, max_deferred=16, max_client_share=0.25))
    engine = mgr.attach("engine")
    lid = mgr.register_layout(SMALL)
    for _ in range(4):
        assert mgr.allocate(mgr.attach("w"), lid, 16) is not None
    batch = [mgr.reserve(engine, lid, tokens=16) for _ in range(4)]
    assert all(d.outcome is Outcome.DEFERRED for d in batch)
    urgent = mgr.reserve(engine, lid, tokens=16, priority=10)
    assert urgent.outcome is Outcome.DEFERRED and urgent.position == 0
    with pytest.raises(ReservationError, match=f"reservation {batch[-1].reservation_id} was displaced from its "
                                               "client's share of the deferred queue's places"):
        mgr.reservation_status(engine, batch[-1].reservation_id)
    assert mgr.reserve(engine, lid, tokens=16).outcome is Outcome.REJECTED  # priority 0: none below it
    mgr.check_invariants()
