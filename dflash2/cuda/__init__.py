"""The CUDA side of dflash2: device arenas exported by IPC handle, pinned host memory, and the
batched copy kernels. Everything here needs CuPy (the `gpu` extra) and a visible GPU; the rest of
dflash2 never imports this package unless the config asks for a CUDA device."""

from __future__ import annotations

import contextlib
import ctypes

from dflash2 import threads
from dflash2.cudadriver import libcuda
from dflash2.errors import ArenaError
from dflash2.gpuid import uuid_text


def cupy():
    """The cupy module, or ArenaError saying how to get it."""
    try:
        import cupy as cp
    except ImportError as e:
        raise ArenaError(f"the CUDA path needs CuPy (pip install 'dflash2[gpu]'): {e}") from None
    return cp


def _context_current() -> bool:
    """Whether this thread has a CUDA context current (cuCtxGetCurrent; makes none)."""
    ctx = ctypes.c_void_p()
    return libcuda().cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)


def _primary_active(ordinal: int) -> bool:
    """Whether GPU `ordinal`'s primary context is active in this process (cuDevicePrimaryCtxGetState;
    makes none)."""
    lib = libcuda()
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    return (lib.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
            and lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
            and bool(active.value))


@contextlib.contextmanager
def on_device(device: int):
    """The thread's current device is `device` inside the block, as in `cp.cuda.Device(device)`; on
    leaving, the device before is set back where that makes no new CUDA context: where the thread had
    a context current, or that device's context is active in the process already.

    CuPy's sets back the device the runtime calls current, which in a thread that never chose one
    is GPU 0, and since CUDA 12 setting a device makes its primary context: a daemon serving GPU 1
    alone made a context on GPU 0 (hundreds of MiB of a GPU another tenant or rank uses), and so did a
    client serving GPU 1 when its heartbeat thread let a dead daemon's HBM mapping go (a review).
    A thread left on `device` (no context before, and none on its device before in the process) has
    that device for the rest of its CUDA work: where it would have made a context on the other."""
    runtime = cupy().cuda.runtime
    had = _context_current()
    before = runtime.getDevice()  # (makes no context)
    if before != device or not had:
        runtime.setDevice(device)
    try:
        yield
    finally:
        if before != device and (had or _primary_active(before)):
            runtime.setDevice(before)


# cudaErrorNotReady: what cudaEventQuery answers while the work before the event still runs.
CUDA_ERROR_NOT_READY = 600


def event_passed(event) -> bool:
    """Whether a CUDA event has passed, or never will: the work before it ended, well or with an
    error (its `synchronize` then raises it). CuPy's `Event.done` is False for both of the last:
    after a sticky error (an illegal address, an uncorrectable ECC error) a copy that waited on it
    looked in flight for ever, the daemon never learned that its GPU was lost, and the calls that
    waited for the copy stalled until their clients gave up (a review's script on an H200)."""
    cp = cupy()
    try:
        return cp.cuda.runtime.eventQuery(event.ptr) != CUDA_ERROR_NOT_READY
    except cp.cuda.runtime.CUDARuntimeError:
        return True  # (a CuPy that raises the error instead of returning it)


def start_device(device: int) -> None:
    """Make `device`'s CUDA context now, before anything else uses the device: the threads the driver
    starts with a context (cuda-EvtHandlr) inherit SIGTERM and SIGINT blocked, so that they reach
    the main thread (dflash2/threads.py). Does nothing when the context exists. ArenaError names the
    GPU when its context cannot be made."""
    cp = cupy()
    try:
        with threads.stop_signals_blocked(), on_device(device):
            cp.cuda.runtime.free(0)  # cudaFree(0): makes the device's primary context, frees nothing
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise ArenaError(f"cannot make a CUDA context on GPU {device}: {e}") from None


def cuda_available() -> bool:
    try:
        cp = cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def gpu_uuid(device: int) -> str:
    """The UUID of this process's CUDA device `device`: the same GPU has the same UUID in every
    process, whatever CUDA_VISIBLE_DEVICES numbers it there. From the driver (cuDeviceGetUuid_v2,
    the UUID CUDA_VISIBLE_DEVICES names, a MIG instance's included), all 16 bytes: CuPy's device
    properties end the UUID's bytes at its first zero byte, as a C string, and a GPU whose UUID
    holds one (about one in sixteen) was refused to every client ("a GPU UUID has 16 bytes, got
    13", an H200)."""
    import ctypes

    cupy().cuda.runtime.getDeviceCount()  # the runtime has initialised the driver (cuInit) by now
    lib = libcuda()
    handle = ctypes.c_int()
    status = lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device))
    if status != 0:
        raise ArenaError(f"cuDeviceGet({device}) failed with CUDA error {status}")
    raw = (ctypes.c_ubyte * 16)()
    get = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    status = get(raw, handle)
    if status != 0:
        raise ArenaError(f"cuDeviceGetUuid of GPU {device} failed with CUDA error {status}")
    return uuid_text(bytes(raw))


def visible_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, by its device number (empty without CUDA)."""
    try:
        cp = cupy()
        return [gpu_uuid(d) for d in range(cp.cuda.runtime.getDeviceCount())]
    except Exception:  # no CuPy, no driver, or no device visible: no GPU here
        return []


def local_device(uuid: str) -> int | None:
    """This process's device number of the GPU with this UUID, or None when it is not visible here."""
    want = uuid_text(uuid)
    seen = visible_uuids()
    return seen.index(want) if want in seen else None
