"""A disk under NVMe whose writes fail: probes that end a back-off once the disk takes writes again
(backoff.py), and slots whose own writes fail with an I/O error set aside (quarantine.py) until a re-test finds them sound.

Real host managers (test_faults.py's fixtures: 64 blocks of HBM and DRAM, 128 of NVMe, 16 KiB each);
failures are injected as test_faults.py does: NVMe's write_blocks raising (a full disk), or os.pwritev
failing at some offsets of the NVMe file (a bad region: EIO, or ENOSPC for contrast).
"""

import errno
import logging
import os
import re
import threading
import time

import numpy as np
import pytest

from dflash2.alloc import SlotAllocator
from dflash2.arena.nvme import HEADER_BYTES
from dflash2.errors import ArenaError
from dflash2.table.columns import NO_ROW
from dflash2.tiers import Tier
from fault_helpers import LAYOUT, failing_disk, idle_blocks_in, make_mgr, mgr, pattern, publish  # noqa: F401  (fixtures)

SLOT = LAYOUT.block_bytes  # 16 KiB: a multiple of the NVMe alignment, so a block's slot is its size


def backing_off_for(m, monkeypatch, seconds: float):
    """With DRAM over its high watermark (filled by the caller) and NVMe's disk full: steps until NVMe
    backs off for `seconds` (1, 2, 4, ...: each failed retry of the drain doubles it). Returns the
    placement's clock (a one-item list), and failing_disk's `failing` and `writes`."""
    pl = m.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    failing, writes = failing_disk(m, monkeypatch)
    m.tick()
    while pl.write_backoff[Tier.NVME][1] < seconds:
        now[0] = pl.write_backoff[Tier.NVME][0]  # over: the drain writes again, fails, backs off twice as long
        m.tick()
    assert pl.write_backoff[Tier.NVME][1] == seconds
    return now, failing, writes


def assert_cached(m, keys) -> None:
    """Invariants hold; each key is still cached, holding its own bytes (read where it lies)."""
    m.check_invariants()
    for k in keys:
        found = m.lookup([k])
        assert len(found) == 1, f"block of key {k} was lost"
        p = found[0]
        if p.tier == Tier.NVME:
            buf = np.zeros(p.nbytes, np.uint8)
            assert m.arenas[Tier.NVME].read_blocks([p.offset], [buf])[0], f"block of key {k} unreadable"
        else:
            buf = np.array(m.view(p.vid))
        assert np.array_equal(buf, pattern(k)), f"block of key {k} holds wrong bytes"


def assert_prefix_order(m) -> None:
    """No cached block lies in a faster tier than its parent (parents leave a tier after their children)."""
    c = m.table.cols
    live = m.table.live_rows()
    linked = live[c.parent[live] != NO_ROW]
    assert (c.tier[linked] >= c.tier[c.parent[linked]]).all()


# -- probes: a back-off ended by the first write that works, not by its clock ----------------------

def test_a_probe_ends_a_long_back_off_once_the_disk_takes_writes_again(mgr, monkeypatch, clock, caplog):
    """After failed retries NVMe backs off for 8 s (up to 60): a disk that had room again waited all
    of it before the DRAM drain went on. The step now tries one block's write a second after the last
    failed one; it works, the back-off ends there, and the drain goes on in the same step."""
    idle_blocks_in(mgr, clock, Tier.DRAM, 62)
    pl = mgr.placement
    now, failing, writes = backing_off_for(mgr, monkeypatch, 8.0)
    until = pl.write_backoff[Tier.NVME][0]
    tried = len(writes)
    monkeypatch.setattr(pl, "REBALANCE_BUDGET_S", 30.0)  # time enough to drain all of it in one step (a loaded machine)
    now[0] += 0.5
    mgr.tick()
    assert len(writes) == tried, "no write tried within WRITE_PROBE_EVERY_S of the last"
    failing[0] = False  # the disk has room again
    now[0] += 0.5
    with caplog.at_level(logging.INFO, logger="dflash2.placement"):
        mgr.tick()
    assert now[0] < until and Tier.NVME not in pl.write_backoff and pl.lower(Tier.DRAM) == Tier.NVME
    assert writes[tried] == 1, "the probe writes one block"
    placed = mgr.stats()["placement"]
    assert placed["evicted"] == 0 and placed["demoted"] > 1, placed  # the probe's block, then the drain's
    assert mgr.stats()["tiers"]["dram"]["blocks"] <= int(pl.watermarks[Tier.DRAM].low * 64) + 1
    said = [r.getMessage() for r in caplog.records if "work again" in r.getMessage()]
    assert len(said) == 1 and re.search(r"writes to nvme work again after 8\.0 s backing off \(a probe", said[0]), said
    assert_cached(mgr, range(1, 63))


def test_writes_that_began_before_a_back_off_do_not_lengthen_it(mgr, monkeypatch):
    """soak11: two failed batches that ended together, both begun before the back-off (copies in
    flight, or a move whose tier below was chosen before a settle in the same call began the
    back-off), each doubled it: 8 s to 16 s to 32 s at once. A failure while the tier backs off
    leaves the back-off as it is; one after it ran out (a retry's) doubles it."""
    pl = mgr.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    pl._note_writes(Tier.NVME, failed=4, moved=0)
    assert pl.write_backoff[Tier.NVME] == (101.0, 1.0)
    pl._note_writes(Tier.NVME, failed=4, moved=0)  # a second batch, ending in the same call
    assert pl.write_backoff[Tier.NVME] == (101.0, 1.0) and pl.stats.write_backoffs == 1
    now[0] = 101.0  # run out: the next failure is a retry's
    pl._note_writes(Tier.NVME, failed=4, moved=0)
    assert pl.write_backoff[Tier.NVME] == (103.0, 2.0) and pl.stats.write_backoffs == 2
    pl._note_writes(Tier.NVME, failed=0, moved=4)  # a write that works ends it
    assert Tier.NVME not in pl.write_backoff


def test_a_failing_probe_loses_nothing_and_leaves_the_back_off_as_it_was(mgr, monkeypatch, clock, caplog):
    """While the disk stays full, a probe a second fails: its block stays in DRAM (nothing dropped,
    nothing lost), the back-off keeps its end and length (not doubled), no warning is logged again,
    and no probe comes sooner than a second after the last."""
    idle_blocks_in(mgr, clock, Tier.DRAM, 62)
    pl = mgr.placement
    now, failing, writes = backing_off_for(mgr, monkeypatch, 4.0)
    off, backoffs, tried = pl.write_backoff[Tier.NVME], pl.stats.write_backoffs, len(writes)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash2.placement"):
        for k in range(1, 4):
            now[0] += 0.5
            mgr.tick()
            assert len(writes) == tried + k - 1, "at most one probe a second"
            now[0] += 0.5
            mgr.tick()
            assert len(writes) == tried + k and writes[-1] == 1, "one probe of one block"
            assert pl.write_backoff[Tier.NVME] == off and pl.stats.write_backoffs == backoffs
    assert not [r for r in caplog.records if r.name == "dflash2.placement"], "a failed probe says nothing more"
    placed = mgr.stats()["placement"]
    assert placed["evicted"] == 0 and placed["demoted"] == 0, placed
    assert mgr.stats()["tiers"]["dram"]["blocks"] == 62 and mgr.stats()["tiers"]["nvme"]["blocks"] == 0
    assert_cached(mgr, range(1, 63))


def test_a_probe_moves_a_leaf_never_a_parent_above_its_children(mgr, monkeypatch, clock):
    """DRAM full of two-block chains whose roots are the coldest blocks: the probe's block is a
    leaf (its parent stays in DRAM), so no block ever lies below its child."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    for c in range(31):
        clock.advance(1)
        vids = mgr.allocate(a, lid, 2, tier=Tier.DRAM)
        keys = [1000 * c + 1, 1000 * c + 2]
        for v, k in zip(vids.tolist(), keys):
            mgr.view(v)[:] = pattern(k)
        mgr.free(a, mgr.commit(a, vids, keys=keys))
    pl = mgr.placement
    now = [100.0]
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    pl.write_backoff[Tier.NVME] = (160.0, 60.0)  # as after long failing retries
    pl.probe_writes()  # (set by hand, no failed write on record: probed a second after it is seen)
    assert mgr.stats()["tiers"]["nvme"]["blocks"] == 0
    now[0] = 101.0
    pl.probe_writes()
    assert Tier.NVME not in pl.write_backoff
    c = mgr.table.cols
    on_nvme = np.flatnonzero((c.tier == int(Tier.NVME)) & (c.state != 0))
    assert len(on_nvme) == 1 and c.parent[on_nvme[0]] != NO_ROW, "one block, a chain's leaf"
    assert c.tier[c.parent[on_nvme[0]]] == int(Tier.DRAM)
    assert_prefix_order(mgr)
    assert_cached(mgr, [1000 * c + i for c in range(31) for i in (1, 2)])


# -- quarantine: slots whose own writes fail with EIO are never handed out again -------------------

def nvme_file(m):
    """A test of whether an fd is the NVMe tier's file (by inode: the re-test writes through a
    duplicate of the tier's descriptor, not the descriptor itself)."""
    st = os.fstat(m.arenas[Tier.NVME]._fd)

    def is_it(f) -> bool:
        try:
            o = os.fstat(f)
        except OSError:
            return False
        return (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino)
    return is_it


def bad_slots(m, monkeypatch, offsets, err=errno.EIO) -> tuple[threading.Event, threading.Event]:
    """Every write that touches these NVMe slots (offsets in the tier) fails with `err`, as a disk
    with a bad region there answers (the staging I/O wrappers call os.pwritev). Returns (answer,
    asked): such a write fails only once `answer` is set (it starts set; clear it for a disk that
    retries a bad sector before it answers), and sets `asked`."""
    ours = nvme_file(m)
    bad = [(HEADER_BYTES + o, HEADER_BYTES + o + SLOT) for o in offsets]
    real = os.pwritev
    answer, asked = threading.Event(), threading.Event()
    answer.set()

    def pwritev(f, bufs, offset):
        n = sum(memoryview(b).nbytes for b in bufs)
        if any(offset < e and offset + n > s for s, e in bad) and ours(f):
            asked.set()
            assert answer.wait(30), "the test never let the disk answer"
            raise OSError(err, os.strerror(err))
        return real(f, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    return answer, asked


def down_to_nvme(m, a, lid, keys) -> np.ndarray:
    """Publish one block per key (roots), move them to DRAM, then to NVMe; the NVMe move's mask."""
    rows = m.table.rows(publish(m, a, lid, keys, chained=False))
    assert m.mover.move(rows, Tier.DRAM).all()
    return m.mover.move(rows, Tier.NVME)


def test_slots_whose_writes_fail_with_eio_are_never_handed_out_again(mgr, monkeypatch, caplog):
    """Two bad slots in NVMe: the batch that takes them writes its other blocks (written again one
    by one) and sets those two aside; filling NVMe then uses every other slot and never those two
    again. Before, they went back to the free pool, and each batch that took them failed whole."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    bad = [2 * SLOT, 5 * SLOT]
    bad_slots(mgr, monkeypatch, bad)
    nvme_alloc = mgr.table.allocators[Tier.NVME]
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        moved = down_to_nvme(mgr, a, lid, list(range(1, 33)))
    assert moved.sum() == 30
    assert sorted(nvme_alloc.quarantined_offsets().tolist()) == bad
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash2.quarantine"]
    assert len(lines) == 1 and lines[0].startswith("2 nvme slots (32768 bytes") and "32768 bytes (1.56% of nvme)" in lines[0]
    tier = mgr.stats()["tiers"]["nvme"]
    assert tier["quarantined_bytes"] == 2 * SLOT and tier["capacity_bytes"] == nvme_alloc.arena_bytes - 2 * SLOT
    assert tier["used_bytes"] + tier["free_bytes"] == tier["capacity_bytes"], tier
    mgr.check_invariants()
    for r in range(1, 4):  # 96 more blocks: 94 fit in the 96 slots left
        down_to_nvme(mgr, a, lid, list(range(1 + 32 * r, 33 + 32 * r)))
        mgr.check_invariants()
    stuck = mgr.table.rows([p.vid for p in mgr.lookup([3, 6])])
    assert not mgr.mover.move(stuck, Tier.NVME).any(), "NVMe is full: no room for the two blocks left in DRAM"
    c = mgr.table.cols
    offsets = c.offset[np.flatnonzero((c.tier == int(Tier.NVME)) & (c.state != 0))]
    assert len(offsets) == 126 and not np.isin(offsets, bad).any()
    assert sorted(set(range(0, 128 * SLOT, SLOT)) - set(offsets.tolist())) == bad, "every other slot is used"
    tier = mgr.stats()["tiers"]["nvme"]
    assert tier["free_bytes"] == 0 and mgr.placement.used_fraction(Tier.NVME) == 1.0, tier
    assert_cached(mgr, range(1, 129))
    assert mgr.mover.stats[(Tier.DRAM, Tier.NVME)].failed_blocks == 2


def test_slots_whose_writes_fail_for_a_full_disk_are_used_again(mgr, monkeypatch):
    """ENOSPC is the disk's state, not the slot's: the batch fails whole (its blocks stay in DRAM),
    nothing is set aside, and once the disk has room the same slots take blocks."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    bad_slots(mgr, monkeypatch, [2 * SLOT, 5 * SLOT], err=errno.ENOSPC)
    assert not down_to_nvme(mgr, a, lid, list(range(1, 33))).any()
    assert mgr.stats()["tiers"]["nvme"]["quarantined_bytes"] == 0
    monkeypatch.undo()
    rows = mgr.table.rows([p.vid for p in mgr.lookup(list(range(1, 33)))])
    assert mgr.mover.move(rows, Tier.NVME).all()
    assert sorted(mgr.table.cols.offset[rows].tolist()) == list(range(0, 32 * SLOT, SLOT))
    assert_cached(mgr, range(1, 33))


def test_a_bad_region_no_longer_makes_nvme_back_off_again_and_again(mgr, monkeypatch, clock):
    """Requests through the manager with a bad region of four slots under NVMe: the drains' batches
    that meet it write their other blocks, and NVMe never backs off; it fills but for those slots.
    (Before: each such batch failed whole and started a back-off, the slots went back to the pool
    and the next batch took them again: about a third of NVMe in use in a helper's run.)"""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    bad_slots(mgr, monkeypatch, [o * SLOT for o in (1, 40, 41, 90)])
    most = 0  # NVMe's blocks at most, after a step

    def step() -> None:
        nonlocal most
        mgr.tick()
        most = max(most, mgr.stats()["tiers"]["nvme"]["blocks"])
    for c in range(16):  # 256 blocks in chains of 16: room for 64 + 64 + 124
        vids = mgr.allocate(a, lid, 16)
        assert vids is not None, mgr.allocate_refusal
        keys = [1000 * c + i + 1 for i in range(16)]
        for v, k in zip(vids.tolist(), keys):
            mgr.view(v)[:] = pattern(k)
        mgr.free(a, mgr.commit(a, vids, keys=keys))
        step()
    for _ in range(100):  # a step drains for its time budget: on a loaded machine, less a step
        if not mgr.draining():
            break
        step()
    assert mgr.placement.stats.write_backoffs == 0
    tier = mgr.stats()["tiers"]["nvme"]
    assert tier["quarantined_bytes"] == 4 * SLOT
    # Full but for its high watermark's slack (it drains itself from there down to its low one).
    assert most >= int(0.95 * 124) - 1, (most, tier)
    assert_prefix_order(mgr)
    mgr.check_invariants()


def test_past_a_twentieth_of_the_tier_set_aside_the_disk_is_failing_and_its_failures_count_again(mgr, monkeypatch,
                                                                                                   caplog):
    """Eight bad slots of 128 (over FAILING_FRACTION): said once, as an error. Slots that fail from
    then on are still set aside, but their failures are the disk's again (back-offs), so that a disk
    failing every write does not lose all of its slots within seconds."""
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    bad_slots(mgr, monkeypatch, [o * SLOT for o in (*range(8), 40, 41)])
    stats = mgr.mover.stats[(Tier.DRAM, Tier.NVME)]
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        assert down_to_nvme(mgr, a, lid, list(range(1, 33))).sum() == 24
        assert stats.slot_failed_blocks == 8 and mgr.mover.disk_failed_into(Tier.NVME) == 0
        assert down_to_nvme(mgr, a, lid, list(range(33, 65))).sum() == 30
    assert stats.failed_blocks == 10 and mgr.mover.disk_failed_into(Tier.NVME) == 2
    assert mgr.stats()["tiers"]["nvme"]["quarantined_bytes"] == 10 * SLOT
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "6.2% of nvme is set aside" in errors[0] and "is failing" in errors[0], errors
    mgr.check_invariants()


# -- the allocator's side ---------------------------------------------------------------------------

def test_quarantined_slots_leave_capacity_not_enter_used_and_bad_requests_are_refused():
    alloc = SlotAllocator(8 * 4096, 4096, 4096)
    got = alloc.alloc(4096, 4)
    alloc.free(4096, got[1:3])
    with pytest.raises(ArenaError, match="quarantine of slot 0 .*not a free slot"):
        alloc.quarantine(4096, [0])  # in use
    with pytest.raises(ArenaError, match=r"quarantine of slot 4096 .*listed twice"):
        alloc.quarantine(4096, [4096, 4096])
    assert alloc.quarantine(4096, got[1:3]) == 2 * 4096
    with pytest.raises(ArenaError, match="not a free slot"):
        alloc.quarantine(4096, got[1:2])  # quarantined already
    st = alloc.stats()
    assert st["capacity_bytes"] == 6 * 4096 and st["quarantined_bytes"] == 2 * 4096
    assert st["used_bytes"] == 2 * 4096 and st["free_bytes"] == 4 * 4096 and st["page_tail_waste_bytes"] == 0
    rest = alloc.alloc(4096, 4)
    assert rest is not None and not np.isin(rest, got[1:3]).any() and alloc.alloc(4096, 1) is None
    with pytest.raises(ArenaError, match="not in use"):
        alloc.free(4096, got[1:2])  # never to be freed again either
    alloc.free(4096, np.concatenate([got[[0, 3]], rest]))
    assert alloc.blocks_free(8192) == 2, "a quarantined slot's page never goes to another size"
    assert sorted(alloc.quarantined_offsets().tolist()) == sorted(got[1:3].tolist())


def test_quarantine_warnings_are_said_once_a_minute_per_tier(mgr, caplog):
    """A bad region met batch after batch: one warning a minute, the rest counted in the next line
    (soak4: 241 warnings in 90 s of drains over a bad region)."""
    q = mgr.mover.quarantine
    alloc = mgr.table.allocators[Tier.NVME]
    offsets = alloc.alloc(LAYOUT.block_bytes, 4)  # (3% of the test NVMe: below FAILING_FRACTION)
    alloc.free(LAYOUT.block_bytes, offsets)
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        for o in offsets.tolist():
            assert q.set_aside(Tier.NVME, np.array([o]), np.array([LAYOUT.block_bytes]))
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash2.quarantine"]
    assert len(lines) == 1, lines
    assert sorted(alloc.quarantined_offsets().tolist()) == sorted(offsets.tolist())


# -- re-tests: slots set aside are given back once their storage writes and reads again ---------------

def step(m) -> None:
    """A background step, then the step that takes a re-test's verdict if it began one (its I/O runs
    on a thread of its own; the step waits for it only RETEST_WAIT_S)."""
    m.tick()
    deadline = time.monotonic() + 30
    while m.mover.quarantine.retests_pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    m.tick()


def retest_setup(m, monkeypatch):
    """A client and layout, the quarantine, the placement's clock (a one-item list, from 1000 s) and
    the sound os.pwritev (to heal a disk that `bad_slots` broke)."""
    now = [1000.0]
    monkeypatch.setattr(m.placement, "monotonic", lambda: now[0])
    return m.attach("a"), m.register_layout(LAYOUT), m.mover.quarantine, now, os.pwritev


def test_slots_set_aside_are_given_back_once_a_re_test_writes_and_reads_them(mgr, monkeypatch, caplog):
    """An EIO that passes (a controller reset): the slots it set aside stayed out of use until the
    daemon restarted. The step re-tests them, the first time RETEST_FIRST_S after it sees them: a
    slot still bad stays set aside (and goes to the back of the list), one that writes and reads its
    pattern back is room again, and a block written there later reads back intact."""
    a, lid, q, now, sound_disk = retest_setup(mgr, monkeypatch)
    bad_slots(mgr, monkeypatch, [2 * SLOT, 5 * SLOT, 7 * SLOT])
    assert down_to_nvme(mgr, a, lid, list(range(1, 33))).sum() == 29
    alloc = mgr.table.allocators[Tier.NVME]
    assert alloc.quarantined_bytes == 3 * SLOT
    mgr.tick()  # the re-test's clock starts when the slots are first seen set aside
    now[0] += q.RETEST_FIRST_S - 1
    step(mgr)
    assert alloc.quarantined_bytes == 3 * SLOT, "no re-test before RETEST_FIRST_S"
    monkeypatch.setattr(os, "pwritev", sound_disk)
    bad_slots(mgr, monkeypatch, [5 * SLOT])  # the EIO passed but for one slot
    now[0] += 2
    with caplog.at_level(logging.INFO, logger="dflash2.quarantine"):
        step(mgr)
    assert alloc.quarantined_offsets().tolist() == [5 * SLOT] and q.given_back == 2
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("re-test")]
    assert len(said) == 1 and "re-test of 3 nvme slots" in said[0] and "2 wrote and read back" in said[0] \
        and "1 failed again" in said[0], said
    tier = mgr.stats()["tiers"]["nvme"]
    assert tier["capacity_bytes"] == alloc.arena_bytes - SLOT and tier["quarantined_bytes"] == SLOT
    assert tier["used_bytes"] + tier["free_bytes"] == tier["capacity_bytes"], tier
    mgr.check_invariants()
    for r in range(1, 4):  # 96 more blocks: 125 on NVMe, the slots given back still free
        down_to_nvme(mgr, a, lid, list(range(1 + 32 * r, 33 + 32 * r)))
        mgr.check_invariants()
    c = mgr.table.cols
    dram = np.flatnonzero((c.tier == int(Tier.DRAM)) & (c.state != 0))
    assert len(dram) == 3, "the first batch's three blocks whose slots failed stay in DRAM"
    left = dram[:2]
    assert mgr.mover.move(left, Tier.NVME).all(), "the slots given back take blocks"
    offsets = c.offset[np.flatnonzero((c.tier == int(Tier.NVME)) & (c.state != 0))].tolist()
    assert 2 * SLOT in offsets and 7 * SLOT in offsets and 5 * SLOT not in offsets and len(offsets) == 127
    assert mgr.stats()["tiers"]["nvme"]["free_bytes"] == 0
    assert_cached(mgr, range(1, 129))


def settle_re_tests(m, q, steps: int = 6) -> int:
    """Up to `steps` background steps, the clock held, each waiting for the re-test it began (its
    I/O on a thread of its own) before the next; the steps until a re-test's verdict left none pending."""
    taken = 0
    for _ in range(steps):
        m.tick()
        deadline = time.monotonic() + 30
        while q.retests_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        taken += 1
    return taken


def test_once_a_re_test_passes_whole_the_rest_follow_a_step_apart_until_one_fails(mgr, monkeypatch, caplog):
    """A passing EIO (a controller reset) set aside the slots of whole drain batches, thousands,
    and the re-test gave back 16 every 5 minutes: hours. A re-test whose every slot passed now says
    the disk answers again: the next follows at the next step, until none is left or one fails again
    (then after a wait twice as long as the last), and the run is said once, at its end."""
    a, lid, q, now, sound_disk = retest_setup(mgr, monkeypatch)
    monkeypatch.setattr(q, "RETEST_SLOTS", 2)
    bad = [1, 3, 5, 7, 9, 11]  # 6 of 128 slots: under the 5% past which the disk is failing
    bad_slots(mgr, monkeypatch, [o * SLOT for o in bad])
    assert down_to_nvme(mgr, a, lid, list(range(1, 33))).sum() == 26
    alloc = mgr.table.allocators[Tier.NVME]
    order = alloc.quarantined_offsets().tolist()  # the re-tests' order, two a round
    assert sorted(order) == [o * SLOT for o in bad]
    mgr.tick()  # the re-test's clock starts when the slots are first seen set aside
    monkeypatch.setattr(os, "pwritev", sound_disk)
    bad_slots(mgr, monkeypatch, [order[3]])  # the EIO passed but for one slot, in the second round
    now[0] += q.RETEST_FIRST_S
    with caplog.at_level(logging.INFO, logger="dflash2.quarantine"):
        settle_re_tests(mgr, q)
    assert alloc.quarantined_offsets().tolist() == [order[3]], \
        "the first round passed whole, the second met the bad slot but gave one back: the third followed (soak12)"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("re-test")]
    assert len(said) == 1 and "re-test of 6 nvme slots set aside after failed writes or reads, in 3 rounds: 5 wrote" in said[0] \
        and "1 failed again" in said[0], said
    bad_slots(mgr, monkeypatch, [order[3]])  # still bad: a round that gives nothing back ends the run
    now[0] += q.RETEST_FIRST_S
    settle_re_tests(mgr, q)
    assert alloc.quarantined_bytes == SLOT
    monkeypatch.setattr(os, "pwritev", sound_disk)
    now[0] += q.RETEST_FIRST_S
    settle_re_tests(mgr, q)
    assert alloc.quarantined_bytes == SLOT, "a slot failed again: the next re-test waits twice as long"
    now[0] += 3 * q.RETEST_FIRST_S
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash2.quarantine"):
        settle_re_tests(mgr, q)
    assert alloc.quarantined_bytes == 0 and q.given_back == 6
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("re-test")]
    assert len(said) == 1 and "re-test of 1 nvme slots set aside after failed writes or reads: 1 wrote" in said[0] \
        and "0 failed again" in said[0] and "0 bytes (0.00% of nvme) set aside now" in said[0], said
    mgr.check_invariants()
    assert mgr.mover.move(np.flatnonzero((mgr.table.cols.tier == int(Tier.DRAM)) & (mgr.table.cols.state != 0)),
                          Tier.NVME).all(), "the slots given back take the blocks whose writes failed"
    assert_cached(mgr, range(1, 33))


def test_a_re_test_waits_while_the_tier_backs_off_and_a_full_disk_gives_nothing_back(mgr, monkeypatch, caplog):
    """No re-test while NVMe backs off (a full disk fails it for its own reasons); one whose batch
    fails for the disk as a whole (ENOSPC) gives nothing back, says so, and waits a period."""
    a, lid, q, now, sound_disk = retest_setup(mgr, monkeypatch)
    bad_slots(mgr, monkeypatch, [3 * SLOT])
    down_to_nvme(mgr, a, lid, list(range(1, 9)))
    alloc = mgr.table.allocators[Tier.NVME]
    mgr.tick()
    now[0] += q.RETEST_EVERY_S + 1
    mgr.placement.write_backoff[Tier.NVME] = (now[0] + 30, 30.0)  # backing off
    monkeypatch.setattr(os, "pwritev", sound_disk)
    step(mgr)
    assert alloc.quarantined_bytes == SLOT, "re-tested while the tier backs off"
    del mgr.placement.write_backoff[Tier.NVME]
    bad_slots(mgr, monkeypatch, [3 * SLOT], err=errno.ENOSPC)
    with caplog.at_level(logging.WARNING, logger="dflash2.quarantine"):
        step(mgr)
    assert alloc.quarantined_bytes == SLOT and q.given_back == 0
    assert any("failed for the disk as a whole" in r.getMessage() for r in caplog.records), caplog.records
    monkeypatch.setattr(os, "pwritev", sound_disk)
    step(mgr)
    assert alloc.quarantined_bytes == SLOT, "the next re-test comes a period later"
    now[0] += q.RETEST_EVERY_S
    step(mgr)
    assert alloc.quarantined_bytes == 0 and q.given_back == 1
    mgr.check_invariants()


def test_quarantined_slots_given_back_are_free_again_and_bad_requests_are_refused():
    alloc = SlotAllocator(8 * 4096, 4096, 4096)
    got = alloc.alloc(4096, 4)
    alloc.free(4096, got)
    alloc.quarantine(4096, got[1:3])
    with pytest.raises(ArenaError, match=f"give back of slot {int(got[0])}: it is not a quarantined slot"):
        alloc.give_back(got[:2])
    with pytest.raises(ArenaError, match="listed twice"):
        alloc.give_back(got[[1, 1]])
    assert alloc.quarantined_bytes == 2 * 4096, "a refused give back changes nothing"
    alloc.requeue_quarantined(got[1:2])
    assert alloc.quarantined_offsets().tolist() == [int(got[2]), int(got[1])]
    assert alloc.give_back(got[1:3]) == 2 * 4096
    st = alloc.stats()
    assert st["capacity_bytes"] == 8 * 4096 and st["quarantined_bytes"] == 0 and st["free_bytes"] == 8 * 4096
    assert alloc.alloc(4096, 8) is not None, "every slot can be handed out again"
    alloc.free(4096, np.arange(8) * 4096)
    assert alloc.blocks_free(8192) == 4, "the slab's pages go back to other sizes once no slot is set aside"


def test_a_re_test_of_slots_still_bad_does_not_hold_the_step_on_the_disk(mgr, monkeypatch):
    """soak8: the re-test wrote and read in the step itself, on the daemon's serving thread: a bad
    region that answers EIO slowly (a disk retrying a sector, seconds a try) held every client for a
    failed batch write and one more per slot. Its I/O now runs on a thread of its own; the step goes
    on while the disk has not answered, and a later step takes the verdict."""
    a, lid, q, now, sound_disk = retest_setup(mgr, monkeypatch)
    answer, asked = bad_slots(mgr, monkeypatch, [1 * SLOT, 4 * SLOT])
    down_to_nvme(mgr, a, lid, list(range(1, 9)))
    alloc = mgr.table.allocators[Tier.NVME]
    assert alloc.quarantined_bytes == 2 * SLOT
    mgr.tick()
    now[0] += q.RETEST_EVERY_S + 1
    answer.clear()
    asked.clear()
    ticking = threading.Thread(target=mgr.tick)
    ticking.start()
    ticking.join(10)
    stuck = ticking.is_alive()
    answer.set()
    ticking.join()
    assert asked.is_set(), "the re-test never wrote"
    assert not stuck, "the step waited for the disk's answer to the re-test"
    step(mgr)
    assert alloc.quarantined_bytes == 2 * SLOT and q.given_back == 0, "slots still bad stay set aside"
    mgr.check_invariants()


def test_a_free_of_an_nvme_block_does_not_wait_for_a_running_re_test(mgr, monkeypatch):
    """soak9: with the re-test's I/O on a thread of its own, it still went through write_blocks and
    read_blocks, which hold the arena's lock for the whole batch: a failed batch write and one more
    per slot. The serving thread's forget (any free or eviction of an NVMe slot) takes that lock, so
    a client's free waited for every slow answer of a bad region. The re-test now writes and reads
    its slots outside that lock."""
    a, lid, q, now, sound_disk = retest_setup(mgr, monkeypatch)
    answer, asked = bad_slots(mgr, monkeypatch, [1 * SLOT, 4 * SLOT])
    down_to_nvme(mgr, a, lid, list(range(1, 9)))
    alloc = mgr.table.allocators[Tier.NVME]
    assert alloc.quarantined_bytes == 2 * SLOT
    vid = mgr.commit(a, mgr.allocate(a, lid, 1))  # a private block (no key), moved down to NVMe
    rows = mgr.table.rows(vid)
    assert mgr.mover.move(rows, Tier.DRAM).all() and mgr.mover.move(rows, Tier.NVME).all()
    mgr.tick()
    now[0] += q.RETEST_EVERY_S + 1
    answer.clear()
    asked.clear()
    mgr.tick()  # the re-test begins; its first write waits for the disk
    assert asked.wait(10) and q.retests_pending()
    freeing = threading.Thread(target=mgr.free, args=(a, vid))
    freeing.start()
    freeing.join(3)
    stuck = freeing.is_alive()
    answer.set()
    freeing.join()
    assert not stuck, "a free of an NVMe block waited for the re-test's disk I/O"
    step(mgr)
    assert alloc.quarantined_bytes == 2 * SLOT and q.given_back == 0, "slots still bad stay set aside"
    mgr.check_invariants()
