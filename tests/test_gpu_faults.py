"""The CUDA path when something fails (run on a GPU machine): start-up short of memory, layouts the
staging buffer cannot hold, copy engines the driver refuses, a lost CUDA context, closing under
live views or moves, named errors instead of CuPy tracebacks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gpu_helpers import GPU, MIB, daemon_on, fill, gpu_manager

pytestmark = GPU


def test_startup_fails_clearly_when_the_reserve_leaves_no_room(cuda_config):
    path = cuda_config(hbm_reserve_mb=10_000_000, hbm_capacity_mb=None)
    out = subprocess.run(["dflash2d", "--config", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "memory.hbm_reserve_mb" in out.stderr and "leaves nothing" in out.stderr


def test_startup_fails_clearly_when_the_gpu_is_short(cuda_config):
    import cupy as cp
    free, _ = cp.cuda.runtime.memGetInfo()
    path = cuda_config(hbm_capacity_mb=int(free // MIB) + 4096)
    out = subprocess.run(["dflash2d", "--config", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 4
    assert "needs" in out.stderr and "free" in out.stderr


def test_a_layout_whose_blocks_exceed_the_staging_buffer_is_refused_when_registered(cuda_config):
    """On a GPU node with NVMe, HBM<->NVMe moves go through the staging buffer whole: a layout with
    larger blocks is refused at attach (nobody attached) and at register_layout, where its moves used
    to fail at run time (and blocks read back from NVMe were dropped)."""
    from dflash2.client import Client
    from dflash2.errors import DaemonError
    from dflash2.layout import Layout
    path = cuda_config(staging_buffer_size_mb=8)
    big = Layout("big", 64, 8, 128, "bf16", 64)  # 16 MiB blocks
    with daemon_on(path):
        with pytest.raises(DaemonError, match="raise memory.staging_buffer_size_mb"):
            Client.connect(config=path, name="big", layouts=[big])
        with Client.connect(config=path, name="ok", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)]) as c:
            assert [s["name"] for s in c.stats()["clients"]] == ["ok"]
            with pytest.raises(DaemonError, match="cannot move between HBM and NVMe"):
                c.register_layout(big)
            with pytest.raises(DaemonError, match="layout id 1 is not registered"):
                c.allocate(1, 1)


def test_when_the_copy_engines_fail_the_kernel_moves_the_batch_and_every_later_one(cuda_config, caplog):
    """A platform whose driver refuses the engines' batches: the batch that hit it still moves (by the
    kernel), bit for bit, and so does every later one, with one error line; before, every batch of
    64 KiB or more failed and its blocks stayed where they were."""
    import logging

    import cupy as cp
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    from dflash2.transfer.route import Mechanism
    mgr = gpu_manager(cuda_config())
    try:
        backend = mgr.backend
        if not backend.engines.available:
            pytest.skip("the driver has no cuMemcpyBatchAsync")
        real = backend.engines.launch
        # The driver's own refusal: the legacy default stream, which cuMemcpyBatchAsync refuses.
        backend.engines.launch = lambda stream, *rest: real(0, *rest)
        a = mgr.attach("t")
        lid = mgr.register_layout(Layout("blk", 8, 8, 128, "bf16", 16))  # 512 KiB: the engines' size
        first, second = (mgr.commit(a, mgr.allocate(a, lid, 4)) for _ in range(2))
        data = {v: fill(mgr.view(v), v % 971) for v in np.concatenate([first, second]).tolist()}
        with caplog.at_level(logging.ERROR, logger="dflash2.transfer.cuda"):
            assert mgr.mover.move(mgr.table.rows(first), Tier.DRAM).all()
            assert mgr.mover.move(mgr.table.rows(second), Tier.DRAM).all()
            assert mgr.mover.move(mgr.table.rows(first), Tier.HBM).all()
        assert caplog.text.count("the copy engines failed") == 1
        assert not backend.engines.available
        assert set(backend.launches) == {(True, Mechanism.KERNEL), (False, Mechanism.KERNEL)}, backend.launches
        for v in second.tolist():
            assert bytes(mgr.view(v)) == data[v].tobytes()
        for v in first.tolist():
            assert (cp.asnumpy(mgr.view(v)) == data[v]).all()
        mgr.check_invariants()
    finally:
        mgr.close()


def _hbm_to_nvme_batch(mgr, n: int):
    """n committed 64 KiB blocks in HBM, as one HBM->NVMe batch to the first n NVMe slots."""
    from dflash2.layout import Layout
    from dflash2.tiers import Tier
    from dflash2.transfer.base import CopyBatch
    a = mgr.attach("t")
    lid = mgr.register_layout(Layout("l", 8, 2, 64, "bf16", 16))  # 64 KiB
    rows = mgr.table.rows(mgr.commit(a, mgr.allocate(a, lid, n)))
    nbytes = mgr.table.block_bytes(rows)
    offsets = np.arange(n, dtype=np.int64) * int(nbytes[0])
    return CopyBatch(Tier.HBM, Tier.NVME, mgr.table.cols.offset[rows].copy(), offsets, nbytes)


def test_closing_the_backend_waits_for_a_staged_move_in_flight(cuda_config):
    """A staged HBM->NVMe move still running when the backend closes finishes first: its thread
    uses the pinned staging buffer that close() frees."""
    mgr = gpu_manager(cuda_config())
    try:
        batch = _hbm_to_nvme_batch(mgr, 64)
        job = mgr.backend.start(batch)
        mgr.backend.close()  # at once, while the staged thread runs
        assert job.done() and job.wait().all()
        from dflash2.errors import ArenaError
        with pytest.raises(ArenaError, match="closed"):  # its staging buffer is gone
            mgr.backend.start(batch)
        mgr.backend.close()  # idempotent
    finally:
        mgr.close()


def test_a_disk_that_fails_every_staged_write_is_logged_once_not_once_per_batch(cuda_config, caplog):
    """HBM->NVMe through the staging buffer on a full disk: every batch fails (a miss), the GPU stays
    usable, and the log has one line, not one per batch (the host path's soak: 10,127 in 45 s)."""
    import errno
    import logging
    from dflash2.tiers import Tier
    mgr = gpu_manager(cuda_config())
    try:
        batch = _hbm_to_nvme_batch(mgr, 16)
        nvme = mgr.backend.arenas[Tier.NVME]

        def full(*_a, **_k):
            raise OSError(errno.ENOSPC, "No space left on device")
        nvme.write_blocks = full
        with caplog.at_level(logging.ERROR, logger="dflash2.transfer.cuda"):
            for _ in range(20):
                job = mgr.backend.start(batch)
                assert not job.wait().any()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "dflash2.transfer.cuda"]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        # a full disk names its error, without a traceback (failures.DISK_FULL)
        assert "staged move of 16 blocks" in errors[0].getMessage() and errors[0].exc_info is None
        assert "No space left on device" in errors[0].getMessage()
        assert mgr.backend.fatal is None  # a disk error leaves the GPU usable
    finally:
        mgr.close()


def test_a_lost_cuda_context_makes_the_backend_fatal_and_close_still_frees_the_host_memory(cuda_config):
    """A copy that faults (an illegal address: the sticky kind, after which every CUDA call of the
    process fails; a 16 KiB block, which the copy kernel moves: the copy engines' driver call
    crashes the process on an address it cannot resolve, which the allocator's offsets never are)
    fails its batch and marks the backend dead, which the daemon exits on (exit 5);
    closing the manager then still gives back the DRAM tier's shared memory. In a process of its own:
    the fault ends that process's CUDA context."""
    import os
    path = cuda_config()
    code = f"""
import glob, numpy as np
from dflash2.assemble import build_manager
from dflash2.config import load_config
from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch
mgr = build_manager(load_config({path!r}), instance="dflash2-gpu-lost-{os.getpid()}")
b = mgr.backend
assert b.fatal is None
import time
job = b.start(CopyBatch(Tier.DRAM, Tier.HBM, np.array([0]), np.array([1 << 46]), np.array([16384])))
until = time.monotonic() + 10
while not job.done() and time.monotonic() < until:  # as the loop polls a drain piece's copies
    time.sleep(0.01)
print("DONE", job.done())
ok = job.wait()
print("BATCH", ok.tolist(), "FATAL", b.fatal)
mgr.close()
print("LEFT", glob.glob("/dev/shm/dflash2-gpu-lost-{os.getpid()}*"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DONE True" in out.stdout, "a failed copy is done, not in flight for ever: " + out.stdout + out.stderr
    assert "BATCH [False] FATAL GPU 0: the CUDA context is lost" in out.stdout, out.stdout + out.stderr
    assert "LEFT []" in out.stdout, out.stdout + out.stderr


# The daemon (srv.run in a process of its own) with its managers kept where the injected code reaches them.
FAULTY_DAEMON = """
import sys, numpy as np
import dflash2.daemon.startup as srv
import dflash2.transfer.cuda as tc
from dflash2.config import load_config
made = {{}}
real = srv.build_managers
def keep(*args, **kw):
    made.update(real(*args, **kw))
    return made
srv.build_managers = keep
{inject}
sys.exit(srv.run(load_config({path!r})))
"""


def run_faulty_daemon(path: str, inject: str, client_code) -> tuple[int | None, str, dict]:
    """A daemon on `path` with `inject` run before it starts; `client_code(seen)` runs against it.
    Returns the daemon's exit code (None: still up 60 s later, stopped), its stderr, and what the
    client code saw."""
    import os
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-c", FAULTY_DAEMON.format(inject=inject, path=path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict = {}
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(os.path.dirname(path), "d.sock")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        client_code(seen)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            code = None
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stderr.read(), seen


def test_a_gpu_lost_during_a_drain_left_in_flight_stops_the_daemon_with_exit_5(cuda_config):
    """Every HBM->DRAM copy aimed at an unmapped address (as an Xid or an uncorrectable ECC error
    would leave the GPU), HBM filled past its high watermark: the background drain's piece, which the
    loop leaves in flight, fails, and the daemon exits 5 naming the GPU. Before, the failed copy
    looked in flight for ever (CuPy's Event.done): the daemon served on, and the calls that waited
    for the copy stalled until their clients gave up (a review's script: still up 25 s later)."""
    from dflash2.client import Client
    from dflash2.errors import DaemonError, DaemonUnavailable
    from dflash2.layout import Layout
    path = cuda_config(hbm_capacity_mb=8, nvme_capacity_mb=0)
    inject = '''
launch = tc.CudaTransferBackend._launch
def faulty(self, to_host, stream, src, dst, src_off, dst_off, *rest):
    return launch(self, to_host, stream, src, dst, src_off, dst_off + (1 << 46) if to_host else dst_off, *rest)
tc.CudaTransferBackend._launch = faulty
'''

    def fill(seen):
        try:
            with Client.connect(config=path, name="filler", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)],
                                device=0, timeout_s=5) as c:
                lid, key = c.layout_ids[0], 1000
                for _ in range(4):  # 248 of 256 blocks: past the high watermark; the drain runs between calls
                    places = c.allocate(lid, 62)
                    c.commit(places["vid"], keys=list(range(key, key + 62)))
                    key += 62
        except (DaemonError, DaemonUnavailable) as e:  # (the daemon may go while the client still talks)
            seen["error"] = e
    code, err, seen = run_faulty_daemon(path, inject, fill)
    assert code == 5, (seen, err[-3000:])
    assert "dflash2d: error: GPU 0: the CUDA context is lost" in err, err[-3000:]


def test_a_cuda_error_in_a_call_checks_the_gpu_and_a_lost_one_stops_the_daemon(cuda_config):
    """A call that fails in CUDA (attach asking for the arena's IPC handle after the GPU faulted
    outside any copy the daemon waits for) makes the backend check its GPU: lost, the daemon exits
    5. Before, the client got an InternalError and the daemon served on without its GPU."""
    from dflash2.client import Client
    from dflash2.errors import DaemonError, DaemonUnavailable
    from dflash2.layout import Layout
    path = cuda_config(hbm_capacity_mb=8, nvme_capacity_mb=0)
    import os
    trigger = os.path.join(os.path.dirname(path), "fault-now")
    inject = f'''
import os, threading, time
from dflash2.tiers import Tier
from dflash2.transfer.base import CopyBatch
def fault():  # once told: a copy nobody waits for, into an unmapped address: the context is lost
    while not os.path.exists({trigger!r}):
        time.sleep(0.01)
    backend = next(iter(made.values())).backend
    backend.start(CopyBatch(Tier.DRAM, Tier.HBM, np.array([0]), np.array([1 << 46]), np.array([16384])))
threading.Thread(target=fault, daemon=True).start()
'''
    layout = Layout("bf16", 4, 2, 64, "bf16", 16)

    def attach_after_the_fault(seen):
        import time
        with Client.connect(config=path, name="before", layouts=[layout], device=0):
            pass
        open(trigger, "w").close()
        time.sleep(1.0)
        try:
            Client.connect(config=path, name="after", layouts=[layout], device=0, timeout_s=5).close()
            seen["after"] = "attached"
        except (DaemonError, DaemonUnavailable) as e:
            seen["after"] = f"{type(e).__name__}: {e}"
    code, err, seen = run_faulty_daemon(path, inject, attach_after_the_fault)
    assert code == 5, (seen, err[-3000:])
    assert "dflash2d: error: GPU 0: the CUDA context is lost" in err, err[-3000:]


def test_views_of_a_closed_cuda_arena_stay_valid_until_the_last_dies():
    """close() with a view alive (a client detaching while its engine still holds tensors over
    blocks) leaves the view readable, as a shared-memory view stays: through an IPC mapping in a
    client process, and in the owner, whose allocation goes back when the last view dies. Each side
    runs in a process of its own: a read of unmapped memory would end that process's CUDA context."""
    from dflash2.cuda.arena import CudaArena
    arena = CudaArena.create(0, 8 * MIB)
    try:
        expected = fill(arena.view(MIB, MIB), seed=4)
        client = f"""
import sys, numpy as np, cupy as cp
from dflash2.cuda.arena import CudaArena
a = CudaArena.attach(bytes.fromhex("{arena.ipc_handle().hex()}"), 0, {8 * MIB})
v = a.view({MIB}, {MIB})
a.close()
sys.stdout.write(str(int(cp.asnumpy(v).astype(np.int64).sum())))
"""
        out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == int(expected.astype(np.int64).sum())
    finally:
        arena.close()
    owner = f"""
import gc, sys, cupy as cp
from dflash2.cuda.arena import CudaArena
free0 = cp.cuda.runtime.memGetInfo()[0]
a = CudaArena.create(0, {512 * MIB})
v = a.view({MIB}, 4096)
v[:] = 7
cp.cuda.runtime.deviceSynchronize()
a.close()
assert cp.asnumpy(v).tolist() == [7] * 4096, "the view reads its bytes after close()"
assert cp.cuda.runtime.memGetInfo()[0] < free0 - {256 * MIB}, "held while a view lives"
del v
gc.collect()
assert cp.cuda.runtime.memGetInfo()[0] > free0 - {256 * MIB}, "freed with the last view"
"""
    out = subprocess.run([sys.executable, "-c", owner], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_staging_buffer_that_cannot_be_had_is_a_capacity_error():
    """Start-up reports it (exit 4, naming the key), not a CuPy traceback."""
    from dflash2.cuda.arena import PinnedBuffer
    from dflash2.errors import CapacityError
    with pytest.raises(CapacityError, match="memory.staging_buffer_size_mb"):
        PinnedBuffer(1 << 50, 0)  # 1 PiB: past any machine's memory and the 47-bit address space


def test_a_copy_kernel_that_does_not_compile_is_an_arena_error(monkeypatch):
    """NVRTC missing or refusing at start-up is a named error the daemon reports (exit 4)."""
    from dflash2.cuda import kernels
    from dflash2.errors import ArenaError
    monkeypatch.setattr(kernels, "SOURCE", 'extern "C" __global__ void dflash2_copy_chunks() { not cuda }')
    with pytest.raises(ArenaError, match="cannot compile the copy kernel for GPU 0"):
        kernels.CopyKernel(0)


def test_a_copy_engine_batch_the_driver_refuses_is_an_arena_error():
    """The driver refuses a batch on the legacy default stream: a named error (the mover then
    leaves the blocks where they were), not a bare RuntimeError."""
    import cupy as cp
    from dflash2.cuda.copy_engine import CopyEngineBatch
    from dflash2.errors import ArenaError
    engines = CopyEngineBatch()
    if not engines.available:
        pytest.skip("the driver has no cuMemcpyBatchAsync (CUDA < 12.8)")
    src, dst = cp.zeros(1 << 20, dtype=cp.uint8), cp.zeros(1 << 20, dtype=cp.uint8)
    offs, sizes = np.arange(4, dtype=np.int64) << 16, np.full(4, 1 << 16, dtype=np.int64)
    with pytest.raises(ArenaError, match="cuMemcpyBatchAsync failed"):
        engines.launch(0, dst.data.ptr, src.data.ptr, offs, offs, sizes)


def test_a_copy_kernel_launch_the_driver_refuses_is_an_arena_error():
    """The copy kernel goes to the driver's cuLaunchKernel directly: a launch it refuses (here a
    thread block larger than any GPU allows) is a named error with the driver's code, and the GPU
    stays usable (such a refusal is not sticky)."""
    import cupy as cp
    from dflash2.cuda.kernels import CopyKernel
    from dflash2.errors import ArenaError
    with cp.cuda.Device(0):
        kernel = CopyKernel(0)
        stream = cp.cuda.Stream(non_blocking=True)
        with pytest.raises(ArenaError, match=r"cuLaunchKernel of the copy kernel failed with CUDA error \d+ "
                                              r"\(grid 1, block 4096\)"):
            kernel._launcher.launch(1, 4096, stream.ptr, kernel._args.params)
        src = cp.arange(4096, dtype=cp.uint8)
        dst = cp.zeros(4096, dtype=cp.uint8)
        kernel.launch(stream, src.data.ptr, dst.data.ptr, np.array([0]), np.array([0]), np.array([4096]))
        stream.synchronize()
        assert (dst == src).all()


def _raising_on_call(nth: int, real):
    """`real`, but its nth call raises EIO (a whole staging chunk's I/O failing)."""
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise OSError(5, "Input/output error (injected, a whole chunk)")
        return real(*args, **kwargs)
    return call


def test_a_staged_chunk_that_fails_fails_itself_and_those_after_not_the_chunks_done(cuda_config, caplog):
    """A move through the staging buffer goes a bufferful at a time; one chunk that raised failed the
    whole batch: the blocks of the chunks before it, written or read and copied already, were
    dropped as misses (and, read from NVMe, their slots set aside as unreadable). Now only the failed
    chunk and those after it fail; the log says how many were done."""
    import logging
    from dflash2.tiers import Tier
    from dflash2.transfer.base import CopyBatch
    mgr = gpu_manager(cuda_config(staging_buffer_size_mb=1))  # 16 blocks of 64 KiB a chunk
    try:
        batch = _hbm_to_nvme_batch(mgr, 64)
        nvme = mgr.backend.arenas[Tier.NVME]
        real_write, real_read = nvme.write_blocks, nvme.read_blocks
        nvme.write_blocks = _raising_on_call(3, real_write)
        with caplog.at_level(logging.ERROR, logger="dflash2.transfer.cuda"):
            ok = mgr.backend.start(batch).wait()
        assert ok[:32].all() and not ok[32:].any(), ok
        assert "after its first 32 were done, for the 32 others" in caplog.text
        nvme.write_blocks = real_write
        assert mgr.backend.start(batch).wait().all()  # every block on NVMe now
        back = CopyBatch(Tier.NVME, Tier.HBM, batch.dst_offsets.copy(), batch.src_offsets.copy(), batch.nbytes.copy())
        nvme.read_blocks = _raising_on_call(2, real_read)
        ok = mgr.backend.start(back).wait()
        assert ok[:16].all() and not ok[16:].any(), ok
        assert mgr.backend.fatal is None
    finally:
        mgr.close()
