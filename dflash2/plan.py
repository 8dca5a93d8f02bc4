"""The resolved plan of a config: what each tier arena will be, and how many blocks of each layout fit.

`resolve_plan(cfg)` turns the config into numbers without taking any memory: the device kind
(`auto` resolved), each tier's capacity in bytes, alignment and page size, blocks per configured
layout, the staging size, the NVMe file and the endpoint. `dflash2d --check` prints it.

GPU memory is probed through the CUDA driver (libcuda via ctypes), else torch when it is installed;
torch stays optional and is never imported at module level. Where neither answers, a GPU tier's
capacity is "unknown until start-up".
"""

from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import os
import re
import socket
import sys
from pathlib import Path
from typing import Optional

from dflash2 import threads
from dflash2.alloc import blocks_that_fit, slot_bytes
from dflash2.config import HOST_NEEDS_HBM_CAPACITY, MB, Config
from dflash2.cudadriver import libcuda
from dflash2.endpoints import check_socket_path, hosts_overlap, interface_host, numeric_address
from dflash2.errors import ConfigError
from dflash2.layout import Layout
from dflash2.tiers import Tier

MEMORY_ALIGNMENT = 256  # bytes; every HBM slot starts on this boundary (coalesced GPU access)
DRAM_ALIGNMENT = 4096  # bytes; page-aligned DRAM slots can go to and from NVMe by O_DIRECT without a copy
NVME_ALIGNMENT = 4096  # bytes; O_DIRECT needs offsets and sizes on the logical block size
UNKNOWN = "unknown until start-up"


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """One arena. `capacity_bytes` is None when it can only be known at start-up (GPU not probed)."""

    tier: Tier
    where: str  # "cuda:0", "host" (shared memory standing in for HBM), "pinned host", "file"
    capacity_bytes: Optional[int]
    alignment: int
    page_bytes: int
    blocks: dict[str, Optional[int]]  # layout name -> blocks that fit when that layout has the arena alone
    unused_bytes: int = 0  # of the size configured (or probed), past the last whole page: never used

    def to_dict(self) -> dict:
        return {"tier": self.tier.label, "where": self.where, "capacity_bytes": self.capacity_bytes,
                "alignment": self.alignment, "page_bytes": self.page_bytes, "blocks": dict(self.blocks)}


@dataclasses.dataclass(frozen=True)
class Plan:
    source_path: Optional[Path]
    device_kind: str  # "cuda" or "host": `auto` resolved
    tiers: tuple[TierPlan, ...]
    layouts: dict[str, Layout]
    staging_bytes: int
    nvme_path: Optional[Path]
    endpoint: str
    state_dir: Path | None  # None: history off and its default could not be resolved (`_state_dir`)
    notes: tuple[str, ...]
    tcp_key_file: Optional[Path] = None  # a tcp endpoint's key file (tcpkeys.py); None for ipc

    @property
    def pools(self) -> int:
        """Block pools: one per GPU (one HBM tier each), one on a host-only node."""
        return sum(1 for t in self.tiers if t.tier == Tier.HBM)

    def pool_bytes(self, tp: TierPlan) -> int:
        """One pool's share of a DRAM or NVMe tier: 1/pools of it in whole pages (assemble.tier_specs)."""
        return tp.capacity_bytes // self.pools // tp.page_bytes * tp.page_bytes

    def nvme_files(self) -> list[Path]:
        """The NVMe files the pools open: nvme_path itself with one pool, nvme_path.gpuN (N the GPU's
        index) with several, so that no pool's moves cross GPUs."""
        if self.nvme_path is None:
            return []
        hbm = [t for t in self.tiers if t.tier == Tier.HBM]
        if len(hbm) == 1:
            return [self.nvme_path]
        return [self.nvme_path.with_name(f"{self.nvme_path.name}.gpu{t.where.split(':')[1]}") for t in hbm]

    @property
    def staging_taken_bytes(self) -> int:
        """Host memory the staging buffers take at start-up with an NVMe tier: each block pool (one a
        GPU, one on a host-only node) has its NVMe tier's staging ring, and on a GPU also a pinned
        buffer of the same size for HBM<->NVMe moves."""
        return self.staging_bytes * self.pools * (2 if self.device_kind == "cuda" else 1)

    @property
    def total_bytes(self) -> Optional[int]:
        """Bytes of every tier together (the virtual cache size), or None while a GPU tier is unknown."""
        sizes = [t.capacity_bytes for t in self.tiers]
        return None if None in sizes else sum(sizes)

    def to_dict(self) -> dict:
        return {
            "source_path": str(self.source_path) if self.source_path else None,
            "device_kind": self.device_kind,
            "tiers": [t.to_dict() for t in self.tiers],
            "layouts": {name: {"block_bytes": lay.block_bytes, "tokens_per_block": lay.tokens_per_block}
                        for name, lay in self.layouts.items()},
            "staging_bytes": self.staging_bytes,
            "staging_taken_bytes": self.staging_taken_bytes,
            "nvme_path": str(self.nvme_path) if self.nvme_path else None,
            "endpoint": self.endpoint,
            "tcp_key_file": str(self.tcp_key_file) if self.tcp_key_file else None,
            "state_dir": None if self.state_dir is None else str(self.state_dir),
            "total_bytes": self.total_bytes,
            "notes": list(self.notes),
        }

    def render_text(self) -> str:
        return "\n".join(_render_lines(self))


def resolve_plan(cfg: Config) -> Plan:
    """The plan for `cfg` on this machine; a config that cannot run here raises ConfigError."""
    notes: list[str] = []
    kind, gpus = _resolve_device(cfg, notes)
    layouts = cfg.layout_objects()
    page = cfg.memory.page_kb * 1024
    mem = cfg.memory
    hbm = _hbm_tiers(cfg, kind, gpus, notes)
    tiers = [*hbm,  # (DRAM and NVMe: each of the pools, one per GPU, takes its share in whole pages)
             _tier(Tier.DRAM, "pinned host" if kind == "cuda" else "host shared memory",
                   mem.dram_capacity_mb * MB, DRAM_ALIGNMENT, page, layouts, share=len(hbm)),
             _tier(Tier.NVME, "file", mem.nvme_capacity_mb * MB, NVME_ALIGNMENT, page, layouts, share=len(hbm))]
    if not layouts:
        notes.append("no layouts configured: blocks per layout are known once clients attach")
    _layouts_fit(tiers, layouts, notes)
    plan = Plan(source_path=cfg.source_path, device_kind=kind, tiers=tuple(tiers), layouts=layouts,
                staging_bytes=mem.staging_buffer_size_mb * MB,
                nvme_path=cfg.resolved_nvme_path if mem.nvme_capacity_mb else None,  # (no tier: no file, said as such)
                endpoint=_checked_endpoint(cfg, resolve=True), state_dir=_state_dir(cfg), notes=tuple(notes),
                tcp_key_file=cfg.resolved_tcp_key_file())
    if plan.pools > 1:
        plan = dataclasses.replace(plan, notes=(*plan.notes, *_split_between_gpus(plan)))
    _nvme_file_is_no_other(plan, cfg.history_enabled)
    return plan


def _nvme_file_is_no_other(plan: Plan, history: bool) -> None:
    """An NVMe file at the path of another file the daemon makes (the socket, its lock, the key files,
    the history's files or its state folder) is refused: --check passed it, and the daemon started,
    the socket made over the cache file, or the history rotating it away as `history.jsonl.1` (a
    review)."""
    from dflash2.history import OWN_NAMES
    from dflash2.tcpkeys import monitor_path

    others: dict[Path, str] = {}
    if plan.endpoint.startswith("ipc://"):
        socket_path = Path(plan.endpoint[len("ipc://"):])
        others[socket_path] = "daemon.endpoint's socket"
        others[socket_path.with_name(socket_path.name + ".lock")] = "daemon.endpoint's lock file"
    if plan.tcp_key_file is not None:
        others[plan.tcp_key_file] = "daemon.tcp_key_file"
        others[monitor_path(plan.tcp_key_file)] = "daemon.tcp_key_file's monitoring file"
    if history and plan.state_dir is not None:
        others[plan.state_dir] = "daemon.state_dir"
        others.update({plan.state_dir / name: f"the history's {name} in daemon.state_dir" for name in OWN_NAMES})
    taken = {os.path.realpath(path): what for path, what in others.items()}
    for nvme_file in plan.nvme_files():
        if (what := taken.get(os.path.realpath(nvme_file))) is not None:
            raise ConfigError("memory.nvme_path", f"{nvme_file} is {what} too: the daemon would make both files at "
                                                  "one path; give the NVMe file a path of its own")


def _state_dir(cfg: Config) -> Path | None:
    """The state folder, which only the history uses: with history off, the default when it cannot be
    resolved ($HOME empty or relative) is None rather than an error (a review: a daemon that never
    uses the folder refused to start)."""
    try:
        return cfg.resolved_state_dir()
    except ConfigError:
        if cfg.history_enabled or cfg.daemon.state_dir is not None:  # (a folder set and wrong is an error)
            raise
        return None


def _split_between_gpus(plan: Plan) -> list[str]:
    """With several GPUs each pool takes 1/pools of DRAM and NVMe (whole pages): a share under one
    page leaves that GPU without the tier, and a layout may fit a tier whole but no GPU's share of
    it, so both are refused here (ConfigError) as the undivided sizes would be; a note says the
    shares and the files."""
    shared = [t for t in plan.tiers if t.tier != Tier.HBM and t.capacity_bytes]
    for t in shared:
        if plan.pool_bytes(t) == 0:
            key = "memory.dram_capacity_mb" if t.tier == Tier.DRAM else "memory.nvme_capacity_mb"
            raise ConfigError(key, f"split between {plan.pools} GPUs, each GPU's share of the {t.tier.label} tier "
                                   f"({t.capacity_bytes // plan.pools} bytes) is less than one page of "
                                   f"{t.page_bytes}; raise it, or set it to 0 for no {t.tier.label} tier")
    for hbm in (t for t in plan.tiers if t.tier == Tier.HBM):
        pool = [hbm, *(_tier(t.tier, t.where, plan.pool_bytes(t), t.alignment, t.page_bytes, plan.layouts)
                       for t in shared)]
        try:
            _layouts_fit(pool, plan.layouts, [])
        except ConfigError as e:
            raise ConfigError(e.key, f"{e.problem} (in the pool of {hbm.where}: each GPU takes 1/{plan.pools} of "
                                     "DRAM and NVMe)") from None
    shares = " and ".join(f"{human_bytes(plan.pool_bytes(t))} of {t.tier.label}" for t in shared)
    files = plan.nvme_files()
    return [f"{plan.pools} GPUs: each GPU's block pool takes {shares or 'no lower tier'} (the sizes above are "
            "the node's)" + (f"; NVMe files {files_said(files)}" if files and any(
                t.tier == Tier.NVME for t in shared) else "")]


def files_said(files: list[Path]) -> str:
    """NVMe files (`Plan.nvme_files`, or where their links lead) named in a message: the first to the
    last where they are one GPU's each, of indices without a gap; each otherwise (GPUs 1 and 3 were
    said "X.gpu1 to X.gpu3")."""
    found = [re.fullmatch(r"\.gpu(\d+)", f.suffix) for f in files]
    gpus = [int(m[1]) for m in found if m]
    if (len(files) > 2 and len(gpus) == len(files) and gpus == list(range(gpus[0], gpus[0] + len(gpus)))
            and len({f.with_suffix("") for f in files}) == 1):  # (links to other folders: each, a review)
        return f"{files[0]} to {files[-1]}"
    return ", ".join(str(f) for f in files)


# A configured layout whose slots in a tier are at least this many times its blocks is warned about.
ROUNDING_WARN_FACTOR = 2


# A tier whose size past its last whole page is at least this share of it is warned about.
PAGE_REMAINDER_WARN = 0.01


def rounding_warnings(plan: Plan, own_tokens: frozenset[str] = frozenset()) -> list[str]:
    """One line per tier whose size is not a whole number of pages by PAGE_REMAINDER_WARN or more,
    and one per configured layout whose blocks take slots at least ROUNDING_WARN_FACTOR times
    their size in some tier (DRAM and NVMe slots are 4 KiB aligned, for O_DIRECT): 1 KiB blocks
    took 4 KiB slots, a quarter of those tiers' bytes held blocks (a scale review's daemon: 1.37 GB
    of rounding in 2 GiB of DRAM), which --check showed only as a block count. `own_tokens`: the layouts
    that give their own tokens_per_block, which kv_block.block_size does not change (it was advised)."""
    out = []
    for t in plan.tiers:
        if t.unused_bytes and t.unused_bytes >= PAGE_REMAINDER_WARN * (t.capacity_bytes + t.unused_bytes):
            each = plan.pools > 1 and t.tier != Tier.HBM  # (split between the GPUs' pools, each in whole pages)
            out.append(f"memory.{t.tier.label}_capacity_mb: the {t.tier.label} tier is not a whole number of pages "
                       + (f"per GPU ({plan.pools} GPUs, " if each else "(")
                       + f"memory.page_kb, {human_bytes(t.page_bytes)}): it uses {human_bytes(t.capacity_bytes)}, and "
                       f"{human_bytes(t.unused_bytes)} of it stays unused; a multiple of the page"
                       + (f" times {plan.pools}" if each else "") + " wastes nothing")
    for name, lay in plan.layouts.items():
        wasted = [t for t in plan.tiers if t.capacity_bytes and slot_bytes(lay.block_bytes, t.alignment)
                  >= ROUNDING_WARN_FACTOR * lay.block_bytes]
        if wasted:
            # Each tier with its own slot and alignment, tiers alike said together (the first's
            # were said of all, a review).
            groups: dict[tuple[int, int], list[str]] = {}
            for t in wasted:
                groups.setdefault((slot_bytes(lay.block_bytes, t.alignment), t.alignment), []).append(t.tier.label)
            said = "; ".join(f"slots of {slot} bytes in {' and '.join(labels)} ({align}-byte alignment): "
                             f"{100 * (1 - lay.block_bytes / slot):.0f}% of {'that tier' if len(labels) == 1 else 'those tiers'} "
                             "would hold nothing" for (slot, align), labels in groups.items())
            larger = (f"layouts.{name}.tokens_per_block" if name in own_tokens
                      else "kv_block.block_size (tokens per block)")
            out.append(f"layouts.{name}: its blocks of {lay.block_bytes} bytes take {said}; a larger {larger} "
                       "wastes less")
    return out


def _layouts_fit(tiers: list[TierPlan], layouts: dict[str, Layout], notes: list[str]) -> None:
    """A configured layout must fit at least one block in some tier (ConfigError naming it); one that
    fits none in HBM gets a note: only host-side writers (tier "dram") can use it."""
    for name, lay in layouts.items():
        known = [t for t in tiers if t.capacity_bytes]  # a GPU tier not probed here, or a tier of 0 bytes: left out
        if known and all(t.blocks[name] == 0 for t in known):
            largest = max(known, key=lambda t: t.capacity_bytes)
            raise ConfigError(f"layouts.{name}", f"a block of {lay.block_bytes} bytes fits in no tier (the largest, "
                                                 f"{largest.tier.label}, holds {largest.capacity_bytes} bytes in pages "
                                                 f"of {largest.page_bytes}); lower tokens_per_block or raise the tiers")
        # Clients write blocks in HBM or DRAM (allocate's tiers); NVMe holds only blocks moved down. One
        # that fits NVMe alone was said usable "in tier dram", and no client could write it (a review).
        writers = [t for t in tiers if t.tier in (Tier.HBM, Tier.DRAM)]
        if all(t.capacity_bytes is not None and t.blocks[name] in (0, None) for t in writers):
            raise ConfigError(f"layouts.{name}", f"a block of {lay.block_bytes} bytes fits in neither HBM nor DRAM, "
                                                 "where clients write their blocks (NVMe holds only blocks moved "
                                                 "down); lower tokens_per_block or raise hbm or dram capacity")
        hbm = [t for t in known if t.tier == Tier.HBM]
        if hbm and all(t.blocks[name] == 0 for t in hbm):
            notes.append(f"layouts.{name}: no block of {lay.block_bytes} bytes fits in HBM: only host-side writers "
                         "(tier dram) can use it")


def _tier(tier: Tier, where: str, capacity: Optional[int], alignment: int, page: int,
          layouts: dict[str, Layout], share: int = 1) -> TierPlan:
    """A tier of `capacity` bytes as the arenas will be: `share` of them (one per pool) of whole pages
    each (a share under one page, which the config and `_split_between_gpus` refuse, is left as it
    is). The plan said the size configured while the daemon used whole pages (50 MB in pages of 32
    MiB: 32 MiB used, `--check` said 50, and a host HBM segment took the rest for nothing; a review)."""
    unused = 0
    if capacity is not None and capacity // share >= page:
        used = capacity // share // page * page * share
        capacity, unused = used, capacity - used
    blocks = {name: None if capacity is None else blocks_that_fit(capacity, page, alignment, lay.block_bytes)
              for name, lay in layouts.items()}
    return TierPlan(tier, where, capacity, alignment, page, blocks, unused)


def _resolve_device(cfg: Config, notes: list[str]) -> tuple[str, Optional[list[Gpu]]]:
    """("cuda" | "host", the GPUs to use or None when they cannot be probed here)."""
    kind = cfg.device.kind
    gpus = probe_gpus() if kind != "host" else []
    if kind == "auto":
        kind = "cuda" if gpus else "host"
        notes.append(f"device.kind auto resolved to {kind}"
                     + ("" if gpus else ": no GPU visible, host memory stands in for HBM"))
    if kind == "host":
        if cfg.memory.hbm_capacity_mb is None:
            raise ConfigError("memory.hbm_capacity_mb", HOST_NEEDS_HBM_CAPACITY)
        return kind, []
    if not gpus:
        notes.append("no GPU is visible on this machine: the HBM tier is " + UNKNOWN)
        return kind, None
    if cfg.device.gpu_ids is None:
        return kind, gpus
    visible = {g.index: g for g in gpus}
    for index in cfg.device.gpu_ids:
        if index not in visible:
            raise ConfigError("device.gpu_ids", f"GPU {index} is not visible; visible GPUs: {sorted(visible)}")
    return kind, [visible[i] for i in cfg.device.gpu_ids]


def _hbm_tiers(cfg: Config, kind: str, gpus: Optional[list[Gpu]], notes: list[str]) -> list[TierPlan]:
    mem, page, layouts = cfg.memory, cfg.memory.page_kb * 1024, cfg.layout_objects()
    if kind == "host":
        return [_tier(Tier.HBM, "host", mem.hbm_capacity_mb * MB, MEMORY_ALIGNMENT, page, layouts)]
    if gpus is None:
        return [_tier(Tier.HBM, "cuda", None, MEMORY_ALIGNMENT, page, layouts)]
    tiers = []
    for gpu in gpus:
        capacity = gpu.total_bytes - mem.hbm_reserve_mb * MB
        if capacity <= 0:
            raise ConfigError("memory.hbm_reserve_mb",
                              f"{mem.hbm_reserve_mb} MB leaves nothing of GPU {gpu.index}'s "
                              f"{gpu.total_bytes // MB} MB ({gpu.name})")
        if mem.hbm_capacity_mb is not None:
            capacity = min(capacity, mem.hbm_capacity_mb * MB)
        if capacity < page:  # (as MemoryConfig refuses a tier under a page: this one started with none, a review)
            raise ConfigError("memory.hbm_reserve_mb",
                              f"{mem.hbm_reserve_mb} MB leaves {capacity} bytes of GPU {gpu.index}'s "
                              f"{gpu.total_bytes // MB} MB ({gpu.name}), less than one page (memory.page_kb is "
                              f"{mem.page_kb} KB): the HBM tier would hold no block")
        tiers.append(_tier(Tier.HBM, f"cuda:{gpu.index}", capacity, MEMORY_ALIGNMENT, page, layouts))
    notes.append("HBM capacity is device memory minus the reserve; start-up takes it from free memory")
    return tiers


def _checked_endpoint(cfg: Config, resolve: bool = False) -> str:
    endpoint = cfg.resolved_endpoint()
    try:
        check_socket_path(endpoint)
    except ValueError as e:
        raise ConfigError("daemon.endpoint", str(e)) from None
    interface = interface_host(endpoint)
    if interface is not None:
        raise ConfigError("daemon.endpoint", f"{interface!r} is the name of a network interface: ZeroMQ binds it, but "
                                             "the clients reading this config cannot connect to it (not a host); give "
                                             "that interface's address, or * for every address")
    if resolve:
        _metrics_port_beside_a_named_endpoint(cfg, endpoint)
    return endpoint


def _addresses(host: str) -> set[str]:
    """The addresses a host name resolves to here (empty where it does not: the probes say so)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return set()
    return {str(ipaddress.ip_address(sockaddr[0].split("%")[0])) for *_, sockaddr in found}


def _metrics_port_beside_a_named_endpoint(cfg: Config, endpoint: str) -> None:
    """The metrics server on the port of a tcp endpoint whose host, or metrics.host, is a name that
    resolves to the other's address (the config compares addresses only: no DNS at config time).
    Each port probed alone was free, `--check` passed, and start-up failed as the endpoint was bound,
    once every tier was taken, "Address already in use" naming no one: its own metrics server held
    it (a review: tcp://vm:P, vm being 127.0.0.1 in /etc/hosts, and metrics on 127.0.0.1:P)."""
    if not cfg.metrics.port or not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if int(port) != cfg.metrics.port or hosts_overlap(host, cfg.metrics.host):  # (the latter: the config's own)
        return
    named = [h for h in (host, cfg.metrics.host) if numeric_address(h) is None]
    if not named:
        return
    ours, theirs = (_addresses(h) if h in named else {numeric_address(h)} for h in (host, cfg.metrics.host))
    shared = sorted(a for a in ours for b in theirs if hosts_overlap(a, b))
    if shared:
        names = " and ".join(repr(h) for h in named)
        raise ConfigError("metrics.port", f"{cfg.metrics.port} is daemon.endpoint's port too ({endpoint}), and "
                                          f"{names} resolve{'s' if len(named) == 1 else ''} here to the same address "
                                          f"({', '.join(dict.fromkeys(shared))}); give metrics another port")


# ----------------------------------------------------------------------------------------------------
# GPU probing


def probe_gpus(import_torch: bool = True) -> Optional[list[Gpu]]:
    """Visible GPUs (after CUDA_VISIBLE_DEVICES), [] when there are none, None when nothing can tell.
    The driver starts a thread of its own at cuInit: it inherits the stop signals blocked, so that
    they reach the main thread (threads.py). `import_torch` False: torch asked only where this
    process has imported it already (a client's attach imported it, 1.5-2 s with the stop signals
    blocked, in a process that never used it, a review): then no driver library is no GPU."""
    with threads.stop_signals_blocked():
        found = _probe_driver()
        if found is not None or import_torch or "torch" in sys.modules:
            return found if found is not None else _probe_torch()
        try:
            libcuda()
        except OSError:
            return []  # (no NVIDIA driver installed: no GPU this process could use, CuPy or not)
        return None


def _probe_driver() -> Optional[list[Gpu]]:
    try:
        cuda = libcuda()
    except OSError:
        return None
    status = cuda.cuInit(0)
    if status == 100:  # CUDA_ERROR_NO_DEVICE
        return []
    count = ctypes.c_int()
    if status != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    gpus = []
    for index in range(count.value):
        device, total, name = ctypes.c_int(), ctypes.c_size_t(), ctypes.create_string_buffer(256)
        if (cuda.cuDeviceGet(ctypes.byref(device), index) != 0
                or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0):
            return None
        cuda.cuDeviceGetName(name, len(name), device)
        gpus.append(Gpu(index, name.value.decode(errors="replace"), total.value))
    return gpus


def _probe_torch() -> Optional[list[Gpu]]:
    try:
        import torch  # optional: only asked when the driver library cannot be loaded directly
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return []
    return [Gpu(i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


# ----------------------------------------------------------------------------------------------------
# Text rendering


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return UNKNOWN
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _render_lines(plan: Plan) -> list[str]:
    lines = [f"dflash2 plan for {plan.source_path or 'an in-memory config'}",
             f"  device:      {plan.device_kind}",
             f"  endpoint:    {plan.endpoint}",
             *([f"  key file:    {plan.tcp_key_file} (a client must read it to attach; monitoring users read "
                f"{plan.tcp_key_file}.monitor: status, history and check only)"] if plan.tcp_key_file else []),
             f"  state dir:   {plan.state_dir or '(none: history is off and $HOME cannot give the default)'}",
             f"  nvme file:   {plan.nvme_path or '(no NVMe tier)'}",
             f"  staging:     {_staging_line(plan)}",
             f"  total cache: {human_bytes(plan.total_bytes)}", ""]
    if plan.layouts:
        lines.append("layouts:")
        for name, lay in plan.layouts.items():
            slots = ", ".join(f"{human_bytes(slot_bytes(lay.block_bytes, t.alignment))} in {t.tier.label}"
                              for t in _one_per_tier(plan))
            lines.append(f"  {name}: {human_bytes(lay.block_bytes)} per block "
                         f"({lay.tokens_per_block} tokens, {lay.num_layers} layers, {lay.dtype}); slot {slots}")
        lines.append("")
    lines.extend(_table(plan))
    lines.extend(f"note: {note}" for note in plan.notes)
    return lines


def _one_per_tier(plan: Plan) -> list[TierPlan]:
    """The first plan of each tier that has bytes (several GPUs: one HBM plan each, alike in alignment)."""
    seen: dict = {}
    for t in plan.tiers:
        if t.capacity_bytes and t.tier not in seen:
            seen[t.tier] = t
    return list(seen.values())


def _staging_line(plan: Plan) -> str:
    line = human_bytes(plan.staging_bytes)
    has_nvme = plan.nvme_path is not None and any(t.tier == Tier.NVME and t.capacity_bytes for t in plan.tiers)
    if has_nvme and plan.staging_taken_bytes != plan.staging_bytes:
        line += (f" a buffer; {human_bytes(plan.staging_taken_bytes)} of host memory in all with the NVMe tier "
                 f"(one ring per GPU and a pinned buffer per GPU for HBM<->NVMe moves)")
    return line


def _table(plan: Plan) -> list[str]:
    names = list(plan.layouts)
    header = ["tier", "where", "capacity", "align", "page", *(f"blocks {n}" for n in names)]
    rows = [header]
    for t in plan.tiers:
        blocks = ["-" if t.capacity_bytes is None else str(t.blocks[n]) for n in names]
        capacity = "unknown" if t.capacity_bytes is None else ("off" if t.capacity_bytes == 0
                                                               else human_bytes(t.capacity_bytes))
        rows.append([t.tier.label, t.where, capacity, str(t.alignment), human_bytes(t.page_bytes), *blocks])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
