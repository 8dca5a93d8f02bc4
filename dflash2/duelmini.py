"""One candidate's miniature in the heat policy's duel (duel.py): a block manager of 1/sample of the
real tiers under that candidate's policy, serving the sampled lookups' chains as the real node would."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dflash2.manager import BlockManager, TierSpec
from dflash2.prefetch import Prefetcher
from dflash2.replay import Request, Tally, serve

CHUNK = 16  # blocks read per step of a miniature request (as the bench's default)


class Miniature:
    """One candidate's miniature: a block manager of 1/sample of the real tiers, serving sampled chains."""

    def __init__(self, policy, specs: list[TierSpec], clock: Callable[[], float], capacity_rows: int,
                 reserve_rows: int | None = None):
        self.manager = BlockManager(specs, policy=policy, clock=clock, table_capacity=capacity_rows,
                                    table_reserve=reserve_rows)
        self.prefetch = Prefetcher(self.manager, 4)
        self.client = self.manager.attach("duel")
        self.layouts: dict[int, int] = {}  # the real manager's layout id -> this manager's

    def holds_for_another(self, keys: tuple[int, ...], layout_id: int) -> bool:
        """Whether one of these keys is cached here for another layout than the real `layout_id`'s: this
        miniature would refuse the request (`serve`), so the duel serves it in none (a review: served by
        the miniatures before the one that refused, it was counted "not replayed" all the same). It may
        skip one the miniature would have served after all (its allocation evicting that block, or a
        request too large to cache): such requests reuse a key across layouts, which the node refuses
        while it holds the key, and are counted "refused"."""
        rows = self.manager.table.keys.lookup(np.asarray(keys, dtype=np.uint64))
        rows = rows[rows >= 0]
        lid = self.layouts.get(layout_id)
        return bool(len(rows)) and (lid is None or bool((self.manager.table.cols.layout[rows] != lid).any()))

    def serve(self, keys: tuple[int, ...], layout, layout_id: int, now: float, index: int) -> tuple[int, int]:
        """(blocks found in some tier, blocks found in HBM) of the request's sampled chain. One that the
        miniature refuses (a key cached for another layout: the real node refuses that commit too)
        raises, and leaves nothing held: its client starts again with nothing (`_forget_request`)."""
        lid = self.layouts.get(layout_id)
        if lid is None:
            lid = self.layouts[layout_id] = self.manager.register_layout(layout)
        tally = Tally()
        try:
            serve(self.manager, self.prefetch, self.client, lid, Request(now, keys), index, tally, CHUNK)
        except Exception:
            self._forget_request()
            raise
        return tally.hits, tally.hbm_hits

    def _forget_request(self) -> None:
        """Drop what a request that failed half-way holds (its prefix's references and pins, blocks
        it was writing): held for ever, they could never leave the miniature."""
        self.prefetch.finish()
        self.manager.detach(self.client)
        self.client = self.manager.attach("duel")
