"""Ghost tables: keys that recently left, for the policies that learn from their return (split.py's
targets, gate.py's admission gate).

Hashed, one slot per key (ghost_bits: twice the block table's rows): a 32-bit tag of the key,
its departure number mod 2**32 (differences in uint32 arithmetic wrap with the counters) and
optionally a one-byte payload (the list it left). A slot taken by another key forgets the older one:
a missed count, never a wrong one. A ghost speaks once: recalling a key forgets it.
"""

from __future__ import annotations

import numpy as np

from dflash2.keys import fib_slots

# Twice as many slots as the block table has rows, to the next power of two, 4096 to 4M: a table's
# ghosts are at most the keys of its tier (a tier holds at most every row), and a table only as full
# as that keeps collisions rare.
MIN_GHOST_BITS, MAX_GHOST_BITS = 12, 22


def ghost_bits(rows: int) -> int:
    """log2 of the slots of a ghost table for a block table of `rows` rows."""
    return int(np.clip(int(np.ceil(np.log2(max(rows, 1)))) + 1, MIN_GHOST_BITS, MAX_GHOST_BITS))


def ghost_slots(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot, tag) of each key in a table of 2**bits slots: the tag is the key's low 32 bits. Tag 0
    marks an empty slot, so a key whose tag is 0 is stored as 1 (a rare false match)."""
    k = np.asarray(keys, dtype=np.uint64)
    tag = np.maximum((k & np.uint64(0xFFFFFFFF)).astype(np.uint32), np.uint32(1))
    return fib_slots(k ^ (k >> np.uint64(29)), bits), tag


class GhostTable:
    def __init__(self, rows: int, payload: bool = False):
        self.bits = ghost_bits(rows)
        self.tag = np.zeros(1 << self.bits, dtype=np.uint32)  # 0: empty
        self.seq = np.zeros(1 << self.bits, dtype=np.uint32)
        self.payload = np.zeros(1 << self.bits, dtype=np.int8) if payload else None

    def remember(self, keys: np.ndarray, seq, payload: int = 0) -> None:
        """Keys left, with their departure numbers (one, or one per key)."""
        slot, tag = ghost_slots(keys, self.bits)
        self.tag[slot] = tag
        self.seq[slot] = seq
        if self.payload is not None:
            self.payload[slot] = payload

    def recall(self, keys: np.ndarray) -> np.ndarray:
        """Slots of the keys remembered here (their `seq` and `payload` still readable), forgotten."""
        slot, tag = ghost_slots(keys, self.bits)
        slot = slot[self.tag[slot] == tag]
        self.tag[slot] = 0
        return slot
