"""Content key → table row, as an open-addressing hash table in two numpy arrays.

A Python dict costs about 100 bytes an entry (two int objects and the slot); this costs 24 bytes a
block at a load factor of one half, and looks up a whole chain of keys in a few vectorised probes.
Keys are 64-bit values; 0 means "no key" and is never stored. A key's home slot is the top bits of
the key times a 64-bit odd constant (Fibonacci hashing), not its low bits: keys that are not hashes
(a trace's consecutive block ids, a client's counters) would otherwise fill one long probe run, and
a removal shifts back the whole run (1 ms a removal at 8,000 consecutive keys, against microseconds).
Linear probing with backward-shift deletion, so there are no tombstones to clean up.
"""

from __future__ import annotations

import numpy as np

from dflash2.counts import repeats, unique
from dflash2.keys import fib_slot, fib_slots

EMPTY = -1


class KeyIndex:
    GROW_CHUNK = 1 << 18  # old slots placed a stretch at a time when the table doubles (`_grow`)

    def __init__(self, capacity: int = 1024):
        size = 1 << max(4, (2 * capacity - 1).bit_length())
        self._keys = np.zeros(size, dtype=np.uint64)
        self._rows = np.full(size, EMPTY, dtype=np.int32)
        self._n = 0

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
    def nbytes(self) -> int:
        return self._keys.nbytes + self._rows.nbytes

    @property
    def _mask(self) -> int:
        return len(self._keys) - 1

    def get(self, key: int) -> int:
        """Row of `key`, or -1."""
        keys, rows = self._keys, self._rows
        mask = len(keys) - 1
        pos = fib_slot(key, mask.bit_length())  # (_home, without its two property calls)
        while True:
            row = int(rows[pos])
            if row == EMPTY:
                return EMPTY
            if int(keys[pos]) == key:
                return row
            pos = (pos + 1) & mask

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Rows of many keys at once (-1 where absent)."""
        at = self._slots(np.asarray(keys, dtype=np.uint64))
        return np.where(at == EMPTY, EMPTY, self._rows[at].astype(np.int64))

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each of many keys (uint64), -1 where absent: all probed at once."""
        out = np.full(len(keys), EMPTY, dtype=np.int64)
        pos = self._homes(keys)
        todo = np.arange(len(keys))
        while len(todo):
            rows = self._rows[pos[todo]]
            hit = (self._keys[pos[todo]] == keys[todo]) & (rows != EMPTY)
            out[todo[hit]] = pos[todo[hit]]
            todo = todo[~hit & (rows != EMPTY)]
            pos[todo] = (pos[todo] + 1) & self._mask
        return out

    def insert(self, key: int, row: int) -> None:
        """Map key → row. The caller checks `get` first: a key present twice is a bug."""
        if key == 0:
            raise ValueError("content key 0 means 'no key' and cannot be indexed")
        if 2 * (self._n + 1) > len(self._keys):
            self._grow()
        mask = self._mask
        pos = self._home(key)
        while self._rows[pos] != EMPTY:
            if int(self._keys[pos]) == key:
                raise KeyError(f"content key {key:#x} is already indexed")
            pos = (pos + 1) & mask
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
        self._bulk_insert(keys, np.asarray(rows, dtype=self._rows.dtype))
        self._n += len(keys)

    def remove(self, key: int) -> None:
        mask = self._mask
        pos = self._home(key)
        while True:
            if self._rows[pos] == EMPTY:
                raise KeyError(f"content key {key:#x} is not indexed")
            if int(self._keys[pos]) == key:
                break
            pos = (pos + 1) & mask
        # Backward-shift: pull later entries of the probe run into the hole when their home allows.
        hole = pos
        nxt = (hole + 1) & mask
        while self._rows[nxt] != EMPTY:
            home = self._home(int(self._keys[nxt]))
            if (nxt - home) & mask >= (nxt - hole) & mask:
                self._keys[hole] = self._keys[nxt]
                self._rows[hole] = self._rows[nxt]
                hole = nxt
            nxt = (nxt + 1) & mask
        self._keys[hole] = 0
        self._rows[hole] = EMPTY
        self._n -= 1

    def remove_many(self, keys: np.ndarray) -> None:
        """Remove many distinct keys at once (an eviction's whole batch): the slots of the keys are
        emptied, then every entry in the probe run after each emptied slot (up to the next empty
        one) is taken out and inserted again from its home. An entry that stays put has no emptied
        slot between its home and itself (the nearest such slot before it would have its run
        followed through the entry), so every key stays reachable, as with backward shifts. One key
        at a time cost about 3 us a key at a million blocks, half of an NVMe eviction's time.
        All or nothing: a key that is not indexed (or given twice) is a KeyError, nothing removed."""
        keys = np.asarray(keys, dtype=np.uint64)
        if not len(keys):
            return
        mask = self._mask
        found = self._slots(keys)
        if (found == EMPTY).any():
            raise KeyError(f"content key {int(keys[int(np.argmax(found == EMPTY))]):#x} is not indexed")
        if repeats(found):
            raise KeyError("a content key is given twice to remove_many")
        self._keys[found] = 0
        self._rows[found] = EMPTY
        # The probe runs after the emptied slots: their entries may have probed past one of them.
        moved = []
        front = (found + 1) & mask
        while len(front):
            front = front[self._rows[front] != EMPTY]
            moved.append(front)
            front = (front + 1) & mask
        run = unique(np.concatenate(moved))
        run_keys, run_rows = self._keys[run].copy(), self._rows[run].copy()
        self._keys[run] = 0
        self._rows[run] = EMPTY
        self._bulk_insert(run_keys, run_rows)
        self._n -= len(keys)

    def _grow(self) -> None:
        """Twice the slots, every entry placed again (the count stands). Entries are placed in the
        order of their new homes, each in the first slot past both its home and the entry before
        it (a running maximum): then every slot between an entry's home and its own is taken, as
        linear probing needs. The old table gives that order a stretch at a time: the entries of
        different probe runs are in order of their homes (a run starts at the home of its first
        entry, and the top bits of a hash keep their order as the table doubles), so only a run's
        own entries need sorting, and the old slots are taken GROW_CHUNK at a time, cut at empty
        slots, in a stable sort each. Placing them by rounds of probes (`_bulk_insert`) cost 0.50 s
        at two million keys on the 2-core VM, a stall of the daemon's loop, and one sort of them all
        0.42 s, most of it faulting in the memory of its temporaries.

        The order starts at the first empty slot (a run that wraps round the end ends before it).
        The entries in the slots before it whose homes lie before it too come first of all; the
        others there close the wrapping run, with the last stretch. Entries placed past the new
        last slot wrap round to the first ones (`_bulk_insert`, after the rest)."""
        old_keys, old_rows = self._keys, self._rows
        old_size, size = len(old_keys), 2 * len(old_keys)
        bits = size.bit_length() - 1
        self._keys = np.zeros(size, dtype=np.uint64)
        self._rows = np.full(size, EMPTY, dtype=np.int32)
        first_empty = 0  # (a load of at most one half leaves one; runs are short: a Python step a slot)
        while old_rows[first_empty] != EMPTY:
            first_empty += 1
        head = np.arange(first_empty)  # occupied: the end of a run that wraps, or one that starts at 0
        low = (fib_slots(old_keys[head], bits) >> 1) < first_empty  # (old home: one bit fewer)
        spill: list[tuple[np.ndarray, np.ndarray]] = []
        free = self._place(old_keys[head[low]], old_rows[head[low]], 0, bits, spill)
        lo = first_empty
        while lo < old_size:
            hi = min(lo + self.GROW_CHUNK, old_size)
            while hi < old_size and old_rows[hi] != EMPTY:  # a run is not cut
                hi += 1
            slots = lo + np.flatnonzero(old_rows[lo:hi] != EMPTY)
            if hi == old_size:
                slots = np.concatenate([slots, head[~low]])
            free = self._place(old_keys[slots], old_rows[slots], free, bits, spill)
            lo = hi
        for keys, rows in spill:
            self._bulk_insert(keys, rows)

    def _place(self, keys: np.ndarray, rows: np.ndarray, free: int, bits: int, spill: list) -> int:
        """`_grow`'s step: entries whose homes are all at least those placed so far, each in the
        first slot past its home and the one before (none below `free`). Returns the next `free`;
        entries past the last slot are added to `spill`."""
        if not len(keys):
            return free
        homes = fib_slots(keys, bits)
        order = np.argsort(homes, kind="stable")
        keys, rows, homes = keys[order], rows[order], homes[order]
        rank = np.arange(len(homes))
        at = np.maximum(np.maximum.accumulate(homes - rank), free) + rank
        fits = int(np.searchsorted(at, len(self._keys)))  # (`at` rises)
        self._keys[at[:fits]] = keys[:fits]
        self._rows[at[:fits]] = rows[:fits]
        if fits < len(at):
            spill.append((keys[fits:], rows[fits:]))
        return int(at[-1]) + 1

    def _bulk_insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Vectorised insertion of distinct keys, none indexed, into a table with room: each round
        places, for every free target slot, the first pending key that probes it. The caller keeps
        the count (`_n`): both callers put back entries they took out."""
        pos = self._homes(keys)
        todo = np.arange(len(keys))
        while len(todo):
            free = self._rows[pos[todo]] == EMPTY
            cand = todo[free]
            _, first = np.unique(pos[cand], return_index=True)
            placed = cand[first]
            self._keys[pos[placed]] = keys[placed]
            self._rows[pos[placed]] = rows[placed]
            done = np.zeros(len(keys), dtype=bool)
            done[placed] = True
            todo = todo[~done[todo]]
            pos[todo] = (pos[todo] + 1) & self._mask
