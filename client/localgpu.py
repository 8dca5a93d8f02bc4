"""How a client names the GPU it serves at attach: by the GPU's UUID where this process can read it
(the daemon may number its GPUs otherwise: CUDA_VISIBLE_DEVICES, a container's device plugin), else
by its device number, which the daemon takes as its own."""

from __future__ import annotations

import logging

from dflash2.errors import ArenaError

log = logging.getLogger("dflash2.client")


def uuid_of_local_device(device: int) -> str | None:
    """The UUID of this process's CUDA device `device`, or None where this process has no CUDA (no
    CuPy, no driver, no such device): then the daemon takes `device` as its own number. Without CuPy
    on a machine that shows a GPU that is said in the log: the number alone named another GPU's pool
    where the two processes number their GPUs differently, and a torch-only serving process (sglang's)
    fell back to it silently (a review); on one that shows none it is all there is, said nowhere."""
    from dflash2 import plan
    from dflash2.cuda import cupy, visible_uuids

    try:
        cupy()
    except ArenaError as e:
        if plan.probe_gpus(import_torch=False) == []:  # (not imported here for it: a review)
            # No GPU on this machine (the daemon's own probe, without CuPy): the number is all there is,
            # and CuPy would find none either (a host-only node's clients were told to install it).
            return None
        log.warning("dflash2: %s, so this process cannot read the UUID of its GPU %d: the daemon takes %d for its "
                    "own device number, which is another GPU's pool where the daemon numbers its GPUs otherwise "
                    "(CUDA_VISIBLE_DEVICES, a container's device plugin)", e, device, device)
        return None
    seen = visible_uuids()
    if not seen:
        return None
    if not 0 <= device < len(seen):
        raise ArenaError(f"device {device}: this process sees {len(seen)} GPU(s) (CUDA_VISIBLE_DEVICES); "
                         f"name one of 0..{len(seen) - 1}")
    return seen[device]
