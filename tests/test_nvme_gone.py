"""The NVMe cache file removed, moved away or replaced while its tier runs (`rm nvme.cache`): found
before each batch and at the background step, a new file made at the path (arena/nvmegone.py), none
where it cannot be had (writes refused, said), and the blocks the old file held dropped from the cache,
counted lost once (BlockManager._drop_forgotten). Split from test_nvme_cut.py (the file cut short)."""

import contextlib
import errno
import logging
import os
import types

import numpy as np
import pytest

import dflash2.arena.nvme as nvme
import dflash2.arena.nvmecut as nvmecut
import dflash2.arena.nvmefiles as nvmefiles
import dflash2.arena.nvmeprep as nvmeprep
import dflash2.arena.nvmegone as nvmegone
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.staging import ALIGN

CAP = 16 << 20
STAGING = 64 << 10


@contextlib.contextmanager
def _tier(path):
    """An NVMe tier of CAP bytes at `path`, removed after."""
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        yield a
    finally:
        a.remove()


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
    with _tier(path) as a:
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


def test_a_removal_while_idle_is_found_at_the_background_step(tmp_path, caplog):
    path = tmp_path / "nvme.cache"
    with _tier(path) as a:
        os.unlink(path)
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.check_file()
        assert f"{path} was removed by another process" in caplog.text and path.exists() and not _deleted_fds(path)


def test_a_file_replaced_by_a_move_is_made_again_on_the_new_one(tmp_path, caplog):
    path = tmp_path / "nvme.cache"
    with _tier(path) as a:
        assert a.write_blocks([0], [np.ones(ALIGN, dtype=np.uint8)]).all()
        (tmp_path / "empty").write_bytes(b"")
        os.replace(tmp_path / "empty", path)  # an operator's `mv` over it
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert not a.read_blocks([0], [np.zeros(ALIGN, dtype=np.uint8)]).any()
        assert f"{path} was replaced (another file is at the path now) by another process" in caplog.text
        assert os.path.getsize(path) == nvme.HEADER_BYTES + CAP and not _deleted_fds(path)


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
        waits, lock = [], nvmeprep.lock_cache_file

        def counted(fd, p, wait=None):
            waits.append(wait)
            return lock(fd, p, *([] if wait is None else [wait]))
        monkeypatch.setattr(nvmeprep, "lock_cache_file", counted)
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
    with _tier(path) as a:
        os.rename(path, tmp_path / "nvme.cache.keep")  # an operator's mv: the file and its room stay
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.check_file()
        assert f"{path} was moved away by another process" in caplog.text
        assert "disk room freed" not in caplog.text and "keeps its disk room where it was moved" in caplog.text


def test_a_new_file_after_a_failed_take_back_is_not_said_taken_back(tmp_path, monkeypatch, caplog):
    """A review's script: a cut whose take-back failed, then the file removed: the new file is whole,
    yet its next batch said the (old) file "is taken back"."""
    path = tmp_path / "nvme.cache"
    data = np.ones(ALIGN, dtype=np.uint8)
    with _tier(path) as a:
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


def test_a_link_put_at_a_running_tiers_path_is_taken_as_at_start_up(tmp_path, caplog):
    """A review's script: the cache moved to another disk (`rm nvme.cache; ln -s /mnt/nvme1/nvme.cache
    nvme.cache`, the target not there yet) under a running tier. Start-up takes such a path (its
    target made); the renewal opened the link as it stood, said the file "removed each of the 3
    times this start opened it", and the tier had no file for good. Now the target is made, locked."""
    (tmp_path / "disk2").mkdir()
    path, target = tmp_path / "nvme.cache", tmp_path / "disk2" / "nvme.cache"
    data = np.arange(2 * ALIGN, dtype=np.uint64).view(np.uint8)[:2 * ALIGN].copy()
    with _tier(path) as a:
        assert a.write_blocks([0], [data]).all()
        os.unlink(path)
        os.symlink(target, path)
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            assert a.write_blocks([0], [data]).all()
        assert not a.no_file and a.path == str(target) and target.read_bytes()[:len(nvme.HEADER)] == nvme.HEADER
        assert (f"{path} was replaced by a symbolic link (to {target}) by another process (an rm, a mv) while the "
                f"tier ran: 1 blocks it held are lost (misses); a new file is made at {target}, where the symbolic "
                f"link {path} leads") in caplog.text
        with pytest.raises(nvme.ArenaError, match="in use by another process"):
            NvmeArena(path, CAP, staging_bytes=STAGING)  # (the target is locked: a second daemon is kept off)
        out = np.zeros_like(data)
        assert a.read_blocks([0], [out]).all() and np.array_equal(out, data)
        target.unlink()  # the link's target removed in its turn: made again where the link leads now
        os.unlink(path)
        os.symlink(tmp_path / "disk2" / "other.cache", path)
        a.check_file()
        assert not a.no_file and (tmp_path / "disk2" / "other.cache").exists() and not target.exists()


def test_a_link_whose_target_cannot_be_made_is_named_with_its_target(tmp_path, caplog):
    (tmp_path / "notafolder").write_bytes(b"")
    path, target = tmp_path / "nvme.cache", tmp_path / "notafolder" / "disk2" / "nvme.cache"
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    try:
        os.unlink(path)
        os.symlink(target, path)
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            with pytest.raises(nvme.ArenaError, match="writes are refused"):
                a.write_blocks([0], [np.ones(ALIGN, dtype=np.uint8)])
        assert a.no_file == (f"its file {path} was replaced by a symbolic link (to {target}) and a new one cannot "
                             f"be made at {target}, where the symbolic link {path} leads: NVMe tier cannot create "
                             f"its file at {target}: {tmp_path / 'notafolder'} is not a folder")
        assert "removed each" not in caplog.text and "this start" not in caplog.text
    finally:
        a.close()


def test_a_link_put_at_the_path_as_it_is_opened_is_not_said_removed(tmp_path):
    """(open_cache_file takes a resolved path) a dangling link there was taken for a file removed
    between its create and its open, each of the tries."""
    os.symlink(tmp_path / "elsewhere.cache", tmp_path / "nvme.cache")
    with pytest.raises(nvme.ArenaError) as e:
        nvmefiles.open_cache_file(str(tmp_path / "nvme.cache"))
    assert str(e.value).startswith(f"NVMe tier cannot open {tmp_path / 'nvme.cache'}: a symbolic link to "
                                   f"{tmp_path / 'elsewhere.cache'}, which does not exist, was put there")


def test_a_folder_that_cannot_be_made_is_not_said_gone(tmp_path, monkeypatch):
    """A folder that mkdir cannot make where it finds no folder (ENOENT, as under /proc) was said to be
    "gone", though it never was (a review)."""
    real = os.mkdir

    def no_folders_here(path, *a, **k):
        if os.fspath(path).startswith(os.fspath(tmp_path / "pseudo")):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, "mkdir", no_folders_here)
    with pytest.raises(nvme.ArenaError) as e:
        nvmefiles.open_cache_file(str(tmp_path / "pseudo" / "dfl" / "nvme.cache"))
    assert str(e.value) == (f"NVMe tier cannot make the folder {tmp_path / 'pseudo'} for its file "
                            f"{tmp_path / 'pseudo' / 'dfl' / 'nvme.cache'}: No such file or directory"), str(e.value)


def test_an_absolute_path_needs_no_working_folder(tmp_path, monkeypatch):
    """(9182a2f asked os.getcwd for every path) a daemon started from a removed working folder, its
    nvme_path absolute, crashed making the tier (exit 1, a traceback)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    NvmeArena(str(tmp_path / "nvme.cache"), CAP, staging_bytes=STAGING).remove()


def test_a_file_moved_away_from_behind_a_link_left_at_its_path_is_said_moved(tmp_path, caplog):
    """`mv nvme.cache d2/; ln -s d2/nvme.cache nvme.cache` (one filesystem): the tier goes on with its
    file. Moved away again later, it was said "replaced by a symbolic link", "its disk room freed"
    (a review): nothing replaced it, and it keeps its room where it went."""
    (tmp_path / "d2").mkdir()
    path, moved = tmp_path / "nvme.cache", tmp_path / "d2" / "nvme.cache"
    with _tier(path) as a:
        assert a.write_blocks([0], [np.ones(ALIGN, dtype=np.uint8)]).all()
        os.rename(path, moved)
        os.symlink(moved, path)
        a.check_file()
        os.rename(moved, tmp_path / "d2" / "kept.cache")
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.check_file()
        assert f"{path} {nvmegone.MOVED} by another process" in caplog.text, caplog.text
        assert "(it keeps its disk room where it was moved)" in caplog.text and "freed" not in caplog.text


@pytest.mark.parametrize("how", ["link gone", "folder repointed"])
def test_a_renewal_names_a_link_only_where_there_is_one(tmp_path, caplog, how):
    """The renewal said "where the symbolic link P leads" whenever P led elsewhere than before, also
    where P is no link now: the link and its target removed (the file made at P itself), or a folder
    above P that is a link, pointed elsewhere (a review)."""
    for d in ("d1", "d2"):
        (tmp_path / d).mkdir()
    if how == "link gone":
        path, target = tmp_path / "nvme.cache", tmp_path / "d2" / "nvme.cache"
        os.symlink(target, path)
    else:
        os.symlink(tmp_path / "d1", tmp_path / "disk")
        path, target = tmp_path / "disk" / "nvme.cache", tmp_path / "d1" / "nvme.cache"
    with _tier(path) as a:
        assert a.path == str(target)
        target.unlink()
        if how == "link gone":
            path.unlink()
            where = f"a new file is made at {path} (its header"
        else:
            (tmp_path / "disk").unlink()
            os.symlink(tmp_path / "d2", tmp_path / "disk")
            where = f"a new file is made at {tmp_path / 'd2' / 'nvme.cache'}, where the path {path} now leads"
        with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
            a.check_file()
        assert where in caplog.text and "symbolic link" not in caplog.text, caplog.text


def test_a_file_that_a_folder_there_cannot_hold_is_not_said_gone(tmp_path, monkeypatch):
    """A file the filesystem of an existing folder cannot make (ENOENT on O_CREAT, as in /proc) was
    said to be in a folder "gone", the folder there all along (a review: memory.nvme_path
    /proc/nvme.cache, where `--check` said the filesystem has no blocks)."""
    real = os.open

    def no_files_here(path, flags, *a, **k):
        if os.fspath(path) == os.fspath(tmp_path / "nvme.cache"):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        return real(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", no_files_here)
    with pytest.raises(nvme.ArenaError) as e:
        nvmefiles.open_cache_file(str(tmp_path / "nvme.cache"))
    assert "gone" not in str(e.value), str(e.value)
    assert str(e.value) == (f"NVMe tier cannot create its file at {tmp_path / 'nvme.cache'}: the filesystem of "
                            f"{tmp_path} makes no files (such as /proc or /sys); give a path on a disk"), str(e.value)
