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
later batch is committed under it, at a store HOLD_S after its batch, it is among the oldest beyond
the limits, or a write of the backend's is refused; a tip no later batch can name (sglang passes no
prefix keys) is not kept past its call. A block with a reference is never dropped, nor is any block
above it in its chain (a cached child holds its parent): a hold keeps a whole chain, shared prefix
and all, so the limits count each held chain's whole depth against a share of the tier the backend
writes to. Nor is a held chain moved down to make room for a write (only idle blocks are), and
`heat` scores a held block as one in use: where holds fill a tier, writes into it are refused until
they are let go (a backend lets its own go when its write is refused, and tries once more).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import numpy as np

from dflash2.client.client import Client
from dflash2.errors import DaemonError, DFlash2Error
from dflash2.protocol import MAX_BATCH

log = logging.getLogger("dflash2.sglang")

# Chains a backend holds at most, each by one reference on its newest block
MAX_HELD_TIPS = 64
# ... and their depths' sum at most: this share of its tier's pages (1/32: the tensor-parallel ranks of
# an 8-GPU server keep at most a quarter of their tier's worth of pages out of reach of dropping)
HELD_PAGES_SHARE = 1 / 32
# ... each let go at a store this long after its batch (seconds): sglang backs a request's chunks up
# as they are prefilled, and its decoded tail when it finishes
HOLD_S = 30.0


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


def commit_linked(client: Client, vids, ckeys, parent: int | None) -> tuple[np.ndarray, DaemonError | None]:
    """Commit `vids` with their keys under `parent` (None: unlinked); where the daemon refuses the
    parent (dropped meanwhile), without it. The vids held, and the refusal when it went unlinked."""
    unlinked = None
    if parent is not None:
        try:
            return client.commit(vids, ckeys, parent), None
        except DaemonError as e:  # the parent was evicted meanwhile: publish without the link
            unlinked = e
    return client.commit(vids, ckeys), unlinked


def slots(arena: dict, page_bytes: int) -> int:
    """How many pages of `page_bytes` the tier of `arena` (an entry of `Client.arena_info`) holds, each
    in a slot of its alignment (1 KiB pages in a DRAM tier aligned to 4 KiB take 4 KiB each)."""
    align = max(1, int(arena.get("alignment") or 1))
    return int(arena["capacity_bytes"]) // (-(-page_bytes // align) * align)


class HeldTips:
    """The references one backend keeps on its chains' newest blocks, for one attached client (a
    client attached again after a daemon restart gets its own: the old one's references went with
    its session, and its block ids mean nothing to the new daemon).

    Invariant: `_pages` is the sum of the held tips' depths (the pages from each chain's root to its
    tip: the most a hold keeps from being dropped), and after every call at most `max_tips` tips are
    held and `_pages` is at most `max_pages`, but for tips a store will write under (`writing`): none
    of the ways a tip is let go (the limits, HOLD_S, a refused write's `let_go`, a call's end, a
    sibling's commit under it, a deduplicated commit not kept) takes one while a store will write
    under it, so the held tips may pass the limits by one a store at most (its chain up to the
    share deep), until the next `extended`. Thread-safe: sglang's storage threads store at once."""

    def __init__(self, client: Client | None, tier_pages: int, clock=time.monotonic):
        self.client = client
        self.max_pages = int(tier_pages * HELD_PAGES_SHARE)
        self.max_tips = MAX_HELD_TIPS if self.max_pages > 0 else 0
        self._clock = clock
        self._lock = threading.Lock()
        # tip vid -> [references held on it, its depth, when its batch was committed], oldest first
        self._held: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._pages = 0
        self._later: list[int] = []  # references no longer held, to free at the next `stale`
        self._under: collections.Counter = collections.Counter()  # what stores will write under (`writing`)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def pages(self) -> int:
        return self._pages

    def extended(self, parent: int | None, tip: int, depth: int, keep: bool = True,
                 writing: Writing | None = None) -> list[int]:
        """A batch was committed under `parent` (None: unlinked, or a chain's first) and ends in `tip`,
        `depth` pages from its chain's root at most; the caller's reference on `tip` (the commit's) is
        kept here (`keep`: a later batch may name it), and `writing` (the store's, under `parent`)
        goes on under `tip`, in the same step. Returns the vids to free now, one entry a reference:
        the parent's hold (`_parents_go`), unless another store will write under it too (two
        requests of one prefix: the last to commit under it takes it), the
        tips held past HOLD_S or the oldest beyond the limits, and `tip`'s own when not kept (only
        the commit's: a hold of another store's on the same block stays) or alone beyond them."""
        with self._lock:
            others = self._under[parent] - (writing is not None and writing.vid == parent)
            kept = keep and max(self._held.get(tip, (0, 0))[1], int(depth)) <= self.max_pages
            free = [] if parent is None or others else self._parents_go(parent, keep, writing)
            if writing is not None:
                writing.moved(tip, kept)
            if not kept:  # (the commit's reference alone; the block may be held for another store)
                return free + [tip] + self._trim(limits=True)
            refs, had, _ = self._held.pop(tip, (0, 0, 0))  # (a tip committed twice: deduplicated to one block)
            counted = max(had, int(depth))
            self._held[tip] = [refs + 1, counted, self._clock()]
            self._pages += counted - had
            return free + self._trim(limits=True)

    def _parents_go(self, parent: int, keep: bool, writing: Writing | None) -> list[int]:
        """Under the lock: what a commit under `parent` gives up of its hold: every reference where a
        later batch may name the new tip (`keep`: it is held, keeping the chain, `parent` in it, or
        the chain is beyond the share and held no more) or the caller holds them all (no `writing`);
        else (a call's last chunk, sglang passing no prefix keys) the store's own alone, where it
        kept one (another request's hold on the same block, deduplicated, stays: a review)."""
        if keep or writing is None:
            return self._take(parent)
        return self._take_one(parent) if writing.kept and writing.mine == parent and parent in self._held else []

    def stale(self) -> list[int]:
        """The references held past HOLD_S, and those let go for later (`let_go_later`), given up here
        (the caller frees them)."""
        with self._lock:
            free, self._later = self._later, []
            return free + self._trim(limits=False)

    def let_go_later(self) -> None:
        """Stop holding every tip (no later batch will name them: the backend's keys moved to another
        clear epoch); their references are given up by the next `stale` (sglang's clear runs in its
        scheduler's thread, under the backend's lock: no daemon call there)."""
        with self._lock:
            self._later += [vid for vid, (refs, _, _) in self._held.items() for _ in range(refs)]
            self._held.clear()
            self._pages = 0

    @contextlib.contextmanager
    def writing(self, client: Client, parent: int | None, keeps: bool):
        """One store's calls, from its parent chosen to its end: `let_go` keeps the block its next
        batch goes under held (`parent`, then each tip it commits: `extended`), the store's
        own or another storage thread's at the time. A store that `keeps` nothing past it (sglang
        passed no prefix keys) lets its last tip go at the end, whichever way it ends."""
        writing = Writing(self, parent)
        try:
            yield writing
        finally:
            # (its own reference on its last tip, kept for a chunk it did not store: `only`)
            only = writing.mine if not keeps and writing.kept else None
            self.let_go(client, "a call without prefix keys ended", only=only, ending=writing)

    def let_go(self, client: Client | None, why: str, only: int | None = None, ending: Writing | None = None) -> int:
        """Give the references of every tip held up (a write was refused: their chains may be what
        fills the tier), or, with `ending` (a store that ends, its protection lifted in the same step:
        between two, another store's let-go could take another's reference, a review), one of `only`
        (its own; another's on the same block, deduplicated, stays), but those stores will write
        under, freed through `client` where it is the one they were taken on (the references of a
        client replaced since went with its session). Returns how many tips went."""
        with self._lock:
            if ending is not None:
                ending._keep(None)
                going = [only] if only in self._held and only not in self._under else []
                free = [v for vid in going for v in self._take_one(vid)]
            else:
                going = [vid for vid in self._held if vid not in self._under]
                free = [v for vid in going for v in self._take(vid)]
        if free and client is not None and client is self.client:
            try:
                client.free(free)
                log.info("dflash2: %s: the references held on %d chain tips were given up", why, len(going))
            except DFlash2Error as e:  # (they go at the client's detach at the latest)
                log.warning("dflash2: %s: the references held on %d chain tips were not given up (%s)", why,
                            len(going), e)
        return len(going)

    def _trim(self, limits: bool) -> list[int]:
        """Under the lock: stop holding the oldest tips while they are held past HOLD_S (or, with
        `limits`, beyond the limits), but those a store will write under (`writing`). Their
        references, one entry each."""
        deadline = self._clock() - HOLD_S
        free: list[int] = []
        for vid in list(self._held):  # (oldest first)
            over = limits and (len(self._held) > self.max_tips or self._pages > self.max_pages)
            if not (over or self._held[vid][2] < deadline):
                break
            if vid not in self._under:
                free += self._take(vid)
        return free

    def _take_one(self, vid: int) -> list[int]:
        """One reference of held `vid` (under the lock): the tip stays held while it has more."""
        entry = self._held[vid]
        if entry[0] == 1:
            return self._take(vid)
        entry[0] -= 1
        return [vid]

    def _take(self, vid: int) -> list[int]:
        """Stop holding `vid` (under the lock): its references, one entry each (none when not held)."""
        refs, counted, _ = self._held.pop(vid, (0, 0, 0))
        self._pages -= counted
        return [vid] * refs


class Writing:
    """The block one store's next batch goes under, kept from `HeldTips.let_go`, `stale` and the limits
    (counted in `_under`)."""

    def __init__(self, tips: HeldTips, parent: int | None):
        self.tips, self.vid, self.mine = tips, None, None
        self.kept = False  # (whether `mine` holds a reference of this store's: `HeldTips.extended`)
        self.protect(parent)

    def protect(self, vid: int | None) -> None:
        """Keep `vid` instead (None: nothing), in one step under the tips' lock."""
        with self.tips._lock:
            self._keep(vid)

    def moved(self, tip: int, kept: bool) -> None:
        """Under the tips' lock (`HeldTips.extended`): a batch of this store's ended in `tip`, which
        its next goes under, its reference held (`kept`) or given up."""
        self._keep(tip)
        self.mine, self.kept = tip, kept

    def _keep(self, vid: int | None) -> None:
        under = self.tips._under
        if self.vid is not None:
            under[self.vid] -= 1
            if not under[self.vid]:
                del under[self.vid]
        if vid is not None:
            under[vid] += 1
        self.vid = vid
