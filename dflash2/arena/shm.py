"""A memory arena in a named POSIX shared-memory segment (a file under /dev/shm).

The daemon `create`s the segment once at start-up and populates it, so the memory is really taken
then and not at the first block write; a client process `attach`es by name and gets the same bytes
(no copy, no unlink on close). It is the DRAM tier, and it stands in for HBM on a machine without a
GPU.

We do not use `multiprocessing.shared_memory`: its resource tracker unlinks segments that it thinks
are leaked, behind the daemon's back.

Invariant: only the creator unlinks the segment; views handed out stay valid until `close`. The
creator holds a shared flock on the segment while it lives: a segment nobody holds was left by a
daemon that was killed (SIGKILL, the OOM killer), and `remove_stale` may delete it to give its memory
back; a held one is never touched. A client tests the same lock (`creator_gone`) to learn that its
daemon died: its mapping then holds the dead daemon's memory, which a restarted daemon needs.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat

import numpy as np

from dflash2.arena.base import MemoryArena
from dflash2.errors import ArenaError, CapacityError
from dflash2.files import owner_text
from dflash2.tiers import Tier

SHM_DIR = "/dev/shm"

log = logging.getLogger("dflash2.arena.shm")


def _segment_path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ArenaError(f"shared-memory segment name {name!r} must be a non-empty file name without '/'")
    return os.path.join(SHM_DIR, name)


def remove_stale(path: str) -> int | None:
    """Delete the segment at `path` when no process holds it (its creator died without unlinking
    it). Returns the bytes given back (0 when it was already gone), or None when it is held (alive),
    or is not this user's (`foreign_segment` says whose): another user's file at a daemon's name,
    which any local user may plant in /dev/shm, was opened for writing, and the PermissionError
    ended every start of a daemon not run as root in a traceback (a review)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    except OSError:  # (another user's: EACCES; a link: ELOOP)
        return None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        size = os.fstat(fd).st_size
        os.unlink(path)
        return size
    finally:
        os.close(fd)


def foreign_segment(path: str) -> str | None:
    """Whose the file at `path` is, when it is not a segment this user may take (another user's, or
    a link), for the error that names it; None when it is this user's (or gone)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    return None if st.st_uid == os.geteuid() else f"a file of {owner_text(st)}"


def nobody_holds(fd: int) -> bool:
    """Whether no process holds a flock on the file open at `fd` (the test takes the lock and gives
    it back at once): a daemon holds one on each of its segments, and on its liveness object, while
    it lives."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


# How a daemon's liveness object's name ends (liveness.py; named here, which that module imports).
ALIVE = "-alive"


def remove_stale_segments(prefix: str, say: bool = True) -> list[tuple[str, int]]:
    """Remove every segment whose name starts with `prefix` that no process holds (the segments of a
    daemon that was killed); (name, bytes) of each one removed, each also logged (`say`)."""
    removed, kept = [], False
    # Invariant: a killed daemon's liveness object goes last, and only once every other segment of
    # its prefix has: it is how a later start finds what the daemon left (liveness.dead_daemons). It
    # went first (names in order): a start stopped part way, or killed, left the rest for good (a
    # review).
    names = sorted((n for n in os.listdir(SHM_DIR) if n.startswith(prefix)), key=lambda n: (n.endswith(ALIVE), n))
    for name in names:
        if name.endswith(ALIVE) and kept:
            continue
        size = remove_stale(os.path.join(SHM_DIR, name))
        if size is None:
            kept = True
            continue
        if say:
            _say_removed(name, size)
        removed.append((name, size))
    return removed


def _say_removed(name: str, size: int) -> None:
    log.warning("removed shared-memory segment %s (%d bytes): no process held it, it was left by a daemon "
                "that was killed (its memory comes back once its clients, which learn it at their next "
                "heartbeat, no longer map it)", name, size)


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, in bytes (what can be taken without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ArenaError("/proc/meminfo has no MemAvailable line")


def address_space() -> tuple[int, int] | None:
    """(limit, in use) of this process's address space in bytes, where a limit is set (RLIMIT_AS:
    `ulimit -v`, systemd's LimitAS=, a batch scheduler's vmem limit); None where there is none. A
    mapping past it fails with ENOMEM, whatever memory is free."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    except OSError:
        used = 0
    return soft, used


def thread_stack_bytes() -> int:
    """The address space a thread's stack takes: RLIMIT_STACK's soft limit, which glibc gives each new
    thread (2 MiB where it is unlimited: measured, a review)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return 2 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def fsize_limit() -> int | None:
    """This process's file size limit in bytes (RLIMIT_FSIZE's soft limit: `ulimit -f`, systemd's
    LimitFSIZE=), None where there is none: no shared-memory segment or NVMe file may be larger."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


# glibc's mallopt parameter for the most arenas malloc keeps (malloc.h's M_ARENA_MAX)
M_ARENA_MAX = -8


def cap_malloc_arenas() -> str | None:
    """Under an address-space limit, malloc's arenas capped at one: glibc gives each thread that
    allocates one of its own (up to 8 a core), each reserving 64 MiB of address space (a serving
    daemon's threads took 256 MiB that way, and a later thread could not start: a review). What was
    done, for the log; None where no limit is set (nothing changed)."""
    if address_space() is None:
        return None
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return ("the address space is limited (RLIMIT_AS), and malloc has no mallopt (not glibc's): its "
                "per-thread arenas are not capped, and may take what --check counted for the tiers")
    if mallopt(M_ARENA_MAX, 1) != 1:
        return "the address space is limited (RLIMIT_AS), and glibc refused to cap malloc's per-thread arenas"
    return ("the address space is limited (RLIMIT_AS): malloc's per-thread arenas capped at one (each "
            "reserves 64 MiB of it)")


def address_space_note() -> str:
    """What the address-space limit is, for an ENOMEM: the tiers' mapping failed with memory free."""
    limits = address_space()
    if limits is None:
        return ""
    soft, used = limits
    return (f" (the daemon's address space is limited to {soft} bytes, {used} in use: RLIMIT_AS, set by "
            "`ulimit -v`, systemd's LimitAS= or a batch scheduler's memory limit; raise it, or lower the tiers' "
            "memory.*_capacity_mb)")


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
    if (limit := fsize_limit()) is not None and limit < capacity_bytes:
        # (a segment is a file in /dev/shm: its ftruncate failed, "[Errno 27] File too large", naming
        # no limit, and --check said the tiers fit, a review)
        raise CapacityError(f"{tier.label} tier needs a shared-memory segment of {capacity_bytes} bytes ({name!r}, a "
                            f"file in {SHM_DIR}), but this process may not write past byte {limit} of a file (its "
                            f"file size limit, RLIMIT_FSIZE: ulimit -f, systemd's LimitFSIZE): raise the limit or "
                            f"lower the tier's capacity")


class SharedMemoryArena(MemoryArena):
    """Use `create` (daemon) or `attach` (client); the constructor takes an already-mapped segment."""

    def __init__(self, name: str, fd: int, capacity_bytes: int, tier: Tier, alignment: int,
                 owner: bool, populate: bool, hold_fd: int = -1):
        self.name = name
        self.path = _segment_path(name)
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self.owner = owner
        # The creator's flock on the segment; a client's descriptor of it, to test that flock (see
        # the module docstring)
        self._hold_fd = hold_fd
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
            # A killed daemon's segment under the same name (a container's daemon is pid 1 every
            # time) is given back and the name reused; one that a live process holds is an error.
            size = remove_stale(path)
            if size is None and (whose := foreign_segment(path)):
                raise ArenaError(f"shared-memory segment {path} already exists, {whose}, not this user's (uid "
                                 f"{os.geteuid()}): it is not a segment of this user's daemons; remove it (as its "
                                 "owner or root) before starting") from None
            if size is None:
                raise ArenaError(f"shared-memory segment {path} already exists and a running process holds "
                                 f"it (another daemon with the same segment names?)") from None
            _say_removed(name, size)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        # Every failure from here on removes the segment, an interruption too (a stop signal during
        # start-up): a segment left behind holds its memory until someone deletes the file.
        hold = -1
        try:
            hold = os.open(path, os.O_RDONLY)
            fcntl.flock(hold, fcntl.LOCK_SH)  # held for the segment's life: it is alive
            os.ftruncate(fd, capacity_bytes)
            if populate:
                # fallocate takes the tmpfs pages now (ENOSPC here, not SIGBUS at a later write).
                os.posix_fallocate(fd, 0, capacity_bytes)
        except BaseException as e:
            os.close(fd)
            if hold >= 0:
                os.close(hold)
            os.unlink(path)
            if not isinstance(e, OSError):
                raise
            raise CapacityError(f"{tier.label} tier could not take {capacity_bytes} bytes of shared memory "
                                f"for segment {name!r}: {e}") from e
        try:
            return cls(name, fd, capacity_bytes, tier, alignment, owner=True, populate=populate, hold_fd=hold)
        except BaseException as e:
            os.unlink(path)
            os.close(hold)
            if not isinstance(e, OSError):
                raise
            # mmap refuses the mapping (ENOMEM: an address-space limit such as ulimit -v, which
            # batch schedulers set): a start-up failure that names the tier, not a traceback.
            note = address_space_note() if e.errno == errno.ENOMEM else ""
            raise CapacityError(f"{tier.label} tier could not map {capacity_bytes} bytes of shared memory "
                                f"for segment {name!r}: {e}{note}") from e

    @classmethod
    def attach(cls, name: str, tier: Tier, alignment: int = 256) -> SharedMemoryArena:
        """Map an existing segment read-write (a client). Closing it never unlinks the segment."""
        path = _segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # (a link planted in /dev/shm is not followed)
        except FileNotFoundError:
            raise ArenaError(f"shared-memory segment {path} does not exist (is the daemon running?)") from None
        except OSError as e:  # permissions (another user's daemon), too many open files, a link
            raise ArenaError(f"shared-memory segment {path} cannot be opened: {e}") from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            # Not this user's daemon's: a client writes its requests' KV cache into it (a review: a
            # daemon another user ran where this user's default socket lies got it).
            os.close(fd)
            raise ArenaError(f"shared-memory segment {path} belongs to {owner_text(st)}, not to this process's "
                             f"user (uid {os.geteuid()}): clients attach only to a daemon of their own user")
        size = st.st_size
        if size <= 0:
            os.close(fd)
            raise ArenaError(f"shared-memory segment {path} is empty")
        try:
            return cls(name, fd, size, tier, alignment, owner=False, populate=False, hold_fd=os.dup(fd))
        except OSError as e:
            # mmap refuses the mapping (an address-space limit such as ulimit -v): the client's
            # caller (an engine integration) gets a dflash2 error it falls back on, not a raw OSError.
            raise ArenaError(f"{tier.label} tier: shared-memory segment {path} ({size} bytes) cannot be "
                             f"mapped in this process: {e}") from e

    def creator_gone(self) -> bool:
        """(A client's mapping) whether the process that created the segment, its daemon, has ended:
        nobody holds its flock any more. The test takes the lock and gives it back at once."""
        if self.owner or self._hold_fd < 0:
            return False
        return nobody_holds(self._hold_fd)

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
        if self._hold_fd >= 0:
            os.close(self._hold_fd)
            self._hold_fd = -1

    def __del__(self) -> None:
        # A client's arena collected without close() (a Client dropped without close or detach, or a
        # mapping that failed in the constructor): its descriptor goes with it. Kept, each held the
        # segment for the process's life, and its memory once the daemon had unlinked it (a review: 20
        # dropped clients, 60 descriptors and the stopped daemon's 80 MB of /dev/shm). The mapping goes
        # with its last view (mmap's own). The daemon's, the creator's lock, is closed by close() alone.
        fd = getattr(self, "_hold_fd", -1)
        if fd >= 0 and not self.owner:
            self._hold_fd = -1
            os.close(fd)
