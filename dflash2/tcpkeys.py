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
serving processes run as the daemon's user.

Beside it the daemon makes a monitoring key file (`monitor_path`: the key file's name with
`.monitor` after it), owner-only too, holding the server's public key, a second client key pair and
the port of each daemon's monitoring socket by its request port (`record_port`, at each start). A
client holding only that one connects there, and is answered `ping`, `stats`, `history` and
`check`, and nothing else, within a share of the daemon's loop (daemon/keygate.py); so a monitoring
group is given that file (chgrp GROUP, chmod 0640), never the key file itself, whose readers can
attach, take HBM and publish blocks under any prompt's keys. A client reads the key file when it
can, else the monitoring one (said in its log). When the key file is made again (removed, to change
the keys), the monitoring file is made again too, its mode and group kept.
Invariants, checked wherever a file is read: a regular file (a link is not followed), holding its
keys and nothing else; the daemon also refuses one that other users may read (mode o+r) or its
group write, or that it does not own, and warns of a key file its group may read.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dflash2.errors import DFlash2Error
from dflash2.files import make_private_folders, pids_text, port_listeners

log = logging.getLogger("dflash2.tcpkeys")

NAMES = ("server_public", "server_secret", "client_public", "client_secret")
MONITOR_NAMES = ("server_public", "client_public", "client_secret")  # (a monitoring key file's)
Z85_KEY_CHARS = 40  # a 32-byte CURVE key in Z85
# The most a key or monitoring file may hold (read whole: 4 KiB cut a monitoring file of 64 nodes'
# lines, and the next edit wrote the cut file back, a review).
MAX_FILE_BYTES = 1 << 20
HEADER = ("# dflash2 tcp endpoint keys (ZeroMQ CURVE): whoever can read this file can attach to the daemon.\n"
          "# Made by dflash2d; kept across restarts. Do not edit. Monitoring users get the .monitor file.\n")
MONITOR_HEADER = ("# dflash2 tcp endpoint monitoring key (ZeroMQ CURVE): whoever can read this file can ask the daemon's\n"
                  "# status, history and invariant check, and nothing else. Made by dflash2d. Do not edit. To give it\n"
                  "# to a group: chgrp GROUP FILE; chmod 0640 FILE (mode and group are kept when it is made again).\n"
                  "# To revoke its readers: remove it and restart every daemon that shares the key file.\n")


class KeyFileError(DFlash2Error):
    """A tcp endpoint's key file is missing, unreadable, malformed or open to other users."""


@dataclass(frozen=True)
class TcpKeys:
    """The four keys as Z85 bytes, as pyzmq's curve socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    read_only = False  # (a client holding these may attach)

    @classmethod
    def fresh(cls) -> "TcpKeys":
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def text(self) -> str:
        return HEADER + "".join(f"{name} = {getattr(self, name).decode()}\n" for name in NAMES)


@dataclass(frozen=True)
class MonitorKeys:
    """A monitoring key file's keys: the server's public key and the monitoring client's pair."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    # The port of each daemon's monitoring socket (on its endpoint's host) by its node (`node_id`) and
    # request port, which it writes here at each start and removes at a clean stop
    # (`port.NODE.REQUEST = MONITORING` lines): daemons of one node, and of several nodes (a key file
    # on a shared folder), may share a key file.
    ports: dict[tuple[str, int], int] = field(default_factory=dict, compare=False)
    path: Path | None = field(default=None, compare=False)  # the file they were read from (a client's)
    read_only = True  # (the daemon answers a client holding these ping, stats, history and check only)

    @classmethod
    def fresh(cls, server_public: bytes) -> "MonitorKeys":
        import zmq

        return cls(server_public, *zmq.curve_keypair())

    def text(self) -> str:
        return (MONITOR_HEADER + "".join(f"{name} = {getattr(self, name).decode()}\n" for name in MONITOR_NAMES)
                + "".join(f"port.{node}.{request} = {port}\n" for (node, request), port in sorted(self.ports.items())))


@dataclass(frozen=True)
class DaemonKeys:
    """What the daemon's gate needs: its key file's keys and the monitoring file's."""

    keys: TcpKeys
    monitor: MonitorKeys

    @property
    def monitor_public(self) -> bytes:
        return self.monitor.client_public


def monitor_path(path: Path) -> Path:
    """The monitoring key file beside the key file at `path`."""
    return path.with_name(path.name + ".monitor")


def parse(text: str, path: Path, names: tuple[str, ...] = NAMES):
    """The keys a file's text holds (a key file's, or with MONITOR_NAMES a monitoring file's);
    KeyFileError naming the file and the line that is wrong."""
    found: dict[str, bytes] = {}
    ports: dict[int, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = (part.strip() for part in line.partition("="))
        if names != NAMES and sep and name.startswith("port."):  # (a monitoring file's: port.NODE.REQUEST = PORT)
            node, _, request = name[len("port."):].rpartition(".")
            if not (_NODE.fullmatch(node) and _port_number(request) and _port_number(value)):
                raise KeyFileError(f"{path} line {number}: expected port.NODE.REQUEST_PORT = MONITORING_PORT (a node id "
                                   f"of letters, digits and dashes, two port numbers 1-65535), got {line[:80]!r}")
            if (node, int(request)) in ports:
                raise KeyFileError(f"{path} line {number}: {name} is given twice")
            ports[node, int(request)] = int(value)
            continue
        if not sep or name not in names:
            raise KeyFileError(f"{path} line {number}: expected one of {', '.join(names)} = KEY, got {line[:60]!r}")
        if name in found:
            raise KeyFileError(f"{path} line {number}: {name} is given twice")
        if len(value) != Z85_KEY_CHARS or not value.isascii():
            raise KeyFileError(f"{path} line {number}: {name} must be a {Z85_KEY_CHARS}-character Z85 key")
        found[name] = value.encode()
    missing = [name for name in names if name not in found]
    if missing:
        raise KeyFileError(f"{path} lacks {', '.join(missing)} (was it cut short? remove it and restart the "
                           "daemon to make a new one; clients then need the new file)")
    return TcpKeys(**found) if names == NAMES else MonitorKeys(**found, ports=ports)


_NODE = re.compile(r"[A-Za-z0-9-]{1,64}")


def node_id() -> str:
    """This node, as the monitoring file's lines name it: the kernel's boot id, which every container
    on the node shares (a pod's hostname is its own), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        if _NODE.fullmatch(boot):
            return boot
    except OSError:
        pass
    name = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]
    return name or "node"


def _port_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and text[0] != "0" and 1 <= int(text) <= 65535


def _read(path: Path, what: str) -> tuple[str, os.stat_result]:
    """The file's text and status, opened without following a link (a link planted at a shared
    folder's path would hand clients someone else's keys)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:  # (O_NOFOLLOW on a symbolic link)
            raise KeyFileError(f"{path} is a symbolic link; the {what} must be a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{path} is not a regular file")
        data = b""
        while len(data) <= MAX_FILE_BYTES and (chunk := os.read(fd, 65536)):
            data += chunk
        if len(data) > MAX_FILE_BYTES:  # (a monitoring file holds a line per daemon sharing it: far less)
            raise KeyFileError(f"{path} holds more than {MAX_FILE_BYTES} bytes: not a dflash2 {what}")
    finally:
        os.close(fd)
    try:
        return data.decode("ascii"), st
    except UnicodeDecodeError:
        raise KeyFileError(f"{path} is not a dflash2 key file (not ASCII text)") from None


def load(path: Path) -> TcpKeys | MonitorKeys:
    """A client's keys: the key file's at `path`, else (when this process may not read it) those of
    the monitoring file beside it, said in the log; a monitoring file's when `path` names one.
    KeyFileError says what is wrong and what to do."""
    if path.name.endswith(".monitor"):
        return dataclasses.replace(parse(_client_read(path, "monitoring key file"), path, MONITOR_NAMES), path=path)
    try:
        return parse(_client_read(path, "key file"), path)
    except _Unreadable as e:
        monitor = monitor_path(path)
        try:
            keys = dataclasses.replace(parse(_client_read(monitor, "monitoring key file"), monitor, MONITOR_NAMES),
                                       path=monitor)
        except KeyFileError as why:
            raise KeyFileError(f"{e} (nor its monitoring key file: {why})") from None
    log.info("cannot read the key file %s; read the monitoring key file %s instead: the daemon answers this "
             "process's ping, stats, history and check only", path, monitor)
    return keys


class _Unreadable(KeyFileError):
    """A client may not read a key file (permission denied): the monitoring file may do."""


def _client_read(path: Path, what: str) -> str:
    try:
        return _read(path, what)[0]
    except FileNotFoundError:
        raise KeyFileError(f"no {what} at {path}: a tcp daemon makes it when it starts (is it running, with "
                           "this daemon.tcp_key_file?); a client must be able to read it to connect") from None
    except PermissionError:
        raise _Unreadable(f"cannot read the {what} {path} (permission denied): only processes that can read "
                          "it may connect (serving processes run as the daemon's user, whose shared memory they "
                          "map; monitoring users read the monitoring key file beside it)") from None
    except OSError as e:
        raise KeyFileError(f"cannot read the {what} {path}: {e.strerror or e}") from None


def load_or_make(path: Path) -> tuple[DaemonKeys, bool]:
    """The daemon's keys: those of the file at `path`, or fresh ones written there (owner-only) when
    there is none; and the monitoring file's beside it, made (owner-only) when there is none, or again
    when it holds another server key (the key file was made again), its mode and group kept.
    Returns (keys, whether the key file was made now). KeyFileError as `read_own`."""
    keys = read_own(path)
    made = keys is None
    if made:
        keys = _make(path)
    return DaemonKeys(keys, _own_monitor(path, keys)), made


def record_port(path: Path, keys: DaemonKeys, request_port: int, port: int) -> None:
    """Write the port of this daemon's monitoring socket, by this node and its request port, into the
    monitoring key file beside the key file at `path` (its mode and group kept, other daemons' lines
    too: they may share the key file), where its readers find it. KeyFileError as `read_own`, or
    when the file no longer holds the keys the daemon took at its start."""
    mine = (node_id(), request_port)

    def edit(ports: dict) -> None:
        earlier = ports.get(mine)
        if earlier is not None and earlier != port and (pids := port_listeners(earlier)):
            # Another live daemon's line: one on this node and request port at another address,
            # sharing the key file (the default one is named by the port alone). Its monitoring users
            # are sent to this daemon's port from now on (a review): said, with who listens there.
            log.warning("the monitoring file %s named port %d for request port %d on this node, where%s listens: "
                        "another dflash2d on this port number at another address, sharing the key file? Its "
                        "monitoring users now reach this daemon's port; give the two daemons other ports or "
                        "daemon.tcp_key_file of their own", monitor_path(path), earlier, request_port, pids_text(pids))
        ports[mine] = port

    _edit_ports(path, keys, edit)


def forget_port(path: Path, keys: DaemonKeys, request_port: int, port: int) -> None:
    """At a clean stop: remove this daemon's line from the monitoring key file, if it is still its
    own (a stale line sent monitoring clients to a port another daemon got later, a review). A file
    removed meanwhile (its readers revoked) or made again holds no line of this daemon's: said."""
    mine = (node_id(), request_port)
    try:
        _edit_ports(path, keys, lambda ports: ports.pop(mine) if ports.get(mine) == port else None)
    except KeyFileError as e:
        log.info("the monitoring port's line is not removed: %s", e)


def _edit_ports(path: Path, keys: DaemonKeys, edit) -> None:
    """Apply `edit` to the monitoring file's ports, under a lock on the key file (two daemons that
    share it, starting at once, keep both their lines); rewrite the file when they changed."""
    monitor = monitor_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise KeyFileError(f"cannot open the key file {path}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # (ENOLCK: NFS without a lock manager; EOPNOTSUPP: some FUSE file systems)
            log.warning("cannot lock the key file %s (%s): the monitoring file's lines are written without the "
                        "lock (two daemons sharing it that start at once might lose one's line)", path, e.strerror or e)
        found = _own(monitor, MONITOR_NAMES)
        if found is None or found[0] != keys.monitor:
            raise KeyFileError(f"the monitoring key file {monitor} {'is gone' if found is None else 'holds other keys'} "
                               "since the daemon read it at its start")
        ports = dict(found[0].ports)
        edit(ports)
        if ports != found[0].ports:
            _write(monitor, dataclasses.replace(keys.monitor, ports=ports).text(), replace=found[1])
    finally:
        os.close(fd)


def read_own(path: Path, names: tuple[str, ...] = NAMES):
    """The keys of the daemon's file at `path` (with MONITOR_NAMES, a monitoring key file), None when
    there is none (start-up makes it; `--check` asks this too, so that a file start-up would refuse is
    refused by both, naming the key). KeyFileError when the file is not the daemon's own, other users
    may read it or its group write it, or it holds no such keys."""
    if names == NAMES and path.name.endswith(".monitor"):
        raise KeyFileError(f"{path}: a name ending in .monitor is read by clients as a monitoring key file, so "
                           "none could attach; give the key file another name (its monitoring file is its name "
                           "with .monitor after it)")
    found = _own(path, names)
    return None if found is None else found[0]


def _own(path: Path, names: tuple[str, ...]):
    """(keys, the file's status) as `read_own`."""
    what = "key file" if names == NAMES else "monitoring key file"
    try:
        text, st = _read(path, what)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise KeyFileError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"the {what} {path} belongs to uid {st.st_uid}, not to the daemon's user "
                           f"({os.geteuid()}): anyone who could write it could choose the keys; remove it")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise KeyFileError(f"the {what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                           "whoever can read it can connect, so it may be readable by the owner and a group at "
                           f"most (chmod 0600 or 0640 {path})")
    return parse(text, path, names), st


def group_warning(path: Path) -> str | None:
    """What to say of a key file its group may read (that group's processes can attach: a monitoring
    group needs the monitoring file only); None for one that is owner-only or not there."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not st.st_mode & stat.S_IRGRP:
        return None
    return (f"daemon.tcp_key_file: {path} is readable by its group (gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o}): "
            "that group's processes can attach, take HBM and publish blocks under any prompt's keys; monitoring "
            f"users need only {monitor_path(path)} (chmod 0600 {path}; chgrp GROUP and chmod 0640 the monitoring file)")


def _own_monitor(path: Path, keys: TcpKeys) -> MonitorKeys:
    """The monitoring key file's keys for the daemon whose key file is at `path` (made as `load_or_make` says)."""
    monitor = monitor_path(path)
    found = _own(monitor, MONITOR_NAMES)
    if found is not None and found[0].server_public == keys.server_public \
            and found[0].client_public != keys.client_public:
        return found[0]
    fresh = MonitorKeys.fresh(keys.server_public)
    if found is None:
        if _write(monitor, fresh.text(), replace=None):
            log.info("made the monitoring key file %s (mode 0600): its readers may ask status, history and check, "
                     "nothing else; give it to a monitoring group (chgrp GROUP; chmod 0640), never %s", monitor, path)
            return fresh
        return _own_monitor(path, keys)  # (made meanwhile: read as any other)
    _write(monitor, fresh.text(), replace=found[1])
    why = ("another server key than %s (that file was made again)" if found[0].server_public != keys.server_public
           else "the client key of %s, whose holders may attach")
    log.warning("made the monitoring key file %s again: it held " + why + "; its mode (%o) and group kept (above if not); "
                "its readers need the new file", monitor, path, stat.S_IMODE(found[1].st_mode))
    return fresh


def _make(path: Path) -> TcpKeys:
    """Fresh keys in a new file at `path` (mode 0600), never over another: a second daemon starting
    at the same moment keeps the first one's file (os.link refuses to replace)."""
    keys = TcpKeys.fresh()
    if _write(path, keys.text(), replace=None):
        return keys
    found = read_own(path)  # another daemon made it first
    return found if found is not None else _make(path)


def _write(path: Path, text: str, replace: os.stat_result | None) -> bool:
    """Write `text` to a file at `path` through a temporary file. With `replace` None: a new file
    (mode 0600), never over another: False when one is there already (left as it is), else True.
    Else over the file whose status `replace` is, keeping its mode and group (renamed over it: a
    reader sees the old file or the new one whole); where the daemon's user may not give the new file
    that group (not in it: the deploy units' own user), the file is written in place instead (blank
    lines pad a shorter text, which `parse` skips: never cut), as a rename lost the group at every
    start and stop (a review); and where it cannot be, the rename goes ahead, said."""
    what = "key file" if path.suffix != ".monitor" else "monitoring key file"
    temporary = None
    try:
        make_private_folders(path.parent)
        # A name of its own (one named by the pid alone, left by a daemon killed meanwhile, was the
        # next start's in a container, where the daemon is always pid 1: every start failed).
        while temporary is None:
            name = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            temporary = name
        try:
            os.write(fd, text.encode())
            group_lost = False
            if replace is not None:
                if replace.st_gid != os.fstat(fd).st_gid:
                    try:
                        os.fchown(fd, -1, replace.st_gid)
                    except PermissionError:
                        group_lost = True
                os.fchmod(fd, stat.S_IMODE(replace.st_mode))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace is not None:
            if group_lost and _write_in_place(path, text, replace):
                return True
            os.replace(temporary, path)
            if group_lost:
                log.warning("%s was written anew and lost its group (gid %d): the daemon's user may not give a file "
                            "that group, nor write this one in place; chgrp it again, or add the daemon's user to "
                            "that group", path, replace.st_gid)
            return True
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
    except OSError as e:
        raise KeyFileError(f"cannot make the {what} {path}: {e.strerror or e}") from None
    finally:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass
    return True


def _write_in_place(path: Path, text: str, replace: os.stat_result) -> bool:
    """Write `text` over the file at `path` (the one `replace` describes), padded with blank lines to
    its length, never cut short: a reader sees whole lines of the old or the new text and blank ones.
    False when it cannot be (not writable, replaced meanwhile)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (replace.st_dev, replace.st_ino) or not stat.S_ISREG(st.st_mode):
            return False
        data = text.encode()
        data += b"\n" * max(0, st.st_size - len(data))
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


