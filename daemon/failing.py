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

log = logging.getLogger("dflash2.daemon")


def fingerprint(manager) -> tuple:
    """Counters that any change of a table moves, read without a scan: the slots held in each tier,
    the rows in use, the keys indexed, the copies in flight. Compared around a call that was refused
    with an expected error (a DFlash2Error; a ValueError, KeyError or TypeError, as validation
    raises them): one that moved them had changed something first (a bug raising KeyError part way
    through a move, a review), and is checked as an unexpected failure is; one that moved none is a
    refusal that changed nothing, as nearly all are (no check: a client that sends bad arguments
    cannot make the daemon check its tables again and again, 0.2-0.35 s each at a million rows)."""
    table = manager.table
    return (tuple(a.used_bytes for a in table.allocators.values()), table.cols.live, len(table.keys),
            len(manager.placement._in_flight))


class Failing:
    """Needs `managers` (device -> BlockManager) of the Service."""

    broken: str | None = None  # why the tables cannot be trusted any more (set once, by `verify_after`)

    def verify_after(self, error: BaseException | str, what: str) -> None:
        """After `what` ("allocate", "the background step") failed with `error` (or its text): check
        every pool's table; one that fails the check, or cannot be checked, marks the daemon broken
        (`fatal`)."""
        if self.broken is not None:
            return
        if not isinstance(error, str):
            error = f"{type(error).__name__}: {error}"
        for pool, manager in self.managers.items():
            try:
                manager.check_invariants()
            except Exception as e:  # (an InvariantViolation; a MemoryError: it cannot be checked)
                verdict = "fails its check" if type(e).__name__ == "InvariantViolation" else "could not be checked"
                self.broken = (f"the block table of pool {pool} {verdict} after {what} failed part way "
                               f"({error}): {type(e).__name__}: {e}")
                log.error("%s; refusing every call from now on, and exiting", self.broken)
                return
        log.info("the block tables are whole after %s failed (%s); serving on", what, error.split(":")[0])

    def fingerprints(self) -> list[tuple]:
        return [fingerprint(m) for m in self.managers.values()]

    def verify_noted(self) -> None:
        """`verify_after` each failure a manager logged and carried on past since the last time
        (`BlockManager.failures`: a call's follow-up, a drain piece's end), before the next call runs
        and at each turn of the loop (`fatal`): their calls or steps had answered as if nothing
        failed (a review: a lookup's prefetch left a slot to be handed out twice)."""
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
