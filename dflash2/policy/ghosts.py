"""Ghost tables: keys that recently left, for the policies that learn from their return (split.py's
targets, gate.py's admission gate).

Hashed, one slot per key (ghost_bits: twice the block table's rows): a 32-bit tag of the key,
its departure number mod 2**32 (differences in uint32 arithmetic wrap with the counters) and
optionally a one-byte payload (the list it left). A slot taken by another key forgets the older one:
a missed count, never a wrong one. A ghost speaks once: recalling a key forgets it.
"""

from __future__ import annotations

import numpy as np

from dflash2.keys import FIB

# Twice as many slots as the block table has rows, to the next power of two, 4096 to 4M: a table's
# ghosts are at most the keys of its tier (a tier holds at most every row), and a table only as full
# as that keeps collisions rare.
MIN_GHOST_BITS, MAX_GHOST_BITS = 12, 22


def ghost_bits(rows: int) -> int:
    """log2 of the slots of a ghost table for a block table of `rows` rows."""
    return int(np.clip(int(np.ceil(np.log2(max(rows, 1)))) + 1, MIN_GHOST_BITS, MAX_GHOST_BITS))


class GhostKeys:
    """Content keys hashed once for every ghost table that looks them up: one referenced batch
    meets up to six (each tier's split, HBM's inner split, the gate's two), all hashing the same
    keys. A table of 2**bits slots puts a key at the top bits of its hash; its tag is the key's low
    32 bits, with a tag of 0 (which marks an empty slot) stored as 1 (a rare false match)."""

    __slots__ = ("keys", "hash", "tag")

    def __init__(self, keys: np.ndarray, hashed: tuple[np.ndarray, np.ndarray] | None = None):
        k = np.asarray(keys, dtype=np.uint64).reshape(-1)
        self.keys = k
        if hashed is None:
            # Fibonacci hashing of a mix of the key (keys.py: fib_slots); an array's uint64 products
            # wrap without a warning.
            hashed = ((k ^ (k >> np.uint64(29))) * np.uint64(FIB),
                      np.maximum((k & np.uint64(0xFFFFFFFF)).astype(np.uint32), np.uint32(1)))
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


class GhostTable:
    def __init__(self, rows: int, payload: bool = False):
        self.bits = ghost_bits(rows)
        self.tag = np.zeros(1 << self.bits, dtype=np.uint32)  # 0: empty
        self.seq = np.zeros(1 << self.bits, dtype=np.uint32)
        self.payload = np.zeros(1 << self.bits, dtype=np.int8) if payload else None

    def remember(self, keys: np.ndarray | GhostKeys, seq, payload: int = 0) -> None:
        """Keys left, with their departure numbers (one, or one per key)."""
        keys = GhostKeys.of(keys)
        slot = keys.slots(self.bits)
        self.tag[slot] = keys.tag
        self.seq[slot] = seq
        if self.payload is not None:
            self.payload[slot] = payload

    def recall(self, keys: np.ndarray | GhostKeys) -> np.ndarray:
        """Slots of the keys remembered here (their `seq` and `payload` still readable), forgotten."""
        keys = GhostKeys.of(keys)
        slot = keys.slots(self.bits)
        slot = slot[self.tag[slot] == keys.tag]
        self.tag[slot] = 0
        return slot
