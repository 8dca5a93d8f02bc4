"""Zero-copy views of daemon-owned blocks: the arenas are mapped once at attach, and a block is then
addressed by (tier, offset, nbytes) from a PLACE_DTYPE record. No bytes are copied, ever.

A view stays valid while the block cannot move: while the client has it pinned (`acquire`) or is
writing it (blocks from `allocate` / `take`, before `commit`). Unpinned blocks may be demoted and
their slot reused.

torch is optional: `bytes_view` returns numpy (CuPy for a GPU's HBM arena, mapped by its CUDA IPC
handle); `tensor_view` imports torch on first use.
"""

from __future__ import annotations

import numpy as np

from dflash2.arena.shm import SharedMemoryArena
from dflash2.errors import ArenaError
from dflash2.layout import DTYPE_BITS, Layout
from dflash2.tiers import Tier

# Layout dtype -> torch dtype name (4-bit packed types are viewed as their bytes).
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int4": "uint8", "fp4": "uint8"}


class ArenaMap:
    """The daemon's memory arenas, mapped into this process (one mapping per tier)."""

    def __init__(self, described: list[dict]):
        self.arenas: dict[int, object] = {}  # SharedMemoryArena, or CudaArena for a GPU's HBM
        try:
            for d in described:
                tier = Tier[str(d["tier"]).upper()]
                if d.get("kind") == "cuda":
                    from dflash2.cuda.arena import CudaArena  # only on a GPU node

                    self.arenas[int(tier)] = CudaArena.attach(bytes.fromhex(d["ipc_handle"]), _local_device(d),
                                                              int(d["capacity_bytes"]), int(d.get("alignment", 256)))
                    continue
                if d.get("kind") != "shm":
                    raise ArenaError(f"the daemon offers a {d.get('kind')!r} arena this client cannot map")
                self.arenas[int(tier)] = SharedMemoryArena.attach(d["name"], tier, int(d.get("alignment", 256)))
        except Exception:
            self.close()
            raise

    def bytes_view(self, place):
        """uint8 view of one block: numpy for host memory, CuPy for a GPU arena."""
        tier = int(place["tier"])
        arena = self.arenas.get(tier)
        if arena is None:
            label = Tier(tier).label if tier in Tier._value2member_map_ else str(tier)
            raise ArenaError(f"block {int(place['vid']):#x} lies in the {label} tier, which this client "
                             "has not mapped (acquire it to bring it to HBM first)")
        return arena.view(int(place["offset"]), int(place["nbytes"]))

    def daemon_gone(self) -> bool:
        """Whether the daemon that mapped these arenas has ended (its shared-memory segments have no
        holder left: `SharedMemoryArena.creator_gone`). False where no arena can tell (a GPU's HBM)."""
        return any(getattr(arena, "creator_gone", lambda: False)() for arena in list(self.arenas.values()))

    def close(self) -> None:
        for arena in self.arenas.values():
            arena.close()  # only unmaps (never unlinks); live views keep their mapping
        self.arenas.clear()


def _local_device(arena: dict) -> int:
    """This process's number of the GPU that holds a daemon's HBM arena: found by its UUID (the
    daemon's number names another GPU, or none, where CUDA_VISIBLE_DEVICES differs). Mapping it on
    another GPU would work over peer access, slowly and with tensors on the wrong device: refused."""
    uuid = arena.get("uuid")
    if uuid is None:  # a daemon of a version that did not say
        return int(arena["device"])
    from dflash2.cuda import local_device, visible_uuids

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
