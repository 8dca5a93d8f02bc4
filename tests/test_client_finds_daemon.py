"""A client finding its daemon, or being told why not: the default socket of another environment, a
daemon still taking its tiers, an endpoint that names no socket, a client in its own pid namespace.
Moved from test_client_daemon.py (past 600 lines)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash2.client import Client, DaemonUnavailable


def test_a_client_looking_at_the_default_socket_is_told_of_the_other_environments(tmp_path, monkeypatch, config_file):
    """A review: the default endpoint follows XDG_RUNTIME_DIR, which a login shell sets and a systemd
    system unit or cron does not: a daemon started in one and a client in the other looked in two
    places, and the client was told only that no daemon runs."""
    from dflash2.client import Client
    from dflash2.errors import DaemonUnavailable

    uid = 900_000 + os.getpid() % 1000  # (a uid of no one: its /tmp/dflash2-UID is this test's)
    monkeypatch.setattr(os, "getuid", lambda: uid)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    other = Path(f"/tmp/dflash2-{uid}")
    config = config_file(daemon={"endpoint": None})  # (the default endpoint)
    with pytest.raises(DaemonUnavailable) as before:
        Client.connect(config=config, timeout_s=1.0)
    assert "the socket file does not exist" in str(before.value) and "one is at" not in str(before.value)
    other.mkdir(mode=0o700)
    try:
        (other / "dflash2.sock").touch()
        with pytest.raises(DaemonUnavailable, match=rf"; one is at ipc://{other}/dflash2.sock, the default socket of "
                                                    r"an environment without XDG_RUNTIME_DIR \(a systemd unit's"):
            Client.connect(config=config, timeout_s=1.0)
    finally:
        shutil.rmtree(other)


def test_a_daemon_still_taking_its_tiers_is_said_to_be_starting(tmp_path):
    """A review: a restarted daemon takes the endpoint's lock and removes the old socket at once, but
    binds its own only once every tier is taken (minutes for large ones); meanwhile clients and `dflash2
    status` were told "is the daemon running?". The lock is the daemon's own (EndpointLock), held here
    as a starting daemon holds it; a killed daemon's lock file, held by no one, is no daemon starting.
    (Asked by a lock, not from /proc/locks, which shows none of another pid namespace's processes.)"""
    from dflash2.client.endpoint_check import check_endpoint
    from dflash2.daemon.endpoint import EndpointLock

    endpoint = f"ipc://{tmp_path}/d.sock"
    lock = EndpointLock(endpoint, tmp_path)
    lock.acquire()
    try:
        with pytest.raises(DaemonUnavailable, match=rf"no dflash2d answers at {endpoint} now: dflash2d pid "
                                                    rf"{os.getpid()} holds it but does not serve it, as while it "
                                                    r"starts \(taking its tiers"):
            check_endpoint(endpoint)
        import socket

        with socket.socket(socket.AF_UNIX) as stale:  # (a killed daemon's socket file, nothing listening on it)
            stale.bind(str(tmp_path / "d.sock"))
            with pytest.raises(DaemonUnavailable, match="holds it but does not serve it"):
                check_endpoint(endpoint)
        (tmp_path / "d.sock").unlink()
    finally:
        fd, lock._fd = lock._fd, -1
        os.close(fd)  # (the lock let go as by a killed daemon: its file stays, naming this pid)
    assert (tmp_path / "d.sock.lock").read_text() == str(os.getpid())
    with pytest.raises(DaemonUnavailable, match=r"the socket file does not exist \(is the daemon running"):
        check_endpoint(endpoint)


def test_an_endpoint_naming_a_folder_or_a_file_is_said_to_be_no_socket(tmp_path):
    """Its connect refused, the client was told a killed daemon had left the socket file (a review:
    the endpoint named the socket's folder)."""
    from dflash2.errors import EndpointNotSocket

    (tmp_path / "file").write_text("")
    for path, said in ((tmp_path, f"names a folder, not dflash2d's socket: daemon.endpoint (and --endpoint) name "
                                  f"the socket file, such as ipc://{tmp_path}/dflash2.sock"),
                       (tmp_path / "file", "names a regular file, not a socket")):
        with pytest.raises(EndpointNotSocket) as ei:
            Client(f"ipc://{path}", "c", timeout_s=1.0)
        assert isinstance(ei.value, DaemonUnavailable) and said in str(ei.value), str(ei.value)
        assert "killed" not in str(ei.value)


def test_a_clients_question_does_not_fail_a_daemons_start(tmp_path):
    """The client asks with a shared lock let go at once: a daemon taking the lock meanwhile waits it
    out (it failed as "another dflash2d is serving")."""
    import fcntl
    import threading

    from dflash2.daemon.endpoint import EndpointLock

    endpoint = f"ipc://{tmp_path}/d.sock"
    (tmp_path / "d.sock.lock").write_text("")
    fd = os.open(tmp_path / "d.sock.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (a client's question, caught in the act)
    threading.Timer(0.015, os.close, (fd,)).start()
    lock = EndpointLock(endpoint, tmp_path)
    lock.acquire()
    lock.release()


def test_a_client_in_its_own_pid_namespace_is_told_the_daemon_is_starting(tmp_path):
    """deploy/kubernetes/daemonset.yaml runs the daemon with hostPID, the serving pods without it:
    /proc/locks, read at first, shows no lock of a process in another pid namespace, and a serving
    pod's client was told "is the daemon running?" all the same (a review of the mend)."""
    import shutil

    from dflash2.daemon.endpoint import EndpointLock

    unshare = ["unshare", "-pf"] if os.geteuid() == 0 else ["unshare", "-Upf", "--map-root-user"]
    if shutil.which("unshare") is None or subprocess.run([*unshare, "--mount-proc", "true"]).returncode != 0:
        pytest.skip("no unshare that can make a pid namespace here")
    endpoint = f"ipc://{tmp_path}/d.sock"
    lock = EndpointLock(endpoint, tmp_path)
    lock.acquire()  # (held as a starting daemon holds it)
    code = ("from dflash2.client.endpoint_check import check_endpoint\n"
            f"try: check_endpoint({endpoint!r})\nexcept Exception as e: print(e)")
    try:
        pod = subprocess.run([*unshare, "--mount-proc", sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60).stdout
    finally:
        lock.release()
    assert "holds it but does not serve it" in pod, pod
