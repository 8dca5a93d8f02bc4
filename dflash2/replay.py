"""Serving one request of a trace through a block manager, as a serving engine does it.

What `dflash2 bench policy` replays at full size and what the duel (duel.py) replays in miniature:
per request, in arrival order,

1. lookup: the leading run of cached blocks is the request's prefix;
   its blocks that step 2 reads are its hits (counted in any tier, and in HBM: the blocks already
   there on arrival);
2. read the hit blocks in order, `chunk` blocks at a time (acquire: promoted to HBM, prefix first,
   and pinned), with the prefetcher keeping its window ahead of the read position;
3. allocate, commit (chained to the last hit block) and free the missing blocks: they stay cached,
   and the policy decides what leaves HBM (to DRAM, NVMe, or out) to make room for them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflash2.errors import NeverFits
from dflash2.prefetch import Prefetcher
from dflash2.tiers import Tier


@dataclasses.dataclass(frozen=True)
class Request:
    t_s: float
    keys: tuple[int, ...]


@dataclasses.dataclass
class Tally:
    refs: int = 0
    hits: int = 0  # blocks of the leading cached run that were read
    hbm_hits: int = 0  # of those, the blocks already in HBM on arrival
    # Blocks of the leading cached run that could not be read (HBM could not be given room for
    # them): recomputed. Before, they counted as hits (a review: LRU's figure equal to Belady's on a
    # 5-request trace, 41 blocks "found" and 15 read).
    found_not_read: int = 0
    uncached: int = 0  # blocks served, never cached (a request larger than HBM, or no room made for it)


def serve(mgr, prefetch: Prefetcher, client: int, lid: int, req: Request, index: int,
          tally: Tally, chunk: int) -> None:
    """Serve `req` (the `index`-th request) through `mgr` for `client`, blocks of layout `lid`;
    adds its references and hits to `tally`."""
    keys = req.keys
    # (Rows, not the in-process API's list of places: a place object per block cost the duel's
    # miniatures, which serve every sampled lookup this way, more than the answer itself.)
    rows = mgr.lookup_rows(keys, lid)
    tally.refs += len(keys)
    in_hbm = mgr.table.cols.tier[rows] == int(Tier.HBM)  # (on arrival)
    hit_vids = mgr.table.vids(rows).tolist()
    if hit_vids:
        mgr.add_ref(client, hit_vids)  # the request holds its prefix: demotable, never dropped
    held: list[int] = []
    # Read the cached prefix in order; the prefetcher runs its window ahead of the read position.
    # While one chunk is read (computed on), the next window's blocks come up.
    for start in range(0, len(hit_vids), chunk):
        part = hit_vids[start: start + chunk]
        read = prefetch.peek(part)  # (settled once the read succeeds: one refused read nothing)
        try:
            acquired = mgr.acquire_rows(client, part)
        except NeverFits:  # a chunk larger than HBM
            acquired = None
        if acquired is None:
            break  # HBM cannot hold the prefix (request larger than the tier): recompute the rest
        if read is not None:
            prefetch.count(read)
        held += part
        prefetch.ahead(hit_vids, start + len(part))
    prefetch.finish()
    tally.hits += len(held)
    tally.hbm_hits += int(np.count_nonzero(in_hbm[:len(held)]))
    tally.found_not_read += len(rows) - len(held)
    missing = keys[len(held):] if len(held) < len(rows) else keys[len(rows):]
    parent = held[-1] if held else None
    if missing:
        try:
            vids = mgr.allocate(client, lid, len(missing), request=index)
        except NeverFits:  # a request larger than HBM: served, never cached
            vids = None
        if vids is None:
            tally.uncached += len(missing)
        else:
            vids = mgr.commit(client, vids, missing, parent)
            mgr.free(client, vids)
    if held:
        mgr.release(client, held)
    if hit_vids:
        mgr.free(client, hit_vids)
