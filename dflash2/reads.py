"""Reading blocks: lookups of prefix chains, acquires that pin blocks in the tier a reader reads
from (promoting, prefix first, those below it), the prefetch windows that follow a reader, and the
hit accounting of each read. A part of BlockManager (a mixin over its table, placement, prefetcher,
access stats and read costs), apart because a read's path is a job of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dflash2.access import reads_by_origin
from dflash2.acquire_checks import refuse_dropped, refuse_never_fits, refuse_unmovable
from dflash2.counts import any_true
from dflash2.errors import CopiesRunning
from dflash2.keys import key_array
from dflash2.reservations.waits import untaken_room
from dflash2.settling import any_in_flight, settle_if
from dflash2.table import BlockState
from dflash2.tiers import Tier

if TYPE_CHECKING:
    from dflash2.manager import Place


def _check_priority(priority) -> None:
    """ValueError for a reading request's priority that is not an integer (None: none given), before
    anything changes: raised as the blocks' priority was raised, after their pins or references were
    taken (a NaN, a string), the call failed and what it took stayed held (a review)."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, (int, np.integer))):
        raise ValueError(f"priority must be an integer (or None), got {priority!r}")


class Reads:
    """BlockManager's reads (the attributes they use are BlockManager's)."""

    def lookup(self, keys: Sequence[int], layout_id: int | None = None) -> list[Place]:
        """The longest cached prefix of a chain of content keys, and where each block lies."""
        return self.places_of_rows(self.lookup_rows(keys, layout_id))

    def lookup_rows(self, keys: Sequence[int], layout_id: int | None = None, *,
                    reader: Tier = Tier.HBM, client: int | None = None, probe: bool = False) -> np.ndarray:
        """Rows of the longest cached prefix. A reader that reads from HBM gets the first window's
        blocks prefetched toward it; a host-side reader (reader=DRAM) reads where blocks lie. For a
        client whose engine gave its prefill rate, the prefix ends before the first block that
        would load to `reader` more slowly than the engine recomputes it (not offered as a hit).
        `probe`: a question about blocks (is the page before mine cached? which of these pages are
        cached already?), not a request reading its prefix: the duel does not replay it, and the
        lookup figures do not count it (an sglang backup's lookup, the read's lookup after the hit
        query's and the parent's probe counted each page two or three times, a review)."""
        keys = key_array(keys)  # (a float key was looked up truncated, a negative one missed)
        rows = self.table.lookup(keys, layout_id)
        if self.placement.in_flight and self._meets_flight(rows, reader, probe):
            self.placement.settle()  # (`settled`) it answers where they are, and may prefetch them
            rows = self.table.lookup(keys, layout_id)
        if self.duel is not None and not probe:  # (after the settle: a parked lookup runs again, whole)
            self.duel.offer(keys, layout_id, host_reader=reader != Tier.HBM)
        # The prefix offered ends before the first block not worth loading: one that loads more
        # slowly than the engine recomputes it, or one on a failing disk that backs off after
        # failed reads (backoff.py), which the engine recomputes at once instead.
        offered = None
        if len(rows) and self.placement.reads_back_off(Tier.NVME):
            offered = self.table.cols.tier[rows] != int(Tier.NVME)
        if len(rows) and self.read_cost.judges(client):
            c = self.table.cols
            worth = self.read_cost.worth(client, self.table.layouts, c.layout[rows], c.tier[rows], reader)
            offered = worth if offered is None else offered & worth
        if offered is not None and not offered.all():
            cut = int(np.argmin(offered))
            self.access.withheld += 0 if probe else len(rows) - cut
            rows = rows[:cut]
        # A probe asks about blocks; no request reads them next: neither prefetched nor followed.
        if (reader == Tier.HBM and not probe and self.prefetcher.base
                and self._below_hbm(rows[: self.prefetcher.max_window])):
            self._follow_up("the prefetch of a lookup",
                            lambda: self.prefetcher.ahead(self.table.vids(rows), 0, reader=client))
            # The prefetch may have dropped blocks of the prefix (an NVMe read that failed, and what
            # hung below it; or room made below HBM): the answer names only blocks still cached,
            # never a freed row (no tier; its vid would be the next block's in that row).
            c = self.table.cols
            cached = (c.state[rows] != int(BlockState.FREE)) & (c.key[rows] != 0)
            if not cached.all():
                rows = rows[: int(np.argmin(cached))]
        if reader == Tier.HBM and not probe and client is not None and len(rows):
            self.prefetcher.follow(client, self.table.vids(rows))  # the window follows its reads
        if not probe:
            self.access.lookups += 1
            self.access.lookup_blocks_found += len(rows)
            self.access.misses += len(keys) - len(rows)
        return rows

    def acquire(self, client: int, vids, up_to: Tier = Tier.HBM, priority: int | None = None, *,
                call: int | None = None) -> list[Place] | None:
        """Pin blocks for use in `up_to` or a faster tier, promoting (prefix first) those that lie
        below it. HBM by default; a host-side reader (a CPU cache such as sglang's host pool) asks
        for DRAM and reads blocks in DRAM where they are. All or nothing: None when the tier cannot
        be given room for them now (nothing is pinned then); NeverFits when the blocks that must come
        up exceed the whole tier. `call`: the daemon's call id, which names a call parked on copies
        across its runs (`acquire_rows`); in-process callers, which wait, pass none."""
        rows = self.acquire_rows(client, vids, up_to, priority, call=call)
        return None if rows is None else self.places_of_rows(rows)

    def acquire_rows(self, client: int, vids, up_to: Tier = Tier.HBM, priority: int | None = None, *,
                     call: int | None = None) -> np.ndarray | None:
        """`acquire`, answering rows (`_acquire_rows`). A call parked on copies (CopiesRunning) keeps
        the record of what it waited for, for its run again; one that ended otherwise (an UnknownBlock
        after its own promotion settled) leaves none: its record stayed, and the client's next acquire
        was taken for that call run again (a copy failure on record refused untried, a review). The
        record is kept per call, (client, call id): a raw-protocol client pipelines up to 64 calls, and
        its second acquire, sent while its first was parked on NVMe reads, took the first's record as
        its own (the parked call's run again counted its reads from NVMe as HBM hits, a review)."""
        try:
            return self._acquire_rows(client, vids, up_to, priority, call)
        except CopiesRunning:
            raise
        except BaseException:
            self.end_call(client, call)  # (the record is this call's: another's, parked, keeps its own)
            raise

    def end_call(self, client: int, call: int | None = None) -> None:
        """`client`'s acquire `call` (its call id) parked on copies will not run again (it failed, or
        the client gave it up)."""
        self._came_from.pop((client, call), None)

    def came_up_again(self, vids: Sequence[int]) -> None:
        """A prefetch brought `vids` up to HBM again: no acquire parked on its copies counts them among
        the prefetches that had left HBM unread (its `left`: that was an earlier prefetch of them, counted
        wasted when it left; this one has not left HBM, a review)."""
        for _, left in self._came_from.values():
            left.difference_update(vids)

    def _park_record(self, who: tuple[int, int | None], rows: np.ndarray, came: dict[int, int], left: set[int]) -> None:
        """Note what the call `who` (client, call id), about to wait for copies, read from where: `came`,
        and the blocks its reader's lookup waited for the prefetch of (`Prefetcher.peek`'s `own`), as
        claimed now: the claim lapses two background steps on, and a call parked on slow NVMe reads
        meanwhile counted those blocks, whose swap-in its request had waited for, as HBM hits (a review
        of the claim's lapse). A new dict: the caller's `came` stays its own."""
        settles = self.prefetcher.settles
        claimed = self.prefetcher.peek(self.table.vids(rows).tolist(), who[0], left) if settles else None
        own = {} if claimed is None else {v: int(t) for v, t in claimed.own.items()}
        self._came_from[who] = {**own, **came}, left

    def _acquire_rows(self, client: int, vids, up_to: Tier = Tier.HBM,
                      priority: int | None = None, call: int | None = None) -> np.ndarray | None:
        """`acquire`, answering rows. The room a promotion needs is made from idle blocks first,
        then from running requests' blocks; with the reading request's `priority` given, only those
        of that priority or lower (never a higher-priority request's: its own reservation could not
        take them either), and the blocks read carry at least that priority while held."""
        if up_to == Tier.NVME or up_to not in self.specs:
            raise ValueError(f"acquire can pin blocks in a memory tier this daemon has, not {Tier(up_to).label}")
        _check_priority(priority)
        rows = self.table.usable_rows(client, vids)  # validates before anything moves
        # Where the blocks it waited for came from (vid -> tier), kept while it is parked on them:
        # for the hit rates, reads from those tiers, though they lie in `up_to` once it runs again.
        # So are the prefetches among them that had left HBM unread (`left_hbm`: wasted, though
        # they lie in HBM once it runs again), looked at before it waits for or promotes anything.
        who = client, call  # (the call's own record, never another parked acquire's of the client)
        parked = self._came_from.pop(who, None)
        if parked is None:  # a new call tries anew the blocks whose copy failed before it (as it begins: it
            self.mover.forget_copy_failed(rows)  # may park below on a prefetch's copies, a review)
        came, left = parked if parked is not None and self.placement.own_parks else ({}, set())
        left |= self.prefetcher.left_hbm(rows)
        c = self.table.cols
        flying = (c.state[rows] == int(BlockState.MIGRATING)) & (c.tier[rows] > int(up_to))
        # A block in flight cannot be pinned, and a promotion is placement work: either settles the
        # drain copies first. A read of blocks already where it reads them leaves them running.
        if any_true(flying):
            # It waits for their copies (a prefetch's window still on its way up from NVMe, another
            # reader's promotion): DESIGN's HBM hit is a read served "without waiting for a
            # swap-in", so each is a read from the tier it is coming from. Parked on them, the call
            # counts as parked on copies of its own (it runs again with `came`).
            came.update(zip(self.table.vids(rows[flying]).tolist(), c.tier[rows[flying]].tolist()))
            self._park_record(who, rows, came, left)
            try:
                settle_if(self, rows, placing=True)
            except CopiesRunning:
                raise CopiesRunning(own=True) from None
            del self._came_from[who]
        else:
            settle_if(self, rows, placing=any_true(c.tier[rows] > int(up_to)))
        refuse_dropped(self.table, rows, vids)  # by a read that just ended (a lookup's prefetch from NVMe)
        tiers = self.table.cols.tier[rows]
        below_rows = tiers > int(up_to)  # (as found: the blocks this acquire reads from below `up_to`)
        promoting = any_true(below_rows)
        if promoting:
            # Refused by name before anything moves, not "no room now" (None), which a retry could
            # never mend: a block pinned below, or still being written, and a promotion (the cached
            # prefix it brings up first included) that can never fit.
            refuse_unmovable(self.table, rows, tiers, below_rows, up_to)
            chain = self.placement.with_ancestors(rows, up_to)  # (once: `promote` below takes it too)
            refuse_never_fits(self.table, chain, rows, tiers, up_to, self.placement.beyond_read(chain, rows, up_to))
            # Run again after it was parked on its own promotion: a copy that failed meanwhile (the
            # loop settled it) is said, not tried again, the call parked again on it (a review: up to 4
            # disk reads and GPU copies for one acquire). A new call tries them anew (above).
            if parked is not None and any_true(self.mover.copy_failed_among(rows[below_rows])):
                return self._copy_failed(up_to, rows[below_rows])
        below = None if priority is None else int(priority) + 1  # (a numpy int64's top wrapped: nothing below it)
        if promoting and not self.placement.could_promote(rows, up_to, below_priority=below, chain=chain):
            return self._no_room(up_to, priority, made=False)  # (none made: it would move blocks for nothing)
        if promoting and self.placement.parks_own():
            # Its reads from NVMe, and the writes to NVMe its room takes, run while the daemon
            # answers other calls; this call is parked meanwhile (unless they end within
            # PARK_AFTER_S: rebalance.py `end_soon`) and runs again, whole, once they have ended
            # (settling.py).
            came.update(zip(self.table.vids(rows[below_rows]).tolist(), tiers[below_rows].tolist()))
            self._park_record(who, rows, came, left)
            with self.placement.own_writes():
                if self.placement.promote_later(rows, up_to, below_priority=below):
                    chain = None  # (blocks may have been dropped since: walked again)
                    if not self.placement.end_soon():
                        raise CopiesRunning(own=True)
                    self.placement.settle()
                    refuse_dropped(self.table, rows, vids)
            del self._came_from[who]  # (promoted at once: the tiers below say where from)
            if any_true(self.mover.copy_failed_among(rows[below_rows])):
                return self._copy_failed(up_to, rows[below_rows])  # (settled just now: not copied again)
        now = self.table.clock()
        vids_read = self.table.vids(rows)  # (the same after the promotion below: it moves rows, it frees none it keeps)
        # The prefetches among the blocks read: those the reader's own lookup brought up are reads
        # from where they came from too (settled only once the read succeeds: `count` below).
        prefetched = self.prefetcher.peek(vids_read.tolist(), client, left) if self.prefetcher.settles else None
        if prefetched is not None and prefetched.own:
            came = {**prefetched.own, **came}  # (a block in both is one read, from where it came)
        counts = reads_by_origin(tiers, vids_read, up_to, came)
        if promoting:
            ok = self.placement.promote(rows, up_to, below_priority=below, chain=chain)
            if not ok.all():
                refuse_dropped(self.table, rows[~ok], np.asarray(vids)[~ok])
                if any_true(self.mover.copy_failed_among(rows[~ok])):
                    return self._copy_failed(up_to, rows[~ok])  # (not room: HBM may be empty)
                return self._no_room(up_to, priority, made=True)
        # Counted once the blocks are there, by the policy too: a read whose NVMe copy failed
        # (UnknownBlock) or found no room (None) served nothing, and its retry would count the same
        # blocks again (each failed try raised an engine's retried key a frequency class, a review).
        # Pinned first: the policy's score of the rows then has their pins and priority (heat's stage
        # and priority terms; told before them, its cache lacked them until its next pass, a review).
        self.table.pin_rows(client, rows)
        if priority is not None:
            self.table.raise_priority(rows, priority)
        self.table.touch(rows, now)
        self.policy.on_access(self.table, rows, now)
        (self.access.reads if up_to == Tier.HBM else self.access.host_reads).update(+counts)
        if prefetched is not None:
            self.prefetcher.count(prefetched)
        if up_to == Tier.HBM:
            self.prefetcher.read_to(client, vids_read.tolist())  # runs after the reply
        return rows

    def _no_room(self, up_to: Tier, priority: int | None, made: bool) -> None:
        """An acquire answers None: its client is told why and what to do (`acquire_refusal`, the
        daemon's reply; it said "could not be given room for them now" whatever the cause, a review),
        and the refusal is counted and logged (refusals.py)."""
        where = "" if up_to == Tier.HBM else " (a block on NVMe is read in DRAM)"
        if made:
            why = "the room made fell short; retry later, or recompute them"
        else:
            held = "" if priority is None else f", or used by requests of priority above {priority}"
            instead = "" if priority is None else ", or acquire without a priority"
            # Granted reservations' untaken slots hold HBM too (RESERVED: no demotion frees them): an
            # HBM of them alone was said to be full of blocks being written or pinned (a review).
            count, untaken = untaken_room(self.admission.granted.values()) if up_to == Tier.HBM else (0, 0)
            also = "" if not untaken else f", and of {count} granted reservation(s) not yet taken ({untaken} bytes)"
            why = (f"it is full of blocks that cannot move now (being written or pinned{held}){also}, so nothing "
                   f"was moved; retry once they are released{', freed, taken or cancelled' if untaken else ' or freed'}"
                   f"{instead}, or recompute them{self.set_aside_note(up_to)}")
        self.acquire_refusal = f"{up_to.name} could not be given room for them now{where}: {why}"
        self.refusals.note("acquire", "tier_full", self.acquire_refusal)
        return None

    def _copy_failed(self, up_to: Tier, rows: np.ndarray) -> None:
        """An acquire answers None because the copy of some of its blocks up to `up_to` failed after
        their source was read (a refused launch, an out-of-memory: `Mover.copy_failed`); they stay
        where they were. Told so, not "the room made fell short" (tier_full, a review); a retry
        tries them again."""
        failed = rows[self.mover.copy_failed_among(rows)]
        self.mover.forget_copy_failed(failed)
        src = Tier(int(self.table.cols.tier[failed].max()))
        self.acquire_refusal = (f"the copy of {len(failed)} of them from {src.name} into {up_to.name} failed (the "
                                f"transfer log names the error; the blocks stay on {src.name}): retry later, or "
                                "recompute them")
        self.refusals.note("acquire", "copy_failed", self.acquire_refusal)
        return None

    def run_prefetch(self) -> None:
        """The windows due since the last acquires (`Prefetcher.read_to`): the daemon runs this once
        it has answered the acquire, so that the reader computes while they come up; the tick too.
        (After every reply: it settles the drain copies in flight only when a window is due.)"""
        if self.prefetcher.due:
            if self.placement.read_later and self.copies_running():
                return  # the loop never waits for copies here: the windows stay due until they have ended
            self.settle()  # a prefetch promotes (`settled`)
            self._follow_up("a prefetch ahead of a read", self.prefetcher.run_queued)

    def release(self, client: int, vids) -> None:
        """Unpin: a pinned block is never in flight (table.py `pin_rows`), so no drain copy is met.
        Blocks unpinned may be what the waiting head of the queue needs moved (`_grant_if_movable`)."""
        # Rows first: the unpin may free a block (a pinned copy, a lost block), whose id is dead after.
        rows = self.table.rows(vids) if self.admission.deferred else None
        self.table.unpin(client, vids)
        if rows is not None:
            self._grant_if_movable(rows, "a release")

    def add_ref(self, client: int, vids, priority: int | None = None) -> None:
        """A request of this client shares these blocks; with its `priority`, they carry at least
        that priority (a shared prefix is protected as the highest-priority request using it is).
        A block in flight is settled first: it was chosen to leave as idle."""
        _check_priority(priority)
        rows = self.table.rows(vids)
        settle_if(self, rows)
        self.table.add_ref(client, vids)
        if priority is not None:
            self.table.raise_priority(rows, priority)
        # Their sharing (and priority) terms grew: heat's cache kept them until its next pass (a review).
        self.policy.on_holds_changed(self.table, rows, self.table.clock())

    def _meets_flight(self, rows: np.ndarray, reader: Tier, probe: bool) -> bool:
        """Whether a lookup that found `rows` must wait for the drain copies in flight: one of them
        is in flight (the answer says where each block lies), or it would prefetch (a promotion)."""
        if not len(rows):
            return False
        if any_in_flight(self.table, rows):
            return True
        return reader == Tier.HBM and not probe and bool(self.prefetcher.base) and self._below_hbm(
            rows[: self.prefetcher.max_window])

    def _below_hbm(self, rows: np.ndarray) -> bool:
        """Whether any of these rows lies below HBM (a cheap test before any prefetch work)."""
        tier = self.table.cols.tier
        if len(rows) <= self.table.SMALL:
            return any(int(tier[r]) > int(Tier.HBM) for r in rows.tolist())
        return bool((tier[rows] > int(Tier.HBM)).any())
