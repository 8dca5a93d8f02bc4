"""What a client holds of the daemon's blocks, to view them by id: those it writes (allocated, not
yet committed or freed) and those it has pinned (acquired, not yet released)."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable

import numpy as np


class HeldPlaces:
    """The places of the blocks a client may view by vid: those it writes (allocate, take; until it
    commits or frees them) and those it has pinned (acquire; counted per pin, as the daemon counts
    them, until the last release). Thread-safe: threads of one engine share a Client.

    Each vid maps to (the reply's records, its index): the record is read only when a view asks for
    it. Taking a record per block out of every reply, and a Python step per block that reads it,
    cost the engine about 0.5 ms an allocate and commit of 1024 blocks, and 0.8 ms an acquire and
    release (the 2-core VM)."""

    def __init__(self):
        # Reentrant: a signal handler's call landing while this thread records a reply's places runs whole (it
        # waited for the lock its own thread held, for good, a review); each step is one per vid.
        self._lock = threading.RLock()
        self._places: dict[int, tuple[np.ndarray, int]] = {}
        self._writing: set[int] = set()
        self._pins: Counter[int] = Counter()

    def writing(self, places: np.ndarray) -> np.ndarray:
        with self._lock:
            self._writing.update(self._remember(places))
        return places

    def pinned(self, places: np.ndarray) -> np.ndarray:
        with self._lock:
            self._pins.update(self._remember(places))  # (one pin each; a vid listed twice, two)
        return places

    def _remember(self, places: np.ndarray) -> list[int]:
        """Each vid of a reply's records maps to (the records, its index); returns the vids."""
        vids = places["vid"].tolist()
        self._places.update(zip(vids, zip(itertools.repeat(places), range(len(vids)))))
        return vids

    def written(self, vids) -> Callable[[], None]:
        """Committed or freed: no longer being written (still viewable while pinned). Returns what
        puts them back, for a call refused (the client gives them up before it sends the call)."""
        vids = _vid_list(vids)
        with self._lock:
            writing = self._writing
            unwritten = [v for v in vids if v in writing]
            writing.difference_update(vids)
            dropped = self._drop_unheld(vids)
        return self._restorer(self._writing, unwritten, dropped)

    def released(self, vids) -> Callable[[], None]:
        """One pin given up per vid listed (none for a vid not pinned here). Returns what puts them
        back, as `written`."""
        vids = _vid_list(vids)
        with self._lock:
            pins = self._pins
            last, unpinned = [], []
            for v in vids:
                n = pins.get(v, 0)
                if n > 0:
                    unpinned.append(v)
                if n > 1:
                    pins[v] = n - 1
                else:
                    pins.pop(v, None)
                    last.append(v)
            dropped = self._drop_unheld(last)
        return self._restorer(self._pins, unpinned, dropped)

    def _restorer(self, held, given_up: list[int], dropped: dict) -> Callable[[], None]:
        """What puts back a call's giving up: `given_up` into `held` (the set being written, or the pin
        Counter: one pin each time a vid is listed) and the places it dropped."""
        def restore() -> None:
            with self._lock:
                held.update(given_up)
                for v, place in dropped.items():  # (where a later reply gave the vid a newer place, that one)
                    self._places.setdefault(v, place)
        return restore

    def place(self, vid: int):
        # Without the lock (one dict lookup, whole under the GIL, as each change is): a signal handler's view
        # landing while this thread recorded a reply's places waited for the lock it held, for good (a review).
        found = self._places.get(vid)
        return None if found is None else found[0][found[1]]

    def _drop_unheld(self, vids: list[int]) -> dict:
        """Forget the places of those of `vids` neither written nor pinned here; returns them."""
        writing, pins, places = self._writing, self._pins, self._places
        dropped = {}
        for v in vids:
            if v not in writing and v not in pins and v in places:
                dropped[v] = places.pop(v)
        return dropped


def _vid_list(vids) -> list[int]:
    return np.asarray(vids, dtype=np.int64).reshape(-1).tolist()
