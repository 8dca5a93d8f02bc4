"""A client leaving the table: `remove_client` releases everything it holds; `set_aside_client`
releases everything but its private blocks, which a process that stopped answering may still be
writing. A part of BlockTable (a mixin over its columns and clients), apart because what a client's
departure frees, and when, is a job of its own.

Why set aside: a lease lapses when a client stops answering, but its process may be alive (a long
pause: a GC or swap storm, SIGSTOP, a frozen cgroup) and resume the writes it was making into the
blocks it had allocated. Freed at once, their slots went to other blocks (promotions, other clients'
commits), and the resumed writes overwrote cached blocks that every client then read as hits (soak 2:
1,263 wrong reads from 9 cached blocks in 30 minutes; a repro: 8 of 8). Its private blocks are therefore
kept, still referenced by the client, until its process is gone or its time set aside ends
(daemon/sessions.py, SetAside). Blocks being written (WRITING) never move, so their slots stay theirs.
Its pins are kept too, for the same reason on the reading side: a process that resumes reads the
blocks it had pinned through the views it holds (an engine's attention over them), and a block
unpinned at the lapse could move or be evicted, its slot given to another block, whose bytes the
resumed reader then read as its own (soak10: a worker resumed after SIGCONT read another block's
bytes through its pinned block's view). A pinned block never moves, so its bytes stay where the view is.
Invariant: a set-aside client holds references to its private blocks only, and the pins it held.
"""

from __future__ import annotations

import numpy as np


class Departures:
    """BlockTable's client departures (the attributes they use are BlockTable's)."""

    def remove_client(self, client_id: int) -> dict:
        """Release everything a client holds: pins, references; its private blocks are freed,
        its published blocks stay cached. Blocks in flight are left to their move's completion."""
        holder = self.client(client_id)
        unpinned, pins = self._unpin_all(holder)
        dereferenced = sum(holder.refs.values())
        freed = self._drop_all_refs(holder) + self._after_unpin(unpinned)
        del self.clients[client_id]
        return {"unpinned": pins, "dereferenced": dereferenced, "freed": freed}

    def set_aside_client(self, client_id: int) -> dict:
        """Release a client's references to published blocks, and keep its references to its private
        blocks (it may still be writing them) and its pins (it may still be reading those blocks through
        its views): `remove_client` releases those later. Returns what it released, and how many blocks
        it keeps (`set_aside`: private blocks; `kept_pins`: pins)."""
        holder = self.client(client_id)
        c = self.cols
        held = sum(holder.refs.values())
        freed = self._drop_all_refs(holder, keep=lambda rows: (c.key[rows] == 0) & (c.owner[rows] == client_id))
        kept = sum(holder.refs.values())
        return {"unpinned": 0, "dereferenced": held - kept, "freed": freed, "set_aside": len(holder.refs),
                "kept_pins": sum(holder.pins.values())}

    def _unpin_all(self, holder) -> tuple[np.ndarray, int]:
        """Drop every pin of the client: (the rows it pinned, how many pins)."""
        c = self.cols
        unpinned = np.fromiter(holder.pins.keys(), dtype=np.int64, count=len(holder.pins))
        pins = np.fromiter(holder.pins.values(), dtype=np.int64, count=len(holder.pins))
        c.pins[unpinned] -= pins.astype(c.pins.dtype)  # distinct rows: no repeats to add up
        self._may_move(unpinned)
        holder.pins.clear()
        return unpinned, int(pins.sum())

    def _after_unpin(self, unpinned: np.ndarray) -> int:
        """After the pins (and references) are gone: priorities settle, and the rows kept only for
        their holders that nobody holds now are freed (pinned copies, lost blocks). How many freed."""
        self._settle_priority(unpinned)
        return self._free_unheld(unpinned.tolist())
