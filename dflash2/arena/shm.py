"""A memory arena in a named POSIX shared-memory segment (a file under /dev/shm).

The daemon `create`s the segment once at start-up and populates it, so the memory is really taken
then and not at the first block write; a client process `attach`es by name and gets the same bytes
(no copy, no unlink on close). It is the DRAM tier, and it stands in for HBM on a machine without a
GPU.

We do not use `multiprocessing.shared_memory`: its resource tracker unlinks segments that it thinks
are leaked, behind the daemon's back.

Invariant: only the creator unlinks the segment; views handed out stay valid until `close`.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from dflash2.arena.base import MemoryArena
from dflash2.errors import ArenaError, CapacityError
from dflash2.tiers import Tier

SHM_DIR = "/dev/shm"


def _segment_path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ArenaError(f"shared-memory segment name {name!r} must be a non-empty file name without '/'")
    return os.path.join(SHM_DIR, name)


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, in bytes (what can be taken without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ArenaError("/proc/meminfo has no MemAvailable line")


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _check_room(name: str, capacity_bytes: int, tier: Tier) -> None:
    shm_free = shm_free_bytes()
    mem_free = mem_available_bytes()
    available = min(shm_free, mem_free)
    if capacity_bytes > available:
        raise CapacityError(
            f"{tier.label} tier needs {capacity_bytes} bytes of shared memory for segment {name!r}, "
            f"only {available} available ({SHM_DIR} free {shm_free}, MemAvailable {mem_free})"
        )


class SharedMemoryArena(MemoryArena):
    """Use `create` (daemon) or `attach` (client); the constructor takes an already-mapped segment."""

    def __init__(self, name: str, fd: int, capacity_bytes: int, tier: Tier, alignment: int,
                 owner: bool, populate: bool):
        self.name = name
        self.path = _segment_path(name)
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self.owner = owner
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, capacity_bytes, flags=flags,
                                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the segment alive; the fd is no longer needed
        self._bytes: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)

    @classmethod
    def create(cls, name: str, capacity_bytes: int, tier: Tier, alignment: int = 256,
               populate: bool = True) -> SharedMemoryArena:
        """Create the segment `name` of `capacity_bytes`. Raises CapacityError when /dev/shm or the
        machine's available memory is short, ArenaError when the segment already exists."""
        path = _segment_path(name)
        if capacity_bytes <= 0 or capacity_bytes % alignment:
            raise ArenaError(f"segment {name!r}: capacity {capacity_bytes} must be a positive multiple "
                             f"of the alignment {alignment}")
        _check_room(name, capacity_bytes, tier)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise ArenaError(f"shared-memory segment {path} already exists (another daemon, or one that "
                             f"did not shut down cleanly: remove the file if no daemon runs)") from None
        # Every failure from here on removes the segment, an interruption too (a stop signal during
        # start-up): a segment left behind holds its memory until someone deletes the file.
        try:
            os.ftruncate(fd, capacity_bytes)
            if populate:
                # fallocate takes the tmpfs pages now (ENOSPC here, not SIGBUS at a later write).
                os.posix_fallocate(fd, 0, capacity_bytes)
        except BaseException as e:
            os.close(fd)
            os.unlink(path)
            if not isinstance(e, OSError):
                raise
            raise CapacityError(f"{tier.label} tier could not take {capacity_bytes} bytes of shared memory "
                                f"for segment {name!r}: {e}") from e
        try:
            return cls(name, fd, capacity_bytes, tier, alignment, owner=True, populate=populate)
        except BaseException:
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, name: str, tier: Tier, alignment: int = 256) -> SharedMemoryArena:
        """Map an existing segment read-write (a client). Closing it never unlinks the segment."""
        path = _segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ArenaError(f"shared-memory segment {path} does not exist (is the daemon running?)") from None
        size = os.fstat(fd).st_size
        if size <= 0:
            os.close(fd)
            raise ArenaError(f"shared-memory segment {path} is empty")
        return cls(name, fd, size, tier, alignment, owner=False, populate=False)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self._slice(self._bytes, offset, nbytes, f"segment {self.name!r}")

    def describe(self) -> dict:
        return {**super().describe(), "kind": "shm", "name": self.name, "path": self.path}

    def close(self) -> None:
        if self._mm is None:
            return
        mm, self._mm, self._bytes = self._mm, None, None
        try:
            mm.close()
        except BufferError:
            # Views handed out are still alive: unmapping now would make them fault. The mapping is
            # released when the last view dies; the segment name goes away below all the same.
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
