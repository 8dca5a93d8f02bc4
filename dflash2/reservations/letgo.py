"""Admission's retries of the head's room after a call let room go (a mixin: the attributes it uses
are Admission's: `deferred`, `_room_tried`, `_room`, `_fails`, `_fails_for`, `_below`, `_below_for`,
`room_count`, `table`, `placement`). Room was made for the head of the queue and fell short; a later
call that frees slots, or leaves blocks idle, may now cover what it lacks: room is made for it again
at that call's `tick`, not at the next background step."""

from __future__ import annotations

import numpy as np

from dflash2.table import BlockState
from dflash2.tiers import Tier


class RoomLetGo:
    def room_freed(self) -> bool:
        """A call has just freed HBM slots (a cancel of a granted reservation, a free of blocks being
        written). Room was made for the head of the queue and fell short; where its free room and the
        blocks that could move for it (`RoomCount.movable_bytes`) now cover it (twice its shortfall
        after each retry that fell short too), room is made for it again at the next `tick`: True.
        Before, a head whose room a granted reservation held, beside idle blocks, was told to wait
        until that reservation's client took and freed its blocks or cancelled it, and the cancel
        granted it at the next background step (1.9 s with `policy.rescore_interval_ms` 3000, a
        review's script): nothing had been moved at its try (not all of its room could be made),
        and a free of slots moves nothing."""
        head = self._tried_head()
        if head is None:
            return False
        short = head.hbm_bytes - self._room(head)
        if short <= 0:  # (the tick grants it from free room)
            return False
        return self.room_count.movable_bytes(head) >= self._bar(head, short) and self._try_again()

    def freed_below(self, rows: np.ndarray) -> bool:
        """A call (a free, a release, a client gone) has just let go of `rows`, which lay in the tiers
        below HBM: their slots freed, or the blocks left idle there. Running requests' blocks that
        the head of the queue may preempt but that had no room below (`Placement.room_below`) may
        leave HBM for it now; `became_movable` counts blocks in HBM only. Room was made for that
        head already and fell short; once the tiers below hold as much free room, with the blocks
        left idle there since, as it is short now (twice that after each retry that fell short
        too), room is made for it again at the next `tick`: True, and the caller ticks. Before, it
        waited for the background step (2.4 s with `policy.rescore_interval_ms` 3000: a DRAM
        writer freed its blocks under a priority-5 reservation, a review's script)."""
        head = self._tried_head()
        if head is None or not len(rows) or self.room_count.preempts_below(head) is None:  # (running blocks
            return False  # never leave for it)
            return False
        if self._below_for != head.id:
            self._below, self._below_for = 0, head.id
        c = self.table.cols
        idle = rows[(c.state[rows] == int(BlockState.RESIDENT)) & (c.refs[rows] == 0) & (c.pins[rows] == 0)
                    & (c.key[rows] != 0)]
        if not len(idle) and not (c.state[rows] == int(BlockState.FREE)).any():
            return False  # (nothing let go of below: a commit there, a reference dropped of a block still held)
        free, tier = 0, self.placement.lower(Tier.HBM)
        while tier is not None:
            here = idle[c.tier[idle] == int(tier)]
            self._below += int(self.table.slot_sizes(tier)[c.layout[here]].sum())
            free += self.placement.free_bytes(tier)
            tier = self.placement.lower(tier)
        if free + self._below < self._bar(head, head.hbm_bytes - self._room(head)):
            return False
        self._below = 0
        return self._try_again()

    def _tried_head(self):
        """The head of the queue where room was made for it and fell short (no try since), else None."""
        return self.deferred[0] if self.deferred and self.deferred[0].id == self._room_tried else None

    def _bar(self, head, short: int) -> int:
        """What must have come free for another try: the head's shortfall, twice that after each retry
        of it that fell short too."""
        return short << min(self._fails if self._fails_for == head.id else 0, 30)

    def _try_again(self) -> bool:
        """Room is made for the head again at the next `tick`: True."""
        self._room_tried = None
        self.room_count.clear()  # the deferred decisions' count of what could move is stale now
        return True
