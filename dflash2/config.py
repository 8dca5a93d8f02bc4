"""The configuration file (`dflash2_config.json`): strict, frozen pydantic models, one per section.

Every key has bounds and a description; unknown keys are an error that names the full dotted key;
values are never coerced or rewritten (`"512"` is not 512, `1` is not `true`). Paths are kept as the
user wrote them and resolved on demand against the config file's folder (`Config.resolved_*`).

Public API: `load_config(path)`, `parse_config(data, source_path)`, `require_enabled(cfg)`; the
warnings of a legal config are config_warnings.py's.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Annotated, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from dflash2 import strictjson
from dflash2.config_errors import dotted_key, first_error
from dflash2.endpoints import (connectable, default_endpoint, endpoint_parts, hosts_overlap, plain_text,
                               tcp_key_path, xdg_dir)
from dflash2.errors import ConfigError, DisabledError, LayoutError
from dflash2.layout import DTYPE_BITS, Layout

MB = 1 << 20
# policy.duel_sample's default: the heat policy's duel replays 1 in 8 content keys (dflash2/duel.py).
DEFAULT_DUEL_SAMPLE = 8
# policy.decay_half_life_s's default: heat's access counts halve once an hour of wall time. Every
# halving takes all counts at once, and a key read once falls back to "never seen" (its next read a
# first-timer's again): on the Mooncake synthetic trace (17 minutes at about 120 block references a
# second) a half-life of 60 s found fewer blocks than LRU at 2,000 and 8,000 HBM blocks (0.1438 and
# 0.3663 against 0.1463 and 0.3731; 0.1545 and 0.3988 without a halving); 300 s and 600 s found
# fewer than without one at four and five of seven capacities, 600 s fewer than LRU at 1,000 blocks
# (docs/policy-experiments.md, "The counts' wall-clock decay"). `bench policy` replays it.
DEFAULT_DECAY_HALF_LIFE_S = 3600.0
MAX_DECAY_HALF_LIFE_S = 1e7
# Why a duel sample of 1 is refused (the config's key and the bench's --duel-sample say the same).
DUEL_SAMPLE_OF_ONE = "1 would replay every key at full size: give N >= 2 (1 in N keys), or 0 for off"

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Section(BaseModel):
    model_config = _STRICT


class DeviceConfig(_Section):
    """Which memory stands in for the HBM tier."""

    kind: Literal["auto", "cuda", "host"] = Field(
        "auto", description="`cuda`: GPU memory; `host`: host shared memory stands in for HBM; "
                            "`auto`: cuda when a GPU is visible (CuPy, the gpu extra, is then needed), else host.")
    gpu_ids: Optional[list[Annotated[int, Field(ge=0, le=1023)]]] = Field(
        None, min_length=1, max_length=64,
        description="CUDA device ordinals to manage (after CUDA_VISIBLE_DEVICES); null = every visible GPU.")

    @field_validator("gpu_ids")
    @classmethod
    def _unique_ids(cls, ids: Optional[list[int]]) -> Optional[list[int]]:
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError(f"GPU ids must be unique, got {ids}")
        return ids


class MemoryConfig(_Section):
    """Sizes of the three tier arenas and of the staging buffer."""

    hbm_reserve_mb: int = Field(
        ..., ge=0, le=1 << 24, description="MB of each GPU's memory left to weights and activations.")
    hbm_capacity_mb: Optional[int] = Field(
        None, gt=0, le=1 << 24,
        description="Cap on the HBM tier per GPU; on a host-only machine the size of the host-memory "
                    "stand-in for HBM (then required).")
    dram_capacity_mb: int = Field(..., ge=0, le=1 << 26, description="MB of pinned host memory for the DRAM tier.")
    nvme_capacity_mb: int = Field(
        0, ge=0, le=1 << 30, description="MB of the preallocated NVMe file; 0 = no NVMe tier.")
    nvme_path: Optional[str] = Field(
        None, min_length=1,
        description="Path of the preallocated NVMe file; `~` expands, relative paths resolve against "
                    "the config file's folder. Required when nvme_capacity_mb > 0.")
    staging_buffer_size_mb: int = Field(
        64, gt=0, le=1 << 16, description="MB of pinned staging buffer that batch moves go through.")
    page_kb: int = Field(
        2048, ge=64, le=1 << 20,
        description="Arena page size (KB) for slot allocation; a power of two.")

    @field_validator("nvme_path")
    @classmethod
    def _plain_nvme_path(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            not_a_folder(value, value, "the cache file's", "nvme.cache")
        return None if value is None else plain_text(value)

    @field_validator("page_kb")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "MemoryConfig":
        if self.nvme_capacity_mb > 0 and self.nvme_path is None:
            raise ConfigError("memory.nvme_path", "required when memory.nvme_capacity_mb > 0")
        return self

    @model_validator(mode="after")
    def _tiers_hold_a_page(self) -> "MemoryConfig":
        # Arenas are cut into whole pages: a tier smaller than one page would hold no block at all.
        for key in ("hbm_capacity_mb", "dram_capacity_mb", "nvme_capacity_mb"):
            value = getattr(self, key)
            if value and value * MB < self.page_kb * 1024:
                raise ConfigError(f"memory.{key}", f"{value} MB is less than one page (memory.page_kb is "
                                                   f"{self.page_kb} KB): the tier would hold no block")
        return self


MAX_PREFETCH_WINDOW = 65536


class KVBlockConfig(_Section):
    """Block geometry and read-ahead."""

    block_size: int = Field(256, ge=16, le=4096, description="Tokens of KV per block (all layers of one layout).")
    prefetch_window: int = Field(4, ge=0, le=MAX_PREFETCH_WINDOW,
                                 description="Blocks ahead of a request's read position promoted before they are needed.")


class LayoutConfig(_Section):
    """One KV layout to plan for; clients register more when they attach."""

    num_layers: int = Field(..., gt=0, le=4096, description="Transformer layers.")
    num_kv_heads: int = Field(0, ge=0, le=4096, description="KV heads per layer (ignored for MLA).")
    head_dim: int = Field(0, ge=0, le=8192, description="Elements per head (ignored for MLA).")
    dtype: str = Field(..., description=f"Element type: one of {sorted(DTYPE_BITS)}.")
    tokens_per_block: Optional[int] = Field(
        None, ge=1, le=4096, description="Tokens per block; null = kv_block.block_size.")
    mla_latent_dim: int = Field(0, ge=0, le=65536, description="MLA latent size; > 0 makes this an MLA layout.")
    mla_rope_dim: int = Field(0, ge=0, le=65536, description="MLA rotary part stored next to the latent.")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPE_BITS:
            raise ValueError(f"must be one of {sorted(DTYPE_BITS)}")
        return value


class Watermark(_Section):
    """Fill fractions of one tier: demotion starts above `high` and stops at `low`."""

    high: float = Field(..., gt=0, le=1, description="Start demoting above this fill fraction.")
    low: float = Field(..., gt=0, lt=1, description="Stop demoting at this fill fraction; < high.")

    @field_validator("low")
    @classmethod
    def _below_high(cls, low: float, info) -> float:
        high = info.data.get("high")
        if high is not None and not low < high:
            raise ValueError(f"must be below high ({high})")
        return low


class Watermarks(_Section):
    """Watermarks per tier."""

    hbm: Watermark = Field(Watermark(high=0.95, low=0.85), description="HBM tier.")
    dram: Watermark = Field(Watermark(high=0.90, low=0.80), description="DRAM tier.")
    nvme: Watermark = Field(Watermark(high=0.95, low=0.85), description="NVMe tier.")


class HeatWeights(_Section):
    """Weights of the heat policy's terms: their ratios order the blocks within each of the split's lists
    (a fixed bonus, heat_lut.SPLIT_BONUS, ranks the lists: weights large enough outweigh it)."""

    frequency: float = Field(0.0, ge=0, le=1e6, description=(
        "Learned hit density of the access-count class (0: the count only splits first-timers from "
        "returning blocks)."))
    recency: float = Field(1.0, ge=0, le=1e6, description="Time since last access.")
    recency_below: float = Field(1.0, ge=0, le=1e6,
                                 description="Extra weight of the time since last access for blocks below HBM.")
    priority: float = Field(1.0, ge=0, le=1e6, description="Priority of the owning request.")
    sharing: float = Field(1.0, ge=0, le=1e6, description="Live requests referencing the block.")
    fanout: float = Field(0.0, ge=0, le=1e6, description="Cached children of the block (prefix fan-out).")
    stage: float = Field(1.0, ge=0, le=1e6, description="Stage of the request (decoding > finished): a block a "
                         "request holds (referenced or pinned) over one every request let go of.")


class PolicyConfig(_Section):
    """Which blocks move, when, and in what batches."""

    name: str = Field("lru", min_length=1, max_length=64, description="Policy looked up by name in the registry.")
    cold_threshold: float = Field(
        0.5, ge=0, le=1, description="A block is cold below this heat percentile of its tier.")
    swap_batch_size: int = Field(1024, ge=1, le=65536, description="Most blocks in one batch move.")
    rescore_interval_ms: int = Field(100, gt=0, le=3_600_000, description="Period of heat re-scoring.")
    decay_half_life_s: float = Field(DEFAULT_DECAY_HALF_LIFE_S, gt=0, le=MAX_DECAY_HALF_LIFE_S,
                                     description="Half-life of the decayed access count (wall time).")
    watermarks: Watermarks = Field(Watermarks(), description="High/low watermarks per tier.")
    weights: HeatWeights = Field(HeatWeights(), description="Weights of the heat policy.")
    duel_sample: int = Field(
        DEFAULT_DUEL_SAMPLE, ge=0, le=1 << 20,
        description="Heat policy: rank as the best of heat, LRU and LFU, judged by miniature replays of 1 in "
                    "N content keys (dflash2/duel.py; more, down to 1 in 2, where 1/N of HBM holds fewer "
                    "than 32 blocks; fewer, 1 in N x 2^k, once the daemon's loop keeps falling behind); 0 = off.")

    @field_validator("duel_sample")
    @classmethod
    def _sample(cls, value: int) -> int:
        if value == 1:
            raise ValueError(DUEL_SAMPLE_OF_ONE)
        return value


class AdmissionConfig(_Section):
    """Reservations before a request runs."""

    smoothing_window_ms: int = Field(
        200, gt=0, le=600_000, description="Low-pass window over reservation demand, so bursts do not "
                                           "set off demotion storms.")
    reservation_ttl_s: float = Field(30.0, gt=0, le=86400, description=(
        "A reservation expires after this (a client deadline may shorten it, never lengthen it)."))
    max_deferred: int = Field(1024, gt=0, le=1_000_000, description="Most reservations waiting in the queue.")
    preemption: bool = Field(True, description=(
        "A higher-priority reservation may demote running lower-priority requests' blocks."))
    burst_fraction: float = Field(
        0.1, gt=0, le=1, description="Fraction of the HBM tier that admission may demote at once before "
                                     "pacing further demotions at the smoothed demand rate.")
    max_client_share: float = Field(1.0, gt=0, le=1, description=(
        "Most of the HBM tier one client may hold (reserve rejected, allocate refused beyond it)."))


def not_a_folder(path: str, value: str, what: str, example: str) -> None:
    """Refuse a file's path written as a folder's: the trailing slash, or `.`, went when the path was
    resolved, and the folder meant became the file (memory.nvme_path; then an ipc endpoint's
    `.../sockdir/` made a socket named `sockdir`, and a tcp_key_file `keys/` a key file `keys`: a review)."""
    tail = "/" if path.endswith("/") else os.path.basename(path)
    if tail in ("/", ".", ".."):
        raise ValueError(f"{value!r} ends in '{tail}', a folder; give {what} path in it (e.g. "
                         f"{value.rstrip('/')}/{example})")


class DaemonConfig(_Section):
    """The daemon process: control endpoint, state folder, client leases."""

    endpoint: Optional[str] = Field(
        None, min_length=1,
        description="ZeroMQ endpoint, `ipc://PATH` or `tcp://HOST:PORT`; null = ipc socket in the runtime "
                    "folder ($XDG_RUNTIME_DIR/dflash2/dflash2.sock or /tmp/dflash2-$UID/dflash2.sock).")
    state_dir: Optional[str] = Field(
        None, min_length=1,
        description="Folder for daemon state (history); resolved like nvme_path; null = "
                    "$XDG_STATE_HOME/dflash2 or ~/.local/state/dflash2.")
    tcp_key_file: Optional[str] = Field(
        None, min_length=1,
        description="A tcp endpoint's CURVE key file, which the daemon makes (owner-only) at its first start and "
                    "a client must read to attach, and beside it PATH.monitor, whose readers may ask status, "
                    "history and check only; resolved like nvme_path; null = tcp-PORT.key in the runtime "
                    "folder. Ignored for an ipc endpoint.")
    lease_timeout_s: float = Field(10.0, gt=0, le=3600, description="A client whose lease lapses this long is dead.")
    heartbeat_interval_s: float = Field(2.0, gt=0, le=3600, description="Clients renew their lease this often.")
    request_timeout_s: float = Field(5.0, gt=0, le=3600, description="Every control request times out after this.")
    set_aside_leases: int = Field(
        30, ge=0, le=100000,
        description="A client whose lease lapsed while its process may still run (or runs in another pid "
                    "namespace) keeps the blocks it was writing out of reuse until the process is gone, or "
                    "this many leases; 0 frees them at once (a resumed write can then overwrite cached blocks).")

    @field_validator("endpoint")
    @classmethod
    def _scheme(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            scheme, rest = endpoint_parts(plain_text(value))
            if scheme == "ipc":
                not_a_folder(rest, value, "the socket's", "dflash2.sock")
        return value

    @field_validator("state_dir")
    @classmethod
    def _plain_state_dir(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else plain_text(value)

    @field_validator("tcp_key_file")
    @classmethod
    def _plain_key_file(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            not_a_folder(value, value, "the key file's", "tcp.key")
        return None if value is None else plain_text(value)

    @model_validator(mode="after")
    def _below_lease(self) -> "DaemonConfig":
        """The heartbeat below the lease, its default too (a lease of 2 s or less with the default
        heartbeat was taken: pydantic checks no default, and every idle client lost its lease)."""
        if not self.heartbeat_interval_s < self.lease_timeout_s:
            why = f"must be below daemon.lease_timeout_s ({self.lease_timeout_s}), got {self.heartbeat_interval_s}"
            if "heartbeat_interval_s" not in self.model_fields_set:
                why += " (its default): a lease this short needs daemon.heartbeat_interval_s set below it"
            raise ConfigError("daemon.heartbeat_interval_s", why)
        return self


class MetricsConfig(_Section):
    """Prometheus `/metrics` endpoint."""

    port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 = off.")
    host: str = Field("127.0.0.1", min_length=1, description="Address to listen on.")

    @field_validator("host")
    @classmethod
    def _plain_host(cls, value: str) -> str:
        plain_text(value)
        # (the resolver refused these at start-up: "Name or service not known"; a bracketed IPv4 address or
        # name too, with no colon in it, a review)
        if ":" in value or "/" in value or value.startswith("["):
            bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
            try:
                ipaddress.ip_address(bare)
            except ValueError:
                raise ValueError("not an address or a host name: give the host alone, such as 127.0.0.1 or ::1 "
                                 "(metrics.port is the port)") from None
            if bare != value:
                kind = "an IPv6 address" if ":" in bare else "an address"
                raise ValueError(f"{kind} is written without brackets here: {bare}")
        try:  # (as the resolver takes a name: `node1..example.com` made --check and start-up tracebacks)
            value.encode("idna")
        except UnicodeError:
            raise ValueError(f"{value!r} is not a host name: a label (between dots) is empty or longer than 63 "
                             "characters") from None
        return value


class LoggingConfig(_Section):
    """Daemon logs."""

    format: Literal["json", "text"] = Field("json", description="Structured JSON lines or plain text.")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Least severe level logged.")


class Config(_Section):
    """The whole file. Frozen after load; `source_path` is the file it came from."""

    enable: bool = Field(..., description="Must be true to run the daemon.")
    history_enabled: bool = Field(False, description="Keep a time series of metrics to read back later.")
    device: DeviceConfig = Field(DeviceConfig(), description="Device selection.")
    memory: MemoryConfig = Field(..., description="Tier and staging sizes.")
    kv_block: KVBlockConfig = Field(KVBlockConfig(), description="Block geometry.")
    layouts: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")], LayoutConfig] = Field(
        {}, description="Layouts to plan for, by name.")
    policy: PolicyConfig = Field(PolicyConfig(), description="Placement policy.")
    admission: AdmissionConfig = Field(AdmissionConfig(), description="Reservations and admission.")
    daemon: DaemonConfig = Field(DaemonConfig(), description="Daemon process.")
    metrics: MetricsConfig = Field(MetricsConfig(), description="Prometheus metrics.")
    logging: LoggingConfig = Field(LoggingConfig(), description="Logging.")

    _source_path: Optional[Path] = PrivateAttr(None)

    @model_validator(mode="after")
    def _layouts_are_whole(self) -> "Config":
        staging = self.memory.staging_buffer_size_mb * MB
        for name, layout in self.layout_objects().items():
            if layout.block_bytes > staging:
                raise ConfigError("memory.staging_buffer_size_mb",
                                  f"{self.memory.staging_buffer_size_mb} MB cannot hold one block of layout "
                                  f"{name!r} ({layout.block_bytes / MB:.1f} MB); raise it or lower the block size")
        if self.device.kind == "host" and self.memory.hbm_capacity_mb is None:
            raise ConfigError("memory.hbm_capacity_mb", HOST_NEEDS_HBM_CAPACITY)
        self._metrics_port_is_free_of_the_endpoint()
        return self

    def _metrics_port_is_free_of_the_endpoint(self) -> None:
        """The metrics server and a tcp control endpoint cannot listen on one port of one address (a
        wildcard address overlaps every other): caught here, not as a failed start-up."""
        if not self.metrics.port or self.daemon.endpoint is None:
            return
        scheme, rest = endpoint_parts(self.daemon.endpoint)
        if scheme != "tcp":
            return
        host, _, port = rest.rpartition(":")
        if int(port) == self.metrics.port and hosts_overlap(host, self.metrics.host):
            raise ConfigError("metrics.port", f"{self.metrics.port} is daemon.endpoint's port too "
                                              f"({self.daemon.endpoint}); give metrics another port")

    def layout_objects(self) -> dict[str, Layout]:
        """The configured layouts as `Layout`s; a malformed one raises ConfigError naming `layouts.NAME`."""
        out = {}
        for name, spec in self.layouts.items():
            fields = spec.model_dump()
            if fields["tokens_per_block"] is None:
                fields["tokens_per_block"] = self.kv_block.block_size
            try:
                out[name] = Layout(name=name, **fields)
            except LayoutError as exc:
                raise ConfigError(f"layouts.{name}", str(exc)) from None
        return out

    @property
    def source_path(self) -> Optional[Path]:
        """The file this config was loaded from (absolute), or None when built from a dict."""
        return self._source_path

    @property
    def base_dir(self) -> Path:
        """Relative paths resolve against this: the config file's folder, else the working directory."""
        return self._source_path.parent if self._source_path else Path.cwd()

    def resolve_path(self, raw: str, key: str, follow_links: bool = False, own_name: bool = False) -> Path:
        """`raw` made absolute: a relative path against base_dir (its symlinks followed; with `own_name`,
        those of its folder only: a key file, which must not be a link, is checked under its own name),
        an absolute one as written, or with its symlinks followed too when `follow_links` (the NVMe
        file: its disk's room is the target's). A socket's path stays as written: a link to a long
        folder would take it past the 107 bytes a socket path may have."""
        path = expand_user(raw, key)
        if path.is_absolute() and not follow_links:
            return path
        try:
            if own_name and path.name not in ("", ".", ".."):
                return (self.base_dir / path.parent).resolve() / path.name
            return (path if path.is_absolute() else self.base_dir / path).resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
            raise ConfigError(key, f"{raw!r} cannot be resolved: {e}") from None

    @property
    def resolved_nvme_path(self) -> Optional[Path]:
        if self.memory.nvme_path is None:
            return None
        return self.resolve_path(self.memory.nvme_path, "memory.nvme_path", follow_links=True)

    def resolved_state_dir(self, environ: Mapping[str, str] = os.environ) -> Path:
        if self.daemon.state_dir is not None:
            return self.resolve_path(self.daemon.state_dir, "daemon.state_dir")
        base = xdg_dir(environ, "XDG_STATE_HOME") or str(expand_user("~/.local/state", "daemon.state_dir (not set: "
                                                                "the default ~/.local/state/dflash2)"))
        return Path(base) / "dflash2"

    def resolved_endpoint(self, environ: Mapping[str, str] = os.environ) -> str:
        """The endpoint to bind/connect: a relative ipc path resolves like nvme_path."""
        if self.daemon.endpoint is None:
            return default_endpoint(environ)
        scheme, rest = endpoint_parts(self.daemon.endpoint)
        if scheme == "ipc":
            return f"ipc://{self.resolve_path(rest, 'daemon.endpoint')}"
        return self.daemon.endpoint

    def resolved_tcp_key_file(self, environ: Mapping[str, str] = os.environ) -> Optional[Path]:
        """A tcp endpoint's key file (dflash2/tcpkeys.py); None for an ipc endpoint."""
        endpoint = self.resolved_endpoint(environ)
        if self.daemon.tcp_key_file is None or not endpoint.startswith("tcp://"):
            return tcp_key_path(endpoint, environ)
        # (its folder resolved alone: a relative key file that is a link was followed, and its target
        # used, where the same link written absolute is refused, a review)
        return self.resolve_path(self.daemon.tcp_key_file, "daemon.tcp_key_file", own_name=True)

    def client_endpoint(self, environ: Mapping[str, str] = os.environ) -> str:
        """The endpoint a client on this node connects to: `resolved_endpoint`, but for a daemon
        bound to every address (tcp://*:PORT, 0.0.0.0, [::]), which nobody can connect to, the
        loopback address of that family."""
        return connectable(self.resolved_endpoint(environ))


def expand_user(raw: str, key: str) -> Path:
    """`raw` with a leading ~ or ~user expanded; ConfigError naming `key` when it cannot be (no such
    user, or no home directory: a uid without a passwd entry and no $HOME, as in some containers, or
    a $HOME that is empty or relative)."""
    if raw == "~" or raw.startswith("~/"):
        home = os.environ.get("HOME")
        if home is not None and not os.path.isabs(home):
            # Python takes an empty $HOME for "/" and a relative one as it is: a GB-sized NVMe file
            # went to the root disk, or under the daemon's working folder, without a word (a review).
            raise ConfigError(key, f"cannot expand '~' in {raw!r}: $HOME is {home!r}, not an absolute path; set "
                                   "HOME or give an absolute path")
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        user = raw[1:].split("/", 1)[0]
        who = f"user {user!r}" if user else "this user (no $HOME and no passwd entry)"
        raise ConfigError(key, f"cannot expand {raw.split('/', 1)[0]!r} in {raw!r}: {who} has no home directory "
                               "here; give an absolute path") from None


HOST_NEEDS_HBM_CAPACITY = ("required when the device kind is host (no GPU): it is the size of the "
                           "host-memory stand-in for HBM")


# ----------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike) -> Config:
    """Read and validate a config file; any problem is one ConfigError naming the key (or the file)."""
    if not str(path).strip():  # ('' read the working folder: "Is a directory")
        raise ConfigError("--config", f"names no file (it was given {str(path)!r})")
    try:
        path = expand_user(str(path), "--config").absolute()
    except FileNotFoundError:  # (os.getcwd() in a folder removed since: a traceback, where this is exit 2)
        raise ConfigError("--config", f"{str(path)!r} is relative and the working directory no longer exists; "
                                      "give an absolute path") from None
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "config file not found") from None
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the config file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"the config file is not UTF-8 text: byte {exc.object[exc.start]:#04x} "
                                     f"at offset {exc.start}") from None
    if text.startswith("\ufeff"):  # (json's own words told the user to "decode using utf-8-sig")
        raise ConfigError(str(path), "invalid JSON: the file begins with a byte-order mark (bytes EF BB BF), which "
                                     "JSON does not allow; save it as UTF-8 without a BOM")
    try:
        data = strictjson.loads(text)
    except strictjson.KeyTwice as exc:
        # (by its dotted path as any other key's, quoted where it must be: a key with a newline split
        # the one-line error, an empty one read ": appears twice", a dotted layout name read as a path)
        key = dotted_key(exc.parts, markers=False)
        if len(exc.parts) == 1 and key != exc.parts[0]:
            key += " (at the top level)"
        raise ConfigError(key, "appears twice in one object (JSON keeps the last; which did you mean?)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:  # a number of over 4300 digits; nesting deeper than the stack
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise ConfigError(str(path), f"invalid JSON: {what}") from None
    return parse_config(data, source_path=path)


def parse_config(data: object, source_path: Optional[Path] = None) -> Config:
    """Validate already-parsed JSON; relative paths will resolve against `source_path`'s folder."""
    where = str(source_path) if source_path else "config"
    if not isinstance(data, dict):
        raise ConfigError(where, "the top level must be a JSON object")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise first_error(exc, Config) from None
    cfg._source_path = source_path
    return cfg


def require_enabled(cfg: Config) -> None:
    """Raise DisabledError unless `enable` is true."""
    if not cfg.enable:
        where = cfg.source_path or "the configuration"
        raise DisabledError(f"DFlash2 is disabled: `enable` is false in {where}; set it to true to run the daemon")
