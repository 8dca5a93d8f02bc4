"""Config and command-line input that used to end in a traceback, a misleading line or a silent
fallback: each now gets one line naming what is wrong, with the documented exit code."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import write_config

from dflash2 import cli
from dflash2.arena.shm import mem_available_bytes
from dflash2.config import load_config, parse_config
from dflash2.config_warnings import config_warnings, machine_memory_bytes
from dflash2.daemon import main as dmain
from dflash2.errors import ConfigError


def check(path, *extra) -> tuple[int, list[str], list[str]]:
    """`dflash2d --config path --check` in this process: (exit code, stdout lines, stderr lines)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dmain.main(["--config", str(path), "--check", *extra])
    return rc, out.getvalue().splitlines(), err.getvalue().splitlines()


def one_error(err: list[str]) -> str:
    errors = [line for line in err if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("dflash2d: error: "), err
    return errors[0]


def now_lines(out: list[str]) -> list[str]:
    return [line for line in out if line.startswith("now: ")]


# -- paths ------------------------------------------------------------------------------------
@pytest.mark.parametrize("section, key, value", [
    ("memory", "nvme_path", "~no-such-user-dflash2/nvme.cache"),
    ("daemon", "endpoint", "ipc://~no-such-user-dflash2/d.sock"),
    ("daemon", "state_dir", "~no-such-user-dflash2/state"),
])
def test_a_home_folder_that_cannot_be_found_is_named(tmp_path, section, key, value):
    path = write_config(tmp_path, **{section: {key: value}})
    rc, _, err = check(path)
    assert rc == 2
    assert one_error(err) == (f"dflash2d: error: {section}.{key}: cannot expand '~no-such-user-dflash2' in "
                              f"'{value.removeprefix('ipc://')}': user 'no-such-user-dflash2' has no home "
                              "directory here; give an absolute path")


def test_a_config_path_whose_home_cannot_be_found_is_named():
    with pytest.raises(ConfigError, match="--config: cannot expand '~no-such-user-dflash2'"):
        load_config("~no-such-user-dflash2/dflash2_config.json")


@pytest.mark.parametrize("key", ["daemon.endpoint", "daemon.state_dir"])
def test_a_folder_the_daemon_may_not_write_is_refused_before_start(tmp_path, monkeypatch, key):
    """(Run as root, every folder is writable: the kernel's answer is stood in for.)"""
    locked = tmp_path / "locked"
    locked.mkdir()
    section = {"endpoint": f"ipc://{locked}/sub/d.sock"} if key == "daemon.endpoint" else \
        {"state_dir": str(locked / "state")}
    path = write_config(tmp_path, daemon=section, history_enabled=key == "daemon.state_dir")
    real = os.access
    monkeypatch.setattr(dmain.os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    rc, _, err = check(path)
    assert rc == 2
    assert one_error(err) == (f"dflash2d: error: {key}: the daemon's user (uid {os.geteuid()}) cannot create files "
                              f"in {locked} (permission denied): give a folder it may write, or run it as a user "
                              "who may")


def test_a_folder_the_daemon_may_not_search_is_named_not_a_traceback(tmp_path, monkeypatch):
    path = write_config(tmp_path, daemon={"endpoint": f"ipc://{tmp_path}/hidden/d.sock"})
    hidden = tmp_path / "hidden"

    def exists(self, *a, **k):
        if self == hidden:
            raise PermissionError(13, "Permission denied")
        return real_exists(self, *a, **k)

    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", exists)
    rc, _, err = check(path)
    assert rc == 2 and one_error(err) == f"dflash2d: error: daemon.endpoint: cannot look at {hidden}: Permission denied"


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "folder", "is a folder, not the NVMe cache file's path; give the path of the file in it"),
    (lambda tmp: tmp / "dflash2_config.json" / "nvme", "is not a folder, so the NVMe file"),
    (lambda tmp: Path("/dev/null"), "/dev/null exists and is not a regular file"),
    (lambda tmp: Path("/proc/dflash2-no-such/nvme.cache"), "/proc is on a filesystem of no blocks (such as /proc or "
                                                           "/sys), so the NVMe file"),  # (was "0 are free there")
])
def test_check_says_an_nvme_file_that_cannot_be_made_would_fail(tmp_path, make, says):
    (tmp_path / "folder").mkdir()
    path = write_config(tmp_path, memory={"nvme_path": str(make(tmp_path))})
    rc, out, _ = check(path)
    assert rc == 0
    assert says in now_lines(out)[-1] and now_lines(out)[-1].endswith("start-up would fail now (exit 4)")


def test_check_says_an_nvme_folder_the_daemon_may_not_write_would_fail(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(dmain.os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    rc, out, _ = check(write_config(tmp_path, memory={"nvme_path": str(locked / "cache" / "nvme.cache")}))
    assert rc == 0
    assert now_lines(out)[-1] == (f"now: the daemon's user (uid {os.geteuid()}) cannot create files in {locked}: "
                                  "start-up would fail now (exit 4)")


def test_check_counts_the_staging_buffer_in_the_memory_it_needs(tmp_path):
    avail = mem_available_bytes()
    staging_mb = avail // (1 << 20) + 1024
    rc, out, _ = check(write_config(tmp_path, memory={"staging_buffer_size_mb": staging_mb}))
    assert rc == 0
    line = now_lines(out)[0]
    assert f"and the staging buffers {staging_mb << 20} bytes of memory" in line
    assert line.endswith("start-up would fail now (exit 4)")


@pytest.mark.parametrize("memory, says", [
    ({"staging_buffer_size_mb": 64, "nvme_capacity_mb": 16}, "fits in no tier"),
    # No client can write it (allocate takes HBM or DRAM): `--check` said only host-side writers could.
    ({"hbm_capacity_mb": 16, "dram_capacity_mb": 16, "staging_buffer_size_mb": 64, "nvme_capacity_mb": 64},
     "fits in neither HBM nor DRAM, where clients write their blocks"),
])
def test_a_layout_that_no_client_can_write_is_named(tmp_path, memory, says):
    big = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16", "tokens_per_block": 256}
    rc, _, err = check(write_config(tmp_path, memory=memory, layouts={"big": big}))
    assert rc == 2
    assert one_error(err).startswith(f"dflash2d: error: layouts.big: a block of 33554432 bytes {says}"), err


def test_a_layout_that_fits_no_hbm_block_gets_a_note(tmp_path):
    mid = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16", "tokens_per_block": 64}
    path = write_config(tmp_path, memory={"hbm_capacity_mb": 4, "dram_capacity_mb": 64, "staging_buffer_size_mb": 16,
                                          "page_kb": 2048}, layouts={"mid": mid})
    rc, out, _ = check(path)
    assert rc == 0
    assert "note: layouts.mid: no block of 8388608 bytes fits in HBM: only host-side writers (tier dram) can use it" in out


# -- JSON -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, problem", [
    ('{"enable": true, "memory": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid JSON: nested too deeply"),
    ('{"enable": ' + "9" * 5000 + "}", "invalid JSON: Exceeds the limit (4300 digits)"),
])
def test_json_the_parser_cannot_take_is_one_line(tmp_path, text, problem):
    path = tmp_path / "c.json"
    path.write_text(text)
    rc, _, err = check(path)
    assert rc == 2 and one_error(err).startswith(f"dflash2d: error: {path}: {problem}")


@pytest.mark.parametrize("line, problem", [
    ('{"timestamp": ' + "9" * 5000 + ', "hash_ids": [1]}', "not JSON (Exceeds the limit (4300 digits)"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply)"),
])
def test_a_trace_line_the_parser_cannot_take_is_named(tmp_path, capsys, line, problem):
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "policy", "--trace", str(trace), "--hbm-blocks", "4", "--policies", "lru"])
    assert e.value.code == 2
    assert f"--trace {trace}, line 1: {problem}" in capsys.readouterr().err


# -- keys -------------------------------------------------------------------------------------
def base() -> dict:
    return {"enable": True, "device": {"kind": "host"},
            "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0}}


@pytest.mark.parametrize("extra, message", [
    ({"memory.dram_capacity_mb": 5}, '"memory.dram_capacity_mb" (at the top level): unknown key; keys are nested '
                                     'objects, not dotted names: write {"memory": {"dram_capacity_mb": ...}}'),
    ({"": 1}, '"" (at the top level): unknown key'),
    ({"foo\nbar": 1}, '"foo\\nbar" (at the top level): unknown key'),
])
def test_odd_keys_are_quoted_in_one_line(extra, message):
    with pytest.raises(ConfigError) as e:
        parse_config({**base(), **extra})
    assert str(e.value) == message and "\n" not in str(e.value)


def test_an_odd_nested_key_is_quoted():
    data = base()
    data["memory"] = {**data["memory"], "": 1}
    with pytest.raises(ConfigError, match='^memory."": unknown key$'):
        parse_config(data)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:\u0663\u0663", "tcp://127.0.0.1:\u00b2"])
def test_a_port_in_other_digits_is_refused(endpoint):
    with pytest.raises(ConfigError, match="must be tcp://HOST:PORT with a port in 1..65535"):
        parse_config({**base(), "daemon": {"endpoint": endpoint}})


@pytest.mark.parametrize("endpoint", ["tcp://:31701", "tcp://[]:31701"])
def test_a_tcp_endpoint_without_a_host_names_the_host(endpoint):
    """`tcp://:31701` was told of "a port in 1..65535" (a review): the port was fine, the host missing.
    `tcp://[]:31701`, its host empty once the brackets are off, passed the check (a review)."""
    with pytest.raises(ConfigError, match=re.escape(f"daemon.endpoint: '{endpoint}' names no host: write "
                                                    "tcp://HOST:PORT, such as tcp://127.0.0.1:31701")):
        parse_config({**base(), "daemon": {"endpoint": endpoint}})


@pytest.mark.parametrize("endpoint", ["tcp://[::1:31701", "tcp://::1]:31701", "tcp://[[::1]]:31701",
                                      "tcp://[::1]]:31701"])
def test_a_tcp_endpoint_with_unmatched_brackets_is_refused(endpoint):
    """`tcp://[::1:31701` passed the check, and start-up failed to bind it (exit 4; a review)."""
    with pytest.raises(ConfigError, match=re.escape(f"daemon.endpoint: '{endpoint}' has unmatched brackets: write "
                                                    "an IPv6 address as tcp://[ADDRESS]:PORT")):
        parse_config({**base(), "daemon": {"endpoint": endpoint}})
    assert parse_config({**base(), "daemon": {"endpoint": "tcp://[::1]:31701"}}).daemon.endpoint == "tcp://[::1]:31701"


@pytest.mark.parametrize("endpoint", ["tcp://[::1]", "tcp://[2001:db8::1]"])
def test_a_bracketed_tcp_endpoint_without_a_port_names_the_port(endpoint):
    """`tcp://[::1]`, its brackets matched and its port left out, was told of "unmatched brackets" (a review)."""
    with pytest.raises(ConfigError, match=re.escape(f"daemon.endpoint: '{endpoint}' names no port: write "
                                                    f"{endpoint}:PORT")):
        parse_config({**base(), "daemon": {"endpoint": endpoint}})


def test_empty_brackets_without_a_port_are_not_told_to_add_a_port():
    """`tcp://[]` was told to write `tcp://[]:PORT`, which is then refused as naming no host (a review)."""
    with pytest.raises(ConfigError) as e:
        parse_config({**base(), "daemon": {"endpoint": "tcp://[]"}})
    assert "tcp://[]:PORT" not in str(e.value) and "tcp://HOST:PORT" in str(e.value), e.value


@pytest.mark.parametrize("endpoint", ["tcp://[::1]]", "tcp://[[::1]]", "tcp://[[]]"])
def test_brackets_within_brackets_are_not_told_to_add_a_port(endpoint):
    """`tcp://[::1]]` was told to write `tcp://[::1]]:PORT`, which is then refused for its unmatched
    brackets (a review)."""
    with pytest.raises(ConfigError) as e:
        parse_config({**base(), "daemon": {"endpoint": endpoint}})
    assert f"{endpoint}:PORT" not in str(e.value), e.value


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_metrics_on_the_endpoints_port_of_loopback_by_another_name_is_refused(host):
    with pytest.raises(ConfigError, match="metrics.port: 9511 is daemon.endpoint's port too"):
        parse_config({**base(), "daemon": {"endpoint": "tcp://localhost:9511"},
                      "metrics": {"port": 9511, "host": host}})


@pytest.mark.parametrize("endpoint, host", [("tcp://[::1]:9511", "::1"), ("tcp://[::1]:9511", "0:0:0:0:0:0:0:1"),
                                            ("tcp://[::]:9511", "::1"), ("tcp://10.0.0.1:9511", "::")])
def test_metrics_on_the_endpoints_port_of_one_ipv6_address_is_refused(endpoint, host):
    """The endpoint's host keeps the brackets tcp:// puts around an IPv6 address, metrics.host has
    none: they were told apart, and the daemon then failed to start (exit 4, address in use)."""
    with pytest.raises(ConfigError, match="metrics.port: 9511 is daemon.endpoint's port too"):
        parse_config({**base(), "daemon": {"endpoint": endpoint}, "metrics": {"port": 9511, "host": host}})


@pytest.mark.parametrize("endpoint, host", [("tcp://127.0.0.1:9511", "0"), ("tcp://127.0.0.1:9511", "127.1"),
                                            ("tcp://localhost:9511", "0x7f.1"), ("tcp://0:9511", "10.1.2.3")])
def test_metrics_on_the_endpoints_port_of_an_address_in_shorthand_is_refused(endpoint, host):
    """`0` is 0.0.0.0 and `127.1` is 127.0.0.1 to the resolver: only the literal spellings were
    compared, --check passed, and start-up took the tiers, then failed to bind the endpoint on the
    port its own metrics server held (exit 4, a review)."""
    with pytest.raises(ConfigError, match="metrics.port: 9511 is daemon.endpoint's port too"):
        parse_config({**base(), "daemon": {"endpoint": endpoint}, "metrics": {"port": 9511, "host": host}})


@pytest.mark.parametrize("host", ["127.0.0.2", "127.2", "node1.example"])
def test_metrics_on_the_endpoints_port_of_another_address_is_taken(host):
    cfg = parse_config({**base(), "daemon": {"endpoint": "tcp://127.0.0.1:9511"}, "metrics": {"port": 9511, "host": host}})
    assert cfg.metrics.host == host  # (kept as written: a name is not looked up at config time)


@pytest.mark.parametrize("endpoint, connect", [
    ("tcp://*:9511", "tcp://127.0.0.1:9511"), ("tcp://0.0.0.0:9511", "tcp://127.0.0.1:9511"),
    ("tcp://[::]:9511", "tcp://[::1]:9511"), ("tcp://10.1.2.3:9511", "tcp://10.1.2.3:9511"),
    ("tcp://[::1]:9511", "tcp://[::1]:9511")])
def test_clients_of_a_daemon_bound_to_every_address_connect_to_loopback(endpoint, connect):
    """The config a daemon binds `tcp://*:PORT` from is the one its clients (sglang's flag, `dflash2
    status --config`, Client.connect(config=)) connect with: to `*` nobody can connect."""
    cfg = parse_config({**base(), "daemon": {"endpoint": endpoint}})
    assert cfg.resolved_endpoint() == endpoint and cfg.client_endpoint() == connect


def test_metrics_on_another_loopback_address_may_share_the_port():
    cfg = parse_config({**base(), "daemon": {"endpoint": "tcp://127.0.0.1:9511"},
                        "metrics": {"port": 9511, "host": "127.0.0.2"}})
    assert cfg.metrics.port == 9511


@pytest.mark.parametrize("name, policy, warned", [
    ("lru", {"weights": {"recency": 2.0}}, "policy.weights is ignored: only the heat policy uses it, and policy.name is 'lru'"),
    ("lfu", {"weights": {"recency": 2.0}, "decay_half_life_s": 5.0},
     "policy.decay_half_life_s and policy.weights are ignored: only the heat policy uses them"),
    ("heat", {"weights": {"recency": 2.0}, "decay_half_life_s": 5.0}, None),
    ("lru", {}, None)])
def test_heat_settings_under_another_policy_are_warned_about(name, policy, warned):
    """Dropped without a word before (the default policy.name is lru: a config that tunes heat's
    weights but names no policy lost them)."""
    cfg = parse_config({**base(), "policy": {**base().get("policy", {}), "name": name, **policy}})
    found = [w for w in config_warnings(cfg, mem_total_bytes=1 << 50) if "only the heat policy" in w]
    assert found == ([] if warned is None else [found[0]]) and (warned is None or warned in found[0])


def test_the_memory_warning_counts_the_stand_in_of_auto_resolved_to_host():
    cfg = parse_config({**base(), "device": {"kind": "auto"},
                        "memory": {**base()["memory"], "hbm_capacity_mb": 100, "dram_capacity_mb": 100}})
    assert config_warnings(cfg, mem_total_bytes=150 << 20, device_kind="cuda") == []
    [warning] = config_warnings(cfg, mem_total_bytes=150 << 20, device_kind="host")
    assert "the host stand-in for HBM (memory.hbm_capacity_mb, 100 MB) come to 200 MB" in warning


def test_check_warns_on_the_resolved_device_kind(tmp_path):
    total = machine_memory_bytes()
    if not total:
        pytest.skip("no /proc/meminfo")
    half = int(0.45 * total) >> 20  # each under 80% of the machine, both together over it
    path = write_config(tmp_path, device={"kind": "auto"}, memory={"hbm_capacity_mb": half, "dram_capacity_mb": half})
    rc, out, err = check(path)
    assert rc == 0
    if "device: host" not in "\n".join(out) and "resolved to host" not in "\n".join(out):
        pytest.skip("a GPU is visible: auto resolves to cuda")
    assert any("the host stand-in for HBM" in line for line in err), err


# -- the operator's commands ------------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv, option", [
    (("status", "--endpoint", "tcp://127.0.0.1:9", "--timeout", "1e16"), "--timeout"),
    (("history", "--endpoint", "tcp://127.0.0.1:9", "--timeout", "1e300"), "--timeout"),
    (("status", "--endpoint", "tcp://127.0.0.1:9", "--watch", "--interval", "1e10"), "--interval"),
    (("history", "--endpoint", "tcp://127.0.0.1:9", "--since", "99999999999999d"), "--since"),
    (("bench", "swap", "--mb", "0"), "--mb"),
    (("bench", "swap", "--repeat", "0"), "--repeat"),
    (("bench", "swap", "--chain", "-1"), "--chain"),
])
def test_out_of_range_options_are_named(capsys, argv, option):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and f"argument {option}: " in err and "Traceback" not in err, err


def test_bench_without_a_name_names_only_the_name(capsys):
    rc, _, err = run_cli(capsys, "bench")
    assert rc == 2 and "bench: name the benchmark, one of table, nvme, policy" in err
    assert "bench_args" not in err


@pytest.mark.parametrize("option", [("--interval", "5"), ("--count", "3")])
def test_watch_options_without_watch_are_refused(capsys, tmp_path, option):
    rc, _, err = run_cli(capsys, "status", "--endpoint", f"ipc://{tmp_path}/none.sock", *option)
    assert rc == 2 and f"dflash2 status: error: {option[0]} only goes with --watch" in err


def test_json_with_watch_is_refused(capsys, tmp_path):
    """It printed the text frames, exit 0, as if --json had not been given (a review)."""
    rc, out, err = run_cli(capsys, "status", "--endpoint", f"ipc://{tmp_path}/none.sock", "--watch", "--json")
    assert rc == 2 and "dflash2 status: error: --json does not go with --watch" in err and not out


def test_a_watch_that_never_got_an_answer_exits_1(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "status", "--endpoint", f"ipc://{tmp_path}/none.sock", "--watch", "--count", "2",
                         "--interval", "0.01")
    assert rc == 1
    frames = [line for line in out.splitlines() if line.startswith("daemon unavailable")]
    assert len(frames) == 2 and frames[0].endswith("; asking again") and not frames[1].endswith("asking again")


def test_history_tells_a_refusal_from_no_daemon(capsys, tmp_path):
    """A daemon that answers with an error is not "not running": the refusal is named, exit 2."""
    import zmq

    from dflash2 import protocol as P

    endpoint = f"ipc://{tmp_path}/d.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)

    def serve():
        ident, *frames = router.recv_multipart()
        req = P.decode_request(frames)
        router.send_multipart([ident, *P.encode_reply(P.Reply(req.call_id, False, {}, "ProtocolError",
                                                              "history: argument 'since_s' is odd"))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        rc, _, err = run_cli(capsys, "history", "--endpoint", endpoint, "--since", "1d")
    finally:
        thread.join(5)
        router.close(0)
    assert rc == 2
    assert f"dflash2d at {endpoint} refused the history call: ProtocolError: history: argument 'since_s' is odd" in err
    assert "is dflash2d running" not in err


def test_history_does_not_ask_whether_a_daemon_it_names_by_pid_runs(capsys, tmp_path):
    """A daemon that holds the endpoint and does not answer (stuck, or taking its tiers): the call's
    timeout names its pid, and history added "is dflash2d running?" after it, as if none might run
    (status says it without; a review, SIGSTOP on a daemon)."""
    import fcntl

    import zmq

    endpoint = f"ipc://{tmp_path}/d.sock"
    lock = os.open(f"{tmp_path}/d.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(lock, f"{os.getpid()}\n".encode())
    fcntl.flock(lock, fcntl.LOCK_EX)  # (as a daemon holds it)
    mute = zmq.Context.instance().socket(zmq.ROUTER)  # takes the call, never answers
    mute.bind(endpoint)
    try:
        for command in (("history",), ("status",)):
            rc, _, err = run_cli(capsys, *command, "--endpoint", endpoint, "--timeout", "0.3")
            assert rc == 1 and f"dflash2d pid {os.getpid()} holds the endpoint" in err, (command, err)
            assert "running?" not in err, (command, err)
    finally:
        mute.close(0)
        os.close(lock)


def test_history_and_status_say_when_what_answers_is_not_dflash2d(capsys, tmp_path):
    """Another ZeroMQ program on the endpoint echoing frames back: before, `dflash2 status` said
    `Error: ` and history that dflash2d refused the call with `Error: `."""
    import zmq

    endpoint = f"ipc://{tmp_path}/d.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)

    def echo():
        for _ in range(2):
            router.send_multipart(router.recv_multipart())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        for command in (("history",), ("status",)):
            rc, _, err = run_cli(capsys, *command, "--endpoint", endpoint, "--timeout", "5")
            assert rc == 1 and "not a dflash2d reply" in err, (command, err)
    finally:
        thread.join(5)
        router.close(0)


def _read_only_mount(folder: Path, command: str) -> "subprocess.CompletedProcess":
    """`command` run where `folder` is bound read-only onto itself (a mount namespace of its own:
    root and unshare(1) needed), as a filesystem remounted read-only after errors is."""
    import shutil
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a read-only mount")
    script = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && {command}"
    out = subprocess.run(["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, timeout=120)
    if "mount:" in out.stderr:
        pytest.skip(f"cannot mount here: {out.stderr.strip()}")
    return out


def test_a_state_folder_on_a_read_only_filesystem_is_named_as_that(tmp_path):
    """Root passes the access check there, so the error said "permission denied ... run it as a user
    who may" (a review's script); the write fails with EROFS. The NVMe file's `now:` line too."""
    import sys
    state = tmp_path / "state"
    state.mkdir()
    path = write_config(tmp_path, daemon={"state_dir": str(state)}, history_enabled=True,
                        memory={"nvme_path": str(state / "nvme.cache")})
    out = _read_only_mount(state, f"{sys.executable} -m dflash2.daemon.main --config {path} --check")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"daemon.state_dir: {state} is on a read-only filesystem" in out.stderr, out.stderr


def test_a_test_config_keeps_its_state_in_the_tests_folder(tmp_path):
    """conftest's write_config puts daemon.state_dir under the test's tmp_path: a test daemon with
    history on wrote its samples into the user's ~/.local/state/dflash2, which the user's own daemon
    then read back as its history (a fresh user's run of the README's test command)."""
    from conftest import write_config

    from dflash2.config import load_config
    from dflash2.plan import resolve_plan

    plan = resolve_plan(load_config(write_config(tmp_path, history_enabled=True)))
    assert str(plan.state_dir).startswith(str(tmp_path))
