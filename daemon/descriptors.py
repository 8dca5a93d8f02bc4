"""Open descriptors. Each attached client holds two connections (its calls, its heartbeat), each a
descriptor of the daemon's, and libzmq aborts the whole process when an ipc accept finds none left
(every client loses the daemon at once). So the soft limit is raised at start, and an attach is
refused (TooManyClients) while fewer than ATTACH_HEADROOM descriptors are left: the connections of
clients still connecting, and of calls sent again on a fresh socket, take from those. Before, the
117th client of a daemon limited to 256 ended it (`Too many open files (src/ipc_listener.cpp)`,
exit 134, a review's script)."""

from __future__ import annotations

import logging
import resource

from dflash2.errors import TooManyClients
from dflash2.zmqio import descriptors_left

log = logging.getLogger("dflash2.daemon")

FEW_OPEN_FILES = 4096  # a soft limit under this is warned about
ATTACH_HEADROOM = 64  # descriptors an attach leaves free


def raise_open_files_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one (as far as it goes), and warn when
    it stays low. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("open files limit raised from %d to %d (each client holds two connections)", soft, want)
            soft = want
        except (ValueError, OSError) as e:
            log.warning("open files limit %d could not be raised to %d: %s", soft, want, e)
    return soft


def warn_if_few() -> None:
    """Once the daemon holds its own descriptors (tiers, sockets, locks): warn when the soft limit is
    low, with how many clients can attach now (the count said at the limit's raise left out the ~20
    the daemon itself holds: "about 33" where 22 fit, a review)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    left = descriptors_left()
    if left is not None and soft < FEW_OPEN_FILES:
        log.warning("open files limit is %d (hard limit %s): about %d clients can attach, more are refused; "
                    "raise it (ulimit -n, systemd LimitNOFILE, the container's nofile)", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, max(0, (left[0] - ATTACH_HEADROOM) // 2))


def refuse_past_descriptors(name: str, pid: int) -> None:
    """TooManyClients when another client's connections (an attach of `name`, process `pid`) would
    leave the daemon fewer than ATTACH_HEADROOM descriptors (out of them, libzmq ends the daemon)."""
    left = descriptors_left()
    if left is not None and left[0] < ATTACH_HEADROOM:
        log.warning("attach of %s (pid %d) refused: %d of the daemon's %d open descriptors are left (each client "
                    "holds two)", name, pid, *left)
        raise TooManyClients(f"attach refused: the daemon has {left[0]} of its {left[1]} open descriptors left, and "
                             f"keeps {ATTACH_HEADROOM} free (each client holds two connections); detach clients, or "
                             "raise dflash2d's open files limit (ulimit -n, systemd LimitNOFILE, the container's nofile)")
