"""The two data paths of sglang's storage backend: a batch of pages stored (`_store`: lookup, allocate,
copy in, commit linked to the batch before, the chain's tip held: chains.py) and read (`_load`:
lookup, acquire, copy out, release). A part of `DFlash2Storage` (backend.py), apart because how pages
move to and from the daemon is a job of its own; it uses the backend's client-facing state (`keys`,
`layout_id`, `tier`, `tips`, `chunk_pages`) and its accounting (`_count`, `_failed`, `_note_moved`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, List, Optional

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from dflash2.client.client import Client
from dflash2.client.sglang.chains import HeldTips, cached_prefix, commit_linked
from dflash2.errors import DaemonUnavailable, DFlash2Error

log = logging.getLogger("dflash2.sglang")

# A read the daemon gives no room (its pages are misses) is logged at most this often (seconds).
REFUSAL_LOG_S = 60.0


class DataPaths:
    """`DFlash2Storage`'s stores and reads (the attributes it uses are the backend's)."""

    def _store(self, client: Client, page_keys: Sequence[str], write: Callable[[int, Any], None],
               extra_info: Optional[HiCacheStorageExtraInfo]) -> List[bool]:
        """Pages not cached yet become blocks; True for each page cached afterwards."""
        n = len(page_keys)
        ok = [False] * n
        ckeys = self.keys.keys(page_keys)
        found = cached_prefix(client, ckeys, self.layout_id, self.tier, probe=True)
        start = len(found)
        ok[:start] = [True] * start
        self._count("pages_deduplicated", start)
        parent = int(found["vid"][-1]) if start else self._prefix_parent(client, extra_info)
        if (tips := self.tips).client is not client:  # (read once: a reattach may replace it meanwhile)
            tips = HeldTips(client, 0)
        told = getattr(extra_info, "prefix_keys", None)  # (None: sglang names no parent later, chains.py)
        above = len(told or ())  # (the chain's pages before the batch)
        with tips.writing(client, parent, keeps=told is not None) as writing:  # (its parent kept: chains.py)
            if stale := tips.stale():
                client.free(stale)
            for lo in range(start, n, self.chunk_pages):
                hi = min(n, lo + self.chunk_pages)
                try:
                    places = client.allocate(self.layout_id, hi - lo, tier=self.tier)
                    if places is None and tips.let_go(client, "a write was refused (tried again)"):
                        places = client.allocate(self.layout_id, hi - lo, tier=self.tier)  # (held chains may fill it)
                    if places is None:
                        self._refused(client, "writes", n - lo)
                        break
                    try:
                        for place, i in zip(places, range(lo, hi)):
                            write(i, client.view_bytes(place))
                        held = self._commit(client, places["vid"], ckeys[lo:hi], parent)
                    except DaemonUnavailable:
                        # The commit timed out: the client asked the daemon to forget it, which drops
                        # these blocks whichever way it went (protocol.UNDOABLE). A free from here could
                        # name ids a late commit replaced, or be lost on a socket the daemon never read.
                        raise
                    except BaseException:
                        client.free(places["vid"])  # written or not, never committed: give them back
                        raise
                    # Our reference on the batch's last block stays, the next batch's parent (chains.py).
                    let_go = tips.extended(parent, int(held[-1]), above + hi, told is not None or hi < n, writing)
                    parent = writing.mine
                    unheld = np.concatenate([held[:-1], np.asarray(let_go, dtype=held.dtype)])
                    if len(unheld):
                        client.free(unheld)
                except DFlash2Error as e:
                    if not any(ok):
                        raise  # nothing stored: the call failed as a whole
                    self._failed(client, e)  # the pages stored so far stay stored, and say so
                    break
                ok[lo:hi] = [True] * (hi - lo)
                # A page another server cached since the lookup: its commit answered that block (counted
                # stored, it was not: a review).
                twins = int(np.count_nonzero(np.asarray(held) != np.asarray(places["vid"])))
                self._count("pages_deduplicated", twins)
                self._count("pages_set", hi - lo - twins)
                self._note_moved(hi - lo - twins)
        return ok

    def _prefix_parent(self, client: Client, extra_info) -> int | None:
        """The block of the page just before this batch, when cached: the chain's parent, so that the
        daemon knows the prefix (descendants leave a tier before their ancestors)."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if not prefix:
            return None
        found = client.lookup(self.keys.keys(prefix[-1:]), self.layout_id, tier=self.tier, probe=True)
        return int(found["vid"][0]) if len(found) else None

    def _commit(self, client: Client, vids, ckeys, parent: int | None) -> np.ndarray:
        out, unlinked = commit_linked(client, vids, ckeys, parent)
        if unlinked is not None:
            self._count("commits_unlinked")
            log.info("dflash2: %d pages committed without their parent link (%s): the daemon does not "
                     "know they extend that prefix", len(vids), unlinked)
        return out

    def _load(self, client: Client, page_keys: Sequence[str], read: Callable[[int, Any], None]) -> List[bool]:
        """Copy the cached prefix of `page_keys` out; True for each page read."""
        n = len(page_keys)
        ok = [False] * n
        found = cached_prefix(client, self.keys.keys(page_keys), self.layout_id, self.tier, probe=True)
        for lo in range(0, len(found), self.chunk_pages):
            vids = found["vid"][lo:lo + self.chunk_pages]
            try:
                places = client.acquire(vids, tier=self.tier)
                if places is None:  # no room to read them now: the rest is a miss
                    self._refused(client, "reads", len(found) - lo)
                    break
                by_vid = {int(p["vid"]): p for p in places}
                try:
                    for j, vid in enumerate(vids.tolist()):
                        read(lo + j, client.view_bytes(by_vid[vid]))
                finally:
                    client.release(vids)
            except DFlash2Error as e:
                if not lo:
                    raise  # nothing read: the call failed as a whole
                self._failed(client, e)  # the pages read so far are hits; the rest a miss
                break
            ok[lo:lo + len(vids)] = [True] * len(vids)
        self._note_moved(sum(ok))
        return ok

    def _loaded(self, ok: List[bool]) -> List[bool]:
        """A read's pages counted, got or missed, whichever way it ended (counted by `_load` alone, the
        misses of a read that failed whole or found the daemon down went uncounted, a review)."""
        got = sum(ok)
        self._count("pages_got", got)
        self._count("page_misses", len(ok) - got)
        return ok

    def _refused(self, client: Client, kind: str, pages: int) -> None:
        """The daemon had no room now for `pages` pages (`kind` "reads": an acquire answered None, they
        are misses, which sglang recomputes; "writes": an allocate did, sglang keeps them in its host
        cache), its reason in `client.last_refusal` (this thread's own). Said at most every
        REFUSAL_LOG_S for each kind (a refused read was not said at all before; a refused write, at
        every batch and without the daemon's reason: a review)."""
        with self._count_lock:
            self.counters[f"{kind}_refused"] += 1
            now = time.monotonic()
            if now < self._refusal_logged[kind] + REFUSAL_LOG_S:
                return
            self._refusal_logged[kind] = now
            refused = self.counters[f"{kind}_refused"]
        what = ("to read %d cached pages now, misses that sglang recomputes" if kind == "reads"
                else "to store %d pages now; sglang keeps them in its host cache") % pages
        log.warning("dflash2: the daemon gave no room %s (%d %s refused so far; said at most every %gs): %s", what,
                    refused, kind, REFUSAL_LOG_S, client.last_refusal)
