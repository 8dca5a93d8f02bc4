"""Content key → table row, as an open-addressing hash table in two numpy arrays.

A Python dict costs about 100 bytes an entry (two int objects and the slot); this costs 24 bytes a
block at a load factor of one half, and looks up a whole chain of keys in a few vectorised probes.
Keys are 64-bit values; 0 means "no key" and is never stored: a slot whose key is 0 is empty (its
row is not read). A key's home slot is the top bits of the key times a 64-bit odd constant
(Fibonacci hashing), not its low bits: keys that are not hashes (a trace's consecutive block ids, a
client's counters) would otherwise fill one long probe run, and a removal shifts back the whole run
(1 ms a removal at 8,000 consecutive keys, against microseconds). Linear probing with
backward-shift deletion, so there are no tombstones to clean up.

The table doubles without holding its caller. The larger table starts empty, and the smaller one's
entries move over MOVE_SLOTS of its slots at each later insert or removal (`_move`), while lookups
look in both. Meanwhile the smaller table is read only, but for tombstones (row TOMB, its key kept
so that its probe runs stay whole): an entry that moved, or was removed there. New keys go to the
larger table. Its arrays are zeros that take memory a 4 KiB page at a time, as entries land
(`_zeros`): faulted in as 2 MiB huge pages, the first keys placed at random in them held one call
81 ms on the 2-core VM. Before, the call that doubled the table placed every entry at once (in the
order of their new homes, a stretch of probe runs at a time, the fastest way found) into arrays it
faulted in: at two million keys 52-325 ms on that VM; now 5-6 ms, and no commit while the entries
move takes longer (experiments: bench table's build, 1024-key commits; a commit on the per-key path,
whose keys are partly cached, 14 ms against 3 settled, a review's script).
"""

from __future__ import annotations

import numpy as np

from dflash2.counts import repeats, unique
from dflash2.keys import fib_slot, fib_slots
from dflash2.table.rowspace import is_mapped, reserve_or_plain

EMPTY = -1
TOMB = -2  # (the smaller table only, while it moves over: an entry gone from it)


def _zeros(size: int) -> tuple[np.ndarray, np.ndarray]:
    """A table's keys and rows: zeros over mappings of 4 KiB pages that take memory once written
    (rowspace.py); numpy's own where the system refuses the mapping (said in the log)."""
    keys = reserve_or_plain(np.uint64, size, size, "the content-key index", "slots", huge=False,
                            after=", whose doublings may fault in huge pages at once")
    rows = (reserve_or_plain(np.int32, size, size, "the content-key index", "slots", huge=False) if is_mapped(keys)
            else np.zeros(size, dtype=np.int32))  # (the refusal said once)
    return keys, rows


def _probe(tkeys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The slot of each of many keys (uint64) among the table's keys `tkeys`, -1 where absent: all
    probed at once. Key 0 is never found. (A tombstone's slot counts as found: its caller reads the row.)"""
    out = np.full(len(keys), EMPTY, dtype=np.int64)
    mask = len(tkeys) - 1
    pos = fib_slots(keys, mask.bit_length())
    todo = np.arange(len(keys))
    while len(todo):
        there = tkeys[pos[todo]]
        used = there != 0
        hit = (there == keys[todo]) & used
        out[todo[hit]] = pos[todo[hit]]
        todo = todo[~hit & used]
        pos[todo] = (pos[todo] + 1) & mask
    return out


def _probe_one(tkeys: np.ndarray, key: int) -> int:
    """`_probe` of one key: its slot, or -1."""
    mask = len(tkeys) - 1
    pos = fib_slot(key, mask.bit_length())
    while True:
        there = int(tkeys[pos])
        if there == 0:
            return EMPTY
        if there == key:
            return pos
        pos = (pos + 1) & mask


class KeyIndex:
    MOVE_SLOTS = 1 << 14  # slots of the smaller table moved at each insert_many or remove_many (about 1 ms)
    # ... and at each one-key insert or remove (a commit's per-key path, a lost block's removal): a
    # few, one at a time, at least 2 a key added, so that a doubling's entries have all moved before
    # the next doubling. Moving MOVE_SLOTS there, a 1,024-key commit on the per-key path took 244 ms
    # at two million keys (a review's script), the whole move in one call.
    MOVE_SLOTS_ONE = 4

    def __init__(self, capacity: int = 1024):
        size = 1 << max(4, (2 * capacity - 1).bit_length())
        self._keys, self._rows = _zeros(size)
        self._n = 0
        # While a doubling moves entries over: the smaller table, and its next slot to move.
        self._old: tuple[np.ndarray, np.ndarray] | None = None
        self._old_next = 0

    @property
    def _bits(self) -> int:
        return len(self._keys).bit_length() - 1

    def _home(self, key: int) -> int:
        return fib_slot(key, self._bits)

    def _homes(self, keys: np.ndarray) -> np.ndarray:
        return fib_slots(keys, self._bits)

    def __len__(self) -> int:
        return self._n

    @property
    def slots(self) -> int:
        """Slots of the table (a power of two; at least twice the keys indexed)."""
        return len(self._keys)

    @property
    def moving(self) -> bool:
        """Whether a doubling's entries are still moving over (lookups look in both tables)."""
        return self._old is not None

    def _arrays(self) -> list[np.ndarray]:
        return [self._keys, self._rows] + ([] if self._old is None else list(self._old))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays())

    @property
    def mapped_bytes(self) -> int:
        """Of `nbytes`, those over mappings (`_zeros`), which tracemalloc does not see."""
        return sum(a.nbytes for a in self._arrays() if is_mapped(a))

    @property
    def _mask(self) -> int:
        return len(self._keys) - 1

    def get(self, key: int) -> int:
        """Row of `key`, or -1."""
        at = _probe_one(self._keys, key)
        if at != EMPTY:
            return int(self._rows[at])
        return EMPTY if self._old is None else self._old_row(key)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Rows of many keys at once (-1 where absent)."""
        keys = np.asarray(keys, dtype=np.uint64)
        at = _probe(self._keys, keys)
        out = np.where(at == EMPTY, EMPTY, self._rows[at].astype(np.int64))
        if self._old is not None:
            miss = np.flatnonzero(at == EMPTY)
            if len(miss):
                old_keys, old_rows = self._old
                old_at = _probe(old_keys, keys[miss])
                found = old_at != EMPTY
                out[miss[found]] = np.maximum(old_rows[old_at[found]].astype(np.int64), EMPTY)  # (TOMB: gone)
        return out

    def insert(self, key: int, row: int) -> None:
        """Map key → row. The caller checks `get` first: a key present twice is a bug."""
        if key == 0:
            raise ValueError("content key 0 means 'no key' and cannot be indexed")
        if 2 * (self._n + 1) > len(self._keys):
            self._grow()
        self._move(self.MOVE_SLOTS_ONE)
        mask = self._mask
        pos = self._home(key)
        while self._keys[pos] != 0:
            if int(self._keys[pos]) == key:
                raise KeyError(f"content key {key:#x} is already indexed")
            pos = (pos + 1) & mask
        if self._old is not None and self._old_row(key) >= 0:
            raise KeyError(f"content key {key:#x} is already indexed")
        self._keys[pos] = key
        self._rows[pos] = row
        self._n += 1

    def insert_many(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Map many keys → rows at once (a commit's new blocks). The caller checked that the keys
        are distinct and none is indexed yet (`lookup`); key 0 is refused, and nothing changes."""
        keys = np.asarray(keys, dtype=np.uint64)
        if (keys == 0).any():
            raise ValueError("content key 0 means 'no key' and cannot be indexed")
        while 2 * (self._n + len(keys)) > len(self._keys):  # as one insert after another would grow
            self._grow()
        self._move(self.MOVE_SLOTS)
        self._bulk_insert(keys, np.asarray(rows, dtype=self._rows.dtype))
        self._n += len(keys)

    def remove(self, key: int) -> None:
        self._move(self.MOVE_SLOTS_ONE)
        if self._old is not None and _probe_one(self._keys, key) == EMPTY:
            old_at = _probe_one(self._old[0], key)
            if old_at == EMPTY or self._old[1][old_at] == TOMB:
                raise KeyError(f"content key {key:#x} is not indexed")
            self._old[1][old_at] = TOMB
            self._n -= 1
            return
        mask = self._mask
        pos = _probe_one(self._keys, key)
        if pos == EMPTY:
            raise KeyError(f"content key {key:#x} is not indexed")
        # Backward-shift: pull later entries of the probe run into the hole when their home allows.
        hole = pos
        nxt = (hole + 1) & mask
        while self._keys[nxt] != 0:
            home = self._home(int(self._keys[nxt]))
            if (nxt - home) & mask >= (nxt - hole) & mask:
                self._keys[hole] = self._keys[nxt]
                self._rows[hole] = self._rows[nxt]
                hole = nxt
            nxt = (nxt + 1) & mask
        self._keys[hole] = 0
        self._n -= 1

    def remove_many(self, keys: np.ndarray) -> None:
        """Remove many distinct keys at once (an eviction's whole batch): the slots of the keys are
        emptied, then every entry in the probe run after each emptied slot (up to the next empty
        one) is taken out and inserted again from its home. An entry that stays put has no emptied
        slot between its home and itself (the nearest such slot before it would have its run
        followed through the entry), so every key stays reachable, as with backward shifts. One key
        at a time cost about 3 us a key at a million blocks, half of an NVMe eviction's time.
        All or nothing: a key that is not indexed (or given twice) is a KeyError, nothing removed.
        (Keys still in the smaller table of a doubling are marked gone there, TOMB.)"""
        keys = np.asarray(keys, dtype=np.uint64)
        if not len(keys):
            return
        found = _probe(self._keys, keys)
        old_found = None
        if self._old is not None and (found == EMPTY).any():
            old_found = np.full(len(keys), EMPTY, dtype=np.int64)
            miss = np.flatnonzero(found == EMPTY)
            at = _probe(self._old[0], keys[miss])
            live = at != EMPTY
            live[live] = self._old[1][at[live]] != TOMB
            old_found[miss[live]] = at[live]
        absent = (found == EMPTY) if old_found is None else (found == EMPTY) & (old_found == EMPTY)
        if absent.any():
            raise KeyError(f"content key {int(keys[int(np.argmax(absent))]):#x} is not indexed")
        if repeats(found[found != EMPTY]) or (old_found is not None and repeats(old_found[old_found != EMPTY])):
            raise KeyError("a content key is given twice to remove_many")
        if old_found is not None:
            self._old[1][old_found[old_found != EMPTY]] = TOMB
            self._n -= int((old_found != EMPTY).sum())
            keys, found = keys[found != EMPTY], found[found != EMPTY]
        self._move(self.MOVE_SLOTS)  # (a move places entries in empty slots only: `found` stands)
        if not len(keys):
            return
        mask = self._mask
        self._keys[found] = 0
        # The probe runs after the emptied slots: their entries may have probed past one of them.
        moved = []
        front = (found + 1) & mask
        while len(front):
            front = front[self._keys[front] != 0]
            moved.append(front)
            front = (front + 1) & mask
        run = unique(np.concatenate(moved))
        run_keys, run_rows = self._keys[run].copy(), self._rows[run].copy()
        self._keys[run] = 0
        self._bulk_insert(run_keys, run_rows)
        self._n -= len(keys)

    # -- doubling ------------------------------------------------------------------------------
    def _old_row(self, key: int) -> int:
        """Row of `key` in the smaller table (EMPTY when absent or gone)."""
        at = _probe_one(self._old[0], key)
        return EMPTY if at == EMPTY else max(int(self._old[1][at]), EMPTY)

    def _grow(self) -> None:
        """Twice the slots: a new, empty larger table; the entries move over in later calls
        (`_move`). A doubling still under way ends first (all its entries moved at once): a table
        filled twice as fast as its entries move."""
        self._move(None)
        self._old, self._old_next = (self._keys, self._rows), 0
        self._keys, self._rows = _zeros(2 * len(self._keys))

    def step(self) -> None:
        """A background step's share of a doubling's move (MOVE_SLOTS slots): a stretch of lookups
        alone ends it too (it looked in both tables meanwhile, and held the smaller one's memory)."""
        self._move(self.MOVE_SLOTS)

    def finish(self) -> None:
        """Move every entry still in the smaller table of a doubling (tests, checks)."""
        self._move(None)

    def _move(self, n: int | None) -> None:
        """Move the entries of the smaller table's next `n` slots (None: all that are left) into the
        larger one, each from its home (`_bulk_insert`), and mark them gone there."""
        if self._old is None:
            return
        old_keys, old_rows = self._old
        a = self._old_next
        b = len(old_rows) if n is None else min(len(old_rows), a + n)
        if n is not None and n <= self.MOVE_SLOTS_ONE:  # (a one-key call's few: numpy's per-call costs would dominate)
            mask = self._mask
            for i in range(a, b):
                if old_keys[i] != 0 and old_rows[i] >= 0:
                    key = int(old_keys[i])
                    pos = self._home(key)
                    while self._keys[pos] != 0:
                        pos = (pos + 1) & mask
                    self._keys[pos], self._rows[pos], old_rows[i] = key, old_rows[i], TOMB
        else:
            live = a + np.flatnonzero((old_keys[a:b] != 0) & (old_rows[a:b] >= 0))
            if len(live):
                self._bulk_insert(old_keys[live], old_rows[live])
                old_rows[live] = TOMB
        self._old_next = b
        if b == len(old_rows):
            self._old = None

    def _bulk_insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Vectorised insertion of distinct keys, none indexed, into a table with room: each round
        places, for every free target slot, the first pending key that probes it. The caller keeps
        the count (`_n`): its callers put back entries they took out, or move them over."""
        pos = self._homes(keys)
        todo = np.arange(len(keys))
        while len(todo):
            free = self._keys[pos[todo]] == 0
            cand = todo[free]
            _, first = np.unique(pos[cand], return_index=True)
            placed = cand[first]
            self._keys[pos[placed]] = keys[placed]
            self._rows[pos[placed]] = rows[placed]
            done = np.zeros(len(keys), dtype=bool)
            done[placed] = True
            todo = todo[~done[todo]]
            pos[todo] = (pos[todo] + 1) & self._mask
