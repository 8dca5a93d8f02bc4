"""What the GPU tests (tests/test_gpu*.py) share: the marks that skip them cleanly without CUDA, the
real daemon on a config, a manager built as the daemon builds it, a view filled with known bytes."""

from __future__ import annotations

import contextlib
import subprocess
import uuid

import numpy as np
import pytest

from dflash2.cuda import cuda_available

GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not cuda_available(), reason="needs CUDA and CuPy (run on the GPU machine)")]

MIB = 1 << 20


def two_gpus() -> bool:
    try:
        import cupy as cp
        return cp.cuda.runtime.getDeviceCount() >= 2
    except Exception:
        return False


@contextlib.contextmanager
def daemon_on(path, prefix=()):
    """The real dflash2d on `path` (run under `prefix`, e.g. unshare(1)), up once it printed its
    start-up line; stopped afterwards."""
    proc = subprocess.Popen([*prefix, "dflash2d", "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("DFlash2: enabled")):
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        yield lines[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(30 if not prefix else 5)
        except subprocess.TimeoutExpired:  # (unshare --fork ignores SIGTERM while it waits; killed, its child gets SIGTERM)
            proc.kill()
            proc.wait(30)


def gpu_manager(path):
    from dflash2.assemble import build_manager
    from dflash2.config import load_config
    return build_manager(load_config(path), instance=f"dflash2-gpu-{uuid.uuid4().hex[:8]}")


def fill(view, seed):
    import cupy as cp
    data = cp.asarray(np.random.default_rng(seed).integers(0, 256, view.size, dtype=np.uint8))
    view[:] = data
    # Writers finish before they commit (a client synchronizes its stream first): the daemon's
    # copy streams do not wait for other streams.
    cp.cuda.runtime.deviceSynchronize()
    return cp.asnumpy(data)
