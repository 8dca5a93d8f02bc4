"""Content keys: a chained 64-bit hash per block of token ids, shared by clients and tests.

Block i's key hashes block i-1's key with block i's token ids, so a key names a block *and its
whole prefix*: two requests share block i only when they share every token before it. The chain
is seeded by a namespace (the model, or model + KV precision), so that two models never share a key.
Key 0 means "no key" on the wire and is never produced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_MASK = (1 << 64) - 1
FIB = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: Fibonacci hashing


def fib_slot(key: int, bits: int) -> int:
    """Slot of a 64-bit key in a table of 2**bits slots: the top bits of key × FIB (mod 2^64), so
    that keys which are not hashes (consecutive ids, counters) spread over the table."""
    return ((key * FIB) & _MASK) >> (64 - bits)


def fib_slots(keys: np.ndarray, bits: int) -> np.ndarray:
    """`fib_slot` of many keys at once (int64 slots). An array's uint64 products wrap without a
    warning; a numpy scalar's would warn, so a 0-d input is hashed as an array of one."""
    k = np.asarray(keys, dtype=np.uint64)
    h = k.reshape(1) * np.uint64(FIB) if k.ndim == 0 else k * np.uint64(FIB)
    h >>= np.uint64(64 - bits)
    return h.astype(np.int64).reshape(k.shape)


def _seed(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=8, person=b"dflash2-ns").digest()


def chain_keys(token_ids: Sequence[int] | np.ndarray, tokens_per_block: int, namespace: str) -> list[int]:
    """Keys of the full blocks of `token_ids` (a trailing partial block has no key: it is not
    shareable until it is full)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
    tokens = np.asarray(token_ids, dtype="<i8")
    parent = _seed(namespace)
    keys = []
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        digest = hashlib.blake2b(parent + tokens[start:start + tokens_per_block].tobytes(), digest_size=8).digest()
        key = int.from_bytes(digest, "little") or 1  # 0 is "no key" on the wire
        keys.append(key)
        parent = digest
    return keys
