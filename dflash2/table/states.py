"""Block states and the legal transitions between them.

    FREE ──allocate──▶ RESERVED ──open──▶ WRITING ──commit──▶ RESIDENT ◀──complete── MIGRATING
      ▲                    │  ◀──give back──  │                   │  └──prepare move──▶ ▲
      └──────cancel────────┴───────free───────┴───────free/evict──┘

(give back: a `take` whose client gave up waiting on it returns its blocks to the reservation.)

Pins and references sit on top of the state: a pinned block is never moved or freed, and a block
with references is never evicted. Committed (RESIDENT) blocks are immutable.
"""

from __future__ import annotations

import enum

import numpy as np

from dflash2.errors import IllegalTransition


class BlockState(enum.IntEnum):
    FREE = 0
    RESERVED = 1  # slot held for a granted reservation; nothing written yet
    WRITING = 2  # its owner is writing it through a view
    RESIDENT = 3  # committed and immutable; may be moved between tiers
    MIGRATING = 4  # a move is prepared; bytes are in flight to another tier


LEGAL: frozenset[tuple[BlockState, BlockState]] = frozenset({
    (BlockState.FREE, BlockState.RESERVED),
    (BlockState.RESERVED, BlockState.WRITING),
    (BlockState.WRITING, BlockState.RESERVED),
    (BlockState.RESERVED, BlockState.FREE),
    (BlockState.WRITING, BlockState.RESIDENT),
    (BlockState.WRITING, BlockState.FREE),
    (BlockState.RESIDENT, BlockState.MIGRATING),
    (BlockState.MIGRATING, BlockState.RESIDENT),
    (BlockState.RESIDENT, BlockState.FREE),
})

# _LEGAL_MATRIX[from, to] is True for a legal transition: checks whole batches at once.
_LEGAL_MATRIX = np.zeros((len(BlockState), len(BlockState)), dtype=bool)
for _a, _b in LEGAL:
    _LEGAL_MATRIX[_a, _b] = True


def check_transition(states: np.ndarray, to: BlockState, vids) -> None:
    """Raise IllegalTransition naming the first block whose state may not go to `to`."""
    ok = _LEGAL_MATRIX[states, int(to)]
    if not ok.all():
        i = int(np.argmin(ok))
        raise IllegalTransition(
            f"block {int(vids[i]):#x}: {BlockState(int(states[i])).name} -> {to.name} is not a legal transition")
