"""An acquire's refusals, each before anything moves and by name: "no room now" (None) would send
the reader to retry what can never succeed (manager.py `acquire_rows`)."""

from __future__ import annotations

import numpy as np

from dflash2.counts import any_true, unique
from dflash2.errors import IllegalTransition, PinnedBlock, UnknownBlock
from dflash2.table import BlockState, BlockTable
from dflash2.tiers import Tier


def refuse_dropped(table: BlockTable, rows: np.ndarray, vids) -> None:
    """UnknownBlock naming the first of `rows` that a read back from NVMe dropped (the read failed:
    an I/O error, or bytes that failed their checksum; the mover does not keep which) since the call
    looked them up: freed, or kept only for earlier holders (`lost`)."""
    gone = (table.cols.tier[rows] < 0) | table.is_lost(rows)
    if any_true(gone):
        vid = int(np.asarray(vids).reshape(-1)[int(np.flatnonzero(gone)[0])])
        raise UnknownBlock(f"block {vid:#x} failed its read back from NVMe (an I/O error, or bytes that failed their "
                           "checksum), or was lost with the NVMe file cut short or removed (the daemon's log says "
                           "which), and was dropped from the cache (a miss): look the chain up again and recompute "
                           "from there")


def refuse_unmovable(table: BlockTable, rows: np.ndarray, tiers: np.ndarray, below: np.ndarray, up_to: Tier) -> None:
    """Of the blocks an acquire must bring up (`below`: they lie below `up_to`), one that cannot
    move: pinned where it lies (PinnedBlock: a host-side reader pinned it in DRAM; it can move up
    once released), or not committed (IllegalTransition: a host-side writer's block being written;
    only committed blocks move between tiers)."""
    c = table.cols
    held = below & (c.pins[rows] > 0)
    if any_true(held):
        r = rows[held][:1]
        raise PinnedBlock(f"block {int(table.vids(r)[0]):#x} lies in {Tier(int(tiers[held][0])).label}, "
                          f"pinned there by a reader of that tier (a host-side reader: acquire with tier "
                          f"'dram'); it can move up to {up_to.label} once released: try again then, or "
                          "read it where it lies (tier 'dram')")
    unsettled = below & (c.state[rows] != int(BlockState.RESIDENT))
    if any_true(unsettled):
        r = rows[unsettled][:1]
        state = BlockState(int(c.state[r][0])).name
        raise IllegalTransition(f"block {int(table.vids(r)[0]):#x} lies in {Tier(int(tiers[unsettled][0])).label} "
                                f"and is {state}, not committed: only committed blocks move up to {up_to.label}; "
                                "commit it first, or read it where it lies (tier 'dram')")


def refuse_never_fits(table: BlockTable, chain: np.ndarray, rows: np.ndarray, tiers: np.ndarray, up_to: Tier,
                      beyond: np.ndarray | None = None) -> None:
    """NeverFits when the blocks at or below `up_to` cannot lie in it at once, with the cached
    prefix a promotion brings up first (`chain`: `rows` and their ancestors, Promotion's
    `with_ancestors`; those pinned below stay where they are; `beyond`: the chain's blocks the read
    does not need there, Promotion's `beyond_read`)."""
    c = table.cols
    if chain is rows:  # a prefix listed root first (the usual read): nothing to add
        there = unique(rows[tiers >= int(up_to)])
    else:
        chain_tiers = c.tier[chain]
        there = chain[(chain_tiers == int(up_to)) | ((chain_tiers > int(up_to))
                                                     & ((c.pins[chain] == 0) | np.isin(chain, rows)))]
        if beyond is not None and len(beyond):
            there = there[~np.isin(there, beyond)]
    lids, counts = np.unique(c.layout[there], return_counts=True)
    named = len(unique(rows))
    table.refuse_never_fits(up_to, dict(zip(lids.tolist(), counts.tolist())), f"acquire of {named} blocks"
                            + (f" (with their cached prefix, {len(there)})" if len(there) > named else ""))
