"""The client's checks of its callers' arguments, as the daemon takes them: block ids, integers,
content keys, place records and layouts, each refused by name before anything is sent (an error
from deep inside numpy or the encoder named nothing the caller wrote)."""

from __future__ import annotations

import numpy as np

from dflash2 import protocol as P
from dflash2.keys import NONE_BAD, first_not_integer, key_array
from dflash2.layout import Layout


def vid_array(vids) -> np.ndarray:
    """Block ids as the wire's int64s. Only integers: a float id was cut to another block's without a
    word (ids are near 2^61, where a float64 keeps multiples of 512: a commit of block 1 given as
    floats published block 0's unwritten bytes under the key), and a bool is no id."""
    arr = np.asarray(vids)
    if arr.size and arr.dtype.kind not in "iu":
        if isinstance(vids, np.ndarray) or hasattr(vids, "dtype"):  # (an array, a tensor: its dtype says)
            raise TypeError(f"block ids are integers, got an array of {arr.dtype}")
        # A list of numpy uint64 and Python ints becomes float64 (numpy's promotion): by element.
        items = np.asarray(vids, dtype=object).reshape(-1)
        odd = first_not_integer(items)
        if odd is not NONE_BAD:  # (a bad id may be None itself: it was taken for none, and int(None) raised)
            raise TypeError(f"block ids are integers, got {odd!r}")
        ints = [int(v) for v in items]
        bad = next((v for v in ints if not 0 <= v < 1 << 64), None)
        if bad is not None:
            raise ValueError(f"block id {bad} is out of range")
        arr = np.array(ints, dtype=np.uint64)
    return np.ascontiguousarray(arr.reshape(-1)).astype(P.VIDS_DTYPE, copy=False)


def _vids(vids) -> bytes:
    return vid_array(vids).tobytes()


def _int(name: str, value) -> int:
    """An integer argument, as the daemon takes it: `int()` turned 2.9 blocks into 2 and layout 0.9
    into layout 0 without a word (the daemon refuses floats; here they never reached it)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _seconds(name: str, value) -> float:
    """A number of seconds, as the daemon takes it: `float()` took "30" and True (1 s) without a word,
    and "abc" failed with Python's own message, naming no argument (a review)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    return float(value)


def _keys(keys) -> bytes:
    """Content keys as the wire's uint64s (`key_array`: ValueError for any that is not an integer in
    [0, 2^64))."""
    return key_array(keys).astype(P.KEYS_DTYPE, copy=False).tobytes()


def vid_of(place) -> int:
    """The vid a view names: a vid (an int), or one place record (places[i]; a whole array of them
    failed inside numpy: "only 0-dimensional arrays can be converted", a review)."""
    if isinstance(place, (int, np.integer)) and not isinstance(place, bool):
        return int(place)
    if getattr(place, "dtype", None) == P.PLACE_DTYPE and np.ndim(place) == 0:
        return int(place["vid"])
    raise TypeError(f"a block is named by one place record (PLACE_DTYPE: places[i]) or by the vid (an int) of a "
                    f"block this client writes or has acquired, not {type(place).__name__} {place!r}")


def layout_dict(layout) -> dict:
    """A layout as the wire takes it (a dict or a name failed as "has no attribute 'to_dict'")."""
    if not isinstance(layout, Layout):
        raise TypeError(f"a layout is a dflash2.layout.Layout (Layout(name, num_layers, num_kv_heads, head_dim, "
                        f"dtype, tokens_per_block)), not {type(layout).__name__} {layout!r}")
    return layout.to_dict()
