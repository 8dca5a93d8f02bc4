"""Hit accounting: block reads by the tier they were served from (the HBM hit rate)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from dflash2.tiers import Tier


@dataclasses.dataclass
class AccessStats:
    """Block reads by where they were served from. HBM hit rate = reads served from HBM without
    waiting for a swap-in / all block reads."""

    # tier -> blocks that HBM readers (the engines' attention) read from it. A block a reader's own
    # lookup promoted counts under the tier it came from: the reader waited for that copy.
    reads: Counter = dataclasses.field(default_factory=Counter)
    # tier -> blocks that host-side readers (tier "dram": sglang's host pool) read where they lie:
    # served where they were asked for, so neither HBM hits nor misses.
    host_reads: Counter = dataclasses.field(default_factory=Counter)
    misses: int = 0  # asked for past the cached prefix: not cached, or after a key that is not (lookup stopped short)
    lookups: int = 0
    lookup_blocks_found: int = 0
    # Cached blocks a lookup did not offer: reading them to the reader costs more than the client's
    # engine recomputing them (also counted in `misses`: the engine recomputes them).
    withheld: int = 0

    @property
    def hbm_hit_ratio(self) -> float | None:
        total = sum(self.reads.values())
        return self.reads[Tier.HBM] / total if total else None


def reads_by_origin(tiers: np.ndarray, vids: np.ndarray, up_to: Tier, came: dict[int, int]) -> Counter:
    """An acquire's block reads by the tier each was served from: the tier it lies in (`tiers`, as
    the acquire found them), or, for a block the acquire waited for while parked on its own copies
    (`came`: vid -> the tier it was read from) and that lies in `up_to` or a faster tier by now,
    the tier it came from: the reader waited for that copy, as for a promotion it waits for in the call."""
    counts = Counter({Tier(t): n for t, n in enumerate(np.bincount(tiers, minlength=len(Tier)).tolist()) if n})
    if came:
        for tier, vid in zip(tiers.tolist(), vids.tolist()):
            if vid in came and tier <= int(up_to):
                counts[Tier(tier)] -= 1
                counts[Tier(came[vid])] += 1
    return counts
