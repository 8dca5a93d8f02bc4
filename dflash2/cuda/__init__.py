"""The CUDA side of dflash2: device arenas exported by IPC handle, pinned host memory, and the
batched copy kernels. Everything here needs CuPy (the `gpu` extra) and a visible GPU; the rest of
dflash2 never imports this package unless the config asks for a CUDA device."""

from __future__ import annotations

from dflash2.errors import ArenaError


def cupy():
    """The cupy module, or ArenaError saying how to get it."""
    try:
        import cupy as cp
    except ImportError as e:
        raise ArenaError(f"the CUDA path needs CuPy (pip install 'dflash2[gpu]'): {e}") from None
    return cp


def cuda_available() -> bool:
    try:
        cp = cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
