"""A tcp endpoint's monitoring key (dflash2/tcpkeys.py): the daemon makes a second, owner-only key
file beside its key file, whose holders it answers ping, stats, history and check, and nothing else.
Before, the README had a monitoring group read the key file itself, and the daemon could not tell
such a process from a serving one: one that spoke the protocol attached, took HBM and published
blocks under any prompt's keys (a review, as uid 65534 with the key file's group)."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_config
from observe_helpers import running_daemon
from test_other_user import OTHER, as_other_user, base  # noqa: F401  (base: a fixture)
from test_tcp_keys import free_port, runtime, tcp_daemon  # noqa: F401  (runtime: a fixture)

from dflash2 import protocol as P
from dflash2.client import Client
from dflash2.client.transport import Transport
from dflash2.errors import AccessDenied
from dflash2.layout import Layout
from dflash2.tcpkeys import (KeyFileError, MonitorKeys, forget_port, load, load_or_make, monitor_path, node_id,
                             record_port)

LAYOUT = Layout("t", 2, 2, 8, "fp16", 16)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def cfg_endpoint(cfg: str) -> str:
    from dflash2.config import load_config

    return load_config(cfg).client_endpoint()


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


def _other_users_key_file(base: Path):
    """A key file (and its keys) made by the other user, as a daemon run as its own user makes it, in
    a folder of that user's."""
    folder = base / "keys"
    folder.mkdir()
    os.chown(folder, OTHER, OTHER)
    key_file = folder / "node.key"
    with as_other_user():
        keys, _ = load_or_make(key_file)
    return key_file, keys


@needs_root
def test_a_daemon_not_of_the_monitoring_group_keeps_the_files_group_as_it_edits_it(base):
    """The deploy units run the daemon as a user of its own: its edits at each start and stop wrote a
    new file, which it could not give the monitoring group (not its own), and the group's readers were
    shut out, unsaid (a review)."""
    key_file, keys = _other_users_key_file(base)
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
    key_file, keys = _other_users_key_file(base)
    with as_other_user():
        monitor_path(key_file).chmod(0o440)
        record_port(key_file, keys, 5555, 41000)
    assert load(monitor_path(key_file)).ports == {(node_id(), 5555): 41000}
    assert stat.S_IMODE(monitor_path(key_file).stat().st_mode) == 0o440
