"""Where each waiting reservation stands in the queue, and the HBM bytes of those up to it.

A deferred decision (each poll of a waiting reservation, each reserve that waits) says its position
and estimates its wait from the bytes ahead of it: found by a scan of the queue each time, a round of
polls of 4,000 waiting reservations cost 549 ms of the daemon's loop, 16,000 of them 8.3 s (a
review's in-process figures). Worked out once per change of the queue instead, and looked up.
"""

from __future__ import annotations

import itertools


class QueuePositions:
    def __init__(self) -> None:
        self._version = 0  # bumped at every change of the queue (`changed`)
        self._at = -1  # the version the tables below are of
        self._where: dict[int, int] = {}  # reservation id -> its index in the queue
        self._upto: list[int] = []  # index -> HBM bytes of the reservations up to and with it

    def changed(self) -> None:
        """A reservation joined or left the queue."""
        self._version += 1

    def of(self, queue: list, res) -> tuple[int, int]:
        """(`res`'s index in `queue`, the HBM bytes of the reservations up to and with it)."""
        if self._at != self._version:
            self._where = {r.id: i for i, r in enumerate(queue)}
            self._upto = list(itertools.accumulate(r.hbm_bytes for r in queue))
            self._at = self._version
        pos = self._where[res.id]
        return pos, self._upto[pos]
