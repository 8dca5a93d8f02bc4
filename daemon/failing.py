"""When the daemon cannot serve any more: a GPU whose CUDA context is lost, or a block table that no
longer adds up after a call or a background step failed part way.

A call that raises something other than the expected refusals (a bug, or numpy's MemoryError under
an address-space limit, where any allocation may fail) may have changed part of the table: a review
injected a MemoryError at each allocation of 19 calls and found the table whole after most, but
after some a slot handed out twice (a move's second half: the source slot freed, the block still
naming it; the next allocate gave it to another block, whose writes then became a cached chain's
bytes), blocks left moving for good, committed blocks missing from the key index, a freed block
leaked. Serving on from such a table hands out wrong bytes. So after each such failure the tables
are checked (`BlockManager.check_invariants`, which caught every one of those); a table that fails
the check, or that cannot be checked (the check itself out of memory), stops the daemon: every call
from then on is refused, and it exits with EXIT_TABLE_BROKEN for its supervisor to restart it, as
after a lost GPU (EXIT_GPU_LOST).
"""

from __future__ import annotations

import logging
import time

from dflash2.errors import ArenaError, DFlash2Error
from dflash2.invariants import InvariantViolation

log = logging.getLogger("dflash2.daemon")


# Checks after refusals (below) take at most this share of the daemon's time: the next waits until
# its last one's length (the thread's CPU time: a stall of the process during a check does not count,
# a review), divided by it, has passed (at a million rows, 0.2-0.35 s a check: one every 4-7 s while
# a client keeps sending calls that are refused), and REFUSAL_CHECK_MAX_S at most (several pools of
# a million rows each, a slower machine).
REFUSAL_CHECK_SHARE = 0.05
REFUSAL_CHECK_MAX_S = 10.0
REFUSALS_NAMED = 4  # refusals whose text a check's verdict names (the last ones; the others counted)


def checked_refusal(error: BaseException) -> bool:
    """Whether a refused call's error may have come part way through a change (`after_refusal`): a
    ValueError, KeyError or TypeError (validation raises them, and so does a bug anywhere: a dict's
    missing key, numpy), an ArenaError (a slot freed twice: the sign of a table already off) or an
    InvariantViolation (a bug: heat's recount raises it after a commit's blocks were published, a
    review). A DFlash2Error otherwise is a refusal raised on purpose, before anything changes or after
    a whole one (an unknown client or block, a wrong token, a call forgotten): checked after each, a
    client that lapsed
    logged 70-90 checks a second and sglang's commit under an evicted parent ran one, 0.2-0.35 s at
    a million rows, in its ordinary work (a review)."""
    return isinstance(error, (ArenaError, InvariantViolation)) or not isinstance(error, DFlash2Error)


class Failing:
    """Needs `managers` (device -> BlockManager) of the Service."""

    broken: str | None = None  # why the tables cannot be trusted any more (set once, by `verify_after`)
    # Refusals of calls that may change the tables not checked yet: how many, and the last few's text and op.
    _refused = 0
    _refusals: list[tuple[str, str]] | None = None
    _refusal_check_at = 0.0  # (time.monotonic) when the next check after refusals may run

    def after_refusal(self, error: BaseException, what: str) -> None:
        """A call that may change the tables was refused with an error that may come part way through
        a change (`checked_refusal`). Nearly all are raised before anything changed, but a bug
        raising one of them part way (a KeyError in a move's second half, a review) leaves a table
        as broken as any failure does, and no cheap counter tells the two apart (refs, pins, the key
        index: a second review). So they are checked as failures are, at once where the last such
        check is long enough past (REFUSAL_CHECK_SHARE), else together once it is, before a later
        call or at a turn of the loop (`verify_noted`): a client that sends bad calls again and
        again holds the daemon in checks 5% of the time where a check takes up to 0.5 s, and for one
        check every REFUSAL_CHECK_MAX_S where it takes longer."""
        self._refusals = [*(self._refusals or [])[1 - REFUSALS_NAMED:], (f"{type(error).__name__}: {error}", what)]
        self._refused += 1
        self._check_refusals()

    def _check_refusals(self, now: bool = False) -> None:
        """Check the tables for the refusals not checked yet, where the budget allows (`now`: whatever
        it says, as at a stop)."""
        if not self._refused or self.broken is not None or (not now and time.monotonic() < self._refusal_check_at):
            return
        count, refused, self._refused, self._refusals = self._refused, self._refusals or [], 0, []
        began = time.thread_time()
        ops = ", ".join(sorted({what for _, what in refused}))
        self.verify_after("; ".join(error for error, _ in refused),
                          f"{ops} (refused)" if count == 1 else f"{count} refused calls (the last: {ops})",
                          whole_said=logging.DEBUG)  # (the common case: a refusal that changed nothing)
        wait = min(REFUSAL_CHECK_MAX_S, (time.thread_time() - began) / REFUSAL_CHECK_SHARE)
        self._refusal_check_at = time.monotonic() + wait

    def verify_after(self, error: BaseException | str, what: str, whole_said: int = logging.INFO) -> None:
        """After `what` ("allocate", "the background step") failed with `error` (or its text): check
        every pool's table; one that fails the check, or cannot be checked, marks the daemon broken
        (`fatal`); tables found whole are logged at `whole_said`."""
        if self.broken is not None:
            return
        if not isinstance(error, str):
            error = f"{type(error).__name__}: {error}"
        for pool, manager in self.managers.items():
            try:
                manager.check_invariants()
            except Exception as e:  # (an InvariantViolation; a MemoryError: it cannot be checked)
                verdict = "fails its check" if isinstance(e, InvariantViolation) else "could not be checked"
                self.broken = (f"the block table of pool {pool} {verdict} after {what} failed part way "
                               f"({error}): {type(e).__name__}: {e}")
                log.error("%s; refusing every call from now on, and exiting", self.broken)
                return
        log.log(whole_said, "the block tables are whole after %s failed (%s); serving on", what, error.split(":")[0])

    def verify_noted(self) -> None:
        """`verify_after` each failure a manager logged and carried on past since the last time
        (`BlockManager.failures`: a call's follow-up, a drain piece's end), before the next call runs
        and at each turn of the loop (`fatal`): their calls or steps had answered as if nothing
        failed (a review: a lookup's prefetch left a slot to be handed out twice)."""
        self._check_refusals()
        noted = [failure for manager in self.managers.values() for failure in manager.failures]
        if noted:  # (one check for them all: each is a full pass)
            for manager in self.managers.values():
                manager.failures.clear()
            self.verify_after("; ".join(error for error, _ in noted), ", then ".join(what for _, what in noted))

    def _check_gpus(self, error: Exception) -> None:
        """A call that failed in CUDA (attach asking for an arena's IPC handle after its GPU
        faulted): each pool's backend checks its GPU, as after a failed copy; a lost CUDA context
        makes the daemon exit (`fatal`). Before, the call's client got an InternalError and the
        daemon served on without its GPU."""
        if not type(error).__module__.startswith(("cupy", "cupy_backends")):
            return
        for m in self.managers.values():
            m.backend.check_gpu(error)

    def fatal(self) -> str | None:
        """Why the daemon cannot serve any more (a pool's transfer backend is dead: a GPU whose CUDA
        context is lost; a table that no longer adds up: `broken`), else None."""
        self.verify_noted()
        if self.broken is not None:
            return self.broken
        for m in self.managers.values():
            reason = getattr(m.backend, "fatal", None)
            if reason:
                return reason
        return None
