"""`dflash2 history --plot FILE` where the disk cannot take the plot: an earlier file at that path stays
whole (it was truncated to a partial PNG), and the command exits 1 with one line, as output that
cannot be written does (it exited 2, a usage error; a review)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from dflash2.history import History
from observe_helpers import service  # noqa: F401  (a fixture)


def _full_disk():  # files past 8 KiB cannot be written (EFBIG, as ENOSPC on a full disk)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))


def _history_of(service, tmp_path, clock, samples=5):
    history = tmp_path / "history.jsonl"
    h = History(path=history, clock=clock)
    for _ in range(samples):
        h.record(service.stats())
        clock.advance(1.0)
    h.close()
    return history


def _plot(history, out, *prefix, **kw):
    return subprocess.run([*prefix, sys.executable, "-m", "dflash2.cli", "history", "--file", str(history),
                           "--plot", str(out)], capture_output=True, text=True, timeout=120, **kw)


def test_a_plot_that_cannot_be_written_leaves_the_file_there_whole(service, tmp_path, clock):
    pytest.importorskip("matplotlib")
    history = _history_of(service, tmp_path, clock, samples=30)
    out = tmp_path / "incident.png"
    earlier = b"an earlier incident's plot" * 10
    out.write_bytes(earlier)

    r = _plot(history, out, preexec_fn=_full_disk)
    assert out.read_bytes() == earlier
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"dflash2 history: --plot: cannot write {out}: File too large; a file there is left as it was"], r.stderr
    assert sorted(os.listdir(tmp_path)) == ["history.jsonl", "incident.png"]  # no temporary file left


def test_a_plot_onto_a_link_writes_the_file_it_names(service, tmp_path, clock):
    """`latest.png -> plots/day.png`: the plot is written through the link (drawn beside and moved
    onto it, the link itself was replaced and the file it named kept the old plot; a review)."""
    pytest.importorskip("matplotlib")
    history = _history_of(service, tmp_path, clock)
    (tmp_path / "plots").mkdir()
    target = tmp_path / "plots" / "day.png"
    target.write_bytes(b"old")
    target.chmod(0o640)
    link = tmp_path / "latest.png"
    link.symlink_to(target)
    r = _plot(history, link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and target.read_bytes()[:4] == b"\x89PNG" and (target.stat().st_mode & 0o777) == 0o640


def test_a_plot_with_a_long_name_in_a_folder_the_user_cannot_write(service, tmp_path, clock):
    """A name of 250 bytes (a temporary name beside it was too long), and a file the user may write
    in a folder they may not (a temporary file could not be made there): both written (a review)."""
    pytest.importorskip("matplotlib")
    history = _history_of(service, tmp_path, clock)
    out = tmp_path / ("p" * 246 + ".png")
    r = _plot(history, out)
    assert r.returncode == 0 and out.read_bytes()[:4] == b"\x89PNG", r.stderr
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: a folder it cannot write cannot be made")
    folder = tmp_path / "reports"
    folder.mkdir()
    shared = folder / "plot.png"
    shared.write_bytes(b"old")
    shared.chmod(0o666)
    folder.chmod(0o555)
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"] if os.geteuid() == 0 else []
    try:
        r = _plot(history, shared, *drop)
    finally:
        folder.chmod(0o755)
    assert r.returncode == 0 and shared.read_bytes()[:4] == b"\x89PNG", r.stderr


def test_a_plot_through_a_dangling_link_onto_a_full_disk_leaves_nothing_behind(service, tmp_path, clock):
    """`latest.png -> day.png`, day.png not made yet: written there where there is room; where there
    is none, no empty day.png is left (it was, though the line said the file was left as it was)."""
    pytest.importorskip("matplotlib")
    history = _history_of(service, tmp_path, clock)
    link = tmp_path / "latest.png"
    link.symlink_to(tmp_path / "day.png")
    r = _plot(history, link, preexec_fn=_full_disk)
    assert r.returncode == 1 and not (tmp_path / "day.png").exists(), r.stderr
    r = _plot(history, link)
    assert r.returncode == 0 and link.is_symlink() and (tmp_path / "day.png").read_bytes()[:4] == b"\x89PNG"


def test_what_cannot_be_a_plot_is_refused_in_one_line(service, tmp_path, clock):
    """A FIFO without a reader or a socket at the path: "not a regular file" (it said "no such device
    or address"); `.pgf` without xelatex, a format matplotlib lists: one line, exit 2 (a traceback)."""
    pytest.importorskip("matplotlib")
    history = _history_of(service, tmp_path, clock)
    os.mkfifo(tmp_path / "fifo.png")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "sock.png"))
    try:
        for name in ("fifo.png", "sock.png"):
            r = _plot(history, tmp_path / name)
            assert r.returncode == 2 and r.stderr.strip().splitlines() == [
                f"dflash2: error: --plot: cannot write {tmp_path / name}: not a regular file"], r.stderr
    finally:
        unix.close()
    if shutil.which("xelatex") is None:
        r = _plot(history, tmp_path / "incident.pgf")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_plot_goes_only_where_the_kernel_finds_its_path(tmp_path, monkeypatch):
    """`missing/../x.png` (no folder `missing`), a link to `nodir/../day.png`, a link to `newdir/`:
    refused as the kernel refuses them, nothing made elsewhere (a lexical realpath made ./x.png and a
    file `newdir`, said "File exists" of the second, and reported each written; a review)."""
    from dflash2.history_cli import _write_whole

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):
        _write_whole("missing/../x.png", b"PNG")
    (tmp_path / "day.png").write_bytes(b"old")
    (tmp_path / "latest.png").symlink_to("nodir/../day.png")
    with pytest.raises(FileNotFoundError):
        _write_whole("latest.png", b"PNG")
    (tmp_path / "dir.png").symlink_to("newdir/")
    with pytest.raises(OSError):
        _write_whole("dir.png", b"PNG")
    assert sorted(os.listdir(tmp_path)) == ["day.png", "dir.png", "latest.png"]
    assert (tmp_path / "day.png").read_bytes() == b"old"
