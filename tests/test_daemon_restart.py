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
