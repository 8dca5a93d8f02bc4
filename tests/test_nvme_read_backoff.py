"""A failing NVMe disk's reads: past 5% of the tier set aside, reads that fail make NVMe back off as
failed writes do (backoff.py `_note_reads`). Real host managers (fault_helpers.py), EIO injected at
the OS calls the NVMe file's I/O makes."""

import errno
import logging
import os

import pytest

from dflash2.errors import UnknownBlock
from dflash2.status import render
from dflash2.tiers import Tier
from fault_helpers import LAYOUT, assert_intact, make_mgr, mgr, publish, to_nvme  # noqa: F401  (fixtures)


def test_a_failing_disk_whose_reads_fail_backs_off_until_a_read_works(mgr, monkeypatch, caplog):
    """Past 5% of NVMe set aside, a read that fails makes NVMe back off (neither read nor written): a
    lookup's prefix ends before its NVMe blocks (withheld), the prefetch leaves them, a write probe
    that lands does not end it, and a failed read after it ran out starts one twice as long. Once
    the disk reads again, the first read of a block a lookup offers ends it. Before, failed reads
    started no back-off at all: such a disk took every block DRAM sent down and failed each read."""
    inode = os.fstat(mgr.arenas[Tier.NVME]._fd).st_ino
    real = os.preadv
    failing = [True]

    def preadv(f, bufs, offset):
        if failing[0] and os.fstat(f).st_ino == inode:
            raise OSError(errno.EIO, "Input/output error")
        return real(f, bufs, offset)
    monkeypatch.setattr(os, "preadv", preadv)
    now = [1000.0]
    pl = mgr.placement
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    kept = publish(mgr, a, lid, [900, 901])  # a chain on NVMe that stays there, read only at the end
    to_nvme(mgr, kept)
    q, key = mgr.mover.quarantine, 1
    with caplog.at_level(logging.INFO, logger="dflash2.placement"):
        while not pl.stats.read_backoffs:  # one block at a time: each read fails, its slot set aside
            assert key < 40, "no back-off though the disk is failing"
            vids = publish(mgr, a, lid, [key], chained=False)
            to_nvme(mgr, vids)
            with pytest.raises(UnknownBlock):
                mgr.acquire(a, vids)
            key += 1
        assert q.failing(Tier.NVME) and pl.reads_back_off(Tier.NVME) and not pl.writable(Tier.NVME)
        assert pl.write_backoff[Tier.NVME][1] == pl.WRITE_BACKOFF_S
        assert "reads from nvme failed (1 blocks) on a disk taken to be failing" in caplog.text
        withheld = mgr.stats()["lookup_withheld"]
        assert mgr.lookup([900, 901], lid) == []  # not read: the engine recomputes them at once
        assert mgr.stats()["lookup_withheld"] == withheld + 2
        # `dflash2 status` names the back-off among the causes: no client gave a prefill rate here, and
        # it called these blocks "slower to load than to recompute" alone (a review).
        assert f"on an NVMe disk backing off after failed reads) {withheld + 2}" in render(
            {"lookup_withheld": mgr.stats()["lookup_withheld"]})
        assert mgr.prefetcher.ahead(kept, 0) == 0
        assert mgr.place(int(kept[0])).tier == Tier.NVME
        # It runs out; the next read offered fails: twice as long.
        now[0] += pl.WRITE_BACKOFF_S
        assert not pl.reads_back_off(Tier.NVME) and [p.vid for p in mgr.lookup([900], lid)] == [int(kept[0])]
        # Writes that land meanwhile (DRAM's room made by moving a block down) say nothing of reads.
        down = publish(mgr, a, lid, [700], chained=False)
        assert mgr.mover.move(mgr.table.rows(down), Tier.DRAM).all()
        assert pl.make_room(Tier.DRAM, pl.free_bytes(Tier.DRAM) + LAYOUT.block_bytes)
        assert mgr.place(int(down[0])).tier == Tier.NVME and Tier.NVME in pl.write_backoff
        vids = publish(mgr, a, lid, [key], chained=False)
        to_nvme(mgr, vids)
        with pytest.raises(UnknownBlock):
            mgr.acquire(a, vids)
        assert pl.stats.read_backoffs == 2 and pl.write_backoff[Tier.NVME][1] == 2 * pl.WRITE_BACKOFF_S
        # A write probe would land (the disk takes writes): it is not tried, and the back-off stands.
        cold = publish(mgr, a, lid, [800], chained=False)
        assert mgr.mover.move(mgr.table.rows(cold), Tier.DRAM).all()  # (a block the probe could take)
        now[0] += pl.WRITE_PROBE_EVERY_S + 0.1
        writes = mgr.mover.stats[(Tier.DRAM, Tier.NVME)].blocks
        pl.probe_writes()
        assert mgr.mover.stats[(Tier.DRAM, Tier.NVME)].blocks == writes and pl.reads_back_off(Tier.NVME)
        mgr.check_invariants()
        # The disk reads again: once the period has run out, the first read ends the back-off.
        failing[0] = False
        now[0] += pl.WRITE_BACKOFF_S
        assert [p.vid for p in mgr.lookup([900, 901], lid)] == kept.tolist()
        mgr.acquire(a, kept)
        assert_intact(mgr, kept, [900, 901])
        assert Tier.NVME not in pl.write_backoff and not pl.reads_back_off(Tier.NVME)
        assert "reads from nvme work again after" in caplog.text
    mgr.release(a, kept)
    mgr.check_invariants()


def _dead(real, inode):
    """`os.preadv` or `os.pwritev` failing with EIO on the NVMe file (any descriptor of it)."""
    def call(fd, bufs, offset):
        if os.fstat(fd).st_ino == inode:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)
    return call


def test_a_dead_disk_backing_off_after_failed_writes_is_not_read_either(mgr, monkeypatch):
    """Reads and writes both fail (a dead disk): the writes set slots aside until the disk is taken
    to be failing, and back off. A read that fails meanwhile keeps NVMe from being read too, as the
    back-off stands: the next lookups end before its blocks. Before (a review's script), lookups went
    on offering them during the write back-off, and every acquire lost its chain."""
    now = [1000.0]
    pl = mgr.placement
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    chains = [publish(mgr, a, lid, [100 + 10 * i, 101 + 10 * i]) for i in range(4)]
    for chain in chains:
        to_nvme(mgr, chain)
    inode = os.fstat(mgr.arenas[Tier.NVME]._fd).st_ino
    monkeypatch.setattr(os, "preadv", _dead(os.preadv, inode))
    monkeypatch.setattr(os, "pwritev", _dead(os.pwritev, inode))
    key = 1
    while not pl.stats.write_backoffs:  # DRAM's room made by moving blocks down: their writes fail
        assert key < 60, "no write back-off on a dead disk"
        down = publish(mgr, a, lid, [key], chained=False)
        assert mgr.mover.move(mgr.table.rows(down), Tier.DRAM).all()
        pl.make_room(Tier.DRAM, pl.free_bytes(Tier.DRAM) + LAYOUT.block_bytes)
        key += 1
    assert mgr.mover.quarantine.failing(Tier.NVME) and not pl.writable(Tier.NVME)
    off = pl.write_backoff[Tier.NVME]
    offered = [p.vid for p in mgr.lookup([100, 101], lid)]  # (the write back-off alone withholds nothing)
    assert offered == chains[0].tolist()
    with pytest.raises(UnknownBlock):
        mgr.acquire(a, offered)
    assert pl.stats.read_backoffs == 1 and pl.reads_back_off(Tier.NVME)
    assert pl.write_backoff[Tier.NVME] == off  # not lengthened
    lost = pl.stats.lost
    for i in range(1, 4):
        assert mgr.lookup([100 + 10 * i, 101 + 10 * i], lid) == []
    assert pl.stats.lost == lost
    mgr.check_invariants()


def test_a_full_disk_after_a_read_back_off_ran_out_backs_off_as_a_full_disk(mgr, monkeypatch):
    """A read back-off runs out with no read of NVMe in between, the disk reads again, writes land;
    then the disk fills (ENOSPC): a plain write back-off, which lookups do not notice and the write
    probe ends once the disk has room. Before (a review's script), the old read back-off's mark
    stayed: lookups withheld sound NVMe blocks and no probe was tried."""
    from fault_helpers import failing_disk
    now = [1000.0]
    pl = mgr.placement
    monkeypatch.setattr(pl, "monotonic", lambda: now[0])
    inode = os.fstat(mgr.arenas[Tier.NVME]._fd).st_ino
    real = os.preadv
    monkeypatch.setattr(os, "preadv", _dead(real, inode))
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    key = 1
    while not pl.stats.read_backoffs:
        assert key < 40
        vids = publish(mgr, a, lid, [key], chained=False)
        to_nvme(mgr, vids)
        with pytest.raises(UnknownBlock):
            mgr.acquire(a, vids)
        key += 1
    monkeypatch.setattr(os, "preadv", real)  # the disk reads again
    now[0] += pl.WRITE_BACKOFF_S + 0.5  # it runs out; nothing reads NVMe meanwhile
    kept = publish(mgr, a, lid, [900, 901])
    to_nvme(mgr, kept)
    full, writes = failing_disk(mgr, monkeypatch)
    down = publish(mgr, a, lid, [700], chained=False)
    assert mgr.mover.move(mgr.table.rows(down), Tier.DRAM).all()
    pl.make_room(Tier.DRAM, pl.free_bytes(Tier.DRAM) + LAYOUT.block_bytes)
    assert pl.stats.write_backoffs == 1 and not pl.writable(Tier.NVME) and not pl.reads_back_off(Tier.NVME)
    assert [p.vid for p in mgr.lookup([900, 901], lid)] == kept.tolist()
    full[0] = False  # room again: the probe's write lands and ends the back-off
    cold = publish(mgr, a, lid, [800], chained=False)
    assert mgr.mover.move(mgr.table.rows(cold), Tier.DRAM).all()
    now[0] += pl.WRITE_PROBE_EVERY_S + 0.1
    tried = len(writes)
    pl.probe_writes()
    assert len(writes) > tried and pl.writable(Tier.NVME) and Tier.NVME not in pl.write_backoff
    mgr.check_invariants()
