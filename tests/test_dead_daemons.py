"""Shared memory of killed daemons that the endpoint's lock file does not name (a review of
2026-12-04: systemd removes a service's RuntimeDirectory, the lock file with it, when the service
stops, a restart after a kill included; the killed daemon's segments were then left for good). A
daemon's start-up finds them by their liveness object, which no process holds (arena/liveness.py
`dead_daemons`)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess

from dflash2.arena.liveness import dead_daemons

SHM = Path("/dev/shm")


def unused_pid() -> int:
    """A pid no process has now (from the top of the range down)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(top - 1, top - 100_000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    pytest.skip("no unused pid found")


@pytest.fixture
def group():
    """make(pid): a killed daemon's liveness object and DRAM segment in /dev/shm (nobody holds
    them); removed at the end if still there."""
    made = []

    def make(pid: int) -> list[Path]:
        paths = [SHM / f"dflash2-{pid}-alive", SHM / f"dflash2-{pid}-dram"]
        for p in paths:
            p.write_bytes(b"x" * 4096)
            made.append(p)
        return paths
    yield make
    for p in made:
        p.unlink(missing_ok=True)


def test_a_killed_daemons_group_is_found_and_a_live_or_running_one_is_not(group):
    dead = unused_pid()
    held = dead - 1 if dead - 1 != os.getpid() else dead - 2
    group(dead)
    group(held)
    group(os.getppid())  # a process of that pid runs: perhaps a daemon between its file and its lock
    fd = os.open(SHM / f"dflash2-{held}-alive", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # as a running daemon holds it
        found = dead_daemons()
    finally:
        os.close(fd)
    assert dead in found and held not in found and os.getppid() not in found


def test_a_daemon_starting_removes_a_killed_daemons_shared_memory(config_file, tmp_path, group):
    """The lock file beside the socket is gone (the folder removed, as systemd does): the start-up
    finds the killed daemon by its liveness object all the same, says so, and removes its segments."""
    dead = unused_pid()
    paths = group(dead)
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    try:
        assert not any(p.exists() for p in paths)
        assert f"dflash2d pid {dead} was killed and left shared memory" in proc.log()
        assert f"removed shared-memory segment dflash2-{dead}-dram (4096 bytes)" in proc.log()
    finally:
        proc.stop()


def test_a_liveness_object_has_its_name_only_once_it_is_held(monkeypatch):
    """Created under its name, then locked: in between, another daemon's start-up in another pid
    namespace (a DaemonSet pod), which cannot see the pid run, took it for a killed daemon's and
    removed it, and the live daemon's clients lost dead-daemon detection (a review's script)."""
    import uuid

    from dflash2.arena import liveness
    from dflash2.arena.shm import nobody_holds

    linked = []
    real_link = os.link

    def link(src, dst):
        fd = os.open(src, os.O_RDONLY)
        try:
            linked.append(not nobody_holds(fd))
        finally:
            os.close(fd)
        real_link(src, dst)
    monkeypatch.setattr(liveness.os, "link", link)
    name = f"dflash2-{4_000_000_000 + uuid.uuid4().int % 1_000_000}-alive"
    alive = liveness.DaemonLiveness.create(name)
    try:
        assert linked == [True]
        assert not (SHM / f"{name}.new").exists() and (SHM / name).exists()
    finally:
        alive.close()
    assert not (SHM / name).exists()
