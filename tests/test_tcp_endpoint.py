"""A daemon on a tcp endpoint (a review of 2026-12-05): its port is tried before any tier is taken,
its lock file lives in the node's runtime folder, `--endpoint tcp://*:P` reaches it, and `--check`
warns of an address of every interface. Each failed before its fix (its key file: test_tcp_keys.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import write_config

from dflash2.client.where import resolve_endpoint
from dflash2.config import load_config
from dflash2.config_warnings import config_warnings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config: str, runtime: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    return subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_a_port_another_program_holds_is_refused_before_any_tier_is_taken(tmp_path):
    """The port was found taken only at the bind, once every tier had been taken (minutes for a
    large DRAM tier, on a live node's memory; short of memory, the start blamed the memory)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # A DRAM tier far past this machine's memory: taken first, start-up would fail on it.
        config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{port}", "state_dir": str(tmp_path / "s")},
                              memory={"dram_capacity_mb": 1 << 26, "nvme_capacity_mb": 0})
        out = start(config, tmp_path / "run")
    assert out.returncode == 4, out.stderr
    assert f"cannot serve daemon.endpoint tcp://127.0.0.1:{port}: Address already in use" in out.stderr
    assert f"held by (pid {os.getpid()}: " in out.stderr, out.stderr  # (who holds it: a review)
    assert "dram tier" not in out.stderr
    assert not list((tmp_path / "run" / "dflash2").glob("*.lock")), "the lock is let go"


def test_a_tcp_endpoints_lock_lives_in_the_runtime_folder_not_the_state_folder(tmp_path):
    """The state folder may be an NFS home shared by several nodes: a lock held there by one node's
    daemon refused another node's, naming a pid of the other node (a review's two namespaces)."""
    port = free_port()
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{port}", "state_dir": str(tmp_path / "state")})
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", config], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    try:
        assert proc.stdout.readline().startswith("DFlash2: enabled")
        assert [p.name for p in (tmp_path / "run" / "dflash2").glob("*.lock")] == [f"tcp_127.0.0.1_{port}.lock"]
        assert not list(tmp_path.glob("state/*.lock"))
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_status_and_history_reach_a_daemon_bound_to_every_address():
    """`dflash2 status --endpoint tcp://*:P`, the spelling the daemon logs, failed (Invalid argument)."""
    assert resolve_endpoint("tcp://*:5999", None) == "tcp://127.0.0.1:5999"
    assert resolve_endpoint("tcp://[::]:5999", None) == "tcp://[::1]:5999"
    assert resolve_endpoint("ipc:///run/x.sock", None) == "ipc:///run/x.sock"
    from argparse import Namespace

    from dflash2.history_cli import resolve_endpoint as history_endpoint
    assert history_endpoint(Namespace(endpoint="tcp://0.0.0.0:5999", config=None)) == ("tcp://127.0.0.1:5999", None)


def test_client_connect_reaches_a_daemon_bound_to_every_address():
    """`Client.connect(endpoint="tcp://*:P")`, the spelling the daemon logs, failed as "Invalid argument"
    though `dflash2 status --endpoint` and `Client.connect(config=)` reach it (a review)."""
    from dflash2.client import Client

    class Endpoint(Client):
        def __init__(self, endpoint, *args):  # (the endpoint connect would attach to, nothing sent)
            self.endpoint = endpoint

    assert Endpoint.connect("tcp://*:5999").endpoint == "tcp://127.0.0.1:5999"
    assert Endpoint.connect("tcp://0.0.0.0:5999").endpoint == "tcp://127.0.0.1:5999"
    assert Endpoint.connect("tcp://10.1.2.3:5999").endpoint == "tcp://10.1.2.3:5999"


def test_check_says_an_endpoint_of_every_address_lets_every_host_try(tmp_path):
    """Access is by the key file (tests/test_tcp_keys.py); an address of every interface is still
    worth a word, and a key file given for an ipc endpoint is said to be ignored."""
    local = config_warnings(load_config(write_config(tmp_path, daemon={"endpoint": "tcp://127.0.0.1:5999"})))
    assert not any("tcp" in w for w in local)
    for everywhere in ("tcp://*:5999", "tcp://0:5999", "tcp://0.0:5999", "tcp://[::]:5999", "tcp://[0::0]:5999"):
        wide = config_warnings(load_config(write_config(tmp_path, daemon={"endpoint": everywhere})))
        assert any("(the monitoring port too), so every host that reaches it can try to connect; only a client "
                   "that holds the endpoint's key file" in w for w in wide), everywhere  # (`0` went unsaid)
    ipc = config_warnings(load_config(write_config(tmp_path, daemon={"tcp_key_file": "k.key"})))
    assert any("daemon.tcp_key_file is ignored: the endpoint is an ipc socket" in w for w in ipc)
    assert not any("tcp" in w for w in config_warnings(load_config(write_config(tmp_path))))


def test_a_shared_folder_for_the_tcp_lock_file_is_refused(tmp_path):
    """/tmp/dflash2-$UID made first by another user (XDG_RUNTIME_DIR unset, as under sudo or cron):
    a link planted at the lock's path had a root daemon truncate the file it pointed to (a review).
    The folder is checked as an ipc socket's is, and the lock file is opened without following links."""
    from dflash2.daemon.endpoint import EndpointLock

    runtime = tmp_path / "run" / "dflash2"
    runtime.mkdir(parents=True)
    runtime.chmod(0o1777)  # shared, as a folder another user made would be
    config = write_config(tmp_path, daemon={"endpoint": f"tcp://127.0.0.1:{free_port()}"})
    out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config, "--check"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    assert out.returncode == 2
    assert f"daemon.endpoint: the folder of its lock file {runtime} is shared (mode 1777" in out.stderr
    runtime.chmod(0o700)
    victim = tmp_path / "victim"
    victim.write_text("ten lines of someone's data\n")
    lock = EndpointLock("tcp://127.0.0.1:5999", runtime)
    lock.lock_path.symlink_to(victim)
    try:
        lock.acquire()
        raise AssertionError("a link at the lock's path was followed")
    except OSError:
        pass
    assert victim.read_text() == "ten lines of someone's data\n"


def test_a_port_held_on_ipv6_loopback_is_found_for_an_endpoint_of_every_address(tmp_path):
    """`tcp://*:P` binds both families; the probe tried 0.0.0.0 only, and a port held on [::1] was
    found after the tiers were taken (a review)."""
    from dflash2.daemon.endpoint import EndpointBusy, probe_port

    try:
        held = socket.socket(socket.AF_INET6)
        held.bind(("::1", 0))
    except OSError:
        import pytest
        pytest.skip("no IPv6 loopback here")
    with held:
        held.listen()
        port = held.getsockname()[1]
        try:
            probe_port(f"tcp://*:{port}")
            raise AssertionError("the port held on [::1] was not found")
        except EndpointBusy as e:
            assert "Address already in use" in str(e) and "holds the port" in str(e)


def test_a_probe_says_why_an_address_cannot_be_bound():
    """An address of another node (a config copied from one) was blamed on another program."""
    from dflash2.daemon.endpoint import EndpointBusy, probe_port

    try:
        probe_port("tcp://192.0.2.7:5999")  # TEST-NET-1: no node's address
        raise AssertionError("bound an address that is not this node's")
    except EndpointBusy as e:
        assert "an address of another node?" in str(e) and "holds the port" not in str(e)


def test_a_metrics_port_another_program_holds_is_refused_before_any_tier_is_taken(tmp_path):
    """As the endpoint's port: a taken metrics port was found only once every tier had been taken
    (a last review's daemon took its tiers, then failed)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = write_config(tmp_path, metrics={"port": port, "host": "127.0.0.1"},
                              memory={"dram_capacity_mb": 1 << 26, "nvme_capacity_mb": 0})
        out = start(config, tmp_path / "run")
    assert out.returncode == 4, out.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port} (metrics.host, metrics.port): [Errno 98] Address already in use" in out.stderr
    # Who holds it (a review: with two models' daemons on a node, the operator could not tell).
    assert f", held by (pid {os.getpid()}: " in out.stderr and "pytest" in out.stderr, out.stderr
    assert "dram tier" not in out.stderr


def test_an_interface_name_as_the_tcp_host_is_refused_by_name(tmp_path):
    """`tcp://lo:P` (or eth0) bound, but the clients reading the config could not connect to it: a
    network interface's name is no host (a review)."""
    from dflash2.errors import ConfigError
    from dflash2.plan import resolve_plan

    name = next((n for _, n in socket.if_nameindex() if n == "lo"), None)
    if name is None:
        import pytest
        pytest.skip("no interface named lo here")
    try:
        resolve_plan(load_config(write_config(tmp_path, daemon={"endpoint": f"tcp://{name}:5999"})))
        raise AssertionError("an interface name was taken as the endpoint's host")
    except ConfigError as e:
        assert "'lo' is the name of a network interface" in str(e) and "daemon.endpoint" in str(e)
    resolve_plan(load_config(write_config(tmp_path, daemon={"endpoint": "tcp://localhost:5999"})))


def test_clients_of_a_daemon_on_every_ipv6_address_go_to_ipv4_where_ipv6_is_off(monkeypatch):
    """A daemon bound to tcp://[::]:P where IPv6 is off serves IPv4; its clients went to [::1] and
    waited out their timeout."""
    from dflash2 import endpoints

    monkeypatch.setattr(endpoints, "ipv6_loopback", lambda: False)
    assert endpoints.connectable("tcp://[::]:5999") == "tcp://127.0.0.1:5999"
    monkeypatch.setattr(endpoints, "ipv6_loopback", lambda: True)
    assert endpoints.connectable("tcp://[::]:5999") == "tcp://[::1]:5999"


def test_an_interface_name_is_refused_as_written_and_even_where_it_resolves(monkeypatch):
    """A review: `enP5p1s0` (Grace servers' names) was lower-cased before the comparison and taken;
    `eth0` with an /etc/hosts entry was taken though ZeroMQ binds the interface's own (IPv6) address
    and clients went to the entry's."""
    from dflash2 import endpoints

    monkeypatch.setattr(endpoints.socket, "if_nameindex", lambda: [(1, "lo"), (5, "enP5p1s0"), (6, "eth0")])
    monkeypatch.setattr(endpoints.socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("192.0.2.2", 0))])
    assert endpoints.interface_host("tcp://enP5p1s0:5999") == "enP5p1s0"
    assert endpoints.interface_host("tcp://eth0:5999") == "eth0"
    assert endpoints.interface_host("tcp://node7:5999") is None
    assert endpoints.interface_host("tcp://[::1]:5999") is None


def test_a_port_holders_command_line_cannot_forge_a_line(tmp_path):
    """A holder's command line was printed as read, NULs made spaces: argv[0] is any local process's
    to choose, and a newline in it wrote a line that read as dflash2d's own (a review)."""
    from dflash2.files import pids_text

    port = free_port()
    forged = "x\ndflash2d: error: FORGED\x1b[2J\u202e"
    holder = subprocess.Popen([forged, "-c", "import socket, sys, time\ns = socket.socket()\n"
                               f"s.bind(('127.0.0.1', {port}))\ns.listen()\n"
                               "print('ready', flush=True)\ntime.sleep(60)"],
                              executable=sys.executable, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        text = pids_text([holder.pid])
        assert text.startswith(f" (pid {holder.pid}: x\\ndflash2d: error: FORGED\\x1b[2J\\u202e -c "), text
        config = write_config(tmp_path, metrics={"port": port, "host": "127.0.0.1"})
        for args in (["--check"], []):
            env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
            out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", config, *args],
                                 capture_output=True, text=True, timeout=60, env=env)
            assert f"(pid {holder.pid}: x\\ndflash2d: error: FORGED" in out.stdout + out.stderr, (args, out)
            assert not any("FORGED" in line and not line.startswith(("dflash2d: error: cannot", "now: cannot"))
                           for line in (out.stdout + out.stderr).splitlines()), (args, out)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
