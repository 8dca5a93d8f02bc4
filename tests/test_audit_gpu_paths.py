"""The CUDA path's planning, run on a CPU: how an HBM<->NVMe batch is cut into runs that fit the
pinned staging buffer. The copies themselves are tested on a GPU (tests/test_gpu.py)."""

import logging

import numpy as np

from dflash2.transfer.cuda import STAGE_ALIGN, staged_parts

KIB = 1024


def test_staged_runs_keep_order_and_fit_the_buffer_at_aligned_places():
    nbytes = np.array([64 * KIB, 100, 64 * KIB + 1, 128 * KIB, 4 * KIB, 64 * KIB], dtype=np.int64)
    staging = 192 * KIB
    parts = staged_parts(nbytes, staging)
    assert np.concatenate(parts).tolist() == list(range(len(nbytes)))  # each block once, in order
    for part in parts:
        places = -(-nbytes[part] // STAGE_ALIGN) * STAGE_ALIGN
        assert 0 < places.sum() <= staging


def test_a_block_larger_than_the_staging_buffer_is_left_out_and_said(caplog):
    """It cannot move between HBM and NVMe: it fails (it stays where it was; read back from NVMe, a
    miss), and an error line names the key to raise, where the move used to fail silently."""
    staging = 1 << 20
    nbytes = np.array([256 * KIB, staging + 1, 512 * KIB, 2 * staging], dtype=np.int64)
    with caplog.at_level(logging.ERROR, logger="dflash2.transfer.cuda"):
        parts = staged_parts(nbytes, staging)
    assert [p.tolist() for p in parts] == [[0, 2]]
    assert "memory.staging_buffer_size_mb" in caplog.text and f"{staging + 1} bytes or more" in caplog.text
    # A block of exactly the buffer fits: the 4 KiB rounding of a whole-MiB buffer loses nothing.
    caplog.clear()
    assert [p.tolist() for p in staged_parts(np.array([staging, staging]), staging)] == [[0], [1]]
    assert not caplog.text
