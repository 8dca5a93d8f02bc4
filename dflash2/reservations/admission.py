"""The admission queue (`Admission`): the package docstring says how it grants, defers and rejects."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import numpy as np

from dflash2.alloc import blocks_that_fit
from dflash2.errors import NotOwner, QuotaExceeded, ReservationError
from dflash2.invariants import InvariantViolation
from dflash2.placement import Placement
from dflash2.reservations.ended import Ended
from dflash2.reservations.expiries import Expiries, ExpiringReservations
from dflash2.reservations.letgo import RoomLetGo
from dflash2.reservations.loosened import Loosened
from dflash2.reservations.records import AdmissionSettings, Decision, Outcome, Reservation
from dflash2.reservations.roomcount import RoomCount
from dflash2.reservations.shares import ClientShares
from dflash2.reservations.waiting import WaitQueue, served_order
from dflash2.reservations.waits import blocked_reason
from dflash2.table import BlockState, BlockTable
from dflash2.table.columns import NO_CLIENT
from dflash2.tiers import Tier


class Admission(ExpiringReservations, RoomLetGo):
    def __init__(self, table: BlockTable, placement: Placement, settings: AdmissionSettings):
        self.table = table
        self.placement = placement
        self.settings = settings
        self.granted: dict[int, Reservation] = {}
        # Reservations spent (every block taken) or displaced, to say so to their next call (ended.py).
        self._ended = Ended()
        self.deferred = WaitQueue()  # in served order: priority desc, then id (arrival); indexed (waiting.py)
        self._ids = itertools.count(1)
        hbm = table.allocators[Tier.HBM].capacity_bytes
        self._bucket_cap = settings.burst_fraction * hbm
        self._bucket = self._bucket_cap
        self._rate = 0.0  # low-pass filtered demand, bytes/s
        self._last = table.clock()
        # released: ended because its client detached or its lease lapsed
        self.counters = {"granted": 0, "deferred": 0, "rejected": 0, "expired": 0, "cancelled": 0, "released": 0,
                         "displaced": 0}
        self.wait_seconds_total = 0.0
        self.on_wait: Callable[[float], None] | None = None  # observer of each deferred grant's wait (s)
        # What lapsed clients' set-aside blocks hold of a tier, said (BlockManager.set_aside_note; "": none)
        self.set_aside_note: Callable[[Tier], str] = lambda tier: ""
        # What making room could free for a deferred reservation, counted once a step (roomcount.py).
        self.room_count = RoomCount(table, placement, settings)
        self._room_tried: int | None = None  # room last made for it (a new head gets room once: `tick`)
        # The blocks that calls have left able to leave HBM for the head since room was last made
        # for it (`became_movable`, loosened.py), and how often in a row such a retry fell short for it
        # (not the background step's tries: `_try_grant`): each failure doubles what the next retry waits for (a
        # head whose room cannot be made retried on every commit of a block it could preempt, each
        # a scan of the table); the step makes room for the head anyway, once a step.
        self._fails, self._fails_for = 0, None
        self._loosened, self._loosened_for = Loosened(table), None
        # Room that calls have let go of in the tiers below HBM since room was last made for the head
        # (`freed_below`): slots freed there, or blocks left idle there, which the last tier may drop.
        self._below, self._below_for = 0, None
        self.shares = ClientShares(table, settings)  # each client's share of HBM and of the queue
        # No reservation expires before this (`_expire_due`; one that ended since may have set it).
        self._next_expiry = math.inf
        self._expiries = Expiries()  # every reservation's expiry, soonest first (`_expire_due`)

    # -- public ----------------------------------------------------------------------------
    def reserve(self, client: int, layout_id: int, tokens: int, *, priority: int = 0,
                deadline: float | None = None, request: int = 0) -> Decision:
        self.table.client(client)
        layout = self.table.layout(layout_id)
        if tokens <= 0:
            raise ValueError(f"a reservation needs a positive token count, got {tokens}")
        self.table.check_allocation(1, priority, request)  # (here, not at its grant: deferred, at every step)
        # (as a Python int: a 3.0 it takes failed its deferred decision's index after it was queued, an
        # IndexError, and an np.int8 127 wrapped in `movable_bytes`, no running block preemptable, a review)
        priority = int(priority)
        now = self._advance()
        # Room that reservations past their time still hold is free room for this one: they end now,
        # not at the next background step. And the queue goes first: what fits of it by now (the
        # bucket refilled since) is granted ahead of this one.
        self._expire_due(now)
        if self.deferred:
            self.tick(make_room=False)
        blocks = math.ceil(tokens / layout.tokens_per_block)
        need = blocks * self.table.slot_bytes(layout_id, Tier.HBM)
        alloc = self.table.allocators[Tier.HBM]
        hbm = alloc.capacity_bytes
        # Whole slabs of this layout's slots, not bytes: page tails hold no block, so a reservation
        # under the tier's bytes may still never fit, and deferred it would wait at the head of the
        # queue (holding back everything behind it) until it expired.
        fit = blocks_that_fit(hbm, alloc.page_bytes, alloc.alignment, layout.block_bytes)
        if blocks > fit:
            return self._reject(f"needs {need} bytes of HBM ({blocks} blocks); the HBM tier holds {hbm} "
                                f"bytes, {fit} blocks of this layout")
        over = self._over_share(client, need)
        if over:
            return self._reject(over)
        deadline = math.inf if deadline is None else deadline
        expires = min(now + self.settings.reservation_ttl_s, deadline)  # the operator's TTL bounds a client's
        if expires <= now:
            return self._reject("deadline already passed")
        res = Reservation(next(self._ids), client, layout_id, blocks, priority, expires, request, now, need,
                          layout.block_bytes, self.table.slot_bytes(layout_id, Tier.HBM), deadline=deadline)
        self._next_expiry = min(self._next_expiry, expires)
        # Only admitted demand (granted or queued) refills the bucket: a rejected reservation never
        # demotes anything, and counted it would let the next burst demote at once.
        demand = need / self.settings.smoothing_window_s
        if not self.deferred or priority > self.deferred[0].priority:
            if self._try_grant(res):
                self._rate += demand
                self._expires(res)
                return Decision(Outcome.GRANTED, res.id)
        elif self._passes(res, self.deferred.slots_from(priority)):
            self._rate += demand
            self._expires(res)
            return Decision(Outcome.GRANTED, res.id)
        # A full queue (or a client's full share of its places, shares.py) keeps the reservations of
        # higher priority: one of lower priority would be served first while one that would stand
        # ahead of it was turned away (a client's one-block low-priority reservations, filling the
        # queue, shut every interactive request out; an engine's batch backlog, its own).
        places = self.shares.queue_places()
        mine = self.deferred.of_client(client) if places is not None else []
        if places is not None and len(mine) >= places:
            if priority <= mine[-1].priority:  # (its lowest priority, the latest of it)
                return self._reject(f"client has {len(mine)} reservations waiting, its share of the deferred "
                                    f"queue's {self.settings.max_deferred} places (admission.max_client_share "
                                    f"{self.settings.max_client_share}), none of a priority below {priority}")
            self._displace(mine[-1], priority, f"its client's share of the deferred queue's places "
                                               f"(admission.max_client_share {self.settings.max_client_share})")
        if len(self.deferred) >= self.settings.max_deferred:
            last = self.deferred[-1]  # the lowest priority, the latest of it
            if priority <= last.priority:
                return self._reject(f"the deferred queue is full ({self.settings.max_deferred} reservations, "
                                    f"none of a priority below {priority}: admission.max_deferred)")
            self._displace(last, priority, f"the full deferred queue (admission.max_deferred "
                                           f"{self.settings.max_deferred})")
        self.deferred.add(res)
        self._expires(res)  # (admitted: a rejected one kept an entry until its time, a review)
        self._rate += demand
        self.counters["deferred"] += 1
        return self._deferred_decision(res)

    def status(self, reservation_id: int, client: int | None = None) -> Decision:
        """Where a reservation stands now (a deferred one re-reports its position and wait)."""
        res = self.find(reservation_id) if client is None else self._owned(client, reservation_id)
        if res is None:
            raise ReservationError(self._ended.gone(reservation_id, client))
        if res.id in self._ended.spent:
            return Decision(Outcome.GRANTED, reservation_id, f"all {res.blocks} blocks taken")
        if not res.granted:
            # What fits now is granted now, in order: the bucket may have refilled, or copies that
            # made room ended, since the last call. Room is made only for a head it was not yet
            # made for (`tick`): a poll that found the room short again does not scan the table.
            self.tick(make_room=False)
        if res.granted:
            return Decision(Outcome.GRANTED, reservation_id)
        return self._deferred_decision(res)

    def find(self, reservation_id: int) -> Reservation | None:
        """A reservation granted or waiting, by id (None when unknown, expired or cancelled). One
        past its expiry ends here (`_expire`), not at the next step: it was granted, and taken, past
        its deadline (a review: 1 s after a 0.2 s deadline, `policy.rescore_interval_ms` 3000)."""
        res = self.granted.get(reservation_id) or self.deferred.get(reservation_id)
        if res is None:
            return self._ended.find(reservation_id, self.table.clock())
        if res.expires <= self.table.clock():
            self._expire(res)
            return None
        return res

    def take(self, client: int, reservation_id: int, n: int) -> np.ndarray:
        """Hand n of a granted reservation's blocks to its request (RESERVED → WRITING)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"a take hands out at least 1 block, got {n!r}")
        res = self._owned(client, reservation_id)
        if not res.granted:
            raise ReservationError(f"reservation {reservation_id} is deferred, not granted yet")
        if not res.remaining:
            raise ReservationError(f"reservation {reservation_id}: all its {res.blocks} blocks were taken already, "
                                   f"asked for {n} more (reserve again for more)")
        if n > res.remaining:
            raise ReservationError(f"reservation {reservation_id} has {res.remaining} blocks left, asked for {n}")
        vids = res.vids[:n]
        self.table.open_write(client, vids)  # validates before the reservation gives them up
        res.vids = res.vids[n:]
        res.taken += n
        if not res.vids:
            del self.granted[res.id]
            self._ended.spend(res, self.table.clock())
        return np.asarray(vids, dtype=np.int64)

    def give_back(self, res: Reservation, vids: np.ndarray) -> bool:
        """Blocks that `take` handed out of `res` go back to it, first in line to be taken again
        (WRITING → RESERVED): its client gave up waiting on the take and never learned which blocks
        it got. True then; False when the reservation has ended or expired since (the caller frees
        them: nobody will take them)."""
        if res.ended or res.expires <= self.table.clock():
            return False
        self.table.close_write(res.client, vids)
        res.vids = [int(v) for v in vids] + res.vids
        res.taken -= len(vids)
        self._ended.unspend(res)
        self.granted[res.id] = res  # again, if the take had emptied it
        self._next_expiry = min(self._next_expiry, res.expires)
        self._expires(res)  # (its entry may have been let go while it was spent)
        return True

    def cancel(self, client: int, reservation_id: int) -> None:
        res = self._owned(client, reservation_id)
        self._ended.cancelled(res, spent := self._ended.unspend(res))
        if spent:
            res.ended = True
            return  # every block was taken: nothing to give back, and nothing was cancelled
        self._drop(res)
        self.counters["cancelled"] += 1
        self.room_freed()  # (its slots may be what the head's room lacked beside blocks that could move)
        self.tick(make_room=False)  # its slots are free room: nothing to demote for that

    def new_step(self) -> None:
        """The background step: which blocks could move is counted anew (`RoomCount.clear`)."""
        self.room_count.clear()

    def tick(self, make_room: bool = True) -> list[int]:
        """Expire what is due, then grant deferred reservations in order while they fit.
        Returns the ids granted now. `make_room` False: grant only from room already free (after a
        call that freed slots but left no block movable that was not before: making room again
        would scan the whole table for what the last attempt could not move), unless the head is
        one that room was not yet made for (its turn came by this call: a cancel ahead of it)."""
        now = self._advance()
        self._expire_due(now)
        granted = []
        while self.deferred and self._try_grant(self.deferred[0],
                                                make_room or self.deferred[0].id != self._room_tried):
            granted.append(self._leave_queue(self.deferred[0], now))
        # Then, behind a head that waits, the first waiting reservation of each other slot size may
        # pass it, and those ahead of it, on room free now that is none of theirs (`_passes`); those
        # of one slot size keep their order: each size's line is tried from its first until one
        # does not pass, the lines' firsts in served order (a heap of them; before, a walk of the
        # queue, its length in Python steps for every free, cancel and poll: waiting.py).
        if self.deferred and self.deferred.slot_count() > 1:  # (one size: no pass)
            head = self.deferred[0].slot
            firsts = [(served_order(r), r.slot) for r in self.deferred.firsts() if r.slot != head]
            heapq.heapify(firsts)
            while firsts:
                slot = heapq.heappop(firsts)[1]
                res = self.deferred.line(slot)[0]
                if self._passes(res, {head}):  # (ahead of it: the head's size at least, never its own)
                    granted.append(self._leave_queue(res, now))
                    if line := self.deferred.line(slot):
                        heapq.heappush(firsts, (served_order(line[0]), slot))
        return granted

    def _leave_queue(self, res: Reservation, now: float) -> int:
        """`res`, waiting, was granted: out of the queue, its wait counted. Its id."""
        self.deferred.remove(res)
        self.wait_seconds_total += now - res.created
        if self.on_wait is not None:
            self.on_wait(now - res.created)
        return res.id

    def may_make_room(self) -> bool:
        """Whether `tick(make_room=False)` may make room now: only for a head not yet given room."""
        return bool(self.deferred) and self.deferred[0].id != self._room_tried

    def became_movable(self, rows: np.ndarray) -> bool:
        """A call (a commit, a release) has just left `rows` movable for the head of the queue: idle,
        or, with preemption and a tier below HBM, a running request's of lower priority. Room was
        made for that head already and fell short (a poll does not make it again: that would scan
        the whole table on every poll); once such blocks of its size cover what it is short now
        (room freed since counts), twice that after each retry that fell short too, room
        is made for it again at the next `tick`: True, and the caller ticks. Before, a priority-5
        reservation waited for the background step after the blocks it could preempt were
        committed (2.7 s with `policy.rescore_interval_ms` 3000, a review's script)."""
        head = self._tried_head()
        if head is None or not len(rows):
            return False
        c = self.table.cols
        rows = rows[(c.tier[rows] == int(Tier.HBM)) & (c.state[rows] == int(BlockState.RESIDENT))
                    & (c.pins[rows] == 0)]
        if not len(rows):
            return False
        below = self.placement.lower(Tier.HBM) is not None
        rows = rows[self._may_leave(rows, head, below)]
        if not len(rows):
            return False
        if self._loosened_for != head.id:
            self._loosened.clear()
            self._loosened_for = head.id
        slot = self.table.slot_bytes(head.layout_id, Tier.HBM)
        want = -(-self._bar(head, head.hbm_bytes - self._room(head)) // slot)  # (as of now: frees since count)
        # Those that can leave now, counted up each chain from its leaves (loosened.py).
        if self._loosened.count(rows, slot, want, lambda r: self._may_leave(r, head, below)) < want:
            return False
        return self._try_again()

    def _may_leave(self, rows: np.ndarray, head: Reservation, below: bool) -> np.ndarray:
        """Mask over `rows` (resident in HBM, unpinned): idle, as `movable` takes them, or, with
        preemption and a tier below HBM, a running request's of lower priority than the head."""
        c = self.table.cols
        ok = (c.refs[rows] == 0) & ((c.owner[rows] == NO_CLIENT) | below)
        if self.settings.preemption and below:
            ok |= c.priority[rows] < head.priority
        return ok

    def remove_client(self, client: int) -> int:
        """The client is gone: its reservations die with it. Returns how many."""
        self._ended.drop_client(client)
        self.shares.drop(client)
        mine = [r for r in self.granted.values() if r.client == client]
        mine += self.deferred.of_client(client)  # (a new list: dropping them changes the line)
        for res in mine:
            self._drop(res)
        self.counters["released"] += len(mine)
        return len(mine)

    def snapshot(self) -> dict:
        return {"granted": len(self.granted), "deferred": len(self.deferred),
                "reserved_blocks": sum(r.remaining for r in self.granted.values()),
                "bucket_bytes": self._bucket, "demand_rate_bps": self._rate, **{f"total_{k}": v for k, v in self.counters.items()}}

    # -- internals -------------------------------------------------------------------------
    def _advance(self) -> float:
        now = self.table.clock()
        dt = max(0.0, now - self._last)
        self._last = now
        decay = math.exp(-dt / self.settings.smoothing_window_s)
        # Refill at the filtered demand rate (integrated over dt), then let the rate decay.
        self._bucket = min(self._bucket_cap_now(), self._bucket + self._refill_rate() * dt)
        self._rate *= decay
        return now

    def _refill_rate(self) -> float:
        """Bytes/s the bucket refills at: the filtered demand rate, and while reservations wait at least
        the cap (the head's bytes, or the burst) per smoothing window. Liveness: the demand that queued
        them decays, and what it paid in while the head waited on something other than the bucket (a
        writer's blocks) was cut at the cap, so without the floor a deferred reservation could wait
        forever although demoting idle blocks would make its room."""
        if not self.deferred:
            return self._rate
        return max(self._rate, self._bucket_cap_now() / self.settings.smoothing_window_s)

    def _bucket_cap_now(self) -> float:
        head = self.deferred[0].hbm_bytes if self.deferred else 0
        return max(self._bucket_cap, head)

    def _try_grant(self, res: Reservation, make_room: bool = True) -> bool:
        need = res.hbm_bytes
        short = need - self._room(res)
        if short > 0:
            if short > self._bucket or not make_room:
                return False
            before = self._room(res)
            retry = self._room_tried is None  # (the retry `became_movable` asked for)
            self._room_tried = res.id
            if self.room_count.could_make_room(res, need):  # (else nothing is moved: roomcount.py)
                self._make_room(res, need, before + int(self._bucket))
            after = self._room(res)
            self._bucket -= max(0, after - before)
            self._loosened.clear()
            self._below = 0
            self.room_count.clear()  # room-making moved blocks: the count of what could move is stale
            if after < need:  # fell short: the next retry for this head waits for twice as much
                # Only a retry that fell short raises the bar, not the background step's tries: they
                # doubled it each step, and after a few a release of every block the head could use
                # asked for more than HBM holds, so the grant waited for the next step (a review).
                if self._fails_for != res.id:
                    self._fails, self._fails_for = 0, res.id
                elif retry:
                    self._fails += 1
        vids = self._allocate(res)
        if vids is None:
            return False
        self._granted(res, vids)
        return True

    def _allocate(self, res: Reservation, in_used_slabs: bool = False) -> np.ndarray | None:
        return self.table.allocate(res.client, res.layout_id, res.blocks, tier=Tier.HBM, request=res.request,
                                   priority=res.priority, state=BlockState.RESERVED, in_used_slabs=in_used_slabs)

    def _granted(self, res: Reservation, vids: np.ndarray) -> None:
        self.placement.policy.on_insert(self.table, self.table.rows(vids), self.table.clock())
        res.vids = vids.tolist()
        res.granted = True
        self.granted[res.id] = res
        self.counters["granted"] += 1

    def _passes(self, res: Reservation, ahead: set[int]) -> bool:
        """Grant `res` out of its turn, before the reservations waiting ahead of it (`ahead`: their
        HBM slot sizes): only when none of them is of its slot size (those of one slot size keep
        their order; layouts of different block bytes may share a slot), and only from room that
        is none of theirs now: free slots of its own size in slabs already in use (nothing is moved
        for it, and no free page or empty slab, which they could use, is taken). Before, it waited
        behind a head of another size that waited on blocks being written, until that head was
        granted or expired (up to `reservation_ttl_s`), while an `allocate` of the same blocks
        passed (a review's script). An allocation still passes whatever it takes (`held_ahead`)."""
        if not ahead or res.slot in ahead:
            return False
        vids = self._allocate(res, in_used_slabs=True)
        if vids is None:
            return False
        self._granted(res, vids)
        return True

    def _room(self, res: Reservation) -> int:
        """HBM bytes that this reservation's blocks could take now (slots of their size)."""
        return self.placement.free_bytes(Tier.HBM, res.block_bytes)

    def _make_room(self, res: Reservation, need: int, most: int) -> None:
        """Room for `res` (`need` bytes of HBM), `most` at most (what the bucket pays for)."""
        size = res.block_bytes
        # Idle blocks first (nobody references them), whatever their writer's priority, a swap
        # batch at a time (`room_batch`) as far as the bucket pays for it: the next reservations
        # find that room made.
        batch = self.placement.room_batch(Tier.HBM, need, self.table.slot_bytes(res.layout_id, Tier.HBM),
                                          share=True)
        self.placement.make_room(Tier.HBM, max(need, min(batch, most)), idle_only=True, block_bytes=size)
        if self.settings.preemption and self._room(res) < need:
            # Preemption: running requests of strictly lower priority give up their unpinned blocks,
            # those of its own slot size first: a block of another size leaves a slot these cannot
            # use unless the rest of its page leaves too (a priority-5 reservation of 16 KiB blocks
            # demoted 48 running blocks, 32 of them 8 KiB blocks whose page-mates stayed, where 16
            # would do; a review's script). Running blocks are never dropped, so the first pass
            # only moves; the others go when those of its size do not make the room.
            others = self._other_sizes(size)
            if others is not None:
                self.placement.make_room(Tier.HBM, need, below_priority=res.priority, block_bytes=size,
                                         protect=others)
            if self._room(res) < need:
                self.placement.make_room(Tier.HBM, need, below_priority=res.priority, block_bytes=size)

    def _other_sizes(self, block_bytes: int) -> np.ndarray | None:
        """Rows in HBM whose slots are not of the size blocks of `block_bytes` take there (None when
        every layout's blocks take that size)."""
        table = self.table
        slots = table.slot_sizes(Tier.HBM)
        slot = table.allocators[Tier.HBM].slot_for(block_bytes)
        if (slots == slot).all():
            return None
        c = table.cols
        return np.flatnonzero((c.tier == int(Tier.HBM)) & (slots[c.layout] != slot))

    def _deferred_decision(self, res: Reservation) -> Decision:
        pos, ahead = self.deferred.position(res)
        room = self._room(res)
        # Demoting cannot make the room: it waits on blocks that cannot move now, on granted
        # reservations' room, or on the reservations ahead of it, each said as such (waits.py).
        why = None
        if ahead > room:  # (movable bytes only asked for when free room falls short)
            movable = room + self.room_count.movable_bytes(res)
            why = blocked_reason(pos, res.hbm_bytes, ahead, movable, self.granted.values(),
                                 self.settings.reservation_ttl_s, res.client,
                                 # (a pass over the table, asked only where it may change the reason: its own
                                 # bytes beyond that room; behind the queue alone, at every poll, a review)
                                 self.room_count.untaken_here(res, movable, self.granted.values())
                                 if res.hbm_bytes > movable else None, self.room_count.preempts_below(res),
                                 lambda: self.set_aside_note(Tier.HBM))
        if why is not None:
            return Decision(Outcome.DEFERRED, res.id, why, position=pos, est_wait_s=None)
        short = ahead - room - self._bucket
        wait = 0.0 if short <= 0 else self._refill_time(short)
        return Decision(Outcome.DEFERRED, res.id, "not enough HBM free yet", position=pos, est_wait_s=wait)

    def _refill_time(self, amount: float) -> float:
        """Seconds until the bucket has taken in `amount` bytes more while the queue waits, with no new
        demand: the demand rate decays as `_advance` lets it, down to the floor of `_refill_rate`.
        At the rate of the moment, the last of a burst were told a fraction of their wait (half, 10
        deep behind a burst of 12, a review's script)."""
        tau = self.settings.smoothing_window_s
        floor = self._bucket_cap_now() / tau
        r0 = self._rate
        if r0 <= floor:
            return amount / floor
        early = tau * (r0 - floor)  # taken in while the rate decays to the floor
        if amount <= early:
            return -tau * math.log1p(-amount / (r0 * tau))
        return tau * math.log(r0 / floor) + (amount - early) / floor

    def check_invariants(self) -> None:
        """The queue is in order (priority desc, then arrival) and indexed by id; no reservation is
        both granted and waiting; each waiting one's block size is its layout's."""
        problems = self.deferred.problems()
        if missing := self._expiries.missing((*self.granted.values(), *self.deferred)):
            problems.append(f"reservations {missing[:8]} have no expiry entry: they would never expire")
        if any(r.id in self.granted for r in self.deferred):
            problems.append("a reservation is both granted and waiting")
        if any(r.block_bytes != self.table.layout(r.layout_id).block_bytes for r in self.deferred):
            problems.append("a waiting reservation's block size is not its layout's")
        if problems:
            raise InvariantViolation("; ".join(problems))

    def _displace(self, res: Reservation, priority: int, where: str) -> None:
        """`res` leaves the queue for one of `priority`, above its own: its next call says so."""
        self._drop(res)
        # An ending, as expired and cancelled are: counted rejected too, a displaced reservation was two
        # decisions of one call (3,010 reserves read 1,034 deferred and 1,986 rejected, a review).
        self.counters["displaced"] += 1
        self._ended.displaced(res, f"reservation {res.id} was displaced from {where} by one of priority "
                                   f"{priority}, above its {res.priority}: reserve again")

    def _reject(self, reason: str) -> Decision:
        self.counters["rejected"] += 1
        return Decision(Outcome.REJECTED, None, reason)

    def _owned(self, client: int, reservation_id: int) -> Reservation:
        res = self.find(reservation_id)
        if res is None:
            raise ReservationError(self._ended.gone(reservation_id, client))
        if res.client != client:
            raise NotOwner(f"reservation {reservation_id} belongs to another client")
        return res

    def _drop(self, res: Reservation) -> None:
        res.ended = True
        self._ended.unspend(res)
        if res.granted:
            self.granted.pop(res.id, None)
            if res.vids and res.client in self.table.clients:
                self.table.free(res.client, res.vids)  # RESERVED → FREE
            res.vids = []
        elif res.id in self.deferred:
            self.deferred.remove(res)

    def held_ahead(self, priority: int, client: int | None, slot: int) -> tuple[int, int]:
        """(How many reservations wait at `priority` or above that an allocation outside any reservation
        leaves room to, their HBM bytes): not `client`'s, only of `slot`-byte HBM slots; those past
        their time end first. Tallied as reservations join and leave (waiting.py): summed over the
        reservations ahead, 1.7-3.7 ms an allocate with 16,000 waiting."""
        self._expire_due(self.table.clock())
        return self.deferred.held_ahead(priority, slot, client)

    def check_share(self, client: int, need: int) -> None:
        """QuotaExceeded when `need` more bytes take the client past `max_client_share` (an allocate
        outside any reservation: reserve refuses the same as REJECTED)."""
        if over := self._over_share(client, need):
            raise QuotaExceeded(f"{over} (admission.max_client_share)")

    def _over_share(self, client: int, need: int) -> str:
        """Why `need` more bytes would take the client past its share of HBM, or "" (shares.py); its
        queued reservations count too (each within the share alone, together granted past it)."""
        if not self.shares.limited:
            return ""
        return self.shares.over(client, need, self.deferred.client_bytes(client))
