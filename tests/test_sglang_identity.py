"""The model's identity, which the sglang page namespace covers (client/sglang/identity.py; no
sglang needed): servers of one served name share pages only when their weights, the arguments that
change their numbers, and their files agree. Before, the served name alone was the namespace:
`--quantization fp8`, or a new checkpoint under the old name, read the other's KV as hits."""

from __future__ import annotations

import argparse
import os

import pytest

from dflash2.client.sglang import identity
from dflash2.client.sglang.identity import describe, model_id, model_identity, server_args
from dflash2.client.sglang.keys import KeyMapper, Shard, namespace


def model_folder(root, name="llama", config='{"hidden_size": 4096}', weights=(("model.safetensors", b"w" * 8),)):
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(config)
    for file, data in weights:
        (folder / file).write_bytes(data)
    (folder / "tokenizer.json").write_text("{}")  # not a weight file: it does not count
    return folder


def args(**kw) -> argparse.Namespace:
    base = {"model_path": None, "revision": None, "load_format": "auto", "dtype": "auto", "quantization": None,
            "quantization_param_path": None, "modelopt_quant": None, "json_model_override_args": "{}",
            "download_dir": None, "served_model_name": "llama", "tp_size": 1}
    return argparse.Namespace(**{**base, **kw})


def id_of(**kw) -> str:
    return model_id(model_identity(server_args(args(**kw))))


def test_the_same_model_spelled_two_ways_has_one_identity(tmp_path):
    folder = model_folder(tmp_path)
    os.symlink(folder, tmp_path / "alias")
    assert id_of(model_path=str(folder)) == id_of(model_path=str(tmp_path / "alias"))
    assert id_of(model_path=str(folder), json_model_override_args='{"a": 1, "b": 2}') == \
        id_of(model_path=str(folder), json_model_override_args='{ "b":2,"a":1 }')
    assert id_of(model_path=str(folder), tp_size=2) == id_of(model_path=str(folder))  # not the model's numbers


def test_a_local_model_is_one_model_whatever_its_revision(tmp_path):
    """sglang loads a local folder or file whatever `--revision` says (its loader and AutoConfig read
    the folder): kept as typed, `--revision main` and none were two models that never shared a page (a
    review)."""
    folder = str(model_folder(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for path in (folder, str(gguf)):
        assert len({id_of(model_path=path, revision=rev) for rev in (None, "main", "v2")}) == 1, path
    assert model_identity(server_args(args(model_path=folder, revision="main")))["revision"] is None


@pytest.mark.parametrize("other", [{"quantization": "fp8"}, {"dtype": "float16"}, {"load_format": "dummy"},
                                   {"json_model_override_args": '{"rope_scaling": 2}'},
                                   {"quantization_param_path": "/scales.json"}, {"modelopt_quant": "fp8"}])
def test_arguments_that_change_the_models_numbers_change_its_identity(tmp_path, other):
    folder = str(model_folder(tmp_path))
    assert id_of(model_path=folder, **other) != id_of(model_path=folder)


def test_kv_cache_scales_recalibrated_under_the_same_path_are_another_model(tmp_path, monkeypatch):
    """With `--kv-cache-dtype fp8_e4m3`, sglang sets each layer's k_scale and v_scale from
    `--quantization-param-path`: the stored KV's bytes depend on its contents. In the identity by its
    path as typed, recalibrated scales put in place there read KV quantized with the old ones as hits,
    and one file spelled relative and absolute was two models (a review)."""
    folder = str(model_folder(tmp_path))
    scales = tmp_path / "kv_scales.json"
    scales.write_text('{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5}}}}')
    before = id_of(model_path=folder, quantization_param_path=str(scales))
    scales.write_text('{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 4.0}}}}')
    assert id_of(model_path=folder, quantization_param_path=str(scales)) != before
    monkeypatch.chdir(tmp_path)
    assert id_of(model_path=folder, quantization_param_path="kv_scales.json") == \
        id_of(model_path=folder, quantization_param_path=str(scales))


def test_kv_cache_scales_that_cannot_be_read_are_said(tmp_path):
    folder = str(model_folder(tmp_path))
    ident = model_identity(server_args(args(model_path=folder, quantization_param_path=str(tmp_path / "gone.json"))))
    assert ident["quantization_param_sha256"] is None and ident["config_sha256"] and ident["weights"]
    assert f"the KV cache scales file {tmp_path / 'gone.json'} (--quantization-param-path) could not be read" \
        in ident["unread"]
    [line] = identity.not_read(ident)
    assert "gone.json" in line and "not read: the KV cache scales file" in describe(ident)
    assert "quantization_param_sha256" not in model_identity(server_args(args(model_path=folder)))  # (as before)


def test_a_checkpoint_replaced_under_the_same_path_is_another_model(tmp_path):
    folder = model_folder(tmp_path)
    before = id_of(model_path=str(folder))
    (folder / "model.safetensors").write_bytes(b"v" * 9)  # a new checkpoint, same name
    assert id_of(model_path=str(folder)) != before
    same_size = id_of(model_path=str(folder))
    os.utime(folder / "model.safetensors", ns=(1, 1))  # same bytes' count, written at another time
    assert id_of(model_path=str(folder)) != same_size
    changed = id_of(model_path=str(folder))
    (folder / "config.json").write_text('{"hidden_size": 8192}')
    assert id_of(model_path=str(folder)) != changed


def test_a_checkpoint_replaced_with_the_same_sizes_and_times_is_another_model(tmp_path):
    """Fine-tunes of one base keep its shard sizes and config.json, and deploy tools (rsync -a, tar,
    reproducible images) keep or clamp modification times: before, such a replacement had the old
    one's identity, and its server read the other checkpoint's KV as hits (a review)."""
    folder = model_folder(tmp_path, weights=(("model.safetensors", b"A" * 64),))
    clamped = (315532800 * 10**9, 315532800 * 10**9)  # 1980-01-01, as reproducible archives set it
    os.utime(folder / "model.safetensors", ns=clamped)
    before = id_of(model_path=str(folder))
    os.remove(folder / "model.safetensors")
    (folder / "model.safetensors").write_bytes(b"B" * 64)
    os.utime(folder / "model.safetensors", ns=clamped)
    assert id_of(model_path=str(folder)) != before
    assert id_of(model_path=str(folder)) == id_of(model_path=str(folder))  # and stable while unchanged


def test_a_rewrite_in_place_with_the_same_size_and_time_is_another_model(tmp_path):
    folder = model_folder(tmp_path, weights=(("model.safetensors", b"A" * 100_000),))
    stamp = os.stat(folder / "model.safetensors").st_mtime_ns
    before = id_of(model_path=str(folder))
    with open(folder / "model.safetensors", "r+b") as f:  # the same inode: `cp -p` onto it, rsync --inplace
        f.write(b"B" * 100_000)
    os.utime(folder / "model.safetensors", ns=(stamp, stamp))
    assert id_of(model_path=str(folder)) != before


def test_what_a_chmod_or_a_hard_link_changes_leaves_the_model_as_it_was(tmp_path):
    """Servers started on each side of a container entrypoint's `chmod -R a+rX /models`, or of a
    dedup tool's hard link, serve the same files: they share pages (the change time, in the identity
    for a while, moved with these, a review)."""
    folder = model_folder(tmp_path)
    before = id_of(model_path=str(folder))
    os.chmod(folder / "model.safetensors", 0o644)
    os.chown(folder / "model.safetensors", os.getuid(), os.getgid())
    os.link(folder / "model.safetensors", tmp_path / "elsewhere.safetensors")
    assert id_of(model_path=str(folder)) == before


def test_a_download_dir_does_not_make_a_local_model_another(tmp_path):
    """sglang reads `--download-dir` only for a repo id: one local folder with and without it is one
    model (it was two, and their servers never shared a page; a review)."""
    folder = str(model_folder(tmp_path))
    assert id_of(model_path=folder, download_dir="/data/hf") == id_of(model_path=folder)


def test_another_folder_under_the_same_served_name_is_another_model(tmp_path):
    v1, v2 = model_folder(tmp_path, "v1"), model_folder(tmp_path, "v2")
    assert id_of(model_path=str(v1)) != id_of(model_path=str(v2))


def test_what_the_files_say_is_read_and_described(tmp_path):
    folder = model_folder(tmp_path, weights=(("a.safetensors", b"1"), ("b.safetensors", b"22")))
    ident = model_identity(server_args(args(model_path=str(folder))))
    assert len(ident["config_sha256"]) == 64 and [w[:2] for w in ident["weights"]] == [["a.safetensors", 1],
                                                                                       ["b.safetensors", 2]]
    assert "unread" not in ident and "2 weight files" in describe(ident) and model_id(ident) in describe(ident)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"g" * 5)
    ident = model_identity(server_args(args(model_path=str(gguf))))
    assert ident["weights"][0][:2] == ["model.gguf", 5] and "unread" not in ident


def test_a_model_whose_files_cannot_be_read_says_why(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "neither config.json nor weight files" in model_identity(server_args(args(model_path=str(empty))))["unread"]
    repo = model_identity(server_args(args(model_path="no-such-org/no-such-model-dflash2")))
    assert "is no local path" in repo["unread"]
    assert model_identity(server_args(args()))["unread"] == "no model path"


def test_the_namespace_carries_the_identity(tmp_path):
    shard = Shard("llama")
    bf16 = KeyMapper(namespace(shard, "MHA/page_first", id_of(model_path=str(model_folder(tmp_path)))))
    fp8 = KeyMapper(namespace(shard, "MHA/page_first", id_of(model_path=str(tmp_path / "llama"), quantization="fp8")))
    assert bf16.key("p0") != fp8.key("p0") and "|id=" in bf16.namespace
    assert namespace(shard, "MHA/page_first") == "sglang|model=llama,tp=0/1|MHA/page_first"  # unknown: as before


def adapter_folder(root, name="support", weights=b"fine-tune v1"):
    folder = root / "adapters" / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "target_modules": ["k_proj", "v_proj"]}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_a_lora_adapter_replaced_under_the_same_path_is_another_model(tmp_path, monkeypatch):
    """sglang keys an adapter's pages by its name and path as typed, never its files: a fine-tune put
    in place under the same path (or one relative path from two working folders) read the other's
    adapter KV (a review). The adapters' files are in the identity, resolved as the model's path."""
    model = str(model_folder(tmp_path))
    adapter = adapter_folder(tmp_path)
    base = id_of(model_path=model)
    v1 = id_of(model_path=model, lora_paths=[f"support={adapter}"])
    assert v1 != base
    assert base == id_of(model_path=model, lora_paths=None)  # (no adapters: the identity of before)
    monkeypatch.chdir(tmp_path / "adapters")
    for spelled in (["support=support"], [{"lora_name": "support", "lora_path": "./support", "pinned": False}],
                    {"support": str(adapter)}):
        assert id_of(model_path=model, lora_paths=spelled) == v1, spelled
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").write_bytes(b"fine-tune v2 -- other weights")
    assert id_of(model_path=model, lora_paths=[f"support={adapter}"]) != v1
    assert id_of(model_path=model, lora_paths=[str(adapter)]) != v1  # (named by its path: another name)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The default Hugging Face cache, in a temporary folder."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def snapshot(cache, repo, files, commit="a" * 40, ref="main"):
    """A repo's snapshot in the Hugging Face cache `cache`, as a download leaves it."""
    base = cache / ("models--" + repo.replace("/", "--"))
    (base / "snapshots" / commit).mkdir(parents=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / ref).write_text(commit)
    for name, data in files.items():
        (base / "snapshots" / commit / name).write_bytes(data)
    return base / "snapshots" / commit


def test_a_repo_id_with_a_download_dir_has_its_files_read(tmp_path, hub):
    """sglang downloads only a repo id's weights into --download-dir, and transformers its
    config.json into the default cache: config.json was looked for under --download-dir, and such a
    model was never read (a new revision under the repo id read the old one's pages; a review)."""
    snapshot(hub, "org/llama", {"config.json": b'{"hidden_size": 4096}'})
    snapshot(tmp_path / "dl", "org/llama", {"model.safetensors": b"v1 weights"})
    ident = model_identity(server_args(args(model_path="org/llama", download_dir=str(tmp_path / "dl"))))
    assert "unread" not in ident, ident["unread"]
    assert ident["config_sha256"] and [w[:2] for w in ident["weights"]] == [["model.safetensors", 10]]
    v1 = model_id(ident)
    snapshot(tmp_path / "dl", "org/llama", {"model.safetensors": b"v2 weights!"}, commit="b" * 40)  # main moves on
    assert id_of(model_path="org/llama", download_dir=str(tmp_path / "dl")) != v1
    no_weights = model_identity(server_args(args(model_path="org/llama", download_dir=str(tmp_path / "none"))))
    assert "no weight files in " + str(hub) in no_weights["unread"]  # (sglang downloads them into the dir)
    assert no_weights["config_sha256"] == ident["config_sha256"] and "not read: no weight files" in describe(no_weights)
    nowhere = model_identity(server_args(args(model_path="org/gone", download_dir=str(tmp_path / "none"))))
    assert f"no snapshot of 'org/gone' at main under --download-dir {tmp_path / 'none'} nor in the default cache" \
        in nowhere["unread"]
    snapshot(hub, "org/other", {"model.safetensors": b"w"})
    snapshot(tmp_path / "dl", "org/other", {"model.safetensors": b"w"})
    no_config = model_identity(server_args(args(model_path="org/other", download_dir=str(tmp_path / "dl"))))
    assert "its config.json is not in the Hugging Face cache" in no_config["unread"] and no_config["weights"]
    snapshot(hub, "org/both", {"config.json": b"{}", "model.safetensors": b"w"})  # without it: one snapshot
    assert "unread" not in model_identity(server_args(args(model_path="org/both")))


def test_a_lora_adapter_given_as_a_repo_id_has_its_files_read(tmp_path, hub, caplog):
    """An adapter given as a repo id was in the identity by its name alone, without a word: one
    updated upstream and fetched again read the old one's adapter KV (a review). Its files are found
    in the cache as the model's, and a warning says when they are not."""
    model = str(model_folder(tmp_path))
    snapshot(hub, "org/support-lora", {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"v1"})
    v1 = id_of(model_path=model, lora_paths=["support=org/support-lora"])
    snapshot(hub, "org/support-lora", {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"v2!"},
             commit="b" * 40)  # updated upstream, fetched again
    ident = model_identity(server_args(args(model_path=model, lora_paths=["support=org/support-lora"])))
    assert model_id(ident) != v1 and ident["lora_adapters"][0][2]["weights"][0][:2] == ["adapter_model.safetensors", 3]
    assert not identity.not_read(ident)
    missing = model_identity(server_args(args(model_path=model, lora_paths=["other=org/not-fetched-lora"])))
    [line] = identity.not_read(missing)
    assert "LoRA adapter 'other'" in line and "adapter_config.json is not in the Hugging Face cache" in line


def test_a_repo_id_in_the_default_cache_served_with_a_download_dir_has_its_weights_read(tmp_path, hub):
    """sglang's loader takes a repo id's weights from the snapshot under --download-dir where there
    is one, else from the default cache's (weight_utils._find_local_hf_snapshot_dir_unlocked): a
    model fetched earlier into the default cache and served with --download-dir on an empty disk
    had no weights read, and two revisions with one config.json had one identity (a review)."""
    cfg = b'{"hidden_size": 4096}'
    snapshot(hub, "org/llama", {"config.json": cfg, "model.safetensors": b"v1 weights"})
    dl = tmp_path / "dl"
    dl.mkdir()
    ident = model_identity(server_args(args(model_path="org/llama", download_dir=str(dl))))
    assert "unread" not in ident, ident["unread"]
    assert [w[:2] for w in ident["weights"]] == [["model.safetensors", 10]]
    snapshot(hub, "org/llama", {"config.json": cfg, "model.safetensors": b"v2 weights!"}, commit="b" * 40)
    assert id_of(model_path="org/llama", download_dir=str(dl)) != model_id(ident)  # main moved on
    snapshot(dl, "org/llama", {"model.safetensors": b"fetched here"}, commit="c" * 40)  # there: it comes first
    there = model_identity(server_args(args(model_path="org/llama", download_dir=str(dl))))
    assert [w[:2] for w in there["weights"]] == [["model.safetensors", 12]]


def test_a_lora_repo_in_the_default_cache_served_with_a_download_dir_has_its_weights_read(tmp_path, hub):
    """The adapter's weights are found as the model's (sglang's loader looks for them alike)."""
    snapshot(hub, "org/support-lora", {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"v1"})
    (tmp_path / "dl").mkdir()
    files = identity._adapter_files("org/support-lora", str(tmp_path / "dl"))
    assert "unread" not in files, files["unread"]
    assert [w[:2] for w in files["weights"]] == [["adapter_model.safetensors", 2]]


def test_the_weights_are_looked_for_where_sglangs_loader_takes_them(tmp_path, hub):
    """`_weights_snapshot` against sglang's own lookup, where sglang is installed."""
    weight_utils = pytest.importorskip("sglang.srt.model_loader.weight_utils")
    snapshot(hub, "org/llama", {"config.json": b"{}", "model.safetensors": b"w"})
    (tmp_path / "dl").mkdir()
    for fetched_there in (False, True):  # the default cache's, then the download dir's once it has one
        if fetched_there:
            snapshot(tmp_path / "dl", "org/llama", {"model.safetensors": b"w"}, commit="c" * 40)
        served = weight_utils._find_local_hf_snapshot_dir_unlocked("org/llama", str(tmp_path / "dl"),
                                                                   ["*.safetensors"], None)
        assert identity._weights_snapshot("org/llama", None, str(tmp_path / "dl"))[0] == served
        assert served.startswith(str(tmp_path / "dl" if fetched_there else hub))


def test_one_snapshot_named_by_any_spelling_of_its_revision_is_one_model(hub):
    """No --revision, `main`, a tag and the commit load the same snapshot: as typed, the revision
    made them four models that never shared a page (a review). Once the files are read, the commit
    is the identity's revision; where they are not, the revision as typed."""
    snapshot(hub, "org/llama", {"config.json": b"{}", "model.safetensors": b"w"})
    (hub / "models--org--llama" / "refs" / "v1.0").write_text("a" * 40)
    ids = {rev: id_of(model_path="org/llama", revision=rev) for rev in (None, "main", "v1.0", "a" * 40)}
    assert len(set(ids.values())) == 1, ids
    assert model_identity(server_args(args(model_path="org/llama", revision="v1.0")))["revision"] == "a" * 40
    unread = model_identity(server_args(args(model_path="org/not-fetched", revision="v1.0")))
    assert unread["revision"] == "v1.0" and unread["unread"]


@pytest.mark.parametrize("reference", ["org/llama-gguf/llama-Q4_K_M.gguf", "org/llama-gguf:Q4_K_M", "org/llama-gguf"])
def test_a_gguf_given_as_a_hub_reference_has_its_file_read(hub, reference):
    """sglang serves `owner/repo/path/file.gguf`, `owner/repo:QUANT` and `owner/repo` of one .gguf
    from the default cache (resolve_hf_gguf_reference): the identity took them for repo ids, read
    nothing and said the cache could not be read, and two revisions of the .gguf had one identity
    (a review)."""
    snapshot(hub, "org/llama-gguf", {"llama-Q4_K_M.gguf": b"GGUF v1"})
    ident = model_identity(server_args(args(model_path=reference)))
    assert "unread" not in ident, ident["unread"]
    assert ident["weights"][0][:2] == ["llama-Q4_K_M.gguf", 7] and ident["revision"] == "a" * 40
    snapshot(hub, "org/llama-gguf", {"llama-Q4_K_M.gguf": b"GGUF v2 other weights"}, commit="b" * 40)
    assert id_of(model_path=reference) != model_id(ident)


def test_a_gguf_hub_reference_not_in_the_cache_says_so(hub):
    snapshot(hub, "org/llama-gguf", {"llama-Q4_K_M.gguf": b"GGUF", "llama-Q8_0.gguf": b"GGUF"})
    missing = model_identity(server_args(args(model_path="org/llama-gguf:Q2_K")))["unread"]
    assert "'org/llama-gguf:Q2_K' is a GGUF Hub reference, and its file is not in" in missing
    assert "the file is not read" in missing
    folder = snapshot(hub, "org/two-gguf", {"a-Q4_K_M.gguf": b"GGUF"})
    (folder / "sub").mkdir()
    (folder / "sub" / "b-Q4_K_M.gguf").write_bytes(b"GGUF")  # (sglang: ambiguous, name the file)
    assert "more than one file is in" in model_identity(server_args(args(model_path="org/two-gguf:Q4_K_M")))["unread"]
    two = model_identity(server_args(args(model_path="org/llama-gguf")))  # two .gguf: sglang asks which
    assert two["unread"] and "GGUF" not in two["unread"]


def test_where_unread_files_were_looked_for_is_not_the_model(tmp_path, hub):
    """The reason files were not read names where they were looked for (--download-dir, the default
    cache): hashed into the identity, two servers of one model, given `--download-dir /data/hf/`,
    `/data/hf` or none, shared no page, though --download-dir is no part of the model (a review)."""
    base = dict(model_path="some-org/not-cached", lora_paths=["x=some-org/not-cached-lora"])
    ids = {model_id(model_identity(server_args(args(**base, **extra))))
           for extra in ({"download_dir": "/data/hf"}, {"download_dir": "/data/hf/"}, {})}
    assert len(ids) == 1
    ident = model_identity(server_args(args(**base, download_dir="/data/hf")))
    assert "--download-dir /data/hf" in ident["unread"] and "/data/hf" in ident["lora_adapters"][0][2]["unread"]


def test_a_snapshot_read_in_part_is_named_by_its_commit(hub):
    """A snapshot found with its config.json but no weight files (a loader of its own keeps them
    elsewhere): the reason, which named its folder and so its commit, is no part of the digest, and
    two commits with one config.json had one identity (a review). Its commit is the revision."""
    snapshot(hub, "org/llama", {"config.json": b"{}"})
    v1 = model_identity(server_args(args(model_path="org/llama")))
    assert v1["unread"] and v1["revision"] == "a" * 40
    snapshot(hub, "org/llama", {"config.json": b"{}"}, commit="b" * 40)  # main moves on
    assert id_of(model_path="org/llama") != model_id(v1)


def test_the_draft_checkpoint_is_part_of_the_identity(tmp_path):
    """With NextN/MTP speculative decoding sglang 0.5.23 packs the draft model's KV layers into the
    target's host pages (base_spec_worker._build_hicache_draft_plan): every stored page holds the
    draft's KV. The draft checkpoint was no part of the identity, and two servers of one target with
    other draft checkpoints, or one replaced under the same path, shared one namespace (a review)."""
    target = str(model_folder(tmp_path))
    draft = model_folder(tmp_path, "nextn", weights=(("model.safetensors", b"draft v1"),))
    spec = {"model_path": target, "speculative_algorithm": "EAGLE"}
    assert id_of(**spec, speculative_draft_model_path="lmsys/DeepSeek-V3-NextN") != \
        id_of(**spec, speculative_draft_model_path="someone/other-NextN-finetune")
    assert id_of(**spec, speculative_draft_model_path=str(draft)) != id_of(model_path=target)
    before = id_of(**spec, speculative_draft_model_path=str(draft))
    (draft / "model.safetensors").unlink()
    (draft / "model.safetensors").write_bytes(b"draft v2")  # a draft fine-tune put in place
    assert id_of(**spec, speculative_draft_model_path=str(draft)) != before
    assert id_of(model_path=target, speculative_algorithm=None, speculative_draft_model_path=str(draft)) == \
        id_of(model_path=target)  # no speculative decoding: the identity stays what it was


def test_a_draft_whose_files_cannot_be_read_says_why(tmp_path):
    model_folder(tmp_path)
    (tmp_path / "empty").mkdir()
    ident = model_identity(server_args(args(model_path=str(tmp_path / "llama"), speculative_algorithm="EAGLE",
                                            speculative_draft_model_path=str(tmp_path / "empty"))))
    assert "unread" not in ident and "neither config.json nor weight files" in ident["draft"]["unread"]
    assert any("draft model's files were not all read" in line for line in identity.not_read(ident))
    assert "EAGLE draft" in describe(ident)
