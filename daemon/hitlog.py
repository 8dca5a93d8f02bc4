"""The HBM hit rate in the daemon's log (DESIGN: "It is exported and logged"): once a minute in
which HBM readers read blocks, over that minute; a warning below 0.95, where HBM is under pressure.
Exported as it accrues by /metrics (`dflash2_hbm_hit_ratio`), kept by the history."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from dflash2.logs import event
from dflash2.tiers import Tier

log = logging.getLogger("dflash2.daemon")
HIT_LOG_INTERVAL_S = 60.0
PRESSURE_BELOW = 0.95  # DESIGN: "below 95% the tier is under pressure"


class HitRateLog:
    """Owner thread: `sample()` as often as it likes; a line when an interval has passed."""

    def __init__(self, service, clock: Callable[[], float] = time.monotonic):
        self.service = service
        self.clock = clock
        self._reads = self._reads_now()
        self._at = clock()

    def _reads_now(self) -> Counter:
        """Block reads of HBM readers by the tier they were served from, every pool's."""
        total: Counter = Counter()
        for m in self.service.managers.values():
            total.update(m.access.reads)
        return total

    def sample(self) -> None:
        now = self.clock()
        if now - self._at < HIT_LOG_INTERVAL_S:
            return
        reads = self._reads_now()
        change = {tier: reads[tier] - self._reads[tier] for tier in reads}
        seconds, self._reads, self._at = now - self._at, reads, now
        total = sum(change.values())
        if total <= 0:
            return  # nothing read: nothing to say
        ratio = change.get(Tier.HBM, 0) / total
        elsewhere = "".join(f", {tier.label} {n / total:.1%}" for tier, n in sorted(change.items())
                            if tier != Tier.HBM and n)
        pressed = ratio < PRESSURE_BELOW
        event(log, "dflash2_hbm_hit_rate",
              f"HBM hit rate {ratio:.3f} over the last {seconds:.0f} s ({total} block reads{elsewhere})"
              + (f": below {PRESSURE_BELOW}, HBM is under pressure" if pressed else ""),
              level=logging.WARNING if pressed else logging.INFO, hbm_hit_ratio=round(ratio, 4), reads=total,
              seconds=round(seconds, 1))
