"""Every error dflash2 raises on purpose, in one place.

A broken invariant raises one of these; an expected shortfall (no room) is a return value the caller
must handle, never an exception. One more exception is no error (`CopiesRunning`): the daemon's way
to park a call until copies in flight have ended.
"""

import errno

# The errnos of a full disk or quota: the disk's state, not a fault (NVMe start-up names them
# CapacityError; a failed batch's log line names them without a traceback, transfer/failures.py).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DFlash2Error(Exception):
    """Base of every error dflash2 raises on purpose."""


class ConfigError(DFlash2Error):
    """The configuration is invalid; the message names the key and what is wrong."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


class DisabledError(DFlash2Error):
    """The configuration says `enable` is not true."""


class LayoutError(DFlash2Error):
    """A KV layout is malformed or does not fit the arena it is asked to live in."""


class IllegalTransition(DFlash2Error):
    """A block state transition that the state machine does not allow."""


class UnknownBlock(DFlash2Error):
    """A virtual block id that is not live (never allocated, freed, or from an older generation)."""


class NotOwner(DFlash2Error):
    """A client touched a private block of another client, or dropped a reference it does not hold."""


class PinnedBlock(DFlash2Error):
    """An operation would move or free a block that a client has pinned."""


class ImmutableBlock(DFlash2Error):
    """A committed block was asked to change its bytes or content key."""


class UnknownClient(DFlash2Error):
    """A client id that is not attached (never was, detached, or its lease lapsed)."""


class UnknownLayout(DFlash2Error):
    """A layout id that no client has registered."""


class UnknownPolicy(DFlash2Error):
    """A policy name that is not in the registry; the message lists the valid names."""


class ArenaError(DFlash2Error):
    """A tier arena could not be created, mapped or used."""


class NoFileError(ArenaError):
    """A storage tier whose file was removed and none can be made: its writes are refused (an operator's
    state, said by the tier itself; nvmegone.py)."""


class CapacityError(ArenaError):
    """Start-up could not take a tier's region: the message gives the bytes needed and available."""


class NeverFits(DFlash2Error):
    """Blocks asked for in a tier exceed that tier's whole capacity: no amount of demotion could
    make room, so the answer is this error, not "no room now" (None)."""


class QuotaExceeded(DFlash2Error):
    """The client would hold more of HBM than its share (admission.max_client_share)."""


class TooManyClients(DFlash2Error):
    """An attach refused: the daemon has too few open descriptors left for another client's
    connections (daemon/descriptors.py)."""


class ReservationError(DFlash2Error):
    """A reservation id that is unknown, expired, or used beyond what it granted."""


class ProtocolError(DFlash2Error):
    """A control message that cannot be understood: malformed frames, unknown op, bad arguments."""


class WrongToken(DFlash2Error):
    """A call named an attached client without that client's session token (another process, or a
    client of a previous daemon): refused, so that no process can act for another's session."""


class CallForgotten(DFlash2Error):
    """A call its client had already given up on (timed out and sent `forget`) arrived afterwards:
    not run, so that nothing is held that the client does not know of."""


class VersionMismatch(ProtocolError):
    """Client and daemon speak different protocol versions."""


class DaemonUnavailable(DFlash2Error):
    """The daemon does not answer (not running, gone, or the call timed out)."""


class CallInProgress(DaemonUnavailable):
    """A call made while a call of the same client runs on this thread (from a signal handler): never
    sent, and what it names stays as it was (pins, blocks being written): make it after that call."""


class EndpointNotSocket(DaemonUnavailable):
    """An ipc endpoint's path is there but is no socket (a folder, a regular file): a mistake in the
    endpoint, not a daemon gone; `dflash2 status` and `history` call it a usage error (exit 2)."""


class AccessDenied(DaemonUnavailable):
    """A tcp daemon's key file cannot be read, or the daemon refused this client's key (tcpkeys.py)."""


class DaemonError(DFlash2Error):
    """The daemon answered a call with an error; `kind` names the daemon-side error type."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(f"{kind}: {message}")


class UnreadableReply(DaemonError):
    """What answered at the endpoint sent a reply this side cannot read (kind ProtocolError): not
    dflash2d's, or mangled. Not the daemon refusing a call."""

    def __init__(self, message: str):
        super().__init__("ProtocolError", message)


class CopiesRunning(Exception):
    """(A call served with `Placement.parking` on) it must wait for copies in flight that have not
    ended by PARK_AFTER_S after the last of them began (rebalance.py `end_soon`): raised before the
    call changed anything, so that it can run again, whole, once they have.
    `own`: the copies are its own, left in flight for it: an acquire's reads from NVMe (started with
    the room made for them), or the writes to NVMe that the room an allocation or a promotion needs
    in HBM takes (DRAM's room) — all it did: nothing allocated, pinned, touched or counted. A call
    is parked on its own copies at most OWN_PARKS times (`Placement.own_parks`); run again after
    that, it does its copies at once.
    Not a DFlash2Error: never an error reply."""

    def __init__(self, own: bool = False):
        super().__init__("copies in flight have not ended")
        self.own = own
