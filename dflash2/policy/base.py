"""The policy interface: a policy only ranks blocks; the placement mechanism moves and frees them.

`scores(table, rows, now)` returns one float per row: higher means keep (hotter). The mechanism turns
scores into percentiles within a tier (for `policy.cold_threshold`), and picks victims among the
blocks it is allowed to move (unpinned, descendants before ancestors) in ascending score order.
`admit` may refuse a block a place in a tier (a block used once only pushes out blocks that would
have been reused); the default admits everything.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from dflash2.errors import UnknownPolicy

if TYPE_CHECKING:
    from dflash2.table import BlockTable
    from dflash2.tiers import Tier


class Policy(abc.ABC):
    name: ClassVar[str]
    # How the blocks under the mechanism's cut leave (placement.py `_leaving`; only a leaf may
    # leave): False, leaves first across every chain (by height in the subtree that leaves, then
    # score), which the online policies find more with (`bench policy`, synthetic trace, HBM
    # alone: LRU 0.0457 / 0.0845 at 500 / 1,000 blocks against 0.0451 / 0.0841 in strict order, LFU
    # 0.0550 against 0.0501 at 1,000); True, strictly by score (each block as late as the highest
    # score in its subtree), as an oracle's scores must be taken: Belady then finds 0.1749 / 0.3742
    # at 500 / 2,000 blocks, against 0.1735 / 0.3740 leaves first.
    strict_order: ClassVar[bool] = False

    @staticmethod
    def _last_tier(table) -> int:
        """The slowest tier of the table: what a block pushed out of it loses (admission's concern)."""
        return max(int(t) for t in table.allocators)

    @abc.abstractmethod
    def scores(self, table: "BlockTable", rows: np.ndarray, now: float) -> np.ndarray:
        """Heat of each row (float64, higher = keep). Must be vectorised: it runs over every block."""

    def scores_all(self, table: "BlockTable", now: float) -> np.ndarray:
        """Heat of every row of the table (free rows included: the caller masks them). Override when
        a policy can answer without gathering rows (one pass over a million blocks matters)."""
        return self.scores(table, np.arange(table.cols.capacity), now)

    def rescore(self, table: "BlockTable", now: float) -> np.ndarray:
        """One full scoring pass over every row. Policies that cache their scores refresh the cache
        here (the daemon's timer calls it every `policy.rescore_interval_ms`)."""
        return self.scores_all(table, now)

    def mapped_bytes(self) -> int:
        """Bytes of per-row state this policy keeps in reserved mappings (rowspace.py), in use by the
        table's rows now: memory that tracemalloc does not see (`bench table` adds it)."""
        return 0

    def on_tick(self, table: "BlockTable", now: float) -> None:
        """The daemon's periodic step (every `policy.rescore_interval_ms`): policies that cache
        scores rescore here; the others have nothing to do."""

    def on_access(self, table: "BlockTable", rows: np.ndarray, now: float) -> None:
        """Blocks were read (a lookup hit, an acquire). The table already updated last_access/hits."""

    def on_insert(self, table: "BlockTable", rows: np.ndarray, now: float) -> None:
        """Blocks were written or arrived in a tier."""

    def on_commit(self, table: "BlockTable", rows: np.ndarray, now: float) -> None:
        """Blocks were committed (published under their content keys when they have them)."""

    def on_remove(self, table: "BlockTable", rows: np.ndarray) -> None:
        """Blocks left the cache (evicted or freed)."""

    def on_holds_changed(self, table: "BlockTable", rows: np.ndarray, now: float) -> None:
        """Blocks gained or lost references, pins or priority (a request shared, freed or released
        them, or its client left): policies that cache scores of those terms score these rows again."""

    def admit(self, table: "BlockTable", rows: np.ndarray, tier: "Tier", now: float) -> np.ndarray:
        """Mask of the rows that deserve a place in `tier` (default: all)."""
        return np.ones(len(rows), dtype=bool)

    def going(self, table: "BlockTable", rows: np.ndarray) -> None:
        """Rows `admit` refused (in this call) go into the tier all the same, held by their writer or
        a reader: `overruled` once they have, `stayed` where they did not (placement.py `_demote`)."""

    def overruled(self, table: "BlockTable", rows: np.ndarray) -> None:
        """Rows `admit` refused went into the tier all the same: held by their writer or a reader,
        they could be neither dropped nor kept where they were (placement.py `_admitted`)."""

    def stayed(self, table: "BlockTable", rows: np.ndarray) -> None:
        """Rows `admit` refused that were `going` into the tier did not go (no room there)."""

    @classmethod
    def from_config(cls, policy_config) -> "Policy":
        """An instance set up from the config's `policy` section (weights, intervals); policies
        without settings ignore it."""
        return cls()

    def set_weights(self, weights: dict[str, float]) -> None:
        """Change weights at run time. Policies without weights refuse any."""
        if weights:
            raise ValueError(f"policy {self.name!r} has no weights (got {sorted(weights)})")

    def describe(self) -> dict:
        return {"name": self.name}


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if cls.name in _REGISTRY:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The registered class of `name`; UnknownPolicy lists the valid names."""
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; valid: {', '.join(sorted(_REGISTRY))}") from None


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh policy instance by name; UnknownPolicy lists the valid names."""
    return policy_class(name)(**kwargs)


def _load_builtin() -> None:
    # Importing registers them; kept lazy so that base.py has no import cycle with its policies.
    import dflash2.policy.lfu  # noqa: F401
    import dflash2.policy.lru  # noqa: F401
    import dflash2.policy.belady  # noqa: F401
    import dflash2.policy.heat  # noqa: F401
