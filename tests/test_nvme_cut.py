"""The NVMe cache file cut short by another process while its tier runs (`: > nvme.cache` to free the
disk): taken back at the next batch or as the tier closes, the blocks past the cut (and one the cut
goes through) misses lost to the cut, never taken for bad sectors (arena/nvmecut.py). Reviews'
scripts found each case: the next start refused the file, reads past the cut failed as disk errors."""

import contextlib
import errno
import logging
import os
import threading
import types

import numpy as np
import pytest

import dflash2.arena.nvme as nvme
import dflash2.arena.nvmecut as nvmecut
import dflash2.arena.nvmegone as nvmegone
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

def _deleted_fds(path) -> list[str]:
    """This process's descriptors still open on a removed file at `path` (its disk room held)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target == f"{path} (deleted)":
                out.append(target)
    return out


def test_a_file_removed_while_the_tier_runs_is_made_again_and_keeps_a_second_tier_off(tmp_path, caplog):
    """A review's script: `rm nvme.cache` under a running tier went unnoticed: it read and wrote the
    deleted file (its room held out of sight, no log line), and a second tier (a second daemon) on
    the same path started on a new file, the lock that keeps it off gone. Now the next batch makes a
    new file there (locked), the old one's blocks are misses lost to it, its descriptors closed."""
    path = tmp_path / "nvme.cache"
    old, new = (np.random.default_rng(s).integers(0, 256, 2 * ALIGN, dtype=np.uint8) for s in (1, 2))
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        assert a.write_blocks([0], [old]).all()
        os.unlink(path)  # the operator frees the disk
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert a.write_blocks([8 * ALIGN], [new]).all()
        said = f"{path} was removed by another process (an rm, a mv) while the tier ran: 1 blocks it held are lost"
        assert said in caplog.text
        assert path.read_bytes()[:len(nvme.HEADER)] == nvme.HEADER and not _deleted_fds(path)
        out = np.zeros_like(old)
        assert not a.read_blocks([0], [out]).any() and a.lost_to_cut([0]).all()  # a miss that blames no slot
        assert a.read_blocks([8 * ALIGN], [out]).all() and np.array_equal(out, new)
        with pytest.raises(nvme.ArenaError, match="in use by another process"):
            NvmeArena(path, CAP, staging_bytes=STAGING)
    finally:
        a.remove()


def test_a_removal_while_idle_is_found_at_the_background_step(tmp_path, caplog):
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        os.unlink(path)
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.check_file()
        assert f"{path} was removed by another process" in caplog.text and path.exists() and not _deleted_fds(path)
    finally:
        a.remove()


def test_a_file_replaced_by_a_move_is_made_again_on_the_new_one(tmp_path, caplog):
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        assert a.write_blocks([0], [np.ones(ALIGN, dtype=np.uint8)]).all()
        (tmp_path / "empty").write_bytes(b"")
        os.replace(tmp_path / "empty", path)  # an operator's `mv` over it
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert not a.read_blocks([0], [np.zeros(ALIGN, dtype=np.uint8)]).any()
        assert f"{path} was replaced (another file is at the path now) by another process" in caplog.text
        assert os.path.getsize(path) == nvme.HEADER_BYTES + CAP and not _deleted_fds(path)
    finally:
        a.remove()


def test_a_path_another_tier_took_meanwhile_refuses_writes_until_it_is_free(tmp_path, monkeypatch, caplog):
    """The second tier started before the first's next batch (its file removed, the path free): the
    first never goes back to the deleted file; it says why, its writes are refused (the back-off)
    and its reads miss, until the path is free again."""
    path = tmp_path / "nvme.cache"
    data = np.arange(2 * ALIGN, dtype=np.uint64).view(np.uint8)[:2 * ALIGN].copy()
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        assert a.write_blocks([0], [data]).all()
        os.unlink(path)
        b = NvmeArena(path, CAP, staging_bytes=STAGING)  # the path is free: it takes it
        try:
            with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
                with pytest.raises(nvme.ArenaError, match=f"writes are refused until one can be made at {path}"):
                    a.write_blocks([0], [data])
                assert not a.read_blocks([0], [data.copy()]).any() and not _deleted_fds(path)
                with pytest.raises(nvme.ArenaError, match="in use by another process"):
                    a.test_slots([0], [data])
            assert (f"{path} was replaced (another file is at the path now) by another process (an rm, a mv) while "
                    "the tier ran: 1 blocks it held "
                    f"are lost (misses), and a new file cannot be made there: NVMe tier file {path} is in use by "
                    "another process") in caplog.text
        finally:
            b.close()
        clock = nvmegone.time.monotonic() + nvmegone.RETRY_S  # (the next try is due: a second later)
        monkeypatch.setattr(nvmegone, "time", types.SimpleNamespace(monotonic=lambda: clock))
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert a.write_blocks([0], [data]).all()  # b gone: the path is the first tier's again
        assert f"a new file is made at {path}: the tier takes writes again" in caplog.text
        assert a.read_blocks([0], [data.copy()]).all()
    finally:
        a.remove()


def test_a_removal_after_the_last_batch_is_said_as_the_tier_closes(tmp_path, caplog):
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    os.unlink(path)
    with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
        a.close()
    assert f"{path} was removed while the tier ran; the tier closes" in caplog.text
    assert not path.exists() and not _deleted_fds(path)  # (nothing made again as it closes)


def test_a_tier_without_a_file_tries_for_one_once_a_second_and_never_for_a_read(tmp_path, monkeypatch):
    """A review's daemon: while another process held the path, every batch (reads too) tried its
    lock for LOCK_WAIT_S under the tier's lock, on the host backend's one worker thread: acquiring
    an NVMe block took 264 ms where it took 1.5 ms. Now reads miss at once; a write, a re-test or the
    background step tries, at most once a second, with one try of the lock; writes are refused in
    between. The first cause stays in what the tier says, and its status shows it has no file."""
    path = tmp_path / "nvme.cache"
    data = np.ones(ALIGN, dtype=np.uint8)
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    clock = [1000.0]
    monkeypatch.setattr(nvmegone, "time", types.SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    try:
        assert a.write_blocks([0], [data]).all() and a.describe().get("no_file", "") == ""
        os.unlink(path)
        b = NvmeArena(path, CAP, staging_bytes=STAGING)  # a second daemon takes the path
        waits, lock = [], nvme.lock_cache_file

        def counted(fd, p, wait=None):
            waits.append(wait)
            return lock(fd, p, *([] if wait is None else [wait]))
        monkeypatch.setattr(nvme, "lock_cache_file", counted)
        try:
            with pytest.raises(nvme.ArenaError, match="in use by another process"):
                a.write_blocks([0], [data])  # found gone: tried for as at start-up
            assert waits == [None]
            for _ in range(8):
                assert not a.read_blocks([0], [data.copy()]).any()
                with pytest.raises(nvme.ArenaError, match="writes are refused"):
                    a.write_blocks([0], [data])
                with pytest.raises(nvme.ArenaError, match="writes are refused"):
                    a.test_slots([0], [data])
                a.check_file()
            assert waits == [None], "the path's lock was tried again within the second"
            clock[0] += nvmegone.RETRY_S
            for _ in range(8):
                assert not a.read_blocks([0], [data.copy()]).any()
            assert waits == [None], "a read tried the path's lock"
            a.check_file()  # the background step: one try, no wait
            assert waits == [None, 0]
            assert "was replaced (another file is at the path now)" in a.no_file  # (not "was removed")
            assert "in use by another process" in a.describe()["no_file"]
        finally:
            b.close()
        clock[0] += nvmegone.RETRY_S
        assert a.write_blocks([0], [data]).all() and waits == [None, 0, 0] and a.no_file == ""
    finally:
        a.remove()


def test_the_status_and_metrics_show_a_tier_without_a_file(small_nvme_manager):
    """`dflash2 status` could not tell a tier without a file from a healthy one (a review)."""
    from dflash2.metrics import _tier_families
    from dflash2.status import render
    from dflash2.tiers import Tier

    arena = small_nvme_manager.arenas[Tier.NVME]
    os.unlink(arena.path)
    b = NvmeArena(arena.path, arena.capacity_bytes, staging_bytes=STAGING)  # another process takes the path
    try:
        arena.check_file()
        st = small_nvme_manager.stats()
        assert "in use by another process" in st["tiers"]["nvme"]["no_file"]
        assert f"nvme tier has no file (writes refused, reads miss): its file {arena.path} was replaced" in render(
            {"tiers": st["tiers"]})
        gauge = next(f for f in _tier_families(st) if f.name == "dflash2_tier_no_file")
        assert {s.labels["tier"]: s.value for s in gauge.samples} == {"hbm": 0, "dram": 0, "nvme": 1}
    finally:
        b.close()


def test_a_file_moved_away_is_not_said_to_free_its_room(tmp_path, caplog):
    path = tmp_path / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        os.rename(path, tmp_path / "nvme.cache.keep")  # an operator's mv: the file and its room stay
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.check_file()
        assert f"{path} was moved away by another process" in caplog.text
        assert "disk room freed" not in caplog.text and "keeps its disk room where it was moved" in caplog.text
    finally:
        a.remove()


def test_a_new_file_after_a_failed_take_back_is_not_said_taken_back(tmp_path, monkeypatch, caplog):
    """A review's script: a cut whose take-back failed, then the file removed: the new file is whole,
    yet its next batch said the (old) file "is taken back"."""
    path = tmp_path / "nvme.cache"
    data = np.ones(ALIGN, dtype=np.uint8)
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        assert a.write_blocks([0], [data]).all()
        os.truncate(path, 8192)

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(nvmecut.os, "posix_fallocate", full)
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.read_blocks([0], [data.copy()])
        assert "cannot be taken back" in caplog.text
        monkeypatch.undo()
        os.unlink(path)  # the operator removes it: a new, whole file is made
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert a.write_blocks([0], [data]).all() and a.write_blocks([0], [data]).all()
        assert "was removed by another process" in caplog.text and "is taken back to" not in caplog.text
    finally:
        a.remove()


def test_a_path_whose_folder_became_a_file_is_no_disk_error(tmp_path, caplog):
    """A review's script: the file's folder replaced by a file (stat: ENOTDIR) escaped the batch as a
    raw OSError, which the mover takes for the disk's (slots set aside). Now the path names no file
    of the tier's: its blocks are lost to it (misses), writes refused until a file can be made."""
    folder = tmp_path / "sub"
    folder.mkdir()
    path = folder / "nvme.cache"
    data = np.ones(ALIGN, dtype=np.uint8)
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        assert a.write_blocks([0], [data]).all()
        folder.rename(tmp_path / "sub.old")
        folder.write_bytes(b"")
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert not a.read_blocks([0], [data.copy()]).any() and a.lost_to_cut([0]).all()
            with pytest.raises(nvme.ArenaError, match="writes are refused"):
                a.write_blocks([0], [data])
            with pytest.raises(nvme.ArenaError, match="writes are refused"):
                a.test_slots([0], [data])
            a.check_file()
        assert f"{path} can no longer be reached at its path (ENOTDIR: Not a directory)" in caplog.text
    finally:
        a.close()


@pytest.mark.parametrize("how", ["removed", "cut"])
def test_the_blocks_lost_with_the_file_leave_the_cache_at_the_next_step(small_nvme_manager, caplog, how):
    """A review: after an `rm nvme.cache` the log said its blocks lost, but lookups found them and the
    status counted them until each was read, its acquire then blaming an I/O error. The next background
    step drops them (misses), as it does those lost to a cut; a chain's prefix above stays found."""
    from dflash2.errors import UnknownBlock
    from dflash2.tiers import Tier

    from conftest import SMALL

    m = small_nvme_manager
    a = m.attach("a")
    lid = m.register_layout(SMALL)
    vids = m.commit(a, m.allocate(a, lid, 4), keys=[11, 12, 13, 14])
    m.free(a, vids)
    lost = m.table.rows(vids[2:])
    assert m.mover.move(lost, Tier.DRAM).all() and m.mover.move(lost, Tier.NVME).all()
    assert [m.place(int(v)).tier for v in vids] == [Tier.HBM, Tier.HBM, Tier.NVME, Tier.NVME]
    arena = m.arenas[Tier.NVME]
    with caplog.at_level(logging.INFO):
        if how == "removed":  # (found at the step, as the tier is idle)
            os.unlink(arena.path)
        else:  # (found at the tier's next batch: a write of another block, not theirs)
            os.truncate(arena.path, nvme.HEADER_BYTES)
            assert arena.write_blocks([arena.capacity_bytes - ALIGN], [np.ones(ALIGN, dtype=np.uint8)]).all()
        m.tick()
    assert m.stats()["tiers"]["nvme"]["blocks"] == 0
    assert [p.vid for p in m.lookup([11, 12, 13, 14], lid)] == vids[:2].tolist()
    assert "2 blocks lost with the nvme file dropped from the cache (misses)" in caplog.text
    with pytest.raises(UnknownBlock, match="is not live"):  # (a stale id now, as any block dropped)
        m.acquire(a, vids[2:])
    m.check_invariants()


def test_a_block_written_to_nvme_as_the_file_went_leaves_the_cache_once_settled(small_nvme_manager):
    """A review: a block whose write into NVMe had ended but was not yet settled when the step found the
    file gone was skipped (not yet RESIDENT) and the loss taken as seen: once settled, it stayed cached
    and counted in a forgotten slot until a read missed. Looked at again while a move is in flight."""
    from dflash2.tiers import Tier

    from conftest import SMALL

    m = small_nvme_manager
    a = m.attach("a")
    lid = m.register_layout(SMALL)
    vids = m.commit(a, m.allocate(a, lid, 2), keys=[21, 22])
    m.free(a, vids)
    rows = m.table.rows(vids)
    assert m.mover.move(rows[1:], Tier.DRAM).all()
    arena = m.arenas[Tier.NVME]
    move = m.mover.prepare(rows[1:], Tier.NVME)  # DRAM -> NVMe, in flight across the loop's turns
    move.job.wait()  # (its bytes in the old file; not settled yet)
    os.unlink(arena.path)
    m.tick()  # the file found gone, a new one made, the one just written forgotten too
    assert m.mover.complete(move).all()
    m.tick()
    assert m.stats()["tiers"]["nvme"]["blocks"] == 0 and m.table.cols.key[rows[1]] == 0
    assert [p.vid for p in m.lookup([21, 22], lid)] == [int(vids[0])]
    m.tick()
    assert m.placement.stats.lost == 1  # (once)
    m.check_invariants()


def _chain_on_nvme(m, keys: list[int], held: bool = False):
    """(client, vids) of a chain committed under `keys`, moved down to NVMe (`held`: its references kept)."""
    from dflash2.tiers import Tier

    from conftest import SMALL

    a = m.attach("a")
    vids = m.commit(a, m.allocate(a, m.register_layout(SMALL), len(keys)), keys=keys)
    if not held:
        m.free(a, vids)
    rows = m.table.rows(vids)
    assert m.mover.move(rows, Tier.DRAM).all() and m.mover.move(rows, Tier.NVME).all()
    return a, vids


def test_the_blocks_lost_with_the_file_leave_a_bounded_number_a_step(small_nvme_manager, monkeypatch, caplog):
    """A review: dropping every block a removed file held in one step held the loop (a Python step a
    block: 16,384 of them 23,000 ticks' worth); at most FORGOTTEN_PER_STEP leave a step, said once."""
    from dflash2 import manager as M
    from dflash2.tiers import Tier

    monkeypatch.setattr(M, "FORGOTTEN_PER_STEP", 3)
    m = small_nvme_manager
    _chain_on_nvme(m, list(range(31, 39)))
    os.unlink(m.arenas[Tier.NVME].path)
    left = []
    with caplog.at_level(logging.INFO):
        for _ in range(4):
            m.tick()
            left.append(m.stats()["tiers"]["nvme"]["blocks"])
    assert left == [5, 2, 0, 0], left
    assert caplog.text.count("blocks lost with the nvme file dropped") == 1 and "8 blocks lost" in caplog.text
    assert (m.placement.stats.lost, m.placement.stats.orphaned) == (8, 0)  # (a child lost too: lost, not orphaned)
    m.check_invariants()


def test_a_chain_lost_with_the_file_is_counted_lost_whole_across_the_steps(small_nvme_manager, monkeypatch):
    """A review: a chain whose last block fell just past a step's part was dropped with its parent as an
    orphan (counted orphaned, not lost, and left out of the line that says how many were lost)."""
    from dflash2 import manager as M
    from dflash2.tiers import Tier

    monkeypatch.setattr(M, "FORGOTTEN_PER_STEP", 3)
    m = small_nvme_manager
    _chain_on_nvme(m, list(range(41, 48)))
    os.unlink(m.arenas[Tier.NVME].path)
    for _ in range(4):
        m.tick()
    assert (m.placement.stats.lost, m.placement.stats.orphaned) == (7, 0)
    m.check_invariants()


def test_a_held_block_lost_with_the_file_is_refused_naming_the_file(small_nvme_manager):
    """A review: a block its client still held, lost with the file, is kept for it until let go; its
    next acquire was told it was "freed while in flight, or its bytes failed their checksum"."""
    from dflash2.errors import UnknownBlock
    from dflash2.tiers import Tier

    m = small_nvme_manager
    a, vids = _chain_on_nvme(m, [51, 52], held=True)
    os.unlink(m.arenas[Tier.NVME].path)
    m.tick()
    with pytest.raises(UnknownBlock, match="or were lost with the NVMe file cut short or removed"):
        m.acquire(a, vids)
    m.free(a, vids)
    assert m.stats()["tiers"]["nvme"]["blocks"] == 0
    m.check_invariants()


def test_a_chain_lost_with_the_file_and_read_first_is_counted_lost_whole(small_nvme_manager):
    """A review: a read of a chain's first blocks that missed (the file removed) dropped their child,
    lost with the file too but not read, as an orphan (counted orphaned, not lost)."""
    from dflash2.errors import UnknownBlock
    from dflash2.tiers import Tier

    m = small_nvme_manager
    a, vids = _chain_on_nvme(m, [71, 72, 73])
    os.unlink(m.arenas[Tier.NVME].path)
    with pytest.raises(UnknownBlock):
        m.acquire(a, vids[:2])
    for _ in range(3):
        m.tick()
    assert (m.placement.stats.lost, m.placement.stats.orphaned) == (3, 0)
    m.check_invariants()


def test_a_write_refused_for_want_of_a_file_logs_no_traceback(small_nvme_manager, caplog):
    """A review: a drain's write refused while the tier had no file (a folder put at its path) was logged
    with a whole traceback, for an operator's state the tier says in a line of its own."""
    from dflash2.tiers import Tier

    from conftest import SMALL

    m = small_nvme_manager
    a = m.attach("a")
    lid = m.register_layout(SMALL)
    vids = m.commit(a, m.allocate(a, lid, 4), keys=[11, 12, 13, 14])
    m.free(a, vids)
    rows = m.table.rows(vids)
    assert m.mover.move(rows[:2], Tier.DRAM).all() and m.mover.move(rows[:1], Tier.NVME).all()
    path = m.arenas[Tier.NVME].path
    os.unlink(path)
    os.mkdir(path)  # an operator's folder at the path: no file can be made
    try:
        with caplog.at_level(logging.INFO):
            assert not m.mover.move(m.table.rows(vids[1:2]), Tier.NVME).any()  # a DRAM->NVMe drain, refused
        assert "is not a regular file" in caplog.text and "NVMe tier has no file" in caplog.text
        assert not [r for r in caplog.records if r.exc_info], caplog.text
    finally:
        os.rmdir(path)
