"""Device (HBM) arenas taken with one plain cudaMalloc each — never managed memory — and exported
to clients by CUDA IPC handle; and pinning of a host shared-memory segment so that the GPU reads
and writes the DRAM tier directly (mapped, page-locked).

A client maps a device arena once with `CudaArena.attach(handle, device)`; `view()` then returns a
CuPy array over the block's bytes (torch.from_dlpack makes it a torch tensor, no copy).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref

from dflash2.arena.base import MemoryArena
from dflash2.cuda import cupy, on_device
from dflash2.cudadriver import libcuda
from dflash2.errors import ArenaError, CapacityError
from dflash2.tiers import Tier

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2
CUDA_IPC_LAZY_PEER_ACCESS = 1

log = logging.getLogger("dflash2.cuda")


def device_pointer(host_ptr: int) -> int:
    """The GPU's address of mapped, page-locked host memory (cuMemHostGetDevicePointer: CuPy does
    not wrap it). Needs the current device's context, which CuPy has made by then."""
    import ctypes

    cuda = libcuda()
    out = ctypes.c_uint64()
    status = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), ctypes.c_uint(0))
    if status != 0:
        raise ArenaError(f"cuMemHostGetDevicePointer failed with CUDA error {status} for host memory at {host_ptr:#x}")
    return out.value


class _Hold:
    """What every view of a CudaArena keeps alive (CuPy's owner of the memory): the memory goes back
    when the arena is closed and the last view has died, never under a live view."""


def _release(device: int, ptr: int, owner: bool, pid: int) -> None:
    """Free an arena's allocation (owner) or close its IPC mapping (client), once nothing uses it.
    Only in the process that took it: a forked child's copy took nothing, and CUDA is unusable there."""
    if os.getpid() != pid:
        return
    try:
        cp = cupy()
        with on_device(device):
            cp.cuda.runtime.deviceSynchronize()  # no queued kernel or copy still reads or writes it
            if owner:
                cp.cuda.runtime.free(ptr)
            else:
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
    except Exception:  # run by the garbage collector: nobody to raise to
        log.exception("releasing the HBM arena of GPU %d at %#x failed", device, ptr)


class CudaArena(MemoryArena):
    """One device allocation of `capacity_bytes` on `device`.

    Invariant: views stay valid after close(), as a shared-memory segment's do (a client detaches
    while its engine still holds tensors over blocks; unmapping them would make the engine's next
    access an illegal-address error, which kills its CUDA context). close() drops the arena's own
    hold; the allocation is freed, or the IPC mapping closed, when the last view dies."""

    def __init__(self, device: int, ptr: int, capacity_bytes: int, alignment: int, owner: bool):
        self.tier = Tier.HBM
        self.device = device
        self.ptr = ptr
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self.owner = owner
        self._uuid: str | None = None
        cp = cupy()
        hold = _Hold()
        weakref.finalize(hold, _release, device, ptr, owner, os.getpid()).atexit = False  # exit frees all
        with on_device(device):
            mem = cp.cuda.UnownedMemory(ptr, capacity_bytes, hold, device_id=device)
            self._bytes = cp.ndarray((capacity_bytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))

    @classmethod
    def create(cls, device: int, capacity_bytes: int, alignment: int = 256) -> "CudaArena":
        """cudaMalloc the whole arena now. CapacityError gives the bytes asked and free."""
        cp = cupy()
        with on_device(device):
            free, total = cp.cuda.runtime.memGetInfo()
            if capacity_bytes > free:
                raise CapacityError(f"HBM tier on GPU {device} needs {capacity_bytes} bytes, only {free} of "
                                    f"{total} are free (raise memory.hbm_reserve_mb or set memory.hbm_capacity_mb)")
            try:
                ptr = cp.cuda.runtime.malloc(capacity_bytes)
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise CapacityError(f"HBM tier on GPU {device}: cudaMalloc of {capacity_bytes} bytes failed "
                                    f"({e}); {free} bytes were free") from None
        return cls(device, ptr, capacity_bytes, alignment, owner=True)

    @classmethod
    def attach(cls, handle: bytes, device: int, capacity_bytes: int, alignment: int = 256) -> "CudaArena":
        """Map another process's arena by its IPC handle (a client)."""
        cp = cupy()
        with on_device(device):
            try:
                ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, CUDA_IPC_LAZY_PEER_ACCESS)
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise ArenaError(f"cannot map the HBM arena of GPU {device} by IPC handle: {e}") from None
        return cls(device, ptr, capacity_bytes, alignment, owner=False)

    def ipc_handle(self) -> bytes:
        with on_device(self.device):
            return bytes(cupy().cuda.runtime.ipcGetMemHandle(self.ptr))

    def view(self, offset: int, nbytes: int):
        return self._slice(self._bytes, offset, nbytes, f"the HBM arena of GPU {self.device}")

    def describe(self) -> dict:
        return {**super().describe(), "kind": "cuda", "device": self.device, "uuid": self.uuid}

    @property
    def uuid(self) -> str:
        """The GPU's UUID: how a client finds the same GPU under its own device numbering."""
        if self._uuid is None:
            from dflash2.cuda import gpu_uuid
            self._uuid = gpu_uuid(self.device)
        return self._uuid

    def close(self) -> None:
        """Drop the arena's hold: with no view alive the memory goes now, else with the last view."""
        self._bytes = None


@dataclasses.dataclass
class PinnedRegion:
    """Host memory page-locked and mapped into the GPU's address space."""

    host_ptr: int
    nbytes: int
    device_ptr: int
    device: int  # the GPU whose context registered it (and unregisters it)
    _registered: bool = True

    @classmethod
    def register(cls, host_ptr: int, nbytes: int, device: int) -> "PinnedRegion":
        """Pinned for every GPU (portable), registered from `device`'s context: from the thread's
        current one it made a context on GPU 0 in a daemon serving another GPU (a review)."""
        cp = cupy()
        with on_device(device):
            try:
                cp.cuda.runtime.hostRegister(host_ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise CapacityError(f"cannot pin {nbytes} bytes of host memory for the GPU: {e} "
                                    "(check ulimit -l / the container's memlock limit)") from None
            try:
                return cls(host_ptr, nbytes, device_pointer(host_ptr), device)
            except BaseException:
                cp.cuda.runtime.hostUnregister(host_ptr)  # not left pinned under a segment about to go
                raise

    def unregister(self) -> None:
        if self._registered:
            self._registered = False
            with on_device(self.device):
                cupy().cuda.runtime.hostUnregister(self.host_ptr)


class PinnedBuffer:
    """A page-locked, mapped host buffer of our own (the GPU staging buffer for NVMe moves)."""

    def __init__(self, nbytes: int, device: int):
        cp = cupy()
        self.nbytes = nbytes
        self.device = device
        with on_device(device):  # (as PinnedRegion.register)
            try:
                self.host_ptr = cp.cuda.runtime.hostAlloc(nbytes, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
            except cp.cuda.runtime.CUDARuntimeError as e:
                # At start-up: a named error, which the daemon reports and exits 4 on (not a traceback).
                raise CapacityError(f"cannot take {nbytes} bytes of pinned host memory for the GPU staging buffer "
                                    f"(memory.staging_buffer_size_mb): {e}") from None
            try:
                self.device_ptr = device_pointer(self.host_ptr)
            except BaseException:
                cp.cuda.runtime.freeHost(self.host_ptr)
                raise
        import ctypes

        import numpy as np
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.host_ptr))

    def close(self) -> None:
        if self.host_ptr:
            ptr, self.host_ptr = self.host_ptr, 0
            self.array = None
            with on_device(self.device):
                cupy().cuda.runtime.freeHost(ptr)


class PinnedHostArena(MemoryArena):
    """A host shared-memory segment (so that clients can map it too) page-locked and mapped for
    the GPU: the DRAM tier of a CUDA node. The GPU reaches it at `region.device_ptr`."""

    def __init__(self, shm, region: PinnedRegion):
        self.shm = shm
        self.region = region
        self.tier = shm.tier
        self.capacity_bytes = shm.capacity_bytes
        self.alignment = shm.alignment

    @classmethod
    def create(cls, name: str, capacity_bytes: int, tier: Tier, alignment: int = 4096, *,
               device: int) -> "PinnedHostArena":
        from dflash2.arena.shm import SharedMemoryArena

        shm = SharedMemoryArena.create(name, capacity_bytes, tier, alignment=alignment)
        try:
            region = PinnedRegion.register(int(shm.view(0, capacity_bytes).ctypes.data), capacity_bytes, device)
        except BaseException:
            shm.close()
            raise
        return cls(shm, region)

    def view(self, offset: int, nbytes: int):
        return self.shm.view(offset, nbytes)

    def describe(self) -> dict:
        return {**self.shm.describe(), "pinned": True}

    def close(self) -> None:
        try:
            self.region.unregister()  # fails where the GPU's context is lost ...
        finally:
            self.shm.close()  # ... and the segment still goes (it is the node's memory, not the GPU's)
