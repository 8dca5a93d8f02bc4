"""What the daemon's handlers read from a request and write into a reply (daemon/service.py): layouts
and prefill rates from the wire, the tier a call names, block places as PLACE_DTYPE records, and the
arenas a client maps at attach."""

from __future__ import annotations

import math

import numpy as np

from dflash2 import protocol as P
from dflash2.errors import LayoutError, ProtocolError
from dflash2.layout import Layout
from dflash2.manager import BlockManager
from dflash2.protocol import arg
from dflash2.readcost import checked_rate
from dflash2.tiers import Tier


def layout_of(data) -> Layout:
    if not isinstance(data, dict):
        raise ProtocolError("a layout must be a JSON object")
    try:
        return Layout.from_dict(data)
    except TypeError as e:
        raise LayoutError(f"bad layout field types: {e}") from None


def weights_of(req) -> dict[str, float]:
    """`set_weights`'s weights as floats: ProtocolError for one that is not a number, or NaN. An
    integer past float's range (JSON allows 10**400) is taken as infinite: the policy's own bounds
    check then names the weight and its bound."""
    weights = arg(req, "weights", dict)
    bad = [k for k, v in weights.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
    if bad:
        raise ProtocolError(f"set_weights: weights {bad} must be numbers")
    bad = {k: v for k, v in weights.items() if isinstance(v, float) and math.isnan(v)}
    if bad:
        raise ProtocolError(f"set_weights: weights must be numbers >= 0, got {bad}")
    return {k: float(v) if isinstance(v, float) or abs(v) < 1 << 1000 else (math.inf if v > 0 else -math.inf)
            for k, v in weights.items()}  # (a float as it came: 1e308 was refused as "got inf", a review)


def prefill_rate(req, value) -> float | None:
    """A prefill rate from the wire (readcost.checked_rate), refused as the op's ProtocolError."""
    try:
        return checked_rate(value)
    except ValueError as e:
        raise ProtocolError(f"{req.op.value}: {e}") from None


_MEMORY_TIERS = {"hbm": Tier.HBM, "dram": Tier.DRAM}


def memory_tier(req) -> Tier:
    tier = _MEMORY_TIERS.get(arg(req, "tier", str, default="hbm"))
    if tier is None:
        raise ProtocolError(f"{req.op.value}: tier must be 'hbm' or 'dram', got {req.args['tier']!r}")
    return tier


def layout_id(m: BlockManager, req) -> int:
    lid = arg(req, "layout", int, lo=0)
    m.table.layout(lid)
    return lid


def places_of(m: BlockManager, vids) -> bytes:
    return records(m, m.table.rows(vids))


def vid_of(gen: int, row: int) -> int:
    """One block's id as a Python int, wrapped to int64 as vids_of's are (a row reused 2**31 times
    has ids past 2**63: replies of a few blocks failed after their call had run, a review)."""
    vid = (gen << 32) | row
    return vid - (1 << 64) if vid >= 1 << 63 else vid

def records(m: BlockManager, rows: np.ndarray) -> bytes:
    """PLACE_DTYPE records of rows, built from the table's columns without a Python loop."""
    table = m.table
    c = table.cols
    if len(rows) <= table.SMALL:
        return np.array([(vid_of(int(c.gen[r]), r), int(c.tier[r]), int(c.offset[r]),
                          table.layouts[int(c.layout[r])].block_bytes, int(c.layout[r])) for r in rows.tolist()],
                        dtype=P.PLACE_DTYPE).tobytes()
    block_bytes = np.array([lay.block_bytes for lay in table.layouts] or [0], dtype=np.int64)
    rec = np.empty(len(rows), dtype=P.PLACE_DTYPE)
    rec["vid"] = table.vids(rows)
    rec["tier"] = c.tier[rows]
    rec["offset"] = c.offset[rows]
    rec["layout"] = c.layout[rows]
    rec["nbytes"] = block_bytes[c.layout[rows]]
    return rec.tobytes()


def arenas(m: BlockManager) -> list[dict]:
    out = []
    for tier, arena in m.arenas.items():
        if tier == Tier.NVME:
            continue  # not mappable: clients reach NVMe blocks by acquiring them
        d = arena.describe()
        entry = {"tier": tier.label, "kind": d.get("kind", "shm"), "capacity_bytes": arena.capacity_bytes,
                 "alignment": arena.alignment}
        if entry["kind"] == "cuda":  # mapped by the client with cudaIpcOpenMemHandle
            entry.update(device=d["device"], uuid=d["uuid"], ipc_handle=arena.ipc_handle().hex())
        else:
            entry["name"] = d.get("name")
        out.append(entry)
    return out
