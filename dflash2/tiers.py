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
