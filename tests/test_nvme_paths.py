"""Where the NVMe tier's file is, as start-up and `--check` see it: a symlink's target (an operator
links ~/.cache/dflash2/nvme.cache onto a large disk), a file another daemon holds, and the host
memory the staging buffers take on a GPU node (found by a review of the NVMe tier)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import time
from pathlib import Path

import pytest
from conftest import gpu_node, write_config

from dflash2.arena.nvme import NvmeArena
from dflash2.config import load_config, parse_config
from dflash2.daemon import main as dmain
from dflash2.errors import CapacityError
from dflash2.plan import resolve_plan

MB = 1 << 20


def check(path) -> tuple[int, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dmain.main(["--config", str(path), "--check"])
    return rc, out.getvalue().splitlines()


def now_lines(out: list[str]) -> list[str]:
    return [line for line in out if line.startswith("now: ")]


def test_an_absolute_symlinked_nvme_path_is_its_target(tmp_path):
    disk = tmp_path / "big-disk"
    disk.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    link = home / "nvme.cache"
    link.symlink_to(disk / "nvme.cache")  # dangling: the target is made at start-up
    cfg = load_config(write_config(tmp_path, memory={"nvme_path": str(link)}))
    assert cfg.resolved_nvme_path == disk / "nvme.cache"  # (a relative path was resolved; an absolute one not)
    rc, out = check(write_config(tmp_path, memory={"nvme_path": str(link)}))
    assert rc == 0 and now_lines(out)[-1].startswith(f"now: the NVMe file needs {4096 + 32 * MB} bytes at "
                                                     f"{disk / 'nvme.cache'}")


def test_a_dangling_symlink_given_to_the_arena_is_followed(tmp_path):
    target = tmp_path / "disk" / "nvme.cache"
    target.parent.mkdir()
    link = tmp_path / "nvme.cache"
    link.symlink_to(target)
    arena = NvmeArena(link, 1 * MB, staging_bytes=1 * MB)  # was ENOENT: O_CREAT|O_EXCL does not follow it
    try:
        assert arena.path == str(target) and target.is_file() and link.is_symlink()
    finally:
        arena.close()


def test_free_room_is_measured_on_the_files_own_disk(tmp_path, monkeypatch):
    """The folder holding the link may be a small disk and the target a large one: the room asked of
    the disk is the file's. (Stands in for two filesystems: the link's folder says it has 4 MiB.)"""
    target = tmp_path / "disk" / "nvme.cache"
    target.parent.mkdir()
    small = tmp_path / "small"
    small.mkdir()
    (small / "nvme.cache").symlink_to(target)
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        if Path(path) == small:
            return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 1024, 1024, *tuple(st)[5:]))
        return st

    monkeypatch.setattr(os, "statvfs", statvfs)
    arena = NvmeArena(small / "nvme.cache", 16 * MB, staging_bytes=1 * MB)  # was: "only 4194304 free"
    arena.close()


def test_check_says_a_file_another_daemon_holds_would_fail(tmp_path):
    path = write_config(tmp_path)
    rc, out = check(path)
    assert rc == 0 and now_lines(out)[-1].endswith(": fits")
    held = NvmeArena(tmp_path / "nvme.cache", 32 * MB, staging_bytes=1 * MB)  # as a running daemon holds it
    try:
        rc, out = check(path)
        assert rc == 0
        # Naming the process that holds it (this one: "another process" named none).
        line = now_lines(out)[-1]
        assert line.startswith(f"now: {tmp_path / 'nvme.cache'} is in use by another process, a daemon serving from "
                               f"it (pid {os.getpid()}: "), line
        assert line.endswith("): start-up would fail now (exit 4)"), line
    finally:
        held.close()
    assert now_lines(check(path)[1])[-1].endswith(": fits")


def test_an_existing_file_on_a_read_only_place_is_named_as_such(tmp_path, monkeypatch):
    """(Root opens a file of mode 000, so the refusal is made here as a read-only filesystem makes it.)"""
    path = tmp_path / "nvme.cache"
    NvmeArena(path, 1 * MB, staging_bytes=1 * MB).close()
    real = os.open

    def refusing(p, flags, *args):
        if os.fspath(p) == str(path) and not flags & os.O_CREAT:
            raise OSError(30, "Read-only file system", str(path))
        return real(p, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(Exception, match=f"NVMe tier cannot open its existing file {path}: .*Read-only"):
        NvmeArena(path, 1 * MB, staging_bytes=1 * MB)


def test_staging_on_a_gpu_node_is_counted_per_gpu_and_twice(tmp_path, monkeypatch):
    """Each GPU's pool takes an NVMe staging ring and a pinned buffer, both of the configured size:
    eight GPUs with 512 MB staging take 8 GB of host memory, which `--check` said was 512 MB."""
    raw = gpu_node(tmp_path, monkeypatch, 2)
    plan = resolve_plan(parse_config(raw))
    assert plan.staging_taken_bytes == 2 * 2 * 16 * MB
    assert plan.to_dict()["staging_taken_bytes"] == 64 * MB
    assert "staging:     16.0 MiB a buffer; 64.0 MiB of host memory in all" in plan.render_text()
    line = next(line for line in dmain.room_now(plan) if "host memory tiers" in line)  # (a CuPy line may lead)
    assert f"and the staging buffers {64 * MB} bytes of memory" in line
    host = resolve_plan(load_config(write_config(tmp_path)))
    assert host.staging_taken_bytes == host.staging_bytes  # one ring, one pool
    assert "staging:     4.0 MiB\n" in host.render_text() + "\n"


def test_a_socket_path_through_a_symlink_stays_as_written(tmp_path):
    """Following links in every absolute path put a socket whose folder links to a long path past
    the 107 bytes a socket path may have: a config that served refused to start, and its clients
    to connect (a review of the fix)."""
    deep = tmp_path / ("k" * 90)
    deep.mkdir()
    (tmp_path / "s").symlink_to(deep)
    cfg = load_config(write_config(tmp_path, daemon={"endpoint": f"ipc://{tmp_path}/s/d.sock"}))
    assert cfg.resolved_endpoint() == f"ipc://{tmp_path}/s/d.sock"


def test_a_symlink_loop_at_the_nvme_path_is_named_by_key(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    rc, out = check(write_config(tmp_path, memory={"nvme_path": str(tmp_path / "a" / "nvme.cache")}))
    assert rc == 2  # a traceback (RuntimeError: Symlink loop) before


def test_a_file_where_a_folder_of_the_nvme_path_must_be_is_named(tmp_path):
    """makedirs said "[Errno 17] File exists: '/etc/passwd'", as if the cache file existed."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(Exception, match=f"NVMe tier cannot create its file at {blocker}/sub/nvme.cache: "
                                        f"{blocker} is not a folder$"):
        NvmeArena(blocker / "sub" / "nvme.cache", 1 * MB, staging_bytes=1 * MB)
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("end", ["/", "/.", "/.."])
def test_an_nvme_path_ending_in_a_slash_is_refused_by_key(tmp_path, end):
    """It named a folder; the slash (or `.`) went when the path was resolved, and the folder meant
    became an 8 MB cache file."""
    with pytest.raises(Exception, match=rf"memory\.nvme_path.*ends in '{end.lstrip('/') or '/'}', a folder; give the "
                                        "cache file's path in it"):
        load_config(write_config(tmp_path, memory={"nvme_capacity_mb": 8, "nvme_path": f"{tmp_path}/newdir{end}"}))
    assert not (tmp_path / "newdir").exists()


def test_check_weighs_the_host_tiers_against_an_address_space_limit(tmp_path, monkeypatch):
    # A review: under `ulimit -v` --check said the DRAM tier fit (memory and /dev/shm were free), and
    # start-up then failed to map it (exit 4). The limit's room past what the check maps is weighed.
    import dflash2.arena.shm as shm

    plan = resolve_plan(load_config(write_config(tmp_path)))  # (HBM stand-in 8 MB, DRAM 16 MB, staging 4 MB)
    assert not any("address space" in line for line in dmain.room_now(plan)) or shm.address_space() is not None
    monkeypatch.setattr(shm, "address_space", lambda: (1 << 30, (1 << 30) - 20 * MB))
    line = [ln for ln in dmain.room_now(plan) if "address space" in ln][0]
    assert line.endswith(f"leaves {20 * MB} of {1 << 30} past what this check maps: start-up would fail now (exit 4)")
    assert f"take {28 * MB} bytes of address space" in line and "ulimit -v" in line
    monkeypatch.setattr(shm, "address_space", lambda: (1 << 30, 100 * MB))
    assert [ln for ln in dmain.room_now(plan) if "address space" in ln][0].endswith(": fits")
    monkeypatch.setattr(shm, "address_space", lambda: None)  # (no limit: no line)
    assert not any("address space" in ln for ln in dmain.room_now(plan))


def test_a_second_daemon_is_kept_off_a_path_whose_file_was_removed(tmp_path):
    """A review's script (two real daemons): `rm nvme.cache` under a running daemon let a second one
    on the same memory.nvme_path start on a new file (the lock went with the deleted file), the first
    serving from the deleted one, its room out of sight. Now the first makes a new file there within
    a step, even while idle, and the second is refused as the path's file is in use."""
    from daemon_proc import DaemonProcess

    nvme = tmp_path / "disk" / "nvme.cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfgs = [write_config(tmp_path / d, memory={"nvme_path": str(nvme), "nvme_capacity_mb": 4}) for d in "ab"]
    first = DaemonProcess(cfgs[0]).start()
    try:
        os.unlink(nvme)  # the operator frees the disk
        deadline = time.monotonic() + 10
        while f"{nvme} was removed by another process" not in first.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nvme.exists(), first.log()
        with pytest.raises(RuntimeError, match=f"(?s)exited with 4: .*{nvme} is in use by another process"):
            DaemonProcess(cfgs[1]).start()
    finally:
        first.stop()


def test_check_counts_the_serving_daemons_thread_stacks_against_an_address_space_limit(tmp_path, monkeypatch):
    """The tiers alone fit in the limit's room; the serving daemon's threads' stacks did not, and
    start-up failed to start a thread after "fits" (a review)."""
    import dflash2.arena.shm as shm
    import dflash2.mainstack as mainstack

    plan = resolve_plan(load_config(write_config(tmp_path)))  # (28 MB of tiers; an NVMe tier: its workers too)
    monkeypatch.setattr(shm, "address_space", lambda: (1 << 30, (1 << 30) - 80 * MB))  # (28 + 48 + 40 MB > 80)
    monkeypatch.setattr(shm, "thread_stack_bytes", lambda: 8 * MB)
    monkeypatch.setattr(mainstack, "main_stack_short", lambda: 2 * MB)  # (the main thread's, grown at start-up)
    line = [ln for ln in dmain.room_now(plan) if "address space" in ln][0]
    threads = 4 + 2  # (ZeroMQ's two, the stall watch, the host transfer; the NVMe tier's two workers)
    assert f"serving daemon's {threads} threads' stacks {threads * 8 * MB} more" in line
    assert f"its main thread's stack's growth {2 * MB} and" in line
    assert f"its tables and heap about {40 * MB}" in line  # (32 MiB, and 2^16 rows of the table at 128 bytes)
    heat = [ln for ln in dmain.room_now(plan, 0, "heat", 8) if "address space" in ln][0]
    assert f"its tables and heap about {32 * MB + 11 * MB + 64 * MB}" in heat  # (the duel's rows, the sketch)
    assert line.endswith("start-up would fail now (exit 4)")
    monkeypatch.setattr(shm, "thread_stack_bytes", lambda: 1 * MB)
    assert [ln for ln in dmain.room_now(plan) if "address space" in ln][0].endswith(": fits")  # (28 + 6 + 2 + 40)
    monkeypatch.setattr(mainstack, "main_stack_short", lambda: 7 * MB)  # (81 MB: the stack's growth weighed)
    assert [ln for ln in dmain.room_now(plan) if "address space" in ln][0].endswith("start-up would fail now (exit 4)")


def check_under_file_size_limit(path, limit: int):
    """`check(path)` with this process's file size limit (ulimit -f) at `limit` bytes, put back after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return check(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_check_says_a_file_size_limit_below_the_nvme_file_fails_start_up(tmp_path):
    """`--check` said the NVMe file fit under a file size limit (ulimit -f) below it, and start-up then
    exited 4 (a review)."""
    rc, out = check_under_file_size_limit(write_config(tmp_path), 16 * MB)
    assert rc == 0 and now_lines(out)[-1] == (
        f"now: the NVMe file needs {4096 + 32 * MB} bytes at {tmp_path / 'nvme.cache'}, and this process's file "
        f"size limit (RLIMIT_FSIZE: ulimit -f) is {16 * MB} bytes: start-up would fail now (exit 4)"), out


def test_check_says_a_file_size_limit_below_a_shared_memory_segment_fails_start_up(tmp_path):
    """The host memory tiers' segments are files in /dev/shm, under the same file size limit: `--check`
    said they fit, and start-up then exited 4 on "[Errno 27] File too large" (a review)."""
    rc, out = check_under_file_size_limit(write_config(tmp_path), 12 * MB)
    assert rc == 0 and (f"now: the dram tier's shared-memory segment needs {16 * MB} bytes, and this process's file "
                        f"size limit (RLIMIT_FSIZE: ulimit -f) is {12 * MB} bytes: start-up would fail now (exit 4)"
                        in now_lines(out)), out


def _out_of_inodes(monkeypatch, folder: Path) -> None:
    """The filesystem of `folder` as one with room for bytes and no free inode (ext4's, fixed at mkfs):
    statvfs says so, and creating a file or folder there fails with ENOSPC."""
    real_statvfs, real_open, real_mkdir = os.statvfs, os.open, os.mkdir

    def statvfs(path):
        st = real_statvfs(path)
        if Path(path) == folder:
            return os.statvfs_result((*tuple(st)[:5], 1000, 0, 0, *tuple(st)[8:]))
        return st

    def refuse(real):
        def call(path, *args, **kwargs):
            if Path(path).parent == folder or Path(path).parent.parent == folder:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "open", refuse(real_open))
    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))


@pytest.mark.parametrize("name", ["nvme.cache", "sub/nvme.cache"])
def test_a_filesystem_out_of_inodes_is_said_by_check_and_start_up(tmp_path, monkeypatch, name):
    """A filesystem with room for bytes and no free inode: `--check` said the NVMe file fit, and start-up
    exited 4 on "[Errno 28] No space left on device" on a disk with room (a review: ext4 made with few
    inodes, every one taken). Both now say it is the inodes, start-up what to do."""
    disk = tmp_path / "disk"
    disk.mkdir()
    path = write_config(tmp_path, memory={"nvme_path": str(disk / name)})
    _out_of_inodes(monkeypatch, disk)
    rc, out = check(path)
    assert rc == 0 and now_lines(out)[-1] == (
        f"now: {disk} is on a filesystem with 0 free inodes (df -i), so the NVMe file {disk / name} cannot be made, "
        "though it has room for bytes: start-up would fail now (exit 4)"), out
    with pytest.raises(CapacityError, match=re.escape(f"NVMe tier cannot create its file at {disk / name}: No space "
                                                      f"left on device: its filesystem has no free inodes (df -i {disk}), "
                                                      "though it has room for bytes: remove files there, or set "
                                                      "memory.nvme_path")):
        NvmeArena(disk / name, 1 * MB, staging_bytes=1 * MB)


def test_a_start_out_of_inodes_takes_back_the_folders_it_made(tmp_path, monkeypatch):
    """One inode left: the start made the file's folder with it, failed on the file, and left the folder,
    so the filesystem had none left and the next start was told to remove files in that empty folder (a
    review, a tmpfs of nr_inodes=4). The folders it made go again, and the error names the folder that
    was there."""
    disk = tmp_path / "disk"
    disk.mkdir()
    real_statvfs, real_open = os.statvfs, os.open

    def statvfs(path):
        st = real_statvfs(path)
        inside = Path(path) == disk or disk in Path(path).parents
        return os.statvfs_result((*tuple(st)[:5], 1000, 0, 0, *tuple(st)[8:])) if inside else st

    def open_(path, *args, **kwargs):
        if Path(path).name == "nvme.cache":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(CapacityError, match=re.escape(f"its filesystem has no free inodes (df -i {disk}), though it "
                                                      "has room for bytes")):
        NvmeArena(disk / "a" / "b" / "nvme.cache", 1 * MB, staging_bytes=1 * MB)
    assert list(disk.iterdir()) == []


def test_a_spent_quota_that_makes_no_file_says_so_and_takes_back_its_folders(tmp_path, monkeypatch):
    """EDQUOT making the file (this user's inode quota spent): said as "[Errno 122] Disk quota exceeded"
    alone, where the fallocate's EDQUOT is said with what to do, and the folder made for it, which took
    the quota's last inode, was left."""
    real_open = os.open

    def spent(path, flags, *args, **kwargs):
        if Path(path).name == "nvme.cache" and flags & os.O_CREAT:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spent)
    with pytest.raises(CapacityError, match=re.escape(f"NVMe tier cannot create its file at {tmp_path}/a/nvme.cache: "
                                                      "Disk quota exceeded: this user's disk quota there is spent "
                                                      "(quota -s)")):
        NvmeArena(tmp_path / "a" / "nvme.cache", 1 * MB, staging_bytes=1 * MB)
    assert not (tmp_path / "a").exists()


def test_the_inodes_of_several_gpus_files_are_counted_together(tmp_path, monkeypatch):
    """Two GPUs' NVMe files where one inode is free: each file's own check found its one inode, `--check`
    said they fit, and start-up failed on the second with "No space left on device" (a review)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    raw = gpu_node(tmp_path, monkeypatch, 2, nvme_path=str(disk / "nvme.cache"))
    plan = resolve_plan(parse_config(raw))
    real_statvfs = os.statvfs

    def statvfs(path):
        st = real_statvfs(path)
        return os.statvfs_result((*tuple(st)[:5], 1000, 1, 1, *tuple(st)[8:])) if Path(path) == disk else st

    monkeypatch.setattr(os, "statvfs", statvfs)
    assert (f"{disk} is on a filesystem with 1 free inodes (df -i), so the 2 NVMe files {disk}/nvme.cache.gpu0, "
            f"{disk}/nvme.cache.gpu1 cannot all be made (2 inodes with their folders), though it has room for bytes: "
            "start-up would fail now (exit 4)") in dmain.room_now(plan)


def test_a_full_disk_that_makes_no_file_says_so(tmp_path, monkeypatch):
    """ENOSPC making the file where inodes are left: the disk is full, said with what to do."""
    real_open = os.open

    def full(path, *args, **kwargs):
        if Path(path) == tmp_path / "nvme.cache":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(CapacityError, match="its disk is full: free room there, or set memory.nvme_path"):
        NvmeArena(tmp_path / "nvme.cache", 1 * MB, staging_bytes=1 * MB)
