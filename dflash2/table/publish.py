"""Publishing written blocks: `commit` makes a block's bytes final and, with content keys, indexes
it and chains it under its parent; a key already cached deduplicates. A part of BlockTable (a
mixin over its columns, key index and client counts), apart because the deduplication's cases
(a pinned copy, a cached twin in a slower tier) are a job of their own."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash2.errors import IllegalTransition, ImmutableBlock, QuotaExceeded, UnknownBlock
from dflash2.keys import key_array
from dflash2.table import release
from dflash2.table.columns import NO_CLIENT, NO_ROW, no_repeats
from dflash2.table.keyindex import EMPTY
from dflash2.table.states import BlockState, check_transition

S = BlockState


class Publishing:
    """BlockTable's commit (the attributes it uses are BlockTable's)."""

    def commit(self, client_id: int, vids, keys: Sequence[int] | None = None,
               parent: int | None = None) -> np.ndarray:
        """WRITING → RESIDENT: the bytes are final. With content keys the blocks are published (any
        client can find them by key) and chained: block i's parent is block i-1, the first one's is
        `parent` (a published block's vid). A key that is already cached deduplicates: the client
        gets a reference to the cached block instead, and its copy is freed (or kept until released,
        when it is pinned: `_adopt_duplicate`). Returns the vids the client holds now, in order."""
        c = self.cols
        self.client(client_id)
        rows = self.rows(vids)
        # Its own block or a published one, committed already: said so (as "RESIDENT -> RESIDENT is
        # not a legal transition", or, published by a keyed commit, "not a private block", reviews).
        again = (c.state[rows] == int(S.RESIDENT)) & np.isin(c.owner[rows], (client_id, NO_CLIENT))
        if again.any():
            raise IllegalTransition(f"commit of block {int(self.vids(rows[again][:1])[0]):#x}: it is committed "
                                    "already (RESIDENT); only blocks being written (allocated, not yet committed) "
                                    "can be committed")
        rows = self._owned_rows(client_id, vids)
        no_repeats(rows, "commit", self.vids)
        self.refuse_reserved(rows)  # (its own reservation's: `take` hands it out first)
        check_transition(c.state[rows], S.RESIDENT, vids)
        self._require(rows, S.WRITING, "commit")
        if keys is None:
            c.state[rows] = S.RESIDENT
            self._may_move(rows)
            return self.vids(rows)
        ukeys = key_array(keys)  # (a float key was truncated, a negative numpy one wrapped around)
        if len(ukeys) != len(rows):
            raise ValueError(f"commit of {len(rows)} blocks with {len(ukeys)} content keys")
        if not ukeys.all():  # (whole-array: a Python step per key cost 0.13 ms a 1024-block commit)
            raise ValueError("content key 0 is reserved for 'no key'")
        try:
            prev = self.rows([parent])[0] if parent is not None else NO_ROW
        except UnknownBlock:  # (said as the parent: "block X is not live" read as one of the writer's own)
            raise UnknownBlock(f"parent block {parent:#x} of this commit is not live (evicted since the lookup?): "
                               "the blocks being written are unchanged; commit them without the parent, or look "
                               "the chain up again and pin its prefix while writing") from None
        if prev != NO_ROW and c.key[prev] == 0:
            raise ImmutableBlock(f"parent block {parent:#x} is not published; only published blocks chain")
        found = self.keys.lookup(ukeys)
        # The layout a key stands for: the cached block's, else the first block given it in this call
        # (a key listed twice dedupes onto its first occurrence). Checked for every block before
        # anything changes: a block deduplicated onto another layout's would swap slots of two sizes.
        owner_row = np.where(found != EMPTY, found, -1)
        new = np.flatnonzero(found == EMPTY)
        if len(new):
            # Each new key's first block in this call (np.unique's index is the first occurrence):
            # whole-array steps, where a Python step per key cost 0.4 ms a 1024-block commit.
            _, first, which = np.unique(ukeys[new], return_index=True, return_inverse=True)
            owner_row[new] = rows[new[first]][which]
        clash = c.layout[owner_row] != c.layout[rows]
        if clash.any():
            at = int(np.argmax(clash))  # (the layouts named: two models' clients share the node)
            theirs, mine = (self.layout(int(c.layout[r])) for r in (owner_row[at], rows[at]))
            raise ImmutableBlock(f"content key {int(ukeys[at]):#x} is cached, or given in this commit, for another "
                                 f"layout ({theirs.name!r}, id {int(c.layout[owner_row[at]])}; this block is of "
                                 f"{mine.name!r}, id {int(c.layout[rows[at]])}): content keys must be namespaced per "
                                 "layout (model, precision, shard)")
        dup = np.flatnonzero(owner_row != rows)
        if len(dup):
            self._refuse_past_holds(client_id, owner_row[dup], rows[dup], ukeys[dup])
        if not len(dup):
            # Every key new, none given twice (the usual commit): published at once, in arrays.
            c.state[rows] = S.RESIDENT
            c.key[rows] = ukeys
            c.owner[rows] = NO_CLIENT
            self.keys.insert_many(ukeys, rows)
            self._link_chain(rows, prev)
            self._may_move(rows)
            return self.vids(rows)
        out = np.empty(len(rows), dtype=np.int64)
        # The copies' references are let go together after the loop (`_adopt_duplicate`): one
        # release a block cost about 60 us, 0.5 s of the daemon's loop a commit of 8,192 cached
        # blocks (a review's profile), where the fresh ones take 3 ms.
        dropped: list[tuple[int, int]] = []
        for i, (row, key) in enumerate(zip(rows.tolist(), ukeys.tolist())):
            key = int(key)
            existing = self.keys.get(key)
            if existing != EMPTY:
                self._adopt_duplicate(client_id, row, existing, dropped)
                row = existing
            else:
                c.state[row] = S.RESIDENT
                c.key[row] = key
                c.owner[row] = NO_CLIENT
                self.keys.insert(key, row)
                self._link(row, prev)
            out[i] = row
            prev = row
        if dropped:
            going, counts = np.array(dropped, dtype=np.int64).T
            holder = self.clients[client_id]
            holder.ref_slot_bytes += self.ref_slots(going, counts)  # (now the twins': the same slots)
            self._drop_refs_many(holder, going, counts)
        copies = rows[(out != rows) & (c.pins[rows] > 0)]  # pinned copies kept: their references went to the twins
        if len(copies):
            self._settle_priority(copies)
        self._may_move(out)  # RESIDENT and ownerless (a twin: a reference of it moved, its slot may have)
        return self.vids(out)

    def _refuse_past_holds(self, client_id: int, twins: np.ndarray, rows: np.ndarray, keys: np.ndarray) -> None:
        """QuotaExceeded, before anything changes, when deduplicating `rows` onto `twins` would take
        a twin past MAX_HOLDS references: each brings the writer's references on it (successive
        commits added them up past 2^31, and the int32 count wrapped)."""
        refs = self.clients[client_id].refs
        brought = np.array([refs.get(r, 0) for r in rows.tolist()], dtype=np.int64)
        at, which = np.unique(twins, return_inverse=True)
        total = self.cols.refs[at].astype(np.int64) + np.bincount(which, weights=brought).astype(np.int64)
        over = np.flatnonzero(total > release.MAX_HOLDS)
        if len(over):
            key = int(keys[int(np.flatnonzero(which == over[0])[0])])
            raise QuotaExceeded(f"content key {key:#x}: its cached block would hold {int(total[over[0]])} references, "
                                f"more than {release.MAX_HOLDS} (of all clients together)")

    def _adopt_duplicate(self, client_id: int, row: int, existing: int, dropped: list[tuple[int, int]]) -> None:
        """The client wrote a block that is already cached: move its references to the cached one
        (all of them: a reference left behind would keep the unpublished copy alive, WRITING, until
        the client detaches). Only the writing client holds a private block. The copy's references
        are added to `dropped` (row, count) for the caller to let go of, all rows together.
        The twin has the copy's layout (commit checks it), so the client's `ref_slot_bytes` is the
        same before and after: only the references' rows change.

        Where the client's copy lies matters in two cases:
        - it is pinned: the client views those bytes there, through the id it pinned. The copy
          stays, private and RESIDENT, until its last pin goes (`pinned_copies`); moving the pins
          to the cached twin instead would leave the view over a freed slot, and the client's
          release naming an id that no longer exists;
        - it is unpinned and lies in a faster tier than the cached twin (a block recomputed because
          reading it back from below was too slow, or not looked up): the twin takes the copy's
          slot, whose bytes are the same, and the twin's slower slot is freed. Dropping the fresh
          copy would leave the block where reading it back costs more than recomputing it again.
        """
        holder = self.clients[client_id]
        c = self.cols
        c.priority[existing] = max(c.priority[existing], c.priority[row])  # its writer's request uses it now
        c.base_priority[existing] = max(c.base_priority[existing], c.base_priority[row])  # written by both
        refs = holder.refs.get(row, 0)
        if holder.pins.get(row, 0):
            c.state[row] = S.RESIDENT  # final bytes, never to be committed again
            self.pinned_copies[row] = int(self.vids(np.array([existing]))[0])
            holder.refs.pop(row, None)
            c.refs[row] -= refs
        else:
            if (c.tier[row] < c.tier[existing] and c.state[existing] == int(S.RESIDENT)
                    and c.pins[existing] == 0 and c.layout[row] == c.layout[existing]):
                self._swap_slots(row, existing)
            if refs:
                dropped.append((row, refs))  # all of them: the copy is freed
        holder.refs[existing] += refs
        c.refs[existing] += refs

    def _swap_slots(self, row: int, existing: int) -> None:
        """`existing` (published, unpinned, RESIDENT) takes `row`'s slot and `row` (private, no
        parent, no children) takes `existing`'s: same content key, same bytes."""
        c = self.cols
        up, down = int(c.tier[row]), int(c.tier[existing])
        c.offset[row], c.offset[existing] = c.offset[existing], c.offset[row]
        c.tier[row], c.tier[existing] = down, up
        self._may_move([row, existing])
        p = int(c.parent[existing])
        if p != NO_ROW:  # the twin now counts among its parent's children of the faster tier
            c.kids[down, p] -= 1
            c.kids[up, p] += 1
        self._recast.append(existing)

    def take_recast(self) -> np.ndarray:
        """Rows that commits' deduplications moved to another tier since the last call."""
        rows, self._recast = np.array(self._recast, dtype=np.int64), []
        return rows

    def _link_chain(self, rows: np.ndarray, parent: int) -> None:
        """`_link` of each row under the one before it, the first under `parent` (rows distinct,
        none of them `parent`: so is each (tier, parent) pair counted)."""
        if not len(rows):
            return
        parents = np.empty(len(rows), dtype=np.int64)
        parents[0], parents[1:] = parent, rows[:-1]
        if parent == NO_ROW:
            rows, parents = rows[1:], parents[1:]
        c = self.cols
        c.parent[rows] = parents
        c.kids[c.tier[rows], parents] += 1
        c.nkids[parents] += 1

    def _link(self, row: int, parent: int) -> None:
        if parent == NO_ROW:
            return
        self.cols.parent[row] = parent
        self.cols.kids[self.cols.tier[row], parent] += 1
        self.cols.nkids[parent] += 1
