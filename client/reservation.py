"""A reservation's answer, as the client library hands it out: the daemon's decision (granted,
deferred with its queue position and estimated wait, or rejected with the reason)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Reservation:
    """The daemon's decision on a reservation (mirrors `reservations.Decision`)."""

    outcome: str  # "granted" | "deferred" | "rejected"
    reservation_id: int | None
    reason: str = ""
    position: int | None = None
    est_wait_s: float | None = None

    @property
    def granted(self) -> bool:
        return self.outcome == "granted"

    @property
    def deferred(self) -> bool:
        return self.outcome == "deferred"

    @property
    def rejected(self) -> bool:
        return self.outcome == "rejected"


def reservation_of(result: dict) -> Reservation:
    """The decision from a reply's fields, those this client knows: a newer daemon may append
    fields (protocol.py), and `Reservation(**result)` raised TypeError on them (the reservation
    held, its id never learned)."""
    return Reservation(**{f.name: result[f.name] for f in dataclasses.fields(Reservation) if f.name in result})
