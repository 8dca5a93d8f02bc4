"""History and `dflash2 history` in-process: samples kept, persisted, read back and rendered."""

from __future__ import annotations

import json
import logging
import os

import pytest

from dflash2 import cli
from dflash2 import protocol as P
from dflash2.daemon.service import Service
from dflash2.history import History, decode, rates, read_file
from observe_helpers import call_ok, load, service  # noqa: F401  (a fixture)


def test_history_is_bounded_persisted_and_reloaded(service, tmp_path, clock):
    path = tmp_path / "history.jsonl"
    h = History(interval_s=1.0, max_samples=3, path=path, clock=clock)
    for _ in range(5):
        assert h.due()
        h.record(service.stats())
        assert not h.due()
        clock.advance(1.0)
    assert [s["t"] for s in h.since()] == [1002.0, 1003.0, 1004.0]
    assert [s["t"] for s in h.since(1.5)] == [1004.0]
    assert decode(History.encode(h.since())) == h.since()
    assert len(read_file(path)) == 5
    again = History(max_samples=3, path=path, clock=clock)
    assert again.since() == h.since()


def test_one_daemon_writes_a_state_folders_history(tmp_path, caplog):
    # Two daemons given one daemon.state_dir: the second keeps its history in memory and says why,
    # rather than interleaving its samples into the first one's file.
    from types import SimpleNamespace

    from dflash2.history import make_history

    cfg = SimpleNamespace(history_enabled=True)
    first = make_history(cfg, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        second = make_history(cfg, tmp_path)
    assert first.path == tmp_path / "history.jsonl" and second.path is None
    assert f"written by another daemon (pid {os.getpid()})" in caplog.text
    first.close()
    third = make_history(cfg, tmp_path)  # the folder is free again once the first one stops
    assert third.path == tmp_path / "history.jsonl"
    third.close()
    second.close()


def test_a_full_disk_under_the_history_lock_names_the_lock_and_the_file_is_written_once_there_is_room(
        service, tmp_path, monkeypatch, caplog, clock):
    # A write to the open lock that fails (ENOSPC) names no file: the line said "cannot create
    # STATE_DIR", a folder that was there (a review). It names the lock it could not write. And a
    # start on a full disk let the lock go and kept its history in memory for the daemon's whole
    # life, its file never written once there was room (a review): the lock is held, its names and
    # the samples written once the disk has room, as for a disk that fills while the daemon runs.
    import errno
    from types import SimpleNamespace

    from dflash2 import history as H

    real, disk_full = os.pwrite, [True]

    def pwrite(*a):
        if disk_full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a)
    monkeypatch.setattr(H.os, "pwrite", pwrite)
    with caplog.at_level(logging.INFO, logger="dflash2.history"):
        kept = H.make_history(SimpleNamespace(history_enabled=True), tmp_path, endpoint="a", clock=clock)
        assert kept.path == tmp_path / "history.jsonl" and kept.lock_fd >= 0
        assert f"history: cannot write {tmp_path / H.LOCK_NAME} ([Errno 28] No space left on device)" in caplog.text
        kept.record(service.stats())
        assert not kept.path.exists() and (tmp_path / H.LOCK_NAME).read_text() == ""
        disk_full[0] = False
        clock.advance(1)
        kept.record(service.stats())
        assert len(read_file(kept.path)) == 2
        assert (tmp_path / H.LOCK_NAME).read_text() == f"{os.getpid()}\na\n"
        assert caplog.text.count("cannot write") == 1 and "written again (2 samples that had waited)" in caplog.text
    kept.close()


def test_a_history_lock_keeps_every_name_its_daemon_was_reached_by(tmp_path, monkeypatch, caplog, clock):
    # A review: the lock kept the last start's names alone: a null endpoint under WSL's
    # XDG_RUNTIME_DIR, then under cron (none), then the config writing out the WSL path its clients
    # used: refused as another daemon's history, where the other order kept it.
    from types import SimpleNamespace

    from dflash2.endpoints import default_endpoint
    from dflash2.history import make_history

    cfg, state = SimpleNamespace(history_enabled=True), tmp_path / "state"
    wsl = tmp_path / "wslg-runtime"
    wsl.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(wsl))
    make_history(cfg, state, "default", default_endpoint(), clock=clock).close()
    wsl_path = default_endpoint()
    (state / "history.jsonl").write_text("")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    make_history(cfg, state, "default", default_endpoint(), clock=clock).close()
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        h = make_history(cfg, state, wsl_path, clock=clock)
    assert h.path == state / "history.jsonl", caplog.text
    h.close()
    other = make_history(cfg, state, f"ipc://{tmp_path}/another.sock", clock=clock)  # (still apart)
    assert other.path is None
    other.close()
    # Nine environments: the lock keeps 8 names, the latest start's among them (a review: the cut
    # after a sort dropped the path the last start served).
    for name in [f"a{i}" for i in range(8)] + ["z-latest"]:
        (tmp_path / name).mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / name))
        make_history(cfg, state, "default", default_endpoint(), clock=clock).close()
    latest = default_endpoint()
    lock = (state / "history.lock").read_text().split("\n")
    assert latest in lock and len([line for line in lock[1:] if line]) == 8, lock
    h = make_history(cfg, state, latest, clock=clock)
    assert h.path == state / "history.jsonl"
    h.close()


def test_a_daemon_of_another_endpoint_does_not_take_a_history_for_its_own(tmp_path, caplog, clock, service):
    # A review: two models' daemons on the default state folder, one after the other: the second
    # read the first's samples back as its own past and wrote on in its file; the first, restarted,
    # was then the one kept in memory only.
    from types import SimpleNamespace

    from dflash2.history import make_history

    cfg = SimpleNamespace(history_enabled=True)
    a = make_history(cfg, tmp_path, "ipc:///run/a.sock", clock=clock)
    a.record(service.stats())
    a.close()
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        b = make_history(cfg, tmp_path, "ipc:///run/b.sock", clock=clock)
    assert b.path is None and not b.samples, caplog.text
    assert "is the history of the daemon serving ipc:///run/a.sock, not of this one (ipc:///run/b.sock)" in caplog.text
    b.close()
    again = make_history(cfg, tmp_path, "ipc:///run/a.sock", clock=clock)  # (its own daemon, back: its file)
    assert again.path == tmp_path / "history.jsonl" and len(again.samples) == 1
    again.close()
    (tmp_path / "history.jsonl").unlink()  # (removed: the folder is anyone's again)
    b = make_history(cfg, tmp_path, "ipc:///run/b.sock", clock=clock)
    assert b.path == tmp_path / "history.jsonl"
    b.record(service.stats())
    b.close()
    (tmp_path / "history.lock").write_text("12345")  # (an earlier release's lock: the pid alone)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash2.history"):
        a = make_history(cfg, tmp_path, "ipc:///run/a.sock", clock=clock)
    assert a.path == tmp_path / "history.jsonl"
    assert "names no daemon's endpoint (an earlier release's): taken as the history of this one" in caplog.text
    a.record(service.stats())
    a.close()
    from dflash2.history import endpoint_id
    assert endpoint_id("tcp://[0:0:0:0:0:0:0:1]:5555") == "tcp://[::1]:5555"  # (as a user would write it)
    # The default socket's usual paths are one owner, in any environment; another path is its own,
    # whatever XDG_RUNTIME_DIR the daemon starts under (a review: the same config, two owners).
    uid = os.getuid()
    assert endpoint_id(f"ipc:///tmp/dflash2-{uid}/dflash2.sock") == "default"
    assert endpoint_id(f"ipc:///run/user/{uid}/dflash2/dflash2.sock") == "default"
    own = f"ipc://{tmp_path}/xdg/dflash2/dflash2.sock"
    ids = set()
    for xdg in (str(tmp_path / "xdg"), str(tmp_path / "elsewhere")):
        os.environ["XDG_RUNTIME_DIR"], saved = xdg, os.environ.get("XDG_RUNTIME_DIR")
        try:
            ids.add(endpoint_id(own))
        finally:
            os.environ.pop("XDG_RUNTIME_DIR") if saved is None else os.environ.__setitem__("XDG_RUNTIME_DIR", saved)
    assert ids == {own}
    # A rotated file alone is the first daemon's history too (it is read back as well).
    (tmp_path / "history.jsonl").rename(tmp_path / "history.jsonl.1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        b = make_history(cfg, tmp_path, "ipc:///run/b.sock", clock=clock)
    assert b.path is None and not b.samples and "history.jsonl.1 to let this one take the folder" in caplog.text
    b.close()
    # One daemon under two spellings: the default endpoint (its path follows XDG_RUNTIME_DIR: a
    # shell's, a systemd unit's) and a tcp host written two ways keep their history.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for first, again in (("default", "default"), ("tcp://[::1]:5555", "tcp://[0:0:0:0:0:0:0:1]:5555"),
                         ("tcp://localhost:5555", "tcp://127.0.0.1:5555"), ("tcp://*:5555", "tcp://0.0.0.0:5555"), ("tcp://[::]:5555", "tcp://*:5555"),
                         (f"ipc://{tmp_path}/link/d.sock", f"ipc://{tmp_path}/real/d.sock")):
        for name in ("history.jsonl", "history.jsonl.1", "history.lock"):
            (tmp_path / name).unlink(missing_ok=True)
        x = make_history(cfg, tmp_path, first, clock=clock)
        x.record(service.stats())
        x.close()
        y = make_history(cfg, tmp_path, again, clock=clock)
        assert y.path == tmp_path / "history.jsonl" and len(y.samples) == 1, (first, again)
        y.close()


def test_history_op_answers_when_off_and_on(service, clock):
    reply = call_ok(service, P.Op.HISTORY)
    assert reply.result == {"enabled": False, "interval_s": None, "count": 0}
    service.history = History(clock=clock)
    service.history.record(service.stats())
    reply = call_ok(service, P.Op.HISTORY, args={"since_s": 60})
    assert reply.result["count"] == 1 and decode(reply.arrays[0])[0]["t"] == clock.now


def test_rates_skip_a_restart_and_give_bandwidth():
    def s(t, hbm_reads, dram_reads, moved):
        return {"t": t, "reads": {"hbm": hbm_reads, "dram": dram_reads},
                "swaps": {"dram->hbm": {"bytes": moved}}}

    r = rates([s(0, 0, 0, 0), s(2, 30, 10, 4000), s(3, 0, 0, 0), s(4, 5, 0, 0)])
    assert [x["t"] for x in r] == [2, 4]
    assert r[0]["hbm_hit_ratio"] == 0.75 and r[0]["swap_bps"] == {"dram->hbm": 2000.0}
    assert r[1]["hbm_hit_ratio"] == 1.0


def test_history_command_reads_a_file_prints_json_and_plots(service, tmp_path, clock, capsys, monkeypatch):
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    h.record(service.stats())
    load(service)
    clock.advance(1)
    h.record(service.stats())
    assert cli.main(["history", "--file", str(path)]) == 0
    text = capsys.readouterr().out
    assert "hbm use" in text and "2 samples" in text
    assert cli.main(["history", "--file", str(path), "--json", "--since", "10m"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == read_file(path)
    pytest.importorskip("matplotlib")
    png = tmp_path / "h.png"
    assert cli.main(["history", "--file", str(path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    # The per-interval hit ratio is drawn as dots too: a lone interval with reads between intervals
    # without any has no neighbour to draw a line to (the series showed nothing, a review).
    import matplotlib.figure

    saved = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.append(fig), real_savefig(fig, *a, **k))[1])
    assert cli.main(["history", "--file", str(path), "--plot", str(png)]) == 0
    lines = {line.get_label(): line for ax in saved[0].axes for line in ax.get_lines()}
    assert lines["per interval"].get_marker() not in (None, "None", "", " ")
    capsys.readouterr()
    # No extension: PNG, and the file named as written (it said "incident" of incident.png).
    assert cli.main(["history", "--file", str(path), "--plot", str(tmp_path / "incident")]) == 0
    assert f"plot written to {tmp_path / 'incident.png'}" in capsys.readouterr().out
    assert (tmp_path / "incident.png").read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["history", "--file", str(path), "--plot", str(tmp_path / "dotted.")]) == 0
    assert f"plot written to {tmp_path / 'dotted.png'}" in capsys.readouterr().out  # (it said "dotted.")
    # A format matplotlib cannot write: one line, exit 2 (a traceback before).
    assert cli.main(["history", "--file", str(path), "--plot", str(tmp_path / "h.xyz")]) == 2
    out, err = capsys.readouterr()
    assert "--plot" in err and "'xyz' is not supported" in err and "Traceback" not in err
    assert out == ""  # (the table was printed first, as if the command had worked)
    assert cli.main(["history", "--file", str(path), "--plot", str(tmp_path / "h.xyz"), "--json"]) == 2
    assert capsys.readouterr().out == ""


def test_a_since_shorter_than_the_daemons_interval_is_not_no_samples_yet(service, clock, capsys, monkeypatch):
    """The daemon counts --since back from now: `--since 0.5s` more than half a second after its last
    sample holds none of them, and the command said "no samples yet" of a daemon that had thousands
    (half the calls against a live one, a review)."""
    from dflash2 import history_cli

    service.history = History(clock=clock)
    for _ in range(3):
        service.history.record(service.stats())
        clock.advance(1)
    clock.advance(-0.3)  # 0.7 s after the last sample
    monkeypatch.setattr(history_cli, "fetch", lambda endpoint, since_s, timeout_s=5.0, key_file=None: decode(
        call_ok(service, P.Op.HISTORY, args={} if since_s is None else {"since_s": since_s}).arrays[0]))
    assert cli.main(["history", "--endpoint", "ipc:///nowhere/d.sock", "--since", "0.5s"]) == 0
    out = capsys.readouterr().out
    assert "no samples yet" not in out and "no samples in the last 0.5s" in out, out
    assert cli.main(["history", "--endpoint", "ipc:///nowhere/d.sock", "--since", "2s"]) == 0
    assert "2 samples over 1s" in capsys.readouterr().out


def test_history_command_without_a_daemon_says_so(tmp_path, capsys):
    # No socket file: said at once (as `dflash2 status` does), exit 1 like status, not a usage error.
    assert cli.main(["history", "--endpoint", f"ipc://{tmp_path}/none.sock"]) == 1
    err = capsys.readouterr().err
    assert "the socket file does not exist" in err and err.count("running?") == 1, err  # (asked once)
    # A socket file nothing listens on (a killed daemon's): said at once, not after the call's timeout.
    import socket
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(tmp_path / "stale.sock"))
        assert cli.main(["history", "--endpoint", f"ipc://{tmp_path}/stale.sock", "--timeout", "30"]) == 1
    assert "nothing listens on its socket file (a daemon that was killed left it" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["status", "--watch", "--count", "1"], ["history"]])
def test_an_endpoint_naming_a_folder_is_a_usage_error_not_a_killed_daemons_socket(tmp_path, capsys, command):
    """Its connect refused, the command said "a daemon that was killed left it", exit 1 (a review)."""
    assert cli.main([*command, "--endpoint", f"ipc://{tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"ipc://{tmp_path} names a folder, not dflash2d's socket" in err, err
    assert "killed" not in err


def test_history_keeps_each_sample_compact_in_memory(make_manager, clock):
    # 3 hours of samples stay in memory: as the nested dicts sample_of builds, 4.4 KB each on a
    # three-tier daemon (48 MB, its resident memory climbing for its first three hours; here 1.8 KB
    # for a 370-byte line); kept as their JSON lines, about what the line takes (here 0.56 KB).
    import tracemalloc

    service = Service(make_manager(hbm_blocks=8, dram_blocks=16, nvme_blocks=32), lease_timeout_s=10,
                      heartbeat_interval_s=1, clock=clock)
    h = History(interval_s=1.0, max_samples=1000, clock=clock)
    h.record(service.stats())
    line = len(History.encode(h.since()))
    tracing = tracemalloc.is_tracing()  # (python -X tracemalloc: leave it on)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(500):
            clock.advance(1.0)
            h.record(service.stats())
        per_sample = (tracemalloc.get_traced_memory()[0] - before) / 500
    finally:
        if not tracing:
            tracemalloc.stop()
    assert per_sample < 2 * line, f"{per_sample:.0f} bytes a sample in memory for a {line}-byte line"
    assert [s["t"] for s in h.since(2.5)] == [clock.now - 2, clock.now - 1, clock.now]
    count, raw = h.encoded(2.5)
    assert count == 3 and decode(raw) == h.since(2.5)


def test_a_restart_that_keeps_the_pid_is_a_restart(service):
    """A daemon that is pid 1 in its container keeps its pid across restarts; one that served more
    after the restart than before showed no counter going down: its figures were taken for the old
    daemon's. Its start time tells."""
    def s(t, reads, started):
        return {"t": t, "pid": 1, "started": started, "requests": reads, "reads": {"hbm": reads}, "swaps": {}}

    assert rates([s(0, 10, 100.0), s(1, 600, 100.0)])[0]["reads"] == 590
    assert rates([s(0, 10, 100.0), s(1, 600, 200.0)]) == []
    from dflash2.history import sample_of
    assert sample_of(service.stats(), 0.0)["started"] == service.started > 0  # in every sample and frame


def test_a_history_row_spans_every_interval_between_its_samples_and_names_a_restart_within():
    """A row of `dflash2 history` stands for all the samples since the row before: its figures add
    up their intervals (the two ends alone mixed or dropped two daemons' figures when one restarted
    between them), and a restart within it is said."""
    from dflash2.history_cli import render

    tiers = {"hbm": {"used_bytes": 1, "capacity_bytes": 2, "blocks": 1}}
    res = {"granted": 0, "deferred": 0, "reserved_blocks": 0}

    def s(t, hbm, dram, started):
        return {"t": 1000.0 + t, "tiers": tiers, "reads": {"hbm": hbm, "dram": dram}, "hbm_hit_ratio": None,
                "swaps": {}, "reservations": res, "clients": 0, "pid": 1, "started": started, "requests": hbm + dram}
    # The first daemon reads 256 blocks from DRAM; the second, pid 1 again, 800 from HBM and 56 from DRAM.
    samples = [s(0, 0, 0, 1.0), s(1, 0, 128, 1.0), s(2, 0, 256, 1.0),
               s(3, 0, 0, 2.0), s(4, 400, 28, 2.0), s(5, 800, 56, 2.0)]
    rows = render(samples, max_rows=2).splitlines()
    assert "(restart)" in rows[2], rows
    # 256 blocks read by the first daemon and 856 by the second, 800 of them from HBM: 71.9%
    assert "71.9% (restart)" in rows[2], rows


def recorded(tmp_path, clock, service, n: int):
    """A history file of `n` samples a second apart: its path and its lines."""
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    for _ in range(n):
        h.record(service.stats())
        clock.advance(1)
    return path, path.read_text().splitlines()


def test_one_bad_byte_in_a_history_line_loses_that_line_not_the_history(tmp_path, clock, service, capsys):
    """A line that still parses but lost a figure the readers use, or whose time became a number no
    clock takes, is not a sample: skipped (and counted), not kept to fail every `dflash2 history`."""
    path, good = recorded(tmp_path, clock, service, 3)
    t = json.loads(good[1])["t"]
    for bad in (good[1].replace(f'"t":{t}', f'"t":{t}e052', 1), good[1].replace('"deferred"', '"deferrad"', 1),
                good[1].replace('"used_bytes"', '"used_bytez"', 1), good[1].replace('"clients":0', '"clients":NaN', 1),
                good[1].replace('"hbm_hit_ratio":null', '"hbm_hit_ratio":"x"', 1)):
        assert bad != good[1]
        path.write_text("\n".join([good[0], bad, good[2]]) + "\n")
        assert [s["t"] for s in read_file(path)] == [json.loads(good[0])["t"], json.loads(good[2])["t"]], bad
        assert cli.main(["history", "--file", str(path)]) == 0, bad
        assert "2 samples" in capsys.readouterr().out


def test_a_history_file_that_is_not_a_regular_file_is_skipped_not_waited_on(tmp_path, capsys, caplog):
    """A FIFO where history.jsonl should be: opened, it blocked the daemon's start-up and `dflash2
    history --file` for ever. Skipped, and said."""
    import threading

    from dflash2.config import parse_config
    from dflash2.history import make_history

    fifo = tmp_path / "history.jsonl"
    os.mkfifo(fifo)
    made, said = [], []
    cfg = parse_config({"enable": True, "device": {"kind": "host"}, "history_enabled": True,
                        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 1, "dram_capacity_mb": 0, "nvme_capacity_mb": 0,
                                   "page_kb": 64},
                        "daemon": {"state_dir": str(tmp_path)}})

    def run():
        made.append(make_history(cfg, tmp_path))
        said.append(cli.main(["history", "--file", str(fifo)]))
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(10)
    assert not worker.is_alive(), "blocked on the FIFO"
    assert made[0].path is None and "is not a regular file" in caplog.text
    made[0].close()
    assert said == [2] and "is not a regular file" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_history_file_in_a_folder_this_user_may_not_enter_is_a_named_error(tmp_path, capsys):
    """The usual case of a user not the daemon's reading STATE_DIR/history.jsonl (the state folder is
    0700): a review saw a PermissionError traceback (exit 1), the existence asked outside the try."""
    from test_other_user import as_other_user
    tmp_path.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = state / "history.jsonl"
    path.write_text('{"t": 1.0}\n')
    with as_other_user():
        code = cli.main(["history", "--file", str(path)])
    assert code == 2
    assert f"cannot read the history file {path}: Permission denied" in capsys.readouterr().err


def test_a_missing_history_file_is_named(tmp_path, capsys):
    assert cli.main(["history", "--file", str(tmp_path / "absent.jsonl")]) == 2
    assert f"no history file at {tmp_path / 'absent.jsonl'}" in capsys.readouterr().err


def test_a_history_time_no_clock_takes_in_this_time_zone_is_not_a_sample(tmp_path, clock, service):
    """A sample's time in the last hours of the year 9999 (UTC) passed the check but failed the
    table's local clock east of UTC (`year 10000 is out of range`)."""
    import subprocess
    import sys
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    h.record(service.stats())
    line = json.loads(path.read_text())
    line["t"] = 253_402_290_000
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    out = subprocess.run([sys.executable, "-m", "dflash2.cli", "history", "--file", str(path)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "TZ": "UTC-14"})  # (POSIX: 14 hours east of UTC)
    assert out.returncode == 0 and "1 samples" in out.stdout and "year 10000" not in out.stderr, out.stdout + out.stderr


def test_a_figure_past_a_float_is_not_a_sample_and_stops_nothing(tmp_path, clock, service, capsys):
    """JSON takes an int of up to 4300 digits; one of 400 in a line made `math.isfinite` raise
    OverflowError: the daemon did not start on its history, nor did `dflash2 history --file` read it
    (a review)."""
    path, good = recorded(tmp_path, clock, service, 2)
    huge = good[1].replace('"clients":0', '"clients":1' + "0" * 400, 1)
    assert huge != good[1]
    path.write_text("\n".join([good[0], huge]) + "\n")
    assert [s["t"] for s in read_file(path)] == [json.loads(good[0])["t"]]
    assert cli.main(["history", "--file", str(path)]) == 0
    assert "1 samples" in capsys.readouterr().out
    History(path=path, clock=clock)  # (the daemon's start-up reads it back)


def test_history_since_parses_only_the_lines_it_keeps(tmp_path, clock, service, monkeypatch, capsys):
    """`dflash2 history --file F --since 30m` parsed the whole file pair (128 MiB: 1.2 GB of memory and
    6 s for 30 minutes' rows, a review); now the lines before the cutoff are passed over by their time."""
    import dflash2.history as history

    path, _ = recorded(tmp_path, clock, service, 200)
    everything = [s["t"] for s in read_file(path)]
    parsed = []
    real = history.json.loads
    monkeypatch.setattr(history.json, "loads", lambda s, *a, **k: parsed.append(1) or real(s, *a, **k))
    kept = read_file(path, since_s=9)
    assert [s["t"] for s in kept] == everything[-10:]
    assert len(parsed) < 60, len(parsed)  # (10 kept, and the tail read for the newest time)
    assert cli.main(["history", "--file", str(path), "--since", "9s", "--json"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 10


def test_a_plot_of_samples_before_a_tier_was_added_draws_it_from_where_it_begins(service, tmp_path, clock, capsys):
    """An NVMe tier added at a restart: the older samples have none. The plot looked the tier up in
    them before asking whether they had it (KeyError, a traceback: a review)."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "history.jsonl"
    h = History(path=path, clock=clock)
    h.record(service.stats())
    clock.advance(1)
    h.record(service.stats())
    samples = read_file(path)
    del samples[0]["tiers"]["dram"]
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert "dram" not in read_file(path)[0]["tiers"] and "dram" in read_file(path)[1]["tiers"]
    assert cli.main(["history", "--file", str(path), "--plot", str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
