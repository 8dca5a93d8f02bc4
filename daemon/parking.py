"""The calls parked until copies in flight end, in the order they came.

A call that must wait for copies not yet ended (a promotion's reads from NVMe, the writes its room
takes: settling.py) is not run: `Service.handle_frames` returns `Parked`, and the server runs the
same frames again, whole, once the copies of the call's own pool have ended, answering other calls
meanwhile. A pool's calls keep their order: one that parks again (the copies a call before it
started: a prefetch's reads) keeps its place and the rest of its pool's wait behind it; other pools'
calls go on (they waited for every pool's copies: one GPU's long promotion from NVMe held every
other GPU's parked calls, a review's script). A call of no pool (`device` None) waits for every
pool's copies, and for the calls parked before it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Parked:
    """(`Service.handle_frames`) the call was not run: it waits for copies in flight to end.
    `own_parks`: how often it was parked on copies of its own (errors.CopiesRunning `own`: its reads
    from NVMe, the writes its room takes), at most Placement.OWN_PARKS. `client`: whose call it is
    (None for calls without one), heard from while it waits (`Service.waiting`). `device`: the pool
    whose copies it waits for (None: every pool's)."""

    own_parks: int = 0
    client: int | None = None
    # (time.perf_counter) when the call first came: its latency counts from then
    arrived: float = dataclasses.field(default=0.0, compare=False)
    device: int | None = dataclasses.field(default=None, compare=False)


class ParkedCalls(collections.deque):
    """A deque of (frames, Parked); `copies_done(device)` says whether a pool (None: every pool)
    has no copies in flight."""

    def __init__(self, copies_done: Callable[[int | None], bool]):
        super().__init__()
        self.copies_done = copies_done

    def ready(self) -> bool:
        """Whether `answer` would run some call now (the same rule: True for a call behind one that
        must wait, and `serve_forever` would spin on it)."""
        held: set[int | None] = set()
        for _, parked in self:
            if not self._waits(parked, held):
                return True
            held.add(parked.device)
        return False

    def _waits(self, parked: Parked, held: set[int | None]) -> bool:
        """Whether the call waits: its pool's copies run, or a call before it of its pool (of any,
        for a call of no pool; a call of no pool holds every later one) waits."""
        return (None in held or parked.device in held or (parked.device is None and bool(held))
                or not self.copies_done(parked.device))

    def answer(self, answer: Callable[[list[bytes], Parked], bool]) -> None:
        """Run again the calls whose pool's copies have ended. `answer(frames, parked)` is False when
        the call parked again, having appended itself to this deque."""
        held: set[int | None] = set()  # pools whose calls wait (None: every pool)
        kept = []
        while self:
            frames, parked = self.popleft()
            if self._waits(parked, held):
                held.add(parked.device)
                kept.append((frames, parked))
            elif not answer(frames, parked):
                kept.append(self.pop())  # (parked again: at the back)
                held.add(parked.device)
        self.extend(kept)
