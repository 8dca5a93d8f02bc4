"""The deferred queue (`WaitQueue`): the reservations waiting for HBM, in the order they are served
(priority, highest first, then arrival), with what admission asks of it kept as it changes, not
found by a scan of the queue.

A review's in-process figures (2026-12-05, the 2-core VM) with Q reservations waiting: a deferred
`reserve` cost 87 / 293 / 1,187 us at Q = 1,000 / 4,000 / 16,000 (the set of slot sizes waiting at
its priority or above, built over the whole queue), and with reservations of two HBM slot sizes
waiting, the rarer one near the back, every `free`, `cancel`, poll and detach walked the queue to
find it (`Admission.tick`'s passes): a one-block free 195 / 544 / 1,765 us against about 85 with one
size. Here each slot size's waiting reservations form a line of their own (the first of each is the
one a pass tries), each client's too (its share of the places and of HBM), and the position of a
waiting one is found by a search of the ordered queue.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Iterator

from dflash2.reservations.records import Reservation


def served_order(res: Reservation) -> tuple[int, int]:
    """Where `res` stands: priority, highest first, then arrival (ids grow)."""
    return -res.priority, res.id


class WaitQueue:
    """Reservations waiting, in served order (`served_order`; a reservation's priority and id never
    change while it waits). Invariants (`problems`): each index below holds exactly the queue's
    reservations, each in served order."""

    def __init__(self) -> None:
        self._queue: list[Reservation] = []
        self._bytes: list[int] = []  # each one's HBM bytes, in the queue's order
        self._by_id: dict[int, Reservation] = {}
        self._lines: dict[int, list[Reservation]] = {}  # by HBM slot size
        self._mine: dict[int, list[Reservation]] = {}  # by client
        self._mine_bytes: collections.Counter[int] = collections.Counter()  # by client: HBM bytes
        self._sums = RunningSums()  # of _bytes: the bytes up to each (`position`)
        # [count, HBM bytes] of those waiting, by slot size and priority, and by client, slot size
        # and priority (`held_ahead`: what an allocation leaves room to).
        self._tally: dict[int, dict[int, list[int]]] = {}
        self._client_tally: dict[int, dict[tuple[int, int], list[int]]] = {}

    # -- the queue as a sequence ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Reservation]:
        return iter(self._queue)

    def __getitem__(self, i: int) -> Reservation:
        return self._queue[i]

    def get(self, reservation_id: int) -> Reservation | None:
        return self._by_id.get(reservation_id)

    def __contains__(self, reservation_id: int) -> bool:
        return reservation_id in self._by_id

    # -- changes -------------------------------------------------------------------------------
    def add(self, res: Reservation) -> None:
        if res.id in self._by_id:
            raise ValueError(f"reservation {res.id} is waiting already")
        i = bisect.bisect_left(self._queue, served_order(res), key=served_order)
        self._queue.insert(i, res)
        self._bytes.insert(i, res.hbm_bytes)
        self._by_id[res.id] = res
        bisect.insort(self._lines.setdefault(res.slot, []), res, key=served_order)
        bisect.insort(self._mine.setdefault(res.client, []), res, key=served_order)
        self._mine_bytes[res.client] += res.hbm_bytes
        self._count(res, 1)
        if i == len(self._queue) - 1:  # (at the back, as most join: the sums hold)
            self._sums.append(res.hbm_bytes)
        else:
            self._sums.stale()

    def remove(self, res: Reservation) -> None:
        i = self.index(res)
        del self._queue[i]
        del self._bytes[i]
        del self._by_id[res.id]
        _take_out(self._lines, res.slot, res)
        _take_out(self._mine, res.client, res)
        self._mine_bytes[res.client] -= res.hbm_bytes
        if not self._mine_bytes[res.client]:
            del self._mine_bytes[res.client]
        self._count(res, -1)
        if i == 0:  # (the head granted: the sums hold)
            self._sums.pop_front()
        elif i == len(self._queue):  # (the last, cancelled)
            self._sums.pop_back()
        else:
            self._sums.stale()

    def remove_due(self, now: float) -> list[Reservation]:
        """Those whose time is up (expires <= now) leave; returned in served order. One pass over
        each index (many may end at once: one removal each would move the lists each time)."""
        due = [r for r in self._queue if r.expires <= now]
        if not due:
            return due
        self._queue = [r for r in self._queue if r.expires > now]
        self._bytes = [r.hbm_bytes for r in self._queue]
        # Each index's entries taken out by key, not a reservation at a time (16,000 expiring at once:
        # 57 ms one at a time against 27-33 for the scans before the indexes).
        gone: collections.Counter = collections.Counter()
        for res in due:
            del self._by_id[res.id]
            gone[res.client, res.slot, res.priority, res.hbm_bytes] += 1
        for (client, slot, priority, nbytes), n in gone.items():
            self._mine_bytes[client] -= n * nbytes
            if not self._mine_bytes[client]:
                del self._mine_bytes[client]
            self._count_n(client, slot, priority, -n, -n * nbytes)
        for index in (self._lines, self._mine):
            for key in list(index):
                if stay := [r for r in index[key] if r.expires > now]:
                    index[key] = stay
                else:
                    del index[key]
        self._sums.stale()
        return due

    def _count(self, res: Reservation, sign: int) -> None:
        self._count_n(res.client, res.slot, res.priority, sign, sign * res.hbm_bytes)

    def _count_n(self, client: int, slot: int, priority: int, n: int, nbytes: int) -> None:
        """`n` reservations (`nbytes` of HBM) of `client`'s at `slot` and `priority` joined (n < 0: left)."""
        for index, outer, inner in ((self._tally, slot, priority), (self._client_tally, client, (slot, priority))):
            tally = index.setdefault(outer, {}).setdefault(inner, [0, 0])
            tally[0] += n
            tally[1] += nbytes
            if not tally[0]:
                del index[outer][inner]
                if not index[outer]:
                    del index[outer]

    # -- what admission asks -------------------------------------------------------------------
    def index(self, res: Reservation) -> int:
        """`res`'s place in the queue (0: next in line); KeyError when it does not wait."""
        return _place(self._queue, res)

    def position(self, res: Reservation) -> tuple[int, int]:
        """(`res`'s place, the HBM bytes of the reservations up to and with it). The running sums are
        kept across the common changes, else worked out again once per change (`RunningSums`)."""
        i = self.index(res)
        return i, self._sums.upto(i, self._bytes)

    def slot_count(self) -> int:
        """How many HBM slot sizes wait."""
        return len(self._lines)

    def line(self, slot: int) -> list[Reservation]:
        """Those of `slot`-byte HBM slots, in served order (the caller does not change it)."""
        return self._lines.get(slot, [])

    def firsts(self) -> list[Reservation]:
        """The first waiting reservation of each slot size, in served order."""
        return sorted((line[0] for line in self._lines.values()), key=served_order)

    def slots_from(self, priority: int) -> set[int]:
        """The slot sizes of the reservations waiting at `priority` or above."""
        return {slot for slot, line in self._lines.items() if line[0].priority >= priority}

    def held_ahead(self, priority: int, slot: int, client: int | None = None) -> tuple[int, int]:
        """(how many wait at `priority` or above in `slot`-byte HBM slots, not `client`'s; their HBM
        bytes): a sum over the priorities waiting, not over the reservations."""
        n = held = 0
        for p, (k, b) in self._tally.get(slot, {}).items():
            if p >= priority:
                n, held = n + k, held + b
        for (s, p), (k, b) in self._client_tally.get(client, {}).items():
            if s == slot and p >= priority:
                n, held = n - k, held - b
        return n, held

    def of_client(self, client: int) -> list[Reservation]:
        """`client`'s waiting reservations, in served order (the caller does not change it)."""
        return self._mine.get(client, [])

    def client_bytes(self, client: int) -> int:
        """The HBM bytes of `client`'s waiting reservations."""
        return self._mine_bytes.get(client, 0)

    def problems(self) -> list[str]:
        """What breaks the invariants (none: an empty list): each index is checked against those of a
        queue made anew, by `add`, of the same reservations."""
        out = []
        order = [served_order(r) for r in self._queue]
        if order != sorted(order):
            out.append("the deferred queue is out of order")
        fresh = WaitQueue()
        try:
            for res in self._queue:
                fresh.add(res)
        except ValueError as e:
            return [*out, f"the deferred queue holds a reservation twice: {e}"]
        for name in ("_by_id", "_bytes", "_lines", "_mine", "_mine_bytes", "_tally", "_client_tally"):
            if getattr(self, name) != getattr(fresh, name):
                out.append(f"the deferred queue's index {name} does not match the queue")
        if self._sums.kept(self._bytes) not in (None, list(itertools.accumulate(self._bytes))):
            out.append("the deferred queue's running sums of bytes do not match the queue")
        return out


def _place(line: list[Reservation], res: Reservation) -> int:
    """Where `res` stands in `line` (in served order); KeyError where it is not there."""
    i = bisect.bisect_left(line, served_order(res), key=served_order)
    if i == len(line) or line[i] is not res:
        raise KeyError(f"reservation {res.id} is not waiting")
    return i


def _take_out(index: dict[int, list[Reservation]], key: int, res: Reservation) -> None:
    line = index[key]
    del line[_place(line, res)]
    if not line:
        del index[key]


class RunningSums:
    """The bytes of the queue's reservations up to and with each, kept across the changes most
    frequent (one joining at the back, the head granted, the last cancelled); after any other
    change worked out again, in C, at the next ask (a round of polls reads them). Stored absolute
    (`_sums`, from an origin `_head` entries before the queue's head), so that the head leaves
    without a pass over the rest. Invariant: when not stale, len(_sums) - _head is the queue's length."""

    COMPACT = 4096  # entries left before the head that are dropped at once (amortised)

    def __init__(self) -> None:
        self._sums: list[int] | None = []
        self._head = 0

    def stale(self) -> None:
        self._sums = None

    def append(self, nbytes: int) -> None:
        if self._sums is not None:
            self._sums.append((self._sums[-1] if self._sums else 0) + nbytes)

    def pop_back(self) -> None:
        if self._sums is not None:
            self._sums.pop()

    def pop_front(self) -> None:
        if self._sums is None:
            return
        self._head += 1
        if self._head >= self.COMPACT and 2 * self._head >= len(self._sums):
            base = self._sums[self._head - 1]
            self._sums = [v - base for v in self._sums[self._head:]]
            self._head = 0

    def upto(self, i: int, nbytes: list[int]) -> int:
        """The bytes up to and with the i-th of the queue, whose bytes are `nbytes`."""
        if self._sums is None:
            self._sums, self._head = list(itertools.accumulate(nbytes)), 0
        base = self._sums[self._head - 1] if self._head else 0
        return self._sums[self._head + i] - base

    def kept(self, nbytes: list[int]) -> list[int] | None:
        """The sums as kept, from the queue's head (None when stale; for the invariant check)."""
        if self._sums is None:
            return None
        return [self.upto(i, nbytes) for i in range(len(self._sums) - self._head)]
