"""A pool whose transfer backend can never move again (a GPU whose CUDA context is lost: the CUDA
backend detects it, tests/test_gpu_faults.py) stops the daemon with exit 5, so that its supervisor restarts
it, instead of serving on with every move failing; and it still cleans up: the endpoint's lock file
and socket go (the next daemon starts as after a clean stop), and so do the tiers' shared memory."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest
from conftest import write_config

from dflash2.assemble import instance_name
from dflash2.config import load_config


@pytest.mark.parametrize("last_sample_fails", [False, True])
def test_the_daemon_exits_5_when_a_pool_cannot_move_any_more(tmp_path, monkeypatch, capsys, last_sample_fails):
    """`last_sample_fails`: a step of the stop raises (the observers' close asks for stats after the
    GPU was lost): the steps after it ran no more, and the segments, the liveness object and the lock
    file stayed (a review). Each step runs now, and the one that failed is logged."""
    import dflash2.daemon.startup as srv
    from dflash2.client import Client
    from dflash2.daemon.observe import Observers

    if last_sample_fails:
        def close(self):
            raise RuntimeError("stats after the GPU was lost (injected)")
        monkeypatch.setattr(Observers, "close", close)

    made: dict = {}
    real = srv.build_managers

    def keep(*args, **kw):  # the daemon's own managers, kept to reach the backend
        made.update(real(*args, **kw))
        return made
    monkeypatch.setattr(srv, "build_managers", keep)
    path = write_config(tmp_path)
    cfg = load_config(path)
    segments = f"/dev/shm/{instance_name(os.getpid())}-*"
    before = set(glob.glob(segments))
    seen = {}

    def lose_the_gpu():
        deadline = time.monotonic() + 30
        while not (made and os.path.exists(tmp_path / "d.sock")) and time.monotonic() < deadline:
            time.sleep(0.01)
        with Client.connect(config=path, name="before") as c:
            seen["served"] = c.ping()["version"]
        seen["segments"] = set(glob.glob(segments)) - before
        seen["lock"] = os.path.exists(tmp_path / "d.sock.lock")
        seen["at"] = time.monotonic()
        # What the CUDA backend sets when its probe after a failed copy finds the context gone.
        next(iter(made.values())).backend.fatal = "GPU 0: the CUDA context is lost (injected)"

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=lose_the_gpu, daemon=True).start()
    try:
        assert srv.run(cfg) == 5
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert seen["served"]
    assert time.monotonic() - seen["at"] < 5  # the loop sees it within a receive timeout or so
    assert seen["segments"] and seen["lock"]  # they were there while serving ...
    assert not (set(glob.glob(segments)) - before)  # ... and went
    assert not os.path.exists(tmp_path / "d.sock.lock") and not os.path.exists(tmp_path / "d.sock")
    err = capsys.readouterr().err
    assert "dflash2d: error: GPU 0: the CUDA context is lost (injected); exiting (code 5)" in err
    assert ("close failed; the other steps run" in err) == last_sample_fails
    assert not glob.glob(f"/dev/shm/dflash2-{os.getpid()}-alive")
