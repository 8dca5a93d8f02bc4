"""Each client's share of HBM (`admission.max_client_share`) and of the deferred queue.

A client holds of HBM what it references there (its private blocks, and published ones a request of
it still holds; not the cached blocks it only pins to read) plus its reservations still queued; an
`allocate` or `reserve` that would take it past its share is refused (QuotaExceeded, REJECTED).

- A process whose lease lapsed while it lived keeps its private blocks set aside a while (it may
  still be writing them: daemon/sessions.py). When it attaches again it is a new client id, and
  those blocks were no one's: the process got a whole share again on top of them (twice its share,
  every other client shut out of HBM meanwhile; a review's script). The daemon names the earlier
  ids of the same process (`carry`), and they count against the new id's share until their blocks
  are let go (`drop`).
- Under a share < 1 a client also takes at most that share of the deferred queue's places
  (`admission.max_deferred`): its share is counted in bytes, so one client's one-block
  reservations filled every place while far inside its share, and every other client's
  reservation of the same priority was rejected.

Mechanism only: Admission asks `over` and `queue_full_for`.
"""

from __future__ import annotations

import math

import numpy as np

from dflash2.reservations.records import AdmissionSettings
from dflash2.table import BlockTable
from dflash2.tiers import Tier


class ClientShares:
    def __init__(self, table: BlockTable, settings: AdmissionSettings):
        self.table = table
        self.settings = settings
        self._carried: dict[int, set[int]] = {}  # client -> the set-aside ids of its process's earlier sessions

    @property
    def limited(self) -> bool:
        return self.settings.max_client_share < 1.0

    def carry(self, client: int, earlier: list[int]) -> None:
        """`earlier`'s blocks (set-aside sessions of the same process) count against `client`'s share.
        Kept only under a share < 1, the one place they are read (`over`): under a whole share a
        process that attached a session per request and dropped each made every lapsed one carried by
        every later one, N^2 entries (a review's 5,000 sessions: +50 MB, pings held up to 440 ms)."""
        if earlier and self.limited:
            self._carried.setdefault(client, set()).update(earlier)

    def drop(self, client: int) -> None:
        """The client is gone (or its set-aside blocks let go): it neither carries nor is carried."""
        self._carried.pop(client, None)
        for earlier in self._carried.values():
            earlier.discard(client)

    def over(self, client: int, need: int, queued: int) -> str:
        """Why `need` more bytes would take the client past its share of HBM (with `queued` bytes of
        its reservations still in the queue), or "" when they would not."""
        if not self.limited:
            return ""
        hbm = self.table.allocators[Tier.HBM].capacity_bytes
        share = self.settings.max_client_share * hbm
        ids = [client, *self._carried.get(client, ())]
        if sum(self.table.client(c).ref_slot_bytes for c in ids) + queued + need <= share:
            return ""  # under the share even if every block it references lay in HBM: no walk over them
        earlier = sum(self.hbm_bytes(c) for c in ids[1:])
        held = self.hbm_bytes(client) + earlier + queued
        if held + need <= share:
            return ""
        why = f"client would hold {held + need} bytes of HBM, over its share {self.settings.max_client_share} of {hbm}"
        if earlier:
            why += (f" ({earlier} of them kept set aside from its process's earlier session, whose lease lapsed: "
                    "they count until the daemon lets them go)")
        return why

    def hbm_bytes(self, client: int) -> int:
        """HBM bytes the client references. A walk over every reference: only when their bound
        (`ClientRefs.ref_slot_bytes`) does not settle it."""
        rows = np.fromiter(self.table.client(client).refs, dtype=np.int64)
        return self.table.ref_slots(rows[self.table.cols.tier[rows] == int(Tier.HBM)])

    def queue_places(self) -> int | None:
        """How many of the deferred queue's places one client may take (None: no bound)."""
        if not self.limited:
            return None
        return max(1, math.ceil(self.settings.max_client_share * self.settings.max_deferred))
