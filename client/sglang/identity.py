"""The model's identity, which the page namespace covers (keys.py): what decides the KV a server
computes for the same tokens, beside the shard and the page format the namespace names already.

sglang's storage backend is told the served model name alone (`--served-model-name`, else
`--model-path`), and pages were shared by name: `--model-path X` and `--model-path X --quantization
fp8` read each other's KV, and so did a new checkpoint served under the old name. Now:

- the plugin passes the server arguments that change the model's numbers (`server_args`,
  IDENTITY_ARGS): its path (a local one resolved, so that two spellings of one folder agree),
  revision (a repo id's, once its files are read, replaced by the commit of the snapshot they came
  from: no --revision, `main`, a tag and the commit load the same files, and as typed they were
  four models that never shared a page, a review; none for a local path, which sglang loads
  whatever the revision), load format, dtype, quantization and its parameters (the KV cache scales
  file, `--quantization-param-path`, resolved as the model's path), and
  `--json-model-override-args` (parsed: its spelling does not count), with
  `--download-dir`, where a repo id's files lie (used to find them, not part of the identity: one
  local folder with and without it was two models);
- the backend adds what the model's files say (`model_identity`), read when it starts, after sglang
  has loaded (and, for a Hugging Face repo id, downloaded) the model: a SHA-256 of its
  `config.json`, and the names, sizes, modification times, inodes and sampled bytes of its weight
  files (WEIGHT_SUFFIXES, the folder's top level), of a local folder, a GGUF file (local, or a Hub
  reference resolved as sglang does: `_gguf_reference`), or a repo id's snapshot in the local
  cache (looked up offline). A checkpoint replaced under the same path is another model, even one
  whose files keep their sizes and modification times (`rsync -a`, `tar`, reproducible images set
  them: a new inode, other bytes); files copied afresh are too (pages miss, never wrong). A SHA-256 of
  the KV cache scales file, where one is given (`_scales_digest`), is added too. A repo
  id's config.json is looked up in the default cache and its weights where sglang's loader takes
  them: the snapshot under `--download-dir` where there is one, else the default cache's. Where some cannot be read,
  `unread` says which and why (the backend logs it, `not_read`): the namespace then covers the
  path, the arguments and what was read;
- the LoRA adapters given at start (`--lora-paths`), each by name, resolved path and files
  (`lora_adapters`; a repo id's found as the model's, `unread` where they are not), when there are any.
- with speculative decoding (`draft`, DRAFT_ARGS), its algorithm and the draft model's path,
  revision, load format, quantization and KV dtype, and the draft checkpoint's files, read as the
  model's: sglang packs a NextN/MTP draft's KV into the target's host pages, and two servers of one
  target with other draft checkpoints shared pages (a review).

`model_id` is the identity's digest, which the namespace carries.
"""

import hashlib
import json
import os
from typing import Any

from dflash2.protocol import MAX_NAME_CHARS

# ServerArgs fields (sglang 0.5.23) that change what a model computes for the same tokens.
IDENTITY_ARGS = ("model_path", "revision", "load_format", "dtype", "quantization", "quantization_param_path",
                 "modelopt_quant", "json_model_override_args")
# ServerArgs fields of speculative decoding that change what the stored pages hold: with NextN/MTP,
# sglang 0.5.23 packs the draft model's KV layers into the target's host pages (base_spec_worker.py
# _build_hicache_draft_plan; the host pool's draft_buffer_infos), so every page holds the draft's KV.
DRAFT_ARGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
              "speculative_draft_load_format", "speculative_draft_model_quantization",
              "speculative_draft_kv_cache_dtype")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILE = "config.json"
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA adapter's (peft)
# What of each weight file is read (`_weight`): 16 pieces of 4 KiB, its first and last among them.
SAMPLES = 16
SAMPLE_BYTES = 4096


def server_args(args) -> dict:
    """The identity's server arguments, from a parsed sglang namespace (the plugin's part): plain
    JSON values, as the extra config carries them to the backend."""
    out = {name: getattr(args, name, None) for name in (*IDENTITY_ARGS, "download_dir")}
    out["json_model_override_args"] = _canonical_json(out["json_model_override_args"])
    for name in ("model_path", "quantization_param_path"):  # (a local one resolved: two spellings, one file)
        path = out[name]
        if isinstance(path, str) and path and os.path.exists(path):
            out[name] = os.path.realpath(path)
    adapters = lora_adapters(getattr(args, "lora_paths", None))
    if adapters:  # (only then: the identity of a server without adapters stays what it was)
        out["lora_adapters"] = adapters
    draft = {name: getattr(args, name, None) for name in DRAFT_ARGS}
    if draft["speculative_algorithm"] not in (None, "", "NONE"):  # (only then, as the adapters)
        # The draft checkpoint was no part of the identity: two servers of one target with other draft
        # checkpoints (whose KV every page holds) shared one namespace (a review).
        path = draft["speculative_draft_model_path"]
        if isinstance(path, str) and path and os.path.exists(path):
            draft["speculative_draft_model_path"] = os.path.realpath(path)
        out["draft"] = {k: (str(v) if v is not None and not isinstance(v, (str, int, float, bool)) else v)
                        for k, v in draft.items()}
    return out


def lora_adapters(lora_paths) -> list[list[str]]:
    """`--lora-paths` as [name, path] pairs, a local path resolved: sglang keys an adapter's pages by
    its name and path as typed (`LoRARef.deterministic_id`), never by its files, so a fine-tune put
    in place under the same path, or one relative path from two working folders, shared KV computed
    with other weights (a review); `model_identity` reads each adapter's files. The forms sglang
    takes: `PATH`, `NAME=PATH`, a JSON object (lora_name, lora_path), a dict of name to path, LoRARefs."""
    if not lora_paths:
        return []
    items = lora_paths.items() if isinstance(lora_paths, dict) else lora_paths
    out = []
    for item in items:
        if isinstance(item, tuple):
            name, path = item
        elif isinstance(item, dict):
            name, path = item.get("lora_name"), item.get("lora_path")
        elif isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        else:  # a LoRARef
            name, path = getattr(item, "lora_name", None), getattr(item, "lora_path", None)
        if isinstance(path, str) and path and os.path.exists(path):
            path = os.path.realpath(path)
        out.append([str(name), str(path)])
    return sorted(out)


def model_identity(args: dict) -> dict:
    """`server_args`' dict with what the model's files say added (the backend's part; module
    docstring): the same in every process that serves those files with those arguments."""
    ident = dict(args)
    download_dir = ident.pop("download_dir", None)  # where to look, not what the model is
    files, revision, why = _checkpoint(ident.get("model_path"), ident.get("revision"), download_dir)
    ident.update(files)
    if revision is not _KEEP:
        ident["revision"] = revision
    if ident.get("quantization_param_path"):  # (only then: the identity of a server without stays what it was)
        ident["quantization_param_sha256"], scales_why = _scales_digest(ident["quantization_param_path"])
        why = "; ".join(w for w in (why, scales_why) if w) or None
    if why is not None:
        ident["unread"] = why
    if ident.get("lora_adapters"):  # each adapter's files, found as the model's
        ident["lora_adapters"] = [[name, path, _adapter_files(path, download_dir)]
                                  for name, path in ident["lora_adapters"]]
    draft = ident.get("draft")
    if draft and draft.get("speculative_draft_model_path"):  # the draft checkpoint's files, read as the model's
        files, revision, draft_why = _checkpoint(draft["speculative_draft_model_path"],
                                                 draft.get("speculative_draft_model_revision"), download_dir)
        draft = {**draft, "files": files}
        if revision is not _KEEP:
            draft["speculative_draft_model_revision"] = revision
        if draft_why is not None:
            draft["unread"] = draft_why
        ident["draft"] = draft
    return ident


_KEEP = object()  # (`_checkpoint`: the revision as given)


def _checkpoint(path, revision: str | None, download_dir: str | None) -> tuple[dict, Any, str | None]:
    """What a checkpoint's files say (`_files`: a local folder or file, a GGUF Hub reference, a repo
    id's cached snapshot), the revision that names them (None for a local path, which sglang loads
    whatever the revision; a snapshot's commit; _KEEP: as given), and why some were not read."""
    if isinstance(path, str) and path and os.path.exists(path):
        files = _files(path)
        # sglang loads a local folder or file whatever --revision says (its loader and AutoConfig read the
        # folder): as typed, `--revision main` and none were two models that never shared a page (a review).
        why = None
        if files["config_sha256"] is None and not files["weights"]:
            why = f"neither {CONFIG_FILE} nor weight files in {path}"
        return files, None, why
    if isinstance(path, str) and (gguf := _gguf_reference(path, revision)) is not None:
        file, commit, why = gguf
        return (_files(file), commit, why) if file else ({"config_sha256": None, "weights": []}, _KEEP, why)
    if isinstance(path, str) and path:
        files, why, commit = _repo_files(path, revision, download_dir, CONFIG_FILE)
        # the snapshot's commit, however its revision was spelled; also where not all of it was read
        # (the reason, which named it, is no part of the digest)
        return files, _KEEP if commit is None else commit, why
    return {}, _KEEP, "no model path"


def not_read(identity: dict) -> list[str]:
    """What of the model's and its adapters' files could not be read, one line each, for the log:
    the namespace then covers less than the weights (a replaced checkpoint reads the old one's pages)."""
    out = []
    if identity.get("unread"):
        out.append(f"the model's files were not all read ({identity['unread']}): its pages are keyed by its "
                   "paths, its server arguments and what else of its files was read (a checkpoint or KV cache "
                   "scales replaced under those paths would read the old ones' pages)")
    for name, path, files in identity.get("lora_adapters") or []:
        if files.get("unread"):
            out.append(f"the LoRA adapter {name!r}'s files were not read ({files['unread']}): its pages are keyed "
                       f"by its name and path {path!r} (an adapter replaced there would read the old one's)")
    draft = identity.get("draft") or {}
    if draft.get("unread"):
        out.append(f"the draft model's files were not all read ({draft['unread']}): its KV, which every page "
                   f"holds, is keyed by its path {draft.get('speculative_draft_model_path')!r} and arguments (a "
                   "draft checkpoint replaced there would read the old one's pages)")
    return out


def model_id(identity: dict) -> str:
    """The identity's digest (24 hex digits): equal for equal identities, whatever their keys' order.
    Why files were not read (`unread`, the model's and each adapter's) is left out: it names where they
    were looked for, --download-dir and the default cache, which are not what the model is (two
    servers of one model, one given `--download-dir /data/hf/` and the other none, shared no page, a
    review); what was read, and what not, is in the identity all the same."""
    kept = {k: v for k, v in identity.items() if k != "unread"}
    if kept.get("lora_adapters"):
        kept["lora_adapters"] = [[name, path, {k: v for k, v in files.items() if k != "unread"}
                                  if isinstance(files, dict) else files] for name, path, files in kept["lora_adapters"]]
    if isinstance(kept.get("draft"), dict):
        kept["draft"] = {k: v for k, v in kept["draft"].items() if k != "unread"}
    canonical = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=12, person=b"dflash2-model").hexdigest()


def describe(identity: dict) -> str:
    """One line for the log: the model's path, what of its files was read, and its digest."""
    files = ("config.json " + identity["config_sha256"][:12] if identity.get("config_sha256") else "no config.json")
    files += f", {len(identity.get('weights') or [])} weight files"
    if identity.get("lora_adapters"):
        files += f", {len(identity['lora_adapters'])} LoRA adapters"
    if identity.get("draft"):
        draft = identity["draft"]
        files += f", {draft.get('speculative_algorithm')} draft {draft.get('speculative_draft_model_path')}"
    if identity.get("unread"):
        read = identity.get("config_sha256") or identity.get("weights")
        files = (f"{files}; " if read else "its files ") + f"not read: {identity['unread']}"
    return f"{identity.get('model_path')} ({files}; id {model_id(identity)})"


def _canonical_json(value):
    """`--json-model-override-args` as a canonical string (its spelling does not change the model);
    a value that is not JSON as given (sglang refuses it itself)."""
    if not isinstance(value, str):
        return value
    try:
        return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return value


def _scales_digest(path: str) -> tuple[str | None, str | None]:
    """A SHA-256 of `--quantization-param-path`'s contents (as config.json's: a small JSON, read
    whole), or (None, why not). With `--kv-cache-dtype fp8_e4m3` sglang sets each layer's k_scale
    and v_scale from it, so the stored KV's bytes depend on what it says: in the identity by its
    path as typed, recalibrated scales put in place there read KV quantized with the old ones as
    hits (wrong KV), and one file spelled relative and absolute was two models (a review)."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest(), None
    except OSError as e:
        return None, f"the KV cache scales file {path} (--quantization-param-path) could not be read " \
            f"({type(e).__name__}: {e.strerror or e})"


def _adapter_files(path: str, download_dir: str | None) -> dict:
    """A LoRA adapter's `_files`, of a local folder or a repo id's cached files (sglang fetches its
    adapter_config.json into the default cache and its weights as the model's); "unread" says why
    none could be read. An adapter given as a repo id was in the identity by its name alone, and
    one updated upstream and fetched again read the old one's KV, without a word (a review)."""
    if os.path.exists(path):
        files = _files(path, ADAPTER_CONFIG)
        if files["config_sha256"] is None and not files["weights"]:
            files["unread"] = f"neither {ADAPTER_CONFIG} nor weight files in {path}"
        return files
    files, why, _ = _repo_files(path, None, download_dir, ADAPTER_CONFIG)
    return {**files, "unread": why} if why else files


def _repo_files(repo_id: str, revision: str | None, download_dir: str | None,
                config: str) -> tuple[dict, str | None, str | None]:
    """`_files` of a Hugging Face repo id, from where sglang took them, why what is missing was not
    read (None when nothing is), and the commit of the weights' snapshot (None where none): `config`
    in the default cache (transformers' AutoConfig, and sglang's LoRA config, never pass
    --download-dir), and the weights in the snapshot `_weights_snapshot` finds, as sglang's loader
    does. Looking for config.json under --download-dir found none, and a repo id served with it was
    never read: a new revision under the same repo id read the old one's pages (a review)."""
    found, why = _cached_snapshot(repo_id, revision, None, config)
    out = _files(found, config) if found else {"config_sha256": None, "weights": []}
    folder, where = _weights_snapshot(repo_id, revision, download_dir)
    if folder is None:
        out["weights"] = []
        missing = f"no snapshot of {repo_id!r} at {revision or 'main'} {where}"
        return out, "; ".join(w for w in (why, missing) if w), None
    out["weights"] = _files(folder, config)["weights"]
    if not out["weights"]:
        why = "; ".join(w for w in (why, f"no weight files in {folder}") if w)
    return out, why, os.path.basename(folder)


def _gguf_reference(model: str, revision: str | None) -> tuple[str | None, str | None, str | None] | None:
    """A GGUF named by Hub reference, resolved offline as sglang resolves it online before loading
    (hf_transformers/common.py resolve_hf_gguf_reference, into the default cache): `owner/repo/
    path/file.gguf` that file, `owner/repo:QUANT` its one `*-QUANT.gguf`, `owner/repo` without a
    config.json its one .gguf. (file, its snapshot's commit, None), (None, None, why not), or None
    for a model path of no such form. Such a reference was taken for a repo id and never read (the
    warning said its cache could not be read, HFValidationError): two revisions of the .gguf had
    one identity (a review)."""
    form = _gguf_form(model)
    try:
        from huggingface_hub import constants
    except ImportError:
        form = None  # (then `_repo_files` says why nothing is read)
    if form is None:
        return None
    repo_id, how, what = form
    folder = _snapshot_in(constants.HF_HUB_CACHE, repo_id, revision)
    names = []
    for root, _, files in os.walk(folder) if folder else ():
        names += [os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/") for n in files]
    found = [n for n in names if (n == what if how == "file" else n.endswith(what))]
    if len(found) == 1 and not (how == "only" and CONFIG_FILE in names):
        return os.path.join(folder, found[0]), os.path.basename(folder), None
    if how == "only":
        return None  # a repo id of another kind (or not fetched): `_repo_files` says
    which = "more than one file is" if found else "its file is not"
    return None, None, (f"{model!r} is a GGUF Hub reference, and {which} in the Hugging Face cache's snapshot "
                        f"of {repo_id!r} at {revision or 'main'}: the file is not read")


def _gguf_form(model: str) -> tuple[str, str, str] | None:
    """(repo id, how its .gguf is named, what) of a GGUF Hub reference (sglang's forms): "file" and
    its path in the repo, "quant" and the file name's end, "only" and ".gguf"; None for no such form."""
    if ":" in model:
        repo_id, _, quant = model.rpartition(":")
        return (repo_id, "quant", f"-{quant}.gguf") if repo_id.count("/") == 1 and quant else None
    parts = model.strip("/").split("/")
    if len(parts) > 2 and model.endswith(".gguf"):
        return "/".join(parts[:2]), "file", "/".join(parts[2:])
    return ("/".join(parts), "only", ".gguf") if len(parts) == 2 else None


def _weights_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> tuple[str | None, str]:
    """The snapshot sglang's loader takes a repo id's weights from when they are local (0.5.x,
    weight_utils._find_local_hf_snapshot_dir_unlocked): the one under --download-dir where that
    folder has one (weights or not: without, sglang downloads them there), else the default cache's
    (huggingface_hub's HF_HUB_CACHE, read now: HF_HOME may move it). (folder, "") or (None, where it
    was looked for). Looking under --download-dir alone missed a model fetched earlier into the
    default cache, which sglang serves from there: its weights were never read, and two revisions
    with one config.json had one identity (a review)."""
    if download_dir:
        folder = _snapshot_in(download_dir, repo_id, revision)
        if folder is not None:
            return folder, ""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None, (f"under --download-dir {download_dir} " if download_dir else "") + \
            "(huggingface_hub is not installed to find its default cache)"
    folder = _snapshot_in(constants.HF_HUB_CACHE, repo_id, revision)
    where = (f"under --download-dir {download_dir} nor " if download_dir else "") + \
        f"in the default cache {constants.HF_HUB_CACHE}"
    return folder, "" if folder else where


def _snapshot_in(cache_dir: str, repo_id: str, revision: str | None) -> str | None:
    """The snapshot folder of `repo_id` at `revision` (a branch or tag through its refs/ file, or a
    commit) in the Hugging Face cache `cache_dir`, or None: found by the cache's layout, as its
    weight files' names are not known beforehand (try_to_load_from_cache wants one)."""
    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    commit = revision or "main"
    try:
        with open(os.path.join(repo, "refs", commit)) as f:
            commit = f.read().strip()
    except (OSError, ValueError):
        pass  # (a commit given as the revision)
    folder = os.path.join(repo, "snapshots", commit)
    return folder if commit and os.path.isdir(folder) else None


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | None,
                     config: str = CONFIG_FILE) -> tuple[str | None, str | None]:
    """The local folder of a Hugging Face repo's snapshot at `revision` (its `config`'s), without
    the network: (folder, None), or (None, why not)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None, f"{repo_id!r} is no local path, and huggingface_hub is not installed to find it in its cache"
    try:
        found = try_to_load_from_cache(repo_id, config, cache_dir=cache_dir, revision=revision)
    except Exception as e:  # a repo id it refuses (HFValidationError), an unreadable cache
        return None, f"{repo_id!r} is no local path, and its cache could not be read ({type(e).__name__}: {e})"
    if not isinstance(found, str):
        return None, f"{repo_id!r} is no local path, and its {config} is not in the Hugging Face cache yet"
    return os.path.dirname(found), None


def _files(folder: str, config: str = CONFIG_FILE) -> dict:
    """`config`'s digest (config.json; an adapter's adapter_config.json) and each weight file's
    `_weight` entry, of a model or adapter folder or of a weights file itself (GGUF)."""
    out = {"config_sha256": None, "weights": []}
    if os.path.isfile(folder):
        try:
            out["weights"] = [_weight(folder)]
        except OSError:
            pass  # (unread: said as neither config.json nor weight files)
        return out
    try:
        with open(os.path.join(folder, config), "rb") as f:
            out["config_sha256"] = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        pass
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(WEIGHT_SUFFIXES))
    except OSError:
        names = []
    for name in names:
        try:
            out["weights"].append(_weight(os.path.join(folder, name)))  # (a cache snapshot's links: their blobs)
        except OSError:
            continue
    return out


def _weight(path: str) -> list:
    """A weight file's name, bytes, modification time (ns), inode and a digest of SAMPLES pieces of
    SAMPLE_BYTES spread over it. The inode and the samples tell a replaced file from the one before
    where its size and modification time were kept (a fine-tune of the same base, put in place by
    rsync -a, tar or a reproducible image): a new file is a new inode, and a rewritten one differs in
    its bytes. What a chmod, a chown or a hard link changes is left out, so every server of the same
    files agrees (the change time moved with them: servers started on each side of a `chmod -R` at a
    container's start shared nothing, a review)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        sample = hashlib.blake2b(digest_size=16)
        last = max(0, st.st_size - SAMPLE_BYTES)
        for i in range(SAMPLES):
            sample.update(os.pread(f.fileno(), SAMPLE_BYTES, last * i // (SAMPLES - 1)))
    return [os.path.basename(path), st.st_size, st.st_mtime_ns, st.st_ino, sample.hexdigest()]


def client_name(model: str, tp_rank: int) -> str:
    """The name this backend attaches under (shown in `dflash2 status`): `sglang:MODEL:tpN`, the model
    cut from the left to fit the daemon's bound on names (a model path of a local snapshot is long;
    over the bound, every scheduler fell back)."""
    tail = f":tp{tp_rank}"
    room = MAX_NAME_CHARS - len("sglang:") - len(tail)
    if len(model) > room:
        model = "..." + model[-(room - 3):]
    return f"sglang:{model}{tail}"
