"""The batched copy kernel: a whole batch of scattered blocks in one launch.

Each thread block walks the batch's blocks (block b for b = blockIdx.x, + gridDim.x, ...) and copies
it in 16-byte words, four in flight per thread, then any tail bytes. Source and destination are
device pointers; a pinned, mapped host buffer's device pointer works the same, so one kernel moves
HBM→DRAM (gather into host memory), DRAM→HBM (scatter from it) and HBM↔staging.

Invariant: every offset is a multiple of 16 (arena alignments are 256 and 4096).
"""

from __future__ import annotations

import numpy as np

from dflash2.cuda import cupy

SOURCE = r"""
extern "C" __global__ void dflash2_copy_blocks(
        const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
        const long long* __restrict__ src_off, const long long* __restrict__ dst_off,
        const long long* __restrict__ nbytes, const int n) {
    for (int b = blockIdx.x; b < n; b += gridDim.x) {
        const unsigned char* s = src + src_off[b];
        unsigned char* d = dst + dst_off[b];
        const long long len = nbytes[b];
        const long long nvec = len >> 4;
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        const long long step = (long long)blockDim.x * 4;
        long long i = threadIdx.x;
        for (; i + 3 * blockDim.x < nvec; i += step) {
            uint4 a = s4[i], b1 = s4[i + blockDim.x], c = s4[i + 2 * blockDim.x], e = s4[i + 3 * blockDim.x];
            d4[i] = a; d4[i + blockDim.x] = b1; d4[i + 2 * blockDim.x] = c; d4[i + 3 * blockDim.x] = e;
        }
        for (; i < nvec; i += blockDim.x) d4[i] = s4[i];
        for (long long t = (nvec << 4) + threadIdx.x; t < len; t += blockDim.x) d[t] = s[t];
    }
}
"""

THREADS = 512
MAX_GRID = 264  # two resident thread blocks per SM on an H200's 132 SMs


class CopyKernel:
    def __init__(self, device: int):
        cp = cupy()
        self.device = device
        with cp.cuda.Device(device):
            self._kernel = cp.RawKernel(SOURCE, "dflash2_copy_blocks")

    def launch(self, stream, src_ptr: int, dst_ptr: int, src_off: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray):
        """Queue one launch on `stream`; returns the device arrays of offsets (keep them alive until
        the stream passes this point)."""
        cp = cupy()
        n = len(nbytes)
        if n == 0:
            return ()
        if ((src_off | dst_off) & 15).any():
            raise ValueError("copy offsets must be multiples of 16 bytes")
        with cp.cuda.Device(self.device), stream:
            meta = cp.asarray(np.stack([src_off, dst_off, nbytes]).astype(np.int64))
            grid = (min(n, MAX_GRID),)
            self._kernel(grid, (THREADS,), (cp.uint64(src_ptr), cp.uint64(dst_ptr), meta[0], meta[1], meta[2],
                                            np.int32(n)))
        return (meta,)
