"""The block manager: the one object the daemon wraps.

It composes the metadata-only core (block table, slot allocators, policy, placement, admission) with
the memory (tier arenas) and the copies (a transfer backend). Without arenas it runs metadata only:
the policy replay and the table bench use it that way, and so do most tests.

    config ─▶ BlockManager ─┬─ BlockTable ── SlotAllocator per tier
                            ├─ Placement ── Policy (by name) ── Mover ── TransferBackend ── Arenas
                            └─ Admission (reservations)

Its reads (lookups, acquires, the prefetch that follows them) are in reads.py, and what a refused
allocate is told in allocrefusal.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from dflash2 import stopsignals
from dflash2.access import AccessStats
from dflash2.allocrefusal import AllocateRefusals
from dflash2.alloc import SlotAllocator
from dflash2.arena.base import Arena, MemoryArena, StorageArena
from dflash2.errors import ArenaError, CopiesRunning, LayoutError
from dflash2.invariants import check_invariants
from dflash2.layout import Layout
from dflash2.mover import Mover
from dflash2.placement import Placement, Watermark
from dflash2.policy import Policy, make_policy
from dflash2.prefetch import Prefetcher
from dflash2.readcost import ReadCost
from dflash2.reads import Reads
from dflash2.refusals import Refusals
from dflash2.reservations import Admission, AdmissionSettings, Decision, Reservation
from dflash2.settling import rows_a_commit_meets, settle_if, settled
from dflash2.table import BlockState, BlockTable
from dflash2.tiers import Tier
from dflash2.transfer.base import TransferBackend

FAILURES_KEPT = 64  # failures carried on past, kept until the daemon checks the tables for them (`failures`)
FORGOTTEN_PER_STEP = 256  # blocks lost with a storage tier's file dropped a background step (_drop_forgotten)

log = logging.getLogger("dflash2.manager")

# The config's defaults (dflash2/config.py, policy.watermarks), for managers built without a config.
DEFAULT_WATERMARKS = {Tier.HBM: Watermark(0.95, 0.85), Tier.DRAM: Watermark(0.90, 0.80),
                      Tier.NVME: Watermark(0.95, 0.85)}


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """One tier: its capacity and how its slots are cut (page size, alignment)."""

    tier: Tier
    capacity_bytes: int
    page_bytes: int
    alignment: int


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a block's bytes are now."""

    vid: int
    tier: Tier
    offset: int
    nbytes: int
    layout_id: int


class BlockManager(AllocateRefusals, Reads):
    def __init__(self, specs: Sequence[TierSpec], *, policy: Policy | str = "lru",
                 swap_batch_size: int = 1024, cold_threshold: float = 0.5,
                 watermarks: dict[Tier, Watermark] | None = None,
                 admission: AdmissionSettings | None = None,
                 arenas: dict[Tier, Arena] | None = None, backend: TransferBackend | None = None,
                 clock: Callable[[], float] = time.monotonic, table_capacity: int = 1024,
                 prefetch_window: int = 0, first_gen: int = 1, table_reserve: int | None = None):
        if Tier.HBM not in {s.tier for s in specs}:
            raise ArenaError("the HBM tier (or its host-memory stand-in) is required")
        twice = [t.label for t, n in collections.Counter(s.tier for s in specs).items() if n > 1]
        if twice:  # (the last one was taken, the others dropped without a word)
            raise ArenaError(f"a tier is given more than once: {', '.join(twice)}")
        if not any(s.tier == Tier.HBM and s.capacity_bytes > 0 for s in specs):  # (a KeyError in Admission)
            raise ArenaError("the HBM tier (or its host-memory stand-in) has no capacity; it is required")
        self.specs = {s.tier: s for s in specs if s.capacity_bytes > 0}
        allocators = {t: SlotAllocator(s.capacity_bytes, s.page_bytes, s.alignment) for t, s in self.specs.items()}
        self.table = BlockTable(allocators, clock=clock, capacity=table_capacity, first_gen=first_gen, reserve=table_reserve)
        self.arenas = dict(arenas or {})
        missing = [t.label for t in self.specs if self.arenas and t not in self.arenas]
        if missing:
            raise ArenaError(f"arenas given for some tiers but not for {missing}")
        self.backend = backend
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.mover = Mover(self.table, backend, swap_batch_size)
        if isinstance(storage := self.arenas.get(Tier.NVME), StorageArena):
            self.mover.storage = storage
            self.mover.quarantine.nvme_path = getattr(storage, "path", None)
        self.placement = Placement(self.table, self.mover, self.policy, list(self.specs),
                                   {**DEFAULT_WATERMARKS, **(watermarks or {})}, cold_threshold)
        # Cost-aware reuse: read bandwidth measured from the mover's batches, engines' prefill rates.
        self.read_cost = ReadCost(clock=clock)
        self.mover.read_cost = self.read_cost
        self.placement.read_cost = self.read_cost
        self.placement.why_no_file = self._why_no_file
        # Failures logged and carried on past (a follow-up step, a drain piece's copies' end) that may
        # have left the table half changed: the daemon checks the tables for each (daemon/failing.py).
        # (Their text, not the exceptions, whose tracebacks hold their frames; the last FAILURES_KEPT
        # where nobody reads them: a duel's miniature, a bench.)
        self.failures: collections.deque[tuple[str, str]] = collections.deque(maxlen=FAILURES_KEPT)
        self.placement.on_failure = self._failed
        self.admission = Admission(self.table, self.placement, admission or AdmissionSettings())
        self.allocate_refusal = ""  # why the last allocate answered None (the daemon's reply says it)
        self.acquire_refusal = ""  # why the last acquire answered None (reads.py)
        self.refusals = Refusals()  # calls answered None, by cause: counted and logged for the operator
        self.set_aside_clients: set[int] = set()  # lapsed, their private blocks kept (set_aside) until detach
        self.admission.set_aside_note = self.set_aside_note  # (a deferred reservation's reason names them)
        self.access = AccessStats()
        # A lookup is followed by the request reading its prefix from the start: the first window's
        # blocks that lie below HBM start up at once (prefetch_window 0 turns this off).
        self.prefetcher = Prefetcher(self, prefetch_window)
        self.table.on_slots_freed = self._forget_slots
        self.table.on_holds_changed = self._holds_changed
        # The duel (duel.py), when whoever built this manager attached one: lookups feed its
        # miniature replays, the tick serves them, and the policy follows the one that finds most.
        self.duel = None
        # Per acquire parked on its own copies, (client, call id), the tiers it read from (vid ->
        # tier), and the prefetches among them that had left HBM unread (`Prefetcher.left_hbm`),
        # until it runs again (`acquire_rows`). Per call: a client may pipeline several.
        self._came_from: dict[tuple[int, int | None], tuple[dict[int, int], set[int]]] = {}
        # Per storage arena, its `forgets` whose blocks were all dropped, and those dropped of the ones
        # since, still under way (_drop_forgotten).
        self._forgets_seen: dict[int, int] = {}
        self._forgotten_dropped: dict[int, int] = {}

    # -- clients and layouts ---------------------------------------------------------------
    def attach(self, name: str, client_id: int | None = None) -> int:
        return self.table.add_client(name, client_id)

    @settled
    def detach(self, client: int, set_aside: bool = False) -> dict:
        """Release everything the client holds (also what a lapsed lease does). `set_aside`: a client
        whose lease lapsed while its process may live keeps its private blocks, which it may still be
        writing (table/departure.py), until a `detach` once the process cannot write any more
        (daemon/sessions.py, SetAside)."""
        holder = self.table.client(client)
        held = np.concatenate([np.fromiter(holder.refs.keys(), dtype=np.int64, count=len(holder.refs)),
                               np.fromiter(holder.pins.keys(), dtype=np.int64, count=len(holder.pins))])
        self.read_cost.drop_client(client)
        self.prefetcher.drop(client)
        for who in [w for w in self._came_from if w[0] == client]:  # (each of its parked acquires)
            del self._came_from[who]
        reservations = self.admission.remove_client(client)
        below = held[self.table.cols.tier[held] != int(Tier.HBM)]  # (room below: `freed_below`)
        if set_aside:
            released = self.table.set_aside_client(client)
            self.set_aside_clients.add(client)
        else:
            released = self.table.remove_client(client)
            self.set_aside_clients.discard(client)
        idle = self._left_idle(held)
        self._follow_up("granting waiting reservations after a detach",
                        lambda: self.admission.tick(make_room=idle or self.admission.freed_below(below)))
        return {"reservations": reservations, **released}

    def register_layout(self, layout: Layout) -> int:
        self.check_layout(layout)
        return self.table.register_layout(layout)

    def check_layout(self, layout: Layout) -> None:
        """LayoutError when this node cannot move the layout's blocks between its tiers (a block
        larger than the GPU's staging buffer, on a node with an NVMe tier)."""
        limit = getattr(self.backend, "max_block_bytes", None)
        if limit is not None and layout.block_bytes > limit:
            raise LayoutError(f"layout {layout.name!r}: a block of {layout.block_bytes} bytes cannot move between "
                              f"HBM and NVMe here: the staging buffer holds {limit} bytes "
                              "(raise memory.staging_buffer_size_mb, or use fewer tokens per block)")

    def set_prefill_rate(self, client: int, layout_id: int, tokens_per_s: float | None) -> None:
        """The client's engine recomputes this layout's blocks at `tokens_per_s` (None: unknown).
        Its lookups then offer only blocks that load faster than that, and placement keeps the
        layout's blocks only in tiers that read back faster than its slowest engine recomputes."""
        self.table.client(client)
        self.table.layout(layout_id)
        self.read_cost.set_rate(client, layout_id, tokens_per_s)

    # -- reservations ----------------------------------------------------------------------
    @settled
    def reserve(self, client: int, layout_id: int, tokens: int, **kw) -> Decision:
        return self.admission.reserve(client, layout_id, tokens, **kw)

    def reservation_status(self, client: int, reservation_id: int) -> Decision:
        """Where the client's reservation stands now (`Admission.status`: a deferred one that fits
        by now is granted, which may make room: placement work, so drain copies in flight end first)."""
        settle_if(self, None, placing=self.admission.may_make_room())
        return self.admission.status(reservation_id, client)

    @settled
    def take(self, client: int, reservation_id: int, n: int) -> np.ndarray:
        return self.admission.take(client, reservation_id, n)

    @settled
    def untake(self, client: int, res: Reservation, vids: np.ndarray) -> None:
        """Undo a `take` whose client gave up waiting on it: its blocks go back to the reservation,
        or are freed when the reservation has ended since."""
        if not self.admission.give_back(res, vids):
            self.free(client, vids)

    @settled
    def cancel(self, client: int, reservation_id: int) -> None:
        self.admission.cancel(client, reservation_id)

    # -- block life ------------------------------------------------------------------------
    def allocate(self, client: int, layout_id: int, n: int, *, request: int = 0,
                 priority: int = 0, tier: Tier = Tier.HBM) -> np.ndarray | None:
        """n private blocks to write in `tier` (HBM by default; a host-side writer such as sglang's
        storage backend writes to DRAM), outside any reservation: idle blocks are demoted to make
        room when needed. None when the tier cannot hold them now (the caller reserves and waits;
        `allocate_refusal` says why); NeverFits when they exceed the whole tier; QuotaExceeded when
        the client would hold more of HBM than `admission.max_client_share`. In HBM the room that
        reservations waiting at this priority or above need is left to them (they are ahead).
        Drain copies in flight are settled only when room must be made: an allocation from room
        already free touches no block of theirs (their destination slots are taken already)."""
        if tier == Tier.NVME or tier not in self.specs:
            raise ValueError(f"blocks are written in a memory tier this daemon has, not {Tier(tier).label}")
        self.table.check_allocation(n, priority, request)
        # Refused before any room is made: demoting (or, on the last tier, dropping) every other
        # client's idle blocks for a request that cannot succeed would lose their cache for nothing.
        self.table.refuse_never_fits(tier, {layout_id: n}, f"allocate of {n} blocks")
        slot = self.table.slot_bytes(layout_id, tier)
        size = self.table.layout(layout_id).block_bytes
        held = 0
        if tier == Tier.HBM:
            self.admission.check_share(client, n * slot)
            if not self.table.client(client).refs:
                # A client with nothing running (it references no block) queues its new request
                # behind the reservations waiting ahead of it. One that references blocks may be
                # growing a running request: held back, that request could never finish and free
                # the room a waiting reservation may be waiting for (the request id cannot tell:
                # a request's blocks may be another request's, deduplicated or found cached).
                ahead, held = self.admission.held_ahead(priority, client, slot)
        kw = dict(tier=tier, request=request, priority=priority)
        vids = self.table.allocate(client, layout_id, n, **kw) if not held else None
        if held and self.placement.free_bytes(tier, size) < held:
            # The room of the reservations ahead is not there yet: admission makes it, paced by its
            # token bucket (a burst of demand must not set off a storm of demotions). Made here, one
            # allocate of one block demoted the whole queue's room at once.
            return self._held_back(ahead, priority, held)
        if vids is None:
            settle_if(self, placing=True)  # making room moves and evicts blocks
            most = self.placement.room_most(tier, n * slot + held, idle_only=True, slot=slot)
            if most < n * slot + held:
                # Nothing is moved for a call that fails anyway: its room waits on blocks held.
                if held:
                    return self._held_back(ahead, priority, held)
                return self._refused(tier, client, layout_id, n * slot, most, slot)
            need = self.placement.room_batch(tier, n * slot + held, slot)
            with self.placement.own_writes():  # (its writes to NVMe: the call may be parked on them)
                self.placement.make_room(tier, need, idle_only=True, block_bytes=size)
            if held and self.placement.free_bytes(tier, size) < n * slot + held:
                return self._held_back(ahead, priority, held)
            vids = self.table.allocate(client, layout_id, n, **kw)
        if vids is None:
            return self._refused(tier, client, layout_id, n * slot, self.placement.free_bytes(tier, size), slot)
        self.policy.on_insert(self.table, self.table.rows(vids), self.table.clock())
        return vids

    def commit(self, client: int, vids, keys: Sequence[int] | None = None, parent: int | None = None) -> np.ndarray:
        """The client's written blocks are final (table/publish.py). Drain copies in flight are
        settled first only when the commit meets one of their blocks: a cached twin that a key
        deduplicates onto (its slot may be swapped, its references grow), or the parent it chains under."""
        if self.placement.in_flight and keys is not None:
            settle_if(self, rows_a_commit_meets(self.table, keys, parent))
        out = self.table.commit(client, vids, keys, parent)
        now = self.table.clock()
        recast = self.table.take_recast()
        if len(recast):  # a cached twin took its writer's faster slot: a move, for the policy
            self.policy.on_insert(self.table, recast, now)
        rows = self.table.rows(out)
        self.policy.on_commit(self.table, rows, now)
        self._grant_if_movable(rows, "a commit")
        return out

    def _grant_if_movable(self, rows: np.ndarray, what: str) -> None:
        """After a call that may have made blocks movable for the waiting head of the queue (their
        writer committed them: running now, preemptable; a reader unpinned them)."""
        def grant() -> None:
            if self.admission.became_movable(rows) or self.admission.freed_below(
                    rows[self.table.cols.tier[rows] != int(Tier.HBM)]):
                try:
                    settle_if(self, placing=True)  # making room is placement work
                except CopiesRunning:
                    # (Served by the loop, copies past the park deadline: the call's own work is done and
                    # cannot be parked; the head's room is made at the next step, `became_movable` having
                    # asked for it. It was logged as an error and the whole tables checked, a review.)
                    return
                self.admission.tick(make_room=False)
        if self.admission.deferred:
            self._follow_up(f"granting waiting reservations after {what}", grant)

    def free(self, client: int, vids) -> int:
        rows = self.table.rows(vids)
        # Settled first when a block freed is in flight (the table would defer its free), or when the
        # follow-up may grant a waiting reservation (which may make room: placement work).
        settle_if(self, rows, placing=bool(self.admission.deferred))
        self.table.refuse_reserved(rows, client)  # only its reservation frees a RESERVED block
        below = rows[self.table.cols.tier[rows] != int(Tier.HBM)]  # (before the free: room below, `freed_below`)
        n = self.table.free(client, vids)
        idle = self._left_idle(rows)
        self._follow_up("granting waiting reservations after a free",
                        lambda: self.admission.tick(make_room=idle or self.admission.freed_below(below)
                                                            or self.admission.room_freed()))
        return n

    def drop_writes(self, client: int, vids: np.ndarray) -> int:
        """The writer gave up on a commit of `vids` (int64) that was not run (daemon/forgetting.py): of
        them, those still its own, being written, are freed (one it pins at its last release: table
        `keep_pinned_writes`); the rest (committed, another's, freed) are left alone. The copies in
        flight are settled first, so that a call parked on them (CopiesRunning) has changed nothing.
        Returns how many it gave up."""
        mine = self.table.being_written(client, vids)
        if len(mine):
            settle_if(self, self.table.rows(mine), placing=bool(self.admission.deferred))
            self.free(client, self.table.keep_pinned_writes(client, mine))
        return len(mine)

    def _left_idle(self, rows: np.ndarray) -> bool:
        """Whether cached blocks in HBM among `rows` are idle now (a call let go of them): only then may
        the queue make room again. The slots a call freed are room as they are, and room-making
        after every free would scan the whole table for what the last attempt could not move."""
        c = self.table.cols
        return bool(((c.key[rows] != 0) & (c.refs[rows] == 0) & (c.pins[rows] == 0)
                     & (c.tier[rows] == int(Tier.HBM))).any())  # the queue's room is HBM's

    def _follow_up(self, what: str, step: Callable[[], object]) -> None:
        """A step that follows a call's own work (granting reservations that wait, a prefetch): its
        failure is logged and left to the next tick, never reported as the call's (whose work is
        done: a client retrying a free that had succeeded would get a double-free error), and noted
        in `failures` (it may have moved blocks part way)."""
        try:
            step()
        except Exception as e:
            log.exception("%s failed (the call itself succeeded; the next tick tries again)", what)
            self._failed(e, what)

    def _failed(self, error: BaseException, what: str) -> None:
        self.failures.append((f"{type(error).__name__}: {error}", what))

    def _drop_forgotten(self, arena: StorageArena) -> None:
        """The blocks lost with a storage tier's file (cut short, removed: nvmecut.py, nvmegone.py) are
        dropped from the cache at the next step, as blocks whose read failed are. Before, the log said
        them lost, but lookups found them and status counted them until each was read, its acquire
        then blaming an I/O error (a review). Settled ones only: one in flight is settled by its copy."""
        forgets = arena.forgets
        if forgets == self._forgets_seen.get(id(arena), 0):
            return
        rows = self.mover.lost_file_rows()  # (the mover's storage arena is this one: a pool has one)
        # At most FORGOTTEN_PER_STEP a step (a Python step a block: 16,384 at once held the loop 23,000
        # ticks' worth, a review), the rest at the next; and a move in flight (its write may have gone to
        # the old file) may yet settle into a lost slot: looked at again until none is (a review).
        done = len(rows) <= FORGOTTEN_PER_STEP and not (self.table.cols.state == int(BlockState.MIGRATING)).any()
        if len(rows):  # (those of a later step lost too: never counted as orphans of these)
            self.placement._drop_lost(rows[:FORGOTTEN_PER_STEP], lost_too=rows)
        dropped = self._forgotten_dropped.pop(id(arena), 0) + min(len(rows), FORGOTTEN_PER_STEP)
        if not done:
            self._forgotten_dropped[id(arena)] = dropped
            return
        self._forgets_seen[id(arena)] = forgets
        if dropped:
            log.info("%d blocks lost with the %s file dropped from the cache (misses)", dropped, arena.tier.label)

    # -- bytes (host arenas) ---------------------------------------------------------------
    @settled
    def place(self, vid: int) -> Place:
        return self.places_of_rows(self.table.rows([vid]))[0]

    @settled
    def view(self, vid: int) -> np.ndarray:
        """A zero-copy uint8 view of a block in a memory tier (not NVMe: acquire it first)."""
        p = self.place(vid)
        if not self.arenas:  # (told "acquire it first", a block acquired in HBM: no acquire gives it bytes)
            raise ArenaError(f"block {vid:#x} has no bytes to view: this block manager holds metadata only "
                             "(built without arenas)")
        arena = self.arenas.get(p.tier)
        if not isinstance(arena, MemoryArena):
            raise ArenaError(f"block {vid:#x} lies in {p.tier.label}, which has no memory view; acquire it first")
        return arena.view(p.offset, p.nbytes)

    # -- background ------------------------------------------------------------------------
    def _why_no_file(self, tier: Tier) -> str:
        """(Read within a settle, backoff.py: never settled itself.)"""
        arena = self.arenas.get(tier)
        return arena.no_file if isinstance(arena, StorageArena) else ""

    @settled
    def tick(self, drain: bool = True, duel: bool = True) -> None:
        """One background step: rescore (policies that cache scores), move a doubling key index's
        entries on, probe a storage tier that backs off after failed writes (backoff.py), expire and
        grant reservations, rebalance the
        tiers, settle prefetches; serve the duel's queued lookups.
        `drain` False: a tier over its high watermark begins its drain, but its pieces are left
        to the caller (`drain_slice`): the server runs them between requests, so that a
        request waits for one piece, not the step's whole share of the drain. `duel` False: the
        duel's queue is left to the caller too (the server serves it between requests)."""
        if self.duel is not None and duel:
            self.duel.run(self.duel.tick_budget_s)
        later = self.placement.read_later
        if not later:
            self.run_prefetch()
        self.policy.on_tick(self.table, self.table.clock())
        self.table.keys.step()  # a doubling of the key index moves on without inserts or removals
        self.admission.new_step()
        for arena in self.arenas.values():  # a cache file removed while idle: made again (nvmegone.py)
            if isinstance(arena, StorageArena):
                self._follow_up("looking at the NVMe cache file", arena.check_file)
                self._follow_up("dropping the blocks lost with the NVMe cache file",
                                lambda: self._drop_forgotten(arena))
        self.placement.probe_writes()  # a storage tier backing off: does its disk take writes again?
        self._retest_set_aside()
        self.admission.tick()
        if drain:
            self.placement.rebalance()
        else:
            self.placement.start_drains()
        self.prefetcher.settle()
        self.mover.swap_log.due()  # (a burst's batches said within 10 s: swaplog.py)
        if later:
            # Last: its reads from NVMe are left in flight, and no placement work of this step (the
            # queue's room, a drain) may run while copies are in flight (rebalance.py).
            self.run_prefetch()

    def _retest_set_aside(self) -> None:
        """Re-test the slots of each storage tier set aside after I/O errors, while it takes writes
        (quarantine.py `retest`: RETEST_FIRST_S after they are first seen, then at most every
        RETEST_EVERY_S); those that pass are room again."""
        for tier, arena in self.arenas.items():
            if isinstance(arena, StorageArena) and self.placement.writable(tier):
                self._follow_up(f"re-testing the {tier.label} slots set aside",
                                lambda t=tier, a=arena: self.mover.quarantine.retest(t, a, self.placement.monotonic()))

    def draining(self) -> bool:
        """Whether a tier is still draining down to its low watermark and may go on now (rebalance:
        not one whose storage tier below backs off)."""
        return self.placement.drain_pending()

    def drain_slice(self, budget_s: float, yield_to=None) -> float:
        """Rebalance pieces for `budget_s` between requests (the server's loop: the step's share of
        the drain, and more while no request has come for a while): a drain paced by the steps alone
        wrote DRAM down to NVMe at about a third of the disk's speed (a 50 ms piece a 100 ms step,
        each piece half its part), and what it left undone the next allocations did on their request
        path. `yield_to(seconds)` (a request waits, or comes within that long?) is asked after each
        piece, and while a piece's copies run (`Placement.settle_when_done`): a request that arrives waits
        for that piece only, not the whole budget. Drains begin at the steps only (`tick`): a tier
        whose drain could not move its cold cut (held or pinned blocks) is not cut again every slice
        while another tier drains (a pass over the whole table each: 1.5 ms at a million rows).
        The last piece's copies are left in flight, and the loop answers requests while they run:
        the next slice ends them first (once they have ended: until then it gives way to a waiting
        request, `Placement.settle_when_done`), as does any call that may touch their blocks
        (`settled`, which waits for them). Returns the seconds it spent waiting for copies to end
        (watching for a request meanwhile): the loop's idle time, not the drain's."""
        waited = self.placement.waited_s
        if self.placement.settle_when_done(yield_to, time.perf_counter() + budget_s):
            self.placement.rebalance(budget_s, yield_to, start=False, defer=self.backend is not None)
        return self.placement.waited_s - waited

    def settle(self) -> None:
        """End the drain copies in flight now (`drain_slice`), waiting for those not done."""
        self.placement.settle()

    def copies_running(self) -> bool:
        """Whether a drain piece's copies are in flight and not all done yet."""
        return self.placement.in_flight and not self.placement.flights_done()

    def check_invariants(self) -> None:
        check_invariants(self.table, self.placement.in_flight_slot_bytes(),  # drain copies in flight too
                         self.placement.in_flight_blocks())
        self.admission.check_invariants()

    def stats(self) -> dict:
        tiers = {}
        blocks, arriving = self.table.tier_blocks(), self.placement.in_flight_blocks()
        for t, alloc in self.table.allocators.items():
            # Each block counted where it lies: one on its way has its destination slot taken too.
            tiers[t.label] = {**alloc.stats(), "blocks": blocks[t] - arriving.get(t, 0)}
            if isinstance(arena := self.arenas.get(t), StorageArena) and arena.no_file:
                tiers[t.label]["no_file"] = arena.no_file  # (writes refused, reads miss: nvmegone.py)
        self.prefetcher.settle_gone()  # (pending: in HBM; a prefetch gone from it unread is wasted)
        return {
            "tiers": tiers,
            "reads": {Tier(t).label: n for t, n in self.access.reads.items()},
            "host_reads": {Tier(t).label: n for t, n in self.access.host_reads.items()},
            "hbm_hit_ratio": self.access.hbm_hit_ratio,
            "lookups": self.access.lookups,
            "lookup_blocks_found": self.access.lookup_blocks_found,
            "lookup_misses": self.access.misses,
            "lookup_withheld": self.access.withheld,
            "refused": self.refusals.describe(),
            "read_cost": self.read_cost.describe(),
            "moves": {f"{a.label}->{b.label}": dataclasses.asdict(s) for (a, b), s in self.mover.stats.items()},
            "copy_batches": {} if self.backend is None else self.backend.copy_batches(),
            "placement": dataclasses.asdict(self.placement.stats),
            # pending: prefetched, in HBM, not read yet (useful once read, wasted once gone unread)
            "prefetch": {"window": self.prefetcher.window_now(), "useful": self.prefetcher.useful,
                         "wasted": self.prefetcher.wasted, "pending": self.prefetcher.pending},
            "reservations": self.admission.snapshot(),
            "clients": len(self.table.clients) - len(self.set_aside_clients),
            # blocks: their private blocks kept out of reuse; pinned: blocks they had pinned, kept
            # pinned (never moved) for a reader that may resume (table/departure.py).
            "set_aside": {"clients": len(self.set_aside_clients),
                          "blocks": sum(len(self.table.clients[c].refs) for c in self.set_aside_clients),
                          "pinned": len(set().union(*(self.table.clients[c].pins for c in self.set_aside_clients)))},
            "policy": self.policy.describe(),
            "duel": None if self.duel is None else self.duel.describe(),
        }

    @settled
    def close(self) -> None:
        """Close the backend, then every arena: each step on its own (one that fails is logged, the
        others still run: a GPU whose context is lost must not keep the host arenas open)."""
        parts = ([("transfer backend", self.backend)] if self.backend is not None else [])
        parts += [(f"{tier.label} arena", arena) for tier, arena in self.arenas.items()]
        with stopsignals.uninterrupted():  # (a bench's SIGTERM waits: one here left its segments)
            self.mover.swap_log.flush()  # (the batches moved since the last `dflash2_swap` line)
            for name, part in parts:
                try:
                    part.close()
                except Exception:
                    log.exception("closing the %s failed", name)

    # -- internals -------------------------------------------------------------------------
    def places_of_rows(self, rows: np.ndarray) -> list[Place]:
        c = self.table.cols
        vids = self.table.vids(rows)
        tiers = tuple(Tier)  # indexed by value: Tier(t) and Layout.block_bytes per block cost more than the rest
        sizes = [layout.block_bytes for layout in self.table.layouts]
        return [Place(v, tiers[t], o, sizes[l], l)
                for v, t, o, l in zip(vids.tolist(), c.tier[rows].tolist(), c.offset[rows].tolist(),
                                      c.layout[rows].tolist())]

    def _holds_changed(self, rows: np.ndarray) -> None:
        self.policy.on_holds_changed(self.table, rows, self.table.clock())

    def _forget_slots(self, tier: Tier, offsets: np.ndarray) -> None:
        arena = self.arenas.get(tier)
        if isinstance(arena, StorageArena):
            arena.forget(offsets.tolist())
            self.mover.quarantine.freed(tier, offsets)  # (those whose read failed: set aside)
