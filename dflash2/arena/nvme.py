"""The NVMe tier: one preallocated cache file, batched aligned I/O, zero-copy where buffers allow.

Each block lies at a slot offset (a multiple of ALIGN) given by the block table; its length need
not be a multiple of ALIGN: the rest of its slot's last page is padding. Every written block has a
crc32 recorded in memory; a read whose crc does not match — or of a block never written, or
forgotten — is a miss, never wrong data.

A block whose buffer is page-aligned (address and length multiples of ALIGN, as the views of a
memory arena with 4096-aligned slots are) moves straight between its buffer and the file, several
adjacent blocks per vectored I/O; any other block goes through the staging ring (see staging.py).
One batch may mix both.

Invariants:
- the checksum table is the only truth about what the file holds: it lives in memory only, so a
  restarted daemon sees an empty tier (the file is a cache; no fsync is needed);
- a block's checksum is recorded only after all of its batch's I/O succeeded (or, after a batch
  write failed with EIO, its own write alone did), and dropped before its slot is overwritten;
- a batch I/O that fails with EIO (a bad region of the disk) is done again block by block: only the
  blocks whose own I/O fails are misses (reads) or refused (writes: `write_blocks` says which, and
  the caller never uses those slots again);
- a direct read lands in the caller's buffer before its checksum is known: on a miss those bytes
  are garbage, which the StorageArena contract allows (the caller must not use them).

Memory cost of the table: 8 bytes per ALIGN bytes of capacity (1/512), indexed by offset // ALIGN.

The file starts with one ALIGN-byte header page (HEADER: what the file is) and block offsets count
from the page after it. A file already at the path is reused only when it starts with that header
(or is empty): any other is refused, never overwritten (a mistyped memory.nvme_path must not destroy
data; made or reused at start-up: nvmeprep.py). One cut short while the tier runs is taken back
(nvmecut.py); one removed or replaced is made again (nvmegone.py)."""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from dflash2.arena.base import StorageArena
from dflash2.arena.nvmecut import FileCuts
from dflash2.arena.nvmegone import FileRenewal
from dflash2.arena.nvmeprep import FilePreparation
from dflash2.arena.nvmefiles import HEADER, HEADER_BYTES
from dflash2.arena.shm import address_space_note, mem_available_bytes
from dflash2.arena.staging import (ALIGN, READ_BRIDGE_BYTES, Chunk, Run, StagingRing, crc32_combine, plan_chunks,
                                   plan_runs, pread_all, preadv_all, pwrite_all, pwritev_all)
from dflash2.errors import ArenaError, CapacityError
from dflash2.tiers import Tier
from dflash2.transfer.failures import RepeatLimit

log = logging.getLogger("dflash2.arena.nvme")

MAX_BLOCK_BYTES = (1 << 32) - 1  # lengths are kept as uint32; 0 means "nothing valid here"


def _as_bytes(buf, writable: bool) -> np.ndarray:
    """A 1-D uint8 view of a contiguous buffer (numpy array of any dtype, memoryview, bytes)."""
    if type(buf) is np.ndarray and buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous:
        arr = buf  # the common case (memory arena views): no new view object
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ArenaError("NVMe tier block buffers must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise ArenaError("NVMe tier read destination is read-only")
    return arr


def _open_direct(path: str) -> int:
    """Open the file with O_DIRECT. Raises OSError (EINVAL) where the filesystem refuses it."""
    return os.open(path, os.O_RDWR | os.O_DIRECT)


def _direct_mask(arrays: list[np.ndarray], lens: np.ndarray) -> np.ndarray:
    """Which buffers can move straight to and from the file: page-aligned address and length."""
    addrs = np.fromiter((a.__array_interface__["data"][0] for a in arrays), dtype=np.uint64, count=len(arrays))
    return ((addrs % ALIGN) == 0) & ((lens % ALIGN) == 0)


def _block_crcs(chunk_pieces: list[list[tuple[int, int, int, int]]], nblocks: int) -> np.ndarray:
    """Each block's crc32 from its pieces' (block, start, nbytes, crc), in any order (checksum
    lanes finish out of order): a split block's pieces are combined in byte order."""
    crcs = np.zeros(nblocks, dtype=np.uint32)
    for i, s, n, crc in sorted(p for pieces in chunk_pieces for p in pieces):
        crcs[i] = crc if s == 0 else crc32_combine(int(crcs[i]), crc, n)
    return crcs


READ_LANES = 2  # direct reads in flight at once
CRC_PIECE_BYTES = 1 << 20  # a read's checksums are dealt out over the lanes in pieces this large


def _crc_pieces(pieces: list[tuple[int, int, int]]):
    """(block, start, end) ranges cut to at most CRC_PIECE_BYTES, so that the lanes share the
    checksums of the last run of a batch instead of one lane doing it while the disk idles."""
    for i, s, e in pieces:
        for a in range(s, e, CRC_PIECE_BYTES):
            yield i, a, min(e, a + CRC_PIECE_BYTES)


def _crc_lanes(ring: StagingRing, io_lanes: int) -> int:
    """Checksum lanes beside the I/O lanes: as many as spare cores and workers allow. zlib's crc32
    runs at 2-7 GB/s a core, no faster than a fast disk, so one lane can hold the I/O back."""
    return max(1, min(ring.workers - io_lanes, (os.cpu_count() or 2) - 1))


def _staging_ring(staging_bytes: int) -> StagingRing:
    """The staging ring, its memory taken now: CapacityError (not an OOM kill) when it cannot be had."""
    available = mem_available_bytes()
    if staging_bytes > available:
        raise CapacityError(f"NVMe tier's staging buffer needs {staging_bytes} bytes of memory "
                            f"(memory.staging_buffer_size_mb), only {available} available (MemAvailable)")
    try:
        return StagingRing(staging_bytes)
    except (OSError, RuntimeError) as e:  # (RuntimeError: its workers', threading's "can't start new thread")
        raise CapacityError(f"NVMe tier's staging buffer ({staging_bytes} bytes, memory.staging_buffer_size_mb) "
                            f"and its I/O workers could not be had: {e}{address_space_note()}") from e


def _refuse_failing_disk(path: str, error: OSError) -> None:
    """(The O_DIRECT probe) an I/O error means a failing disk, not a filesystem without O_DIRECT."""
    if error.errno == errno.EIO:
        raise ArenaError(f"NVMe tier: writing the header page of {path} failed with an I/O error ({error}): the "
                         "disk under memory.nvme_path is failing; replace it, or set memory.nvme_capacity_mb "
                         "to 0 to run without the NVMe tier") from error


class NvmeArena(FilePreparation, FileRenewal, StorageArena):
    alignment = ALIGN

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, staging_bytes: int = 64 << 20,
                 tier: Tier = Tier.NVME):
        # A symlink's target is the file (its disk measured, a dangling link's target made). getcwd only for
        # a relative path: a daemon started from a removed working folder crashed on it (a review).
        self._given_path = os.path.join("" if os.path.isabs(path) else os.getcwd(), path)  # (a renewal resolves it)
        self.path = os.path.realpath(self._given_path)
        self.tier = tier
        self.capacity_bytes = int(capacity_bytes)
        if self.capacity_bytes <= 0 or self.capacity_bytes % ALIGN:
            raise ArenaError(f"NVMe tier capacity {capacity_bytes} must be a positive multiple of {ALIGN}")
        self._fd = -1
        self._ring: StagingRing | None = None
        self._lock = threading.Lock()  # one batch at a time owns the staging ring
        self._preallocate()
        try:
            self._ring = _staging_ring(staging_bytes)
            self.staging_bytes = self._ring.nbytes
            self.direct_io = self._open_for_io()
        except BaseException:
            if not self.reused:  # a file this start created goes again (as in _preallocate): its disk space back
                os.unlink(self.path)  # (still locked: nobody else has opened it)
            self.close()
            raise
        nslots = self.capacity_bytes // ALIGN
        self._crc = np.zeros(nslots, dtype=np.uint32)
        self._len = np.zeros(nslots, dtype=np.uint32)
        self._cuts = FileCuts(nslots)  # blocks lost to the file cut short by another process (nvmecut.py)
        self._init_renewal()  # the file removed or replaced under the tier: a new one (nvmegone.py)
        # Batches retried block by block after an I/O error (reads, writes): logged once a minute each way.
        self._partial_failures = RepeatLimit("batches")

    @classmethod
    def create(cls, path: str | os.PathLike, capacity_bytes: int, staging_bytes: int = 64 << 20,
               tier: Tier = Tier.NVME) -> NvmeArena:
        """The same as the constructor; named like SharedMemoryArena.create."""
        return cls(path, capacity_bytes, staging_bytes, tier)

    def _open_for_io(self) -> bool:
        """Use O_DIRECT where an aligned test write succeeds; otherwise buffered I/O, said once. An I/O
        error (EIO) is the disk's, not O_DIRECT's: the tier is refused (ArenaError), where it used to
        fall back to buffered I/O, whose writes the kernel would then fail later and out of sight."""
        try:
            fd = _open_direct(self.path)
        except OSError as e:
            _refuse_failing_disk(self.path, e)
            reason = e
        else:
            try:
                # The test write is the header page itself (the blocks after it hold nothing valid yet).
                self._ring.np[:HEADER_BYTES] = np.frombuffer(HEADER.ljust(HEADER_BYTES, b"\0"), dtype=np.uint8)
                pwrite_all(fd, self._ring.mv[:HEADER_BYTES], 0)
                # _prepare wrote the same page through the page cache: the kernel writes it back
                # before the direct write, and when that fails (EIO) it may do the direct write
                # buffered as well and return success (soak5, ext4 on Linux 6.18): the error
                # shows at the flush only.
                os.fdatasync(fd)
                self._fd = fd
                return True
            except OSError as e:
                os.close(fd)
                _refuse_failing_disk(self.path, e)
                reason = e
        log.warning("O_DIRECT is unavailable on the filesystem of %s (%s); the NVMe tier uses buffered I/O",
                    self.path, reason, extra={"event": "dflash2_fallback", "what": "nvme_io",
                                              "asked": "o_direct", "using": "buffered", "reason": str(reason)})
        self._fd = os.dup(self._lock_fd)
        return False

    # ---- batches --------------------------------------------------------------------------------

    def _check_batch(self, offsets: Sequence[int], bufs: Sequence, writable: bool):
        if len(offsets) != len(bufs):
            raise ArenaError(f"NVMe batch has {len(offsets)} offsets but {len(bufs)} buffers")
        if self._ring is None:
            raise ArenaError(f"NVMe tier at {self.path} is closed")
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        arrays = [_as_bytes(b, writable) for b in bufs]
        lens = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        if len(offs) and (offs.min() < 0 or (offs % ALIGN).any()):
            raise ArenaError(f"NVMe block offsets must be non-negative multiples of {ALIGN}")
        if len(lens) and (lens.min() <= 0 or lens.max() > MAX_BLOCK_BYTES):
            raise ArenaError(f"NVMe block lengths must be between 1 and {MAX_BLOCK_BYTES} bytes")
        extents = (lens + ALIGN - 1) // ALIGN * ALIGN
        order = np.argsort(offs, kind="stable")
        ends = offs[order] + extents[order]
        if len(offs) and ends[-1] > self.capacity_bytes:
            raise ArenaError(f"NVMe block ends at {int(ends[-1])}, past the tier's {self.capacity_bytes} bytes")
        if len(offs) > 1 and (offs[order][1:] < ends[:-1]).any():
            raise ArenaError("NVMe batch has overlapping blocks")
        return offs, arrays, lens, extents, order

    def _open_ring(self) -> StagingRing:
        """The staging ring, under self._lock: a close() that ran since _check_batch makes the
        batch an ArenaError, not an AttributeError halfway through."""
        if self._ring is None:
            raise ArenaError(f"NVMe tier at {self.path} is closed")
        return self._ring

    def _plan(self, arrays, lens, offs, extents, order, bridge: int) -> tuple[list[Run], list[Chunk]]:
        """Direct runs for the page-aligned buffers, staged chunks for the others (`order` sorted)."""
        direct = _direct_mask(arrays, lens)[order]
        runs = plan_runs(order[direct], offs, lens)
        chunks = plan_chunks(order[~direct], offs, extents, self._ring.slot_bytes, bridge=bridge)
        return runs, chunks

    def write_blocks(self, offsets: Sequence[int], sources: Sequence) -> np.ndarray:
        offs, srcs, lens, extents, order = self._check_batch(offsets, sources, writable=False)
        if not len(offs):
            return np.ones(0, dtype=bool)
        idx = offs // ALIGN
        with self._lock:
            ring = self._open_ring()
            self._check_file(write=True)

            def fill_and_write(chunk: Chunk, base: int) -> list[tuple[int, int, int, int]]:
                crcs = []
                for i, s, e, b in chunk.pieces:
                    n = int(lens[i])
                    d = min(e, n)
                    if d > s:
                        dst = ring.np[base + b:base + b + d - s]
                        dst[:] = srcs[i][s:d]
                        crcs.append((i, s, d - s, zlib.crc32(dst)))
                    if e > max(s, n):  # the slot's padding: zeros, never a previous block's bytes
                        ring.np[base + b + max(s, n) - s:base + b + e - s] = 0
                for f, b, n in chunk.ios:
                    pwrite_all(self._fd, ring.mv[base + b:base + b + n], f)
                return crcs

            def write_lane(lane: list[Run]) -> list:
                for run in lane:  # one I/O at a time, in file order: what the disk does best
                    pwritev_all(self._fd, [srcs[i][s:e] for i, s, e in run.pieces], run.offset)
                return []

            def crc_lane(lane: list[Run]) -> list[tuple[int, int, int, int]]:
                return [(i, s, e - s, zlib.crc32(srcs[i][s:e])) for run in lane for i, s, e in run.pieces]

            self._len[idx] = 0  # these slots are being overwritten: their old bytes are gone
            self._cuts.lost[idx] = False
            runs, chunks = self._plan(srcs, lens, offs + HEADER_BYTES, extents, order, bridge=0)
            # Direct runs: a write needs no checksum first, so the checksums run beside the writes,
            # on the other cores (the runs dealt out over the checksum lanes), rather than in front
            # of or behind each write.
            lanes = _crc_lanes(ring, 1)
            tasks = ([functools.partial(write_lane, runs)]
                     + [functools.partial(crc_lane, runs[j::lanes]) for j in range(lanes)]) if runs else []
            try:
                pieces = ring.run(chunks, fill_and_write, tasks)
            except OSError as e:
                if e.errno != errno.EIO:  # a full disk (ENOSPC) and the rest: no slot is to blame
                    raise ArenaError(f"NVMe tier write to {self.path} failed: {e}") from e
                # A bad region (EIO) fails the batch's I/O, not its other blocks: each is written
                # again alone, and only the slots that still fail are refused (the caller sets them
                # aside: a slot handed out again would fail the next batch the same way).
                return self._write_each(ring, e, offs, srcs, lens)
            self._crc[idx] = _block_crcs(pieces, len(offs))
            self._len[idx] = lens
        return np.ones(len(offs), dtype=bool)

    def _write_each(self, ring: StagingRing, error: OSError, offs: np.ndarray, srcs: list[np.ndarray],
                    lens: np.ndarray) -> np.ndarray:
        """After a batch write failed with EIO: each block written again by itself; the mask of
        those written. Their checksums are recorded only once every block was tried: an error other
        than EIO on the way fails the whole batch (ArenaError), none of it counting as written."""
        crcs = np.zeros(len(offs), dtype=np.uint32)
        ok = np.zeros(len(offs), dtype=bool)
        for i in range(len(offs)):
            try:
                crcs[i] = self._write_alone(ring, int(offs[i]), srcs[i], int(lens[i]))
                ok[i] = True
            except OSError as e:
                if e.errno != errno.EIO:
                    raise ArenaError(f"NVMe tier write to {self.path} failed: {error}; written again block by "
                                     f"block: {e}") from e
        idx = offs[ok] // ALIGN
        self._crc[idx] = crcs[ok]
        self._len[idx] = lens[ok]
        more = self._partial_failures.due("write", blocks=len(offs) - int(ok.sum()))
        if more is not None:
            log.warning("NVMe tier write to %s failed (%s): its %d blocks were written again one by one, %d of "
                        "them unwritable (their slots are set aside)%s", self.path, error, len(offs),
                        len(offs) - int(ok.sum()), more)
        return ok

    def _write_alone(self, ring: StagingRing, offset: int, src: np.ndarray, n: int) -> int:
        """One block written by itself through the ring's first slot (the ring is quiet: its batch
        failed), through the batch's file descriptor (O_DIRECT where the tier uses it), its slot's
        padding zeros: its crc32. An I/O error raises OSError."""
        crc, pos, end = 0, 0, (n + ALIGN - 1) // ALIGN * ALIGN
        while pos < end:
            m = min(ring.slot_bytes, end - pos)
            d = max(0, min(m, n - pos))
            if d:
                ring.np[:d] = src[pos:pos + d]
                crc = zlib.crc32(ring.np[:d], crc)
            ring.np[d:m] = 0
            pwrite_all(self._fd, ring.mv[:m], HEADER_BYTES + offset + pos)
            pos += m
        return crc

    def read_blocks(self, offsets: Sequence[int], dests: Sequence) -> np.ndarray:
        offs, dsts, lens, extents, order = self._check_batch(offsets, dests, writable=True)
        ok = np.zeros(len(offs), dtype=bool)
        if not len(offs):
            return ok
        idx = offs // ALIGN
        with self._lock:
            ring = self._open_ring()
            self._check_file()
            known = self._len[idx] == lens  # never written, forgotten or another length: a miss
            want = order[known[order]]
            if not len(want):
                return ok
            expected = self._crc[idx]

            def read_and_drain(chunk: Chunk, base: int) -> list[tuple[int, int, int, int]]:
                for f, b, n in chunk.ios:
                    pread_all(self._fd, ring.mv[base + b:base + b + n], f)
                crcs = []
                for i, s, e, b in chunk.pieces:
                    d = min(e, int(lens[i]))
                    if d > s:
                        src = ring.np[base + b:base + b + d - s]
                        crcs.append((i, s, d - s, zlib.crc32(src)))
                        dsts[i][s:d] = src
                return crcs

            runs, chunks = self._plan(dsts, lens, offs + HEADER_BYTES, extents, want, bridge=READ_BRIDGE_BYTES)
            # Direct runs: READ_LANES lanes read them (lane r takes runs r, r + READ_LANES, ... in
            # file order), the checksum lanes take each run's pieces as soon as they have landed.
            landed: queue.SimpleQueue = queue.SimpleQueue()
            readers = min(READ_LANES, len(runs))
            checkers = _crc_lanes(ring, readers)
            readers_done = 0
            done_lock = threading.Lock()

            def read_lane(mine: list[Run]) -> list:
                nonlocal readers_done
                try:
                    for run in mine:
                        preadv_all(self._fd, [dsts[i][s:e] for i, s, e in run.pieces], run.offset)
                        for piece in _crc_pieces(run.pieces):
                            landed.put(piece)
                finally:
                    with done_lock:
                        readers_done += 1
                        last = readers_done == readers
                    if last:  # every reader is done, or failed: no checksum lane may wait forever
                        for _ in range(checkers):
                            landed.put(None)
                return []

            def crc_lane() -> list[tuple[int, int, int, int]]:
                out = []
                while (piece := landed.get()) is not None:
                    i, s, e = piece
                    out.append((i, s, e - s, zlib.crc32(dsts[i][s:e])))
                return out

            # The read lanes are queued first, so they hold workers before a checksum lane waits.
            tasks = ([functools.partial(read_lane, runs[r::readers]) for r in range(readers)]
                     + [crc_lane] * checkers) if runs else []
            try:
                pieces = ring.run(chunks, read_and_drain, tasks)
            except OSError as e:
                # An unreadable extent (a bad sector: EIO) fails the batch's I/O, not its other
                # blocks: each is read again alone, and only those that still fail are misses. A
                # batch none of whose blocks can be read (a dead disk) raises as before.
                for i in want.tolist():
                    ok[i] = self._read_alone(ring, int(offs[i]), dsts[i], int(lens[i]), int(expected[i]))
                if not ok.any():
                    raise ArenaError(f"NVMe tier read from {self.path} failed: {e}") from e
                self._read_failed(e, len(want) - int(ok.sum()), len(want))
                return ok
        ok[want] = _block_crcs(pieces, len(offs))[want] == expected[want]
        return ok

    def _read_alone(self, ring: StagingRing, offset: int, dst: np.ndarray, n: int, expected: int) -> bool:
        """One block read by itself through the ring's first slot (the ring is quiet: its batch
        failed): whether its bytes could be read and match their checksum."""
        crc, pos, end = 0, 0, (n + ALIGN - 1) // ALIGN * ALIGN
        try:
            while pos < end:
                m = min(ring.slot_bytes, end - pos)
                pread_all(self._fd, ring.mv[:m], HEADER_BYTES + offset + pos)
                d = min(m, n - pos)
                if d > 0:
                    crc = zlib.crc32(ring.np[:d], crc)
                    dst[pos:pos + d] = ring.np[:d]
                pos += m
        except OSError:
            return False
        return crc == expected

    def lost_to_cut(self, offsets: Sequence[int]) -> np.ndarray:
        """Whether each block's slot lost its block to the file cut short (a miss that blames no slot)."""
        return self._cuts.lost[np.asarray(offsets, dtype=np.int64) // ALIGN]

    def _read_failed(self, error: OSError, unreadable: int, blocks: int) -> None:
        """Log a batch read that failed in part, once a minute with the count left out."""
        more = self._partial_failures.due("read", blocks=unreadable)
        if more is not None:
            log.warning("NVMe tier read from %s failed (%s): its %d blocks were read again one by one, %d of them "
                        "unreadable (misses)%s", self.path, error, blocks, unreadable, more)

    def forget(self, offsets: Sequence[int]) -> None:
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if len(offs) and (offs.min() < 0 or offs.max() >= self.capacity_bytes or (offs % ALIGN).any()):
            raise ArenaError(f"NVMe forget: offsets must be multiples of {ALIGN} inside the tier")
        # Not under self._lock, which a batch holds for the whole of its I/O: every free or eviction
        # of an NVMe slot on the serving thread (a commit deduplicating onto a twin there, a free,
        # a dropped block) waited for the disk, outside any settle or parking (a batch of 1 s writes
        # held a commit 950 ms). A slot forgotten is never one of a batch in flight (the move holds
        # its slots until it ends), and batches read and write only their own slots' entries: one
        # store into entries nobody else touches.
        self._len[offs // ALIGN] = 0
        self._cuts.lost[offs // ALIGN] = False

    def test_slots(self, offsets: Sequence[int], patterns: Sequence[np.ndarray]) -> np.ndarray:
        """The re-test's I/O (quarantine.py), slot by slot, through a duplicate of the tier's file
        descriptor and a buffer of its own: never under self._lock. soak9: through write_blocks and
        read_blocks it held the lock for a failed batch write and 16 more, one per slot; the serving
        thread's forget (every free or eviction of an NVMe slot) and the transfer thread's batches
        waited for each of a slow bad region's answers. The slots are set aside: nobody else writes
        or reads them, and they hold no checksum (their failed writes dropped it)."""
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if len(offs) != len(patterns):
            raise ArenaError(f"NVMe re-test has {len(offs)} offsets but {len(patterns)} patterns")
        lens = np.fromiter((p.size for p in patterns), dtype=np.int64, count=len(patterns))
        ext = (lens + ALIGN - 1) // ALIGN * ALIGN
        if len(offs) and (offs.min() < 0 or (offs % ALIGN).any() or (offs + ext).max() > self.capacity_bytes):
            raise ArenaError(f"NVMe re-test: offsets must be multiples of {ALIGN} inside the tier")
        sound = np.zeros(len(offs), dtype=bool)
        if not len(offs):
            return sound
        with self._lock:
            self._open_ring()
            self._check_file(write=True, cut=False)  # (a removed file: its slots re-tested in the new one)
            fd = os.dup(self._fd)  # a close() meanwhile leaves this one open (never another file's number)
        buf = mmap.mmap(-1, int(ext.max()))  # page-aligned: O_DIRECT takes it
        mv = memoryview(buf)
        a = np.frombuffer(buf, dtype=np.uint8)
        try:
            for i, (off, pat) in enumerate(zip(offs.tolist(), patterns)):
                n, e = int(lens[i]), int(ext[i])
                a[:n] = pat.reshape(-1).view(np.uint8)
                a[n:e] = 0
                try:
                    pwrite_all(fd, mv[:e], HEADER_BYTES + off)
                    a[:e] = 0xFF ^ a[:e]  # what was written must come back from the disk, not stay here
                    pread_all(fd, mv[:e], HEADER_BYTES + off)
                except OSError as err:
                    if err.errno != errno.EIO:  # a full disk and the rest: no slot is to blame
                        raise ArenaError(f"NVMe tier re-test at {self.path} failed: {err}") from err
                    continue
                sound[i] = np.array_equal(a[:n], pat.reshape(-1).view(np.uint8))
        finally:
            del a
            mv.release()
            buf.close()
            os.close(fd)
        return sound

    # ---- tests and life cycle -------------------------------------------------------------------

    def corrupt_for_test(self, offset: int) -> None:
        """Flip the first byte of the block at `offset` on disk (through the same I/O path), so that
        tests can prove a checksum mismatch reads as a miss."""
        with self._lock:
            page = self._ring.mv[:ALIGN]
            pread_all(self._fd, page, HEADER_BYTES + offset)
            page[0] ^= 0xFF
            pwrite_all(self._fd, page, HEADER_BYTES + offset)

    def describe(self) -> dict:
        return {**super().describe(), "kind": "nvme", "path": self.path, "direct_io": self.direct_io,
                "staging_bytes": self.staging_bytes, "no_file": self.no_file}

    def close(self) -> None:
        """Close the file (it stays on disk: a cache file) and free the staging ring. Idempotent."""
        with self._lock:
            if self._ring is not None and hasattr(self, "_cuts"):  # (not as a failed __init__ closes)
                try:  # (a cut since the last batch: the next start would refuse the file)
                    self._check_file(renew=False)
                except OSError as e:
                    log.warning("NVMe: cannot look at %s as the tier closes: %s", self.path, e)
                self._ring.close()
                self._ring = None
            self._close_files()

    def remove(self) -> None:
        """Close and delete the cache file (tests, benches)."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
