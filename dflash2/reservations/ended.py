"""Reservations that have left the queue and the granted set, remembered for a while so that the
next call on one says what became of it, not "unknown, expired or cancelled" (`Admission`):

- spent: granted, every block taken (an engine whose request outgrew its estimate takes once
  more: it is told all were taken, a poll says GRANTED, a cancel has nothing to give back), kept
  until its expiry, SPENT_KEPT at most; in the order they were spent, pruned from the front as
  they come, never scanned (a scan of them all at each call, once the first had expired, cost 25
  times as much per request at 1,000 requests a second: a review's script);
- displaced (pushed out of a full queue, or of its client's share of its places, by one of higher
  priority), expired or cancelled: the
  reason kept, for the ENDED_KEPT latest (an expired one answered "unknown, expired or cancelled",
  and its client could not tell whether to reserve again or look for a bug of its own, a review),
  told to its own client only (another, asking ids in turn, learned of others' requests, a review).
  Cancels are kept apart from the others, ENDED_KEPT each: a client that cancels thousands a
  second pushed out, within a second, the reasons of reservations the daemon ended by itself
  (displaced, expired), which are the ones a client cannot know unless told.
"""

from __future__ import annotations

import collections

from dflash2.reservations.records import Reservation

ENDED_KEPT = 4096
SPENT_KEPT = 16384


class Ended:
    def __init__(self):
        self.spent: collections.OrderedDict[int, Reservation] = collections.OrderedDict()
        self._why: collections.OrderedDict[int, tuple[int, str]] = collections.OrderedDict()  # id -> (client, why)
        # id -> (client, spent: cancelled after its every block was taken)
        self._cancelled: collections.OrderedDict[int, tuple[int, bool]] = collections.OrderedDict()

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

    def displaced(self, res: Reservation, why: str) -> None:
        self._why[res.id] = (res.client, why)
        while len(self._why) > ENDED_KEPT:
            self._why.popitem(last=False)

    def expired(self, res: Reservation, ttl_s: float) -> None:
        """`res` reached its expiry, granted or waiting: it has ended."""
        res.ended = True
        by = "its client's deadline_s" if res.deadline <= res.expires else f"admission.reservation_ttl_s {ttl_s:g}"
        where = (f"granted, {res.taken} of its {res.blocks} blocks taken" if res.granted
                 else "while it waited in the deferred queue")
        self.displaced(res, f"reservation {res.id} expired ({by}), {where}: its room is given back; reserve again")

    def expired_many(self, reservations: list[Reservation], ttl_s: float) -> None:
        """`expired` of each, in order; the reasons of those the last ENDED_KEPT push out at once are
        not written (36,000 waiting reservations expiring together held a daemon's loop 320 ms, most
        of it writing reasons kept for a moment, a review)."""
        skip = max(0, len(reservations) - ENDED_KEPT)
        for res in reservations[:skip]:
            res.ended = True
        for res in reservations[skip:]:
            self.expired(res, ttl_s)

    def cancelled(self, res: Reservation, spent: bool = False) -> None:
        """`res` was cancelled by its client; `spent`: after it had given out its every block (said so
        after: told "was cancelled", its client could think its blocks given back)."""
        self._cancelled[res.id] = (res.client, spent)
        while len(self._cancelled) > ENDED_KEPT:
            self._cancelled.popitem(last=False)

    def gone(self, reservation_id: int, client: int | None) -> str:
        """Why a reservation is not there, to `client` (None: the daemon itself): how it ended, to
        its own client; else unknown, expired or cancelled."""
        owner, why = self._why.get(reservation_id, (None, None))
        if why is None and reservation_id in self._cancelled:
            owner, spent = self._cancelled[reservation_id]
            why = f"reservation {reservation_id} was cancelled" + (
                " after every block was taken (nothing to give back: its blocks are the client's)" if spent else "")
        if why is not None and client in (None, owner):
            return why
        return f"reservation {reservation_id} is unknown, expired or cancelled"
