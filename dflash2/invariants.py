"""The block table's invariants, recomputed from scratch. Tests call this after every step; the
daemon can run it on demand (`check_invariants`). A violation raises InvariantViolation listing
every problem found, never a count clamped into place."""

from __future__ import annotations

from collections import Counter

import numpy as np

from dflash2.errors import DFlash2Error
from dflash2.table import BlockState, BlockTable
from dflash2.table.columns import NO_CLIENT, NO_ROW


class InvariantViolation(DFlash2Error):
    """The block table contradicts itself: a bug in dflash2, never a client's fault."""


def check_invariants(table: BlockTable, in_flight_bytes: dict | None = None,
                     in_flight_blocks: dict | None = None) -> None:
    problems: list[str] = []
    c = table.cols
    live = table.live_rows()
    if (c.tier[live] < 0).any():
        problems.append("a live block has no tier")
    free_rows = np.flatnonzero(c.state == int(BlockState.FREE))
    if (c.tier[free_rows] >= 0).any():
        problems.append("a free row still names a tier")
    # Tier usage adds up: allocator bytes == slots of the rows in each tier (+ moves in flight).
    counted = table.tier_blocks()
    for tier, alloc in table.allocators.items():
        here = live[c.tier[live] == int(tier)]
        slots = table.slot_sizes(tier)
        want = int(np.bincount(c.layout[here], minlength=len(slots)) @ slots) if len(slots) else 0
        want += (in_flight_bytes or {}).get(tier, 0)
        if alloc.used_bytes != want:
            problems.append(f"{tier.label}: allocator says {alloc.used_bytes} bytes used, blocks hold {want}")
        offs = c.offset[here]
        order = np.argsort(offs, kind="stable")  # (one sort for both checks below)
        starts = offs[order]
        if len(starts) > 1 and (starts[1:] == starts[:-1]).any():
            problems.append(f"{tier.label}: two blocks share a slot")
        elif len(starts) > 1:
            # Blocks of several sizes: a slot that begins inside another's shares its bytes as surely
            # as one at the same offset (only equal offsets were looked for: a review).
            ends = starts + slots[c.layout[here[order]]]
            inside = np.flatnonzero(ends[:-1] > starts[1:])
            if len(inside):
                a, b = here[order[inside[0]]], here[order[inside[0] + 1]]
                va, vb = (int(v) for v in table.vids(np.array([a, b])))
                problems.append(f"{tier.label}: block {vb:#x}'s slot at {int(c.offset[b])} begins inside block "
                                f"{va:#x}'s, [{int(c.offset[a])}, {int(ends[inside[0]])})")
        # A quarantined slot (its write failed by itself: quarantine.py) is never handed out again.
        if alloc.quarantined_bytes and np.isin(offs, alloc.quarantined_offsets()).any():
            problems.append(f"{tier.label}: a block lies in a quarantined slot")
        arriving = (in_flight_blocks or {}).get(tier, 0)  # destination slots of copies in flight
        if counted[tier] - arriving != len(here):
            problems.append(f"{tier.label}: tier_blocks says {counted[tier]} blocks ({arriving} on their way), "
                            f"{len(here)} lie there")
    # Refs and pins equal the per-client sums.
    refs, pins = Counter(), Counter()
    for holder in table.clients.values():
        refs.update(holder.refs)
        pins.update(holder.pins)
    for name, want_counts in (("refs", refs), ("pins", pins)):
        arr = getattr(c, name)
        want = np.zeros(c.capacity, dtype=np.int64)
        for r, n in want_counts.items():
            want[r] = n
        bad = np.flatnonzero(arr != want)
        if len(bad):
            problems.append(f"{name} of row {int(bad[0])} is {int(arr[bad[0]])}, clients hold {int(want[bad[0]])}")
    for holder in table.clients.values():  # the share check's bound, kept as references change
        rows = np.fromiter(holder.refs.keys(), dtype=np.int64, count=len(holder.refs))
        counts = np.fromiter(holder.refs.values(), dtype=np.int64, count=len(holder.refs))
        taken = table.ref_slots(rows, counts)
        if holder.ref_slot_bytes != taken:
            problems.append(f"client {holder.client_id} counts {holder.ref_slot_bytes} bytes of references, "
                            f"its references take {taken}")
    if (c.refs[live] < 0).any() or (c.pins[live] < 0).any():
        problems.append("a negative reference or pin count")
    # Private blocks have an owner; published ones are keyed and indexed.
    private = live[c.key[live] == 0]
    pending = np.fromiter(table.pending_frees(), dtype=np.int64)
    kept = np.fromiter(table.pinned_copies, dtype=np.int64)
    if len(kept) and ((c.pins[kept] == 0) | (c.refs[kept] != 0) | (c.key[kept] != 0)).any():
        problems.append("a deduplicated copy is kept although unpinned, referenced or published")
    # A lost block (unpublished after a failed checksum) stays while it is referenced or pinned: its
    # last unpin frees it (table.unpin), so one held by pins alone is not a leak.
    lost = np.fromiter(table.lost, dtype=np.int64, count=len(table.lost))
    held_lost = lost[c.pins[lost] > 0]
    leaked = private[(c.refs[private] == 0) & ~np.isin(private, pending) & ~np.isin(private, kept)
                     & ~np.isin(private, held_lost)]
    if len(leaked):
        problems.append(f"private block row {int(leaked[0])} has no reference left but was not freed (leaked)")
    ownerless = private[c.owner[private] == NO_CLIENT]
    if len(ownerless) and not set(ownerless.tolist()) <= table.lost:
        problems.append("a private block has no owner (and was not dropped as lost)")
    published = live[c.key[live] != 0]
    if len(table.keys) != len(published):
        problems.append(f"key index holds {len(table.keys)} keys, {len(published)} blocks are published")
    if len(published):
        found = table.keys.lookup(c.key[published])
        if (found != published).any():
            problems.append("a published block is not found by its own key")
    # A published block nobody holds carries its writer's priority (what holders raised it to lapsed).
    unheld = published[(c.refs[published] == 0) & (c.pins[published] == 0)]
    raised = unheld[c.priority[unheld] != c.base_priority[unheld]]
    if len(raised):
        problems.append(f"published block row {int(raised[0])} is held by nobody but keeps priority "
                        f"{int(c.priority[raised[0]])} (its writer's is {int(c.base_priority[raised[0]])})")
    # kids[t, p] equals the number of children of p in tier t.
    kids = np.zeros_like(c.kids)
    linked = live[c.parent[live] != NO_ROW]
    np.add.at(kids, (c.tier[linked], c.parent[linked]), 1)
    if (kids != c.kids).any() or (kids.sum(axis=0) != c.nkids).any():
        problems.append("child counts per tier do not match the parent links")
    if (c.state[c.parent[linked]] == int(BlockState.FREE)).any():
        problems.append("a cached block's parent was freed before it")
    if problems:
        raise InvariantViolation("; ".join(problems))
