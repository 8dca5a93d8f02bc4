"""Shared by the reservation tests: admission settings that leave pacing out of the way unless a
test asks for it, and a counter of room-making passes."""

from dflash2.reservations import AdmissionSettings


def settings(**kw) -> AdmissionSettings:
    base = dict(smoothing_window_s=1.0, burst_fraction=1.0, reservation_ttl_s=30.0, max_deferred=8)
    base.update(kw)
    return AdmissionSettings(**base)


def count_room_making(mgr) -> list:
    """A list that grows by one at each `placement.make_room` call of `mgr` from now on."""
    made = []
    make_room = mgr.placement.make_room
    mgr.placement.make_room = lambda *a, **kw: made.append(1) or make_room(*a, **kw)
    return made
