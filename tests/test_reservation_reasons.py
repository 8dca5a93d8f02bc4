"""What a deferred reservation is told it waits for, against a real daemon (HBM of 16 pages of 64 KiB,
DRAM below). A review found two wrong reasons: a reservation behind idle cached blocks only, with one
page of another block size partly used, was told the blocks could not move (no wait estimate), since
that page's free slots were counted neither as room nor as what demoting frees; and one behind
another client's granted, untaken reservation was told of blocks being written or pinned, none of
which there were."""

import time

import numpy as np
import pytest
from conftest import SMALL, SMALL_FP8
from daemon_proc import DaemonProcess

from dflash2.client import Client
from dflash2.layout import Layout

FORTY = Layout("forty", num_layers=5, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)  # 40 KiB


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(
        memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 4, "nvme_capacity_mb": 0, "page_kb": 64},
        daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


def fill_idle(c, lid, n, base):
    places = c.allocate(lid, n)
    assert places is not None, c.last_refusal
    c.free(c.commit(places["vid"], keys=[base + i for i in range(n)]))


@pytest.mark.parametrize("partial_page_of_another_size", [False, True])
def test_a_reservation_behind_idle_blocks_is_not_told_they_cannot_move(daemon, partial_page_of_another_size):
    with Client.connect(daemon.endpoint, name="writer", layouts=[SMALL, SMALL_FP8]) as a, \
            Client.connect(daemon.endpoint, name="reader", layouts=[SMALL]) as b:
        big, small = a.layouts
        fill_idle(a, big, 56, 1000)  # 14 of the 16 pages, 16 KiB blocks, idle and cached
        if partial_page_of_another_size:
            fill_idle(a, small, 5, 5000)  # one page of 8 KiB slots, 5 of its 8 used, idle and cached
        assert b.stats()["tiers"]["hbm"]["blocks"] == 56 + 5 * partial_page_of_another_size
        r = b.reserve(b.layouts[0], 16 * 64)  # the whole tier: every block there goes down to DRAM
        assert r.deferred, r
        assert "cannot move" not in r.reason and r.est_wait_s is not None, r
        deadline = time.monotonic() + 5
        while not r.granted and time.monotonic() < deadline:
            time.sleep(0.05)
            r = b.reservation(r.reservation_id)
        assert r.granted


def test_a_reservation_behind_a_granted_one_is_told_so(daemon):
    with Client.connect(daemon.endpoint, name="a", layouts=[SMALL]) as a, \
            Client.connect(daemon.endpoint, name="b", layouts=[SMALL]) as b:
        assert a.reserve(a.layouts[0], 16 * 64).granted  # the whole HBM tier, nothing taken
        r = b.reserve(b.layouts[0], 16 * 8)
        assert r.deferred and r.est_wait_s is None
        assert "1 granted reservation(s) not yet taken (1048576 bytes)" in r.reason, r.reason
        assert "admission.reservation_ttl_s" in r.reason and "being written" not in r.reason


def test_a_reservation_that_demoting_can_never_fit_gets_no_estimate(daemon):
    """The pages demoting frees hold fewer of its slots than their bytes (one 40 KiB slot a 64 KiB
    page): counted by their bytes, it was told "not enough HBM free yet", with an estimate, where it
    could never be granted while the blocks being written stay (a review of the count by pages)."""
    assert FORTY.block_bytes == 40 * 1024
    with Client.connect(daemon.endpoint, name="writer", layouts=[SMALL]) as a, \
            Client.connect(daemon.endpoint, name="reader", layouts=[FORTY]) as b:
        places = a.allocate(a.layouts[0], 64)  # the whole tier: 16 pages of 4 blocks of 16 KiB
        assert places is not None, a.last_refusal
        vids, pages = places["vid"], places["offset"] // (64 * 1024)
        # pages 0-5 stay being written (cannot move); pages 6-15 keep one idle cached block each
        keep = np.array([np.flatnonzero(pages == p)[0] for p in range(6, 16)])
        drop = np.array([i for p in range(6, 16) for i in np.flatnonzero(pages == p)[1:]])
        a.free(vids[drop])
        a.free(a.commit(vids[keep], keys=[7000 + i for i in range(len(keep))]))
        assert b.stats()["tiers"]["hbm"]["blocks"] == 24 + 10
        r = b.reserve(b.layouts[0], 11 * 16)  # 11 slots of 40 KiB: demoting makes 10
        assert r.deferred and r.est_wait_s is None and "cannot move" in r.reason, r



def test_a_reservation_behind_blocks_their_pinned_leaves_hold_gets_no_estimate(daemon):
    """A chain filling HBM, read whole, its first 8 blocks let go of: they are unpinned, but a block
    leaves HBM only after its children there, all still pinned. Counted as room demoting could free,
    a reservation was told "not enough HBM free yet" with a 0 s estimate at every poll (a review)."""
    with Client.connect(daemon.endpoint, name="writer", layouts=[SMALL]) as a, \
            Client.connect(daemon.endpoint, name="reader", layouts=[SMALL]) as b, \
            Client.connect(daemon.endpoint, name="late", layouts=[SMALL]) as c:
        keys = [9000 + i for i in range(64)]
        places = a.allocate(a.layouts[0], 64)  # the whole tier: 16 pages of 4 blocks of 16 KiB
        assert places is not None, a.last_refusal
        a.free(a.commit(places["vid"], keys=keys))  # one chain, idle and cached
        vids = b.lookup(keys)["vid"]
        assert len(vids) == 64 and b.acquire(vids) is not None
        b.release(vids[:8])  # the chain's first 8: unpinned, held in HBM by their pinned children
        r = c.reserve(c.layouts[0], 16 * 8)
        for _ in range(3):  # (and at the polls after a background step)
            assert r.deferred and r.est_wait_s is None, r
            assert "cannot move" in r.reason, r.reason
            time.sleep(0.15)
            r = c.reservation(r.reservation_id)
        b.release(vids[8:])  # now the whole chain may leave: the reservation is granted
        deadline = time.monotonic() + 5
        while not r.granted and time.monotonic() < deadline:
            time.sleep(0.05)
            r = c.reservation(r.reservation_id)
        assert r.granted, r


def test_a_reservation_behind_another_sizes_granted_slot_is_told_so(daemon):
    """15 of the 16 pages being written; another client's granted 8 KiB reservation holds a slot of
    the last page, which is no 16 KiB room while it stays. Counted by its 8 KiB, a 16 KiB reservation
    was told it waited on blocks being written or pinned (a review)."""
    with Client.connect(daemon.endpoint, name="writer", layouts=[SMALL]) as a, \
            Client.connect(daemon.endpoint, name="small", layouts=[SMALL_FP8]) as g, \
            Client.connect(daemon.endpoint, name="late", layouts=[SMALL]) as c:
        assert a.allocate(a.layouts[0], 60) is not None, a.last_refusal  # 15 pages of 16 KiB blocks
        assert g.reserve(g.layouts[0], 16).granted  # one 8 KiB block: a slot of the last page
        r = c.reserve(c.layouts[0], 16)
        assert r.deferred and r.est_wait_s is None, r
        assert "1 granted reservation(s) not yet taken (8192 bytes)" in r.reason, r.reason
        assert "being written" not in r.reason, r.reason


def test_a_reservation_behind_running_blocks_with_no_room_below_gets_no_estimate(config_file, tmp_path):
    """HBM full of a priority-5 request's running blocks, DRAM (the last tier) full of a priority-0
    request's, which preemption put there: the higher-priority reservation could demote the first
    only into room that nothing can make, and was told "not enough HBM free yet", 0 s, at every poll
    (known gaps). Once the DRAM blocks' request ends, they may be dropped, and it is granted."""
    proc = DaemonProcess(config_file(
        memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 0, "page_kb": 64},
        daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    try:
        with Client.connect(proc.endpoint, name="low", layouts=[SMALL]) as a, \
                Client.connect(proc.endpoint, name="mid", layouts=[SMALL]) as b, \
                Client.connect(proc.endpoint, name="high", layouts=[SMALL]) as c:
            low = a.commit(a.allocate(a.layouts[0], 64)["vid"], keys=[100 + i for i in range(64)])
            r = b.reserve(b.layouts[0], 16 * 64, priority=5)  # low's running blocks go down to DRAM
            deadline = time.monotonic() + 5
            while not r.granted and time.monotonic() < deadline:
                time.sleep(0.05)
                r = b.reservation(r.reservation_id)
            assert r.granted, r
            b.commit(b.take(r.reservation_id, 64)["vid"], keys=[300 + i for i in range(64)])
            tiers = c.stats()["tiers"]
            assert tiers["hbm"]["blocks"] == tiers["dram"]["blocks"] == 64
            r = c.reserve(c.layouts[0], 16 * 8, priority=9)
            for _ in range(3):  # (and at the polls after a background step)
                assert r.deferred and r.est_wait_s is None, r
                assert "no room for them in the tiers below" in r.reason, r.reason
                time.sleep(0.15)
                r = c.reservation(r.reservation_id)
            a.free(low)  # low's blocks, idle and cached, may be dropped from DRAM now
            deadline = time.monotonic() + 5
            while not r.granted and time.monotonic() < deadline:
                time.sleep(0.05)
                r = c.reservation(r.reservation_id)
            assert r.granted, r
    finally:
        proc.stop()
