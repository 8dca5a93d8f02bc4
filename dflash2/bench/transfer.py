"""`dflash2 bench transfer` (on a GPU): the swap path against the link's limit and the naive way.

For each block size, batches of `--blocks` blocks at scattered offsets go HBM→DRAM (d2h), DRAM→HBM
(h2d) and both at once (bidir) through the CUDA transfer backend, the same path the mover uses. The
mover starts every batch of a move before it waits for any, so the main figures keep `--inflight`
batches in flight; `*_single_gbps` start one batch and wait for it (latency included).
`--run-blocks R` places the blocks in runs of R neighbouring slots on both sides (the backend moves
a run as one copy). A size given as `16+256` makes batches that mix those sizes (block i of size
i mod k): a node serving two layouts, whose batches the backend splits between its mechanisms.
`*_via` count the batches each direction sent through the copy kernel and the copy engines.
In the same run: one contiguous pinned copy of the same bytes each way and both ways at once on two
streams (contig_*: the link's limit), and one cudaMemcpyAsync per block (per_block_copy_gbps).
"""

from __future__ import annotations

import argparse
import time
import uuid

import numpy as np

from dflash2 import stopsignals
from dflash2.bench import OptionError, non_negative_int, positive_int, sizes_kib, visible_gpu
from dflash2.cuda import on_device
from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch

KIB = 1024
SHORT = {"hbm->dram": "d2h", "dram->hbm": "h2d"}  # the backend's directions as the *_via figures name them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-kib", default="16,64,256,1024",
                        help="block sizes in KiB (comma separated; sizes joined by + make mixed batches, "
                             "e.g. 16+256; default %(default)s)")
    parser.add_argument("--blocks", type=positive_int, default=1024, help="blocks per batch (default 1024)")
    parser.add_argument("--repeat", type=positive_int, default=10,
                        help="timed rounds per figure, each of --inflight batches per direction (default 10)")
    parser.add_argument("--inflight", type=positive_int, default=4, help="batches in flight (default 4)")
    parser.add_argument("--device", type=non_negative_int, default=0, help="which GPU (default 0)")
    parser.add_argument("--run-blocks", type=positive_int, default=1,
                        help="blocks per run of neighbouring slots on both sides (default 1: every block scattered; "
                             "a request's blocks are usually allocated side by side and move as one copy)")


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def _time(fn, repeat: int) -> float:
    fn()  # warm-up (kernel compile, page mapping)
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return time.perf_counter() - t


def size_mixes(text: str) -> list[tuple[int, ...]]:
    """--sizes-kib: each comma-separated item one block size, or sizes joined by + (a mixed
    batch); bytes."""
    mixes = [tuple(sizes_kib(item.replace("+", ","), repeats=True)) for item in text.split(",")]
    one = [item for item, mix in zip(text.split(","), mixes) if len(mix) > 1 and len(set(mix)) == 1]
    if one:  # (`16+16` measured 16 KiB blocks again, as a "mixed" row, beside `16`: a review)
        raise OptionError(f"--sizes-kib: {one[0]} mixes one size only: write {one[0].split('+')[0]}")
    twice = [item for i, item in enumerate(text.split(",")) if sorted(mixes[i]) in map(sorted, mixes[:i])]
    if twice:
        raise OptionError(f"--sizes-kib: {twice[0]} is given twice")
    return mixes


def run(args) -> list[dict]:
    if args.run_blocks > args.blocks:
        raise OptionError(f"--run-blocks must be 1..--blocks ({args.blocks}), got {args.run_blocks}")
    mixes = size_mixes(args.sizes_kib)  # every option is checked before the GPU is looked for
    if args.run_blocks > 1 and any(len(mix) > 1 for mix in mixes):
        raise OptionError("--run-blocks > 1 needs one block size per batch (mixed sizes do not form runs)")
    cp = visible_gpu(args.device, "bench transfer")
    from dflash2.cuda.arena import CudaArena, PinnedHostArena
    from dflash2.transfer.cuda import CudaTransferBackend

    n, largest = args.blocks, max(max(mix) for mix in mixes)
    whole = -(-n // args.run_blocks) * args.run_blocks  # slots a batch spans: whole runs
    # Two batches' worth of slots on each side: the batches out of HBM use the first half of each
    # arena, those into HBM the second, so that the run both ways at once reads no slot that it
    # writes. (The --inflight batches of one direction share their half: they may overlap.)
    hbm = CudaArena.create(args.device, 2 * whole * largest)
    dram = PinnedHostArena.create(f"dflash2-bench-{uuid.uuid4().hex[:8]}", 2 * whole * largest, Tier.DRAM,
                                  device=args.device)
    backend = CudaTransferBackend({Tier.HBM: hbm, Tier.DRAM: dram}, dram.region, staging_bytes=0)
    rng = np.random.default_rng(0)
    out = []
    try:
        for mix in mixes:
            size = max(mix)  # a mixed batch's blocks lie in slots of its largest size
            slots = 2 * whole * largest // size
            run = args.run_blocks

            half = slots // 2 // run * run  # at least `whole` slots, in whole runs

            def scattered(second: bool):
                starts = rng.permutation(half // run)[: -(-n // run)] * run + (half if second else 0)
                return ((starts[:, None] + np.arange(run)[None, :]).ravel()[:n] * size).astype(np.int64)
            nb = np.array(mix, dtype=np.int64)[np.arange(n) % len(mix)]
            k = args.inflight
            downs = [CopyBatch(Tier.HBM, Tier.DRAM, scattered(False), scattered(False), nb) for _ in range(k)]
            ups = [CopyBatch(Tier.DRAM, Tier.HBM, scattered(True), scattered(True), nb) for _ in range(k)]
            total = int(nb.sum())

            def run_batches(*groups):
                # Both directions at once: started alternately, as a mover swapping blocks out and
                # in would (starting all of one direction first would idle the other while the
                # CPU queues them: a copy-engine batch costs the driver ~0.45 ms a 1024 blocks).
                jobs = [backend.start(b) for pair in zip(*groups) for b in pair]
                for job in jobs:
                    job.wait()
            via = {}

            def timed(name, *groups):
                backend.launches.clear()
                seconds = _time(lambda: run_batches(*groups), args.repeat)
                via[name + "_via"] = {SHORT[d]: per for d, per in backend.copy_batches().items()}
                return seconds
            d2h = timed("d2h", downs)
            h2d = timed("h2d", ups)
            bidir = timed("bidir", downs, ups)
            d2h_single = _time(lambda: run_batches(downs[:1]), args.repeat)
            h2d_single = _time(lambda: run_batches(ups[:1]), args.repeat)
            contig = _contiguous(cp, hbm, dram, total, args.repeat)
            per_block = _per_block(cp, hbm, dram, downs[0], args.repeat)
            moved = total * args.repeat * k
            kib = {"block_kib": size // KIB} if len(mix) == 1 else {"block_kib": None,
                                                                    "mixed_kib": [m // KIB for m in mix]}
            row = {**kib, "blocks": n, "run_blocks": run, "inflight": k,
                   "d2h_gbps": _gbps(moved, d2h), "h2d_gbps": _gbps(moved, h2d),
                   "bidir_gbps": _gbps(2 * moved, bidir),
                   "d2h_single_gbps": _gbps(total * args.repeat, d2h_single),
                   "h2d_single_gbps": _gbps(total * args.repeat, h2d_single), **contig,
                   "per_block_copy_gbps": _gbps(total * args.repeat, per_block), **via}
            row["d2h_vs_contig"] = round(row["d2h_gbps"] / row["contig_d2h_gbps"], 3)
            row["h2d_vs_contig"] = round(row["h2d_gbps"] / row["contig_h2d_gbps"], 3)
            row["bidir_vs_contig"] = round(row["bidir_gbps"] / row["contig_bidir_gbps"], 3)
            out.append(row)
    finally:
        with stopsignals.uninterrupted():
            backend.close()
            dram.close()
            hbm.close()
    return out


def _contiguous(cp, hbm, dram, total: int, repeat: int) -> dict:
    rt = cp.cuda.runtime
    with on_device(hbm.device):
        s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        host = dram.region.host_ptr

        def d2h():
            rt.memcpyAsync(host, hbm.ptr, total, rt.memcpyDeviceToHost, s1.ptr)
            s1.synchronize()

        def h2d():
            rt.memcpyAsync(hbm.ptr + total, host + total, total, rt.memcpyHostToDevice, s2.ptr)
            s2.synchronize()

        def both():
            rt.memcpyAsync(host, hbm.ptr, total, rt.memcpyDeviceToHost, s1.ptr)
            rt.memcpyAsync(hbm.ptr + total, host + total, total, rt.memcpyHostToDevice, s2.ptr)
            s1.synchronize()
            s2.synchronize()
        return {"contig_d2h_gbps": _gbps(total * repeat, _time(d2h, repeat)),
                "contig_h2d_gbps": _gbps(total * repeat, _time(h2d, repeat)),
                "contig_bidir_gbps": _gbps(2 * total * repeat, _time(both, repeat))}


def _per_block(cp, hbm, dram, batch: CopyBatch, repeat: int) -> float:
    rt = cp.cuda.runtime
    host = dram.region.host_ptr
    src, dst, nb = batch.src_offsets.tolist(), batch.dst_offsets.tolist(), batch.nbytes.tolist()
    with on_device(hbm.device):
        s = cp.cuda.Stream(non_blocking=True)

        def naive():
            for a, b, n in zip(src, dst, nb):
                rt.memcpyAsync(host + b, hbm.ptr + a, n, rt.memcpyDeviceToHost, s.ptr)
            s.synchronize()
        return _time(naive, repeat)
