"""Reservations and admission: HBM capacity is handed out before a request runs.

A reservation asks for enough HBM blocks for a request's expected tokens. The answer is

- GRANTED: the blocks are taken now (state RESERVED, in HBM) and handed to the request by `take`;
- DEFERRED: queued (priority first, then arrival), with its position and an estimated wait;
- REJECTED: it can never fit, the client's share forbids it, the queue is full of reservations of its
  priority or higher (one of higher priority takes the place of the latest of the lowest, whose
  next call is told it was displaced), or it expired.

Making room demotes idle blocks (nobody references them: cache, whatever the priority of the request
that wrote them, since a finished request's priority protects nothing and its blocks would otherwise
shut every lower priority out of HBM for as long as they stay cached; the policy's ranking decides
which go first); a higher-priority reservation may also demote the blocks of running lower-priority
requests (preemption). Pinned blocks never move. On a node whose HBM is its last tier, making room
drops idle blocks only: a referenced block is never dropped.

The queue holds room against `allocate` too (`held_ahead`): an allocation outside any
reservation takes HBM only beyond what the reservations waiting at its priority or above need, so a
stream of small allocations cannot pass a deferred reservation until it expires (a client that
references blocks may be growing a running request and is not held back: that request could never
finish and free the room). A reservation lives at most `reservation_ttl_s` untaken: a client's
deadline may shorten that, never lengthen it.

Reservations of different HBM slot sizes (two models on one node) share the queue's order but not its
head-of-line wait: one of a slot size that no reservation ahead of it waits with is granted out of
its turn when its blocks fit in free slots of their size in slabs already in use, room that those
ahead cannot use now (`_passes`). One that needs free pages waits its turn: the head may need them.
The price: the slabs it takes stay in use while its request holds them, so a head that would have
had their pages once their other blocks were let go waits for that request too.

Smoothing: demotions set off by admission draw on a token bucket. It starts with `burst_fraction`
of the HBM tier and refills at the demand rate low-pass filtered over `smoothing_window_s`, so a
spike of arrivals is paced over the window instead of setting off a storm of demotions; what the
bucket cannot pay for now waits in the queue. Demand is what was admitted (granted or queued), not
what was rejected; and a reservation still waiting is demand still there: while the queue is not
empty the bucket refills at least at its head's bytes (or the burst) per window, so a reservation
that only the bucket holds back is never left waiting on demand that has died down.
"""

from dflash2.reservations.admission import Admission
from dflash2.reservations.records import (PRIORITY_MAX, PRIORITY_MIN, AdmissionSettings, Decision, Outcome,
                                          Reservation)

__all__ = ["Admission", "AdmissionSettings", "Decision", "Outcome", "PRIORITY_MAX", "PRIORITY_MIN", "Reservation"]
