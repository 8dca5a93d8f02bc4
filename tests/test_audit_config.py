"""Configuring and starting dflash2d on a machine without a GPU: every bad input is one clear line
that names what is wrong (no traceback), `--check` agrees with start-up, and nothing is left behind
or destroyed on the way."""

from __future__ import annotations

import errno
import glob
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_config

from dflash2.arena import nvme as nvme_module
from dflash2.arena import shm as shm_module
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.shm import SharedMemoryArena
from dflash2.config import load_config, parse_config
from dflash2.errors import CapacityError, ConfigError
from dflash2.tiers import Tier

STARTUP_TIMEOUT_S = 30.0


def config(tmp_path: Path, **sections) -> Path:
    """conftest's small host config without an NVMe tier and with its own state folder; kwargs
    update its sections."""
    merged: dict = {"memory": {"nvme_capacity_mb": 0, "nvme_path": None}, "daemon": {"state_dir": str(tmp_path / "state")}}
    for key, value in sections.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
    return Path(write_config(tmp_path, **merged))


def run_daemon(path: Path, *args: str) -> tuple[int, str, bool]:
    """Run `dflash2d --config path [args]` to its end: (exit code, stderr, whether it started
    serving). A daemon that starts is stopped by SIGTERM at once."""
    err_path = path.with_name(f"stderr-{time.monotonic_ns()}.txt")
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", str(path), *args],
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(path.parent))
    started = False
    try:
        for line in proc.stdout:
            if line.startswith("DFlash2: enabled"):
                started = True
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=STARTUP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return rc, err_path.read_text(), started


def one_error_line(stderr: str, prefix: str = "dflash2d: error: ") -> str:
    lines = [line for line in stderr.splitlines() if " INFO " not in line]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0]


@pytest.mark.parametrize("logging_section", [{"format": "json", "level": "info"}, None])
def test_an_invalid_config_in_json_format_says_so_as_a_json_record(tmp_path, logging_section):
    """Its logs go to a journal read with jq: the error of a value out of range was plain text
    (only errors found after validation were records), and jq stopped there. A config that names
    no format is json's, the default."""
    import json

    path = config(tmp_path, policy={"cold_threshold": 2}, logging=logging_section)
    if logging_section is None:
        raw = json.loads(path.read_text())
        del raw["logging"]
        path.write_text(json.dumps(raw))
    rc, err, started = run_daemon(path)
    assert not started and rc == 2
    [record] = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert record["event"] == "dflash2_error" and record["level"] == "error"
    assert record["msg"].startswith("dflash2d: error: policy.cold_threshold:")
    rc, err, _ = run_daemon(path, "--check")  # for a person: text
    assert rc == 2 and one_error_line(err).startswith("dflash2d: error: policy.cold_threshold:")


# ---- policy.name ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [("--check",), ()])
def test_unknown_policy_name_is_a_config_error_for_check_and_start(tmp_path, args):
    rc, err, started = run_daemon(config(tmp_path, policy={"name": "hot"}), *args)
    assert not started and rc == 2
    assert "policy.name: unknown policy 'hot'; valid: heat, lfu, lru" in one_error_line(err)


def test_bench_only_policy_is_refused_by_the_daemon(tmp_path):
    rc, err, started = run_daemon(config(tmp_path, policy={"name": "belady"}), "--check")
    assert not started and rc == 2
    assert "policy.name: 'belady' cannot run in the daemon" in one_error_line(err)


# ---- the config file --------------------------------------------------------------------------------


def test_config_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"enable": true, "memory": {"nvme_path": "caf\xe9"}}'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        load_config(path)
    assert info.value.key == str(path)
    rc, err, _ = run_daemon(path, "--check")
    assert rc == 2 and str(path) in one_error_line(err)


def test_tier_smaller_than_one_page_is_an_error():
    data = {"enable": True, "device": {"kind": "host"},
            "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 64, "dram_capacity_mb": 1, "page_kb": 2048}}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "memory.dram_capacity_mb" and "less than one page" in info.value.problem
    data["memory"].update(dram_capacity_mb=64, nvme_capacity_mb=1, nvme_path="n.bin")
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "memory.nvme_capacity_mb"
    data["memory"].update(nvme_capacity_mb=2, hbm_capacity_mb=1)
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "memory.hbm_capacity_mb"


# ---- the endpoint -----------------------------------------------------------------------------------


def test_tcp_endpoint_taken_by_another_program_exits_4_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        path = config(tmp_path, daemon={"endpoint": endpoint})
        rc, err, started = run_daemon(path)
    assert not started and rc == 4
    line = one_error_line(err)
    assert endpoint in line and "Address already in use" in line
    assert not glob.glob(f"{tmp_path}/state/*.lock")


def test_a_tcp_endpoint_whose_host_does_not_resolve_says_so(tmp_path):
    """ZeroMQ's bare "No such device" (ENODEV) named the key but not what was wrong with it (a review)."""
    endpoint = "tcp://no-such-host.invalid:33299"
    rc, err, started = run_daemon(config(tmp_path, daemon={"endpoint": endpoint}))
    assert not started and rc == 4
    line = one_error_line(err)
    assert endpoint in line and "the host 'no-such-host.invalid' is neither a network interface of this machine " \
        "nor a name that resolves" in line


@pytest.mark.parametrize("thread", ["dflash2-stall-watch", "dflash2-staging"])
def test_a_thread_that_cannot_start_exits_4_with_one_line_and_gives_the_tiers_back(tmp_path, thread):
    """Under `ulimit -v` the tiers fit and the metrics server's thread did not: a traceback and exit 1
    (a review's repro). Here a thread's start fails as it failed there: the stall watch's, or one of
    the NVMe tier's I/O workers (started with the tier: at its first batch, while serving, a review)."""
    nvme = {"nvme_capacity_mb": 8, "nvme_path": str(tmp_path / "n.cache")} if thread == "dflash2-staging" else {}
    path = config(tmp_path, metrics={"port": 0}, memory=nvme)
    run = ("import sys, threading\n"
           "real = threading.Thread.start\n"
           "def start(self):\n"
           f"    if self.name.startswith({thread!r}):\n"
           "        raise RuntimeError(\"can't start new thread\")\n"
           "    real(self)\n"
           "threading.Thread.start = start\n"
           "from dflash2.daemon.main import main\n"
           f"sys.exit(main(['--config', {str(path)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path))
    _, err = proc.communicate(timeout=STARTUP_TIMEOUT_S)
    assert proc.returncode == 4, err
    said = "cannot start a thread" if thread == "dflash2-stall-watch" else "its I/O workers could not be had"
    assert f"{said}: can't start new thread" in one_error_line(err)
    assert "took dram tier" in err and not glob.glob(f"/dev/shm/dflash2-{proc.pid}-*")


def test_start_up_under_an_address_space_limit_too_small_takes_nothing(tmp_path):
    """Weighed before any tier is taken, as --check weighs it: a thread that could not start after the
    tiers were taken ended start-up, or ZeroMQ's aborted it with its shared memory left (a review)."""
    import resource

    path = config(tmp_path, memory={"dram_capacity_mb": 1536})
    limit = 1 << 30
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    _, err = proc.communicate(timeout=STARTUP_TIMEOUT_S)
    assert proc.returncode == 4, err
    assert f"cannot start: too little address space: they take {1544 * 1024 * 1024} bytes" in one_error_line(err)
    assert "took" not in err and not glob.glob(f"/dev/shm/dflash2-{proc.pid}-*")


def test_cuda_asked_for_where_no_gpu_is_visible_exits_4_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, also on the GPU machine
    path = config(tmp_path, device={"kind": "cuda"}, memory={"hbm_capacity_mb": None})
    rc, err, started = run_daemon(path)
    assert not started and rc == 4
    assert "device.kind is cuda but no GPU is visible" in one_error_line(err)
    assert not glob.glob(f"{tmp_path}/state/*.lock")


def test_socket_in_a_shared_folder_is_refused_and_the_folder_keeps_its_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    path = config(tmp_path, daemon={"endpoint": f"ipc://{shared}/dflash2.sock"})
    for args in (("--check",), ()):
        rc, err, started = run_daemon(path, *args)
        assert (oct(shared.stat().st_mode & 0o7777), started, rc) == ("0o1777", False, 2), err
        assert f"daemon.endpoint: the socket's folder {shared} is shared" in one_error_line(err)


def test_an_existing_socket_folder_keeps_its_mode_and_a_new_one_is_owner_only(tmp_path):
    # /run or a home folder holding the socket must not become owner-only (root's daemon would lock
    # everyone out of /run); a folder the daemon makes for its socket is owner-only.
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    rc, err, started = run_daemon(config(tmp_path, daemon={"endpoint": f"ipc://{mine}/dflash2.sock"}))
    assert (started, rc, oct(mine.stat().st_mode & 0o777)) == (True, 0, "0o755"), err
    fresh = tmp_path / "fresh" / "run"
    rc, err, started = run_daemon(config(tmp_path, daemon={"endpoint": f"ipc://{fresh}/dflash2.sock"}))
    assert (started, rc, oct(fresh.stat().st_mode & 0o777)) == (True, 0, "0o700"), err


def test_endpoint_on_a_regular_file_leaves_the_file_alone(tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    rc, err, started = run_daemon(config(tmp_path, daemon={"endpoint": f"ipc://{precious}"}))
    assert precious.read_text() == "keep me"
    assert not started and rc == 2
    assert f"daemon.endpoint: {precious} exists and is not a socket" in one_error_line(err)


def test_endpoint_on_a_folder_is_one_line_and_leaves_no_lock_file(tmp_path):
    folder = tmp_path / "sockdir"
    folder.mkdir()
    rc, err, started = run_daemon(config(tmp_path, daemon={"endpoint": f"ipc://{folder}"}))
    assert not started and rc == 2
    assert "daemon.endpoint" in one_error_line(err)
    assert folder.is_dir() and not (tmp_path / "sockdir.lock").exists()


@pytest.mark.parametrize("key, history", [("endpoint", False), ("state_dir", True)])
def test_folder_under_a_file_is_a_config_error(tmp_path, key, history):
    """The state folder holds the history (with an ipc endpoint too: it passed --check then, and the
    daemon kept its history in memory only). A tcp endpoint's lock file lives in the runtime folder
    (since 2026-12-05), so such an endpoint without history needs no state folder."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    daemon = ({"endpoint": f"ipc://{afile}/d.sock"} if key == "endpoint"
              else {"endpoint": f"ipc://{tmp_path}/d.sock", "state_dir": str(afile / "state")})
    rc, err, started = run_daemon(config(tmp_path, daemon=daemon, history_enabled=history), "--check")
    assert not started and rc == 2
    assert f"daemon.{key}: {afile} is not a folder" in one_error_line(err)
    tcp = {"endpoint": "tcp://127.0.0.1:5555", "state_dir": str(afile / "state")}
    rc, err, started = run_daemon(config(tmp_path, daemon=tcp, history_enabled=False), "--check")
    assert rc == 0, err


# ---- start-up interrupted ---------------------------------------------------------------------------


def killed_daemon(path, folder, until=None) -> int:
    """Start the daemon on `path` (in `folder`), wait for its start-up line (and for `until()`, when
    given), SIGKILL it; its pid."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(folder))
    try:
        for line in proc.stdout:
            if line.startswith("DFlash2: enabled"):
                break
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while until is not None and not until():
            assert time.monotonic() < deadline, "the daemon never came to the state asked for"
            time.sleep(0.1)
        proc.kill()
        proc.wait(timeout=STARTUP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return proc.pid


def test_a_killed_daemons_segments_are_given_back_by_the_next_one(tmp_path):
    # SIGKILL (the OOM killer) leaves the daemon's shared memory behind; the next daemon on the same
    # endpoint finds the dead one's pid in the lock file and removes the segments nobody holds.
    path = config(tmp_path)
    pid = killed_daemon(path, tmp_path)
    left = sorted(glob.glob(f"/dev/shm/dflash2-{pid}-*"))
    assert left, "the killed daemon left no segment: nothing to test"
    rc, err, started = run_daemon(path)
    assert (started, rc) == (True, 0), err
    assert glob.glob(f"/dev/shm/dflash2-{pid}-*") == []
    for segment in left:
        assert f"removed shared-memory segment {os.path.basename(segment)}" in err


def test_sigterm_during_startup_gives_back_every_segment(tmp_path):
    """SIGTERM while the daemon holds its arenas but does not serve yet (here: blocked reading its
    history file, as on a slow disk: the read waits on a FIFO this test holds open) must not leave
    the segments in /dev/shm. (A FIFO in the history's place is skipped now, not opened.)"""
    (tmp_path / "state").mkdir()
    fifo = tmp_path / "slow-disk"
    os.mkfifo(fifo)
    path = config(tmp_path, history_enabled=True)
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    daemon = ("import sys\n"
              "import dflash2.history as history\n"
              "read = history.read_file\n"
              "def slow(*args, **kw):\n"
              f"    open({str(fifo)!r}, 'rb').read()\n"
              "    return read(*args, **kw)\n"
              "history.read_file = slow\n"
              "from dflash2.daemon.main import main\n"
              f"sys.exit(main(['--config', {str(path)!r}]))\n")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", daemon], stdout=out, stderr=err, cwd=str(tmp_path))
    writer = -1
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while writer < 0:
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO until the daemon opens it
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                assert proc.poll() is None, err_path.read_text()
                assert "DFlash2: enabled" not in out_path.read_text(), "the daemon did not read its history"
                assert time.monotonic() < deadline, "the daemon never opened its history file"
                time.sleep(0.01)
        segments = [Path(f"/dev/shm/dflash2-{proc.pid}-{tier}") for tier in ("hbm", "dram")]
        assert all(s.exists() for s in segments)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=STARTUP_TIMEOUT_S)
        assert [s for s in segments if s.exists()] == [] and rc == 0, err_path.read_text()
        assert not (tmp_path / "d.sock.lock").exists() and not (tmp_path / "d.sock").exists()
        assert "Traceback" not in err_path.read_text()
    finally:
        if writer >= 0:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for leaked in glob.glob(f"/dev/shm/dflash2-{proc.pid}-*"):
            os.unlink(leaked)


@pytest.mark.parametrize("step", ["fallocate", "mmap"])
def test_interrupted_segment_creation_removes_the_segment(monkeypatch, instance_name, step):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if step == "fallocate":
        monkeypatch.setattr(shm_module.os, "posix_fallocate", interrupted)
    else:
        monkeypatch.setattr(shm_module.mmap, "mmap", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            SharedMemoryArena.create(instance_name, 1 << 20, Tier.DRAM)
        monkeypatch.undo()
        assert not os.path.exists(f"/dev/shm/{instance_name}")
    finally:
        if os.path.exists(f"/dev/shm/{instance_name}"):
            os.unlink(f"/dev/shm/{instance_name}")


# ---- the staging buffer -----------------------------------------------------------------------------


def test_staging_buffer_that_cannot_be_had_is_a_capacity_error(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(nvme_module, "StagingRing", no_memory)
    with pytest.raises(CapacityError, match="staging buffer .*memory.staging_buffer_size_mb"):
        NvmeArena.create(tmp_path / "nvme.bin", 1 << 20, staging_bytes=1 << 20)


def test_staging_buffer_above_available_memory_is_refused_before_it_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_module, "mem_available_bytes", lambda: 1 << 20, raising=False)
    with pytest.raises(CapacityError, match=f"needs {8 << 20} bytes .*only {1 << 20} available"):
        NvmeArena.create(tmp_path / "nvme.bin", 1 << 20, staging_bytes=8 << 20)


# ---- the operator command ---------------------------------------------------------------------------


def test_python_m_cli_reports_a_bad_config_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dflash2.cli", "history", "--config", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "config file not found" in one_error_line(out.stderr, prefix="dflash2: error: ")


def test_the_no_gpu_fallback_is_logged_with_what_it_ignores(caplog):
    # device.kind auto on a machine without a GPU: the fallback to host memory is said, and so are
    # the GPU ids it cannot honour (no silent fallback).
    import logging

    from dflash2.daemon.observe import log_fallbacks
    from dflash2.plan import resolve_plan

    cfg = parse_config({"enable": True, "device": {"kind": "auto", "gpu_ids": [0]},
                        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 8, "dram_capacity_mb": 16,
                                   "nvme_capacity_mb": 0}})
    plan = resolve_plan(cfg)
    if plan.device_kind != "host":
        pytest.skip("a GPU is visible here: no fallback to log")
    with caplog.at_level(logging.WARNING):
        log_fallbacks(cfg, plan)
    assert "no GPU: the device tier is in host memory" in caplog.text
    # The ignored ids: a warning of config_warnings, said once, by --check as by start-up (the
    # fallback said them, and --check nothing).
    assert "gpu_ids" not in caplog.text
    from dflash2.config_warnings import config_warnings
    assert config_warnings(cfg, mem_total_bytes=0, device_kind=plan.device_kind) == [
        "device.gpu_ids is ignored: device.kind auto found no GPU (the device tier is in host memory)"]


def test_client_liveness_by_signal_is_logged_as_a_fallback(caplog, monkeypatch):
    # /proc of another pid namespace (or none): the slower, looser check by signal 0 is said.
    import logging

    from dflash2.daemon import sessions
    from dflash2.daemon.observe import log_fallbacks
    from dflash2.plan import resolve_plan

    cfg = parse_config({"enable": True, "device": {"kind": "host"},
                        "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 8, "dram_capacity_mb": 16,
                                   "nvme_capacity_mb": 0}})
    plan = resolve_plan(cfg)
    with caplog.at_level(logging.WARNING):
        log_fallbacks(cfg, plan)
    assert "signal 0" not in caplog.text
    monkeypatch.setattr(sessions, "PROCFS", False)
    with caplog.at_level(logging.WARNING):
        log_fallbacks(cfg, plan)
    assert "whether a client's process still runs is asked by signal 0" in caplog.text


def test_check_says_whether_the_tiers_fit_this_machine_now(tmp_path):
    def check(path):
        out = subprocess.run([sys.executable, "-m", "dflash2.daemon.main", "--config", str(path), "--check"],
                             capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr  # the config is valid: these are lines to read
        return [line for line in out.stdout.splitlines() if line.startswith("now: ")]

    small = check(config(tmp_path))
    assert len(small) == 1 and small[0].startswith("now: host memory tiers take") and small[0].endswith(": fits")
    huge_mb = 4 * shm_module.mem_available_bytes() // (1 << 20)
    huge = check(config(tmp_path, memory={"dram_capacity_mb": huge_mb}))
    assert huge[0].endswith("start-up would fail now (exit 4)")
    foreign = tmp_path / "data.bin"
    foreign.write_bytes(b"not a cache")
    nvme = check(config(tmp_path, memory={"nvme_capacity_mb": 4, "nvme_path": str(foreign)}))
    assert nvme[-1] == f"now: {foreign} exists and is not a dflash2 NVMe cache file: start-up would refuse it (exit 4)"
    assert foreign.read_bytes() == b"not a cache"
    fresh = check(config(tmp_path, memory={"nvme_capacity_mb": 4, "nvme_path": str(tmp_path / "c" / "nvme.bin")}))
    assert fresh[-1].startswith("now: the NVMe file needs") and fresh[-1].endswith(": fits")


def test_a_restart_after_a_kill_says_what_it_found(tmp_path):
    # What the killed daemon left is named on the restart, never taken over silently: the daemon
    # itself (its pid), its socket file, its NVMe file (reused, its blocks dropped), its history.
    path = config(tmp_path, history_enabled=True, memory={"nvme_capacity_mb": 4, "nvme_path": "nvme.cache"})
    history = tmp_path / "state" / "history.jsonl"
    pid = killed_daemon(path, tmp_path, until=lambda: history.exists() and history.stat().st_size > 0)
    rc, err, started = run_daemon(path)
    assert (started, rc) == (True, 0), err
    assert f"(pid {pid}) did not shut down cleanly (killed?): its socket file was replaced" in err
    assert "took nvme tier: 4194304 bytes of" in err and "an earlier daemon's file, reused" in err
    assert "samples read back from" in err
