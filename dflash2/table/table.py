"""The unified virtual block table: every block of every layout in every tier, metadata only.

A block's virtual id is `(generation << 32) | row`: 64 bits, stable while the block moves between
tiers, and a stale id (its row freed and reused) is caught by the generation check. Bytes live in the
tier arenas; this table only knows each block's (tier, slot offset), handed out by one
`SlotAllocator` per tier.

Invariants (checked by `check_invariants`, relied on everywhere):
- a live row is in exactly one tier and holds exactly one slot there (two while MIGRATING: the
  destination slot is held by the move record, not the row);
- each tier allocator's used bytes equal the slots of the rows in that tier plus in-flight moves'
  destination slots;
- refs and pins equal the sums of the per-client counts; a pinned block never changes tier or state;
- a published block that nobody references or pins carries its writer's priority (base_priority):
  what the requests that held it raised it to lasts only while one of them holds it;
- kids[t, p] counts the published children of p that lie in tier t: descendants leave a tier before
  their ancestors, so a block with children in its own tier or a faster one is never demoted, and a
  block with any cached child is never evicted;
- a content key is indexed iff its row is live and published.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from dflash2.alloc import SlotAllocator
from dflash2.errors import (IllegalTransition, LayoutError, NotOwner, PinnedBlock, ReservationError,
                            UnknownBlock, UnknownClient, UnknownLayout)
from dflash2.counts import add_at, any_true, distinct, unique
from dflash2.forest import local_parents
from dflash2.layout import Layout
from dflash2.table.capacity import Capacity
from dflash2.table.dead import DeadRows
from dflash2.table.columns import NO_CLIENT, NO_ROW, Columns, no_repeats
from dflash2.table.departure import Departures
from dflash2.table.keyindex import EMPTY, KeyIndex
from dflash2.table.lost import LostBlocks
from dflash2.table.publish import Publishing
from dflash2.table.release import Releasing
from dflash2.table.rowspace import reserve_rows
from dflash2.table.states import BlockState, check_transition
from dflash2.tiers import Tier

ROW_MASK = 0xFFFFFFFF
S = BlockState
# Layouts a table registers at most. A node serves a few models at a few precisions, and a layout is
# never dropped (blocks and clients name it by id): past this, a client is registering a new layout
# per call (a name with a counter in it), and every lookup of per-layout figures would grow with
# them. Far below the layout column's range (uint16), which ids must never leave.
MAX_LAYOUTS = 1024


def vids_of(gen: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return (gen.astype(np.int64) << 32) | (rows if rows.dtype == np.int64 else rows.astype(np.int64))


class ClientRefs:
    """What one attached client holds: references and pins per row."""

    def __init__(self, client_id: int, name: str):
        self.client_id = client_id
        self.name = name
        self.refs: Counter[int] = Counter()
        self.pins: Counter[int] = Counter()
        # Invariant: the HBM slot bytes of the blocks in `refs` (each counted as often as
        # referenced), wherever they lie: kept as refs change, never by a walk over them. It bounds
        # what the client holds of HBM from above, so a share check under it needs no walk.
        self.ref_slot_bytes = 0


class BlockTable(Publishing, Releasing, LostBlocks, Departures, Capacity, DeadRows):
    def __init__(self, allocators: dict[Tier, SlotAllocator], clock: Callable[[], float] = time.monotonic,
                 capacity: int = 1024, first_gen: int = 1, reserve: int | None = None):
        self.allocators = allocators
        self.clock = clock
        # `reserve`: rows reserved up front (rowspace.py); by default one per KiB of the arenas.
        if reserve is None:
            reserve = reserve_rows((a.arena_bytes for a in allocators.values()), capacity)
        self.cols = Columns(capacity, first_gen, max(capacity, reserve))
        self.keys = KeyIndex(capacity)
        self.layouts: list[Layout] = []
        self._layout_ids: dict[Layout, int] = {}  # each registered layout's id (its place in `layouts`)
        # Per tier, slot and block bytes per layout id: kept until a layout is registered (keyed by how many).
        self._per_layout: dict[object, tuple[int, np.ndarray]] = {}
        self.clients: dict[int, ClientRefs] = {}
        self._next_client = 1
        self._free_after_move: set[int] = set()  # private blocks whose last reference went mid-move
        self.lost: set[int] = set()  # unpublished after a failed checksum, still referenced
        # Private copies that a commit deduplicated while their writer had them pinned: the cached
        # twin took the references, but the writer still views these bytes where they are. Never
        # moved (pinned), freed at their last unpin (the writer's release, or its detach). Each with
        # its twin's id, which an acquire or add_ref of it is told to use (0: release.py keep_pinned_writes).
        self.pinned_copies: dict[int, int] = {}
        # Rows a commit's deduplication moved to another tier (the cached twin taking the writer's
        # faster slot): the manager tells the policy, as after a move. Drained by `take_recast`.
        self._recast: list[int] = []
        # Per tier, a count of the calls that may have made one of its blocks movable (a commit, a
        # move's end, a reference or pin let go: `_may_move`). Placement remembers a tier in which
        # no block could move only until its count changes (`Placement._nothing_movable`).
        self.movable_epoch = np.zeros(len(Tier) + 1, dtype=np.int64)  # the last for tier -1 (freed rows)

    # -- layouts and clients ---------------------------------------------------------------
    def register_layout(self, layout: Layout) -> int:
        """Id of this layout; the same layout (name and geometry) registered twice gets the same id.
        LayoutError past MAX_LAYOUTS (nothing registered)."""
        known = self._layout_ids.get(layout)
        if known is not None:
            return known
        self.refuse_layouts([layout])
        self.layouts.append(layout)
        self._layout_ids[layout] = len(self.layouts) - 1
        return len(self.layouts) - 1

    def refuse_layouts(self, layouts: Sequence[Layout]) -> None:
        """LayoutError when registering these would take the table past MAX_LAYOUTS."""
        new = {lay for lay in layouts if lay not in self._layout_ids}
        if len(self.layouts) + len(new) > MAX_LAYOUTS:
            names = ", ".join(sorted(repr(lay.name) for lay in new)[:3])
            raise LayoutError(f"{len(new)} new layouts ({names}{', ...' if len(new) > 3 else ''}) would take this "
                              f"block pool past {MAX_LAYOUTS} layouts ({len(self.layouts)} are registered, and none "
                              "is ever dropped): register one layout per model and precision, under a name that "
                              "stays the same across calls and processes")

    def _layout_array(self, what, value: Callable[[Layout], int]) -> np.ndarray:
        """`value` of every registered layout, by id (int64), kept until the next registration."""
        kept = self._per_layout.get(what)
        if kept is None or kept[0] != len(self.layouts):
            values = np.array([value(lay) for lay in self.layouts], dtype=np.int64)
            values.flags.writeable = False  # shared by every caller until the next registration
            kept = self._per_layout[what] = (len(self.layouts), values)
        return kept[1]

    def ref_slots(self, rows: np.ndarray, counts: np.ndarray | None = None) -> int:
        """HBM slot bytes of these rows' blocks wherever they lie (a row listed twice, or `counts` times,
        counts so; 0 with no HBM tier): what `ClientRefs.ref_slot_bytes` adds up."""
        if Tier.HBM not in self.allocators or not len(rows):
            return 0
        slots = self.slot_sizes(Tier.HBM)[self.cols.layout[rows]].astype(np.int64)
        return int(slots.sum() if counts is None else slots @ np.asarray(counts, dtype=np.int64))

    def layout(self, layout_id: int) -> Layout:
        if not 0 <= layout_id < len(self.layouts):
            raise UnknownLayout(f"layout id {layout_id} is not registered ({len(self.layouts)} are)")
        return self.layouts[layout_id]

    def add_client(self, name: str, client_id: int | None = None) -> int:
        """Register a client; the daemon passes its own daemon-wide id, tests let the table pick."""
        if client_id is not None and client_id in self.clients:
            raise ValueError(f"client id {client_id} is already attached")
        top = int(np.iinfo(self.cols.owner.dtype).max)
        if client_id is not None and (isinstance(client_id, bool) or not isinstance(client_id, (int, np.integer))
                                      or not 0 <= client_id <= top):
            # (-1 is NO_CLIENT: its private blocks read as published, pinned by other clients; past the
            # int32 owner column, its allocate raised after the rows and slots were taken)
            raise ValueError(f"client id must be an integer in 0..{top}, got {client_id!r}")
        cid = self._next_client if client_id is None else client_id
        if cid > top:  # (picked: one above an id given at the top; it passed unchecked, its allocate leaked)
            raise ValueError(f"no client id left to pick: the next would be {cid}, past the owner column's {top} "
                             "(ids are picked above the highest given); pass a free one")
        self._next_client = max(self._next_client, cid) + 1
        self.clients[cid] = ClientRefs(cid, name)
        return cid

    def client(self, client_id: int) -> ClientRefs:
        try:
            return self.clients[client_id]
        except KeyError:
            raise UnknownClient(f"client {client_id} is not attached") from None

    # -- addressing ------------------------------------------------------------------------
    # Calls with at most this many ids or keys take a scalar path: for one block, a dozen numpy
    # operations on one-element arrays cost more than the control round trip itself.
    SMALL = 8

    def rows(self, vids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows of live blocks; UnknownBlock names the first id that is not live."""
        if len(vids) <= self.SMALL:
            return self._rows_small(vids)
        vids = np.asarray(vids, dtype=np.int64).reshape(-1)
        rows, ok = self.liveness(vids)
        if not ok.all():
            bad = int(vids[int(np.argmin(ok))])
            raise UnknownBlock(f"block {bad:#x} is not live (never allocated, freed, or stale)")
        return rows

    def liveness(self, vids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, live mask) of int64 vids: live = the row holds that very block (same generation,
        not free); a row outside the table is reported as 0 and not live."""
        rows = vids & ROW_MASK
        gens = (vids >> 32) & ROW_MASK
        inside = rows < self.cols.capacity
        if inside.all():  # (the usual case: no masks needed)
            return rows, (self.cols.gen[rows] == gens) & (self.cols.state[rows] != int(S.FREE))
        ok = inside.copy()
        ok[inside] = (self.cols.gen[rows[inside]] == gens[inside]) & (self.cols.state[rows[inside]] != int(S.FREE))
        return np.where(inside, rows, 0), ok

    def being_written(self, client: int, vids: np.ndarray) -> np.ndarray:
        """Those of `vids` (int64) that are `client`'s blocks still being written, each once."""
        rows, live = self.liveness(vids)
        mine = live & (self.cols.owner[rows] == client) & (self.cols.state[rows] == int(S.WRITING))
        return unique(vids[mine])

    def _rows_small(self, vids) -> np.ndarray:
        c = self.cols
        out = []
        for vid in vids:
            vid = int(vid)
            row, gen = vid & ROW_MASK, (vid >> 32) & ROW_MASK
            if row >= c.capacity or int(c.gen[row]) != gen or int(c.state[row]) == S.FREE:
                raise UnknownBlock(f"block {vid:#x} is not live (never allocated, freed, or stale)")
            out.append(row)
        return np.array(out, dtype=np.int64)

    def vids(self, rows: np.ndarray) -> np.ndarray:
        return vids_of(self.cols.gen[rows], rows)

    def slot_bytes(self, layout_id: int, tier: Tier) -> int:
        return self.allocators[tier].slot_for(self.layout(layout_id).block_bytes)

    def slot_sizes(self, tier: Tier) -> np.ndarray:
        """Slot bytes in `tier` per layout id (index it with the layout column; do not write to it)."""
        alloc = self.allocators[tier]
        return self._layout_array(tier, lambda lay: alloc.slot_for(lay.block_bytes))

    def block_bytes(self, rows: np.ndarray) -> np.ndarray:
        """Bytes of each row's block (its layout's), int64."""
        return self._layout_array("block_bytes", lambda lay: lay.block_bytes)[self.cols.layout[rows]]

    def _require(self, rows: np.ndarray, state: BlockState, op: str) -> None:
        """IllegalTransition unless every row is in `state`. For a target that several states may
        reach (RESIDENT: from WRITING by a commit, from MIGRATING by a move's end) the transition
        table alone is not enough: a commit of a block in flight would end its move under the
        mover, an end_move of a block being written would publish it in another tier unwritten."""
        wrong = self.cols.state[rows] != int(state)
        if wrong.any():
            r = rows[wrong][:1]
            raise IllegalTransition(f"{op} of block {int(self.vids(r)[0]):#x}: it is "
                                    f"{BlockState(int(self.cols.state[r][0])).name}, not {state.name}")

    # -- allocation ------------------------------------------------------------------------
    @staticmethod
    def check_allocation(n: int, priority: int, request: int = 0) -> None:
        """ValueError for a count, priority or request id no allocation takes (the manager checks them
        before it makes room: raised after, the room was made for a call that failed, a review)."""
        if n < 0:  # take_rows(-1) would put a live row back on the free list (handed out twice)
            raise ValueError(f"cannot allocate {n} blocks")
        if isinstance(priority, bool) or int(priority) != priority or not -128 <= priority <= 127:
            # (the int8 column's range; raised after the rows were taken, they leaked)
            raise ValueError(f"priority must be an integer in -128..127, got {priority!r}")
        if (isinstance(request, bool) or not isinstance(request, (int, np.integer))
                or not -(1 << 63) <= request < 1 << 63):
            # (the int64 column's; raised as the column was written, after the rows and slots were taken: both leaked)
            raise ValueError(f"request must be an integer in the int64 range, got {request!r}")

    def allocate(self, client_id: int, layout_id: int, n: int, *, tier: Tier = Tier.HBM,
                 request: int = 0, priority: int = 0, state: BlockState = S.WRITING,
                 in_used_slabs: bool = False) -> np.ndarray | None:
        """n private blocks of the client in `tier`, in state WRITING (or RESERVED for a reservation).
        None when the tier has no room: nothing changes and the caller makes room or defers.
        `in_used_slabs`: only in free slots of slabs already in use (`SlotAllocator.alloc_in_used_slabs`)."""
        holder = self.client(client_id)
        layout = self.layout(layout_id)
        if state not in (S.RESERVED, S.WRITING):
            raise ValueError(f"new blocks start RESERVED or WRITING, not {state.name}")
        self.check_allocation(n, priority, request)
        alloc = self.allocators[tier]
        # Before any row is taken: what fails here leaves nothing held (raised after, the rows
        # stayed the client's while its call failed).
        slot_bytes = int(self.slot_sizes(Tier.HBM)[layout_id]) * n if Tier.HBM in self.allocators else 0
        offsets = (alloc.alloc_in_used_slabs if in_used_slabs else alloc.alloc)(layout.block_bytes, n)
        if offsets is None:
            return None
        c = self.cols
        rows = c.take_rows(n)
        c.state[rows] = state
        c.tier[rows] = tier
        c.layout[rows] = layout_id
        c.offset[rows] = offsets
        c.owner[rows] = client_id
        c.request[rows] = request
        c.priority[rows] = priority
        c.base_priority[rows] = priority
        c.refs[rows] = 1
        c.last_access[rows] = self.clock()
        holder.refs.update(rows.tolist())  # (new rows: counted in C, not one Python step per row)
        holder.ref_slot_bytes += slot_bytes
        return self.vids(rows)

    def open_write(self, client_id: int, vids) -> None:
        """RESERVED → WRITING: a reservation's blocks are handed to its request."""
        rows = self._owned_rows(client_id, vids)
        no_repeats(rows, "open_write")
        check_transition(self.cols.state[rows], S.WRITING, vids)
        self.cols.state[rows] = S.WRITING

    def close_write(self, client_id: int, vids) -> None:
        """WRITING → RESERVED: blocks that `open_write` handed out go back to their reservation,
        untouched since: IllegalTransition when one was referenced or pinned again meanwhile."""
        rows = self._owned_rows(client_id, vids)
        no_repeats(rows, "close_write")
        check_transition(self.cols.state[rows], S.RESERVED, vids)
        used = (self.cols.refs[rows] != 1) | (self.cols.pins[rows] != 0)
        if used.any():
            raise IllegalTransition(f"block {int(self.vids(rows[used][:1])[0]):#x} was referenced or pinned since it "
                                    "was taken from its reservation: it cannot go back to it")
        self.cols.state[rows] = S.RESERVED

    # -- references and pins ---------------------------------------------------------------
    def add_ref(self, client_id: int, vids) -> None:
        """A request of this client shares these blocks (they count as referenced, and are never
        evicted while referenced)."""
        holder = self.client(client_id)
        rows = self.usable_rows(client_id, vids)
        np.add.at(self.cols.refs, rows, 1)
        self._within_holds(self.cols.refs, rows, "references")
        holder.refs.update(rows.tolist())
        holder.ref_slot_bytes += self.ref_slots(rows)

    def raise_priority(self, rows: np.ndarray, priority: int) -> None:
        """Blocks used by a request of `priority` carry at least it, until nobody references or
        pins them (`_settle_priority`). While several requests hold a block it keeps the highest
        priority any of them raised it to: the table counts holders per client, not per request."""
        np.maximum.at(self.cols.priority, rows, np.int8(max(-128, min(127, int(priority)))))

    def _may_move(self, rows) -> None:
        """These rows may have become movable (entered RESIDENT, a tier, or lost a reference, a pin
        or their owner): the tiers they lie in count a change (`movable_epoch`)."""
        self.movable_epoch[self.cols.tier[rows]] += 1

    def pin(self, client_id: int, vids) -> np.ndarray:
        """Pin blocks for use: they will not move or be freed until unpinned. Returns the rows."""
        rows = self.usable_rows(client_id, vids)
        self.pin_rows(client_id, rows)
        return rows

    def pin_rows(self, client_id: int, rows: np.ndarray) -> None:
        """Pin rows that `usable_rows` already validated for this client."""
        holder = self.client(client_id)
        # Invariant: a pinned block never changes tier or state, so a block in flight cannot be
        # pinned (its move's end would move it under the pin). Moves end inside the manager call
        # that starts them, or, a drain piece's between requests, before any manager call that pins
        # one of its blocks (settling.py): only a caller of the table between begin_move and end_move sees this.
        moving = self.cols.state[rows] == int(S.MIGRATING)
        if any_true(moving):
            raise IllegalTransition(f"block {int(self.vids(rows[moving][:1])[0]):#x} is moving between tiers; "
                                    "pin it once its move has ended")
        listed = rows.tolist()
        if len(rows) > self.SMALL:
            np.add.at(self.cols.pins, rows, 1)
        else:
            for r in listed:
                self.cols.pins[r] += 1
        self._within_holds(self.cols.pins, rows, "pins")
        holder.pins.update(listed)  # counted in C, not one Python step per row

    def _owned_rows(self, client_id: int, vids) -> np.ndarray:
        self.client(client_id)
        rows = self.rows(vids)
        foreign = self.cols.owner[rows] != client_id
        if foreign.any():
            raise NotOwner(f"block {int(self.vids(rows[foreign][:1])[0]):#x} is not a private block of client {client_id}")
        return rows

    def seen_rows(self, client_id: int, vids) -> np.ndarray:
        """Rows whose places this client may be told (`places`): published blocks and its own private
        ones; another client's private block is NotOwner, as for a reference (its place was told)."""
        rows = self.rows(vids)
        owner = self.cols.owner[rows]
        foreign = (owner != client_id) & (owner != NO_CLIENT)
        if any_true(foreign):
            self.refuse_dead(rows[foreign])  # (a writer's pinned copy: the id to use, as `usable_rows` says)
            raise NotOwner(f"block {int(self.vids(rows[foreign][:1])[0]):#x} is a private block of another client")
        return rows

    def usable_rows(self, client_id: int, vids) -> np.ndarray:
        """Rows this client may reference or pin: published blocks, and its own private ones. A row
        dead to new holders is UnknownBlock first: a pinned copy keeps its writer as owner, and
        another client was told NotOwner, not the id to use instead (a review)."""
        rows = self.rows(vids)
        self.refuse_dead(rows)
        owner = self.cols.owner[rows]
        foreign = (owner != client_id) & (owner != NO_CLIENT)
        if any_true(foreign):
            raise NotOwner(f"block {int(self.vids(rows[foreign][:1])[0]):#x} is a private block of another client")
        self.refuse_reserved(rows)
        return rows

    def refuse_reserved(self, rows: np.ndarray, client_id: int | None = None) -> None:
        """A RESERVED block belongs to its reservation until `take` hands it out: no client may pin,
        reference or free it by id, or the reservation would later hand out or free a block it no
        longer holds alone (and its client's detach would fail half-way, leaking everything). With
        `client_id`, a block in another client's reservation is NotOwner (told to take it from the
        reservation, that client could not)."""
        reserved = self.cols.state[rows] == int(S.RESERVED)
        if any_true(reserved):
            if client_id is not None:
                foreign = reserved & (self.cols.owner[rows] != client_id)
                if any_true(foreign):
                    raise NotOwner(f"block {int(self.vids(rows[foreign][:1])[0]):#x} is in a reservation of "
                                   f"another client, not client {client_id}'s")
            raise ReservationError(f"block {int(self.vids(rows[reserved][:1])[0]):#x} is still in a reservation: "
                                   "take it from the reservation before using it")

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], layout_id: int | None = None) -> np.ndarray:
        """Rows of the longest cached prefix of a chain of content keys (stops at the first miss)."""
        if len(keys) <= self.SMALL:
            return self._lookup_small(keys, layout_id)
        found = self.keys.lookup(np.asarray(keys, dtype=np.uint64))
        ok = found != EMPTY
        if layout_id is not None and ok.any():
            ok[ok] = self.cols.layout[found[ok]] == layout_id
        state = self.cols.state[np.where(ok, found, 0)]
        ok &= (state == int(S.RESIDENT)) | (state == int(S.MIGRATING))
        n = len(ok) if ok.all() else int(np.argmin(ok))
        return found[:n]

    def _lookup_small(self, keys, layout_id: int | None) -> np.ndarray:
        c = self.cols
        out = []
        for key in keys:
            row = self.keys.get(int(key))
            if row == EMPTY or (layout_id is not None and int(c.layout[row]) != layout_id):
                break
            if int(c.state[row]) not in (S.RESIDENT, S.MIGRATING):
                break
            out.append(row)
        return np.array(out, dtype=np.int64)

    def touch(self, rows: np.ndarray, now: float | None = None) -> None:
        """Record an access (for the policy)."""
        self.cols.last_access[rows] = self.clock() if now is None else now
        self.cols.hits[rows] += 1

    # -- eviction --------------------------------------------------------------------------
    def evictable(self, rows: np.ndarray) -> np.ndarray:
        """Mask: cached blocks nobody holds, with no cached child (descendants go first)."""
        c = self.cols
        return ((c.state[rows] == int(S.RESIDENT)) & (c.refs[rows] == 0) & (c.pins[rows] == 0)
                & (c.key[rows] != 0) & (c.nkids[rows] == 0))

    def evict(self, rows: np.ndarray) -> None:
        """Drop cached blocks from the cache entirely (their bytes are gone). All of them or none:
        each must be cached with nobody holding it, and each cached child of one must be among
        `rows` (so a chain goes in one call, in any order)."""
        rows = np.asarray(rows, dtype=np.int64)
        no_repeats(rows, "evict")
        c = self.cols
        ok = ((c.state[rows] == int(S.RESIDENT)) & (c.refs[rows] == 0) & (c.pins[rows] == 0)
              & (c.key[rows] != 0))
        if len(rows) > 1:
            ok &= c.nkids[rows] == self._children_among(rows)
        else:
            ok &= c.nkids[rows] == 0
        if not ok.all():
            r = int(rows[int(np.argmin(ok))])
            raise PinnedBlock(f"block {int(self.vids(np.array([r]))[0]):#x} cannot be evicted: it is referenced, "
                              "pinned, not cached, migrating, or has cached children that stay")
        self._release_rows(rows)

    def _children_among(self, rows: np.ndarray) -> np.ndarray:
        """Per row of `rows` (distinct), how many of `rows` are its children."""
        parent = local_parents(rows, self.cols.parent[rows])
        return np.bincount(parent[parent >= 0], minlength=len(rows))

    def _release_rows(self, rows: np.ndarray) -> None:
        """Free rows (any legal state → FREE): unindex keys, unlink parents, give slots back."""
        c = self.cols
        check_transition(c.state[rows], S.FREE, self.vids(rows))
        # Whole-array steps (a Python step per row cost about 5 us a block of an NVMe eviction at a
        # million blocks); the rows are distinct (their callers check), their keys too (one row a key).
        keyed = c.key[rows]
        self.keys.remove_many(keyed[keyed != 0])
        linked = rows[c.parent[rows] != NO_ROW]
        parents = c.parent[linked].astype(np.int64)
        c.add_kids(c.tier[linked], parents, -1)
        add_at(c.nkids, parents, -1)
        for tier in self.allocators:
            here = rows[c.tier[rows] == int(tier)]
            self._free_slots(tier, here, c.offset[here])
        self.lost.difference_update(rows.tolist())
        for r in rows.tolist() if self.pinned_copies else ():
            self.pinned_copies.pop(r, None)
        c.give_rows(rows.astype(np.int32))

    # -- moves (two-phase; the mover drives these) ----------------------------------------
    def begin_move(self, rows: np.ndarray, dst: Tier) -> np.ndarray | None:
        """RESIDENT → MIGRATING and destination slots, or None (no room at dst; nothing changed)."""
        c = self.cols
        no_repeats(rows, "begin_move")  # one destination slot per block, one source slot freed
        if (c.pins[rows] > 0).any():
            raise PinnedBlock("a pinned block cannot be moved")
        check_transition(c.state[rows], S.MIGRATING, self.vids(rows))
        lids = c.layout[rows]
        dst_off = np.empty(len(rows), dtype=np.int64)
        taken: list[tuple[int, np.ndarray]] = []
        # Largest blocks first, as room is made for them (placement `_make_room_for_rows`): the room
        # counted for a larger size may be an empty slab of a smaller one, which that size's slots,
        # taken first, could cut into (its free list hands out that slab's slots first when they
        # were freed last). The batch then found no room, nor its retries, and nothing moved.
        for lid in sorted(distinct(lids), key=lambda l: -self.layouts[l].block_bytes):
            sel = lids == lid
            got = self.allocators[dst].alloc(self.layouts[lid].block_bytes, int(sel.sum()))
            if got is None:
                for l2, off in taken:
                    self.allocators[dst].free(self.layouts[l2].block_bytes, off)
                return None
            taken.append((lid, got))
            # Paired in order (sources and slots ascending): neighbours land side by side, one copy a run
            # (route.coalesce). The free lists hand slots out as freed, a demoted chain's tip first: the
            # blocks promoted into them moved a copy a block (bench swap --chain 1024: 1024 a batch).
            at = np.flatnonzero(sel)
            dst_off[at[np.argsort(c.offset[rows[at]], kind="stable")]] = np.sort(got)
        c.state[rows] = S.MIGRATING
        return dst_off

    def end_move(self, rows: np.ndarray, dst: Tier, dst_offsets: np.ndarray, ok: np.ndarray) -> None:
        """MIGRATING → RESIDENT. Where ok, the block now lives at dst (the source slot is freed);
        elsewhere it stays where it was (the destination slot is freed)."""
        c = self.cols
        self._require(rows, S.MIGRATING, "end_move")
        c.state[rows] = S.RESIDENT
        moved, failed = rows[ok], rows[~ok]
        self._free_slots(dst, failed, dst_offsets[~ok])
        if len(moved):
            src = c.tier[moved].copy()
            for t in distinct(src):
                sel = moved[src == t]
                self._free_slots(Tier(t), sel, c.offset[sel])
            parents = c.parent[moved]
            linked = parents != NO_ROW
            if linked.any():  # each moved child now counts in its parent's kids of dst, not of src
                up = parents[linked].astype(np.int64)
                c.add_kids(src[linked], up, -1)
                c.add_kids(np.full(len(up), int(dst)), up, 1)
            c.tier[moved] = dst
            c.offset[moved] = dst_offsets[ok]
        self._may_move(rows)  # RESIDENT again: in dst, or where they were
        orphans = [r for r in rows.tolist() if r in self._free_after_move] if self._free_after_move else []
        if orphans:
            self._free_after_move.difference_update(orphans)
            self._release_rows(np.array(orphans, dtype=np.int64))

    def on_slots_freed(self, tier: Tier, offsets: np.ndarray) -> None:
        """Hook for arenas that keep per-slot state (the NVMe checksums); the manager sets it."""

    def _free_slots(self, tier: Tier, rows: np.ndarray, offsets: np.ndarray) -> None:
        if not len(rows):
            return
        lids = self.cols.layout[rows]
        if len(self.layouts) == 1 or (lids == lids[0]).all():
            self.allocators[tier].free(self.layouts[int(lids[0])].block_bytes, offsets)
        else:
            for lid in distinct(lids):
                sel = lids == lid
                self.allocators[tier].free(self.layouts[lid].block_bytes, offsets[sel])
        self.on_slots_freed(tier, offsets)

    # -- accounting ------------------------------------------------------------------------
    def pending_frees(self) -> frozenset[int]:
        """Private blocks that lost their last reference mid-move; freed when the move completes."""
        return frozenset(self._free_after_move)

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.cols.state != int(S.FREE))

    def tier_blocks(self) -> dict[Tier, int]:
        """Slots per tier that its allocator handed out (no scan of the table; stats and metrics
        ask often): the blocks there, and a move's destination slot too while its copy runs
        (drain pieces and deferred promotions leave copies in flight between calls: the manager's
        `stats` takes those off, `Placement.in_flight_blocks`)."""
        return {t: self.allocators[t].used_slots if t in self.allocators else 0 for t in Tier}
