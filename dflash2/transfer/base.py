"""The transfer-backend interface: moves a batch of blocks between two tier arenas.

The mover (mechanism, in dflash2/mover.py) does the two-phase bookkeeping in the block table:
prepare marks the blocks MIGRATING and allocates destination slots, then asks a backend to `start`
the copy, then `wait`s and completes each block with success or failure (a failed block stays where
it was). A backend only copies bytes: it never touches the block table.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from dflash2.tiers import Tier


@dataclasses.dataclass(frozen=True)
class CopyBatch:
    """One batch move: block i goes from src_offsets[i] in the src arena to dst_offsets[i] in the dst
    arena and is nbytes[i] long. Arrays are int64 and of equal length."""

    src_tier: Tier
    dst_tier: Tier
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.src_offsets)
        if len(self.dst_offsets) != n or len(self.nbytes) != n:
            raise ValueError("CopyBatch arrays must have equal lengths")
        if self.src_tier == self.dst_tier:
            raise ValueError(f"CopyBatch from {self.src_tier.label} to itself")

    def __len__(self) -> int:
        return len(self.src_offsets)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


class CopyJob(abc.ABC):
    """A started copy. `wait` returns a bool array: True where the block's bytes arrived intact.
    After `wait`, `seconds` is how long the copy itself took by the backend's own measure (the
    device's events, the copying thread's clock), not counting the time it queued behind other
    copies; None where the backend did not time it."""

    batch: CopyBatch
    seconds: float | None = None
    # After `wait`, for a batch into a storage tier: the mask of the blocks whose destination slot
    # could not be written by itself (an I/O error there, EIO: StorageArena.write_blocks), which the
    # mover sets aside for good (dflash2/quarantine.py); those blocks failed too. None: no slot is
    # to blame (a batch that failed as a whole, ENOSPC; or one into memory).
    unwritable: np.ndarray | None = None
    # After `wait`, for a batch out of a storage tier: the mask of the blocks the storage could not
    # read (a checksum mismatch, an I/O error, a read that raised as a whole), which the mover drops
    # from the cache (a miss) and whose slots it suspects (quarantine.py). A block that failed after
    # its read (the copy on from the staging buffer: a refused GPU launch) stays where it was, its
    # slot sound: such a failure was blamed on the disk, its blocks dropped (a review). None: the
    # backend does not tell them apart, and every failed block of the read counts as unreadable.
    unreadable: np.ndarray | None = None
    # After `wait`, for a read in chunks (the CUDA backend's staged moves): the blocks never read, the
    # batch having ended before their chunk; they stay where they were, and are said not read (the
    # mover said "after the disk read them" of them, a review). None: every block was tried.
    not_read: np.ndarray | None = None

    @abc.abstractmethod
    def done(self) -> bool:
        """True when `wait` would not block."""

    @abc.abstractmethod
    def wait(self) -> np.ndarray:
        """Block until the copy finishes; per-block success. Never raises for a per-block failure."""


class TransferBackend(abc.ABC):
    # The largest block this backend can move between every pair of its tiers (None: any size). A
    # layout with larger blocks is refused when it is registered, not when its first move fails.
    max_block_bytes: int | None = None
    # Why this backend can never move anything again (a GPU whose CUDA context is lost: an illegal
    # address, an uncorrectable ECC error, a GPU fallen off the bus), else None. The daemon exits on it.
    fatal: str | None = None

    @abc.abstractmethod
    def start(self, batch: CopyBatch) -> CopyJob:
        """Begin copying a batch. The source bytes must stay untouched until the job is waited for."""

    def copy_batches(self) -> dict[str, dict[str, int]]:
        """Batches started so far by direction ("hbm->dram") and mechanism ("kernel", "engines"):
        how a GPU backend moved HBM<->DRAM batches. Empty where there is one way only (host copies)."""
        return {}

    def check_gpu(self, error: BaseException) -> None:
        """After a CUDA error outside a copy: whether this backend's GPU is lost (then `fatal` says
        so). Nothing to check where there is no GPU."""

    def close(self) -> None:
        """Release streams, threads and buffers."""
