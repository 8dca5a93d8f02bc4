"""Heat's weights changed at run time through a real dflash2d (`Client.set_weights`, README
Policies): in force at once and reported by status; bad values refused whole, the weights in force
kept; every change said in the daemon's log with the client that made it (a review: the log said
nothing, so an operator could not tell why evictions changed)."""

from __future__ import annotations

import pytest
from daemon_proc import DaemonProcess

from dflash2.client import DaemonError
from dflash2.errors import ProtocolError


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"},
                                     policy={"name": "heat"})).start()
    yield proc
    proc.stop()


def test_weights_set_at_run_time_are_in_force_refused_whole_and_logged(daemon, connect):
    c = connect(name="tuner")
    before = c.stats()["policy"]["weights"]
    policy = c.set_weights({"priority": 0, "recency": 3.5})
    assert policy["weights"]["priority"] == 0.0 and policy["weights"]["recency"] == 3.5
    assert c.stats()["policy"]["weights"] == {**before, "priority": 0.0, "recency": 3.5}
    for bad in ({"priority": -1}, {"recency": 2.0, "bogus": 1}, {"recency": float("nan")}, {"recency": "2"}):
        with pytest.raises((DaemonError, ProtocolError)):
            c.set_weights(bad)
        assert c.stats()["policy"]["weights"]["recency"] == 3.5, bad  # (refused whole: nothing changed)
    log = daemon.log()
    line = [ln for ln in log.splitlines() if "set the policy's weights" in ln]
    assert len(line) == 1, log[-3000:]  # (the refused calls changed nothing, and say nothing here)
    assert "(tuner, pid" in line[0] and f"priority {before['priority']:g} -> 0" in line[0], line[0]
    assert f"recency {before['recency']:g} -> 3.5" in line[0], line[0]
