"""History, `dflash2 history` and `dflash2 status --watch` under misuse and faults: corrupt and torn
history files, restarts that change the tier set or the counters, a wall clock set back, bad
arguments. Real daemons (tests/observe_helpers.py) wherever a daemon is involved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import time
from observe_helpers import RawClient, fill_then_reuse, running_daemon

from dflash2 import protocol as P
from dflash2.history import History, read_file, sample_of
from dflash2.status_watch import changes

pytestmark = pytest.mark.slow


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash2.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def _history_config(config_file, tmp_path, **memory):
    return config_file(history_enabled=True, memory=memory,
                       daemon={"endpoint": f"ipc://{tmp_path}/d.sock", "state_dir": str(tmp_path / "state")})


def _one_sample(config_file, tmp_path) -> str:
    """One real sample line, written by a daemon that ran and stopped."""
    cfg = _history_config(config_file, tmp_path)
    with running_daemon(cfg, str(tmp_path / "first.log")):
        pass
    return (tmp_path / "state" / "history.jsonl").read_text().splitlines()[-1]


def _fail_cleanly(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and last.startswith("dflash2") and "error:" in last, r.stderr
    for w in words:
        assert w in last, r.stderr


def test_a_reloaded_history_with_lines_that_are_not_samples_still_reads_back(tmp_path, config_file):
    # A history file that holds JSON lines that are not samples (a foreign line, `null`) and a torn
    # last line: the daemon reloads the samples and says how many lines it skipped; reading the
    # history back neither fails in the daemon nor in the command.
    sample = _one_sample(config_file, tmp_path)
    path = tmp_path / "state" / "history.jsonl"
    path.write_text(f'{sample}\n{{"x": 1}}\nnull\n[1, 2]\n{sample}\n{{"t": 5')
    cfg = _history_config(config_file, tmp_path)
    log = tmp_path / "second.log"
    with running_daemon(cfg, str(log)):
        endpoint = f"ipc://{tmp_path}/d.sock"
        for args in ([], ["--since", "1d"], ["--json"]):
            r = _cli("history", "--endpoint", endpoint, *args)
            assert r.returncode == 0, (args, r.stderr)
    assert "4 lines are not samples" in log.read_text()


def test_a_torn_last_line_does_not_swallow_the_next_daemons_first_sample(tmp_path, config_file):
    # A daemon killed mid-write leaves a line without its newline: the next daemon must start its
    # samples on a line of their own, or its first sample is glued to the torn one and lost.
    sample = _one_sample(config_file, tmp_path)
    path = tmp_path / "state" / "history.jsonl"
    path.write_text(f"{sample}\n{sample[:40]}")
    before = len(read_file(path))
    cfg = _history_config(config_file, tmp_path)
    with running_daemon(cfg, str(tmp_path / "second.log")):
        c = RawClient(f"ipc://{tmp_path}/d.sock")
        in_memory = len(json_lines(c.call(P.Op.HISTORY).arrays[0]))
        c.close()
    lines = path.read_text().splitlines()
    assert lines[1] == sample[:40], "the torn line must stay as it was, alone"
    assert len(read_file(path)) >= in_memory >= before + 1


def json_lines(raw: bytes) -> list[dict]:
    return [json.loads(x) for x in raw.decode().splitlines() if x.strip()]


def test_one_bad_byte_loses_one_line_not_the_whole_history(tmp_path, config_file):
    sample = _one_sample(config_file, tmp_path)
    path = tmp_path / "history.jsonl"
    path.write_bytes(f"{sample}\n".encode() + b'{"t": 1, "\xff"}\n' + f"{sample}\n".encode())
    assert len(read_file(path)) == 2


def test_history_keeps_sampling_after_the_wall_clock_is_set_back(clock):
    # The sample time is wall-clock time; an NTP step back of an hour must not stop the sampling for
    # that hour.
    h = History(interval_s=1.0, clock=clock)
    stats = {"tiers": {}, "reads": {}, "hbm_hit_ratio": None, "moves": {},
             "reservations": {"granted": 0, "deferred": 0, "reserved_blocks": 0}}
    h.record(stats)
    clock.advance(-3600)
    assert h.due()
    h.record(stats)
    assert not h.due()
    clock.advance(1.0)
    assert h.due()


def test_history_command_rejects_bad_arguments_in_one_line(tmp_path, config_file):
    sample = _one_sample(config_file, tmp_path)
    path = tmp_path / "state" / "history.jsonl"
    path.write_text(f"{sample}\n{sample}\n")
    _fail_cleanly(_cli("history", "--file", str(path), "--rows", "0"), "--rows")
    _fail_cleanly(_cli("history", "--endpoint", f"ipc://{tmp_path}/d.sock", "--timeout", "0"), "--timeout")
    _fail_cleanly(_cli("history", "--file", str(tmp_path)), str(tmp_path))
    config = tmp_path / "dflash2_config.json"
    _fail_cleanly(_cli("history", "--file", str(config)), "no dflash2 history samples")
    one_line = tmp_path / "one.json"
    one_line.write_text('{"enable": true}\n')
    _fail_cleanly(_cli("history", "--file", str(one_line)), "no dflash2 history samples")
    pytest.importorskip("matplotlib")
    _fail_cleanly(_cli("history", "--file", str(path), "--plot", str(tmp_path / "no" / "such" / "h.png")),
                  "cannot write")


def test_history_command_reads_across_a_restart_that_added_the_nvme_tier(tmp_path, config_file):
    # nvme_capacity_mb raised between two runs: the older samples have no nvme tier.
    state = {"endpoint": f"ipc://{tmp_path}/d.sock", "state_dir": str(tmp_path / "state")}
    before = config_file(history_enabled=True, memory={"nvme_capacity_mb": 0, "nvme_path": None}, daemon=state)
    with running_daemon(before, str(tmp_path / "first.log")):
        pass
    after = config_file(history_enabled=True, daemon=state)
    with running_daemon(after, str(tmp_path / "second.log")):
        r = _cli("history", "--endpoint", state["endpoint"])
    assert r.returncode == 0, r.stderr
    assert "nvme use" in r.stdout and "(restart)" in r.stdout


def test_status_watch_tells_a_restart_from_negative_rates(tmp_path, config_file):
    # An idle daemon restarted between two frames: no reads, no swaps, but its request counter
    # starts again. The frame must say it restarted, not show negative requests per second; so too
    # in a container, where every daemon is pid 1 (same pid, counters down).
    cfg = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})
    frames = []
    for run in range(2):
        with running_daemon(cfg, str(tmp_path / f"run{run}.log")):
            c = RawClient(f"ipc://{tmp_path}/d.sock")
            for _ in range(5 if run == 0 else 1):
                stats = c.stats()
            frames.append(sample_of(stats, 1000.0 + run))
            c.close()
    line = changes(frames[0], frames[1])
    assert "restarted" in line and "-" not in line.split("requests/s")[0].split(";")[-1], line
    same_pid = {**frames[1], "pid": frames[0].get("pid")}
    assert "restarted" in changes(frames[0], same_pid)


def test_status_watch_after_a_load_gives_the_rates_of_the_interval(tmp_path, config_file):
    # The same daemon between two frames: a row with the interval's reads and a rate >= 0.
    cfg = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})
    with running_daemon(cfg, str(tmp_path / "d.log")):
        c = RawClient(f"ipc://{tmp_path}/d.sock")
        c.attach()
        first = sample_of(c.stats(), 1000.0)
        fill_then_reuse(c)
        second = sample_of(c.stats(), 1002.0)
        c.close()
    line = changes(first, second)
    assert "restarted" not in line and "of 256 blocks read" in line, line


def test_status_watch_rejects_an_interval_or_count_that_cannot_work(tmp_path):
    endpoint = f"ipc://{tmp_path}/none.sock"
    for bad in (["--interval", "-1"], ["--interval", "0"], ["--count", "-1"], ["--timeout", "-1"]):
        r = _cli("status", "--endpoint", endpoint, "--watch", "--count", "2", *bad)
        _fail_cleanly(r, bad[0])


def _closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """`dflash2 ARGS >&-`: fd 1 closed in the command (Python sets sys.stdout to None)."""
    return subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "dflash2.cli", *args],
                          stderr=subprocess.PIPE, text=True, timeout=60)


def test_status_and_history_with_stdout_closed_say_so_and_exit_by_their_answer(tmp_path, config_file):
    """`>&-`: `status --watch` ended in a traceback (sys.stdout.isatty() of None), exit 1, and `status`
    exited 0 saying nothing (a review). As dflash2d --check: one stderr line, the exit code the answer's."""
    none = f"ipc://{tmp_path}/none.sock"
    for watch in ([], ["--watch", "--count", "1"]):
        r = _closed_stdout("status", *watch, "--endpoint", none)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "the socket file does not exist" in r.stderr, r.stderr
    cfg = _history_config(config_file, tmp_path)
    with running_daemon(cfg, str(tmp_path / "d.log")):
        answered = [_closed_stdout("status", *watch, "--endpoint", f"ipc://{tmp_path}/d.sock")
                    for watch in ([], ["--watch"])]  # (no --count: not frames for ever)
    for r in answered:
        assert r.returncode == 0 and r.stderr.strip().splitlines() == [
            f"dflash2 status: stdout is closed: the view is not printed (dflash2d at ipc://{tmp_path}/d.sock "
            "answered)"], r.stderr
    r = _closed_stdout("history", "--file", str(tmp_path / "state" / "history.jsonl"))
    assert r.returncode == 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("dflash2 history: stdout is closed: the history read ("), r.stderr


def test_a_bench_with_stdout_closed_says_its_figures_are_not_printed(tmp_path):
    """`dflash2 bench ... >&-`: it ran, printed its figures nowhere and exited 0 without a word (a
    review). A bench's figures are its only output: one line says so, exit 1; a bad option, checked
    by argparse or in the run, is still named (exit 2), and a GPU bench without a GPU says so (a
    review of a refusal before the run, which answered "stdout is closed" to those)."""
    r = _closed_stdout("bench", "table", "--blocks", "2000", "--json")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "dflash2 bench table: stdout is closed: its figures are not printed"], r.stderr
    for bad, named in ((["table", "--blocks", "-1"], "--blocks"), (["calls", "--blocks", "100000000"], "--blocks"),
                       (["transfer"], "runs on a GPU")):
        r = _closed_stdout("bench", *bad)
        assert r.returncode == 2 and named in r.stderr and "stdout is closed" not in r.stderr, (bad, r.stderr)


def test_status_watch_tells_a_restart_across_frames_that_went_unanswered(make_manager, monkeypatch, capsys):
    """A stop and start longer than the interval leaves frames unanswered between the two daemons:
    the first frame of the new one said "(first frame)", not that the daemon had restarted."""
    from dflash2 import status_watch
    from dflash2.daemon.service import Service

    def stats_of(requests):
        svc = Service(make_manager(hbm_blocks=8), lease_timeout_s=10.0, heartbeat_interval_s=2.0)
        for _ in range(requests):
            svc.stats()
            svc.counters["requests"] += 1
        return svc.stats()

    old, new = stats_of(5), stats_of(1)
    new["daemon"]["pid"] = old["daemon"]["pid"] + 1
    answers = iter([(old, ""), (None, "no answer within 1s"), (None, "no answer within 1s"), (new, "")])
    monkeypatch.setattr(status_watch, "_ask", lambda endpoint, timeout_s, key_file=None: next(answers))
    monkeypatch.setattr(status_watch.time, "sleep", lambda s: None)
    assert status_watch.watch("ipc:///nowhere", 1.0, count=4, clear=False)
    frames = capsys.readouterr().out.split("every 1s")
    assert "(first frame)" in frames[1] and "daemon unavailable" in frames[2] and "daemon unavailable" in frames[3]
    assert "since last frame: (the daemon restarted)" in frames[4], frames[4]


@pytest.mark.parametrize("n, rows", [(54, 5), (4, 3), (3, 30), (30, 30), (31, 30)])
def test_history_prints_at_most_its_rows_the_last_sample_among_them(make_manager, n, rows):
    """`--rows N` printed N + 1 rows (every step-th sample from the first, then the last appended)."""
    from dflash2.daemon.service import Service
    from dflash2.history import sample_of
    from dflash2.history_cli import render

    stats = Service(make_manager(hbm_blocks=8), lease_timeout_s=10.0, heartbeat_interval_s=2.0).stats()
    samples = [sample_of(stats, 1000.0 + i) for i in range(n)]
    lines = render(samples, max_rows=rows).splitlines()
    body = lines[1:-1]  # the header, then the rows, then the summary line
    assert len(body) == min(n, rows), lines
    assert body[-1].startswith(time.strftime("%H:%M:%S", time.localtime(samples[-1]["t"])))


def test_status_watch_does_not_call_a_wall_clock_step_a_restart(make_manager, monkeypatch, capsys):
    """Frames were timed by the wall clock: set back an hour between two frames of the same daemon
    (same pid and start, more requests), the second said "(the daemon restarted)" (a review)."""
    from dflash2 import status_watch
    from dflash2.daemon.service import Service

    svc = Service(make_manager(hbm_blocks=8), lease_timeout_s=10.0, heartbeat_interval_s=2.0)
    first = svc.stats()
    svc.counters["requests"] += 5
    second = svc.stats()  # the same daemon one frame later: same pid and start, more requests
    answers = iter([(first, ""), (second, "")])
    monkeypatch.setattr(status_watch, "_ask", lambda endpoint, timeout_s, key_file=None: next(answers))
    monkeypatch.setattr(status_watch.time, "sleep", lambda s: None)
    clock = iter([10_000.0, 10_000.0 - 3600.0])  # the wall clock set back an hour between the frames
    monkeypatch.setattr(status_watch.time, "time", lambda: next(clock))
    assert status_watch.watch("ipc:///nowhere", 1.0, count=2, clear=False)
    second_frame = capsys.readouterr().out.split("every 1s")[2]
    assert "restarted" not in second_frame, second_frame


def _ctrl_c(*argv: str, after_s: float) -> tuple[int, str, str]:
    """`dflash2 ARGV` with SIGINT as a terminal leaves it, sent `after_s` in: (exit code, out, err)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                             "signal.default_int_handler); from dflash2 import cli; sys.exit(cli.main())", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(after_s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def test_status_watch_ends_on_ctrl_c_with_exit_0(tmp_path):
    """Ctrl-C is how the live view is left: the benches' stop handler on SIGINT made it exit 130."""
    rc, out, err = _ctrl_c("status", "--watch", "--interval", "0.2", "--timeout", "0.2",
                           "--endpoint", f"ipc://{tmp_path}/none.sock", after_s=3)
    assert "daemon unavailable" in out
    assert rc == 0, (rc, err[-500:])


def test_ctrl_c_on_a_one_shot_command_exits_130_without_a_traceback(tmp_path):
    """`dflash2 history` waiting on a daemon that does not answer, Ctrl-C: a KeyboardInterrupt
    traceback, where the benches exit 130 without one."""
    import zmq

    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # takes the call, never answers
    mute.bind(f"ipc://{tmp_path}/mute.sock")
    try:
        rc, _, err = _ctrl_c("history", "--timeout", "30", "--endpoint", f"ipc://{tmp_path}/mute.sock", after_s=2)
    finally:
        mute.close(0)
        ctx.term()
    assert rc == 130 and "Traceback" not in err, (rc, err[-1000:])


def test_ctrl_c_while_the_parser_loads_its_modules_exits_130(monkeypatch):
    """The parser loads the subcommands' modules (seconds on a busy node): a Ctrl-C then was a
    KeyboardInterrupt traceback (the test above, on a loaded machine), not the exit 130 of later."""
    from dflash2 import cli

    def loading(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", loading)
    assert cli.main(["history"]) == 130


def test_the_default_endpoint_and_its_path_written_out_keep_one_history(tmp_path, config_file, monkeypatch):
    # A review: a config whose daemon.endpoint names the default socket's path, after one that left
    # it null, was taken for another daemon: its own history kept in memory only.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir(mode=0o700)
    state = str(tmp_path / "state")
    with running_daemon(config_file(history_enabled=True, daemon={"endpoint": None, "state_dir": state}),
                        str(tmp_path / "a.log")):
        pass
    explicit = f"ipc://{tmp_path}/xdg/dflash2/dflash2.sock"
    with running_daemon(config_file(history_enabled=True, daemon={"endpoint": explicit, "state_dir": state}),
                        str(tmp_path / "b.log")):
        pass
    log = (tmp_path / "b.log").read_text()
    assert "samples read back" in log and "is the history of the daemon serving" not in log, log[-2000:]


def test_a_daemon_on_the_default_endpoint_keeps_its_history_wherever_it_starts(tmp_path, config_file, monkeypatch):
    # A review: started under one XDG_RUNTIME_DIR (WSL's /mnt/wslg/runtime-dir, a container's), then
    # under another or none (cron, a systemd unit), the daemon of the default endpoint took its own
    # history for another daemon's and kept its samples in memory only.
    state = str(tmp_path / "state")
    for i, xdg in enumerate(("xdg-one", "xdg-two")):
        (tmp_path / xdg).mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / xdg))
        with running_daemon(config_file(history_enabled=True, daemon={"endpoint": None, "state_dir": state}),
                            str(tmp_path / f"{i}.log")):
            pass
    log = (tmp_path / "1.log").read_text()
    assert "samples read back" in log and "is the history of the daemon serving" not in log, log[-2000:]


@pytest.mark.parametrize("watch", [[], ["--watch", "--count", "1"]])
def test_status_outside_the_configs_folder_says_what_to_give(tmp_path, monkeypatch, capsys, watch):
    """Run where no dflash2_config.json lies, it named the missing file and not what to give instead
    (a new user's walk through README, a review)."""
    from dflash2.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["status", *watch]) == 2
    err = capsys.readouterr().err.strip()
    assert "config file not found (give --config FILE, the daemon's config, or --endpoint E)" in err, err
