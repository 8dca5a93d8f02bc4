"""`dflash2 bench nvme`: the NVMe tier's batched block I/O against raw sequential O_DIRECT I/O.

Both run in the same process on the same filesystem (a scratch folder under --dir, removed after):
raw = sequential pwrite/pread of up to 8 MiB each of --size-mb into a preallocated file, cycling
through a memory buffer as large as one tier batch (--batch × --block-kb, at least 8 MiB; or exactly
--raw-buffer-mb; `raw_buffer_mb`), so that
both sides move the same memory footprint — on a VM whose disk path copies through the host, an
8 MiB buffer that stays in the CPU cache writes ~25% faster than any real batch of blocks can
(--raw-buffer-mb 8 gives that figure) — and of the same kind, a shared-memory segment like the DRAM
tier's (--raw-memory anon: an anonymous mapping, which ran raw I/O 5-10% faster on the 2-core
development VM); tier = write_blocks /
read_blocks of the same bytes as --block-kb blocks in batches of --batch, at sequential slot offsets
(as the block table hands them out on a fresh tier), with checksums — the same public calls that the
host transfer backend makes. Sources and destinations are views into a SharedMemoryArena (the DRAM
tier) at 4096-aligned slot offsets, as the block manager hands them out, so the tier takes its
zero-copy path (`"aligned_sources": true`); with --unaligned every view is shifted by 64 bytes, which
measures the staging path instead. Each source's first 8 bytes hold the index of the block it is
written to, stamped before each batch's write, so every block on disk differs from the others. In the
last round each tier batch's destinations are zeroed before its read and compared with the sources
(stamped for that batch) after it, outside the timed calls (`"verified"`).
Phases alternate (raw write, tier write, raw read, tier read; odd rounds run the tier first, since
a virtual disk that writes back through its host's page cache slows whichever side writes right
after the other) so that drift of a shared disk hits both sides alike; with --repeat N the best of
N rounds counts for each phase. Where the filesystem refuses O_DIRECT both sides use buffered I/O,
the page cache is dropped before reading, and the JSON says `"direct_io": false`.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import tempfile
import time

import numpy as np

from dflash2 import stopsignals
from dflash2.arena import nvme as nvme_arena
from dflash2.arena.nvme import NvmeArena
from dflash2.arena.shm import SharedMemoryArena
from dflash2.arena.staging import pread_all, pwrite_all
from dflash2.bench import OptionError, non_negative_int, positive_int
from dflash2.errors import CapacityError
from dflash2.tiers import Tier

RAW_IO_BYTES = 8 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=positive_int, default=2048, help="bytes moved in each phase (MiB; default %(default)s)")
    parser.add_argument("--dir", default=".", help="folder on the filesystem to measure (default: cwd)")
    parser.add_argument("--block-kb", type=positive_int, default=1024, help="block size of the tier phases (KiB; default %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=64, help="blocks per write_blocks/read_blocks call (default %(default)s)")
    parser.add_argument("--staging-mb", type=positive_int, default=64, help="the tier's staging buffer (MiB; default %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="rounds of the four phases; the best of each counts (default %(default)s)")
    parser.add_argument("--raw-buffer-mb", type=non_negative_int, default=0,
                        help="memory the raw phases cycle through (MiB); default: one tier batch")
    parser.add_argument("--raw-memory", choices=("shm", "anon"), default="shm",
                        help="memory the raw phases move: a shared-memory segment like the DRAM tier "
                             "the tier phases move (default), or an anonymous mapping")
    parser.add_argument("--unaligned", action="store_true",
                        help="shift the DRAM views off page alignment (measures the staging path)")


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _drop_cache(path: str) -> None:
    """Buffered I/O only: write back and drop the file's pages, so reads come from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Raw:
    def __init__(self, path: str, size: int, direct: bool, buffer_bytes: int, memory: str):
        self.size = size
        self.fd = os.open(path, os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0), 0o600)
        # Exactly the memory asked for (rounded up to O_DIRECT's 4 KiB), never rounded to whole raw
        # I/Os: the raw side cycles through as much memory as the tier side does.
        self.nbytes = -(-buffer_bytes // 4096) * 4096
        self.shm = self.buf = None
        try:  # (what was made is let go of on any failure, Ctrl-C among them: the segment was left)
            os.posix_fallocate(self.fd, 0, size)
            if memory == "shm":  # the kind of memory the tier moves: a DRAM-tier shared-memory segment
                try:
                    self.shm = SharedMemoryArena.create(f"dflash2-bench-raw-{os.getpid()}", self.nbytes, Tier.DRAM,
                                                        alignment=nvme_arena.ALIGN)
                except CapacityError as e:  # (it named a "dram tier", no option: a review)
                    raise CapacityError(f"--raw-buffer-mb: {e} (--raw-memory shm)") from None
                self.buf = self.shm.view(0, self.nbytes)
            else:
                try:
                    self.buf = mmap.mmap(-1, self.nbytes)
                except OSError as e:  # (ENOMEM: a traceback, where shm's was an option error)
                    raise CapacityError(f"--raw-buffer-mb: cannot map {self.nbytes} bytes of anonymous memory "
                                        f"(--raw-memory anon): {e.strerror or e}") from None
            rng, view = np.random.default_rng(1), np.frombuffer(self.buf, dtype=np.uint8)
            for at in range(0, self.nbytes, 64 << 20):  # (in pieces: two whole copies in memory before)
                view[at: at + (64 << 20)] = rng.integers(0, 256, min(64 << 20, self.nbytes - at), dtype=np.uint8)
            del view
        except BaseException:
            self.close()
            raise

    def _ios(self):
        """Sequential I/Os of at most RAW_IO_BYTES, each from the buffer's next bytes (one that would
        run past the buffer's end stops there; the next starts again at its beginning)."""
        mv = memoryview(self.buf)
        off = 0
        while off < self.size:
            b = off % self.nbytes
            n = min(RAW_IO_BYTES, self.size - off, self.nbytes - b)
            yield mv[b:b + n], off
            off += n

    def write(self) -> float:
        t = time.perf_counter()
        for buf, off in self._ios():
            pwrite_all(self.fd, buf, off)
        return time.perf_counter() - t

    def read(self) -> float:
        t = time.perf_counter()
        for buf, off in self._ios():
            pread_all(self.fd, buf, off)
        return time.perf_counter() - t

    def close(self) -> None:
        os.close(self.fd)
        if self.shm is None:
            if self.buf is not None:
                self.buf.close()
        else:
            self.buf = None
            self.shm.close()


UNALIGNED_SHIFT = 64


# The daemon's keys the NVMe arena's messages name (a file size limit's: the file's size; the staging
# buffer's), and this bench's options for them: a message naming one is put on that option (told to
# lower the daemon's keys, its user was, two reviews); any other (the file's disk room) as it is.
OPTION_OF_KEY = {"memory.nvme_capacity_mb": "--size-mb", "memory.staging_buffer_size_mb": "--staging-mb"}


class _Tier:
    def __init__(self, path: str, size: int, block: int, batch: int, staging: int, aligned: bool):
        try:
            self.arena = NvmeArena(path, size, staging_bytes=staging)
        except CapacityError as e:
            given = {"--size-mb": size >> 20, "--staging-mb": staging >> 20}
            for key, option in OPTION_OF_KEY.items():
                if key in str(e):
                    raise CapacityError(f"{option} {given[option]}: {str(e).replace(key, option)}") from None
            raise
        self.block, self.batch = block, batch
        self.offsets = np.arange(0, size - block + 1, block, dtype=np.int64)
        # One batch of distinct source blocks (reused for every batch, stamped with each block's
        # index: _stamp) and one of destinations, as views into a DRAM-tier arena: slots of `stride`
        # bytes from 4096-aligned offsets.
        shift, stride = (0, block) if aligned else (UNALIGNED_SHIFT, block + nvme_arena.ALIGN)
        self.dram, self.srcs, self.dsts = None, [], []
        try:  # (what was made is let go of on any failure, Ctrl-C among them: the segment was left)
            try:
                self.dram = SharedMemoryArena.create(f"dflash2-bench-nvme-{os.getpid()}", 2 * batch * stride,
                                                     Tier.DRAM, alignment=nvme_arena.ALIGN)
            except CapacityError as e:  # (it named a "dram tier" and its capacity, no option: a review)
                raise CapacityError(f"--batch {batch} of --block-kb {block >> 10} (a batch of sources and one of "
                                    f"destinations): {e}") from None
            self.srcs = [self.dram.view(k * stride + shift, block) for k in range(batch)]
            self.dsts = [self.dram.view((batch + k) * stride + shift, block) for k in range(batch)]
            rng = np.random.default_rng(2)
            for v in self.srcs:
                v[:] = rng.integers(0, 256, block, dtype=np.uint8)
        except BaseException:
            self.close()
            raise
        self.misses = 0
        self.verified = True  # (until a checked read's batch differs from its sources)

    def _batches(self):
        for k in range(0, len(self.offsets), self.batch):
            offs = self.offsets[k:k + self.batch]
            yield offs, len(offs)

    def _stamp(self, offs, n: int) -> None:
        """Each source's first 8 bytes := the index of the block it goes to (or is compared with), so
        block k's bytes on disk are its own: every batch writes the same sources, and a read_blocks
        that returned another batch's blocks passed `verified` (a review)."""
        for s, off in zip(self.srcs[:n], offs):
            s[:8] = np.frombuffer(int(off // self.block).to_bytes(8, "little"), dtype=np.uint8)

    def write(self) -> float:
        """The write_blocks calls' time; the stamping lies between them, outside it (as read's check)."""
        spent = 0.0
        for offs, n in self._batches():
            self._stamp(offs, n)
            t = time.perf_counter()
            self.arena.write_blocks(offs, self.srcs[:n])
            spent += time.perf_counter() - t
        return spent

    def read(self, check: bool = False) -> float:
        """The read_blocks calls' time. With `check` (the last round) every batch's destinations are
        zeroed before its read and compared with the sources after it, so `verified` says what each
        of that round's reads delivered: every batch reads into the same views, and a check of the
        last batch alone passed once any read had landed (a review: reads that copied nothing after
        the first batch said "verified": true). The sources are stamped with the batch's block
        indexes again before it, as write stamped them. The check's work lies between the timed
        calls, outside them; every round times the calls alone, so rounds compare alike."""
        spent = 0.0
        for offs, n in self._batches():
            if check:
                self._stamp(offs, n)
                for d in self.dsts[:n]:
                    d[:] = 0
            t = time.perf_counter()
            ok = self.arena.read_blocks(offs, self.dsts[:n])
            spent += time.perf_counter() - t
            self.misses += int(n - ok.sum())
            if check:
                self.verified = self.verified and all(
                    np.array_equal(s, d) for s, d in zip(self.srcs[:n], self.dsts[:n]))
        return spent

    def close(self) -> None:
        self.arena.close()
        self.srcs = self.dsts = []
        if self.dram is not None:
            self.dram.close()


def _scratch_folder(where: str, nbytes: int) -> str:
    """A new folder under `where` with room for `nbytes` (the tier's file and the raw one)."""
    try:
        free = shutil.disk_usage(where).free
        if free < nbytes:
            raise OptionError(f"--dir {where}: {free >> 20} MiB free, the bench needs {nbytes >> 20} "
                              "MiB (two files of --size-mb)")
        return tempfile.mkdtemp(prefix=".dflash2-bench-nvme-", dir=os.path.abspath(where))
    except OSError as exc:
        raise OptionError(f"--dir {where}: cannot make a scratch folder there: {exc.strerror}") from None


def run(args: argparse.Namespace) -> dict:
    size = args.size_mb << 20
    block = args.block_kb << 10
    if block % nvme_arena.ALIGN or block > size:
        raise OptionError(f"--block-kb {args.block_kb} must be a multiple of 4 and at most --size-mb")
    # No more blocks a batch than the run moves: the buffers are a batch each (a --batch of 100,000
    # took 20 GB of /dev/shm to move 16 MiB, and the OOM killer ended the run with it left there).
    batch = min(args.batch, size // block)
    folder = _scratch_folder(args.dir, 2 * size)
    raw = tier = None
    try:
        try:
            tier = _Tier(os.path.join(folder, "tier.bin"), size, block, batch, args.staging_mb << 20,
                         aligned=not args.unaligned)
            direct = tier.arena.direct_io
            raw = _Raw(os.path.join(folder, "raw.bin"), size, direct,
                       (args.raw_buffer_mb << 20) or max(RAW_IO_BYTES, batch * block), args.raw_memory)
        except CapacityError as e:  # (memory the options ask for and this machine lacks: a traceback before)
            raise OptionError(str(e)) from None
        raw_w = tier_w = raw_r = tier_r = float("inf")
        for k in range(args.repeat):
            # Odd rounds run the tier first: a virtual disk that writes back through its host's page
            # cache slows whichever side writes right after the other.
            first, second = (raw, tier) if k % 2 == 0 else (tier, raw)
            times = {first: [first.write()], second: [second.write()]}
            if not direct:
                _drop_cache(os.path.join(folder, "raw.bin"))
                _drop_cache(tier.arena.path)
            last = k == args.repeat - 1  # (the tier's reads of the last round are checked: `verified`)
            times[first].append(first.read(last) if first is tier else first.read())
            times[second].append(second.read(last) if second is tier else second.read())
            raw_w, raw_r = min(raw_w, times[raw][0]), min(raw_r, times[raw][1])
            tier_w, tier_r = min(tier_w, times[tier][0]), min(tier_r, times[tier][1])
        moved = len(tier.offsets) * block
        return {
            "tier_write_gbps": _gbps(moved, tier_w),
            "raw_write_gbps": _gbps(size, raw_w),
            "tier_read_gbps": _gbps(moved, tier_r),
            "raw_read_gbps": _gbps(size, raw_r),
            "write_ratio": round((moved / tier_w) / (size / raw_w), 3),
            "read_ratio": round((moved / tier_r) / (size / raw_r), 3),
            "tier_read_misses": tier.misses,
            "verified": tier.verified,
            "aligned_sources": not args.unaligned,
            "raw_buffer_mb": round(raw.nbytes / (1 << 20), 3),
            "raw_memory": args.raw_memory,
            "size_mb": args.size_mb,
            "block_kb": args.block_kb,
            "batch": batch,
            "staging_mb": args.staging_mb,
            "repeat": args.repeat,
            "direct_io": direct,
            "path": folder,
        }
    finally:
        with stopsignals.uninterrupted():
            if raw is not None:
                raw.close()
            if tier is not None:
                tier.close()
            shutil.rmtree(folder, ignore_errors=True)
