"""The NVMe cache file cut short by another process while its tier runs (`: > nvme.cache` to free the
disk): taken back at the next batch or as the tier closes, the blocks past the cut (and one the cut
goes through) misses lost to the cut, never taken for bad sectors (arena/nvmecut.py). Reviews'
scripts found each case: the next start refused the file, reads past the cut failed as disk errors."""

import errno
import logging
import os
import threading

import numpy as np
import pytest

import dflash2.arena.nvme as nvme
import dflash2.arena.nvmecut as nvmecut
import dflash2.transfer.failures as failures
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.staging import ALIGN

CAP = 16 << 20
STAGING = 64 << 10


@pytest.fixture
def arena(tmp_path):
    a = NvmeArena(tmp_path / "sub" / "nvme.bin", CAP, staging_bytes=STAGING)
    yield a
    a.remove()


@pytest.mark.parametrize("cut_pages", [0, 9])
def test_a_file_cut_short_while_the_tier_runs_is_taken_back_and_stays_ours(tmp_path, cut_pages, caplog):
    """A review's script: the cache file emptied (`: > nvme.cache`) while the daemon ran; its later
    writes grew a sparse file with no header, and the next start refused it as "not a dflash2 NVMe
    cache file" (exit 4 until removed by hand); reads past the cut failed as "preadv moved 0 bytes".
    Now the next batch takes the file back (header, room); blocks past the cut are misses."""
    path = tmp_path / "nvme.cache"
    rng = np.random.default_rng(5)
    before, after = (rng.integers(0, 256, 4 * ALIGN, dtype=np.uint8) for _ in range(2))
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        assert a.write_blocks([0, 16 * ALIGN], [before, before]).all()
        os.truncate(path, cut_pages * ALIGN)  # someone empties, or cuts, the cache file
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert a.write_blocks([64 * ALIGN], [after]).all()
        assert f"{path} was cut to {cut_pages * ALIGN} bytes by another process" in caplog.text
        assert os.path.getsize(path) == nvme.HEADER_BYTES + CAP
        out = np.zeros_like(before)
        assert a.read_blocks([64 * ALIGN], [out]).all() and np.array_equal(out, after)
        # the block below the cut (pages 1-4 of the file) is intact; the one past it is lost
        kept = a.read_blocks([0], [out]).all()
        assert kept == (cut_pages >= 5) and (not kept or np.array_equal(out, before))
        assert not a.read_blocks([16 * ALIGN], [out]).any()
    finally:
        a.close()
    assert path.read_bytes()[:len(nvme.HEADER)] == nvme.HEADER
    NvmeArena(path, CAP, staging_bytes=STAGING).remove()  # the restart takes its own file back


def test_a_cut_that_a_batch_grows_back_over_is_found_by_its_header(tmp_path, monkeypatch, caplog):
    """A review's script: the cut landed as a batch began writing, and the batch's write to the file's
    last slot made the size whole again over a header page of zeros: the next start refused the file.
    The header says so: every block is forgotten (where the cut was is unknown), the header written."""
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    cut, once = [], threading.Lock()  # the ring writes its chunks from several threads at once
    for name in ("pwrite_all", "pwritev_all"):  # (staged or direct: whichever goes out first)
        def cut_first(*args, _real=getattr(nvme, name), **kw):
            with once:  # (unlocked, two writers both cut: the second cut undid the first's write)
                if not cut:
                    cut.append(os.truncate(path, 0))  # `: > nvme.cache` lands as the batch's first write goes out
            return _real(*args, **kw)
        monkeypatch.setattr(nvme, name, cut_first)
    blocks = [np.full(4 * ALIGN, 9, np.uint8) for _ in range(2)]
    try:
        assert a.write_blocks([0, CAP - 4 * ALIGN], blocks).all()  # reaches the file's last slot
        assert os.path.getsize(path) == nvme.HEADER_BYTES + CAP and path.read_bytes()[:16] == bytes(16)
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert not a.read_blocks([0, CAP - 4 * ALIGN], [np.zeros_like(b) for b in blocks]).any()
        assert "its header page is a hole" in caplog.text
        assert a.lost_to_cut([0, CAP - 4 * ALIGN, 8 * ALIGN]).tolist() == [True, True, False]
    finally:
        a.close()
    assert path.read_bytes()[:len(nvme.HEADER)] == nvme.HEADER
    NvmeArena(path, CAP, staging_bytes=STAGING).remove()


def test_a_block_the_cut_goes_through_is_lost_to_the_cut(tmp_path):
    """A review's script: a block that began before the cut and reached past it kept its checksum,
    failed it when read, and its slots were set aside as bad sectors."""
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        block = np.full(4 * ALIGN, 7, np.uint8)
        assert a.write_blocks([0, 8 * ALIGN], [block, block]).all()  # file pages 1-4 and 9-12
        os.truncate(path, nvme.HEADER_BYTES + 2 * ALIGN)  # through the first block's third page
        assert not a.read_blocks([0], [np.zeros_like(block)]).any()
        assert a.lost_to_cut([0, 8 * ALIGN]).tolist() == [True, True]
    finally:
        a.remove()


def test_a_header_written_over_in_place_is_said_as_such_not_as_a_cut(tmp_path, caplog):
    """A review: one byte of the header page changed (same size, no hole) was logged as "cut and
    grown again (its header page is a hole)", sending the operator after a truncating tool."""
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        block = np.full(ALIGN, 3, np.uint8)
        assert a.write_blocks([0, ALIGN], [block, block]).all()
        size = os.stat(path).st_size
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"X", 3)
        finally:
            os.close(fd)
        assert os.stat(path).st_size == size
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert not a.read_blocks([0, ALIGN], [np.zeros_like(block), np.zeros_like(block)]).any()
        assert "had its header page written over (not cut: the size is whole)" in caplog.text, caplog.text
        assert "is a hole" not in caplog.text and "cut to" not in caplog.text
        assert a.write_blocks([0], [block]).all()  # (taken back: written and read again)
        out = np.zeros_like(block)
        assert a.read_blocks([0], [out]).all() and (out == 3).all()
    finally:
        a.remove()


def test_a_cut_after_the_last_batch_is_taken_back_as_the_tier_closes(tmp_path):
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    a.write_blocks([0], [np.ones(ALIGN, np.uint8)])
    os.truncate(path, 0)
    a.close()
    assert path.read_bytes()[:len(nvme.HEADER)] == nvme.HEADER
    NvmeArena(path, CAP, staging_bytes=STAGING).remove()


def test_a_read_after_the_file_was_cut_is_a_miss_not_a_disk_error(arena, caplog):
    block = np.full(2 * ALIGN, 3, np.uint8)
    assert arena.write_blocks([32 * ALIGN], [block]).all()
    os.truncate(arena.path, 0)
    with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
        assert not arena.read_blocks([32 * ALIGN], [np.zeros_like(block)]).any()
    assert "cut to 0 bytes" in caplog.text and "failed" not in caplog.text


@pytest.mark.parametrize("cut_to", [0, nvme.HEADER_BYTES + 64 << 10])
def test_a_cut_that_cannot_be_taken_back_is_said_once_until_it_can(tmp_path, monkeypatch, caplog, cut_to):
    """A review's script: the file cut while the disk was full (the take-back's fallocate failing);
    every later batch logged the cut again, saying its room was taken again, and then the failure:
    two lines a batch for as long as the disk stayed full. Now one line says the cut and the failure,
    later batches are quiet (a line a minute at most) and the take-back is tried at each batch."""
    a = NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)
    try:
        block = np.arange(4 * ALIGN, dtype=np.uint8)
        assert a.write_blocks([0], [block]).all()
        os.truncate(a.path, cut_to)

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(nvmecut.os, "posix_fallocate", full)
        out = np.zeros_like(block)
        with caplog.at_level(logging.INFO, logger="dflash2.arena"):
            for _ in range(20):
                assert a.read_blocks([0], [out]).all() == (cut_to > 0)
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1 and "cannot be taken back" in lines[0] and "taken again" not in lines[0], lines
            assert "No space left on device" in lines[0] and f"was cut to {cut_to} bytes" in lines[0]
            monkeypatch.undo()  # the disk has room again: the next batch takes the file back
            caplog.clear()
            assert a.read_blocks([0], [out]).all() == (cut_to > 0)
        assert "is taken back to" in caplog.text and os.path.getsize(a.path) == nvme.HEADER_BYTES + CAP
        assert cut_to == 0 or np.array_equal(out, block)
    finally:
        a.remove()


def test_the_tiers_own_writes_after_a_failed_take_back_are_no_new_cut(tmp_path, monkeypatch, caplog):
    """A review: the disk had room for the tier's writes, not for the whole file; each batch's write
    past the file's end grew it, and the next check logged the grown size as a new cut "by another
    process", a line a batch; the take-back that at last worked said a cut again. Now: one line for
    the cut, quiet while the take-back keeps failing, one line when it works."""
    a = NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)
    try:
        block = np.arange(4 * ALIGN, dtype=np.uint8)
        assert a.write_blocks([0], [block]).all()
        os.truncate(a.path, 0)

        def full(fd, offset, length):  # room for small writes, not for the whole tier
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(nvmecut.os, "posix_fallocate", full)
        with caplog.at_level(logging.INFO, logger="dflash2.arena"):
            for i in range(1, 11):  # ten batches, each a block further out: the sparse file grows
                assert a.write_blocks([i * 8 * ALIGN], [block]).all()
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1 and "was cut to 0 bytes" in lines[0], lines
            monkeypatch.undo()
            caplog.clear()
            out = np.zeros_like(block)
            assert a.read_blocks([10 * 8 * ALIGN], [out]).all() and np.array_equal(out, block)
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"NVMe: {a.path} (") and line.endswith(
            f"bytes) is taken back to {nvme.HEADER_BYTES + CAP} bytes, its header and disk room again")
        assert os.path.getsize(a.path) == nvme.HEADER_BYTES + CAP
    finally:
        a.remove()


def test_a_file_the_tiers_own_writes_grew_whole_after_a_failed_take_back_gets_its_room(tmp_path, monkeypatch,
                                                                                       caplog):
    """A review of the mend: the take-back failed, then the tier's write of its last slot made the
    file whole again (sparse: its room never taken), and the check took a whole file for a sound one:
    nothing said it was taken back, and the room was never taken. Now the take-back is tried again."""
    a = NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)
    try:
        block = np.arange(4 * ALIGN, dtype=np.uint8)
        os.truncate(a.path, 0)

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(nvmecut.os, "posix_fallocate", full)
        last = CAP - 4 * ALIGN
        assert a.write_blocks([last], [block]).all()  # cut found, take-back fails; the write makes it whole
        assert os.path.getsize(a.path) == nvme.HEADER_BYTES + CAP
        monkeypatch.undo()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            out = np.zeros_like(block)
            assert a.read_blocks([last], [out]).all() and np.array_equal(out, block)
        assert "is taken back to" in caplog.text
    finally:
        a.remove()


def test_a_take_back_that_fails_another_way_is_no_new_cut(tmp_path, monkeypatch, caplog):
    """A review of the mend: the take-back failed (ENOSPC), the tier's writes grew the file whole,
    and the retry failed another way (EDQUOT): logged as a new cut, with no cause ("PATH  (the tier's
    file ...") and 0 blocks "past the damage". It is the same failing take-back, said once a minute."""
    a = NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)
    try:
        block = np.arange(4 * ALIGN, dtype=np.uint8)
        os.truncate(a.path, 0)
        err = [errno.ENOSPC]

        def failing(fd, offset, length):
            raise OSError(err[0], os.strerror(err[0]))
        monkeypatch.setattr(nvmecut.os, "posix_fallocate", failing)
        assert a.write_blocks([CAP - 4 * ALIGN], [block]).all()  # the cut said; the write grows it whole
        err[0] = errno.EDQUOT
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            out = np.zeros_like(block)
            assert a.read_blocks([CAP - 4 * ALIGN], [out]).all() and np.array_equal(out, block)
        assert not [r.getMessage() for r in caplog.records]
    finally:
        a.remove()


def test_the_once_a_minute_line_counts_only_the_batches_left_unsaid(tmp_path, monkeypatch, caplog):
    """A review of the mend: after a cut, a failed take-back, a take-back that worked and a new cut
    whose take-back failed again, the once-a-minute line counted the lines logged in full as "not
    logged" and dated "the last one logged" from the first cut. Each full line starts the count."""
    a = NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)
    now = [1000.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: now[0])
    room = [False]

    def fallocate(fd, offset, length):
        if not room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(nvmecut.os, "posix_fallocate", fallocate)
    try:
        block = np.arange(4 * ALIGN, dtype=np.uint8)
        assert a.write_blocks([0], [block]).all()
        os.truncate(a.path, 0)  # cut 1: its take-back fails
        a.read_blocks([0], [np.zeros_like(block)])
        room[0] = True
        now[0] += 10
        a.read_blocks([0], [np.zeros_like(block)])  # taken back
        assert a.write_blocks([0], [block]).all()
        room[0] = False
        now[0] += 10
        os.truncate(a.path, 0)  # cut 2: a full line again
        a.read_blocks([0], [np.zeros_like(block)])
        for _ in range(3):  # three batches unsaid
            now[0] += 5
            a.read_blocks([0], [np.zeros_like(block)])
        caplog.clear()
        now[0] += 60
        with caplog.at_level(logging.ERROR, logger="dflash2.arena"):
            a.read_blocks([0], [np.zeros_like(block)])
        [line] = [r.getMessage() for r in caplog.records]
        assert "still cannot be taken back" in line and "(3 more such batches since the last one logged, 75 s ago" in line
    finally:
        monkeypatch.undo()
        a.remove()


# ---- the file removed or replaced (arena/nvmegone.py) ------------------------------------------------
