"""Config values that passed validation and then misbehaved (found by a review of config, plan and
--check): a short lease with the default heartbeat, a multi-GPU split that leaves a GPU without a
tier, control characters in paths, a config file nested too deeply, a cuda config on a machine
without a GPU or without CuPy, relative XDG folders."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpu_node, write_config

from dflash2 import plan as plan_module
from dflash2.config import default_endpoint, parse_config
from dflash2.config_warnings import check_environment
from dflash2.daemon import main as dmain
from dflash2.errors import ConfigError
from dflash2.plan import resolve_plan

MB = 1 << 20
HOST_MEMORY = {"hbm_reserve_mb": 0, "hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0}


def run(*argv) -> tuple[int, list[str], list[str]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dmain.main(list(argv))
    return rc, out.getvalue().splitlines(), err.getvalue().splitlines()


def host(**sections) -> dict:
    return {"enable": True, "device": {"kind": "host"}, "memory": dict(HOST_MEMORY), **sections}


# -- leases ------------------------------------------------------------------------------------------

def test_a_lease_no_longer_than_the_default_heartbeat_is_refused():
    """A lease of 1 s with the heartbeat left at its default (2 s) was taken: every idle client lost
    its lease between heartbeats, its blocks set aside (pydantic does not check defaults)."""
    with pytest.raises(ConfigError) as info:
        parse_config(host(daemon={"lease_timeout_s": 1.0}))
    assert info.value.key == "daemon.heartbeat_interval_s"
    assert info.value.problem.endswith("got 2.0 (its default): a lease this short needs "
                                       "daemon.heartbeat_interval_s set below it")
    with pytest.raises(ConfigError) as info:  # both set: nothing said of the default
        parse_config(host(daemon={"lease_timeout_s": 10, "heartbeat_interval_s": 15}))
    assert info.value.problem == "must be below daemon.lease_timeout_s (10.0), got 15.0"
    assert parse_config(host(daemon={"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.25})).daemon.lease_timeout_s == 1


# -- several GPUs ------------------------------------------------------------------------------------

def test_a_tier_whose_share_per_gpu_is_under_a_page_is_refused(tmp_path, monkeypatch):
    """14 MB of DRAM on 8 GPUs with 2 MiB pages: each pool's 1.75 MB rounded to no page, and every
    GPU started without a DRAM tier while --check showed one."""
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(gpu_node(tmp_path, monkeypatch, 8, dram_capacity_mb=14)))
    assert info.value.key == "memory.dram_capacity_mb" and "split between 8 GPUs" in info.value.problem
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(gpu_node(tmp_path, monkeypatch, 8, nvme_capacity_mb=14)))
    assert info.value.key == "memory.nvme_capacity_mb"


def test_a_layout_that_fits_the_node_but_no_gpus_share_is_refused(tmp_path, monkeypatch):
    big = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8192, "dtype": "fp32", "tokens_per_block": 192}  # 12 MiB
    raw = gpu_node(tmp_path, monkeypatch, 4, dram_capacity_mb=32, nvme_capacity_mb=32, staging_buffer_size_mb=16)
    raw["memory"]["hbm_capacity_mb"] = 8
    raw["layouts"] = {"big": big}
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(raw))
    assert info.value.key == "layouts.big" and "in the pool of cuda:0: each GPU takes 1/4" in info.value.problem
    raw["memory"].update(dram_capacity_mb=64)  # 16 MiB a GPU: one block fits
    assert resolve_plan(parse_config(raw)).pools == 4


def test_check_looks_at_each_gpus_nvme_file_and_their_room_together(tmp_path, monkeypatch):
    path = tmp_path / "node.json"
    path.write_text(json.dumps(gpu_node(tmp_path, monkeypatch, 4)))
    plan = resolve_plan(parse_config(json.loads(path.read_text())))
    assert plan.nvme_files() == [tmp_path / f"nvme.cache.gpu{i}" for i in range(4)]
    assert any(note.startswith("4 GPUs: each GPU's block pool takes 16.0 MiB of dram and 16.0 MiB of nvme")
               for note in plan.notes)
    rc, out, _ = run("--config", str(path), "--check")
    now = [line for line in out if line.startswith("now: ")]
    assert rc == 0 and now[-1].startswith(f"now: 4 NVMe files (one per GPU) need {4 * (16 * MB + 4096)} bytes "
                                          f"in all at {tmp_path / 'nvme.cache.gpu0'} to {tmp_path / 'nvme.cache.gpu3'}")
    (tmp_path / "nvme.cache.gpu2").write_bytes(b"someone's data")  # the file GPU 2's pool would open
    now = [line for line in run("--config", str(path), "--check")[1] if line.startswith("now: ")]
    assert now[-1] == (f"now: {tmp_path / 'nvme.cache.gpu2'} exists and is not a dflash2 NVMe cache file: "
                       "start-up would refuse it (exit 4)")



def test_check_names_the_nvme_files_of_gpus_with_a_gap_between_them_each(tmp_path, monkeypatch):
    """device.gpu_ids [1, 3]: their files were said "nvme.cache.gpu1 to nvme.cache.gpu3", as if GPU
    2's were among them."""
    raw = gpu_node(tmp_path, monkeypatch, 4)
    raw["device"]["gpu_ids"] = [1, 3]
    path = tmp_path / "node.json"
    path.write_text(json.dumps(raw))
    files = f"{tmp_path / 'nvme.cache.gpu1'}, {tmp_path / 'nvme.cache.gpu3'}"
    assert any(note.endswith(f"; NVMe files {files}") for note in resolve_plan(parse_config(raw)).notes)
    rc, out, _ = run("--config", str(path), "--check")
    now = [line for line in out if line.startswith("now: ")]
    assert rc == 0 and f"NVMe files (one per GPU) need {2 * (32 * MB + 4096)} bytes in all at {files};" in now[-1], now

def test_check_names_each_nvme_file_whose_links_lead_to_folders_of_one_disk(tmp_path, monkeypatch):
    """Three GPUs' files linked to a folder each on one disk were said "a/nvme.cache.gpu0 to
    c/nvme.cache.gpu2": b's file, never named, read as if in a's or c's folder (a review)."""
    path = tmp_path / "node.json"
    path.write_text(json.dumps(gpu_node(tmp_path, monkeypatch, 3)))
    for i, folder in enumerate("abc"):
        (tmp_path / folder).mkdir()
        (tmp_path / f"nvme.cache.gpu{i}").symlink_to(tmp_path / folder / f"nvme.cache.gpu{i}")
    files = ", ".join(str(tmp_path / folder / f"nvme.cache.gpu{i}") for i, folder in enumerate("abc"))
    rc, out, _ = run("--config", str(path), "--check")
    now = [line for line in out if line.startswith("now: ")]
    assert rc == 0 and now[-1].startswith("now: 3 NVMe files (one per GPU) need "), now
    assert f" bytes in all at {files};" in now[-1], now


def test_check_measures_each_gpus_nvme_file_on_the_disk_its_link_leads_to(tmp_path, monkeypatch):
    """`nvme.cache.gpuN` linked to a disk per GPU: start-up takes each on its target's disk, and
    --check measured them all on the links' folder (a review of the fix: "would fail" for files
    that fit, "fits" for one that did not)."""
    other = Path("/dev/shm") / f"dflash2-test-{os.getpid()}-{tmp_path.name}"
    other.mkdir()
    try:
        if os.stat(other).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm is not another filesystem here")
        path = tmp_path / "node.json"
        path.write_text(json.dumps(gpu_node(tmp_path, monkeypatch, 2, nvme_capacity_mb=8)))
        (tmp_path / "nvme.cache.gpu1").symlink_to(other / "gpu1.cache")
        now = [line for line in run("--config", str(path), "--check")[1] if line.startswith("now: ")]
        need = 4 * MB + 4096
        assert now[-2].startswith(f"now: the NVMe file needs {need} bytes at {tmp_path / 'nvme.cache.gpu0'};")
        assert now[-1].startswith(f"now: the NVMe file needs {need} bytes at {other / 'gpu1.cache'};")
    finally:
        for f in other.iterdir():
            f.unlink()
        other.rmdir()


def test_check_says_a_cuda_config_cannot_start_where_no_gpu_is_visible(tmp_path, monkeypatch):
    raw = gpu_node(tmp_path, monkeypatch, 0)
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: None)
    path = tmp_path / "node.json"
    path.write_text(json.dumps(raw))
    rc, out, _ = run("--config", str(path), "--check")
    assert rc == 0  # valid for the machine it is meant for
    assert "now: device.kind is cuda and no GPU is visible here (the driver, CUDA_VISIBLE_DEVICES): start-up " \
           "would fail now (exit 4)" in out


# The shipped config on a GPU node set up as the README says, with no `gpu` extra: a stand-in GPU as
# gpu_node's, and CuPy's import failing (sys.modules None makes `import cupy` raise ImportError).
SHIPPED = Path(__file__).resolve().parent.parent / "dflash2_config.json"
STARTS_WITHOUT_CUPY = """
import sys
from dflash2 import plan
from dflash2.daemon.main import main
plan.probe_gpus = lambda: [plan.Gpu(0, "fake", 8 << 30)]
sys.modules["cupy"] = None
sys.exit(main(["--config", sys.argv[1]]))
"""


def _shipped_config_on_a_gpu_node(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: [plan_module.Gpu(0, "fake", 8 << 30)])
    monkeypatch.setitem(sys.modules, "cupy", None)
    raw = json.loads(SHIPPED.read_text())
    raw["memory"]["nvme_path"] = str(tmp_path / "nvme.cache")
    raw["daemon"].update(endpoint=f"ipc://{tmp_path}/d.sock", state_dir=str(tmp_path / "state"))
    path = tmp_path / "dflash2_config.json"
    path.write_text(json.dumps(raw))
    return path


def test_check_says_the_cuda_path_cannot_start_without_cupy(tmp_path, monkeypatch):
    """A review: `auto` resolved to cuda, --check said every tier fits and nothing of CuPy, and
    start-up then exited 4 'the CUDA path needs CuPy'. --check now says so, in start-up's words, and
    start-up still refuses (a GPU without CuPy is still visible: auto means cuda there, not host)."""
    path = _shipped_config_on_a_gpu_node(tmp_path, monkeypatch)
    rc, out, _ = run("--config", str(path), "--check")
    assert rc == 0  # valid: installing CuPy is what it takes
    said = [line for line in out if "CuPy" in line]  # (the import's own error between: Python's words vary)
    assert len(said) == 1 and said[0].startswith("now: the CUDA path needs CuPy (pip install 'dflash2[gpu]'): ")
    assert said[0].endswith(": start-up would fail now (exit 4); on CUDA 13 install cupy-cuda13x instead, or set "
                            "device.kind host to leave the GPU out"), said
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    started = subprocess.run([sys.executable, "-c", STARTS_WITHOUT_CUPY, str(path)], env=env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 4, started.stderr
    assert "the CUDA path needs CuPy (pip install 'dflash2[gpu]')" in started.stderr


# -- text that cannot be a path ----------------------------------------------------------------------

@pytest.mark.parametrize("section, key, value", [
    ("memory", "nvme_path", "cache/a\u0000b"),
    ("daemon", "state_dir", "state\ndflash2d: ok"),
    ("daemon", "endpoint", "tcp://127.0.0.1\u0000:5556"),
    ("daemon", "endpoint", "ipc://sock\r"),
    ("metrics", "host", "127.0.0.1\u0000"),
])
def test_control_characters_in_paths_are_refused_by_key(tmp_path, section, key, value):
    """A NUL passed --check and start-up ended in a traceback (ValueError: embedded null byte); a
    newline split the one-line error naming the path."""
    path = write_config(tmp_path, **{section: {key: value}})
    rc, out, err = run("--config", path, "--check")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"dflash2d: error: {section}.{key}: holds a control "
                                                           "character")


@pytest.mark.parametrize("section, key, value", [
    ("memory", "nvme_path", " /mnt/nvme/nvme.cache"),
    ("daemon", "state_dir", "state "),
    ("daemon", "endpoint", "ipc://sock\u00a0"),
    ("daemon", "tcp_key_file", "keys/tcp.key "),
    ("metrics", "host", " 127.0.0.1"),
])
def test_white_space_at_the_ends_of_a_path_is_refused_by_key(tmp_path, section, key, value):
    """" /mnt/nvme/nvme.cache" (a space pasted in) passed --check and start-up: a relative path, its
    file made under the config's folder in a folder named " "; a metrics host with one passed the
    config and failed the start (exit 4, a name that does not resolve)."""
    path = write_config(tmp_path, **{section: {key: value}})
    rc, out, err = run("--config", path, "--check")
    assert rc == 2 and err == [f"dflash2d: error: {section}.{key}: begins or ends with white space, which a path or "
                               f"address here cannot: remove it (got {json.dumps(value)})"], err


@pytest.mark.parametrize("endpoint", ["tcp:// 127.0.0.1:19481", "tcp://127.0.0.1 :19481", "tcp://[::1 ]:19481"])
def test_a_tcp_host_with_white_space_is_refused(tmp_path, endpoint):
    """It passed the config (exit 0 from --check) and start-up failed to bind it, exit 4: no address
    or host name has a space."""
    rc, out, err = run("--config", write_config(tmp_path, daemon={"endpoint": endpoint}), "--check")
    assert rc == 2 and len(err) == 1 and err[0].startswith("dflash2d: error: daemon.endpoint: ") \
        and "holds white space" in err[0], err


@pytest.mark.parametrize("key, value, what", [
    ("endpoint", "ipc://{tmp}/sockdir/", "the socket's"),
    ("endpoint", "ipc://{tmp}/sockdir/.", "the socket's"),
    ("tcp_key_file", "{tmp}/keys/", "the key file's"),
])
def test_a_file_path_ending_in_a_slash_is_refused_by_key(tmp_path, key, value, what):
    """As memory.nvme_path: the slash went when the path was resolved, and a socket, or a key file,
    was made named `sockdir` or `keys`, the folder meant (a review)."""
    value = value.format(tmp=tmp_path)
    daemon = {"endpoint": "tcp://127.0.0.1:19481", key: value} if key == "tcp_key_file" else {key: value}
    rc, out, err = run("--config", write_config(tmp_path, daemon=daemon), "--check")
    end, example = value[-1], f"{value.rstrip('/')}/{'dflash2.sock' if key == 'endpoint' else 'tcp.key'}"
    assert rc == 2 and err == [f"dflash2d: error: daemon.{key}: {value!r} ends in '{end}', a folder; give {what} "
                               f"path in it (e.g. {example}) (got \"{value}\")"], err
    assert not (tmp_path / "sockdir").exists() and not (tmp_path / "keys").exists()


def test_a_config_nested_too_deeply_is_one_line_at_start_up_too(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200000 + "]" * 200000)
    rc, _, err = run("--config", str(path))  # (--check said so; a start ended in a RecursionError)
    assert rc == 2 and len(err) == 1 and "nested too deeply" in err[0]


@pytest.mark.parametrize("value, problem", [
    ("[::1]", "an IPv6 address is written without brackets here: ::1"),
    ("[127.0.0.1]", "an address is written without brackets here: 127.0.0.1"),  # (no colon: it passed, a review)
    ("[localhost]", "not an address or a host name: give the host alone, such as 127.0.0.1 or ::1 (metrics.port "
                    "is the port)"),
    ("0.0.0.0:9464", "not an address or a host name: give the host alone, such as 127.0.0.1 or ::1 (metrics.port "
                     "is the port)"),
    ("http://node1", "not an address or a host name: give the host alone, such as 127.0.0.1 or ::1 (metrics.port "
                     "is the port)"),
])
def test_a_metrics_host_the_resolver_cannot_read_is_refused_by_key(value, problem):
    """An IPv6 address in brackets (as daemon.endpoint writes it), or a host with its port or scheme,
    passed validation, and start-up then exited 4: "Name or service not known"."""
    with pytest.raises(ConfigError) as info:
        parse_config(host(metrics={"port": 9464, "host": value}))
    assert info.value.key == "metrics.host" and info.value.problem == f'{problem} (got "{value}")', value
    for ok in ("::1", "fe80::1%lo", "127.0.0.1", "localhost", "0.0.0.0"):
        assert parse_config(host(metrics={"port": 9464, "host": ok})).metrics.host == ok


def test_a_config_saved_with_a_byte_order_mark_is_told_what_to_do(tmp_path):
    """A file saved as "UTF-8 with BOM" (a Windows editor's default) was told json's words to its
    programmer: "Unexpected UTF-8 BOM (decode using utf-8-sig)"."""
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(host()).encode())
    rc, _, err = run("--config", str(path), "--check")
    assert rc == 2 and err == [f"dflash2d: error: {path}: invalid JSON: the file begins with a byte-order mark "
                               "(bytes EF BB BF), which JSON does not allow; save it as UTF-8 without a BOM"], err


@pytest.mark.parametrize("text, key", [
    ('{"a\\nb": 1, "a\\nb": 2}', '"a\\nb" (at the top level)'),
    ('{"": 1, "": 2}', '"" (at the top level)'),
    ('{"layouts": {"llama3.1": {"dtype": "bf16", "dtype": "fp16"}}}', 'layouts."llama3.1".dtype'),
    ('{"device": {"gpu_ids": [0], "kind": "host", "kind": "cuda"}}', "device.kind"),
    # (a key named as pydantic's marker for a bad dict key: dropped, the object above it was named)
    ('{"layouts": {"[key]": {"dtype": "bf16"}, "[key]": {"dtype": "fp16"}}}', 'layouts."[key]"'),
    ('{"[key]": 1, "[key]": 2}', '"[key]" (at the top level)'),
])
def test_a_key_named_twice_is_named_as_any_other_key_is(tmp_path, text, key):
    """A key named twice was named by its path joined with dots as written: a key with a newline split
    the one-line error in two, an empty one read ": appears twice", a layout named with a dot read as
    more keys. Now quoted as an unknown or invalid key is (config_errors)."""
    path = tmp_path / "twice.json"
    path.write_text(text)
    rc, _, err = run("--config", str(path), "--check")
    assert rc == 2 and err == [f"dflash2d: error: {key}: appears twice in one object (JSON keeps the last; "
                               "which did you mean?)"], err


# -- XDG folders -------------------------------------------------------------------------------------

def test_relative_xdg_folders_are_ignored_and_said_to_be():
    """A relative XDG_RUNTIME_DIR put the socket where each process's working folder said: a client
    started elsewhere looked for another socket. The XDG spec says to ignore it."""
    assert default_endpoint({"XDG_RUNTIME_DIR": "relrun"}) == f"ipc:///tmp/dflash2-{os.getuid()}/dflash2.sock"
    assert default_endpoint({"XDG_RUNTIME_DIR": "/run/user/7"}) == "ipc:///run/user/7/dflash2/dflash2.sock"
    cfg = parse_config(host())
    assert cfg.resolved_state_dir({"XDG_STATE_HOME": "relstate", "HOME": "/home/u"}) == Path(
        "~/.local/state").expanduser() / "dflash2"
    warnings = check_environment({"XDG_RUNTIME_DIR": "relrun", "XDG_STATE_HOME": "/abs"})
    assert warnings == ["environment variable XDG_RUNTIME_DIR is relative ('relrun'): ignored, as the XDG base "
                        "directory spec says; the default folder stands in for it"]


def test_each_gpus_share_is_planned_in_whole_pages_and_what_is_left_warned_of(tmp_path, monkeypatch):
    """A review's script: with two GPUs each pool takes half of DRAM in whole pages again: 100 MiB in
    32 MiB pages gave the pools 32 MiB each while the plan showed 96 MiB and warned of 4 unused."""
    from dflash2.assemble import tier_specs
    from dflash2.plan import rounding_warnings
    from dflash2.tiers import Tier
    raw = gpu_node(tmp_path, monkeypatch, 2, dram_capacity_mb=100, nvme_capacity_mb=0, page_kb=32768,
                   staging_buffer_size_mb=16, hbm_capacity_mb=64)
    plan = resolve_plan(parse_config(raw))
    used = sum(s.capacity_bytes for hbm in plan.tiers if hbm.tier == Tier.HBM
               for s in tier_specs(plan, hbm, plan.pools) if s.tier == Tier.DRAM)
    dram = next(t for t in plan.tiers if t.tier == Tier.DRAM)
    assert used == dram.capacity_bytes == 64 << 20 and dram.unused_bytes == 36 << 20
    warned = [w for w in rounding_warnings(plan) if w.startswith("memory.dram_capacity_mb")]
    assert len(warned) == 1 and "36.0 MiB of it stays unused" in warned[0], warned
    # per GPU: 96 MiB is three whole pages, yet 32 of it stays unused (a review's script: the advice
    # said a multiple of the page would waste nothing)
    assert "not a whole number of pages per GPU (2 GPUs" in warned[0] and "the page times 2 wastes" in warned[0]


# -- numbers past a float's range ----------------------------------------------------------------------

@pytest.mark.parametrize("section, value, key, bounds", [
    ({"policy": {"cold_threshold": 10 ** 400}}, 10 ** 400, "policy.cold_threshold", ">= 0 and <= 1"),
    ({"admission": {"reservation_ttl_s": -10 ** 400}}, -10 ** 400, "admission.reservation_ttl_s", "> 0 and <= 86400"),
    ({"policy": {"watermarks": {"dram": {"high": 0.9, "low": 10 ** 400}}}}, 10 ** 400, "policy.watermarks.dram.low",
     "> 0 and < 1"),
], ids=["cold_threshold", "reservation_ttl_s", "watermark_low"])
def test_an_integer_past_a_floats_range_is_refused_with_the_keys_bounds(section, value, key, bounds):
    """JSON allows 10**400: a float key given it said "Input should be a valid number", of a number,
    and named no bound (a review; set_weights on the wire names the weight's bound)."""
    with pytest.raises(ConfigError) as info:
        parse_config(host(**section))
    assert info.value.key == key
    assert info.value.problem == f"a number past a float's range; give a number {bounds} (got {value})"


@pytest.mark.parametrize("name", ["a" * 65, "llama/8b", "-x", ""])
def test_a_layout_name_that_is_not_one_is_said_in_words(tmp_path, name):
    """A layout name past 64 characters, or with a character a name cannot have, was told only the
    pattern: `String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'`."""
    layout = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "dtype": "fp16"}
    rc, out, err = run("--config", write_config(tmp_path, layouts={name: layout}), "--check")
    assert rc == 2 and len(err) == 1, err
    assert ": not a layout name: a letter or digit, then letters, digits, '.', '_' or '-', 64 characters at most " \
           f"(got {json.dumps(name)}, {len(name)} characters)" in err[0] and "pattern" not in err[0], err


@pytest.mark.parametrize("endpoint_host, metrics_host", [("node-a.test", "127.0.0.1"), ("127.0.0.1", "node-a.test")])
def test_metrics_on_the_endpoints_port_behind_a_name_is_refused_before_start(tmp_path, monkeypatch, endpoint_host,
                                                                             metrics_host):
    """A name (the node's own, 127.0.0.1 in /etc/hosts) on one side and its address on the other, one
    port: the config compares no names, each probe alone found its port free, --check passed, and
    start-up failed binding the endpoint once every tier was taken ("Address already in use": its own
    metrics server held it), exit 4."""
    monkeypatch.setattr(plan_module, "_addresses", lambda h: {"127.0.0.1"} if h == "node-a.test" else set(),
                        raising=False)
    cfg = parse_config(host(daemon={"endpoint": f"tcp://{endpoint_host}:19483"},
                            metrics={"port": 19483, "host": metrics_host}))
    with pytest.raises(ConfigError) as info:
        resolve_plan(cfg)
    assert info.value.key == "metrics.port" and "resolves here to the same address (127.0.0.1)" in str(info.value)
    # Another port, or a name that resolves elsewhere: no collision.
    resolve_plan(parse_config(host(daemon={"endpoint": f"tcp://{endpoint_host}:19483"},
                                   metrics={"port": 19484, "host": metrics_host})))
    monkeypatch.setattr(plan_module, "_addresses", lambda h: {"127.0.0.2"} if h == "node-a.test" else set())
    resolve_plan(cfg)


@pytest.mark.parametrize("nvme_path, history, what", [
    ("{tmp}/d.sock", False, "daemon.endpoint's socket"),
    ("{tmp}/d.sock.lock", False, "daemon.endpoint's lock file"),
    ("{tmp}/state/history.jsonl", True, "the history's history.jsonl in daemon.state_dir"),
    ("{tmp}/state/history.jsonl.1", True, "the history's history.jsonl.1 in daemon.state_dir"),
    ("{tmp}/state", True, "daemon.state_dir"),
])
def test_an_nvme_file_at_the_path_of_another_of_the_daemons_files_is_refused(tmp_path, nvme_path, history, what):
    """--check passed it and the daemon started: the socket was made over the NVMe file (the tier then
    found its file replaced), or the history rotated the 64 MiB cache file away as history.jsonl.1."""
    nvme_path = nvme_path.format(tmp=tmp_path)
    path = write_config(tmp_path, memory={"nvme_path": nvme_path}, history_enabled=history)
    rc, out, err = run("--config", path, "--check")
    assert rc == 2 and err == [f"dflash2d: error: memory.nvme_path: {nvme_path} is {what} too: the daemon would make "
                               "both files at one path; give the NVMe file a path of its own"], err
    # Without the history its files are none of the daemon's: the path is free.
    if history and nvme_path.endswith("jsonl"):
        assert run("--config", write_config(tmp_path, memory={"nvme_path": nvme_path}), "--check")[0] == 0
