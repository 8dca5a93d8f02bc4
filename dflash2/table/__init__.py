"""The unified virtual block table: metadata only, no bytes. See table.py for its invariants."""

from dflash2.table.states import BlockState
from dflash2.table.table import BlockTable

__all__ = ["BlockState", "BlockTable"]
