"""Stop signals reach the main thread on the CUDA path too (dflash2/threads.py; the host side is
tests/test_threads.py)."""

from __future__ import annotations

import pytest
from gpu_helpers import GPU
from mask_helpers import other_threads, own_mask, taking_stop_signals
from observe_helpers import RawClient, fill_then_reuse, running_daemon

pytestmark = GPU


def test_every_thread_of_a_gpu_daemon_but_the_main_one_blocks_stop_signals(tmp_path, cuda_config):
    """tests/test_threads.py's daemon check on the CUDA path: the driver starts threads of its own
    (at cuInit and with each context), numpy its BLAS pool (15 threads on a 16-core host)."""
    path = cuda_config(hbm_capacity_mb=8)
    endpoint = f"ipc://{tmp_path}/d.sock"
    with running_daemon(path, str(tmp_path / "daemon.log")) as proc:
        c = RawClient(endpoint)
        c.attach()
        fill_then_reuse(c)  # 576 blocks of 16 KiB through an HBM of 512: moves both ways
        assert taking_stop_signals(proc.pid, other_threads(proc.pid)) == []
        c.close()
    assert proc.returncode == 0


def test_a_gpu_whose_context_cannot_be_made_is_named():
    import cupy

    from dflash2.cuda import start_device
    from dflash2.errors import ArenaError

    missing, before = cupy.cuda.runtime.getDeviceCount(), own_mask()
    with pytest.raises(ArenaError, match=f"cannot make a CUDA context on GPU {missing}"):
        start_device(missing)
    assert own_mask() == before  # the block ended with the failure
