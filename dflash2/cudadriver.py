"""The CUDA driver library (libcuda), loaded once per process through ctypes.

For the driver calls that CuPy and torch do not wrap or wrap at a cost: the GPU probe before any
CUDA package is imported (plan.py), a device pointer of mapped host memory (cuda/arena.py), a GPU's
whole UUID (cuda/__init__.py), the copy kernel's launch (cuda/kernels.py) and the engines' batched
copies (cuda/copy_engine.py). No CUDA package here: the probe runs on any machine.
"""

from __future__ import annotations

import ctypes
import functools

LIBRARY = "libcuda.so.1"  # the driver's runtime name (the unversioned libcuda.so comes with the toolkit only)


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The driver library, the same object every call (its functions' argtypes, once set, hold for
    every caller). OSError where no NVIDIA driver is installed (not cached: asked again next time)."""
    return ctypes.CDLL(LIBRARY)
