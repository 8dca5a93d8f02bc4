"""A client's zero-copy views of the blocks it writes or has acquired: numpy bytes (`view_bytes`) or a
torch tensor shaped by the block's layout (`view`), over the daemon's arena mapped at attach.

A mixin of `Client` (client.py). A view is handed out only while this client's lease holds: after
a lease's silence it first asks the daemon (`_confirm_lease`), and it checks that the daemon still
lives at most every GONE_CHECK_S (a killed daemon's segments are let go, and a restart's removed).
"""

from __future__ import annotations

import time

import numpy as np

from dflash2.client.args import vid_of
from dflash2.client.heartbeat import Awake
from dflash2.client.transport import GONE_CHECK_S
from dflash2.client.views import tensor_view
from dflash2.errors import ArenaError, DaemonError, DaemonUnavailable
from dflash2.protocol import Op


class BlockViews:
    def view_bytes(self, place) -> np.ndarray:
        """A numpy uint8 view of a block's bytes in the daemon's arena (no copy)."""
        arenas = self._arenas  # (once: detach on another thread sets it to None)
        if arenas is None:
            raise ArenaError("this client is detached: its arena mappings are gone")
        if not self.lease_lost and not self._forked():  # (a forked child is told so by _place)
            self._confirm_lease()
            # Whether the daemon still lives, at most every GONE_CHECK_S: a killed daemon's block was handed out
            # until the next call or heartbeat, over a segment a restart removed, writes lost (a review).
            if (now := time.monotonic()) - self._alive_checked >= GONE_CHECK_S:
                self._alive_checked = now
                self._daemon_gone(wait=False)
        if self._ended:
            raise ArenaError(f"the daemon at {self.endpoint} that this client attached to has ended (its memory is "
                             "let go): attach a new client")
        if self.lease_lost:  # (its blocks are no longer its own: freed once this process is gone, or set-aside ends)
            raise ArenaError("this client's lease lapsed: its blocks are no longer its own; attach a new client")
        return arenas.bytes_view(self._place(place))

    def renewed(self, sent: float) -> None:
        """The daemon renewed the lease answering a call sent at monotonic time `sent` (threads may race
        here: the earlier time kept only makes a view check sooner)."""
        if sent > self._renewed:
            self._renewed = sent

    def _confirm_lease(self) -> None:
        """Before a new view, where no lease-renewing call was answered for a whole lease: ask the daemon if
        it still knows the client (past the lapse and set-aside its slots went to others; a view wrote in
        another's cached block, a review). ArenaError where it does not answer, unless the heartbeat's beats
        were sent all along within the daemon's set-aside (Awake.vouches: then it waits Awake.ASK_S only)."""
        renewed = self._renewed
        silent_s = time.monotonic() - renewed
        if silent_s <= self.lease_timeout_s:
            return
        vouched = self._awake is not None and self._awake.vouches(renewed)
        try:
            self._call(Op.HEARTBEAT, timeout_s=Awake.ASK_S if vouched else None)
        except DaemonError:  # UnknownClient: _call marked the lease lost (and the view is refused)
            if not self.lease_lost:
                raise
        except DaemonUnavailable as e:
            if not vouched:
                raise ArenaError(f"no call of this client was answered for {silent_s:.1f}s, more than its lease "
                                 f"({self.lease_timeout_s:g}s), and the daemon does not answer now ({e}): its "
                                 "blocks may have been given to others, so no new view is handed out") from None

    def view(self, place):
        """A torch tensor over a block's bytes, typed and shaped by its layout (no copy). `place` is
        a PLACE_DTYPE record, or the vid of a block this client writes or has acquired."""
        p = self._place(place)
        return tensor_view(self.view_bytes(p), self.layout(int(p["layout"])))

    def _place(self, place):
        """Where the block lies now, as this client holds it (written or acquired): by vid, or by a
        place record, whose own place may be of before (a lookup's, then an acquire moved the block
        up: it named a slot another block had taken since, a review)."""
        vid = vid_of(place)
        if self._forked():  # (and no lock taken: one a parent's thread held at the fork is held for good)
            raise ArenaError(f"this client was attached by process {self._pid}: connect a new Client in the child")
        found = self._held.place(vid)
        if self._arenas is None or self._detached:  # (after the look: a detach on another thread empties it)
            raise ArenaError("this client is detached: its arena mappings are gone")
        if found is None:
            raise ArenaError(f"block {vid:#x} is not being written or acquired by this client; acquire it first "
                             "(a lookup's place is not pinned)")
        return found
