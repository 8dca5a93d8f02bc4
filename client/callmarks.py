"""Where one client call stands, so that the exception ending it is read for what it is: the call's own
answer (raised on purpose by the client, or by the transport while it ran the call) or an exception of
the caller's that cut it off: a signal handler's (a serving loop's request deadline by SIGALRM, Ctrl-C),
whatever its class, an error of a call the handler made (of this client: CallInProgress; of another:
that one's refusal, its UnknownClient) included.

Reviews found such exceptions read as answers wherever they landed outside the transport: met while a
commit waited for the client's lock, a handler's refusal kept the block writable here though the commit
ran with the next call and the daemon gave the block to another client; met just after a reply, another
client's UnknownClient ended this client's lease; met as a release entered the client, its pins were
given up here but the release neither sent nor kept, held by the daemon until detach."""

from __future__ import annotations

from collections.abc import Callable

from dflash2 import protocol as P
from dflash2.errors import CallInProgress, DaemonError, ProtocolError, UnreadableReply


class CallMarks:
    """One call's marks. `vids`: the block ids frame of a commit, release or free, what such a call cut
    off before the transport took it keeps to go with the next call (as one that waited out its timeout
    behind other threads' calls); None for other calls. `restore`: what puts back the views the call gave
    up before it was sent (`HeldPlaces.give_up`), once that step has run whole."""

    __slots__ = ("op", "vids", "own", "taken", "answered", "queued", "gives_up", "restore")

    def __init__(self, op: P.Op, arrays, gives_up: bool):
        self.op = op
        self.vids = arrays[0] if op in (P.Op.COMMIT, *P.RETRIED) and arrays else None
        self.own: BaseException | None = None  # the error the client raised as this call's answer
        self.taken: int | None = None  # the transport's `taken` count as the call was handed to it
        self.answered = False  # the transport returned the daemon's answer
        self.queued = False  # kept in the client's queue of unsent calls
        self.gives_up = gives_up
        self.restore: Callable[[], None] | None = None

    def mine(self, error: BaseException) -> BaseException:
        """`error`, noted as this call's own answer (raised by the client on purpose)."""
        self.own = error
        return error

    def keep(self, unsent) -> None:
        """Into the client's queue of calls the next call sends (a commit's as its blocks' `forget`)."""
        self.queued = True
        unsent.append((self.op, self.vids))

    def fate(self, transport) -> str:
        """What became of a call cut off, for its error: "given up as after a timeout" said of every
        such call, also of one kept to send, or one neither sent nor kept (a review)."""
        if self.answered:
            return "it had run: its answer is lost"
        if self.queued:
            return "kept to go with the next call"
        if self.taken is not None and transport.taken != self.taken:
            return "given up as after a timeout"
        return "never sent" + ("; what it names stays this client's until it detaches" if self.vids is not None else "")

    def owns(self, error: BaseException, transport) -> bool:
        """Whether `error` is this call's own answer: raised by the client as one, or by the transport
        while it ran this call (not before: a handler's call of this client, made while this one waited
        for the client's lock, goes through the same transport)."""
        if error is self.own:
            return True
        return self.taken is not None and not self.answered and transport.raised_here(error)

    def to_keep(self, transport) -> bool:
        """Whether a call cut off here is still the client's to send: a commit, release or free neither
        kept yet nor taken by the transport, whose views were given up whole (a giving up cut off halfway
        keeps what is left viewable and the call unsent: the daemon holds what it names until detach,
        where sent later, views kept here would follow blocks that may move)."""
        if self.vids is None or self.queued or self.answered:
            return False
        if self.gives_up and self.restore is None:
            return False
        return self.taken is None or transport.taken == self.taken


def refused(error: BaseException) -> bool:
    """Whether this call's own `error` says it ran nothing: refused by the daemon (but for a lost lease,
    UnknownClient: views are given up with it; and an unreadable reply, after which it may have run) or
    by the client before sending (CallInProgress, ProtocolError)."""
    if isinstance(error, (CallInProgress, ProtocolError)):
        return True
    return isinstance(error, DaemonError) and not isinstance(error, UnreadableReply) and error.kind != "UnknownClient"


def raised_by(error: BaseException, function) -> bool:
    """Whether `function` itself raised `error` (the innermost frame of its traceback is the function's),
    not a signal handler that ran while it did."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is function.__code__
