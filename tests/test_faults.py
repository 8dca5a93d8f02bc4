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
from dflash2.errors import UnknownBlock
from dflash2.mover import Mover
from dflash2.tiers import Tier
from dflash2.transfer import failures
from fault_helpers import LAYOUT, assert_intact, chain_on_nvme, make_mgr, mgr, pattern, publish  # noqa: F401  (fixtures)
from fault_helpers import stored_bytes, to_nvme


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
        with pytest.raises(UnknownBlock, match=f"block {int(vids[1]):#x} failed its read back from NVMe \\(an I/O error, or bytes that failed their checksum.*look the chain up again"):
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
def heat_mgr(make_mgr):
    """As `mgr`, with the heat policy (its split counts the keyed blocks of each tier)."""
    return make_mgr(policy="heat")


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
    offset = m.place(int(vids[0])).offset
    alloc = m.table.allocators[Tier.NVME]
    with pytest.raises(UnknownBlock):
        m.acquire(a, vids[:1])
    assert m.stats()["placement"]["lost"] == 1
    assert batches == [(Tier.NVME, 1)], batches
    assert alloc.quarantined_bytes == 0, "the slot still holds the block its reader keeps"
    m.free(a, vids[:1])
    assert alloc.quarantined_offsets().tolist() == [offset], "set aside as its last reference went"
    m.check_invariants()


def test_a_slot_whose_read_failed_is_set_aside_until_a_re_test_reads_it_back(mgr, monkeypatch, caplog):
    """A sector that reads back wrong (EIO) lost its block, and its slot went back to the free pool:
    the next block written there was lost in turn when read. Now the slot is set aside when its block
    is dropped (said in the log), no block is written there while it is, and the re-test, which writes
    a pattern and reads it back, keeps it aside while the sector fails and gives it back once it reads."""
    import time

    keys = list(range(1, 7))
    a, lid, vids = chain_on_nvme(mgr, keys)
    place = mgr.place(int(vids[3]))
    bad_offset, inode = place.offset, os.fstat(mgr.arenas[Tier.NVME]._fd).st_ino
    bad = (HEADER_BYTES + bad_offset, HEADER_BYTES + bad_offset + place.nbytes)
    real = os.preadv

    def preadv(f, bufs, offset):  # (any descriptor of the file: the re-test reads through its own)
        n = sum(memoryview(b).nbytes for b in bufs)
        if offset < bad[1] and offset + n > bad[0] and os.fstat(f).st_ino == inode:
            raise OSError(errno.EIO, "Input/output error")
        return real(f, bufs, offset)
    monkeypatch.setattr(os, "preadv", preadv)  # (the sector stays bad: reads of that extent fail)
    alloc = mgr.table.allocators[Tier.NVME]
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        with pytest.raises(UnknownBlock, match=f"block {int(vids[3]):#x} failed"):
            mgr.acquire(a, vids)
    assert alloc.quarantined_offsets().tolist() == [bad_offset]
    assert any("whose reads failed" in r.getMessage() for r in caplog.records), caplog.text
    from dflash2.status import render
    view = render({"tiers": mgr.stats()["tiers"]})
    assert "slots set aside after failed writes or reads (re-tested, given back once sound): nvme 16.0 KiB" in view
    mgr.check_invariants()
    more = publish(mgr, a, lid, list(range(100, 140)), chained=False)  # 40 more blocks down to NVMe
    to_nvme(mgr, more)
    assert bad_offset not in [mgr.place(int(v)).offset for v in more]
    assert_intact(mgr, more, list(range(100, 140)))

    now = [1000.0]
    monkeypatch.setattr(mgr.placement, "monotonic", lambda: now[0])
    q = mgr.mover.quarantine

    def step() -> None:  # a background step, then the one that takes its re-test's verdict
        mgr.tick()
        deadline = time.monotonic() + 30
        while q.retests_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        mgr.tick()
    mgr.tick()  # the re-test's clock starts when the slot is first seen set aside
    now[0] += q.RETEST_FIRST_S + 1
    step()
    assert alloc.quarantined_offsets().tolist() == [bad_offset], "still unreadable: kept aside"
    monkeypatch.undo()  # the sector reads again
    monkeypatch.setattr(mgr.placement, "monotonic", lambda: now[0])
    now[0] += q.RETEST_EVERY_S + 1
    step()
    assert alloc.quarantined_bytes == 0 and q.given_back == 1
    assert "slots set aside" not in render({"tiers": mgr.stats()["tiers"]})
    mgr.check_invariants()


def test_a_disk_that_reads_nothing_is_set_aside_whole_and_the_tiers_above_go_on(mgr, monkeypatch, caplog):
    """Every read from NVMe fails (a dead disk that still takes writes): each block read loses its
    slot to the set-aside, until the whole tier is set aside (said as an error past 5%); the
    tiers above go on serving, their room made by dropping what NVMe can no longer take."""
    inode = os.fstat(mgr.arenas[Tier.NVME]._fd).st_ino
    real = os.preadv

    def preadv(f, bufs, offset):
        if os.fstat(f).st_ino == inode:
            raise OSError(errno.EIO, "Input/output error")
        return real(f, bufs, offset)
    monkeypatch.setattr(os, "preadv", preadv)
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    alloc = mgr.table.allocators[Tier.NVME]
    key = 1
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        for _ in range(12):  # 12 rounds of 16 blocks through NVMe (128 slots): each read back fails
            vids = publish(mgr, a, lid, list(range(key, key + 16)), chained=False)
            rows = mgr.table.rows(vids)
            mgr.mover.move(rows, Tier.DRAM)
            moved = mgr.mover.move(rows, Tier.NVME)
            on_nvme = vids[moved]
            if len(on_nvme):
                with pytest.raises(UnknownBlock):
                    mgr.acquire(a, on_nvme)
            mgr.check_invariants()
            key += 16
    assert alloc.quarantined_bytes == alloc.arena_bytes, "every slot was read and failed"
    assert "the disk under it (memory.nvme_path) is failing" in caplog.text
    stats = mgr.stats()["tiers"]["nvme"]
    assert stats["capacity_bytes"] == 0 and stats["blocks"] == 0, stats
    for _ in range(8):  # HBM and DRAM (64 blocks each) go on taking blocks: their room is made
        vids = publish(mgr, a, lid, list(range(key, key + 32)), chained=False)
        assert len(vids) == 32
        mgr.tick()
        mgr.check_invariants()
        key += 32
    assert [p.vid for p in mgr.lookup([key - 1], lid)] == [int(vids[-1])]


def test_a_suspect_slot_that_cannot_be_set_aside_is_said_and_the_free_goes_through(mgr, monkeypatch, caplog):
    """Setting a slot aside runs inside the free that releases it: where the allocator refuses it (a
    slot it does not hold as free, which no path is known to give), the free must not fail halfway:
    an error line says so, and the slot stays in use."""
    from dflash2.errors import ArenaError

    keys = [1, 2, 3]
    a, lid, vids = chain_on_nvme(mgr, keys)
    eio_at(mgr, monkeypatch, vids[2:])

    def refuse(*args, **kwargs):
        raise ArenaError("injected: not a free slot")
    alloc = mgr.table.allocators[Tier.NVME]
    monkeypatch.setattr(alloc, "quarantine", refuse)
    with caplog.at_level(logging.ERROR, logger="dflash2.quarantine"):
        with pytest.raises(UnknownBlock):  # (the block, held by nobody, is dropped and its slot freed)
            mgr.acquire(a, vids)
    assert "1 nvme slots whose reads failed could not be set aside (injected: not a free slot)" in caplog.text
    assert alloc.quarantined_bytes == 0 and mgr.placement.stats.lost == 1
    mgr.check_invariants()
    assert [p.vid for p in mgr.lookup(keys[:2], lid)] == vids[:2].tolist()


def test_blocks_lost_with_a_cut_nvme_file_are_misses_and_no_slot_is_set_aside(mgr, caplog):
    """A review's script: after `: > nvme.cache`, every block past the cut read as a failed read: its
    slot set aside as a bad sector's, and past 5% of the tier the disk said to be failing (replace it)."""
    keys = list(range(1, 33))
    a, lid, vids = chain_on_nvme(mgr, keys)
    os.truncate(mgr.arenas[Tier.NVME].path, 0)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(UnknownBlock):
            mgr.acquire(a, vids[:1])
        mgr.tick()
    assert "was cut to 0 bytes by another process" in caplog.text
    assert "failing" not in caplog.text and "set aside" not in caplog.text, caplog.text
    assert mgr.table.allocators[Tier.NVME].quarantined_bytes == 0
    assert not len(mgr.lookup(a, keys))  # (the chain is gone: misses)
    publish(mgr, a, lid, [101, 102])  # the tier goes on: its slots, the cut ones too, hold new blocks
    mgr.check_invariants()


def test_the_slots_of_one_batchs_failed_reads_are_set_aside_and_said_together(mgr, monkeypatch, caplog):
    """A batch whose reads failed for several blocks sets aside all their slots as one: the warning
    names them all. Before, each dropped block's slot was set aside by itself as it was freed, and the
    once-a-minute warning said "1 nvme slots" beside "2 of 2 blocks read back from NVMe failed" (the
    other counted later as one more "batch"; a review's daemon: 16 failed, "1 nvme slots")."""
    keys = list(range(1, 7))
    a, lid, vids = chain_on_nvme(mgr, keys)
    places = [mgr.place(int(v)) for v in vids[3:5]]
    bad = [(HEADER_BYTES + p.offset, HEADER_BYTES + p.offset + p.nbytes) for p in places]
    inode = os.fstat(mgr.arenas[Tier.NVME]._fd).st_ino
    real = os.preadv

    def preadv(f, bufs, offset):
        n = sum(memoryview(b).nbytes for b in bufs)
        if any(offset < hi and offset + n > lo for lo, hi in bad) and os.fstat(f).st_ino == inode:
            raise OSError(errno.EIO, "Input/output error")
        return real(f, bufs, offset)
    monkeypatch.setattr(os, "preadv", preadv)
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        with pytest.raises(UnknownBlock):
            mgr.acquire(a, vids)
    alloc = mgr.table.allocators[Tier.NVME]
    assert sorted(alloc.quarantined_offsets().tolist()) == sorted(p.offset for p in places)
    said = [r.getMessage() for r in caplog.records if "whose reads failed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("2 nvme slots"), said
    mgr.check_invariants()
