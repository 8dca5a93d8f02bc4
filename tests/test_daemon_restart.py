"""Integration: a daemon killed (SIGKILL, the OOM killer) or stopped under its clients, and the next
daemon on the same endpoint: what the clients learn, and what of the dead daemon's memory is held."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import SMALL
from daemon_proc import mapped, quick_daemon

from dflash2.client import Client, DaemonUnavailable
from dflash2.errors import ArenaError

@pytest.fixture
def daemon(config_file, tmp_path):
    yield from quick_daemon(config_file, tmp_path)


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_dead_daemons_clients_let_go_of_its_memory(daemon, how):
    # A restarted daemon takes its tiers anew: while the clients of the dead one still map its
    # segments (unlinked, their memory held), a restart whose tiers take more than half of /dev/shm
    # failed for room (exit 4), and the clients let go only once a new daemon answered them.
    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL])
    try:
        names = [a["name"] for a in c.arena_info]
        c.view_bytes(c.allocate(c.layouts[0], 1)[0])[:] = 1
        assert mapped(names) == names
        if how == "kill":
            os.kill(daemon.pid, signal.SIGKILL)
            daemon.proc.wait()
        else:
            assert daemon.terminate() == 0
        deadline = time.monotonic() + 5.0
        while not c.lease_lost or mapped(names):
            assert time.monotonic() < deadline, (c.lease_lost, mapped(names))
            time.sleep(0.05)
        with pytest.raises(ArenaError):
            c.view_bytes(0)
    finally:
        c.close()


def test_a_client_without_heartbeat_learns_it_on_its_next_call(daemon):
    c = Client.connect(config=daemon.config_path, name="quiet", layouts=[SMALL], heartbeat=False)
    try:
        names = [a["name"] for a in c.arena_info]
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.proc.wait()
        with pytest.raises(DaemonUnavailable):
            c.lookup([1])
        assert c.lease_lost and mapped(names) == []
    finally:
        c.close()


def test_a_block_id_of_the_daemon_before_a_restart_names_nothing_on_the_next(daemon):
    """Block ids carry a generation, which now begins where each daemon start draws it: from 1 every
    time, the first block of a restarted daemon had the very id of the killed one's first, and an id
    kept across the restart read the new block, without an error (a review's kill loop)."""
    from dflash2.client import DaemonError

    c = Client.connect(config=daemon.config_path, name="before", layouts=[SMALL])
    old = int(c.allocate(c.layouts[0], 1)["vid"][0])
    c.close()
    assert daemon.terminate() == 0
    daemon.start()
    with Client.connect(config=daemon.config_path, name="after", layouts=[SMALL]) as c:
        new = int(c.allocate(c.layouts[0], 1)["vid"][0])
        assert new != old and (new & 0xFFFFFFFF) == (old & 0xFFFFFFFF), "the same row, another generation"
        with pytest.raises(DaemonError, match="UnknownBlock"):
            c.acquire([old])


def test_a_call_answered_by_a_restarted_daemon_says_its_daemon_ended(daemon):
    """A call of a client whose daemon was stopped and started again is answered UnknownClient by the
    new one, which blamed a detach or a lapsed lease (neither happened): the client knows its daemon
    ended (its liveness object is gone), and says so (a review's SIGTERM and start)."""
    from dflash2.client import DaemonError

    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False)
    try:
        assert daemon.terminate() == 0
        daemon.start()
        deadline = time.monotonic() + 5.0
        while True:  # (a call sent before the socket reconnects to the new daemon waits on the ended one)
            with pytest.raises((DaemonError, DaemonUnavailable)) as e:
                c.allocate(c.layouts[0], 1)
            if isinstance(e.value, DaemonError) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert isinstance(e.value, DaemonError) and e.value.kind == "UnknownClient", e.value
        assert "has ended (stopped or restarted)" in str(e.value) and "lease lapsed" not in str(e.value)
        assert c.lease_lost
    finally:
        c.close()


def test_a_close_answered_by_a_restarted_daemon_says_its_daemon_ended(daemon, caplog):
    """As above, for the close: its detach, answered UnknownClient by the new daemon, was logged as
    "not attached (detached, or its lease lapsed: attach again)" (a review's SIGTERM and start)."""
    import logging

    c = Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL], heartbeat=False)
    assert daemon.terminate() == 0
    daemon.start()
    time.sleep(0.5)  # (the socket reconnects to the new daemon)
    with caplog.at_level(logging.WARNING, logger="dflash2.client"):
        c.close()
    said = [r.getMessage() for r in caplog.records if "dflash2 detach" in r.getMessage()]
    assert said and "has ended (stopped or restarted)" in said[0] and "lease lapsed" not in said[0], said
    assert c.lease_lost


def test_a_heartbeat_answered_by_a_restarted_daemon_says_its_daemon_ended(config_file, tmp_path, monkeypatch, caplog):
    """The heartbeat's beat answered UnknownClient by the new daemon logged "lease lost (... detached, or
    its lease lapsed: attach again)", though its daemon had ended (a review's SIGTERM and start). (The
    waiting beat asks whether its daemon ended every 5 s here, not 50 ms: the new daemon answers first.)"""
    import logging

    import dflash2.client.transport as transport
    from daemon_proc import DaemonProcess
    monkeypatch.setattr(transport, "GONE_CHECK_S", 5.0)
    path = config_file(memory={"nvme_capacity_mb": 0}, daemon={"endpoint": f"ipc://{tmp_path}/d.sock",
                                                               "lease_timeout_s": 30.0, "heartbeat_interval_s": 3.0})
    d = DaemonProcess(path).start()
    try:
        with caplog.at_level(logging.ERROR, logger="dflash2.client"):
            c = Client.connect(config=path, name="engine", layouts=[SMALL])
            try:
                assert d.terminate() == 0
                d.start()
                deadline = time.monotonic() + 10.0
                while not c.lease_lost:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            finally:
                c.close()
        said = [r.getMessage() for r in caplog.records if "lease lost" in r.getMessage()]
        assert said and "has ended (stopped or restarted)" in said[0] and "lease lapsed" not in said[0], said
    finally:
        d.stop()
