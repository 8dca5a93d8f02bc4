"""`DFlash2Storage`: sglang's HiCache storage backend (L3) kept in the node's dflash2 daemon.

sglang creates it through its storage-backend factory (`--hicache-storage-backend dynamic`, which
`plugin.py` sets up) and then registers its host KV pool. Each sglang page is one dflash2 block,
committed with a content key (`keys.py`), so every sglang process on the node that holds the same
shard in the same format finds it, and the daemon keeps one copy:

    batch_set_v1   lookup (the prefix already cached is skipped) -> allocate -> copy pages into the
                   blocks -> commit with keys (a key cached meanwhile deduplicates), linked to the
                   batch before -> free our reference (published blocks stay cached; the daemon
                   demotes them by heat), but on the batch's last block until the next batch links
                   to it (`chains.HeldTips`)
    batch_get_v1   lookup -> acquire in DRAM (pins; only NVMe pages move up) -> copy into the host pages
                   -> release
    batch_exists   lookup: the length of the cached prefix

(The store and the read themselves are `datapaths.py`'s.)

Failure is a miss, never an error in sglang's hot path: when the daemon is gone, calls return
misses / failed writes for RETRY_S and then try again (reattaching when the lease was lost). When the
backend cannot start (dflash2 disabled, daemon down, a page format it cannot hold, a hybrid model's
host pools beside the KV pages) it logs one `dflash2: fallback to default` line and stays a backend
that stores nothing, so sglang runs on its own host cache.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo,
                                                  PoolTransfer, PoolTransferResult)

from dflash2.client.client import Client
from dflash2.client.sglang import clears, identity
from dflash2.client.sglang.chains import HeldTips, cached_prefix, slots
from dflash2.client.sglang.datapaths import DataPaths
from dflash2.client.sglang.keys import KeyMapper, Shard, namespace
from dflash2.client.sglang.pages import (PageFormatError, block_tensor, flat_bytes, load_page, logical_kv_dtype,
                                         page_format, page_layout, store_page)
from dflash2.client.sglang.plugin import fallback_line
from dflash2.errors import ConfigError, DaemonUnavailable, DFlash2Error

log = logging.getLogger("dflash2.sglang")

# After the daemon stopped answering, calls are misses for this long before the next try: a gone
# daemon must not cost every prefetch a full request timeout.
RETRY_S = 10.0
# sglang's pages live in host memory: ours are written to, and read from, the daemon's DRAM tier (a
# block found in HBM is read there too); nothing is pulled into HBM on its behalf.
HOST_TIER = "dram"
# Pages per allocate / acquire, at most; also at most a quarter of their tier (pinned while copied).
MAX_CHUNK_PAGES = 64


class DFlash2Storage(DataPaths, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        self.shard = Shard.from_storage_config(storage_config)
        self.is_writer = storage_config.is_storage_writer  # MLA: one writer per replicated shard
        self.client: Client | None = None
        self.layout_id: int | None = None
        self.keys: KeyMapper | None = None
        self.fallback_reason: str | None = None
        self.prefill_rate: float | None = None
        self.chunk_pages = MAX_CHUNK_PAGES
        self.tier = HOST_TIER
        self.tips = HeldTips(None, 0)  # (the attached client's: `_fit_tiers`)
        self.page_bytes = 0
        self._down_until = 0.0
        self._reattach = threading.Lock()
        # (deques: storage threads append while get_stats takes, each sample taken once)
        self._moved = threading.local()  # pages the running call of this thread moved (`_timed`)
        self._metrics = {name: collections.deque() for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth",
                                                               "backup_bandwidth")}
        self.counters = {"pages_set": 0, "pages_deduplicated": 0, "pages_got": 0, "page_misses": 0,
                         "failed_calls": 0, "commits_unlinked": 0, "reads_refused": 0, "writes_refused": 0}
        # When a refused read / write was last logged (`_refused`)
        self._refusal_logged = {"reads": -float("inf"), "writes": -float("inf")}
        # Counted from sglang's threads at once: `+=` on a dict entry is a read and a write, and two
        # threads could each add to the same old value.
        self._count_lock = threading.Lock()
        # The pool this rank attaches to, taken once here, in the scheduler's thread, where sglang has
        # set the rank's CUDA device: an attach again after a lost lease runs in a storage thread,
        # whose current device is 0 (every rank then moved into the first GPU's pool). An MLA model's
        # ranks share one pool, the daemon's first: only the writer rank stores, and a reader on
        # another GPU looked in its own GPU's pool, found nothing, and sglang, taking the least of
        # the ranks' hits, had none (host_only: no rank maps that GPU's HBM for it).
        self.device = None if self.shard.is_mla else _serving_device()
        self.model_id: str | None = None  # the model's identity in the namespace (identity.py)
        self.page = ""  # the pages' format in the namespace (register_mem_pool_host)
        self.rank = self.shard  # (its clears' key space is kept per process and rank: clears.py)
        self.space = clears.resume(self.extra.get(clears.LAUNCH_KEY), self.rank)
        try:
            self.model_id = self._model_id()
            self.client = self._attach()
        except DFlash2Error as e:
            self._fall_back(str(e))

    # -- life ------------------------------------------------------------------------------
    def _attach(self) -> Client:
        from dflash2.config import load_config, require_enabled

        path = self.extra.get("dflash2_config")
        if not path:
            raise DaemonUnavailable("no `dflash2_config` in the storage backend's extra config")
        cfg = load_config(path)
        require_enabled(cfg)
        name = identity.client_name(self.shard.model, self.shard.tp_rank)
        # Every call times out after the config's daemon.request_timeout_s, unless the extra config
        # gives this server its own (`dflash2_timeout_s`).
        timeout_s = self._positive("dflash2_timeout_s", cfg.daemon.request_timeout_s)
        # How fast this engine recomputes a page's tokens: the daemon then offers no page whose
        # read back (from NVMe, into host memory) is slower than that (cost-aware reuse).
        self.prefill_rate = self._positive("dflash2_prefill_tokens_per_s", None)
        # Each tensor-parallel rank serves its own GPU: its blocks live in that GPU's pool (without
        # `device` every rank would share the first GPU's pool and its share of DRAM); MLA: above.
        client = Client.connect(config=cfg, name=name, timeout_s=timeout_s, device=self.device,
                                host_only=self.device is None)
        if client.host_only and not any(a.get("tier") == HOST_TIER for a in client.arena_info):
            # A daemon without a DRAM tier takes pages in HBM (`_fit_tiers`), which a host_only
            # client cannot view: every write failed. Mapped after all, the first GPU's HBM costs a
            # rank on another GPU a CUDA context there.
            client.close()
            log.warning("dflash2: the daemon has no DRAM tier: this MLA rank maps the HBM of the daemon's first "
                        "GPU to store its pages there (a CUDA context on that GPU; give the daemon a DRAM tier)")
            client = Client.connect(config=cfg, name=name, timeout_s=timeout_s, device=None)
        return client

    def _model_id(self) -> str | None:
        """The digest of the model's identity (identity.py), from the server arguments the plugin
        passes (`dflash2_model`) and the model's files, read now (sglang has loaded the model). None,
        said in a warning, without them (a backend set up without `--dflash2-config`): pages are
        then keyed by the served name alone, as before. ConfigError for a value that is not a JSON object."""
        args = self.extra.get("dflash2_model")
        if args is None:
            log.warning("dflash2: the extra config gives no dflash2_model (the model's server arguments, which "
                        "--dflash2-config passes): pages are keyed by the served model name %r alone, and a server "
                        "of that name with other weights or arguments would read them as its own", self.shard.model)
            return None
        if not isinstance(args, dict):
            raise ConfigError("--hicache-storage-backend-extra-config dflash2_model",
                              f"must be a JSON object of the model's server arguments, got {args!r}")
        ident = identity.model_identity(args)
        for line in identity.not_read(ident):  # (the model's, and each LoRA adapter's)
            log.warning("dflash2: %s", line)
        log.info("dflash2: the pages' namespace covers the model %s", identity.describe(ident))
        return identity.model_id(ident)

    def _positive(self, key: str, default: float | None) -> float | None:
        value = self.extra.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"--hicache-storage-backend-extra-config {key}",
                              f"must be a positive number, got {value!r}")
        return float(value)

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.warning(fallback_line(reason))
        if self.client is not None:
            self.client.close()
            self.client = None

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.client is None:
            return
        try:
            layout = page_layout(mem_pool_host, self.shard.model)
            kv = logical_kv_dtype(mem_pool_host, self.extra)
            self.layout_id = self.client.register_layout(layout, prefill_tokens_per_s=self.prefill_rate)
            self._fit_tiers(self.client, layout)
        except (PageFormatError, DFlash2Error) as e:
            self._fall_back(f"sglang's host pages cannot be stored: {e}")
            return
        self.page_bytes = layout.block_bytes
        self.page = f"{page_format(mem_pool_host)}/{layout.name}" + ("" if kv is None else f"/kv={kv}")
        if self.shard.pp_size > 1:  # (which layers the stage holds: keys.Shard.pp_start_layer)
            self.shard = dataclasses.replace(self.shard, pp_start_layer=int(mem_pool_host.start_layer))
        self.keys = KeyMapper(namespace(self.shard, self.page, self.model_id, self.space.tag()))
        log.info("dflash2: sglang pages are dflash2 blocks of layout %s (%d bytes), namespace %s",
                 layout.name, layout.block_bytes, self.keys.namespace)

    def _fit_tiers(self, client: Client, layout) -> None:
        """The tier pages go to and the pages per call, for the daemon `client` is attached to (a
        restarted daemon may have other tiers: its config changed)."""
        tiers = {str(a.get("tier")).lower(): a for a in client.arena_info}
        # Pages go to the daemon's DRAM tier; a daemon configured without one takes them in HBM.
        self.tier = HOST_TIER if HOST_TIER in tiers else "hbm"
        if self.tier != HOST_TIER:
            log.warning("dflash2: the daemon has no DRAM tier: sglang pages are written to its HBM tier")
        self.chunk_pages = MAX_CHUNK_PAGES
        pages = 0  # (the tier's)
        if self.tier in tiers:
            cap = tiers[self.tier]["capacity_bytes"]
            if cap < layout.block_bytes:  # (every store refused NeverFits, a warning a batch, for good: a review)
                raise PageFormatError(f"a page takes {layout.block_bytes} bytes, more than the daemon's whole "
                                      f"{self.tier} tier ({cap} bytes): raise memory.{self.tier}_capacity_mb, or "
                                      "use smaller pages (--page-size)")
            pages = slots(tiers[self.tier], layout.block_bytes)  # (a page takes an aligned slot)
            self.chunk_pages = int(max(1, min(MAX_CHUNK_PAGES, pages // 4)))
        # (set before the client is: a thread storing through the old one holds nothing: `_store`)
        self.tips = HeldTips(client, pages)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """sglang's hybrid cache controller registers every host pool of the model here, the KV pool
        (already ours, by register_mem_pool_host) too. Any other pool (SWA, Mamba state, an indexer,
        a draft model's own KV pool) comes with the v2 calls, which this backend does not store:
        sglang's own cache, rather than KV pages without the state they need. A NextN/MTP draft's KV
        packed into the target's host pages (sglang 0.5.23: the pool's draft_buffer_infos) is in each
        KV page we store: the draft checkpoint is in the model's identity (identity.DRAFT_ARGS)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool is not getattr(self, "mem_pool_host", None) and self.client is not None:
            self._fall_back(f"sglang's {host_pool_name} host pool (a hybrid model's pool beside the KV pages) "
                            "cannot be stored: dflash2 stores KV pages only")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    @property
    def active(self) -> bool:
        return self.client is not None and self.keys is not None

    def _ready(self) -> Client | None:
        """The client to use now, or None (fallen back, or the daemon is down for now)."""
        client = self.client
        if client is None or self.keys is None or time.monotonic() < self._down_until:
            return None
        if clears.follow(self.space, self.rank) != self.space:  # (cleared through another backend: clears.follow)
            with self._reattach:  # (one move, said once, however many threads saw it)
                if (space := clears.follow(self.space, self.rank)) != self.space:
                    self._move(space, "its rank cleared through another storage backend of this process")
        if client.lease_lost:
            with self._reattach:
                current = self.client
                if time.monotonic() < self._down_until or current is None:
                    return None  # (another thread's try failed, or it fell back for good, while this one waited)
                if current.lease_lost:
                    fresh = None
                    try:
                        fresh = self._attach()
                        # The new daemon numbers layouts afresh: use the id it gives. Its config
                        # may have changed too: pages go to the tiers it has now.
                        layout = current.layout(self.layout_id)
                        layout_id = fresh.register_layout(layout, prefill_tokens_per_s=self.prefill_rate)
                        self._fit_tiers(fresh, layout)
                    except (DFlash2Error, PageFormatError) as e:
                        if fresh is not None:
                            fresh.close()
                        if isinstance(e, PageFormatError):  # (the restarted daemon's tiers: for good)
                            self._fall_back(f"sglang's host pages cannot be stored by the restarted daemon: {e}")
                        else:
                            self._daemon_down(e)
                        return None
                    # The layout id first: a thread that reads the client and then its layout id
                    # must never pair the fresh client with the old daemon's id (another layout
                    # there). The old client with the new id fails as the old client does anyway.
                    self.layout_id = layout_id
                    self.client = fresh
                    current.close()
                    log.warning("dflash2: attached again to the daemon at %s (layout %d, pages to its %s tier): "
                                "sglang's storage works again; the pages stored before are gone", fresh.endpoint,
                                layout_id, self.tier)
        return self.client

    def _count(self, key: str, n: int = 1) -> None:
        with self._count_lock:
            self.counters[key] += n

    def _daemon_down(self, error: Exception) -> None:
        self._count("failed_calls")
        self._down_until = time.monotonic() + RETRY_S
        log.warning("dflash2: %s; sglang's storage reads miss and writes fail for %gs", error, RETRY_S)

    def _guarded(self, default, fn: Callable[[Client], Any], fallen_back=None):
        """fn(client); `default` while the daemon is down, `fallen_back` (default: `default`) once fallen back."""
        if not self.active:
            return default if fallen_back is None else fallen_back
        client = self._ready()
        if client is None:
            return default
        try:
            return fn(client)
        except DFlash2Error as e:
            self._failed(client, e)
            return default

    def _failed(self, client: Client, e: DFlash2Error) -> None:
        """Never an exception into sglang's threads: a page evicted between lookup and acquire, or a
        daemon that restarted and no longer knows us, is a miss (or a failed write)."""
        if client is not self.client:
            # A client replaced since (a reattach after a restart) fails its calls: that says nothing of the
            # daemon now. Taken for it, every storage thread missed 10 s more after the reattach (a review).
            self._count("failed_calls")
            log.info("dflash2: a call on the client replaced since failed (%s); treated as a miss", e)
            return
        if isinstance(e, DaemonUnavailable):
            self._daemon_down(e)
            return
        if getattr(e, "kind", "") == "UnknownClient":
            client.lease_lost = True
        self._count("failed_calls")
        log.warning("dflash2: %s; treated as a miss", e)

    def _host_pages(self, host_indices: torch.Tensor, n: int) -> list[int]:
        # Whole pages as sglang's controller hands them: of `logical_page_size` tokens, which decode
        # context parallelism widens (dcp_size ranks share a page, each storing its own rows of
        # `page_size`: pages.py); `page_size` refused every page of an MLA server with --dcp-size 2.
        page = getattr(self.mem_pool_host, "logical_page_size", self.mem_pool_host.page_size)
        if host_indices.numel() != n * page:
            raise ValueError(f"{n} page keys but {host_indices.numel()} host indices (page size {page})")
        return host_indices[::page].tolist()

    def _note_moved(self, n: int) -> None:
        """`n` pages this thread's call read or wrote (`_timed`; a call not timed counts for nothing)."""
        self._moved.n = getattr(self._moved, "n", 0) + n

    def _timed(self, kind: str, fn):
        """fn(), its pages moved (`_moved`: those this thread's call read or wrote) and their rate
        recorded for sglang's storage metrics. Counted by the keys asked for, a batch deduplicated,
        missed or answered while the daemon was down was a sample of pages never moved, at a made-up
        rate of up to 10^5 GB/s (a review)."""
        self._moved.n = 0
        t0 = time.perf_counter()
        result = fn()
        n = self._moved.n
        if self.storage_config.enable_storage_metrics and n:
            dt = max(time.perf_counter() - t0, 1e-9)
            self._metrics[f"{kind}_pgs"].append(n)
            self._metrics[f"{kind}_bandwidth"].append(n * self.page_bytes / dt / 1e9)
        return result

    # -- HiCacheStorage: zero-copy v1 ------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._guarded(0, lambda c: len(cached_prefix(c, self.keys.keys(keys), self.layout_id, self.tier)))

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pages = self._host_pages(host_indices, len(keys))
        pool = self.mem_pool_host
        return self._loaded(self._timed("prefetch", lambda: self._guarded(
            [False] * len(keys), lambda c: self._load(c, keys, lambda i, raw: load_page(pool, pages[i], raw)))))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not self.is_writer:
            return [True] * len(keys)  # a replicated (MLA) page: its writer rank stores it
        pages = self._host_pages(host_indices, len(keys))
        pool = self.mem_pool_host
        # Fallen back for good: accept and drop (a cache may forget; reads miss), so that sglang does
        # not log a failed backup for every batch.
        return self._timed("backup", lambda: self._guarded(
            [False] * len(keys),
            lambda c: self._store(c, keys, lambda i, raw: store_page(pool, pages[i], raw), extra_info),
            fallen_back=[True] * len(keys)))

    # -- HiCacheStorage: v2 (hybrid models; only ever called after the fallback above) ----------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {t.name: [True] * len(t.keys or []) for t in transfers}  # accepted and dropped, as v1

    # -- HiCacheStorage: generic (flat page tensors) ---------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise ValueError(f"batch_get: {len(keys)} keys but {len(targets)} target tensors")
        self._check_pages("batch_get", keys, targets)

        def read(i, raw):
            # Into the target itself (a strided target too): never into a contiguous copy of it.
            targets[i].copy_(block_tensor(raw, targets[i].dtype).view(targets[i].shape))

        ok = self._loaded(self._guarded([False] * len(keys), lambda c: self._load(c, keys, read)))
        return [t if hit else None for t, hit in zip(targets, ok)]

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        values = list(values or [])
        if len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {len(values)} values")
        if not self.is_writer:
            return True
        self._check_pages("batch_set", keys, values)

        def write(i, raw):
            dst = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else torch.from_dlpack(raw)
            dst.copy_(flat_bytes(values[i]))

        return all(self._guarded([False] * len(keys), lambda c: self._store(c, keys, write, None),
                                 fallen_back=[True] * len(keys)))

    def _check_pages(self, call: str, keys: Sequence[str], tensors: Sequence[Any]) -> None:
        """Each tensor holds exactly one page's bytes (a copy of another size broadcasts or fails halfway)."""
        if not self.active:
            return  # fallen back: nothing is copied
        for key, t in zip(keys, tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{call}: the tensor for key {key!r} is a {type(t).__name__}, not a torch.Tensor")
            nbytes = t.numel() * t.element_size()
            if nbytes != self.page_bytes:
                raise ValueError(f"{call}: the tensor for key {key!r} holds {nbytes} bytes ({tuple(t.shape)} "
                                 f"{t.dtype}); a page of this host pool holds {self.page_bytes}")

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> bool:
        """sglang's /clear_hicache_storage_backend (every rank; after an in-place weight update; its PD role switch):
        this rank moves to its launch's next clear epoch (clears.py); returning True and changing nothing, the
        server read KV of its old weights as hits (a review). The old pages stay for the old identity's servers."""
        with self._reattach:  # (a batch call between bump and _move took this clear for another backend's, a review)
            return self._move(clears.bump(self.space, self.rank), "clear()")

    def _move(self, space: clears.KeySpace, why: str) -> bool:
        self.space = space
        self.tips.let_go_later()  # (no later batch will name the tips held)
        if self.keys is not None:
            self.keys = KeyMapper(namespace(self.shard, self.page, self.model_id, space.tag()))
        log.warning("dflash2: %s: this server's pages now have keys of clear epoch %d of launch %s (namespace %s): "
                    "pages written before are no hits for it; the node's cache keeps them for other servers",
                    why, space.epoch, space.launch, getattr(self.keys, "namespace", "none: nothing stored"))
        return True

    def get_stats(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self._metrics.items():
            taken = [values.popleft() for _ in range(len(values))]  # (a sample appended meanwhile stays)
            getattr(metrics, name).extend(taken)
        return metrics


def _serving_device() -> int | None:
    """The CUDA device this engine process serves (its tensor-parallel rank's, as sglang set it), or
    None without CUDA (the daemon's first pool: a host-only node has only that one)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None
