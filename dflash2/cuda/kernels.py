"""The batched copy kernel: a whole batch of scattered blocks in one launch.

The batch is cut into chunks of CHUNK bytes (a block of 64 KiB is four chunks); thread block w
copies chunks w, w + gridDim.x, ... Each thread loads UNROLL 16-byte words before storing any, so
that many reads are in flight: a kernel that reads host memory over PCIe is latency-bound otherwise.
Source and destination are device pointers; a pinned, mapped host buffer's device pointer works the
same, so one kernel moves HBM→DRAM (gather into host memory), DRAM→HBM (scatter from it) and
HBM↔staging.

The batch's offsets travel to the device by an async copy from a pinned buffer on the same stream
(no synchronous upload per batch). Invariant: every offset is a multiple of 16 (arena alignments
are 256 and 4096); a pinned metadata buffer is reused only after the copy that read it finished.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from dflash2.cuda import cupy, on_device
from dflash2.cudadriver import libcuda
from dflash2.errors import ArenaError

THREADS = 128
UNROLL = 8
CHUNK = THREADS * UNROLL * 16  # 16 KiB
GRID_PER_SM = 3  # both directions co-resident: measured best for bidirectional moves on an H200
META_RING = 8

SOURCE = r"""
#define THREADS %(threads)d
#define UNROLL %(unroll)d
#define CHUNK %(chunk)d
extern "C" __global__ void __launch_bounds__(THREADS) dflash2_copy_chunks(
        const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
        const long long* __restrict__ meta, const int n) {
    const long long* src_off = meta;
    const long long* dst_off = meta + n;
    const long long* nbytes = meta + 2 * n;
    const long long* chunk_start = meta + 3 * n;  /* n + 1 entries */
    const long long total = chunk_start[n];
    for (long long w = blockIdx.x; w < total; w += gridDim.x) {
        int lo = 0, hi = n - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (chunk_start[mid] <= w) lo = mid; else hi = mid - 1;
        }
        const long long base = (w - chunk_start[lo]) * CHUNK;
        const long long rest = nbytes[lo] - base;
        const long long len = rest < CHUNK ? rest : CHUNK;
        const unsigned char* s = src + src_off[lo] + base;
        unsigned char* d = dst + dst_off[lo] + base;
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        const long long nvec = len >> 4;
        uint4 r[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = threadIdx.x + (long long)u * THREADS;
            if (i < nvec) r[u] = s4[i];
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = threadIdx.x + (long long)u * THREADS;
            if (i < nvec) d4[i] = r[u];
        }
        for (long long t = (nvec << 4) + threadIdx.x; t < len; t += THREADS) d[t] = s[t];
    }
}
""" % {"threads": THREADS, "unroll": UNROLL, "chunk": CHUNK}


def meta_words(n: int) -> int:
    """int64 words of a batch's metadata: three per copy, and n + 1 chunk starts."""
    return 4 * n + 1


def pack_meta(src_off: np.ndarray, dst_off: np.ndarray, nbytes: np.ndarray,
              out: np.ndarray | None = None) -> np.ndarray:
    """[src offsets, dst offsets, sizes, chunk starts (n + 1)] as one int64 array, written into
    `out` (meta_words(n) words or more: the pinned upload buffer, no temporary in between) when given."""
    n = len(nbytes)
    meta = np.empty(meta_words(n), dtype=np.int64) if out is None else out[: meta_words(n)]
    meta[:n] = src_off
    meta[n:2 * n] = dst_off
    meta[2 * n:3 * n] = nbytes
    meta[3 * n] = 0
    starts = meta[3 * n + 1:]
    np.floor_divide(meta[2 * n:3 * n] + (CHUNK - 1), CHUNK, out=starts)  # chunks per copy ...
    np.cumsum(starts, out=starts)  # ... summed: where each copy's chunks end
    return meta


class _StreamMeta:
    """Pinned host buffers (a ring) and one device buffer for one stream's batch metadata."""

    def __init__(self, stream):
        self.stream = stream
        self.host: list[np.ndarray | None] = [None] * META_RING  # views of pinned buffers
        self.events: list = [None] * META_RING
        self.next = 0
        self.device = None

    def buffer(self, cp, words: int) -> tuple[int, np.ndarray]:
        """The next pinned buffer of the ring, free to fill (the copy that last read it is done)."""
        slot = self.next
        self.next = (slot + 1) % META_RING
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        if self.host[slot] is None or self.host[slot].size < words:
            pinned = cp.cuda.alloc_pinned_memory(words * 8 * 2)
            self.host[slot] = np.frombuffer(pinned, dtype=np.int64, count=words * 2)
        return slot, self.host[slot][:words]

    def upload(self, cp, slot: int, host: np.ndarray):
        """Queue the copy of a filled buffer to the device on the stream; the device buffer."""
        if self.device is None or self.device.size < host.size:
            self.stream.synchronize()  # the old device buffer may still be read by a queued kernel
            self.device = cp.empty(host.size * 2, dtype=cp.int64)
        cp.cuda.runtime.memcpyAsync(self.device.data.ptr, host.ctypes.data, host.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        event = cp.cuda.Event(disable_timing=True)
        event.record(self.stream)
        self.events[slot] = event
        return self.device


class _Args:
    """The copy kernel's four arguments as the driver reads them (kernelParams: a pointer to each
    value), kept from launch to launch: cuLaunchKernel copies them when it is called."""

    def __init__(self):
        self.src, self.dst, self.meta = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self.n = ctypes.c_int32()
        self.params = (ctypes.c_void_p * 4)(*(ctypes.addressof(v) for v in (self.src, self.dst, self.meta, self.n)))

    def set(self, src: int, dst: int, meta: int, n: int) -> None:
        self.src.value, self.dst.value, self.meta.value, self.n.value = src, dst, meta, n


class Launcher:
    """A compiled kernel launched with the driver's cuLaunchKernel directly: CuPy's launch boxes and
    converts every argument on each call (a batch start of 1024 blocks on an H200 host took 143-150
    us of CPU with it, 89 without: CPU that the daemon's loop spends on every move)."""

    def __init__(self, function_ptr: int):
        self._function = ctypes.c_void_p(function_ptr)
        fn = libcuda().cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        fn.restype = ctypes.c_int
        self._fn = fn

    def launch(self, grid: int, block: int, stream_ptr: int, params) -> None:
        status = self._fn(self._function, grid, 1, 1, block, 1, 1, 0, stream_ptr, params, None)
        if status != 0:
            raise ArenaError(f"cuLaunchKernel of the copy kernel failed with CUDA error {status} "
                             f"(grid {grid}, block {block})")


class CopyKernel:
    def __init__(self, device: int):
        cp = cupy()
        self.device = device
        with on_device(device):
            self._kernel = cp.RawKernel(SOURCE, "dflash2_copy_chunks")
            # Compiled now, at start-up: left to the first launch, the compile (hundreds of ms on a
            # fresh machine) would stall the first move a client waits for.
            try:
                self._kernel.compile()
            except Exception as e:  # NVRTC missing or refusing (CuPy raises several kinds): named
                raise ArenaError(f"cannot compile the copy kernel for GPU {device} ({type(e).__name__}: {e}); "
                                 "CuPy compiles it with NVRTC, from the CUDA toolkit or the "
                                 "nvidia-cuda-nvrtc package matching your cupy-cuda* wheel") from None
            self._sms = cp.cuda.Device(device).attributes["MultiProcessorCount"]
            self._launcher = Launcher(self._kernel.kernel.ptr)
        self._args = _Args()  # the kernel's arguments, filled in under the lock at each launch
        self._meta: dict[int, _StreamMeta] = {}
        # A stream's metadata upload and its launch must not interleave with another thread's on
        # the same stream (the staged NVMe moves run on their own threads).
        self._lock = threading.Lock()

    def launch(self, stream, src_ptr: int, dst_ptr: int, src_off: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray, max_blocks: int | None = None) -> None:
        """Queue one launch on `stream` for the whole batch, on at most `max_blocks` thread blocks
        (default GRID_PER_SM per multiprocessor)."""
        cp = cupy()
        n = len(nbytes)
        if n == 0:
            return
        with self._lock, on_device(self.device):
            ring = self._meta.get(stream.ptr)
            if ring is None:
                ring = self._meta[stream.ptr] = _StreamMeta(stream)
            slot, host = ring.buffer(cp, meta_words(n))
            meta = pack_meta(src_off, dst_off, nbytes, out=host)
            if (meta[:2 * n] & 15).any():  # the buffer is refilled by the next batch: nothing was queued
                raise ValueError("copy offsets must be multiples of 16 bytes")
            total_chunks = int(meta[-1])
            device_meta = ring.upload(cp, slot, meta)
            limit = GRID_PER_SM * self._sms if max_blocks is None else max_blocks
            self._args.set(src_ptr, dst_ptr, device_meta.data.ptr, n)
            self._launcher.launch(max(1, min(total_chunks, limit)), THREADS, stream.ptr, self._args.params)
