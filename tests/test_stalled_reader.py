"""soak10: a reader whose lease lapses while its process lives (a stall: GC, swap storm, SIGSTOP, a
frozen cgroup) and that then goes on reading the blocks it had pinned. Its private blocks were set
aside (kept out of reuse) for exactly this kind of process, but its pins were dropped at once: the
blocks it was reading moved, their slots went to other blocks, and the resumed reader read another
block's bytes through its view, silently (the soak: a wrong block read by a worker resumed after
SIGCONT, its session already gone)."""

from __future__ import annotations

import time

import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.keys import chain_keys

LEASE = {"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.2}


@pytest.fixture
def daemon(config_file, tmp_path):
    # HBM 1 MB: 64 blocks of 16 KiB; DRAM below it, no NVMe.
    proc = DaemonProcess(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 4, "nvme_capacity_mb": 0},
                                     daemon={"endpoint": f"ipc://{tmp_path}/d.sock", **LEASE})).start()
    yield proc
    proc.stop()


def test_a_stalled_readers_pinned_block_keeps_its_bytes(daemon):
    writer = Client.connect(daemon.endpoint, name="writer", layouts=[SMALL])
    # No heartbeat: its lease lapses while this process runs, as a stalled engine's does.
    reader = Client.connect(daemon.endpoint, name="reader", layouts=[SMALL], heartbeat=False)
    try:
        lid = writer.layouts[0]
        key = chain_keys(range(16), 16, "stalled-reader")
        place = writer.allocate(lid, 1)
        writer.view_bytes(place[0])[:] = 0x11
        vid = writer.commit(place["vid"], keys=key)
        writer.free(vid)  # cached, idle

        found = reader.lookup(key)
        pinned = reader.acquire(found["vid"])
        view = reader.view_bytes(pinned[0])  # the engine reads the block through this view
        assert (view == 0x11).all()

        time.sleep(LEASE["lease_timeout_s"] + 1.0)  # the reader stalls past its lease (its process lives)
        aside = writer.stats()["set_aside"]
        assert aside["clients"] == 1 and aside["pinned"] == 1, ("the reader's lease lapsed, its process alive", aside)

        # Another client fills HBM: idle cached blocks are demoted to make room, their slots reused.
        got = []
        while (p := writer.allocate(lid, 1)) is not None:
            writer.view_bytes(p[0])[:] = 0x22
            got.append(p)
        # The stalled reader resumes and reads the block it had pinned.
        assert (view == 0x11).all(), f"the pinned block's slot now holds other bytes: {set(view[:8].tolist())}"
        for p in got:
            writer.free(p["vid"])
        writer.check()
    finally:
        reader.close()
        writer.close()
