"""A metadata-only manager of HBM alone, in the policy bench's slots, for the duel's tests."""

from dflash2.bench.policy import ALIGN, SLOT
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier


def manager(hbm_blocks: int, policy="heat", **kw) -> BlockManager:
    kw.setdefault("clock", lambda: 0.0)
    return BlockManager([TierSpec(Tier.HBM, hbm_blocks * SLOT, SLOT, ALIGN)], policy=policy, **kw)
