"""The sglang plugin: `--dflash2-config FILE` turns on sglang's hierarchical cache with dflash2 as its
storage backend.

sglang loads every entry point of the group `sglang.srt.plugins` (ours: `dflash2`, registered in
pyproject.toml) before it parses its command line (`python -m sglang.launch_server`, `sglang serve`,
`sglang.Engine`) and again in each scheduler process. `register()` hooks two methods of
`ServerArgs` through sglang's own HookRegistry:

- after `add_cli_args(parser)`: the parser knows `--dflash2-config FILE`;
- before `from_cli_args(args)`: `rewrite_args(args)` turns the flag into
  `--enable-hierarchical-cache --hicache-storage-backend dynamic
  --hicache-storage-backend-extra-config '{"backend_name": "dflash2", "module_path":
  "dflash2.client.sglang.backend", "class_name": "DFlash2Storage", "interface_v1": 1,
  "hicache_storage_pass_prefix_keys": true, "dflash2_config": FILE, "dflash2_model": {the server
  arguments of the model's identity: identity.py}, "dflash2_launch": a random token of this launch,
  the key space of the server's clears: clears.py}'` (the user's own extra-config keys are kept).

Fallback: when the config's `enable` is not true, the config is invalid, the flag names no file
(`--dflash2-config ""`), or the daemon does not answer, the arguments are left as they are (sglang runs with its own cache) and one warning line
says `dflash2: fallback to default ...` and why. A flag that contradicts ours (another storage
backend), or that sglang does not allow beside the hierarchical cache the flag turns on
(`--disable-radix-cache`, ...: `conflicting_flag`), is a usage error naming both, never silently
overridden (sglang's own error named `--enable-hierarchical-cache`, a flag the user never typed).

Sizing: sglang's pages live in the daemon's DRAM tier, never in its HBM tier, while sglang sizes its
weights' and KV pool's share of each GPU from what the daemon leaves. A daemon that holds more than
HBM_NOTE_BYTES of a GPU as its HBM tier (a config made for engines that use that tier, such as
deploy/dflash2_config.production.json) gets one warning line naming the bytes and the key that caps
them (`hbm_note`).
"""

from __future__ import annotations

import dataclasses
import json
import logging

from dflash2.client.sglang.clears import LAUNCH_KEY, new_launch
from dflash2.client.sglang.identity import server_args
from dflash2.errors import DFlash2Error

log = logging.getLogger("dflash2.sglang")

FLAG = "--dflash2-config"
BACKEND_NAME = "dflash2"
BACKEND_MODULE = "dflash2.client.sglang.backend"
BACKEND_CLASS = "DFlash2Storage"
OURS = {"backend_name": BACKEND_NAME, "module_path": BACKEND_MODULE, "class_name": BACKEND_CLASS}
# How long the start-up check waits for the daemon before falling back.
PROBE_TIMEOUT_S = 2.0
# A GPU's HBM tier above this many bytes gets the sizing warning (`hbm_note`): sglang's pages never
# use that tier. The default config caps it at 256 MB.
HBM_NOTE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether this process may use dflash2; `reason` says why not."""

    ok: bool
    reason: str = ""
    endpoint: str = ""
    # A warning that does not stop this process from using dflash2 (`hbm_note`), or "".
    note: str = ""


def _endpoint_within(endpoint: str, timeout_s: float) -> None:
    """`check_endpoint(endpoint, attaching=True)` until it passes or `timeout_s` has passed (its last
    DaemonUnavailable then); a path that is no socket at once (EndpointNotSocket: it will not become one)."""
    import time

    from dflash2.client.endpoint_check import check_endpoint
    from dflash2.errors import DaemonUnavailable, EndpointNotSocket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check_endpoint(endpoint, attaching=True)
        except EndpointNotSocket:
            raise
        except DaemonUnavailable:
            if time.monotonic() >= deadline:
                raise
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def check_dflash2(config_path: str, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """Load the config, require `enable`, ping the daemon (no attach) and read its tiers (`hbm_note`)."""
    from dflash2.client.transport import Transport
    from dflash2.config import load_config, require_enabled
    from dflash2.protocol import Op

    try:
        cfg = load_config(config_path)
        require_enabled(cfg)
        endpoint = cfg.client_endpoint()
        key_file = cfg.resolved_tcp_key_file()
    except DFlash2Error as e:
        return Verdict(False, str(e))
    transport = None
    try:
        # Said as the client says it: a folder at once; no socket file (a daemon starting beside sglang binds
        # within the timeout), another user's socket, once the timeout has passed. Before, the check said
        # "no reply (daemon gone or stuck)" of each (a review).
        _endpoint_within(endpoint, timeout_s)
        transport = Transport(endpoint, timeout_s, key_file=key_file)
        if transport.read_only:  # (it answers, but this process could not attach)
            return Verdict(False, f"this process may read only the monitoring key file {transport.key_file} of "
                                  f"the dflash2 daemon at {endpoint}, whose holders cannot attach: run sglang as the "
                                  "daemon's user (it maps the daemon's owner-only memory), which reads the key file "
                                  "itself", endpoint)
        transport.call(Op.PING)
        try:
            note = hbm_note(transport.call(Op.STATS).result)
        except (DFlash2Error, AttributeError, KeyError, TypeError, ValueError) as e:
            note = f"dflash2: the daemon's HBM tier could not be read, its size is not checked: {e}"
    except DFlash2Error as e:
        return Verdict(False, f"the dflash2 daemon cannot be reached: {e}", endpoint)
    finally:
        if transport is not None:
            transport.close()
    return Verdict(True, endpoint=endpoint, note=note)


def hbm_note(stats: dict) -> str:
    """The sizing warning for a daemon (its `stats` reply) that holds more than HBM_NOTE_BYTES of a
    GPU as its HBM tier, or "" (a host-only daemon's HBM stand-in is not a GPU's memory)."""
    if stats["daemon"]["device"] != "cuda":
        return ""
    pools = stats.get("devices") or {"": stats}  # one pool per GPU; a single pool's figures are the top level
    largest = max(int(pool["tiers"].get("hbm", {}).get("capacity_bytes", 0)) for pool in pools.values())
    if largest <= HBM_NOTE_BYTES:
        return ""
    return (f"dflash2: the daemon holds {largest / 1e9:.1f} GB of a GPU as its HBM tier, which sglang's pages never "
            "use (they live in its DRAM tier), and sglang's weights and KV pool get only what the daemon leaves of "
            "each GPU; unless another engine on this node reads that tier, cap it with memory.hbm_capacity_mb "
            "(the default config's 256) and restart the daemon")


def config_file(path: str) -> str:
    """The flag's file as one absolute path, `~` expanded, as `load_config` reads it: the start-up
    check and every scheduler's backend load this one (`--dflash2-config=~/x`, which no shell
    expands, passed the check and reached the backends as `$CWD/~/x`: each fell back; a review)."""
    from dflash2.config import expand_user

    return str(expand_user(path, FLAG).absolute())  # (ConfigError: `~` with $HOME empty or relative, or ~user unknown)


def fallback_line(reason: str) -> str:
    return f"dflash2: fallback to default (sglang's own KV cache, no dflash2): {reason}"


def user_extra_config(user_extra: str | None) -> dict:
    """The user's own `--hicache-storage-backend-extra-config` keys, checked: inline JSON, an object,
    and no other backend named where ours goes. ValueError (a usage error) otherwise, raised before
    the daemon is asked (`rewrite_args`): before, it was raised only when the daemon answered, and the
    same command fell back while the daemon was down (a review)."""
    extra: dict = {}
    if user_extra:
        if user_extra.startswith("@"):
            raise ValueError(f"{FLAG} cannot be combined with --hicache-storage-backend-extra-config "
                             f"from a file ({user_extra}); pass the keys inline as JSON")
        try:
            extra = json.loads(user_extra)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON ({e}): {user_extra!r}") from None
        if not isinstance(extra, dict):
            raise ValueError(f"--hicache-storage-backend-extra-config must be a JSON object, not {user_extra!r}")
    for key, value in OURS.items():
        if key in extra and extra[key] != value:
            raise ValueError(f"{FLAG} sets the storage backend's {key} to {value!r}, but "
                             f"--hicache-storage-backend-extra-config gives {extra[key]!r}")
    return extra


def backend_extra_config(config_path: str, user_extra: str | None, kv_cache_dtype: str | None = None,
                         model: dict | None = None, launch: str | None = None) -> str:
    """sglang's `--hicache-storage-backend-extra-config` JSON: the user's keys plus ours (with the
    server's `--kv-cache-dtype`: the logical KV dtype, which fp8 host pools do not show: every fp8
    format is stored as uint8; and `model`, the server arguments of the model's identity,
    identity.server_args, which the page namespace covers; and `launch`, this launch's token, which
    keys the server's pages once it has cleared: clears.py)."""
    extra = user_extra_config(user_extra)
    extra.update(OURS)
    extra["interface_v1"] = 1  # the zero-copy batch_get_v1 / batch_set_v1 path
    # sglang passes a backup batch the keys of the pages before it (`extra_info.prefix_keys`) only
    # with this (its parse_storage_backend_extra_config pops it, default false): the backend then
    # links the batch to its parent page (`_prefix_parent`), and the daemon knows the chain
    # (descendants leave a tier before their ancestors). Unlinked, a later turn's pages outlived the
    # prefix they need (a review measured 2.4-3.0% more hit pages linked). The user's own value stays.
    extra.setdefault("hicache_storage_pass_prefix_keys", True)
    extra["dflash2_config"] = config_file(config_path)
    if kv_cache_dtype is not None:
        extra["dflash2_kv_cache_dtype"] = str(kv_cache_dtype)
    if model is not None:
        extra["dflash2_model"] = model
    if launch is not None:  # (the user's own is replaced: a copied launch command is another launch)
        extra[LAUNCH_KEY] = launch
    return json.dumps(extra)


# sglang's arguments that it refuses beside a hierarchical cache with a storage backend, whatever the
# model (sglang 0.5.23, srt/arg_groups/: kv_cache_hook.py, kv_shard_hook.py, hicache_hook.py).
CONFLICTS = (("disable_radix_cache", "--disable-radix-cache"),
             ("enable_kv_cache_sharding", "--enable-kv-cache-sharding"),
             ("enable_lmcache", "--enable-lmcache"),
             ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker"))


def conflicting_flag(args) -> str | None:
    """The argument that sglang does not allow beside the hierarchical cache `--dflash2-config` turns
    on with a dynamic storage backend, as the user typed it, or None. Decode context parallelism
    (`--dcp-size` above 1): sglang's cache controller serves its storage from the file and Mooncake
    backends only ("HiCache L3 with DCP requires file or Mooncake storage", sglang 0.5.23), so every
    scheduler failed at start-up (a review); a warning said MLA models were served."""
    for attr, flag in CONFLICTS:
        if getattr(args, attr, False):
            return flag
    dcp = getattr(args, "dcp_size", 1) or 1
    if dcp > 1:
        return (f"--dcp-size {dcp} (sglang keeps the pages of decode context parallelism only in its file or "
                "Mooncake storage)")
    return None


def rewrite_args(args, check=check_dflash2) -> Verdict | None:
    """Rewrite a parsed sglang namespace in place (see the module docstring). None when the flag is
    absent; else the verdict (not ok: the namespace is unchanged and the fallback was logged; a flag
    given an empty path falls back so too, where before it turned dflash2 off without a word)."""
    path = getattr(args, "dflash2_config", None)
    if path is None:
        return None  # not asked for
    if not path.strip():  # asked for, with no file named: a launch script's unset variable
        verdict = Verdict(False, f"{FLAG} names no file (it was given {path!r}: an unset variable in the "
                                 "launch command?); name a dflash2_config.json")
        log.warning(fallback_line(verdict.reason))
        return verdict
    backend = getattr(args, "hicache_storage_backend", None)
    if backend not in (None, "dynamic"):
        raise ValueError(f"{FLAG} makes dflash2 the hierarchical cache's storage backend; remove "
                         f"--hicache-storage-backend {backend}")
    conflict = conflicting_flag(args)
    if conflict is not None:
        raise ValueError(f"{FLAG} keeps sglang's KV cache in dflash2 through sglang's hierarchical cache "
                         f"(HiCache, --enable-hierarchical-cache), which sglang does not allow with {conflict}: "
                         f"remove one of them")
    user_extra_config(getattr(args, "hicache_storage_backend_extra_config", None))
    try:
        path = config_file(path)
    except DFlash2Error as e:  # (its `~` cannot be expanded here: as a config that cannot be read)
        verdict = Verdict(False, str(e))
    else:
        verdict = check(path)
    if not verdict.ok:
        log.warning(fallback_line(verdict.reason))
        return verdict
    args.hicache_storage_backend_extra_config = backend_extra_config(
        path, getattr(args, "hicache_storage_backend_extra_config", None), getattr(args, "kv_cache_dtype", None),
        server_args(args), new_launch())
    args.enable_hierarchical_cache = True
    args.hicache_storage_backend = "dynamic"
    log.info("dflash2: sglang's hierarchical cache stores its pages in dflash2 (daemon %s, config %s)",
             verdict.endpoint, path)
    if verdict.note:
        log.warning(verdict.note)
    return verdict


# ----------------------------------------------------------------------------------------------------
# sglang hooks (this part needs sglang)


def _add_flag(_result, parser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args(parser)."""
    if any(FLAG in action.option_strings for action in parser._actions):
        return None  # the parser was extended already
    parser.add_argument(FLAG, type=str, default=None, metavar="FILE",
                        help="dflash2_config.json: keep this server's KV cache in the node's dflash2 daemon "
                             "(shared, tiered, deduplicated); falls back to sglang's own cache when dflash2 "
                             "is disabled or its daemon cannot be reached")
    return None


def _before_from_cli_args(*args, **kwargs):
    """BEFORE ServerArgs.from_cli_args(cls, namespace): rewrite the namespace in place."""
    namespace = args[-1] if args else kwargs.get("args")
    rewrite_args(namespace)
    return None


HOOK_TARGETS = ("sglang.srt.server_args.ServerArgs.add_cli_args",
                "sglang.srt.server_args.ServerArgs.from_cli_args")


def register() -> None:
    """The `sglang.srt.plugins` entry point: register the hooks (sglang applies them)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGETS[0], _add_flag, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS[1], _before_from_cli_args, HookType.BEFORE)
