"""`dflash2 history --plot FILE` where the disk cannot take the plot: an earlier file at that path stays
whole (it was truncated to a partial PNG), and the command exits 1 with one line, as output that
cannot be written does (it exited 2, a usage error; a review)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from dflash2.history import History
from observe_helpers import service  # noqa: F401  (a fixture)


def test_a_plot_that_cannot_be_written_leaves_the_file_there_whole(service, tmp_path, clock):
    pytest.importorskip("matplotlib")
    history = tmp_path / "history.jsonl"
    h = History(path=history, clock=clock)
    for _ in range(30):
        h.record(service.stats())
        clock.advance(1.0)
    h.close()
    out = tmp_path / "incident.png"
    earlier = b"an earlier incident's plot" * 10
    out.write_bytes(earlier)

    def full_disk():  # files past 8 KiB cannot be written (EFBIG, as ENOSPC on a full disk)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    r = subprocess.run([sys.executable, "-m", "dflash2.cli", "history", "--file", str(history), "--plot", str(out)],
                       capture_output=True, text=True, preexec_fn=full_disk, timeout=120)
    assert out.read_bytes() == earlier
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"dflash2 history: --plot: cannot write {out}: File too large; a file there is left as it was"], r.stderr
    assert sorted(os.listdir(tmp_path)) == ["history.jsonl", "incident.png"]  # no temporary file left
