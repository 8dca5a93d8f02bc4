"""Content keys: a chained 64-bit hash per block of token ids, shared by clients and tests.

Block i's key hashes block i-1's key with block i's token ids, so a key names a block *and its
whole prefix*: two requests share block i only when they share every token before it. The chain
is seeded by a namespace (the model, or model + KV precision), so that two models never share a key.
Key 0 means "no key" on the wire and is never produced.
"""

from __future__ import annotations

import hashlib
import numbers
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


KEYS_RANGE = "content keys must be integers in [0, 2^64)"
NONE_BAD = object()  # "no bad value found" (a bad value may be None itself)


def first_not_integer(values):
    """The first of `values` that is not an integer (a bool is none), else NONE_BAD. For a list that
    numpy turned into floats (numpy uint64 beside Python ints): checked by element."""
    return next((v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)), NONE_BAD)


def _not_key(k) -> bool:
    return isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= int(k) < 1 << 64


def key_array(keys) -> np.ndarray:
    """Content keys as a 1-d uint64 array; ValueError, naming the first bad one, for any that is not
    an integer in [0, 2^64). (Before, a float key was truncated: 7.9 was key 7; a negative numpy key
    wrapped around: -5 was 2^64 - 5; a bool was key 1; a Python int out of range raised numpy's
    OverflowError, in the client and in the block manager alike.) Key 0, "no key", is the caller's
    to refuse or to miss. A uint64 array (the daemon's, from the wire) is taken as it is."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64:
        return keys.reshape(-1)
    if isinstance(keys, range) or (isinstance(keys, (list, tuple)) and all(type(k) is int for k in keys)):
        # Python ints (chain_keys' keys, half of them past 2^63): in one numpy conversion, which
        # refuses a negative one or one past 2^64. (As a float array, which numpy makes of them,
        # each went through the object path: 3.5 times the cost of a 1024-key lookup.)
        try:
            return np.array(keys, dtype=np.uint64).reshape(-1)
        except OverflowError:
            raise ValueError(f"{KEYS_RANGE}, got {next(k for k in keys if _not_key(k))!r}") from None
    arr = np.asarray(keys)
    if not isinstance(keys, np.ndarray) and arr.dtype.kind != "O" and arr.ndim == 1:
        # Each item checked: numpy makes int64 of a bool among ints (True was key 1), and floats of
        # Python ints past 2^63 beside numpy ones.
        arr = np.array(list(keys), dtype=object)
    if not arr.size:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind == "O":
        bad = next((k for k in arr.ravel().tolist() if _not_key(k)), NONE_BAD)
        if bad is NONE_BAD:
            arr = np.array([int(k) for k in arr.ravel().tolist()], dtype=np.uint64)
    elif arr.dtype.kind not in "iu":
        bad = arr.ravel()[0]
    else:
        bad = arr[arr < 0].ravel()[0] if arr.dtype.kind == "i" and (arr < 0).any() else NONE_BAD
    if bad is not NONE_BAD:  # (a bad key may be None itself)
        raise ValueError(f"{KEYS_RANGE}, got {bad!r} (as {arr.dtype})")
    return np.asarray(arr, dtype=np.uint64).reshape(-1)


def _seed(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=8, person=b"dflash2-ns").digest()


def chain_keys(token_ids: Sequence[int] | np.ndarray, tokens_per_block: int, namespace: str) -> list[int]:
    """Keys of the full blocks of `token_ids` (a trailing partial block has no key: it is not
    shareable until it is full)."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, (int, np.integer)):
        raise TypeError(f"tokens_per_block is an integer, got {tokens_per_block!r}")
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
    if not isinstance(namespace, str):  # (an int or None failed in `_seed` as an AttributeError, a review)
        raise TypeError(f"namespace is a str, got {namespace!r}")
    tokens = np.asarray(token_ids)
    # One sequence of integers: a batch of one (`input_ids` of shape [1, N]) gave no key at all, and
    # float ids were cut to others' (1.5 keyed as 1), each without a word (a review).
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one sequence of token ids (1-D), got shape {tokens.shape}"
                         + (": pass input_ids[0] for a batch of one" if tokens.ndim == 2 and len(tokens) == 1 else ""))
    if tokens.size and tokens.dtype.kind not in "iu":
        if isinstance(token_ids, np.ndarray) or hasattr(token_ids, "dtype"):  # (an array, a tensor: its dtype says)
            raise TypeError(f"token ids are integers, got an array of {tokens.dtype}")
        # A list of numpy uint64 and Python ints becomes float64 (numpy's promotion): by element.
        items = np.asarray(token_ids, dtype=object)
        odd = first_not_integer(items)
        if odd is not NONE_BAD:
            raise TypeError(f"token ids are integers, got {odd!r}")
        tokens = np.array([int(t) for t in items], dtype="<i8")
    tokens = tokens.astype("<i8", copy=False)
    parent = _seed(namespace)
    keys = []
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        digest = hashlib.blake2b(parent + tokens[start:start + tokens_per_block].tobytes(), digest_size=8).digest()
        key = int.from_bytes(digest, "little") or 1  # 0 is "no key" on the wire
        keys.append(key)
        parent = digest
    return keys
