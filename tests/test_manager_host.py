"""The block manager over real host arenas, built from a config as the daemon builds it."""

import logging
import re

import numpy as np
import pytest

from dflash2.assemble import build_manager
from dflash2.config import load_config
from dflash2.errors import CapacityError, UnknownBlock
from dflash2.layout import Layout
from dflash2.tiers import Tier

LAYOUT = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB


@pytest.fixture
def mgr(config_file, instance_name):
    m = build_manager(load_config(config_file()), instance=instance_name)
    yield m
    m.close()


def write(mgr, client, lid, n, seed, keys=None):
    vids = mgr.allocate(client, lid, n)
    data = []
    for i, v in enumerate(vids.tolist()):
        b = np.random.default_rng(seed + i).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
        mgr.view(v)[:] = b
        data.append(b)
    return mgr.commit(client, vids, keys=keys), data


def test_bytes_survive_hbm_dram_nvme_and_back(mgr):
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    vids, data = write(mgr, a, lid, 8, seed=1, keys=list(range(1, 9)))
    rows = mgr.table.rows(vids)
    assert mgr.mover.move(rows, Tier.DRAM).all()
    assert mgr.mover.move(rows, Tier.NVME).all()
    assert {mgr.place(int(v)).tier for v in vids} == {Tier.NVME}
    places = mgr.acquire(a, vids)
    assert [p.tier for p in places] == [Tier.HBM] * 8
    for v, b in zip(vids.tolist(), data):
        assert bytes(mgr.view(v)) == b.tobytes()
    mgr.check_invariants()


def test_a_corrupt_block_on_nvme_is_a_miss_not_wrong_data(mgr, caplog):
    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    vids, data = write(mgr, a, lid, 3, seed=7, keys=[101, 102, 103])
    mgr.free(a, vids)  # cached, nobody holds them
    rows = mgr.table.rows(vids)
    mgr.mover.move(rows, Tier.NVME)
    nvme = mgr.arenas[Tier.NVME]
    nvme.corrupt_for_test(mgr.place(int(vids[1])).offset)
    with caplog.at_level(logging.WARNING):
        # Not None ("no room now": HBM has room, and a retry could never succeed): named.
        with pytest.raises(UnknownBlock, match=f"block {int(vids[1]):#x} failed its read back from NVMe \\(an I/O error, or bytes that failed their checksum.*look the chain up again"):
            mgr.acquire(a, vids)
    assert f"1 of 3 blocks read back from NVMe failed their checksum or read (block {int(vids[1]):#x}" in caplog.text
    # The byte named is the file's (past its header), where `dd skip=` finds the block; so do the
    # slots set aside. (Both said the tier's offset, a page short of the block, as "of the NVMe file".)
    said = re.search(r"block 0x[0-9a-f]+ at byte (\d+) of the NVMe file", caplog.text)
    assert said and f"the first at byte {said[1]} of the NVMe file {nvme.path}" in caplog.text
    assert f"at byte {said[1]} of the NVMe file {nvme.path}" in caplog.text  # (which file: several pools, a review)
    with open(nvme.path, "rb") as f:
        f.seek(int(said[1]))
        on_disk = np.frombuffer(f.read(LAYOUT.block_bytes), dtype=np.uint8)
    assert (on_disk != data[1]).sum() == 1 and on_disk[0] == data[1][0] ^ 0xFF
    found = mgr.lookup([101, 102, 103], lid)
    assert [p.vid for p in found] == [int(vids[0])], "the corrupt block and what hangs below it are gone"
    assert mgr.mover.stats[(Tier.NVME, Tier.HBM)].failed_blocks == 1
    moved = mgr.mover.stats[(Tier.NVME, Tier.HBM)]
    assert moved.bytes == moved.blocks * LAYOUT.block_bytes, "a failed copy's bytes are not bytes moved"
    mgr.check_invariants()


def test_start_up_fails_clearly_when_the_disk_is_short(config_file, instance_name):
    cfg = load_config(config_file(memory={"nvme_capacity_mb": 1 << 26}))  # 64 TB
    with pytest.raises(CapacityError, match="needs .* bytes"):
        build_manager(cfg, instance=instance_name)


def test_tiers_are_sized_from_the_config(mgr):
    st = mgr.stats()["tiers"]
    assert st["hbm"]["capacity_bytes"] == 8 << 20
    assert st["dram"]["capacity_bytes"] == 16 << 20
    assert st["nvme"]["capacity_bytes"] == 32 << 20
    assert mgr.arenas[Tier.HBM].describe()["name"].endswith("-hbm")


def test_heat_policy_takes_its_weights_and_interval_from_the_config(config_file, instance_name):
    cfg = load_config(config_file(policy={"name": "heat", "rescore_interval_ms": 250,
                                          "weights": {"frequency": 2.0, "priority": 0.0}},
                                  kv_block={"block_size": 16, "prefetch_window": 3}))
    m = build_manager(cfg, instance=instance_name)
    try:
        assert m.policy.name == "heat"
        assert m.policy.weights["frequency"] == 2.0 and m.policy.weights["priority"] == 0.0
        assert m.policy.rescore_interval_s == 0.25
        assert m.prefetcher.base == 3
    finally:
        m.close()


def test_a_move_into_the_tier_a_block_lies_in_changes_nothing(mgr):
    """Its copy batch (a copy from a tier to itself) was refused after the block was marked in flight and
    its new slot taken: the block stayed MIGRATING for good (never pinned again) and the slot leaked."""
    from dflash2.table import BlockState

    a = mgr.attach("a")
    lid = mgr.register_layout(LAYOUT)
    vids, data = write(mgr, a, lid, 1, seed=3, keys=[31])
    rows = mgr.table.rows(vids)
    with pytest.raises(ValueError, match="to itself"):
        mgr.mover.move(rows, Tier.HBM)
    assert mgr.table.cols.state[rows[0]] == int(BlockState.RESIDENT)
    assert mgr.table.allocators[Tier.HBM].used_slots == 1
    mgr.check_invariants()
    assert [p.tier for p in mgr.acquire(a, vids)] == [Tier.HBM]
    assert bytes(mgr.view(int(vids[0]))) == data[0].tobytes()
