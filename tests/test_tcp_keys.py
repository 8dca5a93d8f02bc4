"""A tcp endpoint's access control (dflash2/tcpkeys.py): the daemon makes an owner-only key file and
speaks CURVE; only a client that reads the file attaches. Before, any local user (any host, for an
address of every interface) could attach and commit blocks under any key."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from conftest import write_config

from dflash2 import protocol as P
from dflash2.client import Client
from dflash2.errors import AccessDenied, DaemonUnavailable
from dflash2.layout import Layout
from dflash2.tcpkeys import DaemonKeys, KeyFileError, MonitorKeys, TcpKeys, load, load_or_make

LAYOUT = Layout("t", 2, 2, 8, "fp16", 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tcp_daemon(tmp_path: Path, runtime: Path, **daemon):
    port = free_port()
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{port}", "state_dir": str(tmp_path / "s"),
                                            **daemon})
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config], stdout=subprocess.PIPE,
                            stderr=log, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("DFlash2: enabled"), (line, (tmp_path / "daemon.log").read_text())
        yield config, port
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        log.close()


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "run"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))  # the clients in this process look there too
    return folder


def test_a_tcp_daemon_makes_an_owner_only_key_file_and_a_client_that_reads_it_attaches(tmp_path, runtime):
    with tcp_daemon(tmp_path, runtime) as (config, port):
        key_file = runtime / "dflash2" / f"tcp-{port}.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        keys = load(key_file)
        with Client.connect(config=config, name="reader", layouts=[LAYOUT]) as c:
            assert c.key_file == key_file
            placed = c.allocate(c.layouts[0], 1)
            assert len(placed) == 1
        # An endpoint given alone finds the same file by its port (`dflash2 status --endpoint ...`).
        with Client.connect(f"tcp://127.0.0.1:{port}", name="by-endpoint") as c:
            assert c.key_file == key_file
        out = subprocess.run([sys.executable, "-m", "dflash2.cli", "status", "--config", config, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    # A restart keeps the file, and so the keys clients read.
    with tcp_daemon(tmp_path, runtime) as (config, port2):
        if port2 == port:
            assert load(key_file) == keys


def test_a_client_without_the_daemons_key_is_refused_at_once_by_name(tmp_path, runtime):
    """A client holding another daemon's key file fails the handshake; one that knows the server's
    key but holds another client key is refused by the daemon's gate, which logs it. Each call says
    so well before its timeout (it would wait out the whole timeout, blaming the daemon)."""
    other = tmp_path / "other.key"
    other.write_text(TcpKeys.fresh().text())
    with tcp_daemon(tmp_path, runtime) as (config, port):
        started = time.monotonic()
        with pytest.raises(AccessDenied, match=f"dflash2d at tcp://127.0.0.1:{port} did not accept this client's "
                                               f"handshake: the key file holds another daemon's key .* \\(key file {other}"):
            Client(f"tcp://127.0.0.1:{port}", "intruder", timeout_s=20, key_file=other)
        assert time.monotonic() - started < 10
        ours, fresh = load(runtime / "dflash2" / f"tcp-{port}.key"), TcpKeys.fresh()
        forged = tmp_path / "forged.key"
        forged.write_text(TcpKeys(ours.server_public, ours.server_secret, fresh.client_public, fresh.client_secret).text())
        started = time.monotonic()
        with pytest.raises(AccessDenied, match="refused this client's key"):
            Client(f"tcp://127.0.0.1:{port}", "intruder", timeout_s=20, key_file=forged)
        assert time.monotonic() - started < 10
        # A client with none at all: no such file, said before anything is sent.
        with pytest.raises(AccessDenied, match="no key file at .*nope.key"):
            Client(f"tcp://127.0.0.1:{port}", "intruder", key_file=tmp_path / "nope.key")
        # A plain ZeroMQ peer (no CURVE) sending a well-formed attach gets nothing back.
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(P.encode_request(P.Op.ATTACH, 1, None, {"name": "x", "pid": os.getpid(), "layouts": []}))
            assert not sock.poll(1500), "a client without the key got an answer"
            sock.close(0)
        finally:
            ctx.term()
    log = (tmp_path / "daemon.log").read_text()
    assert "refused 1 tcp connection since the last such line; the last whose handshake failed" in log, log
    # The refusals within the minute after that line are not lost: the gate logs them as it closes.
    later = re.findall(r"refused (\d+) tcp connections? since the last such line", log)
    assert len(later) == 2 and int(later[1]) >= 2, log


def test_a_client_of_a_daemon_without_curve_is_told_so(tmp_path, runtime):
    """A dflash2d from before tcp keys (or another program) on the port: the handshake fails, and the
    client says the daemon does not speak CURVE instead of timing out."""
    port = free_port()
    key_file = tmp_path / "k.key"
    key_file.write_text(TcpKeys.fresh().text())
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(AccessDenied, match="does not speak CURVE"):
            Client(f"tcp://127.0.0.1:{port}", "c", timeout_s=20, key_file=key_file)
    finally:
        server.close(0)
        ctx.term()


@pytest.mark.parametrize("case, message", [
    ("world-readable", "is open to other users (mode 644)"),
    ("another user's", "belongs to uid 4321, not to the daemon's user"),
    ("a link", "is a symbolic link"),
    ("cut short", "lacks client_public, client_secret"),
    ("garbage", "line 1: expected one of server_public"),
])
def test_the_daemon_refuses_a_key_file_that_does_not_guard_the_endpoint(tmp_path, case, message):
    path = tmp_path / "k.key"
    text = TcpKeys.fresh().text()
    if case == "a link":
        (tmp_path / "target").write_text(text)
        path.symlink_to(tmp_path / "target")
    else:
        body = {"cut short": "\n".join(text.splitlines()[:4]), "garbage": "hello there\n"}.get(case, text)
        path.write_text(body)
        path.chmod(0o644 if case == "world-readable" else 0o600)
        if case == "another user's":
            if os.geteuid() != 0:
                pytest.skip("needs root to give the file to another user")
            os.chown(path, 4321, -1)
    with pytest.raises(KeyFileError, match=re.escape(message)):
        load_or_make(path)


def test_a_key_file_named_by_a_relative_path_that_is_a_link_is_refused_too(tmp_path):
    """The link was followed as the relative path was resolved: --check passed, and the daemon used
    the target and made the monitoring file beside it, where the same link written absolute is
    refused (a review). Its folder is resolved, its own name kept."""
    from dflash2.config import load_config

    keys = tmp_path / "keys"
    keys.mkdir()
    load_or_make(keys / "real.key")
    (keys / "node.key").symlink_to("real.key")
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                            "state_dir": str(tmp_path / "s"), "tcp_key_file": "keys/node.key"})
    assert load_config(config).resolved_tcp_key_file() == keys.resolve() / "node.key"
    out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config, "--check"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    assert out.returncode == 2 and "is a symbolic link" in out.stderr, (out.returncode, out.stderr[-300:])


@pytest.mark.parametrize("case", ["open to others", "a folder"])
def test_check_and_start_up_refuse_a_bad_key_file_by_its_key_before_taking_tiers(tmp_path, case):
    """--check passed a key file start-up then refused (exit 4, a line naming neither the key nor
    the config): a folder at its path, a file other users may read (a review). Both refuse it now,
    exit 2, naming daemon.tcp_key_file."""
    key_file = tmp_path / "keys" / "k.key"
    key_file.parent.mkdir()
    if case == "a folder":
        key_file.mkdir()
        message = f"daemon.tcp_key_file: {key_file} is not a regular file"
    else:
        key_file.write_text(TcpKeys.fresh().text())
        key_file.chmod(0o604)
        message = f"daemon.tcp_key_file: the key file {key_file} is open to other users (mode 604)"
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{free_port()}", "state_dir": str(tmp_path / "s"),
                                            "tcp_key_file": str(key_file)},
                          memory={"dram_capacity_mb": 1 << 26, "nvme_capacity_mb": 0})  # past memory: never reached
    for check in (["--check"], []):
        out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config, *check],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
        assert out.returncode == 2, (check, out.stderr)
        assert message in out.stderr, out.stderr
        assert "dram tier" not in out.stderr


def test_a_configured_key_file_is_made_there_and_read_by_clients_of_the_config(tmp_path, runtime):
    key_file = tmp_path / "shared" / "node.key"
    with tcp_daemon(tmp_path, runtime, tcp_key_file=str(key_file)) as (config, port):
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert not (runtime / "dflash2" / f"tcp-{port}.key").exists()
        with Client.connect(config=config, name="c") as c:
            assert c.key_file == key_file
        out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config, "--check", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert f'"tcp_key_file": "{key_file}"' in out.stdout


def test_a_connection_that_never_speaks_is_dropped_within_seconds(tmp_path, runtime):
    """libzmq's default let an idle connection hold a daemon descriptor for 30 s: 1,000 of them from a
    user without the key took a daemon's 1,024 and every new attach timed out (a review)."""
    with tcp_daemon(tmp_path, runtime) as (config, port):
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle.settimeout(8)
            started = time.monotonic()
            try:
                while idle.recv(4096):  # (the daemon's greeting, then the close)
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < 8


def test_a_tcp_client_needs_room_for_its_handshake_monitors(monkeypatch):
    """Each tcp socket has a handshake monitor (two descriptors more): a client left with the 16 an
    ipc one needs attached, and its heartbeat's socket then could not connect (its lease lapsed)."""
    from dflash2.client import transport

    monkeypatch.setattr(transport, "descriptors_left", lambda: (18, 1024))
    transport.check_descriptors("ipc:///run/x.sock")
    with pytest.raises(transport.DaemonUnavailable, match="connecting needs 20"):
        transport.check_descriptors("tcp://127.0.0.1:5999")


def test_history_says_a_refusal_is_not_a_daemon_that_does_not_run(tmp_path, runtime):
    from dflash2.history_cli import DaemonNotAnswering, fetch

    with pytest.raises(DaemonNotAnswering) as e:
        fetch("tcp://127.0.0.1:5999", None, 1.0, key_file=tmp_path / "nope.key")
    assert "no key file at" in str(e.value) and "is dflash2d running" not in str(e.value)
    with pytest.raises(AccessDenied, match="looks in its own runtime folder"):
        Client("tcp://127.0.0.1:5999", "c", timeout_s=1)  # (no key file named: the default is looked for)


def test_a_tcp_daemons_gate_threads_leave_the_stop_signals_to_the_main_thread(tmp_path, runtime):
    """The key gate's threads (pyzmq's ZAP authenticator, the handshake watcher) took SIGTERM like
    any thread that does not block it, and a main thread in a system call then never saw it
    (dflash2/threads.py's invariant)."""
    from mask_helpers import other_threads, taking_stop_signals

    port = free_port()
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{port}", "state_dir": str(tmp_path / "s")})
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    try:
        assert proc.stdout.readline().startswith("DFlash2: enabled")
        with Client.connect(config=config, name="c", layouts=[LAYOUT]):
            others = other_threads(proc.pid)
            assert len(others) >= 4, others  # (the transfer thread, ZeroMQ's two, the gate's two)
            assert taking_stop_signals(proc.pid, others) == []
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_refusals_after_a_logged_line_are_logged_once_the_minute_has_passed(monkeypatch, caplog):
    """A burst of refusals, then quiet: the ones after the burst's first line are logged when the
    minute (here 0.3 s) has passed, not only at a next refusal that may never come."""
    from dflash2.daemon import keygate

    monkeypatch.setattr(keygate, "REFUSALS_LOGGED_EVERY_S", 0.3)
    ctx = zmq.Context()
    keys = TcpKeys.fresh()
    gate = keygate.KeyGate(ctx, DaemonKeys(keys, MonitorKeys.fresh(keys.server_public)), "k.key")
    sock = ctx.socket(zmq.ROUTER)
    try:
        gate.secure(sock)
        gate.secure(ctx.socket(zmq.ROUTER), monitoring=True)  # (the gate's watcher starts with the second; it closes it)
        with caplog.at_level("WARNING", logger="dflash2.daemon"):
            for _ in range(3):
                assert not gate.callback("*", b"not the key")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and len(caplog.records) < 2:
                time.sleep(0.05)
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0].startswith("refused 1 tcp connection since the last such line"), lines
        assert lines[1].startswith("refused 2 tcp connections since the last such line; the last whose client "
                                   "key is not the one in the key file (k.key)"), lines
    finally:
        gate.close()
        sock.close(0)
        ctx.term()


def _start_logged(tmp_path, config: str, runtime, log_name: str):
    """A daemon of `config` started with its stderr in tmp_path/`log_name`: (its process, the open log)."""
    log = open(tmp_path / log_name, "w")
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    line = proc.stdout.readline()
    assert line.startswith("DFlash2: enabled"), (line, (tmp_path / log_name).read_text())
    return proc, log


def _clients_of_an_ended_daemon(tmp_path, runtime):
    """A tcp daemon that two clients attached to, stopped: one with a heartbeat, which has found the end
    by the time this returns, and one without. Returns (config, port, that one, the quiet one)."""
    port = free_port()
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{port}", "state_dir": str(tmp_path / "s"),
                                            "heartbeat_interval_s": 0.2})
    proc, log = _start_logged(tmp_path, config, runtime, "first.log")
    beating = Client.connect(config=config, name="beating", layouts=[LAYOUT])
    quiet = Client.connect(config=config, name="quiet", layouts=[LAYOUT], heartbeat=False)
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    log.close()
    deadline = time.monotonic() + 10
    while not beating._ended and time.monotonic() < deadline:  # (its heartbeat finds it)
        time.sleep(0.05)
    assert beating._ended
    return config, port, beating, quiet


def _restarted_with_new_keys(tmp_path, config: str, runtime, port: int):
    """The key file removed (revoked: the next start makes new keys), the daemon started again."""
    (runtime / "dflash2" / f"tcp-{port}.key").unlink()
    return _start_logged(tmp_path, config, runtime, "second.log")


def _stop_restarted(proc, log, *clients) -> None:
    """The restarted daemon stopped (exit 0) where it was started, its log closed; the clients closed."""
    if proc is not None:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        log.close()
    for client in clients:
        client.close()


def test_a_client_whose_daemon_ended_lets_its_socket_go(tmp_path, runtime):
    """A client that found its daemon ended (by its heartbeat, or by a call) closes its socket: ZeroMQ
    reconnected it to the next daemon on the endpoint without end, and where that daemon's key file
    was made again (removed to revoke its readers) each try failed its handshake, about six a second
    for as long as the idle client lived, every one counted in the new daemon's refusals (a review)."""
    config, port, beating, calling = _clients_of_an_ended_daemon(tmp_path, runtime)
    proc = log = None
    try:
        with pytest.raises(DaemonUnavailable, match="ended while this call waited"):
            calling.ping()  # (this call finds it)
        assert calling._ended
        proc, log = _restarted_with_new_keys(tmp_path, config, runtime, port)
        time.sleep(2)
    finally:
        _stop_restarted(proc, log, beating, calling)
    second = (tmp_path / "second.log").read_text()
    assert "refused" not in second, second


def test_a_call_of_a_client_whose_daemon_ended_is_refused_at_once(tmp_path, runtime):
    """A client that knows its daemon ended (its heartbeat found it) refuses its calls before sending:
    sent, each made a fresh socket to the next daemon on the endpoint, whose handshake failed where
    that daemon's key file was made again (one more of its refusals a call), and the call said the
    daemon "ended while this call waited 0.05s", not that this client must attach again (a review)."""
    from dflash2.errors import DaemonError

    config, port, c, quiet = _clients_of_an_ended_daemon(tmp_path, runtime)
    proc = log = None
    try:
        assert quiet._daemon_gone()  # (as a view finds it: the socket is still open)
        with pytest.raises(DaemonError, match="has ended .*attach a new client"):
            quiet.lookup([1])  # (refused, and lets the socket go)
        proc, log = _restarted_with_new_keys(tmp_path, config, runtime, port)
        for _ in range(3):
            with pytest.raises(DaemonError, match="has ended .*attach a new client") as e:
                c.lookup([1])
            assert e.value.kind == "UnknownClient"
        time.sleep(1.5)  # (the daemon logs its refusals at most every second)
    finally:
        _stop_restarted(proc, log, c, quiet)
    second = (tmp_path / "second.log").read_text()
    assert "refused" not in second, second
