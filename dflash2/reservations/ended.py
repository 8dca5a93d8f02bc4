"""Reservations that have left the queue and the granted set, remembered for a while so that the
next call on one says what became of it, not "unknown, expired or cancelled" (`Admission`):

- spent: granted, every block taken (an engine whose request outgrew its estimate takes once
  more: it is told all were taken, a poll says GRANTED, a cancel has nothing to give back), kept
  until its expiry, SPENT_KEPT at most; in the order they were spent, pruned from the front as
  they come, never scanned (a scan of them all at each call, once the first had expired, cost 25
  times as much per request at 1,000 requests a second: a review's script);
- displaced (pushed out of a full queue by one of higher priority), expired or cancelled: the
  reason kept, for the ENDED_KEPT latest (an expired one answered "unknown, expired or cancelled",
  and its client could not tell whether to reserve again or look for a bug of its own, a review).
"""

from __future__ import annotations

import collections

from dflash2.reservations.records import Reservation

ENDED_KEPT = 4096
SPENT_KEPT = 16384


class Ended:
    def __init__(self):
        self.spent: collections.OrderedDict[int, Reservation] = collections.OrderedDict()
        self._why: collections.OrderedDict[int, str] = collections.OrderedDict()

    def spend(self, res: Reservation, now: float) -> None:
        """`res` has given out its last block."""
        spent = self.spent
        spent[res.id] = res
        while spent and (len(spent) > SPENT_KEPT or next(iter(spent.values())).expires <= now):
            spent.popitem(last=False)

    def find(self, reservation_id: int, now: float) -> Reservation | None:
        """A spent reservation not yet expired (one expired is forgotten: used whole, not counted
        as expired)."""
        res = self.spent.get(reservation_id)
        if res is not None and res.expires <= now:
            del self.spent[reservation_id]
            return None
        return res

    def unspend(self, res: Reservation) -> bool:
        """`res` leaves the spent ones (revived by `give_back`, cancelled, dropped): whether it was one."""
        return self.spent.pop(res.id, None) is not None

    def drop_client(self, client: int) -> None:
        for rid in [rid for rid, r in self.spent.items() if r.client == client]:
            self.spent.pop(rid).ended = True

    def displaced(self, reservation_id: int, why: str) -> None:
        self._why[reservation_id] = why
        while len(self._why) > ENDED_KEPT:
            self._why.popitem(last=False)

    def expired(self, res: Reservation, ttl_s: float) -> None:
        """`res` reached its expiry, granted or waiting: it has ended."""
        res.ended = True
        by = "its client's deadline_s" if res.deadline <= res.expires else f"admission.reservation_ttl_s {ttl_s:g}"
        where = (f"granted, {res.taken} of its {res.blocks} blocks taken" if res.granted
                 else "while it waited in the deferred queue")
        self.displaced(res.id, f"reservation {res.id} expired ({by}), {where}: its room is given back; reserve again")

    def cancelled(self, res: Reservation) -> None:
        self.displaced(res.id, f"reservation {res.id} was cancelled")

    def gone(self, reservation_id: int) -> str:
        """Why a reservation is not there: displaced, or unknown, expired or cancelled."""
        return self._why.get(reservation_id) or f"reservation {reservation_id} is unknown, expired or cancelled"
