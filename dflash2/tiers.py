"""The three tiers, fastest first. A tier's number is its rank: lower is faster."""

import enum


class Tier(enum.IntEnum):
    HBM = 0
    DRAM = 1
    NVME = 2

    @property
    def label(self) -> str:
        return self.name.lower()


TIERS = (Tier.HBM, Tier.DRAM, Tier.NVME)


def fill(figures: dict) -> float:
    """How full a tier is, from its figures (`stats`' tiers, a history sample's): its `full_bytes`
    (used slots and the page tails of the slabs they lie in, `SlotAllocator.full_bytes`) over its
    capacity, what the watermarks weigh (`Placement.used_fraction`). Used bytes alone left a full
    tier of 1,835,008-byte blocks in 2 MiB pages at 87.5%, under every watermark and alert for good
    (a review). A figure without `full_bytes` (a history sample of before) is its used share."""
    cap = figures["capacity_bytes"]
    if not cap:
        return 1.0
    return figures.get("full_bytes", figures["used_bytes"]) / cap
