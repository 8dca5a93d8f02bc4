"""What admission takes and answers: its settings, a reservation, and the decision on it."""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np


# The range of a block's priority (the table's int8 column; the wire takes no other).
PRIORITY_MIN, PRIORITY_MAX = int(np.iinfo(np.int8).min), int(np.iinfo(np.int8).max)


class Outcome(enum.Enum):
    GRANTED = "granted"
    DEFERRED = "deferred"
    REJECTED = "rejected"


@dataclasses.dataclass(frozen=True)
class AdmissionSettings:
    smoothing_window_s: float = 0.1
    burst_fraction: float = 0.1
    reservation_ttl_s: float = 60.0
    max_deferred: int = 1024
    preemption: bool = True
    max_client_share: float = 1.0


@dataclasses.dataclass(eq=False)  # one reservation is itself only: the queue finds it by identity
class Reservation:
    id: int
    client: int
    layout_id: int
    blocks: int
    priority: int
    expires: float
    request: int
    created: float
    hbm_bytes: int = 0  # what its blocks take of HBM (slots of its layout)
    block_bytes: int = 0  # its layout's block size
    slot: int = 0  # its blocks' HBM slot size: layouts of different block bytes may share it (`_passes`)
    vids: list[int] = dataclasses.field(default_factory=list)  # granted, not yet taken (RESERVED)
    taken: int = 0
    granted: bool = False
    ended: bool = False  # cancelled, expired or its client gone (`_drop`); not merely all taken
    deadline: float = math.inf  # the client's own (`deadline_s`): a stall's credit never passes it

    @property
    def remaining(self) -> int:
        return len(self.vids)


@dataclasses.dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reservation_id: int | None
    reason: str = ""
    position: int | None = None  # deferred: 0 = next in line
    est_wait_s: float | None = None  # deferred: None when no estimate can be made

    def to_dict(self) -> dict:
        # Field by field: dataclasses.asdict (a deep copy) cost each reserve reply ~60 us.
        return {"outcome": self.outcome.value, "reservation_id": self.reservation_id, "reason": self.reason,
                "position": self.position, "est_wait_s": self.est_wait_s}


def credit_stall(reservations, stalled_s: float) -> None:
    """The daemon did not run for `stalled_s` (daemon/stalls.py): that time does not count against a
    reservation's `reservation_ttl_s`, as it does not against a lease (a granted reservation lapsed
    untaken while its client could not reach the daemon to take it), but a client's own deadline
    stands: that is the caller's time, and it may have given up. Expiries only move later, so
    admission's earliest-expiry mark may fall early and is worked out again then."""
    for res in reservations:
        res.expires = min(res.expires + stalled_s, res.deadline)
