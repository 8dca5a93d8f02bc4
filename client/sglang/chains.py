"""How sglang's pages are chained in the daemon: the cached prefix of a batch's keys, and the chain
tips a backend keeps until the next batch of the chain links to them.

sglang backs a request's pages up in batches, each under the last page of the batch before (it passes
that prefix's keys: `hicache_storage_pass_prefix_keys`). The backend commits a batch linked to that
page's block and then frees its reference on the batch's blocks: they stay cached, the daemon's to
move and to drop. A chain's newest block is a leaf, the first of its chain to be dropped from the
whole cache when room is made for other writes (under `heat` above all: a block written once and
never read scores as a finished request's). Once it is gone, the next batch has no parent to link to,
and lookups of the request's pages stop before it: the pages after it were stored for nothing.

So the backend keeps its reference on the newest block of each chain it writes (`HeldTips`), until a
later batch is committed under it, or it is among the oldest beyond the limits. A block with a
reference is never dropped (it may still move down a tier), nor is any block above it in its chain
(a cached child holds its parent): a hold keeps a whole chain, shared prefix and all, so the limits
count each held chain's whole depth against a share of the tier the backend writes to.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from dflash2.client.client import Client
from dflash2.protocol import MAX_BATCH

# Chains a backend holds at most, each by one reference on its newest block
MAX_HELD_TIPS = 64
# ... and their depths' sum at most: this share of its tier's pages (1/32: the tensor-parallel ranks of
# an 8-GPU server keep at most a quarter of their tier's worth of pages out of reach of dropping)
HELD_PAGES_SHARE = 1 / 32


def cached_prefix(client: Client, ckeys: np.ndarray, layout: int, tier: str, probe: bool = False) -> np.ndarray:
    """Places of the cached prefix of `ckeys`, looked up MAX_BATCH keys a call (the most one call
    carries): sglang's hit query passes every page of a prompt at once (65,536 pages is a
    65,536-token prompt at sglang's default page size of 1). `probe`: not the request's lookup,
    which sglang's hit query (`batch_exists`) made: a backup's, and the read's own again (counted,
    a page was a lookup hit or miss two or three times in the daemon's figures, a review)."""
    found = [client.lookup(ckeys[:MAX_BATCH], layout, tier=tier, probe=probe)]
    for lo in range(MAX_BATCH, len(ckeys), MAX_BATCH):
        if len(found[-1]) < MAX_BATCH:
            break
        found.append(client.lookup(ckeys[lo:lo + MAX_BATCH], layout, tier=tier, probe=probe))
    return found[0] if len(found) == 1 else np.concatenate(found)


class HeldTips:
    """The references one backend keeps on its chains' newest blocks, for one attached client (a
    client attached again after a daemon restart gets its own: the old one's references went with
    its session, and its block ids mean nothing to the new daemon).

    Invariant: `_pages` is the sum of the held tips' depths (the pages from each chain's root to its
    tip: the most a hold keeps from being dropped), and after every call at most `max_tips` tips are
    held and `_pages` is at most `max_pages`. Thread-safe: sglang's storage threads store at once."""

    def __init__(self, client: Client | None, tier_pages: int):
        self.client = client
        self.max_pages = int(tier_pages * HELD_PAGES_SHARE)
        self.max_tips = MAX_HELD_TIPS if self.max_pages > 0 else 0
        self._lock = threading.Lock()
        # tip vid -> [references held on it, its depth], oldest first
        self._held: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._pages = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def pages(self) -> int:
        return self._pages

    def extended(self, parent: int | None, tip: int, depth: int) -> list[int]:
        """A batch was committed under `parent` (None: unlinked, or a chain's first) and ends in `tip`,
        `depth` pages from its chain's root at most; the caller's reference on `tip` (the commit's) is
        kept here. Returns the vids to free now, one entry a reference: the parent's, whose chain goes
        on under `tip` (which holds it), and the oldest tips' beyond the limits (`tip`'s own when it
        alone is)."""
        with self._lock:
            free: list[int] = []
            if parent is not None and parent in self._held:
                refs, counted = self._held.pop(parent)
                free += [parent] * refs
                self._pages -= counted
            refs, had = self._held.pop(tip, (0, 0))  # (a tip committed twice: deduplicated to one block)
            counted = max(had, int(depth))
            self._held[tip] = [refs + 1, counted]
            self._pages += counted - had
            while self._held and (len(self._held) > self.max_tips or self._pages > self.max_pages):
                vid, (refs, counted) = self._held.popitem(last=False)
                free += [vid] * refs
                self._pages -= counted
            return free
