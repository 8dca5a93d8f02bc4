"""The daemon's liveness object: a tiny file in /dev/shm, `dflash2-<pid>-alive`, that every daemon
(host-only or GPU, with or without a DRAM tier) holds a shared flock on for its whole life.

A client tests that lock, as `SharedMemoryArena.creator_gone` tests a segment's, to learn that its
daemon has ended: a GPU daemon with HBM alone has no segment, and its clients otherwise learned it
only when a restarted daemon answered `UnknownClient`, mapping the dead daemon's HBM (CUDA IPC) until
then, which a restart taking most of the GPU needs.

Invariants:
- The name starts with the daemon's segment prefix (assemble.instance_name, `dflash2-<pid>`), so the
  start-up removal of a killed predecessor's segments (`remove_stale_segments`, a pid-1 container's
  own prefix too) removes its liveness file with them; the daemon creates its own after that removal.
- Only a file nobody holds is removed (`remove_stale`); the daemon removes its own at clean shutdown,
  before it lets go of the endpoint lock (a next daemon then finds nothing to clean).
- A client opens only a name that `check_name` accepts (the daemon's reply names it): a plain file of
  that form in /dev/shm, never a link, a FIFO or another path.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import stat
import threading

from dflash2.arena.shm import ALIVE, SHM_DIR, _say_removed, _segment_path, foreign_segment, nobody_holds, remove_stale
from dflash2.errors import ArenaError, ProtocolError

SUFFIX = ALIVE
_NAME = re.compile(r"dflash2-[0-9]{1,10}" + re.escape(SUFFIX))


def dead_daemons() -> list[int]:
    """Pids of killed daemons whose shared memory is still in /dev/shm: their liveness object exists
    and no process holds it (it has its name only once locked: `DaemonLiveness.create`), and no
    process of that pid runs here, or the pid is this process's own (a pid-1 container's
    predecessor). The endpoint lock file names the
    last daemon of an endpoint, but a killed daemon's can be gone with its folder (systemd removes a
    service's RuntimeDirectory when it stops, a restart after a kill included), and its segments were
    then left for good (a review: the DRAM tier's 128 GiB, which the restart needed again)."""
    found = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not _NAME.fullmatch(name):
            continue
        pid = int(name[len("dflash2-"): -len(SUFFIX)])
        if pid != os.getpid() and _runs(pid):
            continue
        try:
            fd = os.open(_segment_path(name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            # Another user's file is no daemon of this user's (any local user may plant one in /dev/shm:
            # its "segments" could not be removed, and every start ended in a traceback, a review).
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and nobody_holds(fd):
                found.append(pid)
        finally:
            os.close(fd)
    return found


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's process)
    return True


def _holder(path: str) -> str:
    """Why a file at one of this daemon's liveness names cannot be taken, for its error."""
    whose = foreign_segment(path)
    if whose:
        return f"is {whose}, not this user's (uid {os.geteuid()}): remove it (as its owner or root) before starting"
    return "a running process holds it (another daemon with the same pid namespace and pid?)"


def liveness_name(instance: str) -> str:
    """The liveness object of the daemon whose segments are named `instance`-* (dflash2-<pid>)."""
    return f"{instance}{SUFFIX}"


def check_name(name) -> str | None:
    """`name` from an attach reply: None (a daemon that names none: an older one), or a liveness
    object's name. ProtocolError for anything else, before any file is opened."""
    if name is None:
        return None
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ProtocolError(f"attach: the daemon names {name!r} as its liveness object, not a name of the form "
                            f"dflash2-<pid>{SUFFIX}: refused (no file is opened for it)")
    return name


class DaemonLiveness:
    """Use `create` (the daemon: holds the lock) or `open` (a client: tests it with `gone`)."""

    def __init__(self, name: str, fd: int, owner: bool):
        self.name = name
        self.path = _segment_path(name)
        self.owner = owner
        self._fd = fd
        # gone() and close() run on a client's call thread and its heartbeat thread: a descriptor
        # closed by one must never be flock'ed by the other (its number may name another file by then).
        self._lock = threading.Lock()
        self.nonce: str | None = None  # (the daemon's) this start's id, written into the file

    @classmethod
    def create(cls, name: str) -> DaemonLiveness:
        """Create the file and hold a shared lock on it. A file of that name nobody holds (a killed
        daemon's of the same pid: a container's daemon is pid 1 every time) is replaced; ArenaError
        when a live process holds it."""
        path = _segment_path(name)
        # Locked before it has its name (made under a name of its own, then linked): a file of the
        # liveness object's name is always held while its daemon lives, so that another daemon's
        # start-up (`dead_daemons`), which cannot tell a daemon in another pid namespace from a dead
        # one by its pid, never takes it for a killed daemon's (between O_EXCL and flock, it did).
        new = f"{path}.new"
        try:
            try:
                fd = os.open(new, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:  # (a daemon of this pid killed at this very step: nobody holds it)
                if remove_stale(new) is None:
                    raise ArenaError(f"{new} exists and {_holder(new)}") from None
                fd = os.open(new, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise ArenaError(f"cannot create the daemon's liveness object {path}: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held until close: the daemon is alive
            # Its pid (for an operator looking at /dev/shm) and this start's random id, which attach
            # replies carry: a client checks that the memory it mapped is this daemon's (`matches`).
            nonce = secrets.token_hex(8)
            os.write(fd, f"{os.getpid()} {nonce}\n".encode())
            try:
                os.link(new, path)
            except FileExistsError:
                size = remove_stale(path)
                if size is None:
                    raise ArenaError(f"liveness object {path} exists and {_holder(path)}") from None
                _say_removed(name, size)
                os.link(new, path)
        except OSError as e:
            os.close(fd)
            os.unlink(new)
            raise ArenaError(f"cannot create the daemon's liveness object {path}: {e.strerror or e}") from e
        except BaseException:
            os.close(fd)
            os.unlink(new)
            raise
        os.unlink(new)
        made = cls(name, fd, owner=True)
        made.nonce = nonce
        return made

    @classmethod
    def open(cls, name: str) -> DaemonLiveness:
        """(A client) open the daemon's liveness object to test its lock. ArenaError when it cannot
        be opened or is not a plain file."""
        path = _segment_path(check_name(name))
        try:
            # O_NOFOLLOW: /dev/shm is writable by everyone, a link planted there is not followed;
            # O_NONBLOCK: a FIFO planted there does not hang the open (it is refused below).
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ArenaError(f"cannot open the daemon's liveness object {path}: {e.strerror or e}") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ArenaError(f"the daemon's liveness object {path} is not a plain file")
        return cls(name, fd, owner=False)

    def matches(self, nonce: str) -> bool:
        """(A client) whether the file carries `nonce`, the id the daemon's attach reply gave: a
        daemon of the same pid in another pid namespace (pid 1 of another container) has a file of
        the same name, and a client that saw that one's /dev/shm mapped its memory, reading and
        writing another daemon's blocks with no error (a review: over a tcp endpoint)."""
        with self._lock:
            try:
                words = os.pread(self._fd, 64, 0).split()
            except OSError:
                return False
        return len(words) >= 2 and words[1] == nonce.encode()

    def gone(self) -> bool:
        """(A client) whether the daemon has ended: nobody holds the lock any more. The test takes
        the lock and gives it back at once. False once closed."""
        with self._lock:
            if self.owner or self._fd < 0:
                return False
            return nobody_holds(self._fd)

    def close(self) -> None:
        """The daemon's: remove the file, then let go of the lock. A client's: close its descriptor."""
        with self._lock:
            if self._fd < 0:
                return
            if self.owner:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # A client's object collected without close() (a Client dropped without close or detach): its
        # descriptor goes with it (kept, one a dropped client for the process's life, a review). The
        # daemon's holds its lock, let go by close() alone.
        fd = getattr(self, "_fd", -1)
        if fd >= 0 and not self.owner:
            self._fd = -1
            os.close(fd)
