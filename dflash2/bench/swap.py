"""`dflash2 bench swap`: a promotion into a full HBM, which must demote as many bytes as it brings up.

For each block size, `--mb` MB of blocks wait in DRAM while HBM is full of other blocks; promoting
them (placement.promote, the path of `acquire` and the prefetcher) demotes as many bytes to DRAM.
Promotions alternate between two ways of making room, each timed `--repeat` times (median):
`room_first_ms` makes all the room (the demotions) and then moves the blocks up; `pieces_ms` moves in
pieces and makes room for each while the previous piece comes up (both directions of the link at
once). `default` names the one placement uses for that block size, `swap_gbps_*` count the bytes
moved both ways. With `--chain L` the blocks that fill HBM are cached prefix chains of L blocks (as
served requests leave them) instead of loose blocks: making room then demotes whole chains. Runs on
the GPU (CUDA arenas and backend) where one is visible, else on the host-memory stand-ins (shared
memory, copy threads).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from dflash2.bench import OptionError, non_negative_int, positive_int, sizes_kib, visible_gpu
from dflash2.layout import Layout
from dflash2.tiers import Tier

KIB = 1024
MB = 1 << 20
LAYER_BYTES = 64 * KIB  # one layer of the bench layout: 8 KV heads x 128 x bf16 x 16 tokens, K and V


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-kib", default="64,256,2048",
                        help="block sizes in KiB, multiples of 64 (comma separated; default %(default)s)")
    parser.add_argument("--mb", type=positive_int, default=1024, help="MiB (2^20 bytes) promoted, and demoted, per promotion; `mb_each_way` in the output, also MiB "
                             "(default 1024)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="promotions per way of making room (default 3)")
    parser.add_argument("--device", choices=("auto", "cuda", "host"), default="auto",
                        help="auto: the GPU where one is visible, else the host stand-ins")
    parser.add_argument("--gpu", type=non_negative_int, default=0, help="which GPU (default 0)")
    parser.add_argument("--chain", type=positive_int, default=1,
                        help="blocks per cached prefix chain filling HBM (default 1: loose blocks a client holds)")


def run(args) -> list[dict]:
    sizes = sizes_kib(args.sizes_kib, LAYER_BYTES // KIB)
    from dflash2.cuda import cuda_available

    kind = args.device if args.device != "auto" else ("cuda" if cuda_available() else "host")
    if kind == "cuda":
        visible_gpu(args.gpu, "bench swap")  # --gpu names a GPU CUDA sees (host stand-ins need none)
    for size in sizes:  # every size's config checked before any is measured (a bad last size lost the others' runs)
        _checked(_config(size, args, kind), size, args)
    return [_one(size, args, kind) for size in sizes]


def page_kib(block_bytes: int) -> int:
    """The arena page (memory.page_kb, a power of two) for blocks of this size: the largest power of
    two that divides it, so that a block takes whole pages and no page has a tail (a block of a
    power of two, as before, takes one page; 192 KiB, three of 64). Its size as a page was refused
    for any other multiple of 64 KiB that --sizes-kib allows."""
    kib = block_bytes // KIB
    return kib & -kib


def _config(block_bytes: int, args, kind: str) -> dict:
    device = {"kind": kind} if kind == "host" else {"kind": kind, "gpu_ids": [args.gpu]}
    per = max(1, args.mb * MB // block_bytes)  # blocks per promotion
    # Cached chains: HBM holds filler for every promotion's room, idle chains that go first. Full
    # with twice one promotion's blocks, as for loose blocks, only the first two promotions met
    # chains; later ones demoted the bench's own earlier promoted sets, loose blocks it holds, which
    # the medians then timed (a review: 4 of 6 promotions at --repeat 3).
    hbm_mb = -(-(2 * args.repeat if args.chain > 1 else 2) * per * block_bytes // MB)
    dram_mb = -(-(2 * args.repeat + 2) * per * block_bytes // MB)
    return {"enable": True, "device": device,
            "memory": {"hbm_reserve_mb": 0, "hbm_capacity_mb": hbm_mb, "dram_capacity_mb": dram_mb,
                       "page_kb": page_kib(block_bytes)},
            "kv_block": {"block_size": 16, "prefetch_window": 0},
            "policy": {"name": "lru"},
            "logging": {"format": "text", "level": "warning"}}


def _checked(cfg: dict, block_bytes: int, args):
    """The bench's config for one block size, validated; OptionError names the option at fault:
    --sizes-kib for the page (a block too large for any page), --mb and --repeat for the tiers'
    sizes."""
    from dflash2.config import parse_config
    from dflash2.errors import ConfigError

    try:
        return parse_config(cfg)
    except ConfigError as exc:
        raise _option_error(exc, block_bytes, args) from None


def _option_error(exc: Exception, block_bytes: int, args) -> OptionError:
    if getattr(exc, "key", None) == "memory.page_kb":
        return OptionError(f"--sizes-kib: {block_bytes // KIB} KiB blocks need pages of "
                           f"{page_kib(block_bytes)} KiB, past what the arena takes ({exc})")
    return OptionError(f"--mb {args.mb} --repeat {args.repeat}: {exc} (with --sizes-kib {block_bytes // KIB})")


def _one(block_bytes: int, args, kind: str) -> dict:
    from dflash2.assemble import build_manager
    from dflash2.errors import CapacityError

    cfg = _config(block_bytes, args, kind)
    per = max(1, args.mb * MB // block_bytes)  # blocks per promotion
    sets = 2 * args.repeat
    try:
        mgr = build_manager(_checked(cfg, block_bytes, args), instance=f"dflash2-bench-{uuid.uuid4().hex[:8]}")
    except CapacityError as exc:  # the tiers --mb and --repeat ask for do not fit this machine
        raise _option_error(exc, block_bytes, args) from None
    try:
        return _measure(mgr, block_bytes, per, sets, args.chain)
    finally:
        mgr.close()


def _measure(mgr, block_bytes: int, per: int, sets: int, chain: int = 1) -> dict:
    lid = mgr.register_layout(Layout("bench", block_bytes // LAYER_BYTES, 8, 128, "bf16", 16))
    if mgr.table.layout(lid).block_bytes != block_bytes:
        raise RuntimeError(f"the bench layout has {mgr.table.layout(lid).block_bytes} bytes a block, not {block_bytes}")
    client = mgr.attach("bench-swap")
    placement = mgr.placement
    default = "pieces" if block_bytes >= placement.PROMOTE_PIECES_MIN_BLOCK else "room_first"
    waiting = []
    for _ in range(sets):  # written in HBM, then moved down: they wait in DRAM
        vids = mgr.commit(client, mgr.allocate(client, lid, per))
        if not mgr.mover.move(mgr.table.rows(vids), Tier.DRAM).all():
            raise RuntimeError("the DRAM tier could not take the bench's blocks")
        waiting.append(vids)
    hbm_blocks = placement.free_bytes(Tier.HBM, block_bytes) // block_bytes
    filler = mgr.allocate(client, lid, hbm_blocks)  # HBM is full
    if chain == 1:
        mgr.commit(client, filler)
    else:
        for start in range(0, hbm_blocks, chain):  # published chains, held by nobody: cached
            part = filler[start:start + chain]
            mgr.commit(client, part, keys=range(start + 1, start + 1 + len(part)))
        mgr.free(client, filler)
    times: dict[str, list[float]] = {"room_first": [], "pieces": []}
    for i, vids in enumerate(waiting):
        way = "pieces" if i % 2 else "room_first"
        placement.PROMOTE_PIECES_MIN_BLOCK = 0 if way == "pieces" else 1 << 62
        t = time.perf_counter()
        ok = placement.promote(mgr.table.rows(vids), Tier.HBM)
        times[way].append(time.perf_counter() - t)
        if not ok.all():
            raise RuntimeError(f"a promotion of {per} blocks found no room")
    del placement.PROMOTE_PIECES_MIN_BLOCK  # back to the class's value
    mgr.check_invariants()
    moved = 2 * per * block_bytes
    from dflash2.transfer.host import HostTransferBackend
    row = {"device": "host" if isinstance(mgr.backend, HostTransferBackend) else "cuda",
           "block_kib": block_bytes // KIB, "blocks": per, "mb_each_way": round(per * block_bytes / MB, 4),
           # (the chains laid out: none longer than HBM holds; `--chain` past it was reported as given)
           "default": default, "chain": min(chain, hbm_blocks)}
    for way, seconds in times.items():
        median = statistics.median(seconds)
        row[f"{way}_ms"] = round(median * 1e3, 2)
        row[f"swap_gbps_{way}"] = round(moved / median / 1e9, 2)
    row["pieces_vs_room_first"] = round(row["room_first_ms"] / row["pieces_ms"], 3)
    return row
