"""Zero-copy views of daemon-owned blocks: the arenas are mapped once at attach, and a block is then
addressed by (tier, offset, nbytes) from a PLACE_DTYPE record. No bytes are copied, ever.

A view stays valid while the block cannot move: while the client has it pinned (`acquire`) or is
writing it (blocks from `allocate` / `take`, before `commit`). Unpinned blocks may be demoted and
their slot reused.

torch is optional: `bytes_view` returns numpy (CuPy for a GPU's HBM arena, mapped by its CUDA IPC
handle); `tensor_view` imports torch on first use.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from dflash2.arena.liveness import DaemonLiveness, check_name
from dflash2.arena.shm import SharedMemoryArena
from dflash2.errors import ArenaError, ProtocolError
from dflash2.layout import DTYPE_BITS, Layout
from dflash2.tiers import Tier

# Layout dtype -> torch dtype name (4-bit packed types are viewed as their bytes).
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int4": "uint8", "fp4": "uint8"}

log = logging.getLogger("dflash2.client")


def pid_namespace_hint(daemon_pid_namespace: int | None) -> str:
    """What to add when a GPU's arena would not map by its CUDA IPC handle in a process of another pid
    namespace than the daemon's; "" in the daemon's own, or where either is unknown. Measured on an
    H200 host (driver 580.159.04, tests/test_gpu_pid_namespaces.py): the handle opens where one of the
    two processes is in the host's pid namespace, and not between two namespaces of their own (a
    DaemonSet pod and a serving pod, neither with hostPID)."""
    from dflash2.client.transport import pid_namespace

    mine = pid_namespace()
    if daemon_pid_namespace is None or mine is None or mine == daemon_pid_namespace:
        return ""
    return (f"; this process runs in another pid namespace (pid:[{mine}]) than the daemon (pid:[{daemon_pid_namespace}]): "
            "CUDA's IPC handles did not open between two pid namespaces of their own, and did with the daemon in the "
            "host's: run the daemon there (Kubernetes: hostPID: true in the DaemonSet, as deploy/kubernetes has it; "
            "docker: --pid=host for the daemon's container)")


class ArenaMap:
    """The daemon's memory arenas, mapped into this process (one mapping per tier), and its liveness
    object (dflash2/arena/liveness.py), which tells when they are a dead daemon's."""

    def __init__(self, described: list[dict], liveness: str | None = None, liveness_id: str | None = None,
                 endpoint: str = "the daemon", daemon_pid_namespace: int | None = None):
        """`daemon_pid_namespace`: the daemon's (its attach reply's), said when a GPU's arena would not map."""
        self.arenas: dict[int, object] = {}  # SharedMemoryArena, or CudaArena for a GPU's HBM
        self.liveness: DaemonLiveness | None = None
        # daemon_gone() and close() run on a client's call thread and its heartbeat thread at once
        # (both find a killed daemon within GONE_CHECK_S and both let its mappings go): close() must
        # not iterate a dict the other thread empties, nor a gone test flock a descriptor being closed.
        # Reentrant, so that a signal handler's test or close() on the thread whose test it interrupted can
        # tell (`_is_owned`): it waited for the lock its own thread held, for good (a review).
        self._lock = threading.RLock()
        self._close_after: str | None = None  # a close() asked for within this thread's test: run after it
        # Why the mappings are gone, once they are (`close`): a view asked for meanwhile on another
        # thread says that, not that its tier "is not mapped" (a review's script: detach racing a view).
        self.closed: str | None = None
        name = check_name(liveness)  # a bad name refuses the attach before anything is mapped
        if liveness_id is not None and not (isinstance(liveness_id, str) and liveness_id.isalnum()):
            raise ProtocolError(f"attach: the daemon's liveness id {liveness_id!r} is not a word of letters and digits")
        try:
            for d in described:
                tier = Tier[str(d["tier"]).upper()]
                if d.get("kind") == "cuda":
                    from dflash2.cuda.arena import CudaArena  # only on a GPU node

                    device = _local_device(d)  # (no CuPy, or the GPU not seen here: said as it is)
                    try:
                        self.arenas[int(tier)] = CudaArena.attach(bytes.fromhex(d["ipc_handle"]), device,
                                                                  int(d["capacity_bytes"]), int(d.get("alignment", 256)))
                    except ArenaError as e:
                        # Only the handle's failure (ipcOpenMemHandle) gets the pid namespaces' advice: a
                        # client without CuPy was told to move the daemon to the host's pid namespace, for
                        # a handle it never opened (a review).
                        raise ArenaError(f"{e}{pid_namespace_hint(daemon_pid_namespace)}") from None
                    continue
                if d.get("kind") != "shm":
                    raise ArenaError(f"the daemon offers a {d.get('kind')!r} arena this client cannot map")
                try:
                    self.arenas[int(tier)] = SharedMemoryArena.attach(d["name"], tier, int(d.get("alignment", 256)))
                except ArenaError as e:
                    if "does not exist" not in str(e):  # (no descriptor left, a permission: said as it is)
                        raise
                    raise ArenaError(f"{endpoint} answered, but {e}: a client must see the daemon's /dev/shm (run "
                                     "on its host; a container needs the host's IPC namespace or /dev/shm)") from None
                mapped = self.arenas[int(tier)].capacity_bytes
                if "capacity_bytes" in d and mapped != int(d["capacity_bytes"]):
                    raise ArenaError(f"the segment /dev/shm/{d['name']} this process sees holds {mapped} bytes, and "
                                     f"{endpoint}'s {tier.label} tier {int(d['capacity_bytes'])}: it is another "
                                     "daemon's of the same pid (another container's?). Run the client where it sees "
                                     "the daemon's /dev/shm")
        except Exception:
            self.close()
            raise
        self.liveness = _open_liveness(name)
        # (A liveness object that cannot be opened, said in the log, checks nothing: someone may have
        # cleaned /dev/shm under a live daemon. The segments' sizes were checked above.)
        if self.liveness is not None and liveness_id is not None and not self.liveness.matches(liveness_id):
            self.close()
            raise ArenaError(f"the shared memory this process sees under /dev/shm/{name} is not {endpoint}'s: it is "
                             "another daemon's of the same pid (another container's, pid 1 in each?), whose blocks "
                             "would be read and written with no error. Run the client where it sees the daemon's /dev/shm")

    def bytes_view(self, place):
        """uint8 view of one block: numpy for host memory, CuPy for a GPU arena."""
        tier = int(place["tier"])
        arena = self.arenas.get(tier)
        if self.closed is not None:
            raise ArenaError(f"{self.closed}: its arena mappings are gone")
        if arena is None:
            label = Tier(tier).label if tier in Tier._value2member_map_ else str(tier)
            raise ArenaError(f"block {int(place['vid']):#x} lies in the {label} tier, which this client "
                             "has not mapped (acquire it to bring it to HBM first; a host_only client maps no "
                             "GPU arena)")
        try:
            return arena.view(int(place["offset"]), int(place["nbytes"]))
        except ArenaError:
            if self.closed is not None:  # closed by another thread meanwhile
                raise ArenaError(f"{self.closed}: its arena mappings are gone") from None
            raise

    def daemon_gone(self, wait: bool = True) -> bool:
        """Whether the daemon that mapped these arenas has ended: nothing holds its liveness object,
        or one of its shared-memory segments (`SharedMemoryArena.creator_gone`), any more. False
        where neither can tell (a GPU's HBM alone, from a daemon that names no liveness object), and,
        with `wait` False, where another test or close() holds the lock now."""
        if self._lock._is_owned() or not self._lock.acquire(blocking=wait):  # (within this thread's test: the
            return False  # liveness object's lock is held below it)
        try:
            liveness = self.liveness
            if liveness is not None and liveness.gone():
                return True
            return any(getattr(arena, "creator_gone", lambda: False)() for arena in list(self.arenas.values()))
        finally:
            self._lock.release()
            self._closing()

    def _closing(self) -> None:
        """A close() asked for within this thread's test (a signal handler's), once the test is done."""
        if self._close_after is not None and not self._lock._is_owned():
            why, self._close_after = self._close_after, None
            self.close(why)

    def close(self, why: str = "this client is detached") -> None:
        if self._lock._is_owned():  # (a signal handler's, within this thread's test: after it; within a close: by it)
            self.closed = self.closed or why
            self._close_after = why
            return
        with self._lock:
            self.closed = self.closed or why
            arenas, self.arenas = list(self.arenas.values()), {}
            for arena in arenas:
                # Only unmaps (never unlinks). Live views keep their mapping; without any, a segment is
                # unmapped now and a GPU arena's CUDA IPC mapping closed now (CudaArena's last hold).
                arena.close()
            if self.liveness is not None:
                self.liveness.close()
                self.liveness = None
            self._close_after = None  # (one asked for within this close is done by it)


def _open_liveness(name: str | None) -> DaemonLiveness | None:
    """The daemon's liveness object, opened; None (said in the log) when there is none or it cannot
    be opened: the attach still works, without that way of finding the daemon dead."""
    if name is None:
        log.info("dflash2: the daemon names no liveness object (a dflash2d older than this client): a dead "
                 "daemon is found by its shared-memory segments only (none where a GPU daemon has HBM alone)")
        return None
    try:
        return DaemonLiveness.open(name)
    except ArenaError as e:
        log.error("dflash2: %s; dead-daemon detection is off for this client (but for the daemon's shared-memory "
                  "segments, if it has any): a killed daemon is found only when a restarted one answers "
                  "UnknownClient, and its memory stays mapped here until then", e)
        return None


def _local_device(arena: dict) -> int:
    """This process's number of the GPU that holds a daemon's HBM arena: found by its UUID (the
    daemon's number names another GPU, or none, where CUDA_VISIBLE_DEVICES differs). Mapping it on
    another GPU would work over peer access, slowly and with tensors on the wrong device: refused.
    ArenaError saying that CuPy is missing where it is (`pip install 'dflash2[gpu]'`)."""
    from dflash2.cuda import cupy, local_device, visible_uuids

    # First: without CuPy this process sees no GPU (visible_uuids), and a torch-only serving process on
    # the daemon's GPU was told that GPU was not visible to it and to set CUDA_VISIBLE_DEVICES (a review).
    cupy()
    uuid = arena.get("uuid")
    if uuid is None:  # a daemon of a version that did not say
        return int(arena["device"])
    here = local_device(uuid)
    if here is None:
        raise ArenaError(f"the daemon's HBM arena lies on GPU {uuid} (its device {arena.get('device')}), which this "
                         f"process does not see (it sees {visible_uuids() or 'no GPU'}): run the client with that GPU "
                         "visible (CUDA_VISIBLE_DEVICES), or attach with the device this process serves")
    return here


def tensor_shape(layout: Layout) -> tuple[int, ...]:
    """The view's shape: the layout's, except that 4-bit types show their packed bytes."""
    if DTYPE_BITS[layout.dtype] >= 8:
        return layout.shape
    shape = layout.shape
    if shape[-1] % 2 == 0:
        return (*shape[:-1], shape[-1] // 2)
    return (layout.block_bytes,)


def tensor_view(raw: np.ndarray, layout: Layout):
    """A torch tensor over `raw` (a uint8 view of exactly one block), typed and shaped by the layout."""
    import torch  # optional dependency: only views need it

    if raw.nbytes != layout.block_bytes:
        raise ArenaError(f"a block of layout {layout.name!r} is {layout.block_bytes} bytes, the view has {raw.nbytes}")
    if isinstance(raw, np.ndarray):
        flat = torch.frombuffer(raw, dtype=torch.uint8)  # shares the mapping; keeps `raw` alive
    else:
        flat = torch.from_dlpack(raw)  # a CuPy view of GPU memory: a CUDA tensor, no copy
    return flat.view(getattr(torch, TORCH_DTYPES[layout.dtype])).view(tensor_shape(layout))
