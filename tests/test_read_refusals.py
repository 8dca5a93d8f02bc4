"""A host reader's `acquire` the daemon gives no room (a block on NVMe moves up into DRAM to be read,
and DRAM cannot make room: every block there pinned or being written) answers None, and its reason
(`Client.last_refusal`) names the tier asked for: it named HBM for a `tier="dram"` acquire."""

from __future__ import annotations

import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.keys import chain_keys


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 1, "nvme_capacity_mb": 4,
                                             "nvme_path": str(tmp_path / "nvme.cache"), "page_kb": 64})).start()
    yield proc
    proc.stop()


def test_a_dram_read_refused_room_says_dram(daemon):
    c = Client.connect(daemon.endpoint, name="reader", layouts=[SMALL], heartbeat=False)
    try:
        lid = c.layouts[0]
        old = chain_keys(range(16 * 2), 16, "old")
        c.free(c.commit(c.allocate(lid, 2, tier="dram")["vid"], keys=old))
        newer = 0
        while set(c.lookup(old, lid, tier="dram")["tier"].tolist()) != {2}:  # newer pages push them down to NVMe
            assert newer < 256, "never demoted"
            c.free(c.commit(c.allocate(lid, 1, tier="dram")["vid"], keys=chain_keys(range(16), 16, f"new-{newer}")))
            newer += 1
        found = c.lookup(old, lid, tier="dram")
        assert len(found) == 2
        for n in range(newer):  # another reader pins what DRAM holds, and writes into the rest of it
            here = c.lookup(chain_keys(range(16), 16, f"new-{n}"), lid, tier="dram")
            if len(here) and here["tier"][0] == 1:
                assert c.acquire(here["vid"], tier="dram") is not None
        while c.allocate(lid, 1, tier="dram") is not None:
            pass
        assert c.acquire(found["vid"], tier="dram") is None
        assert c.last_refusal.startswith("DRAM could not be given room for them now (a block on NVMe is read in DRAM): "
                                         "it is full of blocks that cannot move now (being written or pinned)")
    finally:
        c.close()


def test_each_thread_reads_its_own_refusal(daemon):
    """One attribute for all threads: another thread's refusal (or success's stale one) was read as
    this thread's reason (the sglang backend's storage threads share a client)."""
    import threading

    c = Client.connect(daemon.endpoint, name="shared", layouts=[SMALL], heartbeat=False)
    try:
        lid = c.layouts[0]
        while c.allocate(lid, 1, tier="dram") is not None:  # DRAM full of blocks being written
            pass
        mine = c.last_refusal
        assert mine and mine.startswith("DRAM")
        seen = {}

        def other_thread():
            seen["before"] = c.last_refusal
            while c.allocate(lid, 64) is not None:  # HBM full too: a refusal of its own
                pass
            seen["after"] = c.last_refusal

        other = threading.Thread(target=other_thread)
        other.start()
        other.join()
        assert seen["before"] is None and seen["after"].startswith("HBM") and c.last_refusal == mine
    finally:
        c.close()
