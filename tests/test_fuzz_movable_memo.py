"""Random operations against the placement's memo of tiers with nothing movable, and `ref_slot_bytes`.

After every operation (and at every memo hit, even in the middle of a manager call) a memo entry
that says "nothing movable" at the tier's current epoch must agree with a fresh `movable` scan.
check_invariants (ref_slot_bytes among them) runs after every operation.
A second check compares select() with the memo against select() with the memo cleared.
"""
from __future__ import annotations

import numpy as np
import pytest

from dflash2.errors import DFlash2Error
from dflash2.manager import BlockManager
from dflash2.placement import Placement
from dflash2.reservations import AdmissionSettings, Outcome
from dflash2.tiers import Tier

from conftest import SMALL, SMALL_FP8, FakeClock, specs

class MemoViolation(AssertionError):
    pass


def memo_stale(pl: Placement) -> list:
    bad = []
    for (t, ev, idle), epoch in pl._nothing_movable.items():
        if int(pl.table.movable_epoch[t]) == epoch:
            if pl.movable(Tier(t), evict=ev, idle_only=idle).any():
                bad.append((t, ev, idle))
    return bad


def install_checking_select(monkeypatch):
    real = Placement.select

    def select(self, tier, need_bytes, *, evict, **kw):
        way = (int(tier), evict, kw.get("idle_only", False))
        if self._nothing_movable.get(way) == int(self.table.movable_epoch[int(tier)]):
            if self.movable(tier, evict=evict, idle_only=way[2]).any():
                raise MemoViolation(f"memo says nothing movable for {way}, but a scan finds some")
        out = real(self, tier, need_bytes, evict=evict, **kw)
        # Same answer without the memo.
        saved = dict(self._nothing_movable)
        self._nothing_movable.clear()
        fresh = real(self, tier, need_bytes, evict=evict, **kw)
        self._nothing_movable.clear()
        self._nothing_movable.update(saved)
        if out.tolist() != fresh.tolist():
            raise MemoViolation(f"select {way} differs with/without memo: {out.tolist()} vs {fresh.tolist()}")
        return out

    monkeypatch.setattr(Placement, "select", select)


def run(seed: int, steps: int = 300):
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    nvme = int(rng.integers(0, 2)) * 16
    mgr = BlockManager(specs(8, 12, nvme), clock=clock, swap_batch_size=4,
                       admission=AdmissionSettings(burst_fraction=float(rng.choice([0.25, 1.0])), max_deferred=4,
                                                   max_client_share=float(rng.choice([0.5, 1.0]))))
    lids = [mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)]
    clients = [mgr.attach("c0"), mgr.attach("c1")]
    held: dict[int, list[int]] = {c: [] for c in clients}  # one entry per reference
    writing: dict[int, list[int]] = {c: [] for c in clients}
    pinned: dict[int, list[int]] = {c: [] for c in clients}
    res: list[tuple[int, int]] = []
    published: list[int] = []
    log = []

    def live(v):
        try:
            mgr.table.rows([v])
            return True
        except Exception:
            return False

    for step in range(steps):
        op = rng.choice(["alloc", "alloc", "commit", "commit", "free", "addref", "acquire", "release",
                         "reserve", "take", "cancel", "tick", "lost", "detach", "attach", "lookup"])
        c = clients[int(rng.integers(len(clients)))] if clients else None
        log.append((step, op))
        try:
            if op == "attach" or c is None:
                n = mgr.attach(f"c{step}")
                clients.append(n)
                held[n], writing[n], pinned[n] = [], [], []
            elif op == "alloc":
                tier = Tier.DRAM if rng.random() < 0.3 else Tier.HBM
                vids = mgr.allocate(c, lids[int(rng.integers(2))], int(rng.integers(1, 4)), tier=tier,
                                    priority=int(rng.integers(0, 3)))
                if vids is not None:
                    held[c] += vids.tolist()
                    writing[c] += vids.tolist()
            elif op == "commit" and writing[c]:
                k = int(rng.integers(1, len(writing[c]) + 1))
                vids = writing[c][:k]
                if rng.random() < 0.3 and pinned[c] == [] and rng.random() < 0.5:
                    mgr.acquire(c, vids[:1])  # a pinned copy, if deduplicated
                    pinned[c].append(vids[0])
                if rng.random() < 0.2:
                    out = mgr.commit(c, vids)
                else:
                    keys = [int(x) for x in rng.integers(1, 12, size=k)]
                    if len(set(keys)) != len(keys):
                        keys = list(dict.fromkeys(keys)) + [100 + step * 10 + i for i in range(k - len(set(keys)))]
                    parent = None
                    out = mgr.commit(c, vids, keys=keys, parent=parent)
                    published += out.tolist()
                writing[c] = writing[c][k:]
                for v in vids:
                    held[c].remove(v)
                held[c] += out.tolist()
            elif op == "free" and held[c]:
                v = held[c][int(rng.integers(len(held[c])))]
                if v in writing[c] and v in pinned[c]:
                    continue
                mgr.free(c, [v])
                held[c].remove(v)
                if v in writing[c]:
                    writing[c].remove(v)
            elif op == "addref" and published:
                v = published[int(rng.integers(len(published)))]
                if live(v):
                    mgr.add_ref(c, [v])
                    held[c].append(v)
            elif op == "acquire":
                cand = [v for v in published if live(v)] + [v for v in held[c] if live(v)]
                if cand:
                    v = cand[int(rng.integers(len(cand)))]
                    up = Tier.DRAM if rng.random() < 0.2 else Tier.HBM
                    if mgr.acquire(c, [v], up_to=up) is not None:
                        pinned[c].append(v)
            elif op == "release" and pinned[c]:
                v = pinned[c].pop(int(rng.integers(len(pinned[c]))))
                mgr.release(c, [v])
            elif op == "reserve":
                d = mgr.reserve(c, lids[int(rng.integers(2))], int(rng.integers(1, 80)), priority=int(rng.integers(0, 3)))
                if d.outcome in (Outcome.GRANTED, Outcome.DEFERRED):
                    res.append((c, d.reservation_id))
            elif op == "take" and res:
                rc, rid = res[int(rng.integers(len(res)))]
                r = mgr.admission.find(rid)
                if r is not None and r.granted and r.remaining and rc in held:
                    vids = mgr.take(rc, rid, int(rng.integers(1, r.remaining + 1)))
                    writing[rc] += vids.tolist()
                    held[rc] += vids.tolist()
            elif op == "cancel" and res:
                rc, rid = res.pop(int(rng.integers(len(res))))
                if rc in held and mgr.admission.find(rid) is not None:
                    mgr.cancel(rc, rid)
            elif op == "tick":
                clock.advance(float(rng.choice([0.01, 0.5, 3.0])))
                mgr.tick()
            elif op == "lost":
                rows = mgr.table.live_rows()
                if len(rows):
                    pick = rng.choice(rows, size=min(len(rows), int(rng.integers(1, 4))), replace=False)
                    pick = pick[(mgr.table.cols.key[pick] != 0) & (mgr.table.cols.pins[pick] == 0)]
                    if len(pick):
                        mgr.table.drop_lost(pick)
            elif op == "detach" and len(clients) > 1:
                mgr.detach(c)
                clients.remove(c)
                del held[c], writing[c], pinned[c]
                res = [(x, r) for x, r in res if x != c]
            elif op == "lookup":
                keys = [int(x) for x in rng.integers(1, 12, size=3)]
                mgr.lookup_rows(keys, client=c)
        except MemoViolation:
            raise
        except (DFlash2Error, ValueError) as e:  # refusals are fine; the checks below are what matter
            log.append(("exc", type(e).__name__, str(e)[:80]))
        # drop vids of the model that died (lost / freed elsewhere)
        for cc in list(held):
            held[cc] = [v for v in held[cc] if live(v)]
            writing[cc] = [v for v in writing[cc] if live(v) and v in held[cc]]
            pinned[cc] = [v for v in pinned[cc] if live(v)]
        bad = memo_stale(mgr.placement)
        if bad:
            raise MemoViolation(f"seed {seed} step {step} op {op}: stale memo {bad}\n{log[-8:]}")
        try:
            mgr.check_invariants()
        except Exception as e:
            raise AssertionError(f"seed {seed} step {step}: {e}\n" + "\n".join(map(str, log[-10:])))
    mgr.close()


@pytest.mark.parametrize("seed", range(12))
def test_the_nothing_movable_memo_agrees_with_a_fresh_scan_under_random_operations(seed, monkeypatch):
    """Every memo hit (a tier said to have nothing movable at its current epoch) is checked against
    a fresh scan, and every selection against one made without the memo; the table's invariants
    (ref_slot_bytes among them) after every operation. Dropping any of the epoch bumps (commit,
    unpin, detach, references let go, a move's end) fails within these seeds (the review's mutation
    runs)."""
    install_checking_select(monkeypatch)
    run(seed)
