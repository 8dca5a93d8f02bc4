"""Fault injection on the host data path: I/O errors, corrupt blocks, copies that fail or never start.

Every test runs a real host manager (shared-memory HBM and DRAM stand-ins, an NVMe file in tmp_path)
whose blocks hold distinct bytes, injects a failure at the lowest level (the staging I/O wrappers,
the transfer backend), and then checks the rules: a failed read is a miss, never wrong data; a
failure loses nothing that was not already lost; the table's invariants hold; nothing leaks.
"""

import errno
import logging
import os

import numpy as np
import pytest

from dflash2.arena.nvme import HEADER_BYTES
from dflash2.assemble import build_manager
from dflash2.config import load_config
from dflash2.errors import UnknownBlock
from dflash2.layout import Layout
from dflash2.mover import Mover
from dflash2.tiers import Tier
from dflash2.transfer import failures

LAYOUT = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB


@pytest.fixture
def make_mgr(config_file, instance_name):
    """Real host managers: 1 MiB of HBM and DRAM (64 blocks each), 2 MiB of NVMe."""
    made = []

    def make(prefetch_window=0):
        cfg = load_config(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                              "staging_buffer_size_mb": 1},
                                      kv_block={"block_size": 16, "prefetch_window": prefetch_window}))
        made.append(build_manager(cfg, instance=instance_name))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.fixture
def mgr(make_mgr):
    return make_mgr()


def pattern(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def publish(m, client, lid, keys, chained=True) -> np.ndarray:
    """Blocks holding pattern(key), published (one chain, or each its own root), held by nobody."""
    groups = [keys] if chained else [[k] for k in keys]
    out = []
    for group in groups:
        vids = m.allocate(client, lid, len(group))
        for v, k in zip(vids.tolist(), group):
            m.view(v)[:] = pattern(k)
        vids = m.commit(client, vids, keys=group)
        m.free(client, vids)
        out.append(vids)
    return np.concatenate(out)


def stored_bytes(m, vid: int) -> np.ndarray | None:
    """A block's bytes wherever it lies; None when its NVMe copy reads as a miss."""
    p = m.place(vid)
    if p.tier == Tier.NVME:
        buf = np.zeros(p.nbytes, np.uint8)
        return buf if m.arenas[Tier.NVME].read_blocks([p.offset], [buf])[0] else None
    return np.array(m.view(vid))


def to_nvme(m, vids) -> None:
    rows = m.table.rows(vids)[::-1]  # leaves first
    assert m.mover.move(rows, Tier.DRAM).all() and m.mover.move(rows, Tier.NVME).all()


def chain_on_nvme(m, keys):
    """A client, the layout and one published chain of `keys` moved down to NVMe: (client, layout, vids)."""
    a = m.attach("a")
    lid = m.register_layout(LAYOUT)
    vids = publish(m, a, lid, keys)
    to_nvme(m, vids)
    return a, lid, vids


def assert_intact(m, vids, keys) -> None:
    """Invariants hold, and each block is still found by its key, holding its own bytes."""
    m.check_invariants()
    for v, k in zip(np.asarray(vids).tolist(), keys):
        assert [p.vid for p in m.lookup([k])] == [v], f"block of key {k} was lost"
        got = stored_bytes(m, v)
        assert got is not None and np.array_equal(got, pattern(k)), f"block of key {k} holds wrong bytes"


def start_fails_at(m, monkeypatch, nth: int) -> None:
    """The backend's `start` raises on its nth call (before any copy of that batch begins)."""
    real, calls = m.backend.start, []

    def start(batch):
        calls.append(batch)
        if len(calls) == nth:
            raise RuntimeError("injected: copy could not be started")
        return real(batch)

    monkeypatch.setattr(m.backend, "start", start)


# -- bugs found by injection ----------------------------------------------------------------------

def test_a_failed_read_is_dropped_even_when_a_later_batch_fails_to_start(mgr, monkeypatch):
    """A promotion whose first batch read a corrupt block and whose next batch's start raised used
    to leave the corrupt block published (found by lookup) and its row in the mover's lost list; the
    next promotion or demotion dropped whatever block held that row by then: a block that had never
    failed, written after the failure, was lost."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    keys = list(range(1, 7))
    vids = publish(mgr, a, lid, keys, chained=False)
    rows = mgr.table.rows(vids)
    assert mgr.mover.move(rows, Tier.DRAM).all() and mgr.mover.move(rows, Tier.NVME).all()
    mgr.arenas[Tier.NVME].corrupt_for_test(mgr.place(int(vids[3])).offset)
    mgr.mover.swap_batch_size = 2  # three batches: [1, 2], [3, 4 (corrupt)], [5, 6 (start raises)]
    start_fails_at(mgr, monkeypatch, 3)
    with pytest.raises(RuntimeError, match="injected"):
        mgr.acquire(a, vids, up_to=Tier.DRAM)
    monkeypatch.undo()
    mgr.check_invariants()
    assert mgr.lookup([4]) == [], "the block whose read failed is a miss at once"
    assert mgr.placement.stats.lost == 1
    # A new block is written (in the row the corrupt one had, had it been freed), then blocks move.
    new = publish(mgr, a, lid, [99])
    assert mgr.acquire(a, vids[4:], up_to=Tier.DRAM) is not None
    mgr.release(a, vids[4:])
    assert_intact(mgr, np.concatenate([vids[[0, 1, 2, 4, 5]], new]), [1, 2, 3, 5, 6, 99])
    assert mgr.placement.stats.lost == 1


def test_the_movers_lost_blocks_are_not_confused_with_a_reused_row(mgr, monkeypatch):
    """Mover.take_lost names blocks, not rows: a lost block freed before its caller drained the list
    (the caller was cut short by an exception) must not make the block that reuses its row a loss."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    vids = publish(mgr, a, lid, [1, 2], chained=False)
    rows = mgr.table.rows(vids)
    mover = Mover(mgr.table, mgr.backend, swap_batch_size=1)
    assert mover.move(rows, Tier.DRAM).all() and mover.move(rows, Tier.NVME).all()
    mgr.arenas[Tier.NVME].corrupt_for_test(mgr.place(int(vids[0])).offset)
    start_fails_at(mgr, monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected"):
        mover.move(rows, Tier.DRAM)  # the first block's read fails, the second batch never starts
    monkeypatch.undo()
    mgr.placement._evict(rows[:1])  # the corrupt block leaves the cache some other way
    new = publish(mgr, a, lid, [99])
    assert mgr.table.rows(new)[0] == rows[0], "the freed row is reused (the case under test)"
    assert len(mover.take_lost()) == 0
    assert_intact(mgr, np.concatenate([vids[1:], new]), [2, 99])


def test_a_lookup_whose_prefetch_reads_a_corrupt_block_answers_the_prefix_before_it(make_mgr):
    """The prefetch that a lookup starts drops a block whose NVMe read fails (and what hangs below
    it). The lookup's answer was computed before: it named the freed rows, and building its places
    raised `ValueError: -1 is not a valid Tier`; the daemon's records of those rows (lookup_rows)
    gave tier -1 and the vid that the row's next block would get."""
    m = make_mgr(prefetch_window=2)
    keys = list(range(1, 7))
    a, lid, vids = chain_on_nvme(m, keys)
    m.arenas[Tier.NVME].corrupt_for_test(m.place(int(vids[1])).offset)
    assert [p.vid for p in m.lookup(keys, lid)] == [int(vids[0])], "the prefix up to the corrupt block"
    assert m.placement.stats.lost == 1
    assert m.table.lookup(keys, lid).tolist() == m.table.rows(vids[:1]).tolist()
    rows = m.lookup_rows(keys, lid)
    assert (m.table.cols.tier[rows] >= 0).all()
    assert_intact(m, vids[:1], keys[:1])
    assert m.acquire(a, vids[:1]) is not None and np.array_equal(m.view(int(vids[0])), pattern(1))


def test_an_acquire_of_blocks_whose_prefetch_read_failed_in_flight_names_the_dropped_one(make_mgr):
    """The daemon leaves a lookup's prefetch reads in flight (read_later): the lookup answers the
    whole chain, and the acquire after it, which ends those reads, finds one dropped (its checksum
    failed). It said `ValueError: 'list' argument must have no negative elements` (the dropped
    row's tier, -1, counted as a read's origin); it names the block, as a failed promotion does."""
    m = make_mgr(prefetch_window=2)
    keys = list(range(1, 4))
    a, lid, vids = chain_on_nvme(m, keys)
    m.arenas[Tier.NVME].corrupt_for_test(m.place(int(vids[1])).offset)
    m.placement.read_later = True
    try:
        found = [p.vid for p in m.lookup(keys, lid)]
        assert found == [int(v) for v in vids] and m.placement.in_flight
        with pytest.raises(UnknownBlock, match=f"block {int(vids[1]):#x} failed its checksum.*look the chain up again"):
            m.acquire(a, found)
    finally:
        m.placement.read_later = False
    m.check_invariants()
    assert [p.vid for p in m.lookup(keys, lid)] == [int(vids[0])]  # looked up again: the prefix before it
    assert m.acquire(a, vids[:1]) is not None and np.array_equal(m.view(int(vids[0])), pattern(1))


def test_a_lookup_whose_prefetch_makes_room_keeps_its_own_chain(make_mgr):
    """The same without a fault: the room a lookup's prefetch makes in full tiers used to evict the
    prefix's own cold tail from NVMe, and the answer named those freed rows (tier -1). The chain the
    reader is about to read is now kept: the room comes from other blocks."""
    m = make_mgr(prefetch_window=2)
    keys = list(range(1, 21))
    a, lid, vids = chain_on_nvme(m, keys)
    key = 1000
    for tier, free_blocks in ((Tier.NVME, 128 - 20), (Tier.DRAM, 64), (Tier.HBM, 64)):
        while free_blocks:
            n = min(free_blocks, 32)
            more = publish(m, a, lid, list(range(key, key + n)), chained=False)
            key += n
            free_blocks -= n
            if tier != Tier.HBM:
                assert m.mover.move(m.table.rows(more), Tier.DRAM).all()
            if tier == Tier.NVME:
                assert m.mover.move(m.table.rows(more), Tier.NVME).all()
    others = np.setdiff1d(m.table.live_rows(), m.table.rows(vids))
    m.table.touch(others, m.table.clock() + 3600)  # everything but the prefix is hot
    rows = m.lookup_rows(keys, lid)
    assert (m.table.cols.tier[rows] >= 0).all(), "only live blocks in the answer"
    assert len(rows) == len(keys), "the prefetch's room-making took the chain's own cold tail"
    assert_intact(m, vids, keys)


def test_a_call_whose_own_work_is_done_succeeds_when_a_follow_up_fails(make_mgr, monkeypatch, caplog):
    # free's own work (the blocks are freed) is done before it grants waiting reservations, and a
    # lookup's answer is known before its prefetch: a failure in those is logged, not the call's.
    mgr = make_mgr(prefetch_window=4)
    client, lid = mgr.attach("c"), mgr.register_layout(LAYOUT)
    vids = mgr.allocate(client, lid, 2)

    def broken():
        raise RuntimeError("injected: follow-up failed")

    monkeypatch.setattr(mgr.admission, "tick", broken)
    with caplog.at_level("ERROR", logger="dflash2.manager"):
        assert mgr.free(client, vids) == 2
    assert "granting waiting reservations after a free failed" in caplog.text
    keys = list(range(100, 104))
    published = publish(mgr, client, lid, keys)
    to_nvme(mgr, published)
    monkeypatch.setattr(mgr.prefetcher, "ahead", lambda *a, **k: broken())
    with caplog.at_level("ERROR", logger="dflash2.manager"):
        assert [p.vid for p in mgr.lookup(keys, lid)] == published.tolist()
    assert "the prefetch of a lookup failed" in caplog.text
    mgr.check_invariants()


def test_an_allocation_that_only_page_tails_could_hold_is_never_fits(make_manager):
    # 64 HBM pages of 16 KiB hold 192 blocks of 5 KiB (three a page; the 1 KiB tails hold none): 200
    # are under the tier's bytes but can never fit. NeverFits at once, not None ("no room now").
    from conftest import MLA

    from dflash2.errors import NeverFits

    m = make_manager(hbm_blocks=64)
    client, lid = m.attach("c"), m.register_layout(MLA)
    assert 200 * MLA.block_bytes < m.table.allocators[Tier.HBM].capacity_bytes
    with pytest.raises(NeverFits, match="the whole tier holds 192 of them"):
        m.allocate(client, lid, 200)
    assert len(m.allocate(client, lid, 192)) == 192


@pytest.mark.parametrize("policy", ["heat", "lru"])
def test_allocations_evict_idle_blocks_while_nvme_writes_fail(config_file, instance_name, monkeypatch, policy):
    """A full (or failing) disk under the NVMe tier fails every write, so nothing moves down from
    DRAM, and nothing from HBM into a full DRAM. The blocks there are idle cached copies: room is
    made by dropping them. Before, room-making tried to drop only the blocks it had chosen to
    demote, which are often parents of cached blocks above (not droppable), and so refused every
    allocation ("hbm is full of blocks that cannot move now") while the disk stayed full."""
    import errno
    cfg = load_config(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                          "staging_buffer_size_mb": 1},
                                  kv_block={"block_size": 16, "prefetch_window": 0}, policy={"name": policy}))
    m = build_manager(cfg, instance=instance_name)
    try:
        a = m.attach("a")
        lid = m.register_layout(LAYOUT)
        for c in range(12):  # 192 blocks in chains of 16: HBM and DRAM full, NVMe half
            publish(m, a, lid, [1000 * c + i + 1 for i in range(16)])
        m.tick()

        def full_disk(offsets, sources):
            raise OSError(errno.ENOSPC, "No space left on device")
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
    finally:
        m.close()


def test_a_tier_whose_writes_fail_takes_no_blocks_until_its_back_off_ends(mgr, monkeypatch, caplog):
    """NVMe writes that fail (a full disk) start a back-off: no block goes down to NVMe for a
    second (DRAM is then the last tier: what leaves it is dropped), the next failure doubles it, and
    a write that works ends it. Before, every room-making retried the writes (a failed batch
    each time, a traceback each in the log)."""
    import errno

    now = [0.0]
    pl = mgr.placement
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    for c in range(12):  # HBM and DRAM full, NVMe half
        publish(mgr, a, lid, [1000 * c + i + 1 for i in range(16)])
    nvme = mgr.arenas[Tier.NVME]
    write, writes, failing = nvme.write_blocks, [], [True]

    def disk(offsets, sources):
        writes.append(len(offsets))
        if failing[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(offsets, sources)
    monkeypatch.setattr(nvme, "write_blocks", disk)
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
    import errno

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

    def full_disk(offsets, sources):
        raise OSError(errno.ENOSPC, "No space left on device")
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
    import errno

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

    def full_disk(offsets, sources):
        raise OSError(errno.ENOSPC, "No space left on device")
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


def dram_full_of_idle_blocks(mgr, clock) -> None:
    """62 of DRAM's 64 blocks cached (over its high watermark), idle, aged one tick apart."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    for k in range(62):
        clock.advance(1)
        vids = mgr.allocate(a, lid, 1, tier=Tier.DRAM)
        mgr.view(int(vids[0]))[:] = pattern(k + 1)
        mgr.free(a, mgr.commit(a, vids, keys=[k + 1]))


def test_a_drain_waits_while_nvme_backs_off_instead_of_dropping_what_no_request_asked_for(mgr, monkeypatch, clock):
    """DRAM over its high watermark of idle cached blocks and NVMe backing off after a failed write:
    the background drain would drop (DRAM is the last tier meanwhile) down to the low watermark,
    blocks and their NVMe descendants that no allocation asked for (soak 2: one failed batch dropped
    DRAM from 0.969 to 0.50). It waits, keeping its cut, and moves them once NVMe takes writes again."""
    dram_full_of_idle_blocks(mgr, clock)
    pl = mgr.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    pl.write_backoff[Tier.NVME] = (101.0, 1.0)  # as after a failed write
    assert pl.lower(Tier.DRAM) is None
    mgr.tick()
    assert Tier.DRAM in pl.draining and not mgr.draining(), "draining, but waiting: the idle loop must not spin"
    assert mgr.stats()["placement"]["evicted"] == 0 and mgr.stats()["tiers"]["dram"]["blocks"] == 62
    now[0] = 101.5  # the back-off is over
    assert mgr.draining()
    mgr.tick()
    placed = mgr.stats()["placement"]
    assert placed["evicted"] == 0 and placed["demoted"] > 0, placed
    assert mgr.stats()["tiers"]["dram"]["blocks"] <= int(pl.watermarks[Tier.DRAM].low * 64) + 1
    mgr.check_invariants()



def idle_blocks_in(mgr, clock, tier: Tier, n: int, first_key: int = 1) -> None:
    """n cached blocks in `tier`, idle, aged one tick apart."""
    a = mgr.attach(f"fill-{tier.label}")
    lid = mgr.register_layout(LAYOUT)
    for k in range(first_key, first_key + n):
        clock.advance(1)
        vids = mgr.allocate(a, lid, 1, tier=tier)
        mgr.view(int(vids[0]))[:] = pattern(k)
        mgr.free(a, mgr.commit(a, vids, keys=[k]))


def test_hbm_drains_into_dram_while_nvme_backs_off(mgr, monkeypatch, clock):
    """NVMe backing off after failed writes holds the drain of DRAM (above), not HBM's: HBM drains
    into DRAM, which needs no NVMe write to take blocks. Before, HBM stayed over its high watermark
    for the whole back-off (up to 60 s, again and again on a full disk) over an empty DRAM."""
    idle_blocks_in(mgr, clock, Tier.HBM, 62)
    pl = mgr.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    pl.write_backoff[Tier.NVME] = (160.0, 60.0)  # as after long failing retries
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
    import errno

    dram_full_of_idle_blocks(mgr, clock)
    pl = mgr.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    nvme = mgr.arenas[Tier.NVME]
    write = nvme.write_blocks

    def full_disk(offsets, sources):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(nvme, "write_blocks", full_disk)
    monkeypatch.setattr(pl, "REBALANCE_BUDGET_S", 30.0)  # time enough to drain all of it in one step
    mgr.tick()
    assert pl.stats.write_backoffs == 1
    assert mgr.stats()["placement"]["evicted"] == 0 and mgr.stats()["tiers"]["dram"]["blocks"] == 62
    assert Tier.DRAM in pl.draining and not mgr.draining(), "waiting, keeping its cut"
    monkeypatch.setattr(nvme, "write_blocks", write)
    now[0] += 2.0  # the back-off is over, the disk has room again
    mgr.tick()
    placed = mgr.stats()["placement"]
    assert placed["evicted"] == 0 and placed["demoted"] > 0, placed
    assert mgr.stats()["tiers"]["dram"]["blocks"] <= int(pl.watermarks[Tier.DRAM].low * 64) + 1
    mgr.check_invariants()

# -- I/O errors (EIO) under the NVMe tier (found with a failing block device under the tier) -------

def eio_at(m, monkeypatch, vids) -> None:
    """Every read that touches these blocks' extents of the NVMe file fails with EIO, as a block
    device with bad sectors there answers (the staging I/O wrappers call os.preadv)."""
    fd = m.arenas[Tier.NVME]._fd
    bad = [(HEADER_BYTES + p.offset, HEADER_BYTES + p.offset + p.nbytes) for p in (m.place(int(v)) for v in vids)]
    real = os.preadv

    def preadv(f, bufs, offset):
        n = sum(memoryview(b).nbytes for b in bufs)
        if f == fd and any(offset < e and offset + n > s for s, e in bad):
            raise OSError(errno.EIO, "Input/output error")
        return real(f, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)


def test_a_bad_sector_drops_its_block_not_the_prefix_read_with_it(mgr, monkeypatch):
    """One unreadable block failed its whole batch's read: every block of the batch was dropped (on
    a device with a quarter of the NVMe file unreadable, 1,601 of 2,471 cached blocks in 20 s). Now
    only the unreadable block (and what hangs below it) is a miss; its prefix comes up."""
    keys = list(range(1, 7))
    a, lid, vids = chain_on_nvme(mgr, keys)
    eio_at(mgr, monkeypatch, vids[3:4])
    with pytest.raises(UnknownBlock, match=f"block {int(vids[3]):#x} failed"):
        mgr.acquire(a, vids)
    monkeypatch.undo()
    mgr.check_invariants()
    assert [p.vid for p in mgr.lookup(keys, lid)] == vids[:3].tolist(), "the prefix before the bad block stays"
    assert mgr.placement.stats.lost == 1
    places = mgr.acquire(a, vids[:3])
    assert places is not None
    assert all(np.array_equal(mgr.view(p.vid), pattern(k)) for p, k in zip(places, keys[:3]))


def test_an_acquire_whose_nvme_read_failed_counts_no_hit(mgr, monkeypatch):
    """The reads (dflash2_cache_hits_total, hbm_hit_ratio) were counted before the promotion: blocks
    whose NVMe read failed (UnknownBlock) counted as hits from NVMe, though nothing was read."""
    keys = [1, 2, 3]
    a, lid, vids = chain_on_nvme(mgr, keys)
    eio_at(mgr, monkeypatch, vids)
    with pytest.raises(UnknownBlock):
        mgr.acquire(a, vids)
    stats = mgr.stats()
    assert stats["reads"] == {} and stats["hbm_hit_ratio"] is None, stats["reads"]


def test_failed_nvme_reads_are_logged_once_a_minute_with_the_count_left_out(mgr, monkeypatch, caplog):
    """A warning per failed batch: a flaky disk (down 1 s in 5) gave 5,400 of them in 4 minutes,
    while the tracebacks were once a minute (FailureLog). Now once a minute per direction too, the
    next line saying how many batches and blocks were left out."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    vids = publish(mgr, a, lid, [1, 2, 3, 4], chained=False)
    to_nvme(mgr, vids)
    eio_at(mgr, monkeypatch, vids)
    now = [1000.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: now[0])  # the repeat limit's clock
    with caplog.at_level(logging.WARNING, logger="dflash2.swap"):
        for v in vids[:3].tolist():
            with pytest.raises(UnknownBlock):
                mgr.acquire(a, [v])
        now[0] += 60
        with pytest.raises(UnknownBlock):
            mgr.acquire(a, vids[3:])
    lines = [r.getMessage() for r in caplog.records if "read back from NVMe failed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "(2 more such batches (2 blocks) since the last one logged, 60 s ago, were not logged)" in lines[1]
    assert mgr.placement.stats.lost == 4, "every failure is counted all the same"


@pytest.fixture
def heat_mgr(config_file, instance_name):
    """As `mgr`, with the heat policy (its split counts the keyed blocks of each tier)."""
    cfg = load_config(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                          "staging_buffer_size_mb": 1},
                                  kv_block={"block_size": 16, "prefetch_window": 0}, policy={"name": "heat"}))
    m = build_manager(cfg, instance=instance_name)
    yield m
    m.close()


def shared_root_on_nvme(m) -> tuple[int, int, np.ndarray]:
    """A root block (key 1) and three children of it (keys 2-4: sessions sharing a prefix), all on
    NVMe: (client, layout, [root, children])."""
    a = m.attach("a")
    lid = m.register_layout(LAYOUT)
    root = publish(m, a, lid, [1])
    kids = []
    for k in (2, 3, 4):
        v = m.allocate(a, lid, 1)
        m.view(int(v[0]))[:] = pattern(k)
        kids.append(m.commit(a, v, keys=[k], parent=int(root[0])))
        m.free(a, kids[-1])
    vids = np.concatenate([root, *kids])
    to_nvme(m, vids)
    return a, lid, vids


def keyed_blocks(m) -> int:
    c = m.table.cols
    return int(((c.key != 0) & (c.state != 0)).sum())


def test_a_lost_block_and_the_children_dropped_with_it_leave_the_policy_and_are_counted(heat_mgr, monkeypatch):
    """The root's read back fails: it is dropped, and its children with it (nobody could find them by
    lookup). Before, neither reached the policy (its split went on counting 4 blocks that were gone,
    until their rows were used again) and the children were counted nowhere."""
    m = heat_mgr
    a, _, vids = shared_root_on_nvme(m)
    assert m.policy.split.sizes.sum() == keyed_blocks(m) == 4
    eio_at(m, monkeypatch, vids[:1])
    with pytest.raises(UnknownBlock):
        m.acquire(a, vids[:1])
    placed = m.stats()["placement"]
    assert (placed["lost"], placed["orphaned"]) == (1, 3), placed
    assert keyed_blocks(m) == 0 and m.policy.split.sizes.sum() == 0, m.policy.split.sizes
    m.check_invariants()


def test_a_lost_block_its_reader_holds_is_read_once_and_counted_once(heat_mgr, monkeypatch):
    """A reader holding a reference to the block (lookup, add_ref, acquire) keeps it after its read
    failed; the promotion's retry of the blocks that did not come up read it again, failed again and
    counted it lost twice."""
    m = heat_mgr
    a, _, vids = shared_root_on_nvme(m)
    eio_at(m, monkeypatch, vids[:1])
    batches = []
    start = m.backend.start

    def counted(batch):
        batches.append((batch.src_tier, len(batch)))
        return start(batch)
    monkeypatch.setattr(m.backend, "start", counted)
    m.add_ref(a, vids[:1])
    with pytest.raises(UnknownBlock):
        m.acquire(a, vids[:1])
    assert m.stats()["placement"]["lost"] == 1
    assert batches == [(Tier.NVME, 1)], batches
    m.free(a, vids[:1])
    m.check_invariants()


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
