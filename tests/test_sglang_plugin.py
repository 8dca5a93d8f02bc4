"""The sglang integration's pure parts, without sglang: key namespacing, the flag's rewriting and
its fallback verdicts (against the real daemon subprocess). The parts that need sglang are in
test_sglang.py."""

from __future__ import annotations

import argparse
import json
import logging
import os

import pytest

from daemon_proc import DaemonProcess
from dflash2.client.sglang import clears
from dflash2.client.sglang.identity import server_args
from dflash2.client.sglang.keys import KeyMapper, Shard, namespace
from dflash2.client.sglang.plugin import HBM_NOTE_BYTES, Verdict, backend_extra_config, check_dflash2, hbm_note, rewrite_args


def mapper(**shard) -> KeyMapper:
    return KeyMapper(namespace(Shard(model=shard.pop("model", "llama"), **shard), "MHA/page_first"))


def test_keys_are_nonzero_stable_and_namespaced():
    a = mapper(tp_rank=0, tp_size=2)
    keys = a.keys(["p0", "p1"])
    assert keys.dtype.name == "uint64" and all(int(k) != 0 for k in keys)
    assert list(keys) == list(mapper(tp_rank=0, tp_size=2).keys(["p0", "p1"]))  # another process
    assert a.key("p0") != mapper(tp_rank=1, tp_size=2).key("p0")  # another rank's shard
    assert a.key("p0") != mapper(model="qwen", tp_rank=0, tp_size=2).key("p0")
    assert a.key("p0") != KeyMapper(namespace(Shard("llama", 0, 2), "MHA/layer_first")).key("p0")


def test_mla_pages_are_shared_by_every_tp_rank_but_not_across_stages():
    assert mapper(is_mla=True, tp_rank=0, tp_size=4).key("p") == mapper(is_mla=True, tp_rank=3, tp_size=4).key("p")
    assert mapper(is_mla=True, pp_rank=0, pp_size=2).key("p") != mapper(is_mla=True, pp_rank=1, pp_size=2).key("p")
    assert mapper(is_mla=True).key("p") != mapper().key("p")


def test_stages_holding_other_layers_never_share():
    """SGLANG_PP_LAYER_PARTITION gives two servers of one model other layers at one pp rank: the
    stage's first layer is in the namespace (with the rank and the layer count alone, stage 1 of 10,10,12
    and of 12,10,10 read each other's pages, KV of other layers, a review)."""
    assert mapper(pp_rank=1, pp_size=3, pp_start_layer=10).key("p") != \
        mapper(pp_rank=1, pp_size=3, pp_start_layer=12).key("p")
    assert mapper(pp_rank=1, pp_size=3, pp_start_layer=10).key("p") == \
        mapper(pp_rank=1, pp_size=3, pp_start_layer=10).key("p")


def test_a_clear_epoch_is_a_fresh_key_space_and_epoch_0_is_as_before():
    """`DFlash2Storage.clear` moves a server to its next clear epoch: none of the keys it had before;
    a server that never cleared keeps the namespace it had (shared with every server of its identity)."""
    shard = Shard("llama")
    assert clears.KeySpace("abc", 0).tag() == "" and clears.KeySpace(None).tag() == ""
    assert namespace(shard, "MHA/page_first", "id1", clear="") == namespace(shard, "MHA/page_first", "id1")
    tags = [clears.KeySpace("abc", e).tag() for e in range(3)]
    assert len({KeyMapper(namespace(shard, "MHA/page_first", "id1", clear=t)).key("p") for t in tags}) == 3


def test_two_launches_that_each_cleared_once_have_their_own_key_spaces():
    """Servers A and B of one identity that each cleared once (A after an update to W2, B after its
    role switch or an update to W3) were both at `|clear=1` and read each other's KV (a review)."""
    # (ranks no other test uses, one a server: each server's rank is a process of its own, and a rank
    # of one process that has cleared keeps its key space whatever token it is given later)
    rank_a, rank_b = (("llama", "tp=0/1", clears.new_launch()) for _ in range(2))
    a = clears.bump(clears.resume(clears.new_launch(), rank_a), rank_a)
    b = clears.bump(clears.resume(clears.new_launch(), rank_b), rank_b)
    assert a.epoch == b.epoch == 1 and a.tag() != b.tag() and a.tag() == f"{a.launch}.1"


def test_a_backend_made_again_continues_from_its_launchs_clears_and_ranks_clear_in_step():
    """sglang's detach + attach makes a new backend in the process: it started at epoch 0 again, in
    the key space of the weights before the update (a review). Each rank counts its own clears, so an
    MLA model's writer and readers (one launch) stay in step."""
    launch, writer, reader = clears.new_launch(), ("mla", 0), ("mla", 1)
    first = clears.bump(clears.resume(launch, writer), writer)
    assert clears.resume(launch, writer) == first  # made again: where it was
    assert clears.bump(clears.resume(launch, reader), reader) == first  # the reader, in step
    assert clears.bump(clears.resume(launch, writer), writer) == clears.KeySpace(launch, 2)


def test_a_cleared_rank_never_goes_back_to_epoch_0(caplog):
    """A backend attached again with another launch's token (a copied attach config), or with the
    launch's own after a clear under the process's own token, started at epoch 0 of that launch: the
    namespace of the weights before the clear, whose KV it read as hits (a review). It keeps the last
    key space, and says so."""
    rank = ("llama", "tp=0/1", clears.new_launch())
    mine, copied = clears.new_launch(), clears.new_launch()
    cleared = clears.bump(clears.resume(mine, rank), rank)
    with caplog.at_level("WARNING", logger="dflash2.sglang"):
        assert clears.resume(copied, rank) == cleared
    assert f"gives dflash2_launch {copied}, under which this process never cleared" in caplog.text
    other = ("llama", "tp=0/1", clears.new_launch())
    launch = clears.new_launch()
    assert clears.resume(launch, other) == clears.KeySpace(launch, 0)
    own = clears.bump(clears.KeySpace(), ("own", clears.new_launch()))  # (another rank's own token)
    assert own.epoch == 1 and clears.resume(launch, other).tag() == ""  # (this rank has not cleared)


def test_a_backend_with_no_token_clears_under_its_ranks_first_launch():
    """An MLA server's ranks, each a process, attached again with no token and cleared: each drew a
    token of its own, and the readers missed the writer's pages till a restart (a review). A rank
    clears under the launch its first backend was given."""
    launch, writer, reader = clears.new_launch(), ("mla", clears.new_launch(), 0), ("mla", clears.new_launch(), 1)
    for rank in (writer, reader):
        assert clears.resume(launch, rank) == clears.KeySpace(launch, 0)
        assert clears.resume(None, rank) == clears.KeySpace(launch, 0)
    assert clears.bump(clears.resume(None, writer), writer) == clears.bump(clears.resume(None, reader), reader)
    assert clears.bump(clears.resume(None, writer), writer) == clears.KeySpace(launch, 2)


def test_a_config_without_the_launch_token_takes_the_processs_last_key_space(caplog):
    """An operator's own attach config has no `dflash2_launch`: before this process cleared, the
    key space of epoch 0; after, the last one, said in a warning. A clear with no token at all
    draws this process's own token, said too."""
    rank = ("llama", "tp=0/1", clears.new_launch())
    assert clears.resume(None, rank) == clears.KeySpace()
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        own = clears.bump(clears.KeySpace(), rank)
    assert own.epoch == 1 and own.launch and f"its own token {own.launch}" in caplog.text
    rank = ("llama", "tp=0/1", clears.new_launch())  # (another process's rank, given its launch's token)
    launched = clears.bump(clears.resume(clears.new_launch(), rank), rank)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        assert clears.resume(None, rank) == launched
    assert "gives no dflash2_launch" in caplog.text and f"launch {launched.launch}, clear epoch 1" in caplog.text


def test_a_ranks_backends_in_one_process_follow_its_clear_and_count_it_once():
    """sglang's PD decode with --disaggregation-decode-enable-offload-kvcache makes two storage backends
    of one rank in one process (the tree cache's and the offload manager's); its clear reaches only the
    tree cache's, and the other kept writing the new weights' KV under the old weights' key space (a
    review). The other follows; a clear that reaches both too moves the rank once."""
    launch, rank = clears.new_launch(), ("llama", "tp=0/1", clears.new_launch())
    tree, offload = clears.resume(launch, rank), clears.resume(launch, rank)
    assert clears.follow(offload, rank) == offload  # (nothing cleared: where it is)
    tree = clears.bump(tree, rank)
    assert clears.follow(offload, rank) == tree == clears.KeySpace(launch, 1)
    assert clears.bump(offload, rank) == tree  # (the same operator call reaching it: counted once)
    assert clears.bump(tree, rank) == clears.KeySpace(launch, 2)  # (the next call's clear)


def sglang_args(**kw) -> argparse.Namespace:
    base = {"dflash2_config": "cfg.json", "enable_hierarchical_cache": False, "hicache_storage_backend": None,
            "hicache_storage_backend_extra_config": None}
    return argparse.Namespace(**{**base, **kw})


def test_rewrite_turns_the_flag_into_the_dynamic_backend(tmp_path):
    args = sglang_args(dflash2_config=str(tmp_path / "c.json"),
                       hicache_storage_backend_extra_config='{"prefetch_threshold": 256}')
    verdict = rewrite_args(args, check=lambda path: Verdict(True, endpoint="ipc://x"))
    assert verdict.ok and args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    model = extra.pop("dflash2_model")
    launch = extra.pop("dflash2_launch")
    assert len(launch) == 16 and int(launch, 16) >= 0  # this launch's token (clears.py)
    assert extra == {"prefetch_threshold": 256, "backend_name": "dflash2", "class_name": "DFlash2Storage",
                     "module_path": "dflash2.client.sglang.backend", "interface_v1": 1,
                     "hicache_storage_pass_prefix_keys": True, "dflash2_config": str(tmp_path / "c.json")}
    assert model == server_args(args)


def test_each_launch_passes_its_own_token_to_every_rank(tmp_path):
    """Two servers launched alike (one identity) key their pages apart once they clear (clears.py):
    each launch draws its token; the user's own is replaced (a copied command is another launch)."""
    tokens = set()
    for _ in range(2):
        args = sglang_args(dflash2_config=str(tmp_path / "c.json"),
                           hicache_storage_backend_extra_config='{"dflash2_launch": "copied"}')
        assert rewrite_args(args, check=lambda path: Verdict(True, endpoint="ipc://x")).ok
        tokens.add(json.loads(args.hicache_storage_backend_extra_config)["dflash2_launch"])
    assert len(tokens) == 2 and "copied" not in tokens


def test_rewrite_passes_the_models_server_arguments_to_the_backend(tmp_path):
    """The page namespace covers the model's identity, not only the served name (identity.py)."""
    args = sglang_args(model_path=str(tmp_path), quantization="fp8", dtype="bfloat16", revision="v2",
                       json_model_override_args='{"rope_scaling": {"factor": 2.0}}')
    assert rewrite_args(args, check=lambda path: Verdict(True, endpoint="ipc://x")).ok
    model = json.loads(args.hicache_storage_backend_extra_config)["dflash2_model"]
    assert model["model_path"] == os.path.realpath(tmp_path) and model["quantization"] == "fp8"
    assert model["dtype"] == "bfloat16" and model["revision"] == "v2"
    assert model["json_model_override_args"] == '{"rope_scaling":{"factor":2.0}}'


def test_the_extra_config_asks_sglang_for_prefix_keys_unless_the_user_says_otherwise():
    """Without them sglang's backup batches reach the backend unlinked to the page before them."""
    assert json.loads(backend_extra_config("c.json", None))["hicache_storage_pass_prefix_keys"] is True
    mine = json.loads(backend_extra_config("c.json", '{"hicache_storage_pass_prefix_keys": false}'))
    assert mine["hicache_storage_pass_prefix_keys"] is False


def test_rewrite_passes_the_servers_kv_cache_dtype_to_the_backend():
    """fp8 host pools store every fp8 format as uint8: the backend's key namespace needs the logical
    KV dtype (`--kv-cache-dtype`), which only the server's arguments know."""
    args = sglang_args(kv_cache_dtype="fp8_e5m2")
    assert rewrite_args(args, check=lambda path: Verdict(True, endpoint="ipc://x")).ok
    assert json.loads(args.hicache_storage_backend_extra_config)["dflash2_kv_cache_dtype"] == "fp8_e5m2"


def test_rewrite_without_the_flag_changes_nothing():
    args = sglang_args(dflash2_config=None)
    assert rewrite_args(args, check=pytest.fail) is None and args.hicache_storage_backend is None


def test_rewrite_refuses_another_storage_backend():
    with pytest.raises(ValueError, match="--hicache-storage-backend file"):
        rewrite_args(sglang_args(hicache_storage_backend="file"), check=pytest.fail)
    with pytest.raises(ValueError, match="class_name"):
        backend_extra_config("c.json", '{"class_name": "Other"}')


@pytest.mark.parametrize("given, named", [
    ({"disable_radix_cache": True}, "--disable-radix-cache"),
    ({"enable_kv_cache_sharding": True}, "--enable-kv-cache-sharding"),
    ({"enable_lmcache": True}, "--enable-lmcache"),
    ({"enable_unified_cache_external_linker": True}, "--enable-unified-cache-external-linker"),
    ({"dcp_size": 2, "hicache_host_memory_mode": "buffer_only"}, "--dcp-size 2"),
    ({"dcp_size": 4, "hicache_host_memory_mode": "cache"}, r"--dcp-size 4 \(sglang keeps the pages of decode "
                                                          "context parallelism only in its file or Mooncake storage"),
])
def test_rewrite_refuses_what_sglang_forbids_beside_its_hierarchical_cache_naming_both_flags(given, named):
    """sglang refused to start with an error about --enable-hierarchical-cache, which the user never typed."""
    args = sglang_args(**given)
    with pytest.raises(ValueError, match=f"--dflash2-config .*HiCache.* {named}"):
        rewrite_args(args, check=pytest.fail)
    assert args == sglang_args(**given)


DOWN = lambda path: Verdict(False, "the dflash2 daemon cannot be reached")  # noqa: E731


@pytest.mark.parametrize("given, named", [
    ({"hicache_storage_backend_extra_config": "@/etc/extra.json"}, "from a file"),
    ({"hicache_storage_backend_extra_config": "{not json"}, "is not JSON"),
    ({"hicache_storage_backend_extra_config": "[1]"}, "must be a JSON object"),
    ({"hicache_storage_backend": "dynamic",
      "hicache_storage_backend_extra_config": '{"backend_name": "mine", "module_path": "my.mod", "class_name": "Mine"}'},
     "backend_name"),
])
def test_a_usage_error_in_the_users_extra_config_is_one_whether_or_not_the_daemon_answers(given, named):
    """Before, these were raised only once the daemon answered: with it down the same command fell
    back (running the user's own dynamic backend while the line said "sglang's own KV cache")."""
    for check in (lambda path: Verdict(True, endpoint="ipc://x"), DOWN, pytest.fail):
        args = sglang_args(**given)
        with pytest.raises(ValueError, match=named):
            rewrite_args(args, check=check)
        assert args == sglang_args(**given)


def test_a_config_path_with_a_tilde_reaches_the_check_and_the_backend_expanded(tmp_path, monkeypatch, caplog):
    """`--dflash2-config=~/x`: no shell expands that `~`. The check expanded it (load_config) and the
    backends got `$CWD/~/x`, which each scheduler failed to load: all fell back after the start-up
    line said dflash2 was on (a review)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    checked = []
    args = sglang_args(dflash2_config="~/dflash2_config.json")
    with caplog.at_level(logging.INFO, logger="dflash2.sglang"):
        assert rewrite_args(args, check=lambda path: checked.append(path) or Verdict(True, endpoint="ipc://x")).ok
    want = str(tmp_path / "dflash2_config.json")
    assert checked == [want]
    assert json.loads(args.hicache_storage_backend_extra_config)["dflash2_config"] == want
    assert any(want in r.getMessage() for r in caplog.records)


def test_fallback_logs_one_line_and_leaves_the_args(caplog):
    args = sglang_args()
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        verdict = rewrite_args(args, check=lambda path: Verdict(False, "the daemon is asleep"))
    assert not verdict.ok and args == sglang_args()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "fallback to default" in lines[0] and "the daemon is asleep" in lines[0]


@pytest.mark.parametrize("given", ["", "  "])
def test_a_flag_given_no_file_falls_back_with_the_line(caplog, given):
    """`--dflash2-config "$UNSET"`: the flag is there, so dflash2 was asked for; it fell back without
    a word (the path was taken for an absent flag)."""
    args = sglang_args(dflash2_config=given)
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        verdict = rewrite_args(args, check=pytest.fail)
    assert not verdict.ok and args == sglang_args(dflash2_config=given)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "fallback to default" in lines[0] and "--dflash2-config names no file" in lines[0]


def test_check_disabled_config(config_file):
    verdict = check_dflash2(config_file(enable=False))
    assert not verdict.ok and "disabled" in verdict.reason


def test_check_invalid_config(config_file):
    verdict = check_dflash2(config_file(bogus_key=1))
    assert not verdict.ok and "bogus_key" in verdict.reason


def test_check_daemon_down_then_up(config_file):
    path = config_file()
    down = check_dflash2(path, timeout_s=0.5)
    assert not down.ok and "cannot be reached" in down.reason
    proc = DaemonProcess(path).start()
    try:
        up = check_dflash2(path)
        # (A host-only daemon: its HBM stand-in is host memory, no GPU's: no sizing warning.)
        assert up.ok and up.endpoint == proc.endpoint and up.note == ""
    finally:
        proc.stop()


@pytest.mark.parametrize("what", ["no daemon", "a folder"])
def test_the_check_says_what_is_wrong_with_the_endpoint(config_file, tmp_path, what):
    """The flag's check said "no reply ... (daemon gone or stuck)" of an endpoint with no socket file or
    one naming a folder (a review): sglang never built the backend, whose message says what is wrong. It
    asks as the client does: a folder at once, no socket file once its timeout has passed."""
    import time

    path = config_file()
    endpoint = json.loads(open(path).read())["daemon"]["endpoint"]
    if what == "a folder":
        os.mkdir(endpoint[len("ipc://"):])
    began = time.monotonic()
    verdict = check_dflash2(path, timeout_s=30 if what == "a folder" else 0.5)
    assert not verdict.ok and time.monotonic() - began < 10  # (a folder: not the 30 s timeout)
    assert ("names a folder, not dflash2d's socket" if what == "a folder" else "does not exist") in verdict.reason


def test_the_check_finds_a_daemon_that_binds_within_its_timeout(config_file):
    """A daemon started beside sglang binds its socket a moment after the check begins: the check took
    the missing socket file for no daemon at once, and sglang fell back for good (a review)."""
    import threading

    path = config_file()
    started = []
    timer = threading.Timer(0.2, lambda: started.append(DaemonProcess(path).start()))
    timer.start()
    try:
        verdict = check_dflash2(path, timeout_s=20)
    finally:
        timer.join()
        for proc in started:
            proc.stop()
    assert verdict.ok, verdict


def stats_of(device: str, *hbm_bytes: int) -> dict:
    """The parts of a daemon's `stats` reply that `hbm_note` reads: one pool per HBM size given."""
    pools = [{"tiers": {"hbm": {"capacity_bytes": b}, "dram": {"capacity_bytes": 8 << 30}}} for b in hbm_bytes]
    top = {"tiers": {"hbm": {"capacity_bytes": sum(hbm_bytes)}}, "daemon": {"device": device}}
    if len(pools) > 1:
        top["devices"] = {str(i): pool for i, pool in enumerate(pools)}
    return top


def test_hbm_note_names_a_gpu_tier_that_sglang_never_uses():
    assert hbm_note(stats_of("cuda", 256 << 20)) == ""  # the default config's cap
    assert hbm_note(stats_of("cuda", HBM_NOTE_BYTES)) == ""
    assert hbm_note(stats_of("host", 100 << 30)) == ""  # host memory standing in for HBM: no GPU's
    note = hbm_note(stats_of("cuda", 120_000_000_000))
    assert "120.0 GB" in note and "memory.hbm_capacity_mb" in note and "DRAM tier" in note
    # Two GPUs, one pool each: the pools' own tiers count, not the node's total (0.6 GB + 0.6 GB).
    assert hbm_note(stats_of("cuda", 600_000_000, 600_000_000)) == ""
    assert "80.0 GB" in hbm_note(stats_of("cuda", 256 << 20, 80_000_000_000))


def test_rewrite_logs_the_sizing_note_and_still_uses_dflash2(caplog):
    args = sglang_args()
    with caplog.at_level(logging.INFO, logger="dflash2.sglang"):
        verdict = rewrite_args(args, check=lambda path: Verdict(True, endpoint="ipc://x", note="dflash2: too much HBM"))
    assert verdict.ok and args.hicache_storage_backend == "dynamic"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["dflash2: too much HBM"]


@pytest.mark.parametrize("home", ["", "relhome"])
def test_the_flags_tilde_with_an_unusable_home_falls_back_naming_home(monkeypatch, caplog, home):
    """It was expanded by os.path.expanduser, which read an empty $HOME as "/": another file was
    checked, where load_config refuses such a `~` (a review)."""
    monkeypatch.setenv("HOME", home)
    with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
        verdict = rewrite_args(sglang_args(dflash2_config="~/c.json"), check=pytest.fail)
    assert not verdict.ok and f"$HOME is {home!r}" in verdict.reason and "fallback to default" in caplog.text

