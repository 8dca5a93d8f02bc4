"""Faults in the host arenas' start-up and data path: a disk or an address space that runs out, a
close that races a batch. Each injects the failure at the syscall wrapper (or a real rlimit)."""

import errno
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

import dflash2.arena.nvme as nvme
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.shm import shm_free_bytes
from dflash2.arena.staging import ALIGN
from dflash2.errors import ArenaError, CapacityError

CAP = 4 << 20
STAGING = 64 << 10


def _disk_fills_half_way(monkeypatch):
    """posix_fallocate as ext4 does it on a disk that fills part way: what it allocated stays (and
    the file grows over it, zeros), then ENOSPC."""
    real = os.posix_fallocate

    def half(fd, offset, length):
        real(fd, offset, length // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", half)


def test_a_preallocation_cut_short_by_a_full_disk_leaves_nothing_and_the_next_start_works(tmp_path, monkeypatch):
    path = tmp_path / "nvme.bin"
    _disk_fills_half_way(monkeypatch)
    with pytest.raises(CapacityError, match="preallocation failed: .*No space left on device: free room on that disk, "
                                            "lower memory.nvme_capacity_mb, or set memory.nvme_path"):
        NvmeArena(path, CAP, staging_bytes=STAGING)
    monkeypatch.undo()
    assert not path.exists()  # the half-allocated file is not left holding the disk space
    a = NvmeArena(path, CAP, staging_bytes=STAGING)  # the disk has room again: the tier starts
    a.remove()


def test_a_preallocation_past_the_users_disk_quota_names_the_quota(tmp_path, monkeypatch):
    """EDQUOT was told to "free room on that disk", which may have plenty: the quota is what is spent (a review)."""
    def over_quota(fd, offset, length):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "posix_fallocate", over_quota)
    with pytest.raises(CapacityError, match="preallocation failed: .*Disk quota exceeded: free room under this "
                                            "user's disk quota there"):
        NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)


def test_a_preallocation_cut_short_in_an_empty_file_leaves_a_cache_file(tmp_path, monkeypatch):
    # An empty file at the path (made by hand, or by an earlier start killed at once) is taken as
    # the cache file; when its preallocation fails part way it must still read as ours next time.
    path = tmp_path / "nvme.bin"
    path.touch()
    _disk_fills_half_way(monkeypatch)
    with pytest.raises(CapacityError, match="preallocation failed"):
        NvmeArena(path, CAP, staging_bytes=STAGING)
    monkeypatch.undo()
    assert path.read_bytes()[:len(nvme.HEADER)] == nvme.HEADER
    a = NvmeArena(path, CAP, staging_bytes=STAGING)
    a.remove()


def test_a_full_disk_at_the_header_write_is_a_capacity_error_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "nvme.bin"

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(CapacityError, match=f"cannot prepare its file at {path} .*No space left"):
        NvmeArena(path, CAP, staging_bytes=STAGING)
    monkeypatch.undo()
    assert not path.exists()


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_close_that_runs_between_a_batchs_checks_and_its_io_is_an_arena_error(tmp_path, monkeypatch, op):
    # Another thread closes the tier (a daemon shutting down while a staged move starts) after the
    # batch was checked and before it takes the ring: the batch fails as "closed", cleanly.
    a = NvmeArena(tmp_path / "nvme.bin", CAP, staging_bytes=STAGING)
    try:
        a.write_blocks([0, ALIGN], [np.ones(10, np.uint8), np.ones(10, np.uint8)])
        real = nvme._as_bytes

        def closing(buf, writable):
            a.close()  # the lock is free here, as it is for another thread's close()
            return real(buf, writable)

        monkeypatch.setattr(nvme, "_as_bytes", closing)
        bufs = [np.zeros(10, np.uint8), np.zeros(10, np.uint8)]
        with pytest.raises(ArenaError, match="is closed"):
            if op == "write":
                a.write_blocks([0, ALIGN], bufs)
            else:
                a.read_blocks([0, ALIGN], bufs)
    finally:
        a.remove()


def test_a_segment_that_cannot_be_mapped_is_a_capacity_error_and_leaves_nothing():
    # An address-space limit (ulimit -v, as batch schedulers set it) refuses the mapping after the
    # segment took its memory: start-up must fail with the tier named, and give the memory back.
    size = 256 << 20
    if shm_free_bytes() < 2 * size:
        pytest.skip("/dev/shm is too small for this test")
    name = f"dflash2-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent(f"""
        import os, resource
        from dflash2.arena.shm import SharedMemoryArena
        from dflash2.errors import CapacityError
        from dflash2.tiers import Tier
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
        try:
            SharedMemoryArena.create({name!r}, {size}, Tier.DRAM)
        except CapacityError as e:
            print("CapacityError:", e)
        print("left:", os.path.exists("/dev/shm/{name}"))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"CapacityError: dram tier could not map {size} bytes of shared memory for segment {name!r}" \
            in out.stdout
        # The limit named, and what to change (it said "Cannot allocate memory" alone, with memory
        # free: an operator looked at /dev/shm and RAM, a review).
        assert "the daemon's address space is limited to" in out.stdout and "ulimit -v" in out.stdout, out.stdout
        assert "left: False" in out.stdout
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_a_client_that_cannot_map_a_segment_gets_an_arena_error():
    # A serving process under an address-space limit attaches to a daemon's segment: the engine
    # integration falls back on a dflash2 error; a raw OSError would escape into the engine.
    size = 256 << 20
    if shm_free_bytes() < 2 * size:
        pytest.skip("/dev/shm is too small for this test")
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2.tiers import Tier
    name = f"dflash2-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    arena = SharedMemoryArena.create(name, size, Tier.DRAM, populate=False)
    script = textwrap.dedent(f"""
        import resource
        from dflash2.arena.shm import SharedMemoryArena
        from dflash2.errors import ArenaError
        from dflash2.tiers import Tier
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
        try:
            SharedMemoryArena.attach({name!r}, Tier.DRAM)
        except ArenaError as e:
            print("ArenaError:", e)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"ArenaError: dram tier: shared-memory segment /dev/shm/{name} ({size} bytes) cannot be mapped" \
            in out.stdout
    finally:
        arena.close()
