"""Config and command-line edges a review found silent or wrong: an empty or relative $HOME put `~`
paths under `/` or the working folder (a GB-sized NVMe file on the root disk, with no word); a tcp
port written with leading zeros named its key file so, where a client of the same port looked for
another name; `history --plot` given a folder or an empty name drew elsewhere or nothing, exit 0;
and `--check` gave every tier the HBM slot (and the first tier's alignment to all)."""

from __future__ import annotations

import os

import pytest

from dflash2 import cli
from dflash2.config import parse_config
from dflash2.endpoints import endpoint_parts
from dflash2.errors import ConfigError
from dflash2.plan import resolve_plan, rounding_warnings

MEMORY = {"hbm_reserve_mb": 0, "hbm_capacity_mb": 16, "dram_capacity_mb": 16, "nvme_capacity_mb": 32,
          "nvme_path": "~/.cache/dflash2/nvme.cache"}


@pytest.mark.parametrize("home", ["", "relhome"])
def test_a_home_that_is_not_an_absolute_path_is_refused_for_tilde_paths(tmp_path, monkeypatch, home):
    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    cfg = parse_config({"enable": True, "device": {"kind": "host"}, "memory": MEMORY}, source_path=tmp_path / "c.json")
    with pytest.raises(ConfigError, match=rf"memory.nvme_path: cannot expand '~'.*\$HOME is '{home}', not an absolute"):
        cfg.resolved_nvme_path
    with pytest.raises(ConfigError, match=r"daemon.state_dir.*\$HOME is"):
        cfg.resolved_state_dir(os.environ)


def test_a_tcp_port_with_leading_zeros_is_refused():
    with pytest.raises(ValueError, match="without leading zeros"):
        endpoint_parts("tcp://127.0.0.1:05599")
    assert endpoint_parts("tcp://127.0.0.1:5599") == ("tcp", "127.0.0.1:5599")


@pytest.mark.parametrize("given", ["", "{folder}/", "{folder}", "{folder}/.png"])
def test_history_plot_needs_a_file_name(tmp_path, capsys, given):
    folder = tmp_path / "plots"
    folder.mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["history", "--file", str(tmp_path / "h.jsonl"), "--plot", given.format(folder=folder)])
    assert e.value.code == 2 and "--plot" in capsys.readouterr().err
    assert not list(folder.iterdir())


def _plan(tmp_path, layout):
    return resolve_plan(parse_config({"enable": True, "device": {"kind": "host"},
                                      "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 64, "dram_capacity_mb": 64},
                                      "layouts": {"t": layout}}, source_path=tmp_path / "c.json"))


def test_check_gives_each_tiers_own_slot_and_alignment(tmp_path):
    one_kib = _plan(tmp_path, {"num_layers": 1, "num_kv_heads": 1, "head_dim": 256, "dtype": "bf16", "tokens_per_block": 1})
    [line] = [ln for ln in one_kib.render_text().splitlines() if ln.strip().startswith("t:")]
    assert line.endswith("slot 1.0 KiB in hbm, 4.0 KiB in dram"), line
    one_byte = _plan(tmp_path, {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "int4", "tokens_per_block": 1})
    [warning] = rounding_warnings(one_byte)
    assert "slots of 256 bytes in hbm (256-byte alignment)" in warning
    assert "slots of 4096 bytes in dram (4096-byte alignment)" in warning


def test_an_empty_config_path_names_no_file():
    from dflash2.config import load_config

    with pytest.raises(ConfigError, match="--config: names no file"):  # (it read the working folder: "Is a directory")
        load_config("")


def test_history_since_zero_is_no_time(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["history", "--since", "0"])
    assert e.value.code == 2 and "'0' is no time" in capsys.readouterr().err


def test_bench_policy_refuses_an_empty_policy_name():
    from dflash2.bench.policy import parse_policies
    from dflash2.bench import OptionError

    with pytest.raises(OptionError, match="has an empty name"):  # (dropped without a word)
        parse_policies("heat,,lru")


def test_with_history_off_an_unusable_home_does_not_stop_a_start(tmp_path, monkeypatch):
    """Only the history uses the state folder: its default, unresolvable with $HOME empty, refused a
    daemon that never uses it (a review of the $HOME rule)."""
    monkeypatch.setenv("HOME", "")
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    raw = {"enable": True, "device": {"kind": "host"}, "memory": {**MEMORY, "nvme_path": str(tmp_path / "n.cache")},
           "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock"}}
    plan = resolve_plan(parse_config(raw, source_path=tmp_path / "c.json"))
    assert plan.state_dir is None and "history is off" in plan.render_text()
    with pytest.raises(ConfigError, match=r"daemon.state_dir.*\$HOME is ''"):
        resolve_plan(parse_config({**raw, "history_enabled": True}, source_path=tmp_path / "c.json"))


def test_a_client_given_a_port_with_leading_zeros_is_told_so():
    from dflash2.client import Client

    with pytest.raises(ValueError, match="without leading zeros"):  # (it looked for tcp-05599.key: "is it running?")
        Client.connect(endpoint="tcp://127.0.0.1:05599", timeout_s=0.5, heartbeat=False)


def _a_config_here(tmp_path, monkeypatch):
    (tmp_path / "dflash2_config.json").write_text(
        '{"enable": true, "device": {"kind": "host"}, "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": 8, '
        f'"dram_capacity_mb": 8, "nvme_capacity_mb": 0}}, "daemon": {{"endpoint": "ipc://{tmp_path}/other.sock"}}}}')
    monkeypatch.chdir(tmp_path)


def test_an_empty_config_for_a_client_names_no_file_rather_than_using_another(tmp_path, monkeypatch):
    """`config=""` (a probe script's unset variable) was taken for "not given": ./dflash2_config.json's
    daemon was asked instead (a review)."""
    from dflash2.client.where import resolve_endpoint

    _a_config_here(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="names no file"):
        resolve_endpoint(None, "")


@pytest.mark.parametrize("command", ["status", "history"])
def test_an_empty_config_for_the_cli_names_no_file(tmp_path, monkeypatch, capsys, command):
    _a_config_here(tmp_path, monkeypatch)
    assert cli.main([command, "--config", ""]) == 2
    assert "names no file" in capsys.readouterr().err


def test_an_empty_history_file_names_no_file_rather_than_asking_a_daemon(tmp_path, monkeypatch, capsys):
    """`history --file "$F"` with F unset was taken for "no --file": the daemon of ./dflash2_config.json
    was asked instead (a review). Refused as `--config ""` is."""
    _a_config_here(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as ei:
        cli.main(["history", "--file", ""])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "argument --file: names no file (it was given '')" in err, err
    assert "other.sock" not in err


def test_an_empty_endpoint_is_refused_by_name_not_taken_for_none():
    from dflash2.client.where import resolve_endpoint

    with pytest.raises(ValueError, match="'' must start with ipc:// or tcp://"):
        resolve_endpoint("", None)


def test_a_socket_folder_behind_a_link_loop_is_named_without_the_runtime_folder_advice(tmp_path):
    """The advice for a folder that may not be entered (set XDG_RUNTIME_DIR) went with any error of
    the look, a link loop's too (a review): the loop is named alone."""
    from dflash2.daemon import main as dmain

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError) as ei:
        dmain._check_own_folder(loop / "run", "the socket's folder", "advice", unsearchable="set XDG_RUNTIME_DIR")
    assert "Too many levels of symbolic links" in str(ei.value) and "XDG_RUNTIME_DIR" not in str(ei.value)
