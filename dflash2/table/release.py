"""Letting go of blocks: a client's `free` (one reference a block) and `unpin` (one pin a block), and
what they free; and the bound on what a block holds (`MAX_HOLDS`). A part of BlockTable (a mixin
over its columns and client counts), apart because the checks and counting of a call that lets go
of many blocks at once are a job of their own: a call that lists each block once, and more than
`BlockTable.SMALL` of them, takes whole-array steps (`_free_distinct`, `_unpin_distinct`), any
other the general per-row path."""

from __future__ import annotations

from collections import Counter
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from dflash2.counts import any_true, repeats, unique
from dflash2.errors import NotOwner, PinnedBlock, QuotaExceeded
from dflash2.table.states import BlockState

if TYPE_CHECKING:
    from dflash2.table.table import ClientRefs

# References, and pins, a block holds at most (all clients together): the int32 columns wrap at 2^31
# (`_within_holds`; a deduplicating commit checks the references it adds to a cached twin:
# publish.py `_refuse_past_holds`); no engine shares one block among a billion requests.
MAX_HOLDS = (1 << 30) - 1


def _count_down(counts: Counter, listed: list[int], held: tuple[int, ...]) -> None:
    """One off each of `listed` (distinct; `held` their counts now, each at least 1): a count that
    reaches 0 is removed. `pop` is dict's own: Counter's `del` is a Python-level method, 0.4 us a row."""
    for r, n in zip(listed, held):
        if n == 1:
            counts.pop(r)
        else:
            counts[r] = n - 1


class Releasing:
    """BlockTable's free and unpin (the attributes they use are BlockTable's)."""

    def free(self, client_id: int, vids) -> int:
        """Drop one reference of this client per block. A private block whose last reference goes is
        freed; a published one stays cached. Returns the number of blocks freed."""
        holder = self.client(client_id)
        rows = self.rows(vids)
        if len(rows) > self.SMALL and not repeats(rows):
            return self._free_distinct(client_id, holder, rows)
        dropping = Counter(rows.tolist())
        for r, n in dropping.items():
            if holder.refs[r] < n:
                raise self._refused_free(client_id, r, unowned=True, asked=n, held=holder.refs[r])
            c = self.cols
            if c.key[r] == 0 and c.refs[r] == n and c.pins[r] > 0:
                raise self._refused_free(client_id, r, unowned=False)
        return self._drop_refs(holder, rows)

    def _refused_free(self, client_id: int, row: int, unowned: bool, asked: int = 1,
                      held: int = 0) -> NotOwner | PinnedBlock:
        """Why a free of `row` is refused: the client holds fewer references to it than the free drops
        (`asked`, its times listed; `held`), or (a private block's last reference) it is pinned."""
        vid = int(self.vids(np.array([row], dtype=np.int64))[0])
        if unowned and held:  # (one id listed more often than the client holds it: not "no reference", a review)
            return NotOwner(f"client {client_id} holds {held} reference(s) to block {vid:#x}, freed {asked} (the "
                            "block listed more often than it was allocated, acquired or referenced)")
        if unowned:
            # (A pinned copy a commit deduplicated, or a block dead otherwise: why, and the id to use; its
            # writer's free of the id it allocated was called a double free, a review.)
            self.refuse_dead(np.array([row], dtype=np.int64))
            return NotOwner(f"client {client_id} holds no reference to block {vid:#x} (double free, or another "
                            "client's block)")
        return PinnedBlock(f"block {vid:#x} is pinned; release it before freeing")

    def _refused_unpin(self, client_id: int, row: int, asked: int, held: int) -> NotOwner:
        """Why a release of `row` is refused: the client holds fewer pins on it than it gives up."""
        vid = int(self.vids(np.array([row], dtype=np.int64))[0])
        return NotOwner(f"client {client_id} holds {held} pin(s) on block {vid:#x}, released {asked} (released "
                        "twice, never acquired, or another client's pin)")

    def _free_distinct(self, client_id: int, holder: ClientRefs, rows: np.ndarray) -> int:
        """`free` of rows listed once each (a request's blocks: the usual large free), checked and
        dropped in whole-array steps and one plain loop over the client's counts. The per-row
        Counter steps of the general path cost about 0.9 ms a 1024-block free on the 2-core VM,
        as much as the GPU copy of those blocks at 64 KiB each."""
        listed = rows.tolist()
        held = itemgetter(*listed)(holder.refs)  # (a Counter answers 0 for a block it lacks)
        c = self.cols
        unowned = np.fromiter(held, dtype=np.int64, count=len(listed)) == 0
        pinned = (c.key[rows] == 0) & (c.refs[rows] == 1) & (c.pins[rows] > 0)
        bad = unowned | pinned
        if any_true(bad):  # the first bad block in the caller's order, as the general path names it
            i = int(np.argmax(bad))
            raise self._refused_free(client_id, int(rows[i]), unowned=bool(unowned[i]))
        _count_down(holder.refs, listed, held)
        c.refs[rows] -= 1
        holder.ref_slot_bytes -= self.ref_slots(rows)
        return self._after_refs_dropped(np.sort(rows))  # (in row order, as `_drop_refs` hands them on)

    def _drop_refs(self, holder: ClientRefs, rows: np.ndarray) -> int:
        c = self.cols
        for r in rows.tolist():
            holder.refs[r] -= 1
            if holder.refs[r] == 0:
                holder.refs.pop(r)  # (dict's own: see `_count_down`)
            c.refs[r] -= 1
        holder.ref_slot_bytes -= self.ref_slots(rows)
        return self._after_refs_dropped(unique(rows))

    def _after_refs_dropped(self, rows: np.ndarray) -> int:
        """`rows` (distinct) lost references: private ones nobody references any more are freed,
        published ones nobody holds go back to their writer's priority. Returns how many were freed."""
        c = self.cols
        self._may_move(rows[c.key[rows] != 0])  # a private block let go is freed, never moved
        self._settle_priority(rows)
        f = rows[(c.refs[rows] == 0) & (c.key[rows] == 0)]
        if len(f):
            # A block in flight is freed when its move completes (end_move), never under the mover.
            in_flight = c.state[f] == int(BlockState.MIGRATING)
            self._free_after_move.update(f[in_flight].tolist())
            self._release_rows(f[~in_flight])
        return len(f)

    def _settle_priority(self, rows) -> None:
        """`rows` lost references or pins (every path that drops either ends here, private blocks kept
        for their pins included: `keep_pinned_writes`, a commit's pinned copy): published blocks among
        them that nobody references or pins go back to their writer's priority, as a request that
        raised it no longer holds them; and the policy hears of them all (`on_holds_changed`)."""
        c = self.cols
        r = np.asarray(rows, dtype=np.int64)
        idle = r[(c.refs[r] == 0) & (c.pins[r] == 0) & (c.key[r] != 0)]
        c.priority[idle] = c.base_priority[idle]
        self.on_holds_changed(r)

    def on_holds_changed(self, rows: np.ndarray) -> None:
        """Hook: `rows` lost references or pins, so a policy's score of them may have changed (heat's
        sharing, stage and priority terms: its cached scores kept them until the next full pass, a
        freed block scored as held). The manager sets it (and tells the policy of the gains itself:
        reads.py `add_ref`, `acquire_rows`)."""

    def _within_holds(self, column: np.ndarray, rows: np.ndarray, what: str) -> None:
        """After `rows` were each counted once more in `column` (refs, pins): undo that and refuse
        the call when a block passes MAX_HOLDS (the int32 column wrapped to a negative count at
        2^31, a client's 32,769 calls of 65,536 copies of one id; each call adds at most MAX_BATCH)."""
        if len(rows) and int(column[rows].max()) > MAX_HOLDS:
            np.subtract.at(column, rows, 1)
            over = rows[column[rows] >= MAX_HOLDS][:1]
            raise QuotaExceeded(f"block {int(self.vids(over)[0]):#x} would hold more than {MAX_HOLDS} {what} (of all "
                                "clients together)")

    def keep_pinned_writes(self, client_id: int, vids: np.ndarray) -> np.ndarray:
        """The writer gave up on these blocks being written (a commit it forgot, which was not run):
        one it still pins whose last reference this lets go of is kept for its pins alone, as a
        pinned copy a commit deduplicated is (`pinned_copies`, twin 0), to be freed at its last
        release; returns the others, for the caller to free (one reference each, as for any: a block
        another of the writer's requests references stays). Before, a free of them all was refused
        for the pinned one, and every block of the commit stayed held until the client detached."""
        holder = self.client(client_id)
        rows = self.rows(vids)
        kept = (self.cols.pins[rows] > 0) & (self.cols.refs[rows] == 1)
        for r in rows[kept].tolist():
            holder.refs.pop(r)
            self.cols.refs[r] = 0
            holder.ref_slot_bytes -= self.ref_slots(np.array([r]))
            self.cols.state[r] = BlockState.RESIDENT  # (its bytes are final: it is never committed)
            self.pinned_copies[r] = 0
        self._settle_priority(rows[kept])
        return vids[~kept]

    def _drop_refs_many(self, holder: ClientRefs, rows: np.ndarray, counts: np.ndarray) -> int:
        """Drop `counts` references of each of the client's distinct `rows`, in whole-array steps (one
        Python step a reference held the daemon's loop 1.6 s at 3.3 million; one release a block, 0.5 s
        a commit of 8,192 cached blocks); the blocks nobody references any more are freed. Returns
        how many were."""
        refs = holder.refs
        for row, n in zip(rows.tolist(), counts.tolist()):
            left = refs[row] - n
            if left:
                refs[row] = left
            else:
                refs.pop(row)
        self.cols.refs[rows] -= counts.astype(self.cols.refs.dtype)
        holder.ref_slot_bytes -= self.ref_slots(rows, counts)
        return self._after_refs_dropped(rows)

    def _drop_all_refs(self, holder: ClientRefs, keep=None) -> int:
        """Every reference of a client that is going away, in whole-array steps (a client holding
        100k references detached in 0.3 s one reference at a time: the daemon's loop stood still).
        `keep(rows)`: a mask of the rows whose references stay. Returns how many blocks it freed."""
        rows = np.fromiter(holder.refs.keys(), dtype=np.int64, count=len(holder.refs))
        counts = np.fromiter(holder.refs.values(), dtype=np.int64, count=len(holder.refs))
        if keep is None:
            holder.refs.clear()
            holder.ref_slot_bytes = 0
        else:
            going = ~keep(rows)
            rows, counts = rows[going], counts[going]
            for r in rows.tolist():
                holder.refs.pop(r)  # (dict's own: see `_count_down`)
            holder.ref_slot_bytes -= self.ref_slots(rows, counts)
        self.cols.refs[rows] -= counts.astype(self.cols.refs.dtype)  # distinct rows: no repeats to add up
        return self._after_refs_dropped(rows)

    def unpin(self, client_id: int, vids) -> None:
        holder = self.client(client_id)
        rows = self.rows(vids)
        if len(rows) > self.SMALL and not repeats(rows):
            self._unpin_distinct(client_id, holder, rows)
            return
        counts = Counter(rows.tolist())
        pins = holder.pins
        short = next((r for r, n in counts.items() if pins[r] < n), None)
        if short is not None:
            raise self._refused_unpin(client_id, short, counts[short], pins[short])
        if len(rows) > self.SMALL:
            np.subtract.at(self.cols.pins, rows, 1)
        else:
            for r in rows.tolist():
                self.cols.pins[r] -= 1
        pins.subtract(counts)
        for r in [r for r in counts if not pins[r]]:
            pins.pop(r)  # (dict's own: see `_count_down`)
        self._may_move(rows)
        self._settle_priority(list(counts))
        self._free_unheld(counts)

    def _unpin_distinct(self, client_id: int, holder: ClientRefs, rows: np.ndarray) -> None:
        """`unpin` of rows listed once each (a read's blocks: the usual large release), as
        `_free_distinct` frees: about 1 ms a 1024-block release on the 2-core VM the general way."""
        listed = rows.tolist()
        pins = holder.pins
        held = itemgetter(*listed)(pins)  # (a Counter answers 0 for a block it lacks)
        if 0 in held:
            raise self._refused_unpin(client_id, listed[held.index(0)], 1, 0)
        self.cols.pins[rows] -= 1
        _count_down(pins, listed, held)
        self._may_move(rows)
        self._settle_priority(rows)
        self._free_unheld(listed)

    def _free_unheld(self, rows) -> int:
        """Rows kept only for their holders (a block whose bytes failed their checksum; a pinned
        copy a commit deduplicated): the last pin of one nobody references frees it (it has no key,
        so nothing else ever would). Returns how many it freed."""
        if not (self.lost or self.pinned_copies):
            return 0
        c = self.cols
        done = [r for r in rows if (r in self.lost or r in self.pinned_copies) and c.pins[r] == 0 and c.refs[r] == 0]
        if done:
            self._release_rows(np.array(done, dtype=np.int64))
        return len(done)
