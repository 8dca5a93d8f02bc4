"""Whether a path still names a file held open: the check of the lock-file protocol (open by path,
lock, then see that the path was not removed or replaced meanwhile), which the endpoint's lock file
(daemon/endpoint.py) and the NVMe cache files (arena/nvmefiles.py) both need; how a file of
another user is named in errors (its owner and mode), and the processes that hold a lock on a file
(`holders_text`: "in use by another process" named none); folders made owner-only, every one made
(`make_private_folders`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from dflash2.protocol import printable


def same_file(fd: int, path: str | os.PathLike, follow: bool = True) -> bool:
    """Whether `path` (where it leads, for a link; the link itself with `follow` False) names the file
    open at `fd` now."""
    try:
        at = os.stat(path, follow_symlinks=follow)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (mine.st_dev, mine.st_ino)


def user_name(uid: int) -> str:
    """` (NAME)` of a uid the passwd database knows, else ""."""
    import pwd

    try:
        return f" ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""


def owner_text(st: os.stat_result) -> str:
    """`uid N (NAME), mode 644`: whose a file is, for an error that refuses another user's file."""
    return f"uid {st.st_uid}{user_name(st.st_uid)}, mode {st.st_mode & 0o7777:o}"


def lock_holders(fd: int) -> list[int]:
    """The pids that /proc/locks says hold a lock on the file open at `fd` (none where it cannot be
    read, or where the file's device is numbered otherwise there, as on overlayfs; a holder of
    another pid namespace is shown by its pid in this one, if it has one)."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        if "->" in fields:  # (a lock waited for, listed under its holder's)
            continue
        if len(fields) >= 6 and fields[5] == where and fields[4].isdigit() and int(fields[4]) > 0:
            pids.append(int(fields[4]))
    return sorted(set(pids))


def holders_text(fd: int) -> str:
    """` (pid N: COMMAND LINE)` for each process holding a lock on the file open at `fd`, or ""."""
    return pids_text(lock_holders(fd))


def port_listeners(port: int) -> list[int]:
    """The pids of the processes this one can see that listen on TCP `port` (/proc/net/tcp and tcp6,
    then their descriptors: another user's are unreadable but to root); [] where /proc says nothing."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    if inodes:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                    pids.add(int(pid))
            except OSError:  # (gone meanwhile, or another user's)
                continue
    return sorted(pids)


def pids_text(pids: list[int]) -> str:
    """` (pid N: COMMAND LINE; ...)` for processes by pid, or ""."""
    named = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = ""
        # Escaped before the cut, which so bounds what is printed of it.
        command = printable(command)
        named.append(f"pid {pid}" + (f": {command[:120]}" if command else ""))
    return f" ({'; '.join(named)})" if named else ""


def make_private_folders(folder: str | os.PathLike) -> bool:
    """Make `folder` and each missing folder above it owner-only (0700 whatever the umask), as the
    XDG spec asks of the folders it names; folders already there keep their modes. mkdir's
    `parents=True` made those above the last with the umask's mode, 0777 under umask 000, where any
    user could rename the daemon's own folder away and put one of theirs in its place (a review).
    Whether `folder` itself was made; NotADirectoryError when something else is at its path."""
    # Walked as written, as os.makedirs does (`a/link/../b` is b beside the link's target, where
    # abspath's `a/b` made a stray folder, a review): a part that is `..` or `.` exists when its
    # folder does.
    missing, path = [], os.fspath(folder)
    while path and not os.path.exists(path) and not os.path.islink(path):
        missing.append(path)
        head = os.path.dirname(path.rstrip(os.sep)) if path.rstrip(os.sep) else path
        if head == path:
            break
        path = head
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # (made meanwhile, by another start: as one that was there)
            continue
        os.chmod(path, 0o700)  # (mkdir's mode is cut by the umask)
    if not os.path.isdir(folder):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", os.fspath(folder))
    return bool(missing) and missing[0] == os.fspath(folder)


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def read_only(folder: Path) -> bool:
    """Whether `folder` lies on a filesystem mounted read-only (False where it cannot be asked: the
    caller's access check then speaks)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
