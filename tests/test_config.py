"""Config models, loading, warnings and the resolved plan (no subprocess; see test_cli_check.py)."""

import copy
import json

import pytest

from dflash2 import plan as plan_module
from dflash2.config import Config, default_endpoint, load_config, parse_config, require_enabled
from dflash2.config_warnings import check_environment, config_warnings
from dflash2.errors import ConfigError, DisabledError
from dflash2.plan import Gpu, resolve_plan

BASE = {
    "enable": True,
    "device": {"kind": "host"},
    "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 64, "dram_capacity_mb": 128,
               "nvme_capacity_mb": 256, "nvme_path": "cache/nvme.bin", "staging_buffer_size_mb": 32},
    "kv_block": {"block_size": 16},
    "layouts": {"small": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16"}},
}


def with_(path: str, value) -> dict:
    """BASE with one dotted key set (value None deletes it)."""
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return data


def error_of(data) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value


def test_base_config_loads_with_defaults():
    cfg = parse_config(BASE)
    assert cfg.policy.name == "lru"
    assert cfg.kv_block.prefetch_window == 4
    assert cfg.history_enabled is False
    assert cfg.policy.watermarks.hbm.low < cfg.policy.watermarks.hbm.high


def test_config_is_frozen():
    cfg = parse_config(BASE)
    with pytest.raises(Exception):
        cfg.enable = False


@pytest.mark.parametrize("path, value, key", [
    ("memory.dram_capacity_mb", -1, "memory.dram_capacity_mb"),
    ("memory.staging_buffer_size_mb", 0, "memory.staging_buffer_size_mb"),
    ("memory.page_kb", 96, "memory.page_kb"),
    ("memory.page_kb", 32, "memory.page_kb"),
    ("kv_block.block_size", 8, "kv_block.block_size"),
    ("kv_block.block_size", 8192, "kv_block.block_size"),
    ("policy.cold_threshold", 1.5, "policy.cold_threshold"),
    ("policy.swap_batch_size", 0, "policy.swap_batch_size"),
    ("policy.swap_batch_size", 65537, "policy.swap_batch_size"),
    ("policy.weights.fanout", -0.1, "policy.weights.fanout"),
    ("policy.decay_half_life_s", 0, "policy.decay_half_life_s"),
    ("policy.duel_sample", 1, "policy.duel_sample"),
    ("policy.duel_sample", -1, "policy.duel_sample"),
    ("policy.duel_sample", (1 << 20) + 1, "policy.duel_sample"),
    ("metrics.port", 70000, "metrics.port"),
    ("logging.format", "xml", "logging.format"),
    ("device.kind", "tpu", "device.kind"),
    ("device.gpu_ids", [0, 0], "device.gpu_ids"),
    ("device.gpu_ids", [-1], "device.gpu_ids[0]"),
    ("admission.max_deferred", 0, "admission.max_deferred"),
])
def test_out_of_bounds_names_the_key(path, value, key):
    assert error_of(with_(path, value)).key == key


@pytest.mark.parametrize("path, value", [
    ("memory.dram_capacity_mb", "128"),  # no coercion from strings
    ("memory.dram_capacity_mb", 128.0),  # nor from floats
    ("enable", 1),  # nor ints as booleans
])
def test_values_are_not_coerced(path, value):
    assert error_of(with_(path, value)).key == path


def test_unknown_key_named_with_full_path_and_suggestion():
    err = error_of(with_("memory.dram_capacty_mb", 5))
    assert err.key == "memory.dram_capacty_mb"
    assert "unknown key" in err.problem and "dram_capacity_mb" in err.problem
    assert error_of(with_("bogus", 1)).key == "bogus"
    nested = error_of(with_("layouts.small.head_dims", 64))
    assert nested.key == "layouts.small.head_dims" and "head_dim" in nested.problem


def test_missing_required_keys():
    assert error_of(with_("enable", None)).key == "enable"
    assert error_of(with_("memory.dram_capacity_mb", None)).key == "memory.dram_capacity_mb"


def test_watermark_low_must_be_below_high():
    err = error_of(with_("policy.watermarks.dram", {"high": 0.5, "low": 0.7}))
    assert err.key == "policy.watermarks.dram.low"
    assert error_of(with_("policy.watermarks.nvme", {"high": 0.5, "low": 0.5})).key == "policy.watermarks.nvme.low"


def test_heartbeat_must_be_below_lease():
    err = error_of(with_("daemon", {"lease_timeout_s": 5, "heartbeat_interval_s": 5}))
    assert err.key == "daemon.heartbeat_interval_s"


@pytest.mark.parametrize("endpoint", ["http://x:1", "ipc://", "tcp://host", "tcp://:5", "tcp://h:0", "sock"])
def test_endpoint_scheme_is_checked(endpoint):
    assert error_of(with_("daemon.endpoint", endpoint)).key == "daemon.endpoint"


def test_nvme_tier_needs_a_path():
    data = with_("memory.nvme_path", None)
    assert error_of(data).key == "memory.nvme_path"
    data["memory"]["nvme_capacity_mb"] = 0
    assert parse_config(data).resolved_nvme_path is None


def test_host_device_needs_hbm_capacity():
    assert error_of(with_("memory.hbm_capacity_mb", None)).key == "memory.hbm_capacity_mb"


def test_layouts_become_layout_objects_with_block_size_default():
    data = with_("layouts.wide", {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "fp8_e4m3",
                                  "tokens_per_block": 32})
    layouts = parse_config(data).layout_objects()
    assert layouts["small"].tokens_per_block == 16
    assert layouts["small"].block_bytes == 4 * 2 * 16 * 2 * 64 * 2
    assert layouts["wide"].tokens_per_block == 32


def test_bad_layouts_name_the_layout():
    assert error_of(with_("layouts.small.dtype", "bf17")).key == "layouts.small.dtype"
    assert error_of(with_("layouts.small.num_kv_heads", 0)).key == "layouts.small"
    assert error_of(with_("layouts.bad name", BASE["layouts"]["small"])).key == "layouts.bad name"


def test_staging_must_hold_a_block():
    data = with_("layouts.huge", {"num_layers": 64, "num_kv_heads": 8, "head_dim": 128, "dtype": "fp32",
                                  "tokens_per_block": 256})  # 128 MiB > 32 MB of staging
    assert error_of(data).key == "memory.staging_buffer_size_mb"


def test_load_config_resolves_paths_against_its_folder(tmp_path):
    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "c.json"
    path.write_text(json.dumps(with_("daemon.endpoint", "ipc://run/d.sock")))
    cfg = load_config(path)
    assert cfg.source_path == path
    assert cfg.memory.nvme_path == "cache/nvme.bin"  # the user's value is kept as written
    assert cfg.resolved_nvme_path == folder / "cache" / "nvme.bin"
    assert cfg.resolved_endpoint() == f"ipc://{folder / 'run' / 'd.sock'}"


def test_home_expands_in_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_config(with_("memory.nvme_path", "~/x/nvme.bin"))
    assert cfg.resolved_nvme_path == tmp_path / "x" / "nvme.bin"


def test_default_endpoint_uses_runtime_folder():
    assert default_endpoint({"XDG_RUNTIME_DIR": "/run/user/7"}) == "ipc:///run/user/7/dflash2/dflash2.sock"
    assert default_endpoint({}).startswith("ipc:///tmp/dflash2-")


def test_tcp_endpoint_is_kept():
    cfg = parse_config(with_("daemon.endpoint", "tcp://127.0.0.1:5555"))
    assert cfg.resolved_endpoint() == "tcp://127.0.0.1:5555"


def test_json_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "enable": true,\n  "memory": {,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == str(path) and "line 3" in info.value.problem


def test_duplicate_keys_are_an_error(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"enable": true, "enable": false}')
    with pytest.raises(ConfigError, match="twice"):
        load_config(path)


@pytest.mark.parametrize("text, key", [
    ('{"policy": {"watermarks": {"hbm": {"high": 0.9}, "dram": {"high": 0.9, "high": 0.95}}}}',
     "policy.watermarks.dram.high"),
    ('{"layouts": {"a": {"num_layers": 1}, "a": {"num_layers": 2}}}', "layouts.a"),
    ('{"x": [{"k": 1}, {"k": 1, "k": 2}]}', "x[1].k"),
])
def test_a_key_named_twice_is_named_by_its_whole_path(tmp_path, text, key):
    """Three tiers have a `high`: the error named only "high" (a review)."""
    path = tmp_path / "dup.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key and "twice" in info.value.problem


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.json")


def test_require_enabled(tmp_path):
    path = tmp_path / "off.json"
    path.write_text(json.dumps(with_("enable", False)))
    cfg = load_config(path)
    with pytest.raises(DisabledError, match=r"disabled: `enable` is false in .*off\.json"):
        require_enabled(cfg)
    require_enabled(parse_config(BASE))


def test_config_warnings():
    assert config_warnings(parse_config(BASE), mem_total_bytes=1 << 40) == []
    churn = config_warnings(parse_config(with_("policy.cold_threshold", 0.99)), mem_total_bytes=1 << 40)
    assert len(churn) == 1 and "policy.cold_threshold" in churn[0] and "churn" in churn[0]
    big = config_warnings(parse_config(BASE), mem_total_bytes=150 << 20)  # 128 MB of 150 MB
    assert len(big) == 1 and "memory.dram_capacity_mb" in big[0] and "80%" in big[0]


def test_config_warnings_name_settings_that_stop_the_background_drain():
    """Both in bounds, both silent before: a tier never drains in the background (a review)."""
    cold = config_warnings(parse_config(with_("policy.cold_threshold", 0.0)), mem_total_bytes=1 << 40)
    assert len(cold) == 1 and "policy.cold_threshold is 0: no block counts as cold" in cold[0]
    full = config_warnings(parse_config(with_("policy.watermarks.dram", {"high": 1.0, "low": 0.5})),
                           mem_total_bytes=1 << 40)
    assert full == [w for w in full if "policy.watermarks.dram.high is 1.0" in w] and len(full) == 1


def test_config_warnings_count_the_host_stand_in_and_name_ignored_gpu_ids():
    # 64 MB of DRAM alone is under 80% of 150 MB, but the 64 MB HBM stand-in is host memory too.
    both = config_warnings(parse_config(with_("memory.dram_capacity_mb", 64)), mem_total_bytes=150 << 20)
    assert len(both) == 1 and "come to 128 MB" in both[0] and "memory.hbm_capacity_mb" in both[0]
    cuda = with_("memory.dram_capacity_mb", 64)
    cuda["device"] = {"kind": "cuda"}
    assert config_warnings(parse_config(cuda), mem_total_bytes=150 << 20) == []  # HBM is GPU memory there
    ids = config_warnings(parse_config(with_("device.gpu_ids", [0, 1])), mem_total_bytes=1 << 40)
    assert ids == ["device.gpu_ids is ignored: device.kind is host (the device tier is in host memory)"]


def test_an_nvme_file_without_a_capacity_is_said_to_be_ignored():
    """memory.nvme_capacity_mb left out (its default 0): no NVMe tier, said; the plan showed the file
    as if it were used, and nothing was said (a review)."""
    from dflash2.plan import resolve_plan

    cfg = parse_config(with_("memory.nvme_capacity_mb", None))
    warnings = config_warnings(cfg, mem_total_bytes=1 << 40)
    assert warnings == ["memory.nvme_path (cache/nvme.bin) is ignored: memory.nvme_capacity_mb is 0 (its default), so "
                        "there is no NVMe tier; set memory.nvme_capacity_mb to use the file"]
    plan = resolve_plan(cfg)
    assert plan.nvme_path is None and "nvme file:   (no NVMe tier)" in plan.render_text()
    assert config_warnings(parse_config(BASE), mem_total_bytes=1 << 40) == []


def test_check_environment_names_the_key_to_use():
    env = {"DFLASH_DRAM_LIMIT": "64G", "DFLASH_OFFLOAD_ENABLE": "1", "DFLASH_SOMETHING": "x", "PATH": "/bin"}
    warnings = check_environment(env)
    assert len(warnings) == 3
    assert any("DFLASH_DRAM_LIMIT" in w and "memory.dram_capacity_mb" in w and "ignored" in w for w in warnings)
    assert any("DFLASH_OFFLOAD_ENABLE" in w and "`enable`" in w for w in warnings)
    assert any("DFLASH_SOMETHING" in w and "no effect" in w for w in warnings)
    assert check_environment({"PATH": "/bin"}) == []


# --- plan -------------------------------------------------------------------------------------------


def test_host_plan_counts_blocks_per_layout():
    plan = resolve_plan(parse_config(BASE))
    block = plan.layouts["small"].block_bytes  # 32 KiB: 64 per 2 MiB page
    assert block == 32 * 1024
    assert [t.tier.label for t in plan.tiers] == ["hbm", "dram", "nvme"]
    assert [t.blocks["small"] for t in plan.tiers] == [64 * 32, 128 * 32, 256 * 32]
    assert [t.alignment for t in plan.tiers] == [256, 4096, 4096]
    assert plan.total_bytes == (64 + 128 + 256) << 20
    assert plan.to_dict()["tiers"][0]["blocks"] == {"small": 2048}
    assert "small" in plan.render_text()


def test_auto_without_gpu_is_host_and_needs_capacity(monkeypatch):
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: None)
    assert resolve_plan(parse_config(with_("device.kind", "auto"))).device_kind == "host"
    data = with_("device.kind", "auto")
    del data["memory"]["hbm_capacity_mb"]
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(data))
    assert info.value.key == "memory.hbm_capacity_mb"


def test_cuda_plan_is_device_memory_minus_reserve(monkeypatch):
    gpus = [Gpu(0, "fake", 8 << 30), Gpu(1, "fake", 8 << 30)]
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: gpus)
    data = with_("device", {"kind": "auto", "gpu_ids": [1]})
    data["memory"].update(hbm_reserve_mb=1024, hbm_capacity_mb=None)
    plan = resolve_plan(parse_config(data))
    assert plan.device_kind == "cuda"
    assert [(t.where, t.capacity_bytes) for t in plan.tiers[:1]] == [("cuda:1", 7 << 30)]
    data["memory"]["hbm_capacity_mb"] = 512  # a cap below what is left
    assert resolve_plan(parse_config(data)).tiers[0].capacity_bytes == 512 << 20


def test_cuda_plan_errors(monkeypatch):
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: [Gpu(0, "fake", 4 << 30)])
    too_much = with_("device", {"kind": "cuda"})
    too_much["memory"]["hbm_reserve_mb"] = 8192
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(too_much))
    assert info.value.key == "memory.hbm_reserve_mb"
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(with_("device", {"kind": "cuda", "gpu_ids": [3]})))
    assert info.value.key == "device.gpu_ids"


def test_a_reserve_that_leaves_less_than_a_page_is_an_error(monkeypatch):
    """A GPU whose reserve left less than one page: --check showed an HBM tier of that size, and the
    daemon started with an HBM tier of no page, holding no block (a tier set that small by
    memory.hbm_capacity_mb is refused: MemoryConfig)."""
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: [Gpu(0, "fake", 4097 << 20)])
    data = with_("device", {"kind": "cuda"})
    data["memory"].update(hbm_reserve_mb=4096, hbm_capacity_mb=None, page_kb=2048)
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(data))
    assert info.value.key == "memory.hbm_reserve_mb"
    assert str(info.value) == ("memory.hbm_reserve_mb: 4096 MB leaves 1048576 bytes of GPU 0's 4097 MB (fake), less "
                               "than one page (memory.page_kb is 2048 KB): the HBM tier would hold no block")
    data["memory"]["hbm_reserve_mb"] = 4095  # one page left: a tier
    assert resolve_plan(parse_config(data)).tiers[0].capacity_bytes == 2 << 20


def test_cuda_plan_without_visible_gpu_is_unknown(monkeypatch):
    monkeypatch.setattr(plan_module, "probe_gpus", lambda: [])
    plan = resolve_plan(parse_config(with_("device.kind", "cuda")))
    assert plan.tiers[0].capacity_bytes is None and plan.tiers[0].blocks == {"small": None}
    assert plan.total_bytes is None
    assert "unknown until start-up" in plan.render_text()


def test_ipc_path_too_long_is_an_error():
    with pytest.raises(ConfigError) as info:
        resolve_plan(parse_config(with_("daemon.endpoint", "ipc:///" + "x" * 120)))
    assert info.value.key == "daemon.endpoint"


def test_shipped_configs_are_valid():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    for name in ("dflash2_config.json", "deploy/dflash2_config.production.json"):
        cfg = load_config(root / name)
        assert isinstance(cfg, Config) and cfg.enable


@pytest.mark.parametrize("endpoint, host, clash", [
    ("tcp://127.0.0.1:9464", "127.0.0.1", True), ("tcp://0.0.0.0:9464", "127.0.0.1", True),
    ("tcp://127.0.0.1:9464", "0.0.0.0", True), ("tcp://10.0.0.5:9464", "127.0.0.1", False),
    ("tcp://127.0.0.1:5555", "127.0.0.1", False), ("ipc:///tmp/d.sock", "127.0.0.1", False),
])
def test_metrics_on_the_control_endpoints_port_is_a_config_error(endpoint, host, clash):
    data = with_("daemon.endpoint", endpoint)
    data["metrics"] = {"port": 9464, "host": host}
    if clash:
        err = error_of(data)
        assert err.key == "metrics.port" and "daemon.endpoint's port" in str(err)
    else:
        parse_config(data)


@pytest.mark.parametrize("host", ["node1..example.com", "a" * 64 + ".example.com"])
def test_a_metrics_host_the_resolver_cannot_take_is_refused_by_key(host):
    """The resolver's IDNA step raised UnicodeError (not OSError) for an empty or long label:
    `--check` and start-up ended in a traceback (a review)."""
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "metrics": {"host": host, "port": 9400}})
    assert info.value.key == "metrics.host" and "label" in info.value.problem


def test_the_metrics_probe_names_a_host_it_cannot_encode():
    from dflash2.daemon.endpoint import EndpointBusy, probe_metrics

    with pytest.raises(EndpointBusy, match=r"cannot serve metrics on node1\.\.example\.com:9400 \(metrics\.host"):
        probe_metrics("node1..example.com", 9400)
