"""A metadata-only manager (of HBM alone, unless DRAM blocks are asked for), in the policy bench's
slots, for the duel's tests."""

from dflash2.bench.policy import ALIGN, SLOT
from dflash2.manager import BlockManager, TierSpec
from dflash2.tiers import Tier


def manager(hbm_blocks: int, policy="heat", dram_blocks: int = 0, **kw) -> BlockManager:
    kw.setdefault("clock", lambda: 0.0)
    specs = [TierSpec(Tier.HBM, hbm_blocks * SLOT, SLOT, ALIGN)]
    specs += [TierSpec(Tier.DRAM, dram_blocks * SLOT, SLOT, ALIGN)] if dram_blocks else []
    return BlockManager(specs, policy=policy, **kw)
