"""When each reservation expires, soonest first (`Expiries`), and Admission's expiries
(`ExpiringReservations`, a mixin): the reservations whose time has come are found by popping a
heap, not by a pass over every reservation granted or waiting.

With 16,000 reservations waiting, each expiring at its own time, a poll that met one expiry took
15.5-16.7 ms (0.3-0.5 at 1,000, the default `admission.max_deferred`'s size; in process on the 2-core
VM): every expiry passed over the queue twice (those due, then the earliest expiry left).
"""

from __future__ import annotations

import heapq
import math

from dflash2.reservations.records import Reservation, credit_stall
from dflash2.reservations.waiting import served_order


class Expiries:
    """A heap of (expires, id, reservation), one entry or more per reservation: pushed when it is
    admitted (granted or queued) and when it is live again (`Admission.give_back`), rebuilt when
    expiries move (a stall's credit) and when entries of ended ones pile up (`_expires`).
    An entry of a reservation that has ended, or whose expiry moved since, is let go when its own
    time comes, never before (a reservation spent, then given blocks back, must keep its entry)."""

    # Entries popped one at a time at most, before the rest of those due are taken in one pass (16,000
    # expiring at once: their pops took a third of the call).
    POP_AT_MOST = 64

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Reservation]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, res: Reservation) -> None:
        heapq.heappush(self._heap, (res.expires, res.id, res))

    def soonest(self) -> float:
        """No reservation expires before this (an entry let go later may make it early: harmless)."""
        return self._heap[0][0] if self._heap else math.inf

    def due(self, now: float) -> list[Reservation]:
        """The reservations whose entries' time has come (expires <= now), each once, their entries
        popped; the caller keeps those still live."""
        out: dict[int, Reservation] = {}
        popped = 0
        while self._heap and self._heap[0][0] <= now:
            if popped == self.POP_AT_MOST:  # many at once: the rest by one pass, then a heap anew
                due = sorted(e for e in self._heap if e[0] <= now)
                self._heap = [e for e in self._heap if e[0] > now]
                heapq.heapify(self._heap)
            else:
                due, popped = [heapq.heappop(self._heap)], popped + 1
            for expires, rid, res in due:
                if res.expires == expires:  # (else moved since: its own entry stands for it)
                    out[rid] = res
        return list(out.values())

    def missing(self, reservations) -> list[int]:
        """The ids of those of `reservations` with no entry at their expiry (the invariant: every
        reservation granted or waiting has one; none may be left never to expire)."""
        entries = {(rid, expires) for expires, rid, _ in self._heap}
        return [r.id for r in reservations if (r.id, r.expires) not in entries]

    def rebuild(self, reservations) -> None:
        """Entries anew for these reservations, their expiries moved (`credit_stall`)."""
        self._heap = [(r.expires, r.id, r) for r in reservations]
        heapq.heapify(self._heap)


class ExpiringReservations:
    """Admission's expiries (a mixin: the attributes it uses are Admission's: `granted`, `deferred`,
    `_ended`, `_expiries`, `_next_expiry`, `settings`, `counters`, `_drop`, `room_freed`)."""

    # Past this many waiting reservations expiring at once, the queue is rebuilt in one pass rather
    # than each taken out (a list removal each).
    REMOVE_ONE_BY_ONE = 64

    def credit_stall(self, stalled_s: float) -> None:
        """The daemon did not run for `stalled_s`: every reservation's TTL, spent ones' too (records.py)."""
        credit_stall(self._live(), stalled_s)
        self._expiries.rebuild(self._live())

    def _live(self) -> tuple[Reservation, ...]:
        """Every reservation that may still expire: granted, waiting, or spent (blocks may come back)."""
        return (*self.granted.values(), *self.deferred, *self._ended.spent.values())

    def _expires(self, res: Reservation) -> None:
        """`res` expires at `res.expires` (an entry in the heap). Entries of reservations that ended
        are let go at their time: past twice the reservations live (and 1,024), the heap is made anew
        from those alone (amortised; with `reservation_ttl_s` up to a day, a steady 100 reserves a
        second would have kept 8.6 million entries)."""
        self._expiries.push(res)
        if len(self._expiries) > 2 * (len(self.granted) + len(self.deferred) + len(self._ended.spent)) + 1024:
            self._expiries.rebuild(self._live())

    def _expire(self, res: Reservation) -> None:
        self._ended.expired(res, self.settings.reservation_ttl_s)  # (before _drop: granted or not)
        self._drop(res)
        self.counters["expired"] += 1

    def _expire_due(self, now: float) -> None:
        """End the reservations whose time is up (granted ones give their blocks back): found by their
        expiries' heap (expiries.py), once the earliest expiry has come (each `reserve` asks). Granted
        ones end in the order they were granted, waiting ones in the queue's."""
        if now < self._next_expiry:
            return
        due = self._expiries.due(now)
        granted = [r for r in due if self.granted.get(r.id) is r]
        if len(granted) > 1:
            order = {rid: k for k, rid in enumerate(self.granted)}
            granted.sort(key=lambda r: order[r.id])
        for res in granted:
            self._expire(res)
        if granted:  # (their slots may be what the head's room lacked beside blocks that could move)
            self.room_freed()
        waiting = [r for r in due if self.deferred.get(r.id) is r]
        if len(waiting) > self.REMOVE_ONE_BY_ONE:
            waiting = self.deferred.remove_due(now)  # (one pass: the same ones, in the queue's order)
        else:
            waiting.sort(key=served_order)
            for res in waiting:
                self.deferred.remove(res)
        self._ended.expired_many(waiting, self.settings.reservation_ttl_s)  # (ends them)
        self.counters["expired"] += len(waiting)
        self._next_expiry = self._expiries.soonest()
