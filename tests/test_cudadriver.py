"""The CUDA driver library is loaded once per process (dflash2/cudadriver.py), or refused as missing."""

import pytest
from gpu_helpers import GPU

from dflash2.cudadriver import libcuda


def test_a_missing_driver_is_refused_each_time_and_nothing_kept():
    try:
        libcuda()
    except OSError:
        with pytest.raises(OSError):
            libcuda()
        assert libcuda.cache_info().currsize == 0
    else:
        pytest.skip("an NVIDIA driver is installed here (the GPU test below covers it)")


@GPU[0]
@GPU[1]
def test_the_driver_is_one_library_object_for_every_caller():
    """One object: the argtypes that one caller (the kernel launcher, the engines' batches) sets on a
    driver function hold for every caller; the probe, the UUID and the arenas use the same one."""
    from dflash2.cuda import gpu_uuid
    from dflash2.plan import probe_gpus

    first = libcuda()
    assert libcuda() is first and first.cuInit(0) == 0
    gpus = probe_gpus()
    assert gpus and gpu_uuid(0).startswith("GPU-")
    assert libcuda() is first and libcuda.cache_info().currsize == 1
