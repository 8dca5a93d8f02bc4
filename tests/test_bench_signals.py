"""A bench stopped by SIGTERM (`timeout`, a supervisor) or by a SIGINT sent to it alone cleans up as
after Ctrl-C: its daemon stopped, its temporary folder (the NVMe file in it) and shared memory gone
(a review of 2026-12-04: a SIGTERM left the daemon running, 288 MiB of /dev/shm and a 512 MiB NVMe
file; a SIGINT during the daemon's start-up left the NVMe file, which the daemon recreated)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


def _daemons_under(folder: Path) -> list[int]:
    """Pids of processes whose command line names `folder` (the bench's daemon: its config is there)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmd and "dflash2.daemon.main" in cmd:
            found.append(int(pid))
    return found


def _client_processes(bench_pid: int) -> list[int]:
    """Pids of the client processes a bench spawned (multiprocessing's `spawn_main` children), once
    there are any (a minute at most)."""
    deadline, clients = time.monotonic() + 60, []
    while not clients and time.monotonic() < deadline:
        time.sleep(0.1)
        out = subprocess.run(["ps", "-ww", "--ppid", str(bench_pid), "-o", "pid=,args="], capture_output=True,
                             text=True).stdout
        clients = [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]
    assert clients, "the bench started no client process"
    return clients


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "serving"), (signal.SIGINT, "starting")])
def test_a_bench_stopped_by_a_signal_to_it_alone_leaves_nothing(tmp_path, sig, when):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # (SIGINT as a terminal leaves it: a test run in the background, `pytest &` or `nohup`, hands its
    # children SIGINT ignored, which Python keeps: the signal was then rightly nothing to the bench)
    bench = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                              "signal.default_int_handler); from dflash2.cli import main; sys.exit(main())",
                              "bench", "churn", "--clients", "1", "--warmup", "60", "--seconds", "60", "--json"],
                             env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            folders = list(tmp_path.glob("dflash2-bench-*"))
            if folders and (when == "starting" or (folders[0] / "d.sock").exists()):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the bench never started its daemon")
        if when == "serving":
            time.sleep(1.0)
        bench.send_signal(sig)
        bench.wait(60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    deadline = time.monotonic() + 10
    while _daemons_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _daemons_under(tmp_path), "the bench's daemon still runs"
    assert not list(tmp_path.glob("dflash2-bench-*")), [str(p) for p in tmp_path.rglob("*")]
    assert bench.returncode == 128 + sig, (bench.returncode, bench.stderr.read()[-2000:])  # (Ctrl-C: no traceback)


def test_a_hang_up_the_command_was_started_to_ignore_stays_ignored(tmp_path):
    """`nohup dflash2 bench ... &` and a logout: SIGHUP ended the run once SIGHUP meant a clean exit
    (a review); one the process inherited as ignored stays ignored."""
    script = ("import signal, sys, threading; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
              "import os\n"
              "threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGHUP)).start()\n"
              "from dflash2.cli import main\n"
              "sys.exit(main(['status', '--endpoint', 'ipc://%s/none.sock', '--watch', '--count', '4', "
              "'--interval', '0.5']))" % tmp_path)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done  # (four frames, none answered: as without the hang-up; 129 before)
    assert done.stdout.count("daemon unavailable") == 4, done.stdout


CLOSE_SIGNALLED = textwrap.dedent("""
    import os, signal, sys
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2 import cli

    made = []
    orig_create, orig_close = SharedMemoryArena.create.__func__, SharedMemoryArena.close

    def create(cls, name, *a, **kw):
        made.append(name)
        print("SEGMENT", name, flush=True)
        return orig_create(cls, name, *a, **kw)

    def close(self):
        if self.name.endswith("-hbm") and self._mm is not None:
            os.kill(os.getpid(), signal.SIGTERM)  # `timeout`/a supervisor stops the bench now
        return orig_close(self)

    SharedMemoryArena.create = classmethod(create)
    SharedMemoryArena.close = close
    sys.exit(cli.main(["bench", "swap", "--device", "host", "--sizes-kib", "64", "--mb", "4", "--repeat", "1"]))
""")


def test_a_sigterm_as_the_bench_closes_its_arenas_waits_for_them():
    """Sent from inside the HBM arena's close, where a real SIGTERM lands about one time in six
    (unmapping a large segment takes a while): SystemExit there left the DRAM segment, 800 MB of it,
    in /dev/shm (a review). The signal waits for the clean-up (stopsignals.py)."""
    proc = subprocess.run([sys.executable, "-c", CLOSE_SIGNALLED], capture_output=True, text=True, timeout=120)
    names = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("SEGMENT ")]
    left = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    for n in left:  # clean up after the repro itself
        os.unlink(f"/dev/shm/{n}")
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])
    assert names, proc.stdout
    assert not left, f"segments left in /dev/shm after SIGTERM: {left}"


def test_sigterm_during_the_echo_servers_stop_still_stops_the_daemon(monkeypatch):
    """The control bench stops two children in one clean-up: a SIGTERM held while the first stopped
    was raised at the end of its stop, and the daemon, stopped second, ran on (a review). The whole
    clean-up waits."""
    import argparse

    from dflash2 import stopsignals
    from dflash2.bench import control

    started = []
    real_start_daemon = control._start_daemon

    def start_daemon(folder, endpoint):
        started.append(real_start_daemon(folder, endpoint))
        return started[-1]

    monkeypatch.setattr(control, "_start_daemon", start_daemon)
    monkeypatch.setattr(control, "_measure", lambda *a: {})
    real_terminate = subprocess.Popen.terminate
    sent = []

    def terminate(self):
        if not sent:  # the first child stopped (the echo server): a `timeout`'s SIGTERM lands now
            sent.append(self.pid)
            os.kill(os.getpid(), signal.SIGTERM)
        real_terminate(self)

    monkeypatch.setattr(subprocess.Popen, "terminate", terminate)
    saved = stopsignals.install()
    try:
        with pytest.raises(SystemExit) as exc:
            control.run(argparse.Namespace())
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        monkeypatch.undo()
    assert exc.value.code == 128 + signal.SIGTERM
    daemon = started[0]
    alive = daemon.poll() is None
    if alive:
        daemon.terminate()
        daemon.wait(10)
    assert not alive, "the bench's daemon was left running after the SIGTERM"


def test_a_churn_client_killed_mid_run_ends_the_bench_with_an_error_naming_it(tmp_path):
    """A review: the bench's client process SIGKILLed (the OOM killer, by hand) left `bench churn`
    waiting for ever, and a SIGTERM then sometimes hung too; now it ends, exit 1, naming the client,
    no figures, its daemon and folder gone."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-m", "dflash2.cli", "bench", "churn", "--json", "--clients", "2",
                              "--warmup", "60", "--seconds", "60", "--hbm-mb", "4", "--dram-mb", "4", "--nvme-mb", "0",
                              "--docs", "100"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = _client_processes(bench.pid)
        os.kill(workers[0], signal.SIGKILL)
        # At once, in the warm-up: it was named only after the warm-up and the window had been
        # slept through (two minutes here).
        out, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:  # (failed: stopped as a user would, so that its daemon goes too)
            bench.terminate()
            try:
                bench.wait(30)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
            for pid in _daemons_under(tmp_path):
                os.kill(pid, signal.SIGTERM)
    assert bench.returncode == 1 and out == "", (bench.returncode, out, err[-2000:])
    assert "dflash2: error: bench churn: client process" in err and "killed by SIGKILL" in err, err[-2000:]
    assert "Traceback" not in err.split("dflash2: error:")[-1]
    assert not _daemons_under(tmp_path) and not list(tmp_path.glob("dflash2-bench-*"))


def test_a_bench_whose_daemon_is_killed_mid_run_says_so_and_leaves_no_shared_memory(tmp_path):
    """A review: the bench's own daemon SIGKILLed (the OOM killer) ended `bench calls` (and drain,
    control, churn) in a DaemonUnavailable traceback and left the daemon's segments in /dev/shm (GBs
    for drain's tiers): now one error line, exit 1, no figures, the segments removed and said."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-m", "dflash2.cli", "bench", "calls", "--blocks", "256", "--rounds",
                              "100", "--hbm-chains", "2", "--dram-chains", "4", "--device", "host",
                              "--block-kib", "64", "--json"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, daemons = time.monotonic() + 60, []
        while not (daemons and list(tmp_path.glob("dflash2-bench-*/d.sock"))) and time.monotonic() < deadline:
            time.sleep(0.1)
            daemons = _daemons_under(tmp_path)
        assert daemons, "the bench started no daemon"
        time.sleep(1.0)  # (mid-run: its socket is bound)
        os.kill(daemons[0], signal.SIGKILL)
        out, err = bench.communicate(timeout=90)
    finally:
        if bench.poll() is None:
            bench.terminate()
            bench.wait(30)
    assert bench.returncode == 1 and out == "" and "Traceback" not in err, (bench.returncode, out, err[-2000:])
    assert "dflash2: error: bench calls: its daemon stopped answering, no figures" in err, err[-2000:]
    assert f"its daemon (pid {daemons[0]}): it had ended before the bench stopped it (killed by SIGKILL); the " \
           "bench removed the shared memory it left (3 segments" in err, err[-2000:]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dflash2-{daemons[0]}-")]
    assert not list(tmp_path.glob("dflash2-bench-*"))


@pytest.mark.parametrize("sig, how", [(signal.SIGKILL, "ended mid-run (killed by SIGKILL)"),
                                      (signal.SIGSTOP, "did not answer within 1 s and was stopped")],
                         ids=["SIGKILL", "SIGSTOP"])
def test_a_control_bench_whose_echo_server_is_killed_says_one_line(tmp_path, sig, how):
    """A review: the control bench's echo server (its helper process) SIGKILLed mid-run ended the bench
    in a TimeoutError traceback ("echo server did not answer"): now one error line naming its pid and
    signal, exit 1, no figures, the daemon stopped and the folder removed. One stopped (SIGSTOP: alive,
    silent) is killed at once (a later review: _stop's SIGTERM, never acted on, cost 10 s and a second
    line before the error's)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-c", "import sys; from dflash2.bench import control; "
                              "control.ECHO_TIMEOUT_S = 1.0; from dflash2.cli import main; sys.exit(main())",
                              "bench", "control", "--iterations", "3000", "--json"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        echo, deadline = None, time.monotonic() + 60
        while echo is None and time.monotonic() < deadline:
            time.sleep(0.1)
            out = subprocess.run(["ps", "-ww", "--ppid", str(bench.pid), "-o", "pid=,args="], capture_output=True,
                                 text=True).stdout
            echo = next((int(line.split()[0]) for line in out.splitlines() if "echo_server" in line), None)
        assert echo is not None, "the bench started no echo server"
        # Mid-run: its socket bound (it prints "ready" next), then a second for the rounds to begin. (Killed
        # a second after it was seen, under a loaded CI run it had not yet said it was ready: "ended as it
        # started", another line.)
        while not list(tmp_path.glob("dflash2-bench-*/echo.sock")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(echo, sig)
        out, err = bench.communicate(timeout=90)
    finally:
        if bench.poll() is None:
            bench.terminate()
            bench.wait(30)
    assert bench.returncode == 1 and out == "" and "Traceback" not in err, (bench.returncode, out, err[-2000:])
    assert err.splitlines() == [f"dflash2: error: bench control: its helper process (the echo server, pid {echo}) "
                                f"{how}; no figures"], err[-2000:]
    assert not _daemons_under(tmp_path) and not list(tmp_path.glob("dflash2-bench-*"))


@pytest.mark.parametrize("bench", ["control", "churn"])
def test_ctrl_c_at_a_terminal_stops_the_bench_and_its_children_quietly(tmp_path, bench):
    """A terminal's Ctrl-C sends SIGINT to the whole process group: the bench's daemon and echo server
    got it too, died or stopped by themselves, and the bench then said each had ended before it stopped
    it (a review). Its children have sessions of their own: the bench stops them, and says nothing."""
    args = {"control": ["--iterations", "200", "--batch-iterations", "20", "--seconds", "3", "--processes", "2"],
            "churn": ["--clients", "2", "--warmup", "1", "--seconds", "3", "--hbm-mb", "4", "--dram-mb", "4",
                      "--nvme-mb", "0", "--docs", "100"]}[bench]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                             "signal.default_int_handler); from dflash2.cli import main; sys.exit(main())",
                             "bench", bench, "--json", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _client_processes(proc.pid)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # (as a terminal's Ctrl-C: the bench's whole group)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    assert proc.returncode == 128 + signal.SIGINT and out == "", (proc.returncode, out, err[-2000:])
    assert err == "", err[-2000:]
    deadline = time.monotonic() + 10
    while _daemons_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _daemons_under(tmp_path) and not list(tmp_path.glob("dflash2-bench-*"))
