"""Cost-aware reuse: is reading a cached block back cheaper than recomputing it?

Reading a block back costs its bytes over the measured bandwidth of the path from its tier to the
reader; recomputing it costs its tokens over the engine's prefill rate. On the reference machine a
32k-token KV loads from pinned DRAM 12-18x faster than it is recomputed, but from a local disk more
slowly: such a block is not worth offering as a hit, nor worth sending to that tier.

- Bandwidth is measured from the daemon's own moves, never assumed: the mover reports each finished
  batch (source, destination, bytes that arrived, and the seconds the copy itself took by the
  transfer backend's measure: CUDA events around a kernel or copy-engine batch, at most one
  batch per direction a second, the copying thread's clock for host and staged NVMe copies; a batch's time
  queued behind others is not its own). Sums decay per batch, so the figure follows the machine (a disk that slows down, a busy link).
  A path not yet measured (MIN_SAMPLE_BYTES moved) has no figure (null in the stats, "unmeasured"
  in `dflash2 status`): its blocks are offered. Nor is a path judged by once no batch has crossed
  it for STALE_S: a path judged too slow carries no more batches (its blocks are neither offered
  nor kept there), so one slow measurement (a disk busy for one batch) turned the tier off for
  good; now its blocks are offered again after a while, and the next batches measure it afresh
  (the old sums dropped: they would outweigh a fast path's first batches). The stats keep showing
  the last figure until then.
- Prefill rates are registered by the engines, per client and layout (tokens per second). A layout
  without a registered rate is never judged: its blocks are always offered and kept.

Mechanism only: the lookup cuts its answer where `worth` says no, and placement drops instead of
demoting where `keeps` says no. Nothing here holds block data.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dflash2.counts import distinct
from dflash2.layout import Layout
from dflash2.tiers import Tier

DECAY = 0.9  # weight of the past per finished batch on a path
MIN_SAMPLE_BYTES = 1 << 20  # a path is measured once this many bytes have crossed it
MAX_PREFILL_RATE = 1e18  # tokens per second: any real engine is far below; bounds what a client may say
STALE_S = 60.0  # a path no batch crossed for this long is judged as unmeasured again (its blocks offered)


def checked_rate(tokens_per_s) -> float | None:
    """A prefill rate as given (None: not given); ValueError naming what is wrong otherwise."""
    if tokens_per_s is None:
        return None
    if isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, (int, float)) \
            or not 0 < tokens_per_s <= MAX_PREFILL_RATE:  # NaN fails every comparison
        raise ValueError(f"a prefill rate must be a positive number of tokens per second (at most "
                         f"{MAX_PREFILL_RATE:g}) or null, got {tokens_per_s!r}")
    return float(tokens_per_s)


class ReadCost:
    def __init__(self, decay: float = DECAY, clock: Callable[[], float] = time.monotonic):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay}")
        self.decay = decay
        self.clock = clock
        self._last: dict[tuple[Tier, Tier], float] = {}  # when a batch last crossed the path
        self._bytes: dict[tuple[Tier, Tier], float] = {}
        self._seconds: dict[tuple[Tier, Tier], float] = {}
        self._seen: dict[tuple[Tier, Tier], int] = {}  # bytes ever measured on the path (not decayed)
        self._rates: dict[tuple[int, int], float | None] = {}  # (client, layout id) -> tokens per second
        self._rated: set[int] = set()  # clients with a rate for some layout (the others are never judged)

    # -- measurement -------------------------------------------------------------------------
    def observe(self, src: Tier, dst: Tier, nbytes: int, seconds: float) -> None:
        """A batch moved `nbytes` (those that arrived) from src to dst in `seconds` of its own (the
        transfer backend's measure: not counting the time it queued behind other batches)."""
        if nbytes <= 0 or not seconds > 0.0:
            return
        path = (src, dst)
        now = self.clock()
        if now - self._last.get(path, now) > STALE_S:  # a figure of a minute ago: measured afresh
            for sums in (self._bytes, self._seconds, self._seen):
                sums.pop(path, None)
        self._last[path] = now
        self._bytes[path] = self.decay * self._bytes.get(path, 0.0) + nbytes
        self._seconds[path] = self.decay * self._seconds.get(path, 0.0) + seconds
        self._seen[path] = self._seen.get(path, 0) + nbytes

    def bandwidth(self, src: Tier, dst: Tier) -> float | None:
        """Bytes per second measured from src to dst; None while unmeasured."""
        path = (src, dst)
        if self._seen.get(path, 0) < MIN_SAMPLE_BYTES:
            return None
        return self._bytes[path] / self._seconds[path]

    def _judged(self, src: Tier, dst: Tier) -> float | None:
        """The bandwidth decisions go by: None (unmeasured) once no batch crossed the path for STALE_S."""
        last = self._last.get((src, dst))
        if last is None or self.clock() - last > STALE_S:
            return None
        return self.bandwidth(src, dst)

    def seconds_per_byte(self, src: Tier, reader: Tier) -> float | None:
        """Time to bring one byte from src to the reader's tier: the direct path when measured
        (promotions move straight there), else the sum of the measured hops; None when unknown."""
        if src <= reader:
            return 0.0
        direct = self._judged(src, reader)
        if direct is not None:
            return 1.0 / direct
        total = 0.0
        for hop in range(int(src), int(reader), -1):
            bw = self._judged(Tier(hop), Tier(hop - 1))
            if bw is None:
                return None
            total += 1.0 / bw
        return total

    # -- engines' prefill rates ----------------------------------------------------------------
    def set_rate(self, client: int, layout_id: int, tokens_per_s: float | None) -> None:
        """The client's engine recomputes blocks of this layout at this many tokens per second
        (None: it does not say; its blocks of the layout are then never judged)."""
        self._rates[(client, layout_id)] = checked_rate(tokens_per_s)
        self._rated = {c for (c, _), r in self._rates.items() if r is not None}

    def judges(self, client: int | None) -> bool:
        """Whether `client` gave a rate for some layout: only such a client's reads are judged."""
        return client in self._rated

    def rate(self, client: int, layout_id: int) -> float | None:
        return self._rates.get((client, layout_id))

    def drop_client(self, client: int) -> None:
        for key in [k for k in self._rates if k[0] == client]:
            del self._rates[key]
        self._rated.discard(client)

    def keeping_rate(self, layout_id: int) -> float | None:
        """The rate placement judges a layout by: the slowest engine's (it gains most from a read
        back), and None (never judged) while any client of the layout has not given one."""
        rates = [r for (_, lid), r in self._rates.items() if lid == layout_id]
        if not rates or any(r is None for r in rates):
            return None
        return min(rates)

    # -- decisions -----------------------------------------------------------------------------
    @staticmethod
    def recompute_seconds(layout: Layout, tokens_per_s: float) -> float:
        return layout.tokens_per_block / tokens_per_s

    def load_seconds(self, layout: Layout, src: Tier, reader: Tier) -> float | None:
        spb = self.seconds_per_byte(src, reader)
        return None if spb is None else spb * layout.block_bytes

    def _worth(self, layout: Layout, tokens_per_s: float | None, src: Tier, reader: Tier) -> bool:
        if tokens_per_s is None:
            return True
        load = self.load_seconds(layout, src, reader)
        return load is None or load < self.recompute_seconds(layout, tokens_per_s)

    def worth(self, client: int | None, layouts: list[Layout], layout_ids: np.ndarray, tiers: np.ndarray,
              reader: Tier) -> np.ndarray:
        """Per block (layout id, tier): is reading it to `reader` cheaper than the client's engine
        recomputing it? True where nothing is known (no rate, or an unmeasured path)."""
        ok = np.ones(len(tiers), dtype=bool)
        if not self.judges(client) or not len(tiers):  # the common case: no rate given, nothing judged
            return ok
        if int(tiers.max()) <= int(reader):  # all already where the reader reads: nothing to load
            return ok
        for lid, tier in set(zip(layout_ids.tolist(), tiers.tolist())):
            rate = self.rate(client, lid)
            if not self._worth(layouts[lid], rate, Tier(tier), reader):
                ok[(layout_ids == lid) & (tiers == tier)] = False
        return ok

    def keeps(self, layouts: list[Layout], layout_ids: np.ndarray, tier: Tier) -> np.ndarray:
        """Per block: is `tier` worth holding it, i.e. is reading it back from there to HBM cheaper
        than recomputing it for the slowest engine of its layout?"""
        ok = np.ones(len(layout_ids), dtype=bool)
        for lid in distinct(layout_ids):
            if not self._worth(layouts[lid], self.keeping_rate(lid), tier, Tier.HBM):
                ok[layout_ids == lid] = False
        return ok

    def describe(self) -> dict:
        paths = {f"{a.label}->{b.label}": self.bandwidth(a, b) for (a, b) in sorted(set(self._seen))}
        return {"bytes_per_s": paths, "prefill_rates": len([r for r in self._rates.values() if r is not None])}


def read_paths(paths: dict) -> dict:
    """Of `describe()`'s measured paths ("dram->hbm": bytes/s), those that read blocks back up (from a
    lower tier into a higher one): demotions are measured too, and `dflash2 status`'s "read back:" line
    and the read-bandwidth metric showed their speed as read-back speed (a review)."""
    def up(path: str) -> bool:
        src, _, dst = path.partition("->")
        return _DEPTH.get(src, -1) > _DEPTH.get(dst, len(_DEPTH))
    return {path: rate for path, rate in paths.items() if up(path)}


_DEPTH = {t.label: int(t) for t in Tier}  # (HBM 0, DRAM 1, NVMe 2: a read back goes to a smaller depth)
