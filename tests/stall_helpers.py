"""A stopped daemon and a client whose lock another thread's call holds: the calls that time out
waiting behind it are never sent (Client._call's `_unsent`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from dflash2.client import DaemonUnavailable
from dflash2.protocol import Op


@contextlib.contextmanager
def behind_a_stalled_call(daemon, client):
    """Within: the daemon stopped (SIGSTOP), and another thread's call (2 s timeout) holding the
    client's lock; on the way out that call has timed out and the daemon runs again."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        slow = threading.Thread(target=lambda: pytest.raises(DaemonUnavailable, client._call, Op.STATS, timeout_s=2.0))
        slow.start()
        time.sleep(0.1)
        try:
            yield
        finally:
            slow.join(10)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
