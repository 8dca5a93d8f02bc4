"""The sglang backend through a daemon stall (SIGSTOP, as a busy or frozen daemon): a read's `release`
or a write's `free` that times out gives its pins or references back once the daemon runs again (the
client sends it again until answered, and the daemon runs it once). Before, one queued on the fresh
socket of an earlier timeout was lost with it, and held its pins or references for the rest of the
sglang process's life (a review's script). Skipped where sglang is not importable (test_sglang.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

from conftest import config_file  # noqa: F401  (fixture)
from test_sglang import backends, daemon  # noqa: F401  (fixtures; skips this module without sglang)
from test_sglang import fill, host_pool, indices, make_backend

from dflash2.errors import DaemonUnavailable


def stall_before(backend, proc, name: str):
    """Wrap the backend's client's `name` call: the daemon stops (for 1.5 s) just before it, and
    another of sglang's storage threads times out on the client first (its socket is made again
    while the daemon does not run, and the wrapped call goes on that one)."""
    real = getattr(backend.client, name)

    def stalled(vids):
        os.kill(proc.pid, signal.SIGSTOP)
        threading.Timer(1.5, lambda: os.kill(proc.pid, signal.SIGCONT)).start()
        try:
            backend.client.lookup(backend.keys.keys(["other"]), backend.layout_id, tier="dram")
        except DaemonUnavailable:
            pass
        return real(vids)
    setattr(backend.client, name, stalled)
    return lambda: setattr(backend.client, name, real)


def backend_with_pages(daemon, backends, seed: int):
    """A backend of calls that time out after 0.5 s, its host pool's pages 1-3 filled; and the daemon."""
    path, proc = daemon
    pool = host_pool()
    b = make_backend(path, pool, dflash2_timeout_s=0.5)
    backends.append(b)
    fill(pool, [1, 2, 3], seed=seed)
    return b, proc


def test_a_read_whose_release_times_out_leaves_no_pin(daemon, backends):
    b, proc = backend_with_pages(daemon, backends, seed=1)
    keys = ["k1", "k2", "k3"]
    assert b.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    undo = stall_before(b, proc, "release")
    assert b.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3  # a miss, as documented
    undo()
    time.sleep(1.5)  # the daemon runs again, and the release sent again reaches it
    b.client.ping()
    assert b.client.detach()["unpinned"] == 0


def test_a_write_whose_free_times_out_leaves_no_reference(daemon, backends):
    b, proc = backend_with_pages(daemon, backends, seed=2)
    undo = stall_before(b, proc, "free")
    assert b.batch_set_v1(["w1", "w2", "w3"], indices([1, 2, 3])) == [False] * 3
    undo()
    time.sleep(1.5)
    b.client.ping()
    assert b.client.detach()["dereferenced"] == 0
