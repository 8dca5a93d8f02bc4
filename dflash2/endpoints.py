"""Where the daemon listens and where its clients connect: endpoint strings (`ipc://PATH`,
`tcp://HOST:PORT`), the runtime folder of the default socket and of a tcp endpoint's lock file, the
XDG folders (a relative one is ignored, as the spec says), and the text a path or address may hold.
Pure functions over strings and the environment: config.py validates with them, the daemon, the
client and the operator commands resolve with them."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

UNIX_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL

def connectable(endpoint: str) -> str:
    """The endpoint a client connects to for a daemon bound to `endpoint`: the loopback address of
    its family for one bound to every address (tcp://*:PORT, 0.0.0.0, [::]), which nobody can
    connect to (`dflash2 status --endpoint tcp://*:P`, as the daemon logs it, failed); else itself."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    host, _, port = rest.rpartition(":")
    loopback = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(_bare_host(host))
    if loopback == "[::1]" and not ipv6_loopback():
        # A daemon bound to [::] where IPv6 is off serves IPv4 (ZeroMQ falls back): clients sent to
        # [::1] waited out their timeout.
        loopback = "127.0.0.1"
    return endpoint if loopback is None else f"tcp://{loopback}:{port}"


def ipv6_loopback() -> bool:
    """Whether this machine has IPv6's loopback address (a socket can be bound to it)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def interface_host(endpoint: str) -> Optional[str]:
    """The host of a tcp endpoint when it is the name of a network interface of this machine (eth0,
    enP5p1s0, lo), else None. ZeroMQ binds such a name (case-sensitively, and to its IPv6 address
    first), where a client connects to what the name resolves to, if anything: so it is refused even
    where it resolves (an /etc/hosts entry for eth0 sent clients to another address than the bound
    one), and compared as written (lower-cased, enP5p1s0 was not found among the interfaces)."""
    scheme, _, rest = endpoint.partition("://")
    host = rest.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if scheme != "tcp" or host == "*":
        return None
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return host if host in names else None


def runtime_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The node-local runtime folder: the default socket's, and a tcp endpoint's lock file's."""
    runtime = xdg_dir(environ, "XDG_RUNTIME_DIR")
    return Path(runtime) / "dflash2" if runtime else Path(f"/tmp/dflash2-{os.getuid()}")


def tcp_key_path(endpoint: str, environ: Mapping[str, str] = os.environ) -> Optional[Path]:
    """Where a tcp endpoint's key file is when the config names none (dflash2/tcpkeys.py): `tcp-PORT.key`
    in the runtime folder, by port alone, so that a client connecting to 127.0.0.1:P finds the key of a
    daemon bound to tcp://*:P; None for an ipc endpoint (its socket's mode guards it)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None
    return runtime_dir(environ) / f"tcp-{rest.rpartition(':')[2]}.key"


def _bare_host(host: str) -> str:
    """A host as one spelling: lower case, an IPv6 address without the brackets an endpoint puts
    around it, and an IP address in its canonical form (`0:0:0:0:0:0:0:1` is `::1`)."""
    host = host.lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _same_host(a: str, b: str) -> bool:
    """Whether two hosts may name one address, as far as can be told without asking a resolver:
    equal, or a loopback name and a loopback address it stands for (127.0.0.2 is another address)."""
    names, addresses = {"localhost", "ip6-localhost"}, {"127.0.0.1", "::1"}
    a, b = _bare_host(a), _bare_host(b)
    return a == b or ({a, b} <= names | addresses and bool({a, b} & names))


def numeric_address(host: str) -> Optional[str]:
    """The address a numeric host is bound at, as the resolver reads it: `127.1` is 127.0.0.1 and `0`
    is 0.0.0.0 (inet_aton's shorthand), `*` and "" every IPv4 address; None for a name, which is not
    looked up (no DNS at config time)."""
    host = host.lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("*", ""):
        return "0.0.0.0"
    try:
        *_, sockaddr = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)[0]
        return str(ipaddress.ip_address(sockaddr[0]))
    except (OSError, UnicodeError, ValueError):
        return None


def _every_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def hosts_overlap(a: str, b: str) -> bool:
    """Whether listening on one port at hosts a and b collides: the same address however written
    (`127.1`, `0:0:0:0:0:0:0:1`), a loopback name and its address, or either one every address
    (`0` passed as another host than `0.0.0.0`, and the daemon's own metrics server then held the
    endpoint's port: exit 4 after the tiers were taken, a review)."""
    a, b = (numeric_address(h) or h for h in (a, b))
    return _same_host(a, b) or _every_address(a) or _every_address(b)


def plain_text(value: str) -> str:
    """A path or address without control characters: a NUL cannot be in a path (start-up ended in a
    traceback), and a newline would split the one-line errors and `now:` lines that name it."""
    bad = next((i for i, ch in enumerate(value) if ord(ch) < 32 or ord(ch) == 127), None)
    if bad is not None:
        raise ValueError(f"holds a control character ({value[bad]!r} at position {bad}); a path or address "
                         "cannot")
    if value != value.strip():
        # (" /mnt/nvme/nvme.cache" was a relative path: the file went under the config's folder, in a
        # folder named " "; a host with a space passed the config and failed the start, exit 4: a review)
        raise ValueError("begins or ends with white space, which a path or address here cannot: remove it")
    return value


def xdg_dir(environ: Mapping[str, str], name: str) -> Optional[str]:
    """An XDG base directory variable's folder, or None when it is unset, empty or relative (the XDG
    spec: a relative path is invalid and ignored; it would resolve against each process's working
    folder, so a client started elsewhere would look for another socket). check_environment warns."""
    value = environ.get(name)
    return value if value and os.path.isabs(value) else None


def endpoint_parts(endpoint: str) -> tuple[str, str]:
    """Split and check `ipc://PATH` or `tcp://HOST:PORT`; ValueError says what is wrong."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ValueError(f"{endpoint!r} must start with ipc:// or tcp://")
    if not rest:
        raise ValueError(f"{endpoint!r} has no {'path' if scheme == 'ipc' else 'host:port'}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # (an IPv6 address's brackets)
        if colon and not bare:  # (`tcp://:31701` was told of "a port in 1..65535", a review; `tcp://[]:P` passed)
            raise ValueError(f"{endpoint!r} names no host: write tcp://HOST:PORT, such as "
                             f"tcp://127.0.0.1:{port or 'PORT'}")
        # (`tcp://[::1]` was told of unmatched brackets, a review; `tcp://[]` names no host either, and
        # `tcp://[::1]]` was told to write `tcp://[::1]]:PORT`, refused then for its brackets: a review)
        if rest.startswith("[") and rest.endswith("]") and rest[1:-1] and not set("[]") & set(rest[1:-1]):
            raise ValueError(f"{endpoint!r} names no port: write tcp://{rest}:PORT")
        if "[" in bare or "]" in bare or (host.startswith("[") != host.endswith("]")):
            # (`tcp://[::1:31701` passed the config's check; start-up then failed to bind it, exit 4: a review)
            raise ValueError(f"{endpoint!r} has unmatched brackets: write an IPv6 address as tcp://[ADDRESS]:PORT")
        if any(ch.isspace() for ch in host):  # (passed the config; no address or name has one: start-up exit 4)
            raise ValueError(f"{endpoint!r}: its host {host!r} holds white space; write tcp://HOST:PORT without it")
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ValueError(f"{endpoint!r} must be tcp://HOST:PORT with a port in 1..65535")
        if port != str(int(port)):  # (the key and lock files are named by the port as written: two names)
            raise ValueError(f"{endpoint!r}: write the port without leading zeros ({int(port)})")
    return scheme, rest


def check_socket_path(endpoint: str) -> None:
    """ValueError when an ipc endpoint's path is longer than a Unix socket's may be: the daemon's
    --check refused it (plan.py), where `--endpoint` went on to "File name too long", exit 1 (a review)."""
    if endpoint.startswith("ipc://") and len(endpoint[len("ipc://"):].encode()) > UNIX_SOCKET_PATH_MAX:
        raise ValueError(f"the socket path {endpoint[len('ipc://'):]!r} is longer than {UNIX_SOCKET_PATH_MAX} "
                         "bytes, the Unix limit")


def default_endpoint(environ: Mapping[str, str] = os.environ) -> str:
    return f"ipc://{runtime_dir(environ) / 'dflash2.sock'}"


def usual_default_endpoints() -> tuple[str, str]:
    """The default endpoint as a login shell has it (XDG_RUNTIME_DIR as systemd-logind sets it,
    /run/user/UID) and as a systemd unit or cron has it (none: /tmp/dflash2-UID)."""
    return default_endpoint({"XDG_RUNTIME_DIR": f"/run/user/{os.getuid()}"}), default_endpoint({})
