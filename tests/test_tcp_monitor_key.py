"""A tcp endpoint's monitoring key (dflash2/tcpkeys.py): the daemon makes a second, owner-only key
file beside its key file, whose holders it answers ping, stats, history and check, and nothing else.
Before, the README had a monitoring group read the key file itself, and the daemon could not tell
such a process from a serving one: one that spoke the protocol attached, took HBM and published
blocks under any prompt's keys (a review, as uid 65534 with the key file's group)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import write_config
from observe_helpers import running_daemon
from test_other_user import OTHER, as_other_user
from test_tcp_keys import free_port, tcp_daemon

from dflash2 import protocol as P
from dflash2.client import Client
from dflash2.client.transport import Transport
from dflash2.errors import AccessDenied, DaemonUnavailable
from dflash2.layout import Layout
from dflash2.tcpkeys import (KeyFileError, MonitorKeys, forget_port, load, load_or_make, monitor_path, node_id,
                             record_port)

LAYOUT = Layout("t", 2, 2, 8, "fp16", 16)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def cfg_endpoint(cfg: str) -> str:
    from dflash2.config import load_config

    return load_config(cfg).client_endpoint()


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "run"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    return folder


def test_the_daemon_makes_an_owner_only_monitoring_key_file_beside_its_key_file(tmp_path):
    path = tmp_path / "keys" / "k.key"
    keys, made = load_or_make(path)
    monitor = monitor_path(path)
    assert made and monitor == tmp_path / "keys" / "k.key.monitor"
    assert stat.S_IMODE(monitor.stat().st_mode) == 0o600
    read = load(monitor)  # (a client given the monitoring file by name)
    assert isinstance(read, MonitorKeys) and read.read_only
    assert read.server_public == keys.keys.server_public and read.client_public == keys.monitor_public
    assert read.client_public != keys.keys.client_public
    assert "server_secret" not in monitor.read_text()
    again, made = load_or_make(path)  # a restart keeps both
    assert not made and again == keys


def test_a_key_file_made_again_makes_the_monitoring_file_again_keeping_its_mode_and_group(tmp_path, caplog):
    path = tmp_path / "k.key"
    first, _ = load_or_make(path)
    monitor = monitor_path(path)
    monitor.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(monitor, -1, OTHER)
    gid = monitor.stat().st_gid
    path.unlink()  # (how a user changes the keys)
    with caplog.at_level(logging.WARNING, logger="dflash2.tcpkeys"):
        second, made = load_or_make(path)
    assert made and second.keys.server_public != first.keys.server_public
    read = load(monitor)
    assert read.server_public == second.keys.server_public and read.client_public == second.monitor_public
    assert stat.S_IMODE(monitor.stat().st_mode) == 0o640 and monitor.stat().st_gid == gid
    assert any(f"made the monitoring key file {monitor} again" in r.getMessage() and "its mode (640) and group kept"
               in r.getMessage() for r in caplog.records), caplog.text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o602])
def test_a_monitoring_file_open_to_other_users_is_refused(tmp_path, mode):
    path = tmp_path / "k.key"
    load_or_make(path)
    monitor_path(path).chmod(mode)
    with pytest.raises(KeyFileError, match=f"the monitoring key file {monitor_path(path)} is open to other users "
                                           f"\\(mode {mode:o}\\)"):
        load_or_make(path)


def test_a_malformed_monitoring_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "k.key"
    keys, _ = load_or_make(path)
    monitor_path(path).write_text(keys.keys.text())  # (the key file's text: a server secret in it)
    with pytest.raises(KeyFileError, match="k.key.monitor line 4: expected one of server_public, client_public, "
                                           "client_secret"):
        load_or_make(path)


def _refusals(endpoint: str, monitor: Path, client: int, token: str) -> dict[str, str]:
    """Each call but the read-only ones, sent over the monitoring key as the attached `client` (its
    id and token, as if learned): the error type of each reply."""
    transport = Transport(endpoint, 10.0, key_file=monitor)
    transport.token = token
    answers = {}
    try:
        for op in sorted(set(P.Op) - P.READ_ONLY, key=lambda o: o.value):
            try:
                transport.call(op, client, {"name": "m", "pid": os.getpid(), "layouts": []})
                answers[op.value] = "ran"
            except AccessDenied as e:
                answers[op.value] = "AccessDenied" if "monitoring key" in str(e) else str(e)
            except Exception as e:
                answers[op.value] = f"{type(e).__name__}: {e}"
    finally:
        transport.close()
    return answers


def test_the_monitoring_key_asks_status_history_and_check_and_nothing_else(tmp_path, runtime):
    with tcp_daemon(tmp_path, runtime) as (config, port):
        endpoint = f"tcp://127.0.0.1:{port}"
        monitor = runtime / "dflash2" / f"tcp-{port}.key.monitor"
        transport = Transport(endpoint, 10.0, key_file=monitor)
        try:
            assert transport.read_only
            assert transport.call(P.Op.PING).ok
            assert "tiers" in transport.call(P.Op.STATS).result
            assert transport.call(P.Op.HISTORY, None, {}).ok
            assert transport.call(P.Op.CHECK).ok
        finally:
            transport.close()
        with Client.connect(config=config, name="engine", layouts=[LAYOUT]) as engine:
            engine.allocate(engine.layouts[0], 2)
            answers = _refusals(endpoint, monitor, engine.client_id, engine._token)
            stats = engine.stats()
            assert engine.allocate(engine.layouts[0], 1) is not None  # the engine's session is untouched
        assert answers == {op.value: "AccessDenied" for op in set(P.Op) - P.READ_ONLY}, answers
        assert [c["name"] for c in stats["clients"]] == ["engine"] and stats["daemon"]["errors"] >= len(answers)
        # The client library says so before it asks: a process that reads only the monitoring file
        # never attaches.
        with pytest.raises(AccessDenied, match=f"holds only the monitoring key file {monitor}, whose holders may ask"):
            Client(endpoint, "m", [LAYOUT], 5.0, False, key_file=monitor)


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="dmk-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_a_monitoring_user_reads_the_monitoring_file_and_gets_status_but_cannot_attach(base, capsys, caplog):
    """As the README has it: the key file owner-only, the monitoring file given to the monitoring
    user's group (here root's group, which the other user's process keeps with seteuid)."""
    import argparse

    from dflash2 import status as status_mod
    from dflash2.client.sglang.plugin import check_dflash2

    keys = base / "keys"
    keys.mkdir(mode=0o755)
    key_file = keys / "node.key"
    cfg = write_config(base, daemon={"endpoint": f"tcp://127.0.0.1:{free_port()}", "state_dir": str(base / "state"),
                                     "tcp_key_file": str(key_file)})
    os.chmod(cfg, 0o644)
    ns = argparse.Namespace(endpoint=None, config=cfg, json=True, timeout=5.0)
    with running_daemon(cfg, str(base / "d.log")):
        monitor = monitor_path(key_file)
        with as_other_user():
            with pytest.raises(KeyFileError, match="nor its monitoring key file"):
                load(key_file)  # both owner-only: neither can be read
        os.chmod(monitor, 0o640)  # (its group: root's)
        with as_other_user(), caplog.at_level(logging.INFO, logger="dflash2.tcpkeys"):
            assert isinstance(load(key_file), MonitorKeys)
            transport = Transport(cfg_endpoint(cfg), 5.0, key_file=key_file)
            transport.close()
            assert transport.read_only and transport.key_file == monitor  # (its errors name the file it read)
            rc = status_mod.handler(ns)
            with pytest.raises(AccessDenied, match=f"holds only the monitoring key file {monitor}"):
                Client.connect(config=cfg, name="other", layouts=[LAYOUT])
            probe = check_dflash2(cfg)  # (sglang's: it would have switched this process to dflash2)
        assert rc == 0, capsys.readouterr().err
        assert not probe.ok and f"may read only the monitoring key file {monitor}" in probe.reason
        assert f"read the monitoring key file {monitor} instead" in caplog.text


def test_check_warns_of_a_key_file_its_group_may_read_and_refuses_an_open_monitoring_file(tmp_path):
    key_file = tmp_path / "keys" / "k.key"
    load_or_make(key_file)
    key_file.chmod(0o640)
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{free_port()}", "state_dir": str(tmp_path / "s"),
                                            "tcp_key_file": str(key_file)})
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    check = [sys.executable, "-m", "dflash2.daemon.main", "--config", config, "--check"]
    out = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert f"{key_file} is readable by its group" in out.stderr and f"need only {key_file}.monitor" in out.stderr
    assert f"monitoring users read {key_file}.monitor: status, history and check only" in out.stdout
    key_file.chmod(0o600)
    monitor_path(key_file).chmod(0o604)
    out = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    assert f"daemon.tcp_key_file: the monitoring key file {key_file}.monitor is open to other users" in out.stderr


def test_a_key_file_named_like_a_monitoring_file_is_refused(tmp_path):
    """Clients read a `*.monitor` file as a monitoring key file: a daemon that took one for its key
    file started, and no engine could ever attach (a review)."""
    key_file = tmp_path / "node.monitor"
    with pytest.raises(KeyFileError, match="a name ending in .monitor is read by clients as a monitoring key file"):
        load_or_make(key_file)
    assert not key_file.exists()
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{free_port()}", "state_dir": str(tmp_path / "s"),
                                            "tcp_key_file": str(key_file)})
    out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config, "--check"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    assert out.returncode == 2 and "daemon.tcp_key_file" in out.stderr and "ending in .monitor" in out.stderr, out.stderr


def test_a_monitoring_file_holding_the_key_files_own_client_key_is_made_again(tmp_path, caplog):
    """One written from the key file without its server secret was taken: its readers attached (a review)."""
    path = tmp_path / "k.key"
    keys, _ = load_or_make(path)
    engine = keys.keys
    monitor_path(path).write_text(MonitorKeys(engine.server_public, engine.client_public, engine.client_secret).text())
    with caplog.at_level(logging.WARNING, logger="dflash2.tcpkeys"):
        again, made = load_or_make(path)
    assert not made and again.monitor_public != engine.client_public
    assert load(monitor_path(path)).client_public == again.monitor_public
    assert f"it held the client key of {path}, whose holders may attach" in caplog.text


def test_files_at_temporary_names_of_an_earlier_start_are_left_alone(tmp_path):
    """A temporary file named by the pid alone, left by a daemon killed meanwhile (in a container the
    daemon is always pid 1), failed every next start naming the wrong file, and was removed (a review)."""
    path = tmp_path / "k.key"
    planted = [tmp_path / f".k.key.{os.getpid()}.tmp", tmp_path / f".k.key.monitor.{os.getpid()}.tmp"]
    planted[0].write_text("left by a killed daemon\n")
    planted[1].mkdir()
    keys, made = load_or_make(path)
    assert made and load(monitor_path(path)).client_public == keys.monitor_public
    assert planted[0].read_text() == "left by a killed daemon\n" and planted[1].is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["k.key", "k.key.monitor", *(p.name for p in planted)])


def test_a_refused_monitoring_key_is_named_as_such(tmp_path, runtime):
    with tcp_daemon(tmp_path, runtime) as (config, port):
        monitor = runtime / "dflash2" / f"tcp-{port}.key.monitor"
        revoked = tmp_path / "copy.monitor"
        current = load(monitor)
        revoked.write_text(dataclasses.replace(MonitorKeys.fresh(current.server_public), ports=current.ports).text())
        transport = Transport(f"tcp://127.0.0.1:{port}", 5.0, key_file=revoked)
        try:
            assert transport.key_file == revoked
            with pytest.raises(AccessDenied, match="refused this client's key: the monitoring key file's client key "
                                                   f"is not the daemon's .* \\(monitoring key file {revoked}\\)"):
                transport.call(P.Op.PING)
        finally:
            transport.close()


def _served(tmp_path, make_manager):
    """An in-process Server on a tcp endpoint with keys, its loop not running (the test drives it)."""
    from dflash2.daemon.server import Server
    from dflash2.daemon.service import Service

    keys, _ = load_or_make(tmp_path / "k.key")
    svc = Service(make_manager(hbm_blocks=8, dram_blocks=16), lease_timeout_s=10, heartbeat_interval_s=1)
    return keys, Server(svc, f"tcp://127.0.0.1:{free_port()}", 30.0, keys=keys, key_file=str(tmp_path / "k.key"))


def _monitoring_dealer(ctx, keys, port):
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.monitor.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.monitor.client_secret)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _next(gate, within_s=5.0):
    import time as _time

    deadline = _time.monotonic() + within_s
    while _time.monotonic() < deadline:
        frames = gate.next_monitoring(64)
        if frames is not None:
            return frames
        _time.sleep(0.01)
    return None


def test_the_monitoring_socket_is_not_read_while_its_calls_owe_the_loop(tmp_path, make_manager):
    """Calls over the monitoring key were answered on the serving processes' socket and refused once
    past their share, and the refusals themselves took the loop: a flood of pings took it 40-60% of
    the time (a review). They come by a socket of their own now, which the loop does not read while
    they owe it: a flood waits in ZeroMQ's queue at no cost to the loop."""
    import zmq

    from dflash2.daemon import keygate

    keys, srv = _served(tmp_path, make_manager)
    ctx = zmq.Context()
    sock = _monitoring_dealer(ctx, keys, srv.monitoring_port)
    try:
        gate = srv._gate
        sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        frames = _next(gate)
        assert type(frames) is keygate.ReadOnlyFrames and frames.sock is not None
        srv._answer(frames)
        assert sock.poll(5000) and P.decode_reply(sock.recv_multipart()).ok  # answered on its own socket
        gate.charge(1.0)  # (a walk of a large table)
        sock.send_multipart(P.encode_request(P.Op.PING, 2, None))
        assert _next(gate, within_s=1.0) is None  # owed: not read (it waits, queued)
        gate._monitor_owed_s = 0.0  # (paid back)
        frames = _next(gate)
        assert frames is not None and P.decode_request(frames[1:]).call_id == 2
        gate.charge(3600.0)  # a flood: what it owes is capped, and so is the other monitoring users' wait
        assert gate._owed() <= keygate.MONITOR_OWED_MAX_S
    finally:
        sock.close(0)
        ctx.term()
        srv.close()


def test_the_request_socket_refuses_the_monitoring_key_and_the_monitoring_socket_the_key_files(tmp_path, make_manager):
    import zmq

    keys, srv = _served(tmp_path, make_manager)
    ctx = zmq.Context()
    try:
        request_port = int(srv._sock.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
        wrong = _monitoring_dealer(ctx, keys, request_port)  # the monitoring key at the request socket
        engine = ctx.socket(zmq.DEALER)  # the key file's at the monitoring socket
        engine.setsockopt(zmq.LINGER, 0)
        engine.setsockopt(zmq.CURVE_SERVERKEY, keys.keys.server_public)
        engine.setsockopt(zmq.CURVE_PUBLICKEY, keys.keys.client_public)
        engine.setsockopt(zmq.CURVE_SECRETKEY, keys.keys.client_secret)
        engine.connect(f"tcp://127.0.0.1:{srv.monitoring_port}")
        for sock in (wrong, engine):
            sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        assert _next(srv._gate, within_s=1.0) is None
        with pytest.raises(zmq.Again):
            srv._sock.recv(zmq.NOBLOCK)
        wrong.close(0)
        engine.close(0)
    finally:
        ctx.term()
        srv.close()


def test_refused_and_oversized_monitoring_messages_are_charged_and_never_decoded(tmp_path, make_manager, monkeypatch):
    """Refused calls were decoded in full (headers up to 1 MB, twice) and never charged, nor was the
    receipt of a message of millions of frames: a monitoring-key holder took most of the loop (a
    review: 86% of the daemon's CPU)."""
    from dflash2.daemon import keygate

    keys, srv = _served(tmp_path, make_manager)
    try:
        gate = srv._gate

        def message(op, header_pad=0, received_s=0.0):
            frames = keygate.ReadOnlyFrames([b"peer", *P.encode_request(op, 5, None, {"pad": "x" * header_pad})])
            frames.received_s = received_s
            return frames

        srv._answer(message(P.Op.ATTACH, received_s=0.1))  # refused (AccessDenied): its receipt is charged
        assert gate._owed() >= 0.1
        decoded = []
        with monkeypatch.context() as m:
            m.setattr(keygate.P, "decode_request", lambda frames: decoded.append(1))
            big = message(P.Op.STATS, header_pad=keygate.MONITOR_HEADER_BYTES)
            reply = P.decode_reply(gate.refusal(big))
        assert reply.error_type == "AccessDenied" and "a header of at most 4096 bytes" in reply.error_message
        assert decoded == []  # (refused unread)
        srv._answer(message(P.Op.STATS, received_s=1.0))  # answered, its receipt charged past the burst
        assert gate._owed() > keygate.MONITOR_BURST_S and gate.next_monitoring(64) is None
    finally:
        srv.close()


def test_the_daemon_writes_its_monitoring_port_into_the_file_each_start_keeping_mode_and_group(tmp_path):
    key_file = tmp_path / "keys" / "node.key"
    monitor = monitor_path(key_file)
    port = free_port()
    mine = (node_id(), port)
    with _daemon_at(tmp_path / "d", port, key_file, tmp_path / "run"):
        first = load(monitor).ports[mine]
        assert first != port
        monitor.chmod(0o640)
    assert mine not in load(monitor).ports  # removed at the clean stop
    with _daemon_at(tmp_path / "d", port, key_file, tmp_path / "run"):
        assert stat.S_IMODE(monitor.stat().st_mode) == 0o640  # (rewritten with the new port, mode kept)
        now = load(monitor).ports[mine]
        assert f"port.{node_id()}.{port} = {now}" in monitor.read_text()
        transport = Transport(f"tcp://127.0.0.1:{port}", 5.0, key_file=monitor)
        try:
            assert transport.call(P.Op.PING).ok  # at the port written now
        finally:
            transport.close()


@pytest.mark.parametrize("line, why", [("port.n1.5555 = 0", "expected port.NODE.REQUEST_PORT = MONITORING_PORT"),
                                       ("port.n1.5555 = 65536", "two port numbers"), ("port.n1.x = 7", "two port"),
                                       ("port.n1.05 = 7", "two port numbers"), ("port.5555 = 7", "a node id"),
                                       ("port.n/1.5555 = 7", "a node id"),
                                       ("port.n1.5 = 6\nport.n1.5 = 7", "port.n1.5 is given twice"),
                                       ("port = 7", "expected one of server_public")])
def test_a_bad_port_in_a_monitoring_file_is_refused_naming_the_line(tmp_path, line, why):
    path = tmp_path / "k.key.monitor"
    path.write_text(MonitorKeys.fresh(load_or_make(tmp_path / "k.key")[0].keys.server_public).text() + line + "\n")
    with pytest.raises(KeyFileError, match=why):
        load(path)


def test_a_monitoring_file_without_its_endpoints_port_is_refused_by_name(tmp_path):
    path = tmp_path / "k.key.monitor"
    ports = {(node_id(), 8): 9, ("another-node", 10): 11}  # (a key file shared by two nodes)
    keys = dataclasses.replace(MonitorKeys.fresh(load_or_make(tmp_path / "k.key")[0].keys.server_public), ports=ports)
    path.write_text(keys.text())
    with pytest.raises(AccessDenied, match="names no monitoring port for port 10 of this node .*is it running"):
        Transport("tcp://127.0.0.1:10", 1.0, key_file=path)
    assert Transport("tcp://127.0.0.1:8", 1.0, key_file=path)._connect_to == "tcp://127.0.0.1:9"


@contextmanager
def _daemon_at(folder: Path, port: int, key_file: Path, runtime: Path):
    """A tcp daemon on `port` with `key_file`; yields its pid."""
    folder.mkdir(exist_ok=True)
    config = write_config(folder, daemon={"endpoint": f"tcp://127.0.0.1:{port}", "state_dir": str(folder / "s"),
                                          "tcp_key_file": str(key_file)})
    with open(folder / "daemon.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config], stdout=subprocess.PIPE,
                                stderr=log, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("DFlash2: enabled"), (line, (folder / "daemon.log").read_text())
        yield proc.pid
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()


def test_two_daemons_sharing_a_key_file_each_answer_their_own_monitoring_users(tmp_path):
    """The monitoring file held one port, the last started daemon's: a monitoring user of the first
    was answered by the second, silently (a review)."""
    key_file = tmp_path / "keys" / "node.key"
    ports = [free_port(), free_port()]
    with _daemon_at(tmp_path / "a", ports[0], key_file, tmp_path / "run") as pid_a, \
            _daemon_at(tmp_path / "b", ports[1], key_file, tmp_path / "run") as pid_b:
        for port, pid in zip(ports, (pid_a, pid_b)):
            transport = Transport(f"tcp://127.0.0.1:{port}", 10.0, key_file=monitor_path(key_file))
            try:
                assert transport.call(P.Op.STATS).result["daemon"]["pid"] == pid
            finally:
                transport.close()
        assert sorted(load(monitor_path(key_file)).ports) == sorted((node_id(), p) for p in ports)


def test_a_monitoring_transport_follows_its_daemon_across_a_restart(tmp_path):
    """A restarted daemon binds another monitoring port: a monitoring transport kept connecting to the
    old one, and its calls timed out for good, while the key file's transport was answered (a review)."""
    key_file = tmp_path / "keys" / "node.key"
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    with _daemon_at(tmp_path / "d", port, key_file, tmp_path / "run") as first:
        transport = Transport(endpoint, 5.0, key_file=monitor_path(key_file))
        assert transport.call(P.Op.STATS).result["daemon"]["pid"] == first
    try:
        with _daemon_at(tmp_path / "d", port, key_file, tmp_path / "run") as second:
            assert transport.call(P.Op.STATS).result["daemon"]["pid"] == second
    finally:
        transport.close()


def test_a_monitoring_message_wakes_the_loops_wait(tmp_path, make_manager):
    """The loop waited on the request socket alone: a monitoring call on an idle daemon waited out
    its timeout (90-200 ms a call, a review)."""
    import zmq

    keys, srv = _served(tmp_path, make_manager)
    ctx = zmq.Context()
    sock = _monitoring_dealer(ctx, keys, srv.monitoring_port)
    try:
        assert not srv._gate.wait(srv._sock, 50)  # (nothing came)
        sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        assert srv._gate.wait(srv._sock, 5000)
        srv._gate.charge(1.0)  # owed: the monitoring socket is left out of the wait
        assert not srv._gate.wait(srv._sock, 50)
    finally:
        sock.close(0)
        ctx.term()
        srv.close()


def test_a_stale_line_sending_monitoring_users_to_another_daemon_is_said(tmp_path):
    """A daemon killed before it could remove its line leaves a port the system may give another
    daemon's monitoring socket later: its monitoring users were answered by that daemon, its stats
    shown as theirs (a review). The client asks who answers first."""
    key_file = tmp_path / "keys" / "node.key"
    gone, there = free_port(), free_port()
    with _daemon_at(tmp_path / "b", there, key_file, tmp_path / "run"):
        keys, _ = load_or_make(key_file)
        record_port(key_file, keys, gone, load(monitor_path(key_file)).ports[node_id(), there])  # (the killed one's)
        transport = Transport(f"tcp://127.0.0.1:{gone}", 5.0, key_file=monitor_path(key_file))
        try:
            for op in (P.Op.PING, P.Op.STATS):  # (each call is checked by the daemon that answers it)
                with pytest.raises(DaemonUnavailable, match=f"is the daemon's of port {there}, not port {gone}'s: the "
                                                            f"monitoring key file's line for port {gone} is stale"):
                    transport.call(op)
        finally:
            transport.close()


def test_a_key_file_that_cannot_be_locked_is_written_without_the_lock_said(tmp_path, monkeypatch, caplog):
    """NFS without a lock manager answers ENOLCK: start-up ended in a traceback naming neither the file
    nor the key, after every tier was taken (a review)."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    keys, _ = load_or_make(tmp_path / "k.key")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="dflash2.tcpkeys"):
        record_port(tmp_path / "k.key", keys, 5555, 6666)
    assert load(monitor_path(tmp_path / "k.key")).ports == {(node_id(), 5555): 6666}
    assert "cannot lock the key file" in caplog.text and "No locks available" in caplog.text


def test_a_monitoring_transport_follows_new_keys_after_the_key_file_is_made_again(tmp_path):
    """The key file removed and the daemon restarted (new keys, the monitoring file made again, its mode
    kept): a monitoring transport kept the old keys and was refused for good (a review)."""
    key_file = tmp_path / "keys" / "node.key"
    port = free_port()
    with _daemon_at(tmp_path / "d", port, key_file, tmp_path / "run") as first:
        transport = Transport(f"tcp://127.0.0.1:{port}", 5.0, key_file=monitor_path(key_file))
        assert transport.call(P.Op.STATS).result["daemon"]["pid"] == first
    key_file.unlink()
    try:
        with _daemon_at(tmp_path / "d", port, key_file, tmp_path / "run") as second:
            assert transport.call(P.Op.STATS).result["daemon"]["pid"] == second
    finally:
        transport.close()


def test_the_monitoring_socket_drops_a_sender_of_a_large_frame(tmp_path, make_manager):
    """It took the request socket's frames of 4 MiB: one refused message of 100 of them took 400 MiB
    of the daemon's memory first (a review)."""
    import zmq

    from dflash2.daemon import keygate

    keys, srv = _served(tmp_path, make_manager)
    ctx = zmq.Context()
    big = _monitoring_dealer(ctx, keys, srv.monitoring_port)
    try:
        big.send_multipart([*P.encode_request(P.Op.PING, 1, None), b"x" * (keygate.MONITOR_HEADER_BYTES + 65)])
        assert _next(srv._gate, within_s=1.0) is None  # (dropped with its connection, never queued)
        small = _monitoring_dealer(ctx, keys, srv.monitoring_port)
        small.send_multipart(P.encode_request(P.Op.PING, 2, None))
        frames = _next(srv._gate)
        assert frames is not None and P.decode_request(frames[1:]).call_id == 2
        small.close(0)
    finally:
        big.close(0)
        ctx.term()
        srv.close()


def test_a_failed_handshake_at_the_monitoring_socket_is_logged(tmp_path, make_manager, caplog):
    """Only the request socket's were watched: a client with another daemon's key at the monitoring
    port left no line (a review)."""
    import time as _time

    import zmq

    from dflash2.tcpkeys import TcpKeys

    keys, srv = _served(tmp_path, make_manager)
    ctx = zmq.Context()
    other = TcpKeys.fresh()  # (another daemon's server key)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, other.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.monitor.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.monitor.client_secret)
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.daemon"):
            sock.connect(f"tcp://127.0.0.1:{srv.monitoring_port}")
            sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
            deadline = _time.monotonic() + 10  # (the first refusal is logged at once; a later one at the close)
            while _time.monotonic() < deadline and "whose handshake failed" not in caplog.text \
                    and not srv._gate._unlogged:
                _time.sleep(0.05)
            srv.close()
        assert "at the monitoring socket, whose handshake failed" in caplog.text, caplog.text
    finally:
        sock.close(0)
        ctx.term()


def test_a_monitoring_file_of_many_daemons_lines_is_read_whole(tmp_path):
    """It was read in 4 KiB: the lines of the 65th daemon sharing a key file on, and a port, were cut
    (one read as 400 where 40074 was written), and the next edit wrote the cut file back (a review)."""
    key_file = tmp_path / "k.key"
    keys, _ = load_or_make(key_file)
    ports = {(f"node-{n:03d}-{'x' * 30}", 5555): 40000 + n for n in range(200)}
    monitor_path(key_file).write_text(dataclasses.replace(keys.monitor, ports=ports).text())
    record_port(key_file, keys, 5555, 41234)
    assert load(monitor_path(key_file)).ports == {**ports, (node_id(), 5555): 41234}
    monitor_path(key_file).write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(KeyFileError, match="holds more than 1048576 bytes"):
        load(monitor_path(key_file))


def test_a_clean_stop_after_the_monitoring_file_was_removed_logs_no_error(tmp_path):
    """Removing the monitoring file to revoke its readers, as README says, made the next clean stop log
    an error with a traceback naming a lambda (a review)."""
    key_file = tmp_path / "keys" / "node.key"
    with _daemon_at(tmp_path / "d", free_port(), key_file, tmp_path / "run"):
        monitor_path(key_file).unlink()
    log = (tmp_path / "d" / "daemon.log").read_text()
    assert "ERROR" not in log and "Traceback" not in log, log
    assert "the monitoring port's line is not removed" in log


def test_a_read_only_client_checks_the_port_a_ping_or_stats_answer_names(tmp_path):
    """Beside the daemon's check of the port each monitoring call names: an answer from a daemon that
    does not check it (not this release) is refused by the client where it names its request port."""
    path = tmp_path / "k.key.monitor"
    keys = dataclasses.replace(MonitorKeys.fresh(load_or_make(tmp_path / "k.key")[0].keys.server_public),
                               ports={(node_id(), 8): 9})
    path.write_text(keys.text())
    transport = Transport("tcp://127.0.0.1:8", 1.0, key_file=path)
    try:
        transport._check_answerer(P.Op.PING, P.Reply(1, True, {"request_port": 8}))  # (its own: fine)
        transport._check_answerer(P.Op.PING, P.Reply(1, True, {"version": 3}))  # (none named: fine)
        for result in ({"request_port": 7}, {"daemon": {"request_port": 7}}):
            with pytest.raises(DaemonUnavailable, match="where the daemon of port 7 answered: that line is stale"):
                transport._check_answerer(P.Op.STATS, P.Reply(1, True, result))
    finally:
        transport.close()


@needs_root
def test_a_daemon_not_of_the_monitoring_group_keeps_the_files_group_as_it_edits_it(base):
    """The deploy units run the daemon as a user of its own: its edits at each start and stop wrote a
    new file, which it could not give the monitoring group (not its own), and the group's readers were
    shut out, unsaid (a review)."""
    folder = base / "keys"
    folder.mkdir()
    os.chown(folder, OTHER, OTHER)
    key_file = folder / "node.key"
    with as_other_user():
        keys, _ = load_or_make(key_file)
    monitor = monitor_path(key_file)
    os.chown(monitor, -1, 100)  # (root, as the README's chgrp: a group the daemon's user is not in)
    monitor.chmod(0o640)
    with as_other_user():
        assert 100 not in os.getgroups() or os.getegid() != 100
        record_port(key_file, keys, 5555, 41000)
        forget_port(key_file, keys, 5555, 41000)
        record_port(key_file, keys, 5556, 41001)
    st = monitor.stat()
    assert (st.st_gid, stat.S_IMODE(st.st_mode), st.st_uid) == (100, 0o640, OTHER)
    assert load(monitor).ports == {(node_id(), 5556): 41001}


def test_a_lock_on_the_monitoring_file_blocks_neither_the_daemon_nor_its_readers(tmp_path):
    """An in-place write under a lock that readers took let any reader of the monitoring file (flock
    needs no write access) hang every daemon sharing the key file at start and stop, and every
    `dflash2 status` (a review). The daemon renames a new file over it, and nobody locks it."""
    import fcntl
    import threading

    key_file = tmp_path / "k.key"
    keys, _ = load_or_make(key_file)
    with open(monitor_path(key_file)) as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # (a monitoring user's)
        done = []
        worker = threading.Thread(target=lambda: done.append((record_port(key_file, keys, 5555, 41000),
                                                               load(monitor_path(key_file)))), daemon=True)
        worker.start()
        worker.join(5)
        assert done, "record_port or load waited for the monitoring user's lock"
    assert done[0][1].ports == {(node_id(), 5555): 41000}


def test_an_in_place_write_is_never_cut_short(tmp_path):
    """Written over, shorter, then cut to length, a reader between the two saw the new text and the
    old tail (a line given twice), and a daemon killed there left a file the next start refused (a
    review). Blank lines pad it instead."""
    from dflash2 import tcpkeys

    key_file = tmp_path / "k.key"
    keys, _ = load_or_make(key_file)
    monitor = monitor_path(key_file)
    many = {(node_id(), port): port + 1000 for port in (5555, 5556, 5557)}
    monitor.write_text(dataclasses.replace(keys.monitor, ports=many).text())
    before = monitor.stat()
    assert tcpkeys._write_in_place(monitor, dataclasses.replace(keys.monitor, ports={(node_id(), 5557): 6557}).text(),
                                   before)
    assert monitor.stat().st_size == before.st_size and monitor.stat().st_ino == before.st_ino
    assert load(monitor).ports == {(node_id(), 5557): 6557}


@needs_root
def test_an_owner_read_only_monitoring_file_is_still_edited(base):
    """In place, a monitoring file of mode 0440 (nobody may write: "Do not edit") failed every start of
    a daemon run as its own user (a review): renamed over, it takes only the folder's write access."""
    folder = base / "keys"
    folder.mkdir()
    os.chown(folder, OTHER, OTHER)
    key_file = folder / "node.key"
    with as_other_user():
        keys, _ = load_or_make(key_file)
        monitor_path(key_file).chmod(0o440)
        record_port(key_file, keys, 5555, 41000)
    assert load(monitor_path(key_file)).ports == {(node_id(), 5555): 41000}
    assert stat.S_IMODE(monitor_path(key_file).stat().st_mode) == 0o440
