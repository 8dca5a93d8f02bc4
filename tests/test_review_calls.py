"""Calls that failed part-way or poisoned other clients (a review of 2026-12-05, each reproduced on
a real daemon before its fix)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import write_config
from daemon_proc import DaemonProcess

from dflash2.client import Client, DaemonError
from dflash2.errors import LayoutError
from dflash2.layout import Layout
from dflash2.protocol import Op
from dflash2.alloc import SlotAllocator
from dflash2.table.table import BlockTable
from dflash2.tiers import Tier

SMALL = Layout("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)


def test_a_layout_whose_slot_would_pass_int64_is_refused_and_harms_no_other_client(tmp_path):
    """A block within one alignment of 2^63 bytes was taken; its slot rounded to 2^63, and every
    client's allocate, reserve and check then failed (OverflowError) until a restart, the failed
    allocates leaving their blocks held."""
    huge = {"name": "huge", "num_layers": (1 << 61) - 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "fp16",
            "tokens_per_block": 1}  # (2^61 - 1) * 4 bytes: 2^63 - 4
    with pytest.raises(LayoutError, match="exceeds 4611686018427387904"):
        Layout.from_dict(huge)
    proc = DaemonProcess(write_config(tmp_path)).start()
    try:
        with Client.connect(proc.endpoint, name="bad", layouts=[SMALL]) as bad, \
                Client.connect(proc.endpoint, name="victim", layouts=[SMALL]) as victim:
            with pytest.raises(DaemonError, match="LayoutError"):
                bad._call(Op.REGISTER_LAYOUT, {"layout": huge})
            assert len(victim.allocate(victim.layouts[0], 2)) == 2
            victim.check()
    finally:
        proc.stop()


def test_an_allocate_that_fails_part_way_leaves_no_block_held():
    """The rows were taken and counted as the client's before the slot bytes were summed: a failure
    there left them held while the call failed."""
    table = BlockTable({Tier.HBM: SlotAllocator(1 << 20, 1 << 16, 256)})
    lid = table.register_layout(SMALL)
    client = table.add_client("c")

    def broken(tier):
        raise OverflowError("Python int too large to convert to C long")

    table.slot_sizes = broken
    with pytest.raises(OverflowError):
        table.allocate(client, lid, 2, tier=Tier.HBM)
    assert not table.client(client).refs
    assert not np.any(table.cols.refs)
    assert table.allocators[Tier.HBM].used_slots == 0


def test_swap_seconds_are_the_copies_own_time(tmp_path):
    """Each batch counted from its move's start to its settling: the wait behind the earlier batches
    of its move and, for a drain piece, until the loop settled it (a review: 5.07 s of "copy time"
    summed in 3.26 s of wall time, on a host daemon whose one worker copies a batch at a time). Now
    the backend's own time: summed over every direction it stays under the wall time."""
    config = write_config(tmp_path, policy={"name": "lru", "swap_batch_size": 8},
                          memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 64})
    proc = DaemonProcess(config).start()
    try:
        with Client.connect(proc.endpoint, name="w", layouts=[SMALL]) as c:
            started = time.perf_counter()
            key = 1
            for _ in range(12):  # 12 x 256 blocks of 16 KiB: HBM and DRAM fill, DRAM drains to NVMe
                placed = c.allocate(c.layouts[0], 256)
                held = c.commit(placed["vid"], keys=list(range(key, key + 256)))
                key += 256
                c.free(held)
            time.sleep(3)
            moves = c.stats()["moves"]
            wall = time.perf_counter() - started
        assert moves["dram->nvme"]["batches"] > 10
        for d, m in moves.items():
            assert m["timed_batches"] == m["batches"], d  # (the host backend times every batch)
        assert sum(m["seconds"] for m in moves.values()) < wall
    finally:
        proc.stop()


def test_a_reply_that_cannot_be_encoded_gives_back_what_its_call_handed_out(make_manager, monkeypatch):
    """Its client never learns what the call handed out (it sends `forget` only after a timeout, not
    after an error reply): the blocks stayed held until detach. Now the daemon gives them back and
    says so in the InternalError."""
    from dflash2 import protocol as P
    from dflash2.daemon import service as service_module
    from dflash2.daemon.service import Service

    svc = Service(make_manager(hbm_blocks=16), lease_timeout_s=60.0, heartbeat_interval_s=10.0)
    att = P.decode_reply(svc.handle_frames(P.encode_request(Op.ATTACH, 1, None, {"name": "c", "pid": 1,
                                                                                "layouts": [SMALL.to_dict()]})))
    client, token = att.result["client"], att.result["token"]
    real = P.encode_reply

    def broken(reply):
        if reply.ok and reply.result.get("allocated"):
            raise TypeError("Object of type bytes_ is not JSON serializable")
        return real(reply)

    monkeypatch.setattr(service_module.P, "encode_reply", broken)
    out = P.decode_reply(svc.handle_frames(P.encode_request(Op.ALLOCATE, 2, client, {"layout": 0, "n": 3},
                                                            token=token)))
    assert not out.ok and out.error_type == "InternalError"
    assert "what the call handed out was given back" in out.error_message
    assert not svc.manager.table.client(client).refs
    assert svc.manager.table.allocators[Tier.HBM].used_slots == 0


def test_a_reservation_among_idle_blocks_of_another_size_is_not_told_they_cannot_move(tmp_path):
    """HBM full of idle cached 16 KiB blocks (DRAM below: all can move); a reservation of 2 MiB
    blocks past the admission bucket was told "HBM is held by blocks that cannot move now" with no
    wait estimate, and granted at the next step (a review): only blocks of its own size counted as
    movable, though room for it is made by emptying other sizes' slabs."""
    config = write_config(tmp_path, policy={"name": "lru", "cold_threshold": 0.2, "swap_batch_size": 1024},
                          memory={"hbm_capacity_mb": 64, "dram_capacity_mb": 256, "nvme_capacity_mb": 0,
                                  "page_kb": 2048})
    big = Layout("big", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16", tokens_per_block=16)  # 2 MiB
    proc = DaemonProcess(config).start()
    try:
        with Client.connect(proc.endpoint, name="small", layouts=[SMALL]) as small, \
                Client.connect(proc.endpoint, name="asker", layouts=[big]) as asker:
            for start in range(0, 4096, 256):
                placed = small.allocate(small.layouts[0], 256)
                small.free(small.commit(placed["vid"], keys=list(range(start + 1, start + 257))))
            time.sleep(0.5)  # (background steps: HBM drained to its watermark)
            decision = asker.reserve(asker.layouts[0], 16 * 16)  # 32 MiB: past the bucket
            assert decision.deferred, decision
            assert "cannot move" not in decision.reason and decision.est_wait_s is not None, decision
    finally:
        proc.stop()


def test_idle_blocks_in_slabs_that_cannot_empty_are_not_room_for_another_size():
    """Counted by their slots whatever their slab, idle blocks of another size made a reservation
    whose every slab held a block being written "not enough HBM free yet", to wait 0 s, though
    room-making could free nothing (a review): such a reservation waits on blocks that cannot move."""
    from dflash2.manager import BlockManager, TierSpec
    from dflash2.reservations import AdmissionSettings, Outcome

    page_bytes = 64 << 10
    now = [1000.0]
    mgr = BlockManager([TierSpec(Tier.HBM, 4 * page_bytes, page_bytes, 256),
                        TierSpec(Tier.DRAM, 16 * page_bytes, page_bytes, 256)], policy="lru", clock=lambda: now[0],
                       admission=AdmissionSettings(smoothing_window_s=1.0, burst_fraction=1.0, reservation_ttl_s=30.0,
                                                   max_deferred=8))
    a, b = mgr.attach("a"), mgr.attach("b")
    s = mgr.register_layout(SMALL)
    page = mgr.register_layout(Layout("page", num_layers=8, num_kv_heads=2, head_dim=64, dtype="fp16",
                                      tokens_per_block=16))  # 64 KiB
    vids = mgr.allocate(a, s, 16)  # HBM full: four pages of four
    idle = np.array([v for i, v in enumerate(vids) if i % 4])  # one block of each page stays being written
    mgr.free(a, mgr.commit(a, idle, keys=list(range(1, len(idle) + 1))))
    d = mgr.reserve(b, page, tokens=16)
    assert d.outcome is Outcome.DEFERRED
    assert d.est_wait_s is None and "cannot move" in d.reason, d
    mgr.check_invariants()
