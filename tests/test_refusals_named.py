"""What a refusal tells the caller to do must be something it can do (a review of 2026-12-05): a
host writer's DRAM refusal advised an HBM reservation, and a commit under a parent evicted since the
lookup read as if one of the writer's own blocks were gone."""

from __future__ import annotations

import contextlib

import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2.client import Client, DaemonError, chain_keys
from dflash2.tiers import Tier


@contextlib.contextmanager
def daemon_with(config_file, tmp_path, **memory):
    daemon = DaemonProcess(config_file(memory={"nvme_capacity_mb": 0, **memory},
                                       daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    try:
        yield daemon
    finally:
        daemon.stop()


def test_a_dram_allocation_refused_is_not_told_to_reserve(config_file, tmp_path):
    # DRAM of 1 MiB (64 blocks of 16 KiB), no NVMe: a full DRAM of blocks being written cannot drain.
    with daemon_with(config_file, tmp_path, hbm_capacity_mb=1, dram_capacity_mb=1) as daemon, \
            Client.connect(config=daemon.config_path, name="host-writer", layouts=[SMALL]) as c:
        lid = c.layouts[0]
        assert c.allocate(lid, 64, tier="dram") is not None  # every DRAM slot, being written
        assert c.allocate(lid, 1, tier="dram") is None
        reason = c.last_refusal
        assert reason is not None and "dram" in reason.lower()
        # A reservation would be of HBM, and is granted at once here: it gives DRAM no room.
        assert c.reserve(lid, 16).granted
        assert c.allocate(lid, 1, tier="dram") is None
        for said in (reason, c.last_refusal):
            assert "reserve" not in said and "free or release them" in said, said


def test_a_commit_under_an_evicted_parent_says_it_is_the_parent(config_file, tmp_path):
    # One tier of 1 MiB (64 blocks of 16 KiB), nothing below: room is made by eviction.
    with daemon_with(config_file, tmp_path, hbm_capacity_mb=1, dram_capacity_mb=0) as daemon, \
            Client.connect(config=daemon.config_path, name="engine", layouts=[SMALL]) as c, \
            Client.connect(config=daemon.config_path, name="other", layouts=[SMALL]) as other:
        lid = c.layouts[0]
        keys = chain_keys(range(32), 16, "doc")
        first = c.allocate(lid, 1)
        parent = int(c.commit(first["vid"], keys[:1])[0])
        c.free([parent])  # cached, idle
        found = c.lookup(keys, layout=lid, probe=True)
        assert found["vid"].tolist() == [parent]
        mine = c.allocate(lid, 1)  # the block after the prefix, being written
        # Meanwhile another client fills the tier: the idle parent is evicted.
        for i in range(8):
            p = other.allocate(lid, 8)
            assert p is not None
            other.free(other.commit(p["vid"], chain_keys(range(i * 1000, i * 1000 + 128), 16, "fill")))
        assert not len(c.lookup(keys[:1], layout=lid, probe=True)), "the parent was evicted"
        with pytest.raises(DaemonError) as e:
            c.commit(mine["vid"], keys[1:2], parent=parent)
        assert e.value.kind == "UnknownBlock"
        # The blocks committed are still the writer's: the commit without the parent runs.
        msg = str(e.value)
        out = c.commit(mine["vid"], keys[1:2])
        assert len(out) == 1
        assert f"parent block {parent:#x} of this commit is not live" in msg, msg


def test_a_refusal_for_room_names_blocks_set_aside_for_lapsed_clients(make_manager):
    """HBM held by a lapsed client's set-aside blocks (its process may still write them): an allocate
    was told to reserve and wait, and the reservation that it "waits for their clients to release
    them", where no client would (a review: a process SIGSTOPped past its lease). Now each names them
    and when they are let go."""
    m = make_manager(hbm_blocks=16)
    stalled = m.attach("stalled")
    lid = m.register_layout(SMALL)
    assert m.allocate(stalled, lid, 14) is not None
    m.detach(stalled, set_aside=True)
    other = m.attach("other")
    assert m.allocate(other, lid, 4) is None
    decision = m.reserve(other, lid, tokens=4 * 16)
    assert decision.outcome.value == "deferred"
    for said in (m.allocate_refusal, decision.reason):
        assert "14 of HBM's blocks are set aside for 1 client(s) whose lease lapsed" in said, said
        assert "daemon.set_aside_leases" in said, said
    m.detach(stalled)  # (the set-aside ends: nothing is named any more)
    assert m.allocate(other, lid, 1) is not None
    assert m.set_aside_note(Tier.HBM) == ""


def test_the_set_aside_note_counts_only_blocks_no_live_client_holds(make_manager):
    """A lapsed client and a live one pin the same two cached blocks; the lapsed one also writes three
    of its own in HBM (and two in DRAM): the note named 5 HBM blocks "not released by any client: let
    go when that process ends", where the shared two stay pinned by the live reader after that."""
    m = make_manager(hbm_blocks=8, dram_blocks=8)
    lapsed, live, owner = m.attach("lapsed"), m.attach("live"), m.attach("owner")
    lid = m.register_layout(SMALL)
    m.free(owner, m.commit(owner, m.allocate(owner, lid, 2), keys=[1, 2]))
    vids = [p.vid for p in m.lookup([1, 2], lid)]
    assert m.acquire(lapsed, vids) is not None and m.acquire(live, vids) is not None
    assert m.allocate(lapsed, lid, 3) is not None and m.allocate(live, lid, 3) is not None
    assert m.allocate(lapsed, lid, 2, tier=Tier.DRAM) is not None
    m.detach(lapsed, set_aside=True)
    assert "; 3 of HBM's blocks are set aside for 1 client(s)" in m.set_aside_note(Tier.HBM), m.set_aside_note(Tier.HBM)
    assert "; 2 of DRAM's blocks are set aside" in m.set_aside_note(Tier.DRAM), m.set_aside_note(Tier.DRAM)
    m.detach(live)  # the shared pins are the lapsed client's alone now
    assert "; 5 of HBM's blocks are set aside" in m.set_aside_note(Tier.HBM), m.set_aside_note(Tier.HBM)


def test_the_set_aside_note_behind_the_queue_names_the_tier_not_the_reservation(make_manager):
    """Behind another reservation, the reason's note came after "1 reservation(s) queued ahead of it
    (...) go first" as "12 of its blocks are set aside": read as the 6-block reservation's own."""
    m = make_manager(hbm_blocks=16)
    stalled, b, c = m.attach("stalled"), m.attach("b"), m.attach("c")
    lid = m.register_layout(SMALL)
    assert m.allocate(stalled, lid, 12) is not None
    m.detach(stalled, set_aside=True)
    m.reserve(b, lid, tokens=16 * 6, priority=5)
    d = m.reserve(c, lid, tokens=16 * 6, priority=1)
    assert "queued ahead of it" in d.reason and "; 12 of HBM's blocks are set aside for 1 client(s)" in d.reason, d.reason
    assert "of its blocks" not in d.reason, d.reason
