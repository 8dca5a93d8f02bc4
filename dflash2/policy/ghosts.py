"""Ghost tables: keys that recently left, for the policies that learn from their return (split.py's
targets, gate.py's admission gate).

Hashed, one slot per key (ghost_bits: twice the block table's rows): a 32-bit tag of the key's
hash, its departure number mod 2**32 (differences in uint32 arithmetic wrap with the counters) and
optionally a one-byte payload (the list it left). A slot taken by another key forgets the older one:
a missed count, never a wrong one. A ghost speaks once: recalling a key forgets it. A table grows
with the block table keeping every ghost (`GhostTable.grow`: the tag holds the hash bits that
place a ghost in the larger table).
"""

from __future__ import annotations

import numpy as np

from dflash2.keys import FIB

# Twice as many slots as the block table has rows, to the next power of two, 4096 to 4M: a table's
# ghosts are at most the keys of its tier (a tier holds at most every row), and a table only as full
# as that keeps collisions rare.
MIN_GHOST_BITS, MAX_GHOST_BITS = 12, 22
# A key's tag is bits [TAG_SHIFT, TAG_SHIFT + 32) of its hash, whose top bits are its slot: the tag
# ends where the smallest table's slot begins, so it holds every bit a doubling adds to a slot (bits
# 42..51, for 13 to 22 bits), and beside a slot of any size at least 22 bits of its own (a false
# match 1 in 4M at the largest size; 32 bits at the smallest). Before, the tag was the key's low 32
# bits, from which no larger table's slot could be found: each doubling forgot every ghost.
TAG_SHIFT = 64 - MIN_GHOST_BITS - 32


def ghost_bits(rows: int) -> int:
    """log2 of the slots of a ghost table for a block table of `rows` rows."""
    return int(np.clip(int(np.ceil(np.log2(max(rows, 1)))) + 1, MIN_GHOST_BITS, MAX_GHOST_BITS))


class GhostKeys:
    """Content keys hashed once for every ghost table that looks them up: one referenced batch
    meets up to six (each tier's split, HBM's inner split, the gate's two), all hashing the same
    keys. A table of 2**bits slots puts a key at the top bits of its hash; its tag is 32 bits of the
    hash below the smallest table's slot (TAG_SHIFT), with a tag of 0 (which marks an empty slot)
    stored as 1 (a rare false match, or a ghost a doubling places wrongly: a missed count)."""

    __slots__ = ("keys", "hash", "tag")

    def __init__(self, keys: np.ndarray, hashed: tuple[np.ndarray, np.ndarray] | None = None):
        k = np.asarray(keys, dtype=np.uint64).reshape(-1)
        self.keys = k
        if hashed is None:
            # Fibonacci hashing of a mix of the key (keys.py: fib_slots); an array's uint64 products
            # wrap without a warning.
            h = (k ^ (k >> np.uint64(29))) * np.uint64(FIB)
            hashed = (h, np.maximum((h >> np.uint64(TAG_SHIFT)).astype(np.uint32), np.uint32(1)))
        self.hash, self.tag = hashed

    @classmethod
    def of(cls, keys) -> "GhostKeys":
        return keys if isinstance(keys, GhostKeys) else cls(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def keyed(self) -> "GhostKeys":
        """These keys less key 0 (a block without a key has no ghost)."""
        has = self.keys != 0
        return self if has.all() else self.take(has)

    def take(self, which: np.ndarray) -> "GhostKeys":
        """The keys at `which` (a mask or indices), hashes kept."""
        return GhostKeys(self.keys[which], (self.hash[which], self.tag[which]))

    def slots(self, bits: int) -> np.ndarray:
        """Each key's slot in a table of 2**bits slots (int64)."""
        return (self.hash >> np.uint64(64 - bits)).astype(np.int64)


class _Slots:
    """Arrays of one table size: tag (0: empty), departure number, payload (or None)."""

    __slots__ = ("bits", "tag", "seq", "payload")

    def __init__(self, bits: int, payload: bool):
        self.bits = bits
        self.tag = np.zeros(1 << bits, dtype=np.uint32)
        self.seq = np.zeros(1 << bits, dtype=np.uint32)
        self.payload = np.zeros(1 << bits, dtype=np.int8) if payload else None

    def put(self, slot: np.ndarray, tag: np.ndarray, seq, payload) -> None:
        self.tag[slot] = tag
        self.seq[slot] = seq
        if self.payload is not None:
            self.payload[slot] = payload

    def take(self, slot: np.ndarray, tag: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Departure numbers and payloads of the slots holding these tags, which forget them."""
        slot = slot[self.tag[slot] == tag]
        if len(slot) > 1:
            slot = np.unique(slot)  # a key asked twice in one batch speaks once (it counted twice)
        self.tag[slot] = 0
        return self.seq[slot], None if self.payload is None else self.payload[slot]


class GhostTable:
    """A ghost table (the module's docstring). It grows with the block table keeping its ghosts:
    the larger table's arrays start empty and the smaller one's ghosts move over a stretch of
    MOVE_SLOTS slots at each later remember or recall, a key whose old slot has not moved yet being
    remembered and recalled there. (Moving them all at once held the daemon's loop 79 ms at the
    block table's doubling to 1M rows and 164 ms to 2M, four tables of a heat policy whose HBM sent
    blocks down, on the 2-core VM; making the tables anew, as before, forgot every ghost.)"""

    MOVE_SLOTS = 1 << 16

    def __init__(self, rows: int, payload: bool = False):
        self._now = _Slots(ghost_bits(rows), payload)
        self._old: _Slots | None = None  # the smaller table, while its ghosts move over
        self._moved = 0  # ... its slots below this have moved
        self.remembered = False  # whether a key was ever remembered (an empty table grows for free)

    @property
    def bits(self) -> int:
        return self._now.bits

    def ghosts(self) -> int:
        """Ghosts held (a pass over the tables: for tests and checks, not the hot path)."""
        old = 0 if self._old is None else int(np.count_nonzero(self._old.tag[self._moved:]))
        return int(np.count_nonzero(self._now.tag)) + old

    def grow(self, bits: int) -> None:
        """To 2**bits slots (from fewer), keeping every ghost: a ghost in slot s of 2**b slots goes
        to slot s << (bits - b) | the hash bits below its old slot, read from its tag (distinct old
        slots give distinct new ones: nothing collides), over the next calls (`_move`)."""
        if bits > MAX_GHOST_BITS:  # invariant: the tag holds the bits of slots up to MAX_GHOST_BITS
            raise ValueError(f"a ghost table of 2**{bits} slots: at most 2**{MAX_GHOST_BITS}")
        if bits <= self.bits:
            return
        payload = self._now.payload is not None
        if not self.remembered:
            self._now = _Slots(bits, payload)  # (zero pages, not yet touched)
            return
        self._move(None)  # (the last growth's, where it has not ended)
        self._old, self._now, self._moved = self._now, _Slots(bits, payload), 0

    def _move(self, n: int | None) -> None:
        """Move the next `n` slots of the smaller table (None: all that are left) into the larger."""
        old = self._old
        if old is None:
            return
        a = self._moved
        b = len(old.tag) if n is None else min(len(old.tag), a + n)
        used = np.flatnonzero(old.tag[a:b])
        if len(used):
            tag = old.tag[a:b][used]
            extra = self.bits - old.bits
            below = (tag >> np.uint32(64 - self.bits - TAG_SHIFT)) & np.uint32((1 << extra) - 1)
            slot = ((used + a) << extra) | below.astype(np.int64)
            self._now.put(slot, tag, old.seq[a:b][used], None if old.payload is None else old.payload[a:b][used])
        self._moved = b
        if b == len(old.tag):
            self._old = None

    def _where(self, keys: GhostKeys) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Each key's slot in the larger table; while ghosts move, which keys are still the smaller
        table's (their old slot has not moved) and their old slots."""
        slot = keys.slots(self.bits)
        if self._old is None:
            return slot, None, None
        old_slot = slot >> (self.bits - self._old.bits)
        return slot, old_slot >= self._moved, old_slot

    def remember(self, keys: np.ndarray | GhostKeys, seq, payload: int = 0) -> None:
        """Keys left, with their departure numbers (one, or one per key)."""
        keys = GhostKeys.of(keys)
        self._move(self.MOVE_SLOTS)
        self.remembered = True
        slot, in_old, old_slot = self._where(keys)
        if in_old is None or not in_old.any():
            self._now.put(slot, keys.tag, seq, payload)
            return
        seq = np.broadcast_to(np.asarray(seq, dtype=np.uint32), len(keys))
        self._now.put(slot[~in_old], keys.tag[~in_old], seq[~in_old], payload)
        self._old.put(old_slot[in_old], keys.tag[in_old], seq[in_old], payload)

    def recall(self, keys: np.ndarray | GhostKeys) -> tuple[np.ndarray, np.ndarray | None]:
        """The departure numbers and payloads (None: the table keeps none) of the keys remembered
        here, in no particular order; recalled, they are forgotten."""
        keys = GhostKeys.of(keys)
        self._move(self.MOVE_SLOTS)
        slot, in_old, old_slot = self._where(keys)
        if in_old is None or not in_old.any():
            return self._now.take(slot, keys.tag)
        seq, payload = self._now.take(slot[~in_old], keys.tag[~in_old])
        old_seq, old_payload = self._old.take(old_slot[in_old], keys.tag[in_old])
        return (np.concatenate([seq, old_seq]),
                None if payload is None else np.concatenate([payload, old_payload]))
