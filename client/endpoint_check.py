"""Whether this process may use an ipc endpoint, told before any message is sent (`check_endpoint`):
a socket file that is not there, one of a folder it may not enter, one it may not connect to, and
one of another user's daemon it must not attach to (transport.py's callers: the client, `dflash2
status` and `history`)."""

from __future__ import annotations

import os
import socket
import stat

from dflash2.endpointlock import holder
from dflash2.errors import DaemonUnavailable, EndpointNotSocket


def check_endpoint(endpoint: str, attaching: bool = False) -> None:
    """Fail fast (DaemonUnavailable) when an ipc endpoint has no socket file (no daemon there), or
    one this process may not use: the socket and its folder are the daemon user's own. A folder it
    could not enter was said to hold no socket, and a socket it could not open waited out the whole
    timeout as "no reply (daemon gone or stuck)" (a review: the systemd unit's and the DaemonSet's
    layouts, another user's `dflash2 status` and sglang). `attaching`: a client that will hand the
    daemon its KV cache, which only a daemon of its own user may get (a review: another user who made
    this user's default runtime folder first, /tmp/dflash2-UID, and served a daemon there, had this
    user's clients attach and write their blocks into its memory); a status may read another's."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    same_user = ("clients run as the daemon's user (the socket and the shared memory are its own): "
                 f"this process is uid {os.geteuid()}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DaemonUnavailable(_starting(endpoint, path) or f"no dflash2d at {endpoint}: the socket file does not "
                                "exist (is the daemon running? `dflash2d --config FILE`)"
                                f"{_default_elsewhere(path)}") from None
    except PermissionError:
        folder = os.path.dirname(path) or "."
        try:
            fst = os.stat(folder)
            whose = f" (owner uid {fst.st_uid}, mode {stat.S_IMODE(fst.st_mode):o})"
        except OSError:
            whose = ""
        raise DaemonUnavailable(f"cannot reach dflash2d's socket {path}: permission denied to enter its folder "
                                f"{folder}{whose}; {same_user}") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot reach dflash2d's socket {path}: {e.strerror or e}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointNotSocket(_not_a_socket(endpoint, path, st.st_mode))
    if attaching and st.st_uid != os.geteuid():
        from dflash2.endpoints import default_endpoint

        # In this user's default folder another user made it (/tmp is everyone's); elsewhere, the
        # daemon runs as another user (a systemd unit's User=), and this client must too (a review:
        # the advice to remove the daemon's own runtime folder).
        why = (f"another user made {os.path.dirname(path)}, this user's default folder: remove it, or give "
               "daemon.endpoint a folder of your own" if path == default_endpoint()[len("ipc://"):]
               else f"run this client as the daemon's user, uid {st.st_uid}")
        raise DaemonUnavailable(f"will not attach to the dflash2d at {path}: its socket belongs to uid {st.st_uid}, "
                                f"not to this process's user (uid {os.geteuid()}), and a client hands its daemon its "
                                f"requests' KV cache; {same_user} ({why})")
    # The kernel's own answer, a plain connect let go at once (the daemon's ZeroMQ drops a peer that
    # never greets): a guess from the mode bits, or access(2), refused a socket its group could
    # use (it needs write only), or ACLs allowed, and a seccomp profile that refuses faccessat2
    # would have refused every client (a review).
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except PermissionError:
        raise DaemonUnavailable(f"cannot use dflash2d's socket {path}: permission denied (owner uid {st.st_uid}, "
                                f"mode {stat.S_IMODE(st.st_mode):o}); {same_user}") from None
    except ConnectionRefusedError:
        raise DaemonUnavailable(_starting(endpoint, path) or f"no dflash2d at {endpoint}: nothing listens on its "
                                "socket file (a daemon that was killed left it; is the daemon running? `dflash2d "
                                "--config FILE`)") from None
    except OSError:
        pass  # (a full backlog, a timeout: ZeroMQ tries as it does, and the call's timeout says)
    finally:
        probe.close()


def _not_a_socket(endpoint: str, path: str, mode: int) -> str:
    """What to say of an endpoint whose path is no socket: its connect was refused and the command said
    a killed daemon had left the socket file there (a review: it named a folder)."""
    if stat.S_ISDIR(mode):
        return (f"{endpoint} names a folder, not dflash2d's socket: daemon.endpoint (and --endpoint) name the "
                f"socket file, such as ipc://{path.rstrip('/')}/dflash2.sock")
    kind = ("a regular file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "no socket")
    return (f"{endpoint} names {kind}, not a socket: daemon.endpoint (and --endpoint) name dflash2d's socket "
            "file, which the daemon makes as it starts")


def _starting(endpoint: str, path: str) -> str:
    """What to say of a daemon that holds the endpoint's lock but does not serve its socket (`path`,
    gone or refusing connections): one taking its tiers at start-up (minutes for large ones), or
    letting them go as it stops ("" when none holds it). Told "is the daemon running?" then, an
    operator restarted it, and sglang fell back as with none (a review)."""
    pid = holder(f"ipc://{path}")
    if pid is None:
        return ""
    return (f"no dflash2d answers at {endpoint} now: dflash2d pid {pid} holds it but does not serve it, "
            "as while it starts (taking its tiers: minutes for large ones) or stops; try again shortly")


def _default_elsewhere(path: str) -> str:
    """Where the default socket of the other kind of environment lies, when it is there: the default
    endpoint follows XDG_RUNTIME_DIR, which a login shell sets and a systemd system unit or cron does
    not, so a daemon started in one and a client in the other looked in two places (a review)."""
    from dflash2.endpoints import default_endpoint, usual_default_endpoints

    if path != default_endpoint()[len("ipc://"):]:
        return ""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    with_xdg, without = usual_default_endpoints()
    other = (without if xdg else with_xdg)[len("ipc://"):]
    if not os.path.exists(other):
        return ""
    return (f"; one is at ipc://{other}, the default socket of an environment {'without' if xdg else 'with'} "
            "XDG_RUNTIME_DIR (a systemd unit's, cron's, a login shell's): name one socket in daemon.endpoint of "
            "the config both read")
