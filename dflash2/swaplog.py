"""The `dflash2_swap` lines of the daemon's log: batch moves, at most one line per direction every
SWAP_LOG_EVERY_S.

One line per batch move filled the log under churn: a soak with tiers of tens of MB wrote 34 MB in
30 minutes, 98% of it these lines (about 150 a second). Now the first batch of a direction after a
quiet spell is said at once, as before, and the batches that follow within SWAP_LOG_EVERY_S are
summed into the next line of that direction, which says how many batches it covers (`batches`) and
over how long (`over_s`). Each batch is also said alone at debug (`dflash2_swap_batch`).

A direction's batches kept for its next line are said by the daemon's step once SWAP_LOG_EVERY_S
has passed since its last line (`due`), whether or not another batch comes: the log lags the moves
by SWAP_LOG_EVERY_S and a step at most (a crash loses no more than that), and a line after a quiet
spell covers only that spell's batches.

Fields: `blocks` moved and `bytes` of theirs (the blocks that arrived, as the metrics count them),
`failed` blocks (left where they were, or dropped when read from NVMe), `batches`, `seconds` (their
copies' own time, summed over the `timed` batches the backend timed: every host and NVMe batch, a
GPU HBM<->DRAM batch once a second per direction; not the wait behind other batches), `over_s` (from
the first batch's end to the line).

Invariant: every batch is counted in exactly one `dflash2_swap` line (`flush` says the rest at
shutdown): summed over the lines, `blocks`, `failed` and `bytes` are the totals of
`dflash2_swap_blocks_total`, `dflash2_swap_failed_blocks_total` and `dflash2_swap_bytes_total`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

SWAP_LOG_EVERY_S = 10.0


@dataclasses.dataclass
class _Spell:
    """Batches of one direction not yet said at info."""

    first: float  # when the first of them ended (the clock's time)
    batches: int = 0
    blocks: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0  # their copies' own time, summed over ...
    timed: int = 0  # ... the batches the backend timed


class SwapLog:
    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic,
                 every_s: float = SWAP_LOG_EVERY_S):
        self._log = logger
        self._clock = clock
        self._every_s = every_s
        self._last: dict[str, float] = {}  # direction -> when its last line was said
        self._pending: dict[str, _Spell] = {}

    def batch(self, direction: str, blocks: int, failed: int, nbytes: int, seconds: float | None) -> None:
        """One batch move has ended (`blocks` moved, `nbytes` of theirs, `failed` not; its copy took
        `seconds`, None where the backend did not time it): said now if its direction's last line is
        SWAP_LOG_EVERY_S old (or there was none), else kept."""
        now = self._clock()
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug("dflash2_swap_batch", extra={"event": "dflash2_swap_batch", "direction": direction,
                                                         "blocks": blocks, "failed": failed, "bytes": nbytes,
                                                         "seconds": None if seconds is None else round(seconds, 6)})
        spell = self._pending.get(direction)
        if spell is None:
            spell = self._pending[direction] = _Spell(first=now)
        spell.batches += 1
        spell.blocks += blocks
        spell.failed += failed
        spell.bytes += nbytes
        if seconds is not None:
            spell.seconds += seconds
            spell.timed += 1
        last = self._last.get(direction)
        if last is None or now - last >= self._every_s:
            self._say(direction, now)

    def due(self) -> None:
        """Say each direction whose batches wait and whose last line is SWAP_LOG_EVERY_S old (the
        daemon's step: a burst's batches are said within that time, not at the next batch)."""
        if not self._pending:
            return
        now = self._clock()
        for direction in list(self._pending):
            last = self._last.get(direction)
            if last is None or now - last >= self._every_s:
                self._say(direction, now)

    def flush(self) -> None:
        """Say every direction's batches not said yet (at shutdown: none is left unsaid)."""
        now = self._clock()
        for direction in list(self._pending):
            self._say(direction, now)

    def _say(self, direction: str, now: float) -> None:
        spell = self._pending.pop(direction)
        self._last[direction] = now
        self._log.info("dflash2_swap", extra={"event": "dflash2_swap", "direction": direction,
                                              "batches": spell.batches, "blocks": spell.blocks,
                                              "failed": spell.failed, "bytes": spell.bytes,
                                              "seconds": round(spell.seconds, 6), "timed": spell.timed,
                                              "over_s": round(now - spell.first, 3)})
