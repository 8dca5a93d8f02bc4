"""Start-up's NVMe files when two daemons share a folder and start together, and entries beside the
cache file that cannot be looked at (nvmefiles.py, nvme.py). A review found: a scan that let go of an
earlier daemon's file's lock before it removed the file, while a daemon of another number of GPUs
took that file in between (it then served from a deleted file, its disk room out of sight); a link
that could not be looked at crashing start-up with a traceback (exit 1); and a folder given as
`memory.nvme_path` with several GPUs, whose files went beside it (on the root disk for a mount point)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import threading
import time

import pytest
from conftest import gpu_node, write_config

from dflash2.arena import nvmefiles, nvmeprep
from dflash2.arena.nvme import NvmeArena
from dflash2.assemble import build_managers
from dflash2.config import load_config
from dflash2.daemon import main as dmain
from dflash2.errors import ArenaError

MB = 1 << 20


def start_and_stop(config) -> None:
    for m in build_managers(load_config(config)).values():
        m.close()


def lock_is_held(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_an_earlier_daemons_file_is_removed_only_while_its_lock_is_held(tmp_path, monkeypatch):
    NvmeArena(tmp_path / "nvme.cache.gpu0", 4 * MB, staging_bytes=1 * MB).close()
    real_unlink, seen = os.unlink, []

    def unlink(path, *args, **kwargs):
        if str(path).endswith("gpu0"):
            seen.append(lock_is_held(path))  # another daemon could not take it now
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(nvmefiles.os, "unlink", unlink)
    start_and_stop(write_config(tmp_path))  # one pool: nvme.cache
    assert seen == [True] and not (tmp_path / "nvme.cache.gpu0").exists()


def test_a_file_replaced_as_the_scan_looked_is_not_removed(tmp_path, monkeypatch):
    """The path names another file by the time the scan holds the lock it took (another daemon
    removed the old one and made its own): that file is left."""
    NvmeArena(tmp_path / "nvme.cache.gpu0", 4 * MB, staging_bytes=1 * MB).close()
    real_flock, replaced = fcntl.flock, []

    def flock(fd, op):
        if not replaced and os.fstat(fd).st_size and op & fcntl.LOCK_NB:
            replaced.append(True)
            os.rename(tmp_path / "nvme.cache.gpu0", tmp_path / "old")
            NvmeArena(tmp_path / "nvme.cache.gpu0", 4 * MB, staging_bytes=1 * MB).close()
        return real_flock(fd, op)

    monkeypatch.setattr(nvmefiles.fcntl, "flock", flock)
    start_and_stop(write_config(tmp_path))
    monkeypatch.undo()
    assert replaced and (tmp_path / "nvme.cache.gpu0").exists()


def test_a_daemon_whose_file_is_removed_as_it_opens_it_makes_its_own(tmp_path, monkeypatch, caplog):
    """The other side: a daemon opened the earlier file by path, and a scan removed it before the
    daemon held its lock. The daemon's file must be the one its path names."""
    path = tmp_path / "nvme.cache"
    NvmeArena(path, 4 * MB, staging_bytes=1 * MB).close()
    real_lock, removed = nvmeprep.lock_cache_file, []

    def lock(fd, where, wait=None):
        if not removed:
            removed.append(True)
            os.unlink(where)  # another start's scan, between this start's open and its lock
        return real_lock(fd, where, wait)

    monkeypatch.setattr(nvmeprep, "lock_cache_file", lock)
    with caplog.at_level("INFO", logger="dflash2.arena.nvme"):
        arena = NvmeArena(path, 4 * MB, staging_bytes=1 * MB)
    try:
        mine, named = os.fstat(arena._lock_fd), os.stat(path)
        assert (mine.st_ino, mine.st_dev) == (named.st_ino, named.st_dev) and mine.st_nlink == 1
        assert not arena.reused and "removed or replaced between its open and its lock" in caplog.text
    finally:
        arena.close()


def test_a_lock_held_for_a_moment_by_another_starts_scan_is_waited_for(tmp_path):
    path = tmp_path / "nvme.cache"
    NvmeArena(path, 4 * MB, staging_bytes=1 * MB).close()
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a scan looking at it
    threading.Timer(0.05, os.close, (fd,)).start()
    NvmeArena(path, 4 * MB, staging_bytes=1 * MB).close()  # "in use by another process" before


def test_a_lock_held_for_good_is_still_in_use(tmp_path, monkeypatch):
    path = tmp_path / "nvme.cache"
    held = NvmeArena(path, 4 * MB, staging_bytes=1 * MB)
    try:
        t0 = time.monotonic()
        with pytest.raises(ArenaError, match=f"in use by another process \\(pid {os.getpid()}: "):
            NvmeArena(path, 4 * MB, staging_bytes=1 * MB)
        assert time.monotonic() - t0 >= nvmefiles.LOCK_WAIT_S
    finally:
        held.close()


def test_an_entry_that_cannot_be_looked_at_is_named_and_left(tmp_path, caplog):
    """A link whose target cannot be looked at (ENAMETOOLONG here; EACCES, EIO or a dead FUSE mount
    elsewhere) beside a file this start does not use: a traceback and exit 1 before."""
    link = tmp_path / "nvme.cache.gpu1"
    link.symlink_to(tmp_path / ("x" * 300))
    with caplog.at_level("WARNING", logger="dflash2.arena"):
        start_and_stop(write_config(tmp_path))
    assert os.path.islink(link) and f"cannot look at {link}" in caplog.text and "left as it is" in caplog.text


def test_a_folder_as_nvme_path_is_refused_whatever_the_number_of_gpus(tmp_path, monkeypatch):
    mount = tmp_path / "mnt" / "nvme"
    mount.mkdir(parents=True)  # a disk's mount point, written without a file name
    raw = gpu_node(tmp_path, monkeypatch, 2, nvme_path=str(mount))
    (tmp_path / "c.json").write_text(json.dumps(raw))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        dmain.main(["--config", str(tmp_path / "c.json"), "--check"])
    [line] = [ln for ln in out.getvalue().splitlines() if "memory.nvme_path" in ln and ln.startswith("now:")]
    assert f"{mount} is a folder" in line and f"{mount}/nvme.cache" in line and "would fail now (exit 4)" in line
    assert not list(mount.parent.glob("nvme.gpu*"))
    with pytest.raises(ArenaError, match=f"memory.nvme_path {mount} is a folder"):
        start_and_stop(write_config(tmp_path, memory={"nvme_path": str(mount)}))
