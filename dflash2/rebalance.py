"""The background rebalance: a tier that went over its high watermark drains its cold blocks down to
its low watermark, in pieces, over as many background steps as that takes. A part of Placement (a
mixin over its tiers, watermarks and room-making), apart because the pacing of a drain (its cold cut,
its pieces, its time budget) is a job of its own."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np

from dflash2.drainorder import DrainCut
from dflash2.errors import CopiesRunning
from dflash2.mover import Flight
from dflash2.tiers import Tier
from dflash2.transfer.doorbell import COMPLETIONS

log = logging.getLogger("dflash2.placement")


class Rebalancing:
    """Placement's rebalance (the attributes it uses are Placement's)."""

    # Told of a failure `settle` logs and carries on past (its blocks may be left half moved): the
    # manager notes it, and the daemon checks the tables (daemon/failing.py). None: nobody to tell.
    on_failure: Callable[[BaseException, str], None] | None = None

    # The background rebalance runs at most this long a step (seconds), in pieces of REBALANCE_PIECE
    # of a tier's capacity: draining 10% of a tier in one step (from the high watermark down to the
    # low) held the daemon's loop for seconds when DRAM went down to NVMe, every client's call
    # waiting behind it. A tier that went over its high watermark keeps draining, step after step,
    # until it is down to its low one. The draining tiers share the budget: each, slowest first,
    # gets an equal part of what is left of it, and one piece whatever the time (a call stopped by a
    # request before some tiers' pieces lets those begin the next: `_first_next`). A piece is sized by
    # how fast the tier drained last (`_drain_rate`) to take at most half its part, between
    # REBALANCE_MIN_PIECE and REBALANCE_PIECE of the tier: 1% of a 128 GB DRAM tier is 1.3 GB of
    # NVMe writes, half a second of the loop at 2.3 GB/s; a sixteenth of that, 35 ms. (With every
    # tier full and draining at a million blocks, pieces sized to half the whole budget each took
    # 80-110 ms a step: NVMe's evictions used the budget, and DRAM and HBM then had a piece each.)
    # The floor keeps a drain going where a piece's fixed cost (choosing its blocks: passes over the
    # table) alone outlasts half its part: sized by rate alone, each piece would then be smaller
    # than the last, down to one block a step. A tier's first piece, its rate unknown, is the floor;
    # once a piece left in flight has measured that cost, the floor is no higher than what its copies
    # move meanwhile (`_piece_bytes`).
    REBALANCE_BUDGET_S = 0.05
    # A call is parked on its own copies (CopiesRunning `own`) at most this often: an acquire on the
    # writes that make its room, then on its reads (each run again makes progress: its room is made,
    # its blocks came up); a third time it does its copies at once.
    OWN_PARKS = 2
    REBALANCE_PIECE = 0.01
    REBALANCE_MIN_PIECE = REBALANCE_PIECE / 16
    # How often a drain slice whose piece's copies are still in flight looks whether they have ended
    # (seconds), waiting meanwhile for a request (the server's poll: one that arrives is answered at
    # once). Copies end unseen for up to this long: a millisecond, the poll's resolution.
    FLIGHT_POLL_S = 0.001
    # A call that meets copies not yet ended (a drain piece's, a promotion's reads, the writes its
    # own room takes) waits for them until PARK_AFTER_S after the last of them began, and is parked
    # (CopiesRunning) only if they still run then: copies that end that soon cost the loop less than
    # a parked call run again, whole. A disk that answers slowly holds the loop at most this long a
    # flight: callers of a flight past it are parked at once.
    PARK_AFTER_S = 0.005

    def _init_rebalancing(self) -> None:
        self.draining: set[Tier] = set()  # went over the high watermark, not yet down to the low one
        # The draining tier whose piece comes first in the next `rebalance`: one that the last call,
        # stopped by a request after an earlier tier's piece, did not reach (None: slowest first).
        self._first_next: Tier | None = None
        # Per draining tier, its cold cut when the drain began (rows and their generations), kept
        # in score order for its pieces' selections: the drain moves only those blocks, however
        # many steps it takes.
        self._cuts: dict[Tier, DrainCut] = {}
        # Bytes a second the last rebalance piece of each tier freed (moves and selection): it sizes
        # the next pieces (`_piece_bytes`).
        self._drain_rate: dict[Tier, float] = {}
        # Seconds the last piece of each tier took of the loop with its copies left in flight (choosing
        # its blocks, starting the copies): where the floor is needed at all (`_piece_bytes`).
        self._piece_cost_s: dict[Tier, float] = {}
        # A drain piece between requests (`rebalance(defer=True)`) leaves its copies in flight: the
        # loop answers requests while the disk writes, where it waited for them (about half of a
        # piece of DRAM drained to NVMe: docs/measured-figures.md). `_deferring` is set while such
        # a piece makes room; `_in_flight` holds what ends each piece's copies (`settle`), and
        # `_leaving_bytes` the bytes they take out of each tier. Invariant: no placement work runs while
        # copies are in flight: the next piece settles them first, and so does every BlockManager
        # call that meets them: one that does placement work (makes room, promotes) or touches a
        # block in flight (settling.py), a lookup when it finds a block in flight or would
        # prefetch. Between, the blocks are MIGRATING: readable where they were, pinned, freed or
        # moved by nobody.
        self._deferring = False
        # A drain piece moving blocks down only into the room the tier below has (`_room_below`):
        # no room is made there and nothing is dropped here (`_free_some`, `_move_down`).
        self._into_room_only = False
        # The same holds for a promotion's reads from NVMe while the daemon serves (`read_later`,
        # placement.py `promote_later`): a prefetch's, or an acquire's, which the server parks
        # meanwhile. And while it serves a call (`parking`), a settle that would wait for copies not
        # yet ended raises CopiesRunning (settling.py): the server parks that call instead of
        # holding every client behind the disk.
        self.read_later = False
        self.parking = False
        # ... and how often the call served was parked on its own copies already (CopiesRunning
        # `own`): from OWN_PARKS on it does them at once, so that no call is parked again and again.
        self.own_parks = 0
        # Whether the room being made is a call's own that it may be parked on (`own_writes`): an
        # allocation's, a promotion's; not a reservation's, whose queue changed before its room.
        self._room_parks = False
        self._in_flight: list[tuple[Flight, Callable[[], object]]] = []
        self._leaving_bytes: dict[Tier, int] = {}
        # Seconds `settle_when_done` has spent waiting for copies to end, watching for a request: the
        # loop's idle time, not the drain's (the server does not count it against the step's share).
        self.waited_s = 0.0
        # Seconds `settle` has spent ending copies (waiting for them, landing their blocks): within a
        # call (settling.py), the drain's use of the loop, which the server paces as a piece's.
        self.settled_s = 0.0

    def rebalance(self, budget_s: float | None = None, yield_to: Callable[[float], bool] | None = None,
                  start: bool = True, defer: bool = False) -> None:
        """Bring every tier that went above its high watermark down to its low watermark, moving
        only the blocks cold when it went over (`cold_threshold`: the cut is taken then, once, not
        again over what is left), for at most `budget_s` (REBALANCE_BUDGET_S) this step, shared by
        the draining tiers (the rest in the next steps). Slowest tier first, so that demotions find
        room below; but a call that `yield_to` stopped before some tiers' pieces has the next one
        begin with those (under constant load every call runs one piece: the tiers take turns).
        Blocks awaiting their read (`awaiting_read`) stay: demoting them now would only
        bring them back up for the read. `yield_to(seconds)`: whether a request waits (looking for
        up to that long); asked after each piece, True ends the call there
        (a request waits: the server's idle drain), the rest in the next calls. `start` False: only
        the drains begun already go on (the server's slices between requests: a tier that could not
        drain, its cold cut held or pinned, is not cut again every slice, only at the next step).
        `defer`: the last piece's copies are left in flight (`settle` ends them)."""
        deadline = time.perf_counter() + (self.REBALANCE_BUDGET_S if budget_s is None else budget_s)
        if start:
            self.start_drains()
        order = self._drainable()
        if not order:
            return
        if self._first_next in order:  # the last call stopped for a request before this tier's piece
            at = order.index(self._first_next)
            order = order[at:] + order[:at]
        self._first_next = None
        held = [np.asarray(source(), dtype=np.int64) for source in self.awaiting_read]
        protect = np.concatenate(held) if held else None
        for i, tier in enumerate(order):
            part = max(0.0, deadline - time.perf_counter()) / (len(order) - i)  # its share of what is left
            if self._drain(tier, part, protect, yield_to, defer):
                self.draining.discard(tier)
                del self._cuts[tier]
            if yield_to is not None and yield_to(0.0):
                # The tiers after this one begin the next call: with a request always waiting, each
                # call runs one piece, and the slowest tier would get them all.
                self._first_next = order[i + 1] if i + 1 < len(order) else None
                return

    def start_drains(self) -> None:
        """Begin the drain of each tier that went over its high watermark: its cold cut is taken
        now; its pieces run in `rebalance` calls (the server's loop runs them between requests)."""
        c = self.table.cols
        awaiting = [np.asarray(source(), dtype=np.int64) for source in self.awaiting_read]
        awaiting = np.concatenate(awaiting) if awaiting else np.empty(0, dtype=np.int64)
        if len(awaiting):
            # A drain that spans steps keeps its cut: a block of it that went down and was brought
            # back up for a read (a reader's prefetch) would go down again unread once the step lets
            # go of the list of fresh prefetches (a review). Left out, as from a cut taken now.
            for cut in self._cuts.values():
                cut.exclude(awaiting)
        for tier in self.tiers:
            if tier not in self.draining and self.used_fraction(tier) > self.watermarks[tier].high:
                self.draining.add(tier)
                # Each block ranked by the hottest block under it in the tier (coldcut.py), so the cut
                # holds its cold blocks' descendants there: a block leaves only after those, and a
                # chain written root first is colder at its root under every policy (older, read as
                # often), so a cut of its cold root side alone could never move and the tier stayed
                # above its high watermark. Nor does it take the blocks above a hot one: a chain being
                # written, taken with its cold root side, had the block written last leave first.
                cut = np.flatnonzero(self._cold_mask(tier, self.policy.scores_all(self.table, self.table.clock())))
                # Blocks brought up for a read that has not come yet stay (`awaiting_read`): a prefetch
                # is not a read, so their scores are old and they were in the cut, and the daemon runs
                # the cut's pieces after the step that let go of its list of them: a reader's prefetched
                # chain went back down before it was read (a review).
                self._cuts[tier] = DrainCut(tier, cut, c.gen[cut].copy())
                self._cuts[tier].exclude(awaiting)

    def _drainable(self) -> list[Tier]:
        """The draining tiers whose drain may run now, slowest first. One with a storage tier below it
        that backs off after failed writes waits (keeping its cut) unless the next tier down takes
        writes and has room (`_room_below`): what leaves it would be dropped, or make room below by
        dropping, and a drain, which no request asked for, then turned one failed batch into the loss
        of a tenth of DRAM and those blocks' descendants on NVMe (soak 2). Allocations still make the
        room they need meanwhile (backoff.py)."""
        return [tier for tier in reversed(self.tiers) if tier in self.draining and not self._held(tier)]

    def _room_below(self, tier: Tier) -> int | None:
        """Bytes a drain of `tier` may move down now: None (no cap) while no storage tier below it
        backs off after failed writes. While one does, what the next tier down takes up to its high
        watermark, where it needs no room of its own (making room there would drop its blocks while
        the tier below it backs off); 0 when the next tier down is the one backing off. Before, HBM's
        drain waited out NVMe's back-offs (up to 60 s each, again and again on a full disk) with an
        empty DRAM under it, and HBM stayed over its high watermark (a review's script)."""
        if not self._backing_off_below(tier):
            return None
        below = self.tiers[self.tiers.index(tier) + 1]
        if self.lower(tier) != below:
            return 0
        alloc = self.table.allocators[below]
        room = int(self.watermarks[below].high * alloc.capacity_bytes) - alloc.full_bytes  # (used_fraction's measure)
        # ... and slots of each size the tier holds: a tier below well under its watermark may have
        # every page cut into slots of another size (half of it: sizes share the free pages).
        c = self.table.cols
        sizes = {self.table.layouts[lid].block_bytes for lid in np.unique(c.layout[c.tier == int(tier)]).tolist()}
        for size in sizes:
            room = min(room, alloc.room_for(size) // 2 - size)
        return max(0, room)

    def _held(self, tier: Tier) -> bool:
        """Whether `tier`'s drain waits now (`_room_below`)."""
        return self._room_below(tier) == 0

    def drain_pending(self) -> bool:
        """Whether a drain may run now (`_drainable`), or a piece's copies are in flight: the server's
        loop runs more of it (and settles them) between requests. (Asked after every request: the
        usual answer, nothing draining and nothing in flight, takes no list.)"""
        return bool(self._in_flight) or (bool(self.draining) and bool(self._drainable()))

    def _drain(self, tier: Tier, seconds: float, protect: np.ndarray | None,
               yield_to: Callable[[float], bool] | None = None, defer: bool = False) -> bool:
        """Drain `tier`'s cold cut for about `seconds` (at least one piece). True when it is done:
        down to its low watermark, or its cut used up. `defer`: the last piece's copies are left in
        flight; each piece settles the one before it first."""
        c = self.table.cols
        alloc = self.table.allocators[tier]
        # Down to `low` as the watermarks weigh a tier (used_fraction: used slots and their slabs' page
        # tails). Measured in free bytes, the tails of empty slabs, which go back to the pages only
        # when another size needs them, never came free: a drain of blocks just over a page went on
        # past `low`, to an empty HBM where `low` was under their tails' share (a review).
        low_full = int(self.watermarks[tier].low * alloc.capacity_bytes)
        cut = self._cuts[tier]
        cold = np.zeros(c.capacity, dtype=bool)
        until = time.perf_counter() + seconds
        while True:
            if not self.settle_when_done(yield_to if defer else None, until):
                return False  # a request waits, or the time is up, while the last piece's copies run
            below = self._room_below(tier)
            if below == 0:
                # Its writes failed just now, or the tier below is as full as it may be while the
                # one under it backs off: the drain waits, keeping its cut (_drainable), and drops
                # nothing meanwhile (the piece's next rounds dropped what was to go down: with NVMe
                # on a full disk, DRAM fell from 1.0 to 0.5 over the back-off's retries).
                return False
            free, excess = self.free_bytes(tier), alloc.full_bytes - low_full
            if excess <= 0:
                return True
            piece = self._piece_bytes(tier, seconds / 2)
            if below is not None:
                piece = min(piece, below)  # no more than the tier below takes without making room
            started = time.perf_counter()
            cold.fill(False)  # (a memset: clearing the last piece's rows one by one was a scatter of the cut)
            cold[cut.here(self.table)] = True  # still those blocks, still here
            self._deferring, self._into_room_only = defer, below is not None
            try:
                room = self.make_room(tier, free + min(excess, piece), cold_only=True, cold=cold,
                                      protect=protect, until_backoff=True, cut=cut)
            finally:
                self._deferring = self._into_room_only = False
                cut.forget()
            freed = self.free_bytes(tier) + self._leaving_bytes.get(tier, 0) - free
            if self._held(tier):
                return False
            # No room made means the cut is used up, unless copies are in flight: a chain's parents
            # leave only once its tail, on its way, has landed (the next call settles it first).
            done = (not room and not self._in_flight) or freed >= excess
            now = time.perf_counter()
            if freed > 0:
                self._drain_rate[tier] = freed / max(now - started, 1e-6)
            if defer and self._in_flight:
                self._piece_cost_s[tier] = now - started
            if done or now >= until or self._in_flight or (yield_to is not None and yield_to(0.0)):
                # The rest in the next calls (each draining tier gets a piece a step); one piece a call
                # while its copies run (the next call waits for them, or gives way to a request).
                return done

    @property
    def in_flight(self) -> bool:
        """Whether a drain piece's copies are in flight (`settle` ends them)."""
        return bool(self._in_flight)

    def flights_done(self) -> bool:
        """Whether every copy left in flight has ended (`settle` then waits for nothing)."""
        return all(flight.done() for flight, _ in self._in_flight)

    def settle(self) -> None:
        """End the copies that drain pieces and deferred promotions left in flight, in the order
        they began (waiting for those not done; with `parking`, CopiesRunning where they run past
        PARK_AFTER_S: `end_soon`):
        each block lands where its copy succeeded and stays where it was
        otherwise, as a move that ended at once would have left it. One that fails to end is logged
        and the others still end: the call that settles them is not theirs to fail."""
        if not self._in_flight:
            return  # nothing to end: no wait for a piece's copies (`settled_s`, the server's pacing)
        began = time.perf_counter()  # (a wait within PARK_AFTER_S is the pieces' use of the loop too)
        if self.parking and not self.end_soon():
            raise CopiesRunning()  # (a call the server parks until they have ended: settling.py)
        while self._in_flight:
            _, end = self._in_flight.pop(0)
            try:
                end()
            except Exception as e:
                log.exception("ending a drain piece's copies failed; its blocks stay where the failure left them")
                if self.on_failure is not None:
                    self.on_failure(e, "ending a drain piece's copies")
        self.settled_s += time.perf_counter() - began

    def settle_when_done(self, yield_to: Callable[[float], bool] | None, until: float) -> bool:
        """`settle` once the copies in flight have ended; meanwhile return False as soon as a
        request waits (`yield_to`, which waits up to FLIGHT_POLL_S for one) or `until` (perf_counter)
        has passed, leaving them in flight. A drain between requests so never holds a request
        behind a copy. True once settled (at once when nothing is in flight)."""
        while self._in_flight and not self.flights_done():
            began = time.perf_counter()
            left = until - began
            if left <= 0:
                return False
            if yield_to is None:
                time.sleep(min(left, self.FLIGHT_POLL_S))
                arrived = False
            else:
                arrived = yield_to(min(left, self.FLIGHT_POLL_S))
            self.waited_s += time.perf_counter() - began
            if arrived:
                return False
        self.settle()
        return True

    def _arriving(self):
        """(tier, rows) of each move of the copies in flight: rows on their way into `tier`, whose
        destination slots are taken (the allocator counts them) while they still lie in their
        source tier."""
        for flight, _ in self._in_flight:
            for _, move in flight.prepared:
                yield move.dst, move.rows

    def in_flight_slot_bytes(self) -> dict[Tier, int]:
        """Bytes of the destination slots that the copies in flight hold, by tier (the invariants
        count them as used there while their blocks still lie in their source tier)."""
        held: dict[Tier, int] = {}
        for dst, rows in self._arriving():
            held[dst] = held.get(dst, 0) + int(self.table.slot_sizes(dst)[self.table.cols.layout[rows]].sum())
        return held

    def in_flight_blocks(self) -> dict[Tier, int]:
        """Blocks on their way into each tier by the copies in flight."""
        held: dict[Tier, int] = {}
        for dst, rows in self._arriving():
            held[dst] = held.get(dst, 0) + len(rows)
        return held

    def end_soon(self, flights: list[Flight] | None = None) -> bool:
        """Whether the copies in flight (or `flights`) have ended by PARK_AFTER_S after the last of
        them began, waiting for them until then (`settle` then waits for nothing). The doorbell
        wakes the wait; a ring it took is rung again for the server's poll (parked calls)."""
        pending = [flight for flight, _ in self._in_flight] if flights is None else flights
        if all(flight.done() for flight in pending):
            return True
        began = max((move.started for flight in pending for _, move in flight.prepared), default=0.0)
        deadline = began + self.PARK_AFTER_S
        rang = False
        try:
            while (left := deadline - time.perf_counter()) > 0:
                rang = COMPLETIONS.wait(min(left, self.FLIGHT_POLL_S)) or rang
                if all(flight.done() for flight in pending):
                    return True
            return False
        finally:
            if rang:
                COMPLETIONS.ring()

    def parks_own(self) -> bool:
        """Whether the call being served may be parked on copies of its own (CopiesRunning `own`)."""
        return self.parking and self.read_later and self.own_parks < self.OWN_PARKS

    @contextlib.contextmanager
    def own_writes(self, parks: bool = True):
        """The room made within is the call's own: writes to NVMe it takes (DRAM's room, for HBM's)
        are left in flight and the call is parked on them, where it may be (`parks_own`,
        placement.py `_move_down`). Only around room made before the call changed anything.
        `parks` False: room made within is not the call's to be parked on."""
        before, self._room_parks = self._room_parks, parks
        try:
            yield
        finally:
            self._room_parks = before

    def _leave_in_flight(self, flight: Flight, end: Callable[[], object], n: int) -> np.ndarray:
        """(`_move_down` in a drain piece) keep `flight` for `settle`, which calls `end`; the mask of
        the `n` victims on their way."""
        leaving: dict[Tier, int] = {}
        on_way = np.zeros(n, dtype=bool)
        for part, move in flight.prepared:
            leaving[move.src] = leaving.get(move.src, 0) + move.nbytes
            on_way[part] = True
        for t, nbytes in leaving.items():
            self._leaving_bytes[t] = self._leaving_bytes.get(t, 0) + nbytes

        def landed() -> None:
            for t, nbytes in leaving.items():
                self._leaving_bytes[t] -= nbytes
            end()
        self._in_flight.append((flight, landed))
        return on_way

    def _free_or_leaving(self, tier: Tier, block_bytes: int | None = None) -> int:
        """Free bytes of `tier` (usable by blocks of `block_bytes`); in a drain piece between requests,
        with those its copies in flight will free: its room is made once they are on their way."""
        free = self.free_bytes(tier, block_bytes)
        return free + self._leaving_bytes.get(tier, 0) if self._deferring else free

    def _piece_bytes(self, tier: Tier, seconds: float) -> int:
        """Bytes the next rebalance piece of `tier` frees: what its last piece's rate frees in
        `seconds` (half the tier's part of the step's budget), within REBALANCE_MIN_PIECE and
        REBALANCE_PIECE of the tier (and one byte: at least one block); the floor while no rate is
        known. Nor more than its copies move in `seconds` at the path's measured bandwidth: a piece's
        copies are left in flight, and a call that must settle them waits for what is left of them
        (sized by the loop's time alone, pieces of DRAM drained to NVMe grew to 1% of a 4 GB tier,
        30-40 ms of writes on the H200 host).
        The floor is for a piece whose fixed cost (choosing its blocks: passes over the table) would
        outlast its copies; once a piece left in flight has measured that cost, it is no higher than
        what the copies move meanwhile. Without that, the floor, a share of the tier's bytes, set
        every piece of a large tier of large blocks, however fast they were chosen: about 35 ms of
        NVMe writes a piece of a 128 GB tier, 130 ms of a 512 GB one, that an allocation waited for."""
        capacity = self.table.allocators[tier].capacity_bytes
        least = max(1, int(self.REBALANCE_MIN_PIECE * capacity))
        most = max(least, int(self.REBALANCE_PIECE * capacity))
        rate = self._drain_rate.get(tier)
        piece = least if rate is None else int(rate * seconds)
        lower = self.lower(tier)
        copy = None if lower is None or self.read_cost is None else self.read_cost.bandwidth(tier, lower)
        if copy is not None:
            piece = min(piece, int(copy * seconds))
            cost = self._piece_cost_s.get(tier)
            if cost is not None:
                least = max(1, min(least, int(copy * cost)))
        return max(least, min(most, piece))
