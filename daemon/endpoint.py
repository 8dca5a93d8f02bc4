"""The daemon's control endpoint: an owner-only ipc:// socket by default, one daemon per endpoint.

A lock file beside the socket (flock) proves which daemon owns an endpoint: a second daemon on the
same endpoint refuses to start with a message naming the first one's pid; a socket file left by a
daemon that died is replaced. tcp:// endpoints are bound as configured (loopback unless the config
names another address); their lock file lives in the node's runtime folder (not the state folder,
which several nodes may share), and the port is tried before the daemon takes its tiers
(`probe_port`): a port another program holds, or a daemon on another spelling of its address, was
found only once every tier had been taken (minutes for a large DRAM tier, on a live node's memory),
and a start short of memory blamed the memory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from dflash2.errors import DFlash2Error
from dflash2.files import make_private_folders, pids_text, port_listeners, same_file


PROBE_TRIES = 5  # tries at the lock, 10 ms apart (`_take`)


def _take(fd: int) -> None:
    """The endpoint's lock file locked, or BlockingIOError while another holds it. Tried PROBE_TRIES
    times: a client asking whether a daemon holds it (client/endpoint_check.py) holds a shared lock
    for microseconds, which must not fail this start as "another dflash2d is serving"."""
    for _ in range(PROBE_TRIES - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.01)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class EndpointBusy(DFlash2Error):
    """Another daemon serves this endpoint."""


class EndpointLock:
    def __init__(self, endpoint: str, lock_dir: Path):
        """`lock_dir`: where a tcp endpoint's lock file lives (an ipc socket's is beside it)."""
        self.endpoint = endpoint
        if endpoint.startswith("ipc://"):
            self.socket_path: Path | None = Path(endpoint[len("ipc://"):])
            self.lock_path = self.socket_path.with_name(self.socket_path.name + ".lock")
        else:
            self.socket_path = None
            safe = endpoint.replace("://", "_").replace(":", "_").replace("/", "_").replace("*", "any")
            self.lock_path = lock_dir / f"{safe}.lock"
        self._fd = -1
        # pid of the daemon that held this endpoint before and did not shut down cleanly (a clean
        # shutdown removes the lock file): its shared-memory segments may be left behind.
        self.previous_pid: int | None = None
        self.replaced_socket = False  # a socket file that such a daemon left was replaced

    def acquire(self) -> None:
        folder = self.lock_path.parent
        # A runtime folder of our own making is owner-only, and so is each folder made above it. A
        # folder that was there before keeps its mode: it may be /run or a home folder that others
        # need; the socket itself is made owner-only after bind (secure_socket).
        make_private_folders(folder)
        while True:
            # O_NOFOLLOW: a link planted at the lock's path (a shared folder) is not followed and truncated.
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                _take(fd)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise EndpointBusy(f"another dflash2d (pid {holder}) is serving {self.endpoint}; "
                                   "stop it first or configure another daemon.endpoint") from None
            if same_file(fd, self.lock_path):
                break
            # The daemon before us removed this file (it stopped) between our open and our lock: a
            # lock on it proves nothing, since the next daemon would make a new file. Lock the one at
            # the path now.
            os.close(fd)
        previous = os.read(fd, 32).decode(errors="replace").strip()
        if previous.isdigit():
            # Our own pid too: a container's daemon is pid 1 every time. Its segments, named by that
            # pid, are a killed predecessor's all the same (this daemon has taken none yet), and
            # those of a tier the config no longer has would otherwise be left for good.
            self.previous_pid = int(previous)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        if self.socket_path is not None and self.socket_path.exists():
            try:
                live = _listened_on(self.socket_path)
                denied = False
            except PermissionError:  # (another user's socket: whether it lives cannot be told; not ours to remove)
                live = denied = True
            if live:
                # A live socket whose lock file was removed (a clean-up of the runtime folder): it was
                # replaced without a word, its daemon left serving no one with its memory (a review).
                self.lock_path.unlink()  # (ours, just made; the socket is the other process's: left)
                os.close(fd)
                self._fd = -1
                if denied:  # (taken for a dead one's: removed, or "its lock file: Operation not permitted", a review)
                    raise EndpointBusy(f"{self.socket_path} is a socket this user may not connect to (another "
                                       "user's, live or not: it cannot be told); stop its process or have its user "
                                       "remove it, or configure another daemon.endpoint")
                raise EndpointBusy(f"a process is listening on {self.socket_path} although no lock file "
                                   f"names it (a dflash2d whose {self.lock_path.name} was removed, or another "
                                   "program); stop it first or configure another daemon.endpoint")
            self.socket_path.unlink()  # left by a daemon that died: we hold the lock now
            self.replaced_socket = True

    def secure_socket(self) -> None:
        """After bind: only the owner may connect."""
        if self.socket_path is not None:
            os.chmod(self.socket_path, 0o600)

    def release(self) -> None:
        if self.socket_path is not None:
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
        if self._fd >= 0:
            try:
                self.lock_path.unlink()
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def _listened_on(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (a dead one's refuses)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(1.0)
        sock.connect(str(path))
        return True
    except (TimeoutError, BlockingIOError):  # (a backlog full: a live process that does not accept fast enough;
        return True  # Linux refuses at once, EAGAIN, where it does not wait: the socket was replaced, a review)
    except PermissionError:  # (another user's: the caller says so)
        raise
    except OSError:  # (refused: nothing listens, a killed daemon's file)
        return False
    finally:
        sock.close()


def probe_port(endpoint: str) -> None:
    """EndpointBusy when a tcp endpoint cannot be bound now: a bind tried and let go at once, by
    ZeroMQ as the server binds (IPv6 on: `*` is every address of both families, and a port held on
    `[::1]` only was missed by a probe of 0.0.0.0; SO_REUSEADDR, so a killed daemon's connections in
    TIME_WAIT do not count)."""
    if not endpoint.startswith("tcp://"):
        return
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            why = ("another program, or a dflash2d on another spelling of this address, holds the port"
                   if e.errno == errno.EADDRINUSE else
                   "an address of another node? (daemon.endpoint names this node's)" if e.errno == errno.EADDRNOTAVAIL else
                   "a port below 1024 needs privileges" if e.errno == errno.EACCES else
                   _no_such_host(endpoint) if e.errno == errno.ENODEV else "")
            port = int(endpoint.rpartition(":")[2]) if e.errno == errno.EADDRINUSE else 0
            holders = pids_text(port_listeners(port)) if port else ""
            raise EndpointBusy(f"cannot serve daemon.endpoint {endpoint}: {e.strerror or e}"
                               + (f" ({why})" if why else "") + (f", held by{holders}" if holders else "")) from None
        finally:
            sock.close(0)
    finally:
        ctx.term()


def _no_such_host(endpoint: str) -> str:
    """Why ZeroMQ found no device for a tcp endpoint's host (ENODEV): it binds an interface's name or
    a name that resolves, and the bare "No such device" did not say which was wrong (a review)."""
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # (socket.gaierror; UnicodeError: a name IDNA cannot encode)
        return (f"the host {host!r} is neither a network interface of this machine nor a name that resolves: "
                f"{getattr(e, 'strerror', None) or e}")
    return f"the host {host!r} resolves, but to no address ZeroMQ could bind here"


def probe_metrics(host: str, port: int) -> None:
    """EndpointBusy when the metrics port (0: off) cannot be bound now, tried and let go at once as
    the HTTP server binds it (SO_REUSEADDR): a port taken was found only once every tier was taken."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except (OSError, UnicodeError) as e:  # (socket.gaierror too; UnicodeError: a name IDNA cannot encode)
        # Who holds it, where this user may see (another model's dflash2d, an exporter): an operator
        # of two daemons on a node could not tell (a review).
        holders = pids_text(port_listeners(port)) if getattr(e, "errno", None) == errno.EADDRINUSE else ""
        raise EndpointBusy(f"cannot serve metrics on {host}:{port} (metrics.host, metrics.port): {e}"
                           + (f", held by{holders}" if holders else "")) from None
