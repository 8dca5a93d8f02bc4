"""Builds a running BlockManager from a validated config: takes every tier's region once.

Start-up fails with a specific error when a region cannot be had (CapacityError names the bytes
needed and available). On a machine without a GPU, host shared memory stands in for HBM; the CUDA
arenas come with the GPU path and plug in here behind the same arena interface.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable

from dflash2.arena.base import Arena
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.nvmefiles import folder_named, remove_unused_cache_files
from dflash2.arena.shm import SharedMemoryArena
from dflash2.config import Config
from dflash2.duel import Duel
from dflash2.errors import ArenaError
from dflash2.manager import BlockManager, TierSpec
from dflash2.placement import Watermark
from dflash2.policy.base import policy_class
from dflash2.plan import Plan, TierPlan, resolve_plan
from dflash2.reservations import AdmissionSettings
from dflash2.table.columns import MAX_FIRST_GEN
from dflash2.tiers import Tier
from dflash2.transfer.host import HostTransferBackend

log = logging.getLogger("dflash2.assemble")


def watermarks(cfg: Config) -> dict[Tier, Watermark]:
    wm = cfg.policy.watermarks
    return {Tier.HBM: Watermark(wm.hbm.high, wm.hbm.low), Tier.DRAM: Watermark(wm.dram.high, wm.dram.low),
            Tier.NVME: Watermark(wm.nvme.high, wm.nvme.low)}


def admission_settings(cfg: Config) -> AdmissionSettings:
    a = cfg.admission
    return AdmissionSettings(smoothing_window_s=a.smoothing_window_ms / 1000.0, burst_fraction=a.burst_fraction,
                             reservation_ttl_s=a.reservation_ttl_s, max_deferred=a.max_deferred,
                             preemption=a.preemption, max_client_share=a.max_client_share)


def tier_specs(plan: Plan, hbm: TierPlan | None = None, share: int = 1) -> list[TierSpec]:
    """The tiers of one block pool: `hbm` (default: the plan's only one) and 1/share of the others,
    rounded down to whole pages."""
    specs = []
    hbm = hbm or next(t for t in plan.tiers if t.tier == Tier.HBM)
    for tp in plan.tiers:
        if tp.tier == Tier.HBM and tp is not hbm:
            continue
        if tp.capacity_bytes is None:
            raise ArenaError(f"the {tp.tier.label} tier's size is unknown ({tp.where}); cannot start")
        capacity = tp.capacity_bytes if tp.tier == Tier.HBM else tp.capacity_bytes // share // tp.page_bytes * tp.page_bytes
        if capacity > 0:
            specs.append(TierSpec(tp.tier, capacity, tp.page_bytes, tp.alignment))
    return specs


def instance_name(pid: int) -> str:
    """The prefix of the shared-memory segments of the daemon with this pid."""
    return f"dflash2-{pid}"


def build_managers(cfg: Config, *, instance: str | None = None, plan: Plan | None = None,
                   clock: Callable[[], float] = time.monotonic) -> dict[int, BlockManager]:
    """Take the arenas of `cfg`: one block manager per GPU, keyed by device index ({0: ...} on a
    machine without a GPU). Each GPU has its own HBM arena and block pool; the DRAM and NVMe tiers
    are split evenly between the GPUs (a segment and a file each), so no move ever crosses GPUs.
    `instance` names the shared-memory segments (default: dflash2-<pid>)."""
    plan = plan or resolve_plan(cfg)
    instance = instance or instance_name(os.getpid())
    hbm_plans = [t for t in plan.tiers if t.tier == Tier.HBM]
    if plan.device_kind == "cuda" and any(hp.capacity_bytes is None for hp in hbm_plans):
        # The plan could not probe a GPU (none visible, or no driver): there is no HBM to take.
        raise ArenaError("device.kind is cuda but no GPU is visible here (check the driver and "
                         "CUDA_VISIBLE_DEVICES, or set device.kind to auto or host)")
    if plan.nvme_path is not None and any(t.tier == Tier.NVME and t.capacity_bytes for t in plan.tiers):
        if (why := folder_named(plan.nvme_path)) is not None:
            raise ArenaError(why)
        remove_unused_cache_files(plan.nvme_path, plan.nvme_files())  # (before the new files' room is checked)
    managers: dict[int, BlockManager] = {}
    try:
        for hp in hbm_plans:
            device = int(hp.where.split(":")[1]) if plan.device_kind == "cuda" else None
            key = 0 if device is None else device
            managers[key] = _build_one(cfg, plan, hp, device, len(hbm_plans), instance, clock)
    except BaseException:
        for manager in managers.values():
            manager.close()
        raise
    return managers


def build_manager(cfg: Config, **kwargs) -> BlockManager:
    """The single block manager of a one-GPU (or host-only) config."""
    managers = build_managers(cfg, **kwargs)
    if len(managers) != 1:
        for manager in managers.values():
            manager.close()
        raise ArenaError(f"{len(managers)} GPUs selected: use build_managers")
    return next(iter(managers.values()))


def _build_one(cfg: Config, plan: Plan, hbm: TierPlan, device: int | None, share: int, instance: str,
               clock: Callable[[], float]) -> BlockManager:
    specs = tier_specs(plan, hbm, share)
    policy = policy_class(cfg.policy.name).from_config(cfg.policy)  # before any region is taken
    name = instance if share == 1 else f"{instance}-gpu{device}"
    nvme_path = plan.nvme_files()[plan.tiers.index(hbm)] if plan.nvme_path is not None else None
    arenas: dict[Tier, Arena] = {}
    if device is not None:
        from dflash2.cuda import start_device

        start_device(device)
    manager = backend = None
    try:  # (all of it: a stop signal while the table was built left the tiers' segments for good, a review)
        for spec in specs:
            arenas[spec.tier], taken = _open_arena(spec, plan, name, device, nvme_path)
            log.info("%s", taken)  # (after it is in `arenas`: one raised here was left open)
        backend = _backend(arenas, plan) if device is not None else HostTransferBackend(arenas)
        manager = BlockManager(specs, policy=policy, prefetch_window=cfg.kv_block.prefetch_window,
                               swap_batch_size=cfg.policy.swap_batch_size,
                               cold_threshold=cfg.policy.cold_threshold, watermarks=watermarks(cfg),
                               admission=admission_settings(cfg), arenas=arenas, backend=backend, clock=clock,
                               first_gen=secrets.randbelow(MAX_FIRST_GEN) + 1)  # (ids differ from a restart's)
        _attach_duel(cfg, manager)
    except BaseException:
        if manager is not None:
            manager.close()
        else:
            # The backend before the arenas it copies between: a stop signal while the table was built
            # left its thread running (on a GPU, its pinned staging buffer and streams too) (a review).
            if backend is not None:
                backend.close()
            for arena in arenas.values():
                arena.close()
        raise
    return manager


def _attach_duel(cfg: Config, manager: BlockManager) -> None:
    """The heat policy's duel (duel.py), unless `policy.duel_sample` is 0; other policies rank as
    they are named (a duel_sample set for them is warned of as ignored: config_warnings)."""
    sample = cfg.policy.duel_sample
    if not sample:
        return
    if hasattr(manager.policy, "follow"):
        Duel(manager, sample)


def _backend(arenas: dict[Tier, Arena], plan: Plan):
    from dflash2.transfer.cuda import CudaTransferBackend

    dram = arenas.get(Tier.DRAM)
    return CudaTransferBackend(arenas, getattr(dram, "region", None), plan.staging_bytes)


def _open_arena(spec: TierSpec, plan: Plan, instance: str, device: int | None, nvme_path) -> tuple[Arena, str]:
    """The tier's arena, taken now, and the line that says so (logged by the caller once it holds it)."""
    if spec.tier == Tier.NVME:
        if nvme_path is None:
            raise ArenaError("memory.nvme_path is not set but the NVMe tier has a capacity")
        arena = NvmeArena.create(nvme_path, spec.capacity_bytes, staging_bytes=plan.staging_bytes)
        return arena, (f"took nvme tier: {spec.capacity_bytes} bytes of {nvme_path} ("
                       + ("an earlier daemon's file, reused: what it held is dropped" if arena.reused else "a new file")
                       + ")")
    if device is not None:
        from dflash2.cuda.arena import CudaArena, PinnedHostArena

        if spec.tier == Tier.HBM:
            arena = CudaArena.create(device, spec.capacity_bytes, spec.alignment)
            return arena, f"took hbm tier: {spec.capacity_bytes} bytes of GPU {device} memory"
        arena = PinnedHostArena.create(f"{instance}-{spec.tier.label}", spec.capacity_bytes, spec.tier,
                                       alignment=spec.alignment, device=device)
        return arena, f"took {spec.tier.label} tier: {spec.capacity_bytes} bytes of pinned host shared memory"
    arena = SharedMemoryArena.create(f"{instance}-{spec.tier.label}", spec.capacity_bytes, spec.tier,
                                     alignment=spec.alignment)
    return arena, (f"took {spec.tier.label} tier: {spec.capacity_bytes} bytes of host shared memory "
                   f"({arena.describe().get('name')})")
