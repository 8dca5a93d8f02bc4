"""Calls the block manager answered "no room now" (None), counted by call and cause.

The client is told why (`allocate_refusal`, `acquire_refusal`: the daemon's reply). Before, the
operator saw nothing: no counter, no log line, `dflash2 status` showed a quiet daemon while an engine
was turned away (a review). Each refusal is counted here (`stats()["refused"]`,
`dflash2_refused_calls_total{op,cause}`, `dflash2 status`) and logged at INFO, once a minute per
(call, cause), the next line counting those left out (`RepeatLimit`).

Causes:
- `tier_full`: the tier cannot hold the blocks now: what is there cannot move (being written,
  pinned, running at a priority the call may not push out), or the room made fell short;
- `copy_failed` (an acquire): the copy of blocks up to the tier failed after their source was read
  (a refused GPU launch, an out-of-memory; the transfer log names it); they stay where they were,
  and a retry tries them again. It was counted `tier_full`, the room made said to fall short
  though HBM may be empty (a review);
- `reservations_ahead`: HBM is held for reservations waiting at the caller's priority or above
  (an allocate outside a reservation queues behind them).
"""

from __future__ import annotations

import logging

from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.refusals")

CAUSES = {"allocate": ("tier_full", "reservations_ahead"), "acquire": ("tier_full", "copy_failed")}


class Refusals:
    def __init__(self):
        self.counts = {op: dict.fromkeys(causes, 0) for op, causes in CAUSES.items()}
        self._limit = RepeatLimit("refusals")

    def note(self, op: str, cause: str, reason: str) -> None:
        """`op` answered None for `cause`; `reason` is what its client was told."""
        self.counts[op][cause] += 1
        more = self._limit.due((op, cause))
        if more is not None:
            log.info("%s refused (%s): %s%s", op, cause, reason, more)

    def describe(self) -> dict:
        return {op: dict(causes) for op, causes in self.counts.items()}
