"""The NVMe tier's write back-off (a full or failing disk) and the drains it holds: room is made by
dropping idle copies, never what no request asked for; HBM drains into the room DRAM has.

Real host managers (fault_helpers): 64 blocks each of HBM and DRAM, 128 of NVMe."""

import logging

import numpy as np
import pytest

from dflash2.layout import Layout
from dflash2.tiers import Tier
from fault_helpers import (LAYOUT, drained_down, failing_disk, full_disk, idle_blocks_in, make_mgr, mgr,  # noqa: F401
                           pattern, publish)  # (fixtures imported)


def nvme_backing_off(mgr, monkeypatch, backoff: tuple[float, float]):
    """NVMe backs off (`backoff`: until when, for how long) on the placement's clock, which reads
    100 s now; a step's drain may run to its end (a loaded machine cut its 50 ms short).
    Returns the placement and its clock (a one-item list)."""
    pl, now = mgr.placement, [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    pl.write_backoff[Tier.NVME] = backoff
    monkeypatch.setattr(pl, "REBALANCE_BUDGET_S", 30.0)
    return pl, now


@pytest.mark.parametrize("policy", ["heat", "lru"])
def test_allocations_evict_idle_blocks_while_nvme_writes_fail(make_mgr, monkeypatch, policy):
    """A full (or failing) disk under the NVMe tier fails every write, so nothing moves down from
    DRAM, and nothing from HBM into a full DRAM. The blocks there are idle cached copies: room is
    made by dropping them. Before, room-making tried to drop only the blocks it had chosen to
    demote, which are often parents of cached blocks above (not droppable), and so refused every
    allocation ("HBM is full of blocks that cannot move now") while the disk stayed full."""
    m = make_mgr(policy=policy)
    a = m.attach("a")
    lid = m.register_layout(LAYOUT)
    for c in range(12):  # 192 blocks in chains of 16: HBM and DRAM full, NVMe half
        publish(m, a, lid, [1000 * c + i + 1 for i in range(16)])
    m.tick()
    monkeypatch.setattr(m.arenas[Tier.NVME], "write_blocks", full_disk)
    refused = 0
    for c in range(12, 24):
        vids = m.allocate(a, lid, 16)
        if vids is None:
            refused += 1
            continue
        keys = [1000 * c + i + 1 for i in range(16)]
        for v, k in zip(vids.tolist(), keys):
            m.view(v)[:] = pattern(k)
        m.free(a, m.commit(a, vids, keys=keys))
        m.tick()
    assert refused == 0, f"{refused} of 12 allocations refused while every cached block was idle"
    m.check_invariants()


def test_a_tier_whose_writes_fail_takes_no_blocks_until_its_back_off_ends(mgr, monkeypatch, caplog):
    """NVMe writes that fail (a full disk) start a back-off: no block goes down to NVMe for a
    second (DRAM is then the last tier: what leaves it is dropped), the next failure doubles it, and
    a write that works ends it. Before, every room-making retried the writes (a failed batch
    each time, a traceback each in the log)."""
    now = [0.0]
    pl = mgr.placement
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    for c in range(12):  # HBM and DRAM full, NVMe half
        publish(mgr, a, lid, [1000 * c + i + 1 for i in range(16)])
    failing, writes = failing_disk(mgr, monkeypatch)
    key = [100000]

    def one_request():
        vids = mgr.allocate(a, lid, 16)
        assert vids is not None, "every cached block is idle: room can be made"
        keys = list(range(key[0], key[0] + 16))
        key[0] += 16
        for v, k in zip(vids.tolist(), keys):
            mgr.view(v)[:] = pattern(k)
        mgr.free(a, mgr.commit(a, vids, keys=keys))

    with caplog.at_level(logging.INFO, logger="dflash2.placement"):
        one_request()
        assert len(writes) == 1 and pl.write_backoff[Tier.NVME] == (1.0, 1.0)
        assert pl.lower(Tier.DRAM) is None and pl.lower(Tier.HBM) == Tier.DRAM
        for _ in range(5):
            one_request()
            mgr.tick()
        assert len(writes) == 1, "no write tried while NVMe backs off"
        now[0] = 1.5  # the back-off is over: the next room-making writes, fails, backs off twice as long
        for _ in range(3):
            one_request()
        assert len(writes) == 2 and pl.write_backoff[Tier.NVME] == (3.5, 2.0)
        failing[0] = False
        now[0] = 4.0
        for _ in range(3):
            one_request()
        assert len(writes) >= 3 and Tier.NVME not in pl.write_backoff and pl.lower(Tier.DRAM) == Tier.NVME
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "dflash2.placement"]
    assert len(warned) == 2 and "nvme takes no blocks for 1 s" in warned[0] and "for 2 s" in warned[1], warned
    assert any("writes to nvme work again" in r.getMessage() for r in caplog.records)
    assert mgr.stats()["placement"]["write_backoffs"] == 2
    mgr.check_invariants()


def test_while_nvme_backs_off_room_is_made_by_dropping_the_coldest_chains_not_hot_leaves(mgr, monkeypatch, clock):
    """DRAM full of parents of blocks on NVMe, HBM full of their parents and of a few leaves written
    last, and NVMe writes failing: no DRAM block may go down, nor be dropped alone. DRAM drops its
    coldest blocks with their descendants on NVMe, and HBM's coldest blocks go down into the room
    (the policy's victims); the hot leaves stay. Before, while the back-off lasted, every allocation
    in HBM was refused (the soak's disk-full run got 64 of 128 HBM blocks); then HBM dropped its
    leaves, the newest blocks, because they alone could be dropped."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    mover = mgr.mover

    def chain(keys, tiers):
        clock.advance(1)
        vids = publish(mgr, a, lid, keys)
        for v, t in reversed(list(zip(vids.tolist(), tiers))):  # leaves first
            if t != Tier.HBM:
                assert mover.move(mgr.table.rows([v]), t).all()
        return vids

    for b in range(4):
        chain([500 + 2 * b, 501 + 2 * b], [Tier.DRAM, Tier.NVME])
    roots = [chain([1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i], [Tier.HBM, Tier.DRAM, Tier.NVME])[0] for i in range(60)]
    leaves = np.concatenate([chain([9000 + k], [Tier.HBM]) for k in range(4)])
    tiers = {k: v["blocks"] for k, v in mgr.stats()["tiers"].items()}
    assert tiers == {"hbm": 64, "dram": 64, "nvme": 64}, tiers

    monkeypatch.setattr(mgr.arenas[Tier.NVME], "write_blocks", full_disk)
    got = mgr.allocate(a, lid, 2)
    assert got is not None, mgr.allocate_refusal
    assert not mgr.placement.writable(Tier.NVME)
    assert mgr.table.liveness(leaves)[1].all(), "the hot leaves stay"
    assert mgr.table.liveness(np.array(roots))[1].all(), "HBM's blocks went down, none was dropped"
    placed = mgr.stats()["placement"]
    assert placed["demoted"] >= 2 and placed["evicted"] >= 2, placed
    tiers = {k: v["blocks"] for k, v in mgr.stats()["tiers"].items()}
    assert tiers["nvme"] == 64 - placed["evicted"] // 2, (tiers, placed)  # each DRAM block dropped took its tail
    mgr.check_invariants()  # no block outlives its parent


def test_while_nvme_backs_off_chains_whose_tails_lie_on_nvme_are_dropped_whole(mgr, monkeypatch, clock):
    """Every HBM block a parent of one in DRAM, every DRAM block a parent of one on NVMe, and NVMe
    writes failing: no tier has a block it may drop alone, nor one that may go down. Room is made by
    dropping DRAM blocks together with their descendants on NVMe (dropping a block there needs no
    write), so HBM's blocks can go down. Before, every allocation in HBM was refused until the
    back-off ended (the soak's disk-full run: a probe got 96 of 128 HBM blocks)."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    mover = mgr.mover
    for b in range(2):  # two chains wholly below HBM
        vids = publish(mgr, a, lid, [500 + 2 * b, 501 + 2 * b])
        for v, t in ((vids[1], Tier.NVME), (vids[0], Tier.DRAM)):
            assert mover.move(mgr.table.rows([v]), t).all()
    chains = []
    for i in range(62):
        clock.advance(1)
        vids, parent = [], None
        for k, t in zip(range(1000 + 3 * i, 1003 + 3 * i), (Tier.HBM, Tier.DRAM, Tier.NVME)):
            # a block at a time, each moved down before the next is written: HBM holds the heads only
            v = mgr.allocate(a, lid, 1)
            mgr.view(int(v[0]))[:] = pattern(k)
            v = mgr.commit(a, v, keys=[k], parent=parent)
            mgr.free(a, v)
            parent = int(v[0])
            vids.append(parent)
            if t != Tier.HBM:
                assert mover.move(mgr.table.rows(v), t).all(), (i, mgr.stats()["tiers"])
        chains.append(np.array(vids))
    assert {k: v["blocks"] for k, v in mgr.stats()["tiers"].items()} == {"hbm": 62, "dram": 64, "nvme": 64}
    pinned = chains[7]
    mgr.table.pin(a, pinned[2:])  # a reader holds one tail on NVMe: its chain's DRAM block stays

    monkeypatch.setattr(mgr.arenas[Tier.NVME], "write_blocks", full_disk)
    got = mgr.allocate(a, lid, 4)  # room for two more in HBM
    assert got is not None, mgr.allocate_refusal
    assert not mgr.placement.writable(Tier.NVME)
    tails = np.array([c[2] for c in chains])
    middles = np.array([c[1] for c in chains])
    alive_mid, alive_tail = mgr.table.liveness(middles)[1], mgr.table.liveness(tails)[1]
    assert not alive_mid.all(), "DRAM blocks were dropped to make room"
    assert (alive_tail <= alive_mid).all(), "a tail on NVMe never outlives its parent"
    assert alive_mid[7] and alive_tail[7], "the held tail and its parent stay"
    assert mgr.table.liveness(np.array([c[0] for c in chains]))[1].all(), "HBM's blocks went down, none dropped"
    mgr.check_invariants()
    mgr.table.unpin(a, pinned[2:])


def test_a_drain_waits_while_nvme_backs_off_instead_of_dropping_what_no_request_asked_for(mgr, monkeypatch, clock):
    """DRAM over its high watermark of idle cached blocks and NVMe backing off after a failed write:
    the background drain would drop (DRAM is the last tier meanwhile) down to the low watermark,
    blocks and their NVMe descendants that no allocation asked for (soak 2: one failed batch dropped
    DRAM from 0.969 to 0.50). It waits, keeping its cut, and moves them once NVMe takes writes again."""
    idle_blocks_in(mgr, clock, Tier.DRAM, 62)
    pl, now = nvme_backing_off(mgr, monkeypatch, (101.0, 1.0))  # as after a failed write
    assert pl.lower(Tier.DRAM) is None
    mgr.tick()
    assert Tier.DRAM in pl.draining and not mgr.draining(), "draining, but waiting: the idle loop must not spin"
    assert mgr.stats()["placement"]["evicted"] == 0 and mgr.stats()["tiers"]["dram"]["blocks"] == 62
    now[0] = 101.5  # the back-off is over
    assert mgr.draining()
    mgr.tick()
    drained_down(mgr, Tier.DRAM)


def test_hbm_drains_into_dram_while_nvme_backs_off(mgr, monkeypatch, clock):
    """NVMe backing off after failed writes holds the drain of DRAM (above), not HBM's: HBM drains
    into DRAM, which needs no NVMe write to take blocks. Before, HBM stayed over its high watermark
    for the whole back-off (up to 60 s, again and again on a full disk) over an empty DRAM."""
    idle_blocks_in(mgr, clock, Tier.HBM, 62)
    pl, now = nvme_backing_off(mgr, monkeypatch, (160.0, 60.0))  # as after long failing retries
    mgr.tick()
    placed, tiers = mgr.stats()["placement"], mgr.stats()["tiers"]
    assert placed["evicted"] == 0 and placed["demoted"] > 0, placed
    assert tiers["hbm"]["blocks"] <= int(pl.watermarks[Tier.HBM].low * 64) + 1, tiers
    assert tiers["hbm"]["blocks"] + tiers["dram"]["blocks"] == 62
    mgr.check_invariants()


def test_hbm_drains_only_into_the_room_dram_has_while_nvme_backs_off(mgr, monkeypatch, clock):
    """... and only as far as DRAM takes blocks below its high watermark: more would make room in
    DRAM, which drops its blocks while NVMe backs off. The drain then waits, keeping its cut."""
    pl = mgr.placement
    in_dram = int(pl.watermarks[Tier.DRAM].high * 64) - 3  # room for 3 blocks below its high watermark
    idle_blocks_in(mgr, clock, Tier.DRAM, in_dram)
    idle_blocks_in(mgr, clock, Tier.HBM, 62, first_key=100)
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    pl.write_backoff[Tier.NVME] = (160.0, 60.0)
    for _ in range(5):
        mgr.tick()
    placed, tiers = mgr.stats()["placement"], mgr.stats()["tiers"]
    assert placed["evicted"] == 0 and placed["demoted"] > 0, placed
    assert tiers["hbm"]["blocks"] + tiers["dram"]["blocks"] == 62 + in_dram, "nothing dropped"
    assert in_dram + 3 <= tiers["dram"]["blocks"] <= int(pl.watermarks[Tier.DRAM].high * 64) + 1, tiers
    assert Tier.HBM in pl.draining and not mgr.draining(), "waiting, keeping its cut"
    now[0] = 161.0  # the back-off is over: the rest of HBM's drain goes on (DRAM making room on NVMe)
    assert mgr.draining()
    mgr.check_invariants()


def test_a_drain_whose_writes_fail_as_it_runs_drops_nothing(mgr, monkeypatch, clock):
    """DRAM over its high watermark of idle cached blocks, NVMe's disk full: the drain's first batch
    down fails and NVMe begins to back off; the same piece's next rounds then dropped the blocks
    that were to go down (DRAM the last tier meanwhile), and so again at each retry after a back-off
    (an experiment script, NVMe on a full ext4: DRAM from 1.0 to 0.5 with no request asking for
    room). The drain stops there, keeping its cut, and goes on once NVMe takes writes again."""
    idle_blocks_in(mgr, clock, Tier.DRAM, 62)
    pl = mgr.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    nvme = mgr.arenas[Tier.NVME]
    write = nvme.write_blocks

    monkeypatch.setattr(nvme, "write_blocks", full_disk)
    monkeypatch.setattr(pl, "REBALANCE_BUDGET_S", 30.0)  # time enough to drain all of it in one step
    mgr.tick()
    assert pl.stats.write_backoffs == 1
    assert mgr.stats()["placement"]["evicted"] == 0 and mgr.stats()["tiers"]["dram"]["blocks"] == 62
    assert Tier.DRAM in pl.draining and not mgr.draining(), "waiting, keeping its cut"
    monkeypatch.setattr(nvme, "write_blocks", write)
    now[0] += 2.0  # the back-off is over, the disk has room again
    mgr.tick()
    drained_down(mgr, Tier.DRAM)


def test_hbm_drains_into_dram_only_where_dram_has_slots_of_its_size(mgr, monkeypatch, clock):
    """DRAM far under its high watermark in bytes, but every page of it cut into slots of a smaller
    size (4 KiB blocks, one kept on each page), and NVMe backing off: HBM's drain has no room below
    for its 16 KiB blocks and waits. Counted in bytes alone, it made room in DRAM, which dropped
    DRAM's blocks (NVMe backing off: nowhere to go), the loss the wait is for (a review's script)."""
    tiny = Layout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bf16", tokens_per_block=16)  # 4 KiB
    a = mgr.attach("frag")
    lid = mgr.register_layout(tiny)
    alloc = mgr.table.allocators[Tier.DRAM]
    vids = mgr.allocate(a, lid, alloc.capacity_bytes // tiny.block_bytes, tier=Tier.DRAM)
    pages = {}
    for v in vids.tolist():
        pages.setdefault(mgr.place(v).offset // alloc.page_bytes, v)
    keep = list(pages.values())
    mgr.free(a, np.array([v for v in vids.tolist() if v not in set(keep)], dtype=np.int64))
    for i, v in enumerate(keep):
        mgr.free(a, mgr.commit(a, np.array([v]), keys=[10_000 + i]))
    assert alloc.room_for(LAYOUT.block_bytes) == 0 and mgr.placement.used_fraction(Tier.DRAM) < 0.1
    idle_blocks_in(mgr, clock, Tier.HBM, 62)
    pl = mgr.placement
    monkeypatch.setattr(pl, "monotonic", lambda: 100.0)
    pl.write_backoff[Tier.NVME] = (160.0, 60.0)
    for _ in range(5):
        mgr.tick()
    placed, tiers = mgr.stats()["placement"], mgr.stats()["tiers"]
    assert placed["evicted"] == 0 and (tiers["hbm"]["blocks"], tiers["dram"]["blocks"]) == (62, len(keep)), placed
    assert Tier.HBM in pl.draining and not mgr.draining(), "waiting, keeping its cut"
    mgr.check_invariants()


def test_writes_refused_for_want_of_a_file_are_not_blamed_on_the_disk(mgr, caplog):
    """The NVMe file removed and a folder put at its path: the tier has no file (its ERROR says why),
    and the back-off's warning guessed "a full or failing disk under memory.nvme_path?" (a review's
    soak). It says the tier has no file, and why."""
    import os

    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    for c in range(12):  # HBM and DRAM full, NVMe half
        publish(mgr, a, lid, [1000 * c + i + 1 for i in range(16)])
    path = mgr.arenas[Tier.NVME].path
    os.unlink(path)
    os.mkdir(path)
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.placement"):
            for c in range(12, 16):
                vids = mgr.allocate(a, lid, 16)
                assert vids is not None, "every cached block is idle: room can be made"
                keys = [1000 * c + i + 1 for i in range(16)]
                for v, k in zip(vids.tolist(), keys):
                    mgr.view(v)[:] = pattern(k)
                mgr.free(a, mgr.commit(a, vids, keys=keys))
        warned = [r.getMessage() for r in caplog.records if "takes no blocks" in r.getMessage()]
        assert warned and all("the tier has no file: its file" in w and "full or failing disk" not in w
                              for w in warned), warned
    finally:
        os.rmdir(path)
    mgr.check_invariants()
