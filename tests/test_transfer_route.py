"""Which mechanism moves an HBM<->DRAM batch (policy only, on a CPU), and how a copy-engine batch is
cut into driver calls."""

from __future__ import annotations

import pytest

from dflash2.cuda.copy_engine import FIRST_SLICE, slices
from dflash2.transfer.route import Mechanism, choose

KIB = 1024


@pytest.mark.parametrize("block_kib, to_host, busy, expected", [
    (16, True, False, Mechanism.KERNEL),
    (16, False, False, Mechanism.KERNEL),
    (16, True, True, Mechanism.KERNEL),  # the engines move 16 KiB blocks at 4-32 GB/s
    (32, False, True, Mechanism.KERNEL),
    (64, True, False, Mechanism.KERNEL),  # one way, device to host: the kernel is faster at 64 KiB
    (64, False, False, Mechanism.ENGINES),  # one way, host to device: the engines are
    (64, True, True, Mechanism.ENGINES),  # both ways: the engines fill the duplex link
    (64, False, True, Mechanism.ENGINES),
    (127, True, False, Mechanism.KERNEL),
    (128, True, False, Mechanism.ENGINES),
    (1024, True, False, Mechanism.ENGINES),
    (1024, False, True, Mechanism.ENGINES),
])
def test_route(block_kib, to_host, busy, expected):
    assert choose(block_kib * KIB, to_host, busy) is expected


def test_no_engines_means_the_kernel_everywhere():
    for size in (0, 16 * KIB, 64 * KIB, 1 << 30):
        for to_host in (True, False):
            for busy in (True, False):
                assert choose(size, to_host, busy, engines_available=False) is Mechanism.KERNEL


def test_negative_block_size_is_an_error():
    with pytest.raises(ValueError, match="smallest_block"):
        choose(-1, True, False)


@pytest.mark.parametrize("n", [0, 1, FIRST_SLICE - 1, FIRST_SLICE, FIRST_SLICE + 1, 1000, 1024, 4097])
def test_slices_cover_the_batch_once_in_doubling_runs(n):
    runs = slices(n)
    covered = [i for lo, hi in runs for i in range(lo, hi)]
    assert covered == list(range(n))
    for k, (lo, hi) in enumerate(runs[:-1]):
        assert hi - lo == FIRST_SLICE << k
    if runs:
        assert 0 < runs[-1][1] - runs[-1][0] <= FIRST_SLICE << (len(runs) - 1)
    assert len(runs) <= max(1, n.bit_length())  # few driver calls


def test_the_other_direction_stays_busy_for_the_hold_after_its_last_start():
    from dflash2.transfer.route import DUPLEX_HOLD_S, other_busy
    assert other_busy(True, None) and other_busy(True, 10.0)
    assert not other_busy(False, None)  # never started a batch
    assert other_busy(False, 0.0) and other_busy(False, DUPLEX_HOLD_S / 2)
    assert not other_busy(False, DUPLEX_HOLD_S) and not other_busy(False, 1.0)
