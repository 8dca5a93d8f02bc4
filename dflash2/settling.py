"""When a BlockManager call ends the copies left in flight first (rebalance.py `settle`).

A drain piece between requests leaves its copies in flight, and so does a promotion's read from NVMe
while the daemon serves (promotion.py `promote_later`); their blocks are MIGRATING until they
are settled: readable where they were, but a pin, a move or an eviction must not meet them, nor a
free that the table would defer. Calls that may do any of that to blocks they cannot name up front
(reservations, `detach`, `place`, `view`, the step) settle always (`settled`). The calls of a serving
step settle only where they meet the flight (`settle_if`): they make room or promote (placement
work), or name a block in flight; a commit, the cached twins its keys deduplicate onto and the
parent it chains under (`rows_a_commit_meets`). Before, every one of them settled: an allocation
from free room waited for a piece's NVMe writes.

While the daemon serves a call (`Placement.parking`), a settle waits for copies not yet ended only
until PARK_AFTER_S after the last of them began (rebalance.py `end_soon`); copies that run longer
raise `CopiesRunning` (errors.py) instead, before the call has changed anything: the server parks
the call and answers it once the copies have ended, and answers other calls meanwhile (a disk that
answers slowly held every client's calls behind one read). Copies that end that soon are waited
for: parking every call that met them, and running it again, cost more at the tail with a healthy
disk than the wait (docs/measured-figures.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from dflash2.errors import UnknownBlock
from dflash2.keys import key_array
from dflash2.table import BlockState, BlockTable


def settled(method):
    """(A BlockManager method) the drain copies in flight end first, whatever the call touches."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.placement.in_flight:
            self.placement.settle()
        return method(self, *args, **kwargs)
    return call


def any_in_flight(table: BlockTable, rows: np.ndarray | None) -> bool:
    """Whether one of `rows` is MIGRATING (its copy in flight)."""
    return rows is not None and len(rows) > 0 and bool((table.cols.state[rows] == int(BlockState.MIGRATING)).any())


def settle_if(manager, rows: np.ndarray | None = None, placing: bool = False) -> None:
    """Settle `manager`'s drain copies in flight when a call meets them: it does placement work
    (`placing`: makes room, promotes), or one of `rows` is in flight."""
    placement = manager.placement
    if placement.in_flight and (placing or any_in_flight(manager.table, rows)):
        placement.settle()


def rows_a_commit_meets(table: BlockTable, keys: Sequence[int], parent: int | None) -> np.ndarray:
    """Rows a commit of `keys` under `parent` may touch beside its own: the cached twins of its keys
    and the parent. Keys or a parent that the commit will refuse touch nothing (it says why)."""
    try:
        found = np.asarray(table.keys.lookup(key_array(keys)), dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        found = np.zeros(0, dtype=np.int64)
    found = found[found >= 0]
    if parent is not None:
        try:
            found = np.append(found, table.rows([parent]))
        except (UnknownBlock, OverflowError, TypeError, ValueError):
            pass
    return found
