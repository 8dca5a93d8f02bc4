"""The doorbell: a file descriptor that turns readable when a copy thread ends a batch.

The daemon's loop parks a call that must wait for copies in flight and answers the others meanwhile
(daemon/server.py); it learns that the copies have ended by polling the doorbell beside its socket,
at once, where a poll of the jobs every millisecond kept each parked call up to a millisecond longer
(lookups at random times during a 4 GB drain on the H200 host: 1.53-1.60 ms at p50 against
1.08-1.09 when the loop waited inside the call). Copies that end on the GPU's streams (the copy
kernel, the copy engines) ring nothing: the loop still looks at them every millisecond.

One per process (`COMPLETIONS`): ringing is a one-byte write to a non-blocking pipe, dropped when
the pipe is full (it is readable then anyway); whoever polls it drains it before looking at the jobs.
"""

from __future__ import annotations

import os
import select


class Doorbell:
    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        """Readable once `ring` was called since the last `drain`."""
        return self._read

    def ring(self) -> None:
        try:
            os.write(self._write, b"\0")
        except (BlockingIOError, BrokenPipeError):
            pass  # full: readable already

    def wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for a ring; whether one came (drained: ring again for another
        poller that should see it)."""
        if not select.select([self._read], [], [], seconds)[0]:
            return False
        self.drain()
        return True

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass


COMPLETIONS = Doorbell()
