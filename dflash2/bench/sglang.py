"""`dflash2 bench sglang`: sglang's HiCache storage (L3) through dflash2 against sglang's own file
backend (`HiCacheFile`), with pages of a real size, in one run, on one disk.

Pages: Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16), 64 tokens a page = 8 MiB, in sglang's
own host KV pool (`MHATokenToKVPoolHost`, page_first, on the CPU). Each backend is driven the way
sglang's cache controller drives it, in batches of STORAGE_BATCH_SIZE pages:

- dflash2 (`DFlash2Storage`, created by sglang's storage-backend factory, `dynamic`): the zero-copy
  `batch_set_v1` / `batch_get_v1` calls on host indices;
- file (`HiCacheFile` in a folder under --dir, where the daemon's NVMe file also lies): the generic
  path sglang uses for it, `batch_set(keys, [get_data_page(i)])` and `batch_get` into fresh flat
  pages followed by `set_from_flat_data_page`.

Set: every page is new. Get: every page is read back into other host pages and compared byte for
byte (`verified`). Then a second dflash2 backend (another "instance": its own client and host pool)
asks for the same keys (`second_instance_hit_pages`). The daemon runs as a subprocess on a host-only
config (--hbm-mb of shared memory stands in for HBM; DRAM holds the rest; an NVMe file under --dir).
With --repeat N the best of N rounds counts (fresh keys each round).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from dflash2 import stopsignals
from dflash2.bench import OptionError, positive_int

LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128}
PAGE_TOKENS = 64
ARENA_PAGE_MB = 2  # memory.page_kb of the daemon's config (_write_config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=positive_int, default=128,
                        help="pages set and got per round (8 MiB each; default 128)")
    parser.add_argument("--dir", default=".", help="folder on the disk to use (scratch folder removed after; default: cwd)")
    parser.add_argument("--hbm-mb", type=positive_int, default=256,
                        help=f"the daemon's HBM stand-in (host shared memory; at least {ARENA_PAGE_MB}, default 256)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="rounds; the best of each phase counts (default 3)")


def run(args: argparse.Namespace) -> dict:
    if args.hbm_mb < ARENA_PAGE_MB:  # a tier smaller than one arena page holds nothing (the config is refused)
        raise OptionError(f"--hbm-mb: {args.hbm_mb} is less than one arena page ({ARENA_PAGE_MB} MB)")
    try:
        import torch  # noqa: F401  (sglang needs it)
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
    except ModuleNotFoundError as exc:
        raise OptionError(f"bench sglang needs {exc.name!r}, which is not installed here: run it in sglang's own "
                          "environment (pip install -e '.[sglang]'; README, \"sglang\")") from None

    from dflash2.bench.control import _start, _stop

    try:
        scratch = Path(tempfile.mkdtemp(prefix=".dflash2-bench-sglang-", dir=os.path.abspath(args.dir)))
    except OSError as exc:
        raise OptionError(f"--dir {args.dir}: cannot make a scratch folder there: {exc.strerror}") from None
    page_mb = _page_bytes() >> 20
    daemon = None
    try:
        config = _write_config(scratch, args.hbm_mb, dram_mb=2 * args.pages * page_mb + 64)
        daemon = _start(["-m", "dflash2.daemon.main", "--config", str(config)], "DFlash2: enabled",
                        scratch / "daemon.log")
        pool = _host_pool(2 * args.pages)
        src = list(range(1, args.pages + 1))
        dst = list(range(args.pages + 1, 2 * args.pages + 1))
        _fill(pool, src)
        ours = _dflash2_backend(config, pool)
        theirs = _file_backend(scratch / "hicache", pool)
        best = {"dflash2_set": float("inf"), "dflash2_get": float("inf"), "file_set": float("inf"),
                "file_get": float("inf")}
        verified, hits = True, 0
        for r in range(args.repeat):
            keys = [f"bench-{r}-{i}" for i in range(args.pages)]
            for name, backend in (("dflash2", ours), ("file", theirs)):
                set_s, get_s = _round(backend, pool, keys, src, dst, STORAGE_BATCH_SIZE, v1=(name == "dflash2"))
                verified &= _same(pool, src, dst)
                _scrub(pool, dst)
                best[f"{name}_set"] = min(best[f"{name}_set"], set_s)
                best[f"{name}_get"] = min(best[f"{name}_get"], get_s)
            second = _dflash2_backend(config, _host_pool(1))
            hits = second.batch_exists(keys)
            second.close()
        stats = ours.client.stats()
        ours.close()
        return _report(args, best, verified, hits, stats, page_mb)
    finally:
        with stopsignals.uninterrupted():
            if daemon is not None:
                _stop(daemon)
            shutil.rmtree(scratch, ignore_errors=True)


def _round(backend, pool, keys, src, dst, batch: int, v1: bool) -> tuple[float, float]:
    """Seconds to set every page, then to get every page back (sglang's controller paths)."""
    import torch

    def idx(pages):
        return torch.tensor([p * PAGE_TOKENS + t for p in pages for t in range(PAGE_TOKENS)], dtype=torch.int64)

    t0 = time.perf_counter()
    for lo in range(0, len(keys), batch):
        k, s = keys[lo:lo + batch], src[lo:lo + batch]
        ok = all(backend.batch_set_v1(k, idx(s))) if v1 else backend.batch_set(
            k, [pool.get_data_page(p * PAGE_TOKENS) for p in s])
        if not ok:
            raise RuntimeError(f"{type(backend).__name__}: a batch of pages was not stored")
    t1 = time.perf_counter()
    for lo in range(0, len(keys), batch):
        k, d = keys[lo:lo + batch], dst[lo:lo + batch]
        if v1:
            got = backend.batch_get_v1(k, idx(d))
        else:
            pages = backend.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
            got = [page is not None for page in pages]
            for page, p in zip(pages, d):
                pool.set_from_flat_data_page(p * PAGE_TOKENS, page)
        if not all(got):
            raise RuntimeError(f"{type(backend).__name__}: a page stored in this round was not found")
    return t1 - t0, time.perf_counter() - t1


def _report(args, best: dict, verified: bool, hits: int, stats: dict, page_mb: int) -> dict:
    page = _page_bytes()

    def rate(seconds):
        return round(args.pages / seconds, 1)

    out = {
        "bench": "sglang", "model": "llama3-8b", "dtype": "bf16", "page_tokens": PAGE_TOKENS, "page_mb": page_mb,
        "pages": args.pages, "repeat": args.repeat, "hbm_mb": args.hbm_mb,
        "set_pages_per_s": rate(best["dflash2_set"]), "get_pages_per_s": rate(best["dflash2_get"]),
        "set_gbps": round(args.pages * page / best["dflash2_set"] / 1e9, 3),
        "get_gbps": round(args.pages * page / best["dflash2_get"] / 1e9, 3),
        "file_set_pages_per_s": rate(best["file_set"]), "file_get_pages_per_s": rate(best["file_get"]),
        "file_get_gbps": round(args.pages * page / best["file_get"] / 1e9, 3),
    }
    out["set_speedup_vs_file"] = round(out["set_pages_per_s"] / out["file_set_pages_per_s"], 2)
    out["get_speedup_vs_file"] = round(out["get_pages_per_s"] / out["file_get_pages_per_s"], 2)
    out["faster_than_file"] = out["set_speedup_vs_file"] > 1 and out["get_speedup_vs_file"] > 1
    out["second_instance_hit_pages"] = hits
    out["second_instance_hit"] = hits == args.pages
    out["verified"] = verified
    out["daemon_blocks"] = {tier: t["blocks"] for tier, t in stats["tiers"].items()}
    return out


# -- set-up -------------------------------------------------------------------------------------------


def _page_bytes() -> int:
    return 2 * LLAMA3_8B["layers"] * PAGE_TOKENS * LLAMA3_8B["kv_heads"] * LLAMA3_8B["head_dim"] * 2


def _write_config(folder: Path, hbm_mb: int, dram_mb: int) -> Path:
    cfg = {"enable": True, "device": {"kind": "host"},
           "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": hbm_mb, "dram_capacity_mb": dram_mb,
                      "nvme_capacity_mb": 256, "nvme_path": "nvme.cache", "staging_buffer_size_mb": 64,
                      "page_kb": ARENA_PAGE_MB * 1024},
           "kv_block": {"block_size": PAGE_TOKENS, "prefetch_window": 2},
           "policy": {"name": "lru", "cold_threshold": 0.5, "swap_batch_size": 64},
           "daemon": {"endpoint": f"ipc://{folder.resolve()}/d.sock"},
           "logging": {"format": "text", "level": "warning"}}
    path = folder / "dflash2_config.json"
    path.write_text(json.dumps(cfg))
    return path


def _host_pool(pages: int):
    """sglang's host KV pool for Llama-3-8B on the CPU: `pages` usable pages (page 0 is padding)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    m = LLAMA3_8B
    dev = MHATokenToKVPool(PAGE_TOKENS, PAGE_TOKENS, torch.bfloat16, m["kv_heads"], m["head_dim"], m["layers"],
                           "cpu", False, start_layer=0, end_layer=m["layers"] - 1)
    info = dev.get_device_pool_infos()[0]
    return MHATokenToKVPoolHost(info.buffer_info, 0.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=m["layers"] - 1,
                                host_token_capacity=(pages + 1) * PAGE_TOKENS)


def _storage_config(extra: dict | None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="meta-llama/Meta-Llama-3-8B", extra_config=extra)


def _dflash2_backend(config: Path, pool):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from dflash2.client.sglang.identity import server_args
    from dflash2.client.sglang.plugin import backend_extra_config

    # (The model's server arguments, as the flag passes them: its files are not read, and the log says so.)
    model = server_args(argparse.Namespace(model_path="meta-llama/Meta-Llama-3-8B"))
    extra = json.loads(backend_extra_config(str(config), None, model=model))
    backend = StorageBackendFactory.create_backend("dynamic", _storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    if backend.fallback_reason:
        raise RuntimeError(f"the dflash2 backend fell back: {backend.fallback_reason}")
    return backend


def _file_backend(folder: Path, pool):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("file", _storage_config({"file_storage_path": str(folder)}), pool)
    backend.register_mem_pool_host(pool)
    return backend


def _fill(pool, pages) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    for p in pages:
        page = pool.get_data_page(p * PAGE_TOKENS, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))


def _scrub(pool, pages) -> None:
    for p in pages:
        pool.get_data_page(p * PAGE_TOKENS, flat=False).zero_()


def _same(pool, a, b) -> bool:
    import torch

    return all(torch.equal(pool.get_data_page(x * PAGE_TOKENS), pool.get_data_page(y * PAGE_TOKENS))
               for x, y in zip(a, b))
