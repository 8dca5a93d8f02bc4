"""Processes of another user than the daemon's. The deploy files make the control socket owner-only
(systemd: RuntimeDirectoryMode=0700 under User=dflash2; container/DaemonSet: socket 0600 in
/run/dflash2), and say serving processes must run as the same user. One of another user (an
operator's `dflash2 status`, a serving process under another uid) was told the daemon was not there
or was stuck (a review); it is told that it may not use the socket, and why.

Needs root (it runs the daemon as root and the caller as uid 65534 with seteuid)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import write_config
from observe_helpers import running_daemon

from dflash2 import status as status_mod
from dflash2.client import Client
import dflash2.client.client  # noqa: F401  (imported before the euid drops)
import dflash2.client.transport  # noqa: F401

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
OTHER = 65534


@contextlib.contextmanager
def as_other_user():
    os.seteuid(OTHER)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="dp1-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _status(cfg: str, capsys) -> tuple[int, str]:
    ns = argparse.Namespace(endpoint=None, config=cfg, json=True, timeout=2.0)
    assert status_mod.handler(ns) == 0  # as root: it answers (and every lazy import is done)
    capsys.readouterr()
    with as_other_user():
        rc = status_mod.handler(ns)
    return rc, capsys.readouterr().err


def test_status_from_another_user_under_the_systemd_units_0700_runtime_dir(base, capsys):
    run = base / "run"
    run.mkdir(mode=0o700)  # RuntimeDirectory=dflash2 + RuntimeDirectoryMode=0700
    cfg = write_config(base, daemon={"endpoint": f"ipc://{run}/dflash2.sock", "state_dir": str(base / "state")})
    with running_daemon(cfg, str(base / "d.log")):
        assert (run / "dflash2.sock").exists()  # (as root) the daemon is there
        rc, err = _status(cfg, capsys)
    assert rc != 0
    assert "does not exist" not in err and "permission" in err.lower(), (
        f"a running daemon whose socket folder this user may not enter is reported as: {err!r}")


def test_status_from_another_user_on_the_containers_0600_socket(base, capsys):
    run = base / "run"
    run.mkdir(mode=0o755)  # hostPath /run/dflash2 (kubelet/docker make it 0755 root)
    cfg = write_config(base, daemon={"endpoint": f"ipc://{run}/dflash2.sock", "state_dir": str(base / "state")})
    with running_daemon(cfg, str(base / "d.log")):
        rc, err = _status(cfg, capsys)
    assert rc != 0
    assert "permission" in err.lower(), (
        f"a running daemon whose 0600 socket this user may not connect to is reported as: {err!r}")


def test_a_client_of_another_user_is_told_why_it_cannot_attach(base):
    run = base / "run"
    run.mkdir(mode=0o755)
    cfg = write_config(base, daemon={"endpoint": f"ipc://{run}/dflash2.sock", "state_dir": str(base / "state")})
    with running_daemon(cfg, str(base / "d.log")):
        Client.connect(f"ipc://{run}/dflash2.sock", timeout_s=2.0).close()  # as root: it attaches
        with as_other_user():
            with pytest.raises(Exception) as ei:
                Client.connect(f"ipc://{run}/dflash2.sock", timeout_s=2.0)
    assert "its socket belongs to uid 0, not to this process's user (uid 65534)" in str(ei.value), \
        f"attach as another user fails with: {ei.value!r}"


def test_a_client_never_attaches_to_another_users_daemon_nor_maps_its_memory(base, capsys):
    """A review: another user made this user's default runtime folder first (/tmp/dflash2-UID, which
    anyone may create) and served a daemon there, its socket and segments open to all: this user's
    clients attached and wrote their requests' KV cache into its memory. Played here by root's
    daemon whose socket and segments are given to uid 65534, with root's client attaching: refused,
    while `dflash2 status` may still read it."""
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2.errors import ArenaError, DaemonUnavailable
    from dflash2.tiers import Tier

    run = base / "run"
    run.mkdir(mode=0o777)
    cfg = write_config(base, daemon={"endpoint": f"ipc://{run}/dflash2.sock", "state_dir": str(base / "state")})
    with running_daemon(cfg, str(base / "d.log")):
        with Client.connect(f"ipc://{run}/dflash2.sock", timeout_s=2.0) as c:  # (its own user's: attaches)
            segment = next(a.name for a in c._arenas.arenas.values() if isinstance(a, SharedMemoryArena))
        os.chown(run / "dflash2.sock", OTHER, OTHER)
        with pytest.raises(DaemonUnavailable, match=r"will not attach to the dflash2d at .*: its socket belongs to "
                                                     r"uid 65534, not to this process's user \(uid 0\).*\(run this "
                                                     r"client as the daemon's user, uid 65534\)"):
            Client.connect(f"ipc://{run}/dflash2.sock", timeout_s=2.0)  # (not this user's default folder:
            # a daemon's own runtime folder under a systemd unit's User=, not to be removed, a review)
        ns = argparse.Namespace(endpoint=None, config=cfg, json=True, timeout=2.0)
        assert status_mod.handler(ns) == 0  # (reading another's daemon is not handing it anything)
        os.chown(f"/dev/shm/{segment}", OTHER, OTHER)  # (a tcp endpoint has no socket file: the memory is checked)
        with pytest.raises(ArenaError, match=r"belongs to .*65534.*, not to this process's user \(uid 0\): clients "
                                             r"attach only to a daemon of their own user"):
            SharedMemoryArena.attach(segment, Tier.DRAM)
        os.chown(f"/dev/shm/{segment}", 0, 0)
        os.chown(run / "dflash2.sock", 0, 0)


def test_check_names_the_owner_of_another_users_endpoint_folder(base):
    """A review: another user's 0755 folder at this user's socket path was said only to refuse this
    user's files ("cannot create files in ..."), not whose it is, as README says."""
    from dflash2.config_errors import ConfigError
    from dflash2.daemon import main as dmain

    run = base / "run"
    run.mkdir(mode=0o755)  # (root's: the other user here is uid 65534)
    with as_other_user():
        with pytest.raises(ConfigError) as ei:
            dmain._check_own_folder(run, "the socket's folder", "give daemon.endpoint a folder of your own")
    assert f"the socket's folder {run} belongs to uid 0" in str(ei.value) and "not to this user (uid 65534)" \
        in str(ei.value), str(ei.value)


@pytest.mark.parametrize("which", ["ipc", "default", "tcp"])
def test_check_names_the_key_of_a_socket_folder_the_user_may_not_search(base, which, monkeypatch):
    """An ipc socket in a folder of another user's 0700 one, the default socket or a tcp endpoint's
    lock file under a runtime folder the daemon's user may not search (`sudo -u dflash2 dflash2d`
    keeps the caller's /run/user/UID): a ConfigError naming daemon.endpoint (exit 2, as README
    promises); it was a PermissionError traceback and exit 1 (a review)."""
    from dflash2.config import load_config
    from dflash2.config_errors import ConfigError
    from dflash2.daemon import main as dmain
    from dflash2.plan import resolve_plan

    private = base / "private"  # root's, 0700
    (private / "sub").mkdir(parents=True)
    private.chmod(0o700)
    daemon = {"ipc": {"endpoint": f"ipc://{private}/sub/s.sock"}, "default": {"endpoint": None},
              "tcp": {"endpoint": "tcp://127.0.0.1:5997"}}[which]
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base / "rt") if which == "ipc" else str(private))
    plan = resolve_plan(load_config(write_config(base, daemon=daemon)))
    with as_other_user():
        with pytest.raises(ConfigError) as ei:
            dmain.check_paths(plan)
    assert "daemon.endpoint" in str(ei.value) and "Permission denied" in str(ei.value), str(ei.value)
    assert "set XDG_RUNTIME_DIR to a folder of the daemon's own" in str(ei.value), str(ei.value)  # (a review)
