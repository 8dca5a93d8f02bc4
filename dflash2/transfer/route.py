"""Which GPU mechanism moves an HBM<->DRAM batch: the copy kernel (on the multiprocessors) or the
copy engines (cuMemcpyBatchAsync). Policy only: no CUDA here, so it is tested on a CPU.

Measured on an H200 (PCIe Gen5, batches of 1024 scattered blocks, `.exp`-style runs of four
batches in flight; GB/s):

| block  | kernel d2h | engines d2h | kernel h2d | engines h2d | kernels both ways | engines both ways |
| 16 KiB | 49.8       | 27-32       | 48.4       | 4-11        | 66.5              | 8                 |
| 64 KiB | 51.8       | 48.5        | 50.5       | 54.3        | 75.0              | 93.4              |

So copies under 64 KiB always take the kernel; from 64 KiB the engines take the host-to-device
direction, the device-to-host direction from 128 KiB, and both directions whenever the other one
has a batch in flight: multiprocessor loads and stores of host memory travel in small PCIe packets,
so two kernels share the link's two directions poorly, while the engines fill both. A kernel one way
with the engines the other way is worse still (55 GB/s at 64 KiB), but passes: once one direction
runs on the engines, every later batch of the other finds it busy and takes them too. To keep a
short lull from sending one batch back to the kernel (and into that mix), the other direction counts
as busy for DUPLEX_HOLD_S after it last started a batch: a mover swapping both ways starts batches of
both within milliseconds; one moving one way has not started the other for much longer.

A batch that mixes sizes (two layouts, or runs of neighbouring blocks coalesced into one copy) is
split: copies of 256 KiB or more take the engines and the others, all under 64 KiB, the kernel,
one after the other on the direction's stream. Measured on a two-GPU H200 host (batches alternating
two sizes; fraction of the contiguous copy d2h / h2d / both ways; split against the whole batch on
the kernel, where its smallest copy sends it; two or three runs each, alternated in one process):
16+256 KiB 0.94-0.95 / 0.97-0.98 / 0.75-0.76 against 0.93-0.94 / 0.91-0.92 / 0.75-0.79;
16+1024 KiB 0.99 / 0.98-0.99 / 0.81-0.84 against 0.94-0.95 / 0.92 / 0.77-0.81. Splitting a mix
whose small copies the engines could take as well did worse both ways: 64+256 KiB 0.57-0.60 (whole,
on the engines but for a batch whose other direction was idle: 0.83-0.86), 16+64 KiB 0.60-0.62
(whole 0.65-0.71); such a batch goes whole where its smallest copy goes.
"""

from __future__ import annotations

import enum

import numpy as np

KIB = 1024

KERNEL_MAX_BLOCK = 64 * KIB  # below this the engines lose in every case measured
ENGINE_MIN_BLOCK_D2H = 128 * KIB  # the other direction idle, device to host
ENGINE_MIN_BLOCK_H2D = 64 * KIB  # the other direction idle, host to device
SPLIT_MIN_BLOCK = 256 * KIB  # the smallest copy that leaves a mixed batch for the engines
SORT_MIN_BYTES = 64 * KIB  # copies a batch of which `coalesce` takes in their sources' order
DUPLEX_HOLD_S = 0.005  # about four 1024-block batches of 64 KiB; the bench's lull between rounds is ~1 ms


class Mechanism(enum.Enum):
    KERNEL = "kernel"
    ENGINES = "engines"


def other_busy(in_flight: bool, seconds_since_start: float | None) -> bool:
    """Whether the other direction counts as busy: a batch in flight, or one started within
    DUPLEX_HOLD_S (None: it never started one)."""
    return in_flight or (seconds_since_start is not None and seconds_since_start < DUPLEX_HOLD_S)


def choose(block: int, to_host: bool, other_direction_busy: bool, engines_available: bool = True) -> Mechanism:
    """The mechanism for one copy of `block` bytes, going device to host when `to_host`;
    `other_direction_busy`: what `other_busy` says of the other direction."""
    if block < 0:
        raise ValueError(f"block size must be >= 0, got {block}")
    if other_direction_busy:
        threshold = KERNEL_MAX_BLOCK
    else:
        threshold = max(KERNEL_MAX_BLOCK, ENGINE_MIN_BLOCK_D2H if to_host else ENGINE_MIN_BLOCK_H2D)
    return Mechanism.ENGINES if engines_available and block >= threshold else Mechanism.KERNEL


def split(nbytes: np.ndarray, to_host: bool, other_direction_busy: bool,
          engines_available: bool = True) -> np.ndarray:
    """Which copies of a batch the engines take (a mask; the kernel takes the rest). A batch whose
    every copy `choose` sends to the engines goes there whole. Otherwise the engines take only its
    copies of SPLIT_MIN_BLOCK or more, and only when every other copy is one that the kernel always
    moves (under KERNEL_MAX_BLOCK): a batch of a 16 KiB layout's blocks and of another layout's
    large ones (or of runs of neighbouring blocks, coalesced into one large copy). A mix with copies
    of 64-255 KiB goes whole where its smallest copy goes: split, it moved both ways at 0.57-0.62
    of the link against 0.65-0.86 whole (measured; module docstring)."""
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if not len(nbytes):
        return np.zeros(0, dtype=bool)
    smallest, largest = int(nbytes.min()), int(nbytes.max())
    if smallest < 0:
        raise ValueError(f"block sizes must be >= 0, got {smallest}")
    none = np.zeros(len(nbytes), dtype=bool)
    if not engines_available:
        return none
    if choose(smallest, to_host, other_direction_busy) is Mechanism.ENGINES:
        return ~none
    if largest < SPLIT_MIN_BLOCK:
        return none  # no copy the engines take out of a mix (the common case: one layout's blocks)
    large = nbytes >= SPLIT_MIN_BLOCK
    if ((nbytes < KERNEL_MAX_BLOCK) | large).all():
        return large
    return none


def coalesce(src_off: np.ndarray, dst_off: np.ndarray, nbytes: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive blocks whose source and destination are both contiguous into one copy:
    one engine descriptor (or kernel entry) per run instead of per block, and the mechanism is
    chosen on the runs' sizes. A request's blocks allocated side by side in a fresh cache form such
    runs; in a full cache they seldom do (tiered `bench policy` replays, recorded: 0-4% of a batch's
    blocks in runs of 8 or more DRAM slots, none on both sides). Copies of SORT_MIN_BYTES or more are
    taken in the order of their sources where they are not in it already (a batch's copies end
    together, whatever their order: one event): a demotion lists its blocks leaves first, level by
    level across chains, so a chain's blocks lay 1,024 copies apart in the list (bench swap --chain
    1024), though side by side on both sides (table.begin_move pairs the slots in order). Smaller
    copies keep their order: sorting a scattered batch of 1,024 costs about 18 us on the 2-core VM,
    where a 16 KiB batch's start is 90-150 us and the kernel moves them scattered at 0.87 of the link."""
    src_off, dst_off, nbytes = (np.asarray(a, dtype=np.int64) for a in (src_off, dst_off, nbytes))
    if len(nbytes) < 2:
        return src_off, dst_off, nbytes
    if nbytes.min() >= SORT_MIN_BYTES and not (src_off[1:] > src_off[:-1]).all():
        order = np.argsort(src_off, kind="stable")
        src_off, dst_off, nbytes = src_off[order], dst_off[order], nbytes[order]
    joins = (src_off[1:] == src_off[:-1] + nbytes[:-1]) & (dst_off[1:] == dst_off[:-1] + nbytes[:-1])
    if not joins.any():
        return src_off, dst_off, nbytes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src_off[starts], dst_off[starts], np.add.reduceat(nbytes, starts)
