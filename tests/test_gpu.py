"""The CUDA path, run on a GPU machine (`bash .gpu/run-gpu-suite.sh`); skipped cleanly elsewhere:
IPC views, bit-exact moves through every tier, concurrent reads, the copy kernel and engines,
the read bandwidth measured on the device. Multi-GPU: test_gpu_nodes.py; faults: test_gpu_faults.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

from gpu_helpers import GPU, MIB, daemon_on, fill, gpu_manager

pytestmark = GPU


def test_ipc_view_across_processes():
    """The daemon's arena written in one process, read through an IPC mapping in another."""
    from dflash2.cuda.arena import CudaArena
    arena = CudaArena.create(0, 8 * MIB)
    try:
        expected = fill(arena.view(MIB, MIB), seed=3)
        arena.view(0, 16)[:] = 0
        code = f"""
import sys, numpy as np, cupy as cp
from dflash2.cuda.arena import CudaArena
a = CudaArena.attach(bytes.fromhex("{arena.ipc_handle().hex()}"), 0, {8 * MIB})
data = cp.asnumpy(a.view({MIB}, {MIB}))
a.view(0, 16)[:] = 7
cp.cuda.runtime.deviceSynchronize()
sys.stdout.write(str(int(data.astype(np.int64).sum())))
a.close()
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == int(expected.astype(np.int64).sum())
        import cupy as cp
        assert cp.asnumpy(arena.view(0, 16)).tolist() == [7] * 16, "the child's write is visible here"
    finally:
        arena.close()


def test_mixed_layouts_round_trip_every_tier_bit_exact(cuda_config):
    import cupy as cp
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    mgr = gpu_manager(cuda_config())
    try:
        a = mgr.attach("t")
        bf16 = mgr.register_layout(Layout("bf16", 4, 2, 64, "bf16", 16))
        fp8 = mgr.register_layout(Layout("fp8", 4, 2, 64, "fp8_e4m3", 16))
        vids, data = [], {}
        for lid, seed in ((bf16, 1), (fp8, 2), (bf16, 3)):
            got = mgr.allocate(a, lid, 8)
            for i, v in enumerate(got.tolist()):
                data[v] = fill(mgr.view(v), seed * 100 + i)
            vids += mgr.commit(a, got).tolist()
        rows = mgr.table.rows(vids)
        assert mgr.mover.move(rows, Tier.DRAM).all()
        for v in vids:
            assert bytes(mgr.view(v)) == data[v].tobytes(), "HBM -> DRAM"
        assert mgr.mover.move(rows, Tier.NVME).all()
        assert mgr.acquire(a, vids) is not None
        for v in vids:
            p = mgr.place(v)
            assert p.tier == Tier.HBM
            assert (cp.asnumpy(mgr.view(v)) == data[v]).all(), "NVMe -> HBM"
        mgr.release(a, vids)
        # HBM -> NVMe directly (through the staging buffer) and back
        assert mgr.mover.move(rows, Tier.NVME).all()
        assert mgr.acquire(a, vids) is not None
        for v in vids:
            assert (cp.asnumpy(mgr.view(v)) == data[v]).all(), "HBM -> NVMe -> HBM"
        mgr.check_invariants()
    finally:
        mgr.close()


def test_reads_of_pinned_blocks_stay_exact_while_others_move(cuda_config):
    import cupy as cp
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    mgr = gpu_manager(cuda_config())
    try:
        a = mgr.attach("t")
        lid = mgr.register_layout(Layout("bf16", 4, 2, 64, "bf16", 16))
        mine = mgr.commit(a, mgr.allocate(a, lid, 4))
        expected = {v: fill(mgr.view(v), v % 1000) for v in mine.tolist()}
        mgr.acquire(a, mine)
        others = mgr.commit(a, mgr.allocate(a, lid, 200))
        for v in others.tolist():
            fill(mgr.view(v), 7)
        bad, stop, reads = [], threading.Event(), []

        def reader():
            with cp.cuda.Device(0):
                while not stop.is_set():
                    for v, want in expected.items():
                        if not (cp.asnumpy(mgr.view(v)) == want).all():
                            bad.append(v)
                        reads.append(v)
        t = threading.Thread(target=reader)
        t.start()
        rows = mgr.table.rows(others)
        for _ in range(10):
            assert mgr.mover.move(rows, Tier.DRAM).all()
            assert mgr.mover.move(rows, Tier.HBM).all()
        stop.set()
        t.join()
        assert reads and not bad
        for v, want in expected.items():
            assert mgr.place(v).tier == Tier.HBM
    finally:
        mgr.close()


def test_neighbouring_blocks_move_as_one_copy_bit_exact():
    """Runs of 16 KiB blocks side by side in both arenas go as one copy each: on the copy engines
    once a run reaches 128 KiB; scattered 16 KiB blocks take the kernel. Both ways, byte for byte."""
    import cupy as cp
    from dflash2.cuda.arena import CudaArena, PinnedHostArena
    from dflash2.tiers import Tier
    from dflash2.transfer.base import CopyBatch
    from dflash2.transfer.cuda import CudaTransferBackend
    from dflash2.transfer.route import Mechanism
    k, n = 16 << 10, 64
    hbm = CudaArena.create(0, 4 * n * k)
    dram = PinnedHostArena.create(f"dflash2-gpu-{uuid.uuid4().hex[:8]}", 4 * n * k, Tier.DRAM, device=0)
    backend = CudaTransferBackend({Tier.HBM: hbm, Tier.DRAM: dram}, dram.region, staging_bytes=0)
    try:
        rng = np.random.default_rng(3)
        data = rng.integers(0, 256, 4 * n * k, dtype=np.uint8)
        hbm.view(0, 4 * n * k)[:] = cp.asarray(data)
        cp.cuda.runtime.deviceSynchronize()
        runs = np.concatenate([np.arange(16) + 16 * r for r in rng.permutation(2 * n // 16)[: n // 16]])
        dst_runs = np.concatenate([np.arange(16) + 16 * r for r in rng.permutation(2 * n // 16)[: n // 16]])
        scattered, dst_scattered = rng.permutation(2 * n)[:n] + 2 * n, rng.permutation(2 * n)[:n] + 2 * n
        for src, dst, mech in ((runs, dst_runs, Mechanism.ENGINES), (scattered, dst_scattered, Mechanism.KERNEL)):
            backend.launches.clear()
            job = backend.start(CopyBatch(Tier.HBM, Tier.DRAM, src * k, dst * k, np.full(n, k)))
            assert job.wait().all()
            assert backend.launches == {(True, mech): 1}, backend.launches
            got = dram.view(0, 4 * n * k)
            for s_, d_ in zip(src.tolist(), dst.tolist()):
                assert (got[d_ * k:(d_ + 1) * k] == data[s_ * k:(s_ + 1) * k]).all()
        # and back up, from the runs just written, into fresh HBM places
        up_dst = np.arange(n) + 2 * n
        hbm.view(0, 4 * n * k)[2 * n * k:] = 0
        backend.launches.clear()
        job = backend.start(CopyBatch(Tier.DRAM, Tier.HBM, dst_runs * k, up_dst * k, np.full(n, k)))
        assert job.wait().all() and backend.launches == {(False, Mechanism.ENGINES): 1}
        back = cp.asnumpy(hbm.view(0, 4 * n * k))
        for s_, d_ in zip(runs.tolist(), up_dst.tolist()):
            assert (back[d_ * k:(d_ + 1) * k] == data[s_ * k:(s_ + 1) * k]).all()
    finally:
        backend.close()
        dram.close()
        hbm.close()


def test_copy_kernel_handles_odd_sizes_and_many_chunks():
    import cupy as cp
    from dflash2.cuda.arena import CudaArena, PinnedBuffer
    from dflash2.cuda.kernels import CopyKernel
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 200_000, 300).astype(np.int64)
    slots = (-(-sizes // 256) * 256).astype(np.int64)
    src_off = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
    perm = rng.permutation(len(sizes))
    dst_off = np.zeros_like(src_off)
    dst_off[perm] = np.concatenate([[0], np.cumsum(slots[perm])[:-1]])
    total = int(slots.sum())
    hbm = CudaArena.create(0, total)
    host = PinnedBuffer(total, 0)
    try:
        data = rng.integers(0, 256, total, dtype=np.uint8)
        hbm.view(0, total)[:] = cp.asarray(data)
        cp.cuda.runtime.deviceSynchronize()
        kernel = CopyKernel(0)
        stream = cp.cuda.Stream(non_blocking=True)
        kernel.launch(stream, hbm.ptr, host.device_ptr, src_off, dst_off, sizes)
        stream.synchronize()
        for s, d, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist()):
            assert (host.array[d:d + n] == data[s:s + n]).all()
    finally:
        host.close()
        hbm.close()


def test_clients_share_blocks_through_cuda_views(cuda_config):
    """Two client processes and the real daemon: one writes a prefix through its CUDA tensor views
    and commits it by content key; the other maps the arena by IPC handle, finds the prefix, and
    reads the same bytes through its own views. It prints how long attaching (IPC mapping included)
    takes in a process whose CUDA context exists already, as a serving engine's does."""
    import torch
    from dflash2.client import Client
    from dflash2.layout import Layout
    path = cuda_config()
    with daemon_on(path):
        layout = Layout("bf16", 4, 2, 64, "bf16", 16)
        with Client.connect(config=path, name="writer", layouts=[layout]) as w:
            lid = w.layout_ids[0]
            places = w.allocate(lid, 3)
            torch.manual_seed(0)
            written = []
            for p in places:
                t = w.view(p)
                assert t.is_cuda and t.dtype == torch.bfloat16 and tuple(t.shape) == layout.shape
                t.copy_(torch.randn(layout.shape, dtype=torch.bfloat16, device=t.device))
                written.append(t.float().sum().item())
            torch.cuda.synchronize()
            w.commit(places["vid"], keys=[11, 12, 13])
            code = f"""
import time, json, torch, cupy
from dflash2.client import Client
from dflash2.layout import Layout
# A serving process has CUDA up before it attaches (its engine made the context): so does this one.
torch.zeros(1, device="cuda")
cupy.cuda.runtime.getDeviceCount()
t0 = time.perf_counter()
c = Client.connect(config={path!r}, name="reader", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)])
attach_s = time.perf_counter() - t0
found = c.lookup([11, 12, 13, 14])
got = c.acquire(found["vid"])
sums = [c.view(p).float().sum().item() for p in got]
c.release(found["vid"])
c.close()
print(json.dumps({{"attach_s": attach_s, "found": len(found), "sums": sums}}))
"""
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            res = json.loads(out.stdout.strip().splitlines()[-1])
            print("attach with IPC mapping:", res["attach_s"], "s")
            assert res["found"] == 3
            assert res["sums"] == written
            # the attach time is a figure to report (target <= 0.5 s), not a timed assertion


def hold_stream(stream, seconds: float) -> None:
    """Queue a kernel that keeps `stream` busy for about `seconds`."""
    import cupy as cp
    spin = cp.RawKernel(r'''extern "C" __global__ void hold(long long cycles) {
        const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "hold")
    khz = cp.cuda.Device().attributes["ClockRate"]
    spin((1,), (1,), (np.int64(seconds * khz * 1000),), stream=stream)


@pytest.mark.parametrize("layers, block_kib", [(8, 512), (1, 64)])
def test_copy_engine_batches_both_ways_bit_exact(cuda_config, layers, block_kib):
    """Both directions in flight together, bit for bit, on the mechanism `route` names: 512 KiB
    blocks take the copy engines each way; 64 KiB blocks take them host to device always, device to
    host only while the other direction is busy (the kernel when it is idle)."""
    import cupy as cp
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    from dflash2.transfer.route import Mechanism
    mgr = gpu_manager(cuda_config())
    try:
        backend = mgr.backend
        assert backend.engines.available
        a = mgr.attach("t")
        lid = mgr.register_layout(Layout("blk", layers, 8, 128, "bf16", 16))
        assert mgr.table.layout(lid).block_bytes == block_kib << 10
        per = 4 if block_kib > 64 else 16
        down = [mgr.commit(a, mgr.allocate(a, lid, per)) for _ in range(3)]
        data = {v: fill(mgr.view(v), v % 977) for d in down for v in d.tolist()}
        up = [mgr.commit(a, mgr.allocate(a, lid, per)) for _ in range(3)]
        data.update({v: fill(mgr.view(v), v % 991) for u in up for v in u.tolist()})
        for u in up:
            assert mgr.mover.move(mgr.table.rows(u), Tier.DRAM).all()
        backend.launches.clear()
        # The other direction idle: 64 KiB device to host takes the kernel (every other block of an
        # allocation: no two are neighbours, which the backend would move as one larger copy).
        lone = mgr.commit(a, mgr.allocate(a, lid, 2 * per))[::2]
        data.update({v: fill(mgr.view(v), v % 983) for v in lone.tolist()})
        assert mgr.mover.move(mgr.table.rows(lone), Tier.DRAM).all()
        lone_mech = Mechanism.ENGINES if block_kib >= 128 else Mechanism.KERNEL
        assert backend.launches == {(True, lone_mech): 1}, backend.launches
        # The up batches queue behind a held stream, so every down batch finds them in flight.
        backend.launches.clear()
        with cp.cuda.Device(backend.device):
            hold_stream(backend.h2d, 0.3)
        moves = []
        for d, u in zip(down, up):  # all in flight before any is waited for
            moves.append(mgr.mover.prepare(mgr.table.rows(u), Tier.HBM))
            moves.append(mgr.mover.prepare(mgr.table.rows(d), Tier.DRAM))
        for m in moves:
            assert mgr.mover.complete(m).all()
        assert backend.launches == {(False, Mechanism.ENGINES): 3, (True, Mechanism.ENGINES): 3}, backend.launches
        for v in np.concatenate(down + [lone]).tolist():
            assert mgr.place(v).tier == Tier.DRAM and bytes(mgr.view(v)) == data[v].tobytes()
        for u in up:
            for v in u.tolist():
                assert mgr.place(v).tier == Tier.HBM and (cp.asnumpy(mgr.view(v)) == data[v]).all()
        mgr.check_invariants()
    finally:
        mgr.close()


def test_read_bandwidth_is_measured_on_the_cuda_path_and_slow_tiers_are_withheld(cuda_config):
    """Cost-aware reuse on a GPU: the daemon measures DRAM->HBM and NVMe->HBM on its own moves, and an
    engine whose recompute lies between the two is offered the blocks in DRAM but not those on NVMe."""
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    mgr = gpu_manager(cuda_config())
    try:
        a = mgr.attach("engine")
        layout = Layout("l", 8, 2, 64, "bf16", 16)  # 64 KiB
        lid = mgr.register_layout(layout)
        keys = list(range(1, 129))
        vids = mgr.commit(a, mgr.allocate(a, lid, 128), keys=keys)
        rows = mgr.table.rows(vids)
        for _ in range(3):  # 8 MiB each way per round: both paths measured, past their first batch
            assert mgr.mover.move(rows, Tier.DRAM).all()
            assert mgr.mover.move(rows[64:], Tier.NVME).all()
            assert mgr.acquire(a, vids) is not None
            mgr.release(a, vids)
        dram = mgr.read_cost.bandwidth(Tier.DRAM, Tier.HBM)
        nvme = mgr.read_cost.bandwidth(Tier.NVME, Tier.HBM)
        print(f"\nmeasured read bandwidth: dram->hbm {dram / 1e9:.2f} GB/s, nvme->hbm {nvme / 1e9:.2f} GB/s")
        assert dram > nvme > 0
        assert mgr.mover.move(rows, Tier.DRAM).all()
        assert mgr.mover.move(rows[64:], Tier.NVME).all()
        # Recomputing a block takes as long as reading it at the geometric mean of the two paths.
        rate = layout.tokens_per_block * (dram * nvme) ** 0.5 / layout.block_bytes
        mgr.set_prefill_rate(a, lid, rate)
        found = mgr.lookup_rows(keys, lid, client=a)
        assert mgr.table.vids(found).tolist() == vids[:64].tolist()
        assert mgr.access.withheld == 64
        mgr.check_invariants()
    finally:
        mgr.close()


def test_sglang_sizing_note_reads_a_gpu_daemons_hbm_tier(cuda_config):
    """sglang's start-up check (the plugin, no sglang needed) against the real daemon on a GPU: an
    HBM tier above HBM_NOTE_BYTES gets the warning that names its bytes; the small one does not."""
    from dflash2.client.sglang.plugin import HBM_NOTE_BYTES, check_dflash2
    assert 64 << 20 < HBM_NOTE_BYTES < 2048 << 20
    with daemon_on(cuda_config()):  # 64 MB of HBM
        small = check_dflash2(cuda_config())
    with daemon_on(cuda_config(hbm_capacity_mb=2048)):
        large = check_dflash2(cuda_config(hbm_capacity_mb=2048))
    assert small.ok and small.note == ""
    assert large.ok and "2.1 GB" in large.note and "memory.hbm_capacity_mb" in large.note
