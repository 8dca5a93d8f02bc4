"""The daemon's life under an operator's hands: signals that used to kill it without its clean-up, a
low open-files limit that let libzmq abort it, and a history file that stopped after one failed write."""

from __future__ import annotations

import glob
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest
import zmq
from daemon_proc import DaemonProcess

from dflash2 import protocol as P
from dflash2.client import Transport


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


def _ping(endpoint: str) -> dict:
    t = Transport(endpoint, timeout_s=5.0)
    try:
        return t.call(P.Op.PING).result
    finally:
        t.close()


def test_sigusr_is_ignored_and_sighup_stops_cleanly(daemon):
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        os.kill(daemon.pid, sig)
    assert _ping(daemon.endpoint)["pid"] == daemon.pid  # still serving
    os.kill(daemon.pid, signal.SIGHUP)
    assert daemon.proc.wait(timeout=15) == 0
    assert not daemon.socket_path.exists()
    assert not glob.glob(f"/dev/shm/dflash2-{daemon.pid}-*"), "every segment given back"
    log = daemon.log()
    assert "SIGUSR1 ignored" in log and "SIGUSR2 ignored" in log
    assert "shut down (stopped by SIGHUP): released 0 clients" in log  # (the line named no signal, a review)


def test_a_low_open_files_limit_is_raised_so_many_connections_do_not_abort_it(config_file, tmp_path):
    """Each client holds two connections; libzmq aborts the process when an ipc accept finds no
    descriptor left. Started with a soft limit of 128 (the hard one higher), the daemon raises it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard limit here is {hard}")
    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})
    log_path = tmp_path / "d.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", path], stdout=subprocess.PIPE,
                                stderr=log, text=True, cwd=tmp_path,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard)))
    ctx = zmq.Context()
    socks = []
    try:
        assert proc.stdout.readline().startswith("DFlash2: enabled"), log_path.read_text()
        endpoint = f"ipc://{tmp_path}/d.sock"
        for i in range(300):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send_multipart(P.encode_request(P.Op.PING, i + 1, None))
            socks.append(s)
        for s in socks:
            assert s.poll(10_000), "every connection answered"
            s.recv_multipart()
        assert proc.poll() is None, log_path.read_text()
        assert _ping(endpoint)["pid"] == proc.pid
        assert "open files limit raised from 128" in log_path.read_text()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)


def test_a_low_hard_limit_is_warned_about():
    """With the clients that fit as the daemon's own descriptors leave them (the count left them
    out: "about 33" where 22 fit, a review)."""
    code = ("import logging, os, resource; logging.basicConfig(level=logging.INFO); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)); "
            "from dflash2.daemon.descriptors import raise_open_files_limit, warn_if_few; print(raise_open_files_limit()); "
            "held = [os.open('/dev/null', os.O_RDONLY) for _ in range(20)]; "  # as tiers, sockets and locks
            "print(200 - len(os.listdir('/proc/self/fd'))); warn_if_few()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    limit, left = out.stdout.split()
    assert limit == "200" and int(left) < 200 - 20
    said = re.search(r"open files limit is 200 \(hard limit 200\): about (\d+) clients can attach", out.stderr)
    assert said and abs(int(said[1]) - (int(left) - 64) // 2) <= 1, out.stderr  # (listing /proc/self/fd takes one)


def test_clients_past_the_open_files_limit_are_refused_and_the_daemon_serves_on(config_file, tmp_path):
    """A daemon held to 160 descriptors (soft and hard: it cannot raise them): attaches are refused
    (TooManyClients, named) while fewer than ATTACH_HEADROOM are left, and the daemon serves on, its
    clients too; one detached makes room for another. Before, the 117th client of a daemon held to
    256 ended it: libzmq aborted in an ipc accept that found no descriptor left (exit 134)."""
    from dflash2.client import Client, DaemonError
    from dflash2.daemon.descriptors import ATTACH_HEADROOM

    from conftest import SMALL

    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})
    log_path = tmp_path / "d.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", path], stdout=subprocess.PIPE,
                                stderr=log, text=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160)))
    endpoint = f"ipc://{tmp_path}/d.sock"
    clients = []
    try:
        assert proc.stdout.readline().startswith("DFlash2: enabled"), log_path.read_text()
        refused = None
        for i in range(160):  # more than could ever fit
            try:
                clients.append(Client.connect(endpoint, name=f"c{i}", layouts=[SMALL], timeout_s=10.0))
            except DaemonError as e:
                refused = e
                break
        assert refused is not None and refused.kind == "TooManyClients", refused
        said = re.search(r"about (\d+) clients can attach", log_path.read_text())
        assert said and abs(int(said[1]) - len(clients)) <= 1, (said and said[0], len(clients))
        assert f"keeps {ATTACH_HEADROOM} free" in str(refused) and "ulimit -n" in str(refused)
        assert 10 <= len(clients) < (160 - ATTACH_HEADROOM) // 2 + 1, len(clients)
        assert proc.poll() is None and _ping(endpoint)["pid"] == proc.pid
        for c in clients:
            assert c.ping()["pid"] == proc.pid  # every attached client still served
        for _ in range(2):  # (their connections are closed on the daemon's side as libzmq sees them go)
            clients.pop().close()
        for _ in range(100):
            try:
                clients.append(Client.connect(endpoint, name="again", layouts=[SMALL], timeout_s=10.0))
                break
            except DaemonError:
                time.sleep(0.05)
        assert clients[-1].name == "again"
        assert "attach of c" in log_path.read_text() and "refused" in log_path.read_text()
    finally:
        for c in clients:
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log_path.read_text()


def test_history_catches_up_after_a_failed_write(tmp_path):
    """A full disk for a while (the file's size limit, RLIMIT_FSIZE, in a process of its own: the
    write of an append fails part way, as on a disk that fills up): the samples wait in memory and
    reach the file once there is room, each once, in order, with no torn line between; the failure
    is logged once, the recovery once. Before, the lines that a failed append had written whole were
    appended again with the rest once there was room: samples twice, time going back."""
    path = tmp_path / "history.jsonl"
    code = f"""
import json, logging, resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from dflash2.history import History, _line
now = [1000.0]
h = History(interval_s=1.0, path=Path({str(path)!r}), clock=lambda: now[0])
stats = {{"tiers": {{}}, "reads": {{}}, "moves": {{}}, "hbm_hit_ratio": None,
         "reservations": {{"granted": 0, "deferred": 0, "reserved_blocks": 0}}}}
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
for i in range(7):
    if i == 2:  # room for one more sample and half of the next
        size = h.path.stat().st_size
        line = len(_line(h.since()[-1]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + line + line // 2, hard))
    if i == 6:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    now[0] += 1.0
    h.record(stats)
"""
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).parent.parent))
    assert out.returncode == 0, out.stderr
    lines = path.read_text().splitlines()
    samples = [json.loads(line) for line in lines if line.strip()]
    assert [s["t"] for s in samples] == [1001.0 + i for i in range(7)], [s["t"] for s in samples]
    assert out.stderr.count("cannot write") == 1, out.stderr
    assert "written again (4 samples that had waited)" in out.stderr, out.stderr


def test_in_json_format_every_line_the_daemon_writes_is_a_json_record(config_file, tmp_path):
    """The journal takes stdout and stderr together, and README's `journalctl -u dflash2d -o cat |
    jq ...` stops at the first line that is not JSON: the start-up line and the warnings printed
    before logging is set up were plain text."""
    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"}, logging={"format": "json", "level": "info"})
    env = {**os.environ, "DFLASH_DRAM_LIMIT": "4G"}  # a first-generation variable: warned about, ignored
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", path], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "DFlash2: enabled" in line:
                break
        assert _ping(f"ipc://{tmp_path}/d.sock")["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        # (Read through the file object: communicate with a timeout reads the pipe itself, and lost
        # what the loop above had read ahead into its buffer: dflash2_start, once in a full-suite run.)
        out = proc.stdout.read()
    lines += out.splitlines()
    records = [json.loads(line) for line in lines if line.strip()]  # each line one JSON object
    events = {r["event"]: r for r in records}
    assert events["dflash2_enabled"]["msg"].startswith("DFlash2: enabled, total virtual cache size")
    assert "DFLASH_DRAM_LIMIT" in events["dflash2_warning"]["msg"] and events["dflash2_warning"]["level"] == "warning"
    assert {"dflash2_start", "dflash2_shutdown"} <= set(events) and proc.returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_while_the_config_is_read_stops_it_cleanly(config_file, tmp_path, monkeypatch, capsys, sig):
    """README: it stops cleanly on SIGTERM, Ctrl-C or SIGHUP "during start-up too". Before the
    server's own start-up handlers, while the config was read and the GPUs probed (about a second
    with device auto), SIGINT raised a traceback (exit 130) and SIGHUP killed it (exit 129)."""
    from dflash2.daemon import main as daemon_main

    real = daemon_main.resolve_plan

    def plan_then_signal(cfg):
        os.kill(os.getpid(), sig)  # as if sent while the GPUs are probed
        return real(cfg)

    monkeypatch.setattr(daemon_main, "resolve_plan", plan_then_signal)
    before = signal.getsignal(signal.SIGINT)
    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"}, logging={"format": "text", "level": "info"})
    assert daemon_main.main(["--config", path]) == 0
    assert f"dflash2d: stopped by {sig.name} during start-up" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handlers are back
    assert not glob.glob(f"/dev/shm/dflash2-{os.getpid()}-*")


@pytest.mark.parametrize("stdout", ["/dev/full", "a pipe whose reader left", "closed"])
def test_a_stdout_that_takes_nothing_does_not_stop_a_started_daemon(config_file, tmp_path, stdout):
    """A review: with stdout on /dev/full the daemon took its tiers, then died in a traceback at its
    start-up line (exit 1); under `dflash2d | head -1` (a journald restarted) it died saying nothing.
    It serves on, and its log says the line could not be written."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    cfg = config_file(daemon={"endpoint": endpoint})
    if stdout == "/dev/full":
        out = open("/dev/full", "w")
    elif stdout == "closed":
        out = open(os.devnull, "w")  # (unused: the child closes its fd 1 below)
    else:
        r, w = os.pipe()
        os.close(r)
        out = os.fdopen(w, "w")
    with out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", cfg], stdout=out, stderr=err,
                                preexec_fn=(lambda: os.close(1)) if stdout == "closed" else None)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if "the start-up line could not be written to stdout" in (tmp_path / "err").read_text():
                break
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / "err").read_text()[-2000:]
        assert _ping(endpoint)["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    text = (tmp_path / "err").read_text()
    assert rc == 0 and "Traceback" not in text and "DFlash2: enabled" in text, text[-2000:]


def test_a_hang_up_the_daemon_was_started_to_ignore_stays_ignored(config_file, tmp_path):
    """`nohup dflash2d ... &` and a logout: the daemon took SIGHUP over from nohup's SIG_IGN and
    stopped at the hang-up nohup was there for, while starting and while serving (a review)."""
    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"}, logging={"format": "text", "level": "info"})
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from dflash2.daemon.launch import main; "
                             "sys.exit(main())", "--config", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGHUP)  # while it starts
        assert proc.stdout.readline().startswith("DFlash2: enabled"), proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGHUP)  # while it serves
        time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()
        assert _ping(f"ipc://{tmp_path}/d.sock")["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
