"""Which content keys the duel replays (dflash2/duel.py): 1 in N by a hash of the key, so that a
sampled key is sampled in every request that names it, and a key in a coarser sample is in every
finer one whose N divides it."""

from __future__ import annotations

import numpy as np

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_U64 = (1 << 64) - 1
SMALL_LOOKUP = 8  # keys a lookup may have for `sampled` to hash them one by one


def sampled(keys: np.ndarray, sample: int) -> np.ndarray:
    """The keys (uint64) whose hash falls in the sample, 1 in `sample` (splitmix64's finalizer: content
    keys from a client need not be uniform in their low bits). A lookup of a few keys (sglang asks
    about one page at a time) hashes them as Python ints: five numpy steps on a tiny array cost
    about 7 us of every such lookup, a tenth of its handling."""
    if len(keys) <= SMALL_LOOKUP:
        picked = [k for k in keys.tolist() if _mix(k) % sample == 0]
        return np.array(picked, dtype=np.uint64) if picked else keys[:0]
    x = keys ^ (keys >> np.uint64(30))
    x = x * _MIX1
    x ^= x >> np.uint64(27)
    x = x * _MIX2
    x ^= x >> np.uint64(31)
    return keys[x % np.uint64(sample) == 0]


def _mix(k: int) -> int:
    """splitmix64's finalizer of one key, as `sampled` computes it over an array."""
    k = ((k ^ (k >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    k = ((k ^ (k >> 27)) * 0x94D049BB133111EB) & _U64
    return k ^ (k >> 31)
