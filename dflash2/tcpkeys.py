"""Access control of a tcp endpoint: ZeroMQ CURVE keys in one file that the daemon makes.

An ipc endpoint is guarded by its socket's mode (owner only). A tcp port has no mode: any local user
(any host that reaches the node, for an address of every interface) could attach, commit blocks
under any key (wrong KV served as a hit to every engine) and take the daemon's descriptors. So a
tcp daemon speaks CURVE (encrypted, authenticated) and lets in only a client that proves it holds
the client key of its key file: whoever can read the file can attach, as whoever may open an ipc
socket can.

The file (`daemon.tcp_key_file`; default `tcp-PORT.key` in the node's runtime folder, beside the
endpoint's lock file) holds four Z85 keys, one `name = value` line each. The daemon makes it at its
first start, owner-only (mode 0600), and keeps it across restarts, so clients that read it once
keep working. A client that attaches maps the daemon's shared memory, which is owner-only too: so
serving processes run as the daemon's user; a group given read access to the file (chmod 0640,
chgrp, and a `daemon.tcp_key_file` that group's processes can reach) can ask `dflash2 status` and
`history`; the client library will not attach for it, but the daemon cannot tell its messages from a
serving process's (docs/known-gaps.md, "Whoever reads a tcp key file can attach").
Invariants, checked wherever the file is read: a regular file (a link is not followed), holding the
four keys and nothing else; the daemon also refuses one that other users may read (mode o+r), or
that it does not own.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from dflash2.errors import DFlash2Error

NAMES = ("server_public", "server_secret", "client_public", "client_secret")
Z85_KEY_CHARS = 40  # a 32-byte CURVE key in Z85
HEADER = ("# dflash2 tcp endpoint keys (ZeroMQ CURVE): whoever can read this file can attach to the daemon.\n"
          "# Made by dflash2d; kept across restarts. Do not edit.\n")


class KeyFileError(DFlash2Error):
    """A tcp endpoint's key file is missing, unreadable, malformed or open to other users."""


@dataclass(frozen=True)
class TcpKeys:
    """The four keys as Z85 bytes, as pyzmq's curve socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def fresh(cls) -> "TcpKeys":
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def text(self) -> str:
        return HEADER + "".join(f"{name} = {getattr(self, name).decode()}\n" for name in NAMES)


def parse(text: str, path: Path) -> TcpKeys:
    """The keys a file's text holds; KeyFileError naming the file and the line that is wrong."""
    found: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = (part.strip() for part in line.partition("="))
        if not sep or name not in NAMES:
            raise KeyFileError(f"{path} line {number}: expected one of {', '.join(NAMES)} = KEY, got {line[:60]!r}")
        if name in found:
            raise KeyFileError(f"{path} line {number}: {name} is given twice")
        if len(value) != Z85_KEY_CHARS or not value.isascii():
            raise KeyFileError(f"{path} line {number}: {name} must be a {Z85_KEY_CHARS}-character Z85 key")
        found[name] = value.encode()
    missing = [name for name in NAMES if name not in found]
    if missing:
        raise KeyFileError(f"{path} lacks {', '.join(missing)} (was it cut short? remove it and restart the "
                           "daemon to make a new one; clients then need the new file)")
    return TcpKeys(**found)


def _read(path: Path) -> tuple[str, os.stat_result]:
    """The file's text and status, opened without following a link (a link planted at a shared
    folder's path would hand clients someone else's keys)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:  # (O_NOFOLLOW on a symbolic link)
            raise KeyFileError(f"{path} is a symbolic link; the key file must be a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{path} is not a regular file")
        data = os.read(fd, 4096)  # (the file is a few hundred bytes)
    finally:
        os.close(fd)
    try:
        return data.decode("ascii"), st
    except UnicodeDecodeError:
        raise KeyFileError(f"{path} is not a dflash2 key file (not ASCII text)") from None


def load(path: Path) -> TcpKeys:
    """A client's read of the key file: KeyFileError says what is wrong and what to do."""
    try:
        text, _ = _read(path)
    except FileNotFoundError:
        raise KeyFileError(f"no key file at {path}: a tcp daemon makes it when it starts (is it running, with "
                           "this daemon.tcp_key_file?); a client must be able to read it to attach") from None
    except PermissionError:
        raise KeyFileError(f"cannot read the key file {path} (permission denied): only processes that can read "
                           "it may connect (serving processes run as the daemon's user, whose shared memory they "
                           "map)") from None
    except OSError as e:
        raise KeyFileError(f"cannot read the key file {path}: {e.strerror or e}") from None
    return parse(text, path)


def load_or_make(path: Path) -> tuple[TcpKeys, bool]:
    """The daemon's keys: those of the file at `path`, or fresh ones written there (owner-only) when
    there is none. Returns (keys, whether the file was made now). KeyFileError as `read_own`."""
    keys = read_own(path)
    return (keys, False) if keys is not None else (_make(path), True)


def read_own(path: Path) -> TcpKeys | None:
    """The keys of the daemon's file at `path`, None when there is none (start-up makes it; `--check`
    asks this too, so that a file start-up would refuse is refused by both, naming the key).
    KeyFileError when the file is not the daemon's own, other users may read it, or it is no key file."""
    try:
        text, st = _read(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise KeyFileError(f"cannot read the key file {path}: {e.strerror or e}") from None
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"the key file {path} belongs to uid {st.st_uid}, not to the daemon's user "
                           f"({os.geteuid()}): anyone who could write it could choose the keys; remove it")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise KeyFileError(f"the key file {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                           "whoever can read it can connect, so it may be readable by the owner and a group at "
                           f"most (chmod 0600 or 0640 {path})")
    return parse(text, path)


def _make(path: Path) -> TcpKeys:
    """Write fresh keys to a new file at `path` (mode 0600), never over another: a second daemon
    starting at the same moment keeps the first one's file (os.link refuses to replace)."""
    keys = TcpKeys.fresh()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, keys.text().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)
        except FileExistsError:
            return load_or_make(path)[0]  # another daemon made it first
    except OSError as e:
        raise KeyFileError(f"cannot make the key file {path}: {e.strerror or e}") from None
    finally:
        try:
            os.unlink(temporary)
        except OSError:
            pass
    return keys
