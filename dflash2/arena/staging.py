"""The I/O plans of a storage arena: direct runs, staged chunks, and the ring that runs them.

A batch's blocks take one of two paths:
- **direct** (zero copy): a block whose buffer address and length are multiples of ALIGN (the views
  of a memory arena with 4096-aligned slots) is written from / read into its own buffer. Adjacent
  such blocks form a *run*: one `os.pwritev`/`os.preadv` over their buffers (at most
  MAX_DIRECT_IO_BYTES and IOV_MAX buffers); a larger block is split over several runs;
- **staged**: any other block is cut into chunks that each fill one slot of a page-aligned ring
  buffer (anonymous mmap) — write: copy into the slot, checksum, pwrite; read: pread, checksum,
  copy out.
The direct runs of a batch go through lanes on a small pool of worker threads: their I/O runs in
file order on one lane for writes (the pattern of raw sequential I/O) and on nvme.READ_LANES lanes
for reads; the other lanes checksum them (a read's as each run lands); each staged chunk is one job
on the same pool, so that while one worker waits on the disk another checksums (and copies).
`os.pwritev`/`os.preadv`, numpy copies and `zlib.crc32` all release the GIL, so the workers run in
parallel.

Invariants:
- every I/O piece has a file offset, a slot offset and a length that are multiples of ALIGN, so the
  same plan works with O_DIRECT;
- a slot is never reused while the job of an earlier chunk on it is running;
- a write never touches file bytes outside the batch's blocks' padded extents (other live blocks may
  lie in the gaps); a read may read across small gaps, which is harmless;
- a block no larger than a slot lies in one chunk; a larger one is split and its checksum is
  assembled from its pieces' checksums in order (`crc32_combine`);
- a direct run's pieces are whole pages of the blocks' own buffers (address, length and file offset
  multiples of ALIGN): O_DIRECT takes them as they are, and no byte outside a block is written.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from dflash2 import threads

T = TypeVar("T")

ALIGN = 4096
# Reads bridge gaps between blocks up to this size: one larger read beats two syscalls.
READ_BRIDGE_BYTES = 1 << 20
# One chunk is at most this long: large enough for full device throughput, small enough that the
# pipeline fills and drains fast at the ends of a batch.
MAX_CHUNK_BYTES = 8 << 20
# One direct run moves at most this much (a vectored I/O of many blocks' buffers).
MAX_DIRECT_IO_BYTES = 8 << 20
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# Workers: while some copy and checksum (CPU), others wait on the disk (measured best on 2 cores).
WORKERS = 4


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


# ---- crc32_combine (zlib's, which Python does not expose) ---------------------------------------

_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """Multiply a and b modulo the CRC polynomial (bit-reflected, as zlib does)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p, for k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=1024)
def _x8nmodp(n: int) -> int:
    """x^(8n) mod p: the operator that shifts a crc over n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


# ---- planning -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Chunk:
    """What fills one ring slot: `ios` are (file_offset, slot_offset, nbytes) file transfers;
    `pieces` are (block_index, block_start, block_end, slot_offset) ranges of padded block extents."""

    ios: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    pieces: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    fill: int = 0


def plan_chunks(order: np.ndarray, offsets: np.ndarray, extents: np.ndarray, chunk_bytes: int,
                bridge: int) -> list[Chunk]:
    """Cut the blocks `order` (sorted by offset) with padded `extents` into chunks of at most
    `chunk_bytes`, merging adjacent file ranges into one I/O (and gaps up to `bridge` bytes)."""
    chunks: list[Chunk] = []
    cur = Chunk()
    last_end = -1  # file offset where the current chunk's last I/O ends
    for i in order.tolist():
        off, ext = int(offsets[i]), int(extents[i])
        if cur.fill and ext <= chunk_bytes < cur.fill + ext:
            chunks.append(cur)  # keep a block that fits in one slot whole
            cur, last_end = Chunk(), -1
        s = 0
        while s < ext:
            if cur.fill == chunk_bytes:
                chunks.append(cur)
                cur, last_end = Chunk(), -1
            pos = off + s
            gap = pos - last_end
            if cur.ios and 0 < gap <= bridge and cur.fill + gap + min(ext - s, chunk_bytes) <= chunk_bytes:
                cur.fill += gap  # read the gap too: the last I/O grows over it
                f, b, n = cur.ios[-1]
                cur.ios[-1] = (f, b, n + gap)
                gap = 0
            n = min(ext - s, chunk_bytes - cur.fill)
            if cur.ios and gap == 0:
                f, b, m = cur.ios[-1]
                cur.ios[-1] = (f, b, m + n)
            else:
                cur.ios.append((pos, cur.fill, n))
            cur.pieces.append((i, s, s + n, cur.fill))
            cur.fill += n
            s += n
            last_end = pos + n
    if cur.ios:
        chunks.append(cur)
    return chunks


@dataclasses.dataclass
class Run:
    """One vectored I/O straight between the file (from `offset` on, contiguous) and the blocks' own
    buffers: `pieces` are (block_index, block_start, block_end) byte ranges, in file order."""

    offset: int
    pieces: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)


def plan_runs(order: np.ndarray, offsets: np.ndarray, lens: np.ndarray, max_bytes: int | None = None,
              max_iov: int = IOV_MAX) -> list[Run]:
    """Group the blocks `order` (sorted by offset; lengths multiples of ALIGN) into runs of adjacent
    blocks of at most `max_bytes` (MAX_DIRECT_IO_BYTES) and `max_iov` pieces; a larger block is split
    over runs."""
    max_bytes = max_bytes or MAX_DIRECT_IO_BYTES
    runs: list[Run] = []
    cur: Run | None = None
    end = fill = 0  # file offset where `cur` ends, and its bytes
    for i, off, n in zip(order.tolist(), offsets[order].tolist(), lens[order].tolist()):
        s = 0
        while s < n:
            if cur is None or off + s != end or fill >= max_bytes or len(cur.pieces) >= max_iov:
                cur, fill = Run(off + s), 0
                runs.append(cur)
            k = min(n - s, max_bytes - fill)
            cur.pieces.append((i, s, s + k))
            fill, s = fill + k, s + k
            end = off + s
    return runs


# ---- the ring -----------------------------------------------------------------------------------

def ring_slot_bytes(staging_bytes: int) -> int:
    """The slot of a ring of `staging_bytes`: half of it, at most a chunk, in whole pages."""
    return max(ALIGN, min(MAX_CHUNK_BYTES, staging_bytes // 2) // ALIGN * ALIGN)


def ring_workers(staging_bytes: int, workers: int = WORKERS) -> int:
    """The threads a ring of `staging_bytes` runs: a slot each at most."""
    return min(workers, staging_bytes // ring_slot_bytes(staging_bytes))


class StagingRing:
    """A page-aligned buffer of `nslots` slots of `slot_bytes`, and WORKERS threads."""

    def __init__(self, staging_bytes: int, workers: int = WORKERS):
        if staging_bytes < 2 * ALIGN:
            raise ValueError(f"staging buffer of {staging_bytes} bytes is smaller than two {ALIGN}-byte pages")
        self.slot_bytes = ring_slot_bytes(staging_bytes)
        self.nslots = staging_bytes // self.slot_bytes
        self.nbytes = self.nslots * self.slot_bytes
        self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        self.mv = memoryview(self._mm)
        self.np = np.frombuffer(self._mm, dtype=np.uint8)
        self.workers = ring_workers(staging_bytes, workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers,
                                                           thread_name_prefix="dflash2-staging",
                                                           initializer=threads.block_stop_signals)
        try:
            self._start_workers()
        except BaseException:
            self.close()
            raise

    def _start_workers(self) -> None:
        """Every worker started now, not at the pool's first tasks: one that could not start then (an
        address-space limit, `ulimit -v`; a limit on threads) raised in the middle of a batch's
        submits, left a task queued with none to run it and its partner waiting on it for good: the
        batch failed, its blocks were blamed on the disk, and close waited for ever (a review). Here
        such a failure is start-up's (RuntimeError). A pool with all its workers starts no more."""
        gate = threading.Barrier(self.workers + 1)  # (each blocked on it: every submit starts a thread)
        try:
            for _ in range(self.workers):
                self._pool.submit(gate.wait)
            gate.wait()
        except BaseException:
            gate.abort()  # (the started ones, and a task queued by a submit that raised, return)
            raise

    def run(self, chunks: list[Chunk], job: Callable[[Chunk, int], T],
            tasks: Sequence[Callable[[], T]] = ()) -> list[T]:
        """Run every slot-free task() (direct runs' I/O and checksums) and job(chunk, slot_offset)
        for every staged chunk on the workers; results of the tasks then of the chunks, each in
        order. Every job started is waited for before returning, also when one fails (the ring is
        reused)."""
        if len(chunks) + len(tasks) == 1:  # nothing to overlap: skip the thread hop
            return [tasks[0]()] if tasks else [job(chunks[0], 0)]
        futures: list[concurrent.futures.Future] = []
        try:
            # Tasks need no slot: all queue at once, the pool bounds how many are in flight.
            futures.extend(self._pool.submit(t) for t in tasks)
            staged: list[concurrent.futures.Future] = []
            for k, chunk in enumerate(chunks):
                if k >= self.nslots:
                    staged[k - self.nslots].result()  # its slot is free again
                staged.append(self._pool.submit(job, chunk, (k % self.nslots) * self.slot_bytes))
                futures.append(staged[-1])
            return [f.result() for f in futures]
        finally:
            for f in futures:  # after a failure: let the ring go quiet before reuse
                f.cancel()
            concurrent.futures.wait(futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.mv.release()
        self.np = None
        try:
            self._mm.close()
        except BufferError:
            pass


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    pwritev_all(fd, [buf], offset)


def pread_all(fd: int, buf: memoryview, offset: int) -> None:
    preadv_all(fd, [buf], offset)


def _advance(bufs: list, n: int) -> list:
    """The buffers left after the first n bytes of `bufs` (1-D byte buffers) were transferred."""
    k = 0
    while k < len(bufs) and n >= len(bufs[k]):
        n -= len(bufs[k])
        k += 1
    rest = bufs[k:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _vectored_all(op, fd: int, bufs: list, offset: int) -> None:
    """Run os.pwritev / os.preadv until every byte of `bufs` moved (more calls if one is short)."""
    while bufs:
        n = op(fd, bufs, offset)
        if n <= 0:  # a read past the end of the file, or a write the device refused
            raise OSError(f"{op.__name__} moved {n} bytes at offset {offset}")
        bufs, offset = _advance(bufs, n), offset + n


def pwritev_all(fd: int, bufs: list, offset: int) -> None:
    """Write the 1-D byte buffers `bufs` back to back from `offset` (one pwritev, more if short)."""
    _vectored_all(os.pwritev, fd, bufs, offset)


def preadv_all(fd: int, bufs: list, offset: int) -> None:
    """Fill the 1-D byte buffers `bufs` back to back from `offset` (one preadv, more if short)."""
    _vectored_all(os.preadv, fd, bufs, offset)
