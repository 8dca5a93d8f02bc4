"""Prefetch: promote the blocks a request will read next before it asks for them.

While a request reads its cached prefix, the prefetcher keeps `kv_block.prefetch_window` blocks
beyond the read position on their way up to HBM, so the next read is served from HBM without
waiting for a swap-in. In the daemon a reader's lookup names the chain it will read (`follow`);
each of its acquires moves its read position (`read_to`), and the window beyond it comes up once
the acquire is answered (`run_queued`: after the reply, or at the next tick), while the engine
computes on what it read. The window doubles (up to `max_factor` × the configured value) each time it
is used while HBM is filled below its low watermark, and falls back to the configured value as soon
as HBM is above its high watermark: prefetching into a full tier only pushes out blocks that other
requests are about to read.

Accounting: a prefetched block is *useful* when it is read while still in HBM, *wasted* when it left
HBM (demoted, evicted) before its read or was never read (still unread a step after its reader
left); each prefetch counts once either way. A block that a reader's own lookup brought up (the
lookup waited for the copy) is, for the HBM hit rate, that reader's read from the tier it came from,
whoever reads it first, until the second step after the lookup (`_claims`; its read comes right after
the lookup it waited in, and one later waited for nothing: a hit): `reading` says which those are.
A block prefetched since the last tick is left in HBM by that tick's rebalance (its score is old: a
prefetch is not a read), so that the read it was brought up for finds it there.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from dflash2.table import BlockState
from dflash2.table.table import ROW_MASK
from dflash2.tiers import Tier


CHAINS_PER_READER = 16  # chains followed per reader: the requests an engine reads at once
PROTECT_WINDOWS = 4  # windows past the read position kept out of the room a prefetch makes


@dataclasses.dataclass(frozen=True)
class PrefetchedRead:
    """The prefetched blocks among a read (`Prefetcher.peek`): each vid, whether it was still in HBM
    when the read came (useful) or had left (wasted), and those the reader's own lookup brought up
    to HBM, by the tier each came from (the reader waited for those copies: no HBM hits)."""

    vids: list[int]
    in_hbm: list[bool]
    own: dict[int, Tier]
    reader: int | None = None


class Chain:
    """A followed chain: its vids in read order, and a sorted copy to find reads in (log time),
    made when a read is first looked for on it (a lookup whose chain is never read sorts nothing)."""

    def __init__(self, vids: np.ndarray):
        self.vids = vids
        self._order: np.ndarray | None = None
        self._sorted: np.ndarray | None = None

    def furthest(self, read: np.ndarray) -> int | None:
        """The furthest position among `read` on this chain, or None when none lies on it."""
        if self._order is None:
            self._order = np.argsort(self.vids, kind="stable")
            self._sorted = self.vids[self._order]
        at = np.searchsorted(self._sorted, read)
        inside = at < len(self._sorted)  # a read past every vid of the chain is not on it
        at = at[inside]
        hit = at[self._sorted[at] == read[inside]]
        return int(self._order[hit].max()) if len(hit) else None


class Prefetcher:
    def __init__(self, manager, window: int, *, max_factor: int = 16):
        if window < 0:
            raise ValueError(f"prefetch window must be >= 0, got {window}")
        self.manager = manager
        self.base = window
        self.window = window
        self.max_window = window * max_factor
        self.useful = 0
        self.wasted = 0
        # vids promoted by the prefetcher, not yet read -> (the tier each came from, the reader it was
        # brought up for, None when unknown, whether that reader's lookup waited for it, and the step
        # it came up in: the wait is that reader's claim until the second step after, `_claims`)
        self._pending: dict[int, tuple[int, int | None, bool, int]] = {}
        # A reader's lookup waited for these copies, and another reader read them first (settling
        # them): reader -> {vid: (the tier it came from, the step its lookup brought it up in)}, its own
        # read of them still to count as from there (before, the hit rate hung on who read first, a
        # review). Until the second step after that lookup (`_settle_owed`), or sooner as the block
        # leaves HBM.
        self._owed: dict[int, dict[int, tuple[int, int]]] = {}
        self._steps = 0  # settles so far
        # Prefetched for a reader that left, still in HBM: a read before the next step is useful,
        # and those left unread then were wasted (`drop`).
        self._orphans: set[int] = set()
        # vids prefetched since the last settle (the daemon's tick): the tick's rebalance leaves
        # them in HBM for their read. One tick only: a block nobody reads is cold like any other.
        self._fresh: set[int] = set()
        manager.placement.awaiting_read.append(self._fresh_rows)
        # The chains each reader (client) reads, from its last CHAINS_PER_READER lookups (an engine
        # serves several requests at once): each as a Chain of int64 vids (a lookup may name 65,536);
        # and the windows due ((reader, chain) -> read position), run after the reply.
        self._chains: dict[int, OrderedDict[int, Chain]] = {}
        self._queued: dict[tuple[int, int], int] = {}
        self._next_chain = 0

    # -- window ----------------------------------------------------------------------------
    def _adapt(self) -> int:
        """The window for this step, from HBM's fill against its watermarks."""
        placement = self.manager.placement
        used = placement.used_fraction(Tier.HBM)
        wm = placement.watermarks[Tier.HBM]
        if used >= wm.high:
            self.window = self.base
        elif used < wm.low:
            self.window = min(self.max_window, max(self.base, 2 * self.window))
        return self.window

    def window_now(self) -> int:
        """The window as `stats` reports it, nothing changed: the last prefetch's, or the base once
        HBM is at or above its high watermark (the next prefetch falls back to it). (The last
        prefetch's window alone, a doubled one while HBM had since filled, stayed the gauge's until
        a prefetch ran, a review.)"""
        placement = self.manager.placement
        if placement.used_fraction(Tier.HBM) >= placement.watermarks[Tier.HBM].high:
            return self.base
        return self.window

    # -- the request's read loop -----------------------------------------------------------
    def ahead(self, vids: Sequence[int], position: int, reader: int | None = None, *, waits: bool = True) -> int:
        """The request will read vids[position:] next: bring the window's blocks up to HBM.
        `reader`: the client they come up for; `waits`: it waits for them (its lookup asks: its
        reads of them are no HBM hits). Returns the number of blocks promoted."""
        if not self.base or position >= len(vids):
            return 0
        window = list(vids[position: position + self._adapt()])
        rows, live = self._rows(window)
        table = self.manager.table
        c = table.cols
        rows = rows[live]
        want = rows[(c.tier[rows] > int(Tier.HBM)) & (c.pins[rows] == 0)
                    & (c.state[rows] == int(BlockState.RESIDENT))]
        if len(want) and self.manager.placement.reads_back_off(Tier.NVME):
            want = want[c.tier[want] != int(Tier.NVME)]  # (a failing disk is not read: backoff.py)
        if not len(want):
            return 0
        # promote keeps the window's prefix (the blocks read first, already in HBM) in place, and
        # the room it makes never takes the rest of the chain this reader is about to read.
        ahead_rows, ahead_live = self._rows(list(vids[position:]))
        # ... nor the windows brought up before that still wait for their readers (`_waiting_rows`).
        protect = np.concatenate([ahead_rows[ahead_live], self._waiting_rows()])
        placement = self.manager.placement
        # Only the part HBM could hold comes up (its room made for it alone), the blocks read first.
        want = want[:placement.fitting_prefix(want, Tier.HBM, protect=protect)]
        if not len(want):
            return 0
        origin = c.tier[want]  # read before the promotion moves them
        vids_wanted = table.vids(want)

        def landed(ok: np.ndarray) -> int:
            done = vids_wanted[ok].tolist()
            # Still pending yet below HBM until now: an earlier prefetch of it left HBM unread (no
            # settle between): that one was wasted, once; this one is counted on its own.
            again = [v for v in done if v in self._pending]
            self.wasted += len(again)
            if again:  # (a parked acquire's `left` of it was that earlier one's: `came_up_again`)
                self.manager.came_up_again(again)
            self._pending.update((v, (t, reader, waits, self._steps)) for v, t in zip(done, origin[ok].tolist()))
            self._orphans.difference_update(done)  # (brought up again for a reader here: its own, a review)
            self._fresh.update(done)
            return len(done)
        # A guess: its room comes from idle blocks only, never from a running request's. Blocks read
        # from NVMe while the daemon serves come up while it answers other calls (`promote_later`):
        # counted when they land.
        if placement.promote_later(want, Tier.HBM, landed, protect=protect, idle_only=True):
            return 0
        return landed(placement.promote(want, Tier.HBM, protect=protect, idle_only=True))

    def _waiting_rows(self) -> np.ndarray:
        """Rows of the prefetched blocks that still wait for their read (pending; not those whose reader
        left): another prefetch's room is never made from them, however many steps ago they came up.
        Kept out of it only until the next step (`_fresh`), which may come a moment after, a window
        then was, its score old, the first block another reader's prefetch pushed out unread (a
        review). A read's room still takes them after idle blocks, and a drain after one step."""
        # (Vectorised: a comprehension over the pending vids took 5 ms of each prefetch at 50,000
        # pending, a review.)
        mine = np.asarray(list(self._pending), dtype=np.int64)
        if len(mine) and self._orphans:
            mine = mine[~np.isin(mine, np.asarray(list(self._orphans), dtype=np.int64))]
        if not len(mine):
            return np.empty(0, dtype=np.int64)
        rows, live = self._rows(mine)
        return rows[live]

    def follow(self, reader: int, vids: Sequence[int]) -> None:
        """`reader`'s lookup found this chain: a request of it reads it from the start next."""
        if not self.base:
            return
        chains = self._chains.setdefault(reader, OrderedDict())
        self._next_chain += 1
        chains[self._next_chain] = Chain(np.array(vids, dtype=np.int64))
        while len(chains) > CHAINS_PER_READER:
            self._queued.pop((reader, next(iter(chains))), None)
            chains.popitem(last=False)

    def read_to(self, reader: int, vids: Sequence[int]) -> None:
        """`reader` has read (acquired) these blocks: the window beyond the furthest of them, on the
        newest of its chains that holds them, is due."""
        chains = self._chains.get(reader)
        if not chains:
            return
        read = np.asarray(vids, dtype=np.int64)
        for key in reversed(chains):
            chain = chains[key]
            furthest = chain.furthest(read)
            if furthest is not None:
                break
        else:
            return
        position = furthest + 1
        if position >= len(chain.vids):  # read to its end: nothing more to bring up for it
            del chains[key]
            self._queued.pop((reader, key), None)
        else:
            self._queued[(reader, key)] = position

    def run_queued(self) -> int:
        """Bring up the due windows (the readers did not wait for these: their reads of them are
        HBM hits). Returns the blocks promoted (not those still on their way up from NVMe)."""
        done = 0
        # One window's reads at a time left in flight: the next window's room must not be made
        # while they run (rebalance.py); the rest run after a later reply, or at the next tick.
        while self._queued and not self.manager.placement.in_flight:
            (reader, key), position = self._queued.popitem()
            chain = self._chains.get(reader, {}).get(key)
            if chain is not None:
                # The window and what follows it closely: its room is never made from those (O(window)
                # per read, not O(chain): a 65,536-block prefix is read in many acquires).
                near = chain.vids[position: position + PROTECT_WINDOWS * max(1, self.max_window)]
                done += self.ahead(near.tolist(), 0, reader, waits=False)
        return done

    @property
    def due(self) -> bool:
        return bool(self._queued)

    def drop(self, reader: int) -> None:
        """The reader left (detached, lease lapsed): what was prefetched for it and is not read by the
        next step (by another reader) was wasted. Before, it stayed pending for as long as HBM had
        room, counted neither way; then, counted wasted at once, another reader's read of it from HBM
        right after was no useful prefetch, though the same read before the detach was (reviews)."""
        for key in self._chains.pop(reader, {}):
            self._queued.pop((reader, key), None)
        self._owed.pop(reader, None)
        for v, (origin, by, _, step) in list(self._pending.items()):
            if by == reader:
                self._pending[v] = (origin, None, False, step)
                self._orphans.add(v)

    def reading(self, vids: Sequence[int], reader: int | None = None) -> Counter:
        """The request is about to read these blocks: settle the prefetches among them (`peek`,
        then `count`). Returns, by the tier they came from, how many of them `reader`'s own lookup
        brought up to HBM (it waited for those copies: they are no HBM hits)."""
        read = self.peek(vids, reader)
        if read is None:
            return Counter()
        self.count(read)
        return Counter(read.own.values())

    def left_hbm(self, rows: np.ndarray) -> set[int]:
        """The pending prefetches among these rows that lie below HBM now: each left HBM unread (a
        waste), whatever brings it back up before the read that settles it (`peek`'s `left`)."""
        if not self._pending:
            return set()
        table = self.manager.table
        below = rows[table.cols.tier[rows] > int(Tier.HBM)]
        return {v for v in table.vids(below).tolist() if v in self._pending}

    def peek(self, vids: Sequence[int], reader: int | None = None, left: set[int] | frozenset = frozenset()
             ) -> PrefetchedRead | None:
        """What reading these blocks would settle, nothing settled yet (`count` does, once the read
        has succeeded: an acquire that finds no room reads nothing, and its retry must find the
        same prefetches pending). Looked at before the reader's own promotion moves blocks up: `left`,
        those `left_hbm` found below HBM before the read waited for or promoted anything, are not in
        HBM though they lie there now (a parked acquire runs again once its own NVMe reads have
        landed: it counted a prefetch that had left HBM unread useful, a review)."""
        owed = self._owed.get(reader, {}) if reader is not None else {}
        mine = list(dict.fromkeys(v for v in vids if v in self._pending or v in owed))  # a vid read twice settles once
        if not mine:
            return None
        rows, live = self._rows(mine)
        in_hbm = (live & (self.manager.table.cols.tier[rows] == int(Tier.HBM))).tolist()
        if left:
            in_hbm = [there and v not in left for v, there in zip(mine, in_hbm)]
        own = {}
        for v, there in zip(mine, in_hbm):
            origin, by, waited, step = self._pending.get(v) or (owed[v][0], reader, True, owed[v][1])
            if there and reader is not None and by == reader and self._claims(waited, step):
                own[v] = Tier(origin)
        return PrefetchedRead(mine, in_hbm, own, reader)

    def count(self, read: PrefetchedRead) -> None:
        """The read `peek` looked at succeeded: its prefetches were useful (in HBM when it came)
        or wasted (they had left it), and are settled."""
        owed = self._owed.get(read.reader, {}) if read.reader is not None else {}
        for v, there in zip(read.vids, read.in_hbm):
            if owed.pop(v, None) is not None and v not in self._pending:
                continue  # (settled by the read that came first: here only its waiting reader's own)
            entry = self._pending.pop(v, None)
            if entry is None:
                continue
            self._orphans.discard(v)
            self.useful += there
            self.wasted += not there
            origin, by, waited, step = entry
            if there and self._claims(waited, step) and by is not None and by != read.reader:
                self._owed.setdefault(by, {})[v] = (origin, step)  # its waiting reader reads it still
        if read.reader in self._owed and not owed:
            del self._owed[read.reader]

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def settles(self) -> bool:
        """Whether a read may settle something here (a prefetch pending, or a waiting reader's debt)."""
        return bool(self._pending or self._owed)

    def settle(self) -> None:
        """Between reads (the daemon's tick): a prefetched block that left HBM unread was wasted."""
        self._fresh.clear()
        self._settle_owed()
        orphans = [v for v in self._orphans if v in self._pending]  # (their reader left: unread now, for nothing)
        self.wasted += len(orphans)
        for v in orphans:
            del self._pending[v]
        self._orphans.clear()
        self.settle_gone()

    def settle_gone(self) -> None:
        """The pending prefetches that left HBM unread were wasted: counted now (each step, and before
        the figures are reported: `stats()`; counted at the steps alone, a window pushed out of HBM read
        as pending, none of it wasted, for up to a step's interval, which may be an hour, a review)."""
        if not self._pending:
            return
        mine = list(self._pending)
        rows, live = self._rows(mine)
        gone = ~(live & (self.manager.table.cols.tier[rows] == int(Tier.HBM)))
        self.wasted += int(gone.sum())
        for v, g in zip(mine, gone.tolist()):
            if g:
                del self._pending[v]

    def _claims(self, waited: bool, step: int) -> bool:
        """Whether a reader's lookup that waited for a copy made in `step` still has its read of it
        count from where it came: until the second step after (its read comes right after the lookup;
        one later waited for nothing). Kept until read, a lookup with no acquire after it (the request
        went away) made the same client's read seconds later, of blocks that had sat in HBM, a DRAM
        read (a review). The prefetch is useful either way: read while in HBM."""
        return waited and step >= self._steps - 1

    def _settle_owed(self) -> None:
        """A waiting reader's debt ends at the second step after its lookup, or sooner as its block
        leaves HBM (its read then counts from where the block lies): its read comes right after the
        lookup it waited in, and a later request's read of blocks it finds in HBM waited for nothing
        (kept until read, a debt outlived its reason, a review; a block that leaves HBM and comes back
        within those steps still counts it)."""
        self._steps += 1
        for reader, owed in list(self._owed.items()):
            vids = list(owed)
            rows, live = self._rows(vids)
            there = (live & (self.manager.table.cols.tier[rows] == int(Tier.HBM))).tolist()
            for v, here in zip(vids, there):
                if not here or not self._claims(True, owed[v][1]):
                    del owed[v]
            if not owed:
                del self._owed[reader]

    def finish(self) -> None:
        """The request is done reading: whatever it did not read was prefetched for nothing."""
        self.wasted += len(self._pending)
        self._pending.clear()
        self._owed.clear()
        self._orphans.clear()
        self._fresh.clear()

    def _fresh_rows(self) -> np.ndarray:
        """Rows of the blocks prefetched since the last settle, not yet read and still in HBM."""
        mine = [v for v in self._fresh if v in self._pending]
        if not mine:
            return np.empty(0, dtype=np.int64)
        rows, live = self._rows(mine)
        rows = rows[live]
        return rows[self.manager.table.cols.tier[rows] == int(Tier.HBM)]

    def _rows(self, vids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the vids and a mask of those still live (an evicted block's vid is stale)."""
        v = np.asarray(vids, dtype=np.int64)
        rows = v & ROW_MASK
        c = self.manager.table.cols
        live = (rows < c.capacity)
        live[live] = (c.gen[rows[live]] == ((v[live] >> 32) & ROW_MASK)) & (c.state[rows[live]] != int(BlockState.FREE))
        return np.where(live, rows, 0), live
