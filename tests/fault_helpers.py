"""Real host managers for fault injection, and the blocks they hold: each block's bytes are a pattern
of its key, so that a test can tell a right block from a wrong one wherever it lies."""

import errno

import numpy as np
import pytest

from dflash2.assemble import build_manager
from dflash2.config import load_config
from dflash2.layout import Layout
from dflash2.tiers import Tier

LAYOUT = Layout("t", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_block=16)  # 16 KiB


@pytest.fixture
def make_mgr(config_file, instance_name):
    """Real host managers: 1 MiB of HBM and DRAM (64 blocks each), 2 MiB of NVMe."""
    made = []

    def make(prefetch_window=0, policy=None):
        cfg = load_config(config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 1, "nvme_capacity_mb": 2,
                                              "staging_buffer_size_mb": 1},
                                      kv_block={"block_size": 16, "prefetch_window": prefetch_window},
                                      **({"policy": {"name": policy}} if policy else {})))
        made.append(build_manager(cfg, instance=instance_name))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.fixture
def mgr(make_mgr):
    return make_mgr()


def pattern(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def publish(m, client, lid, keys, chained=True) -> np.ndarray:
    """Blocks holding pattern(key), published (one chain, or each its own root), held by nobody."""
    groups = [keys] if chained else [[k] for k in keys]
    out = []
    for group in groups:
        vids = m.allocate(client, lid, len(group))
        for v, k in zip(vids.tolist(), group):
            m.view(v)[:] = pattern(k)
        vids = m.commit(client, vids, keys=group)
        m.free(client, vids)
        out.append(vids)
    return np.concatenate(out)


def stored_bytes(m, vid: int) -> np.ndarray | None:
    """A block's bytes wherever it lies; None when its NVMe copy reads as a miss."""
    p = m.place(vid)
    if p.tier == Tier.NVME:
        buf = np.zeros(p.nbytes, np.uint8)
        return buf if m.arenas[Tier.NVME].read_blocks([p.offset], [buf])[0] else None
    return np.array(m.view(vid))


def to_nvme(m, vids) -> None:
    rows = m.table.rows(vids)[::-1]  # leaves first
    assert m.mover.move(rows, Tier.DRAM).all() and m.mover.move(rows, Tier.NVME).all()


def chain_on_nvme(m, keys):
    """A client, the layout and one published chain of `keys` moved down to NVMe: (client, layout, vids)."""
    a = m.attach("a")
    lid = m.register_layout(LAYOUT)
    vids = publish(m, a, lid, keys)
    to_nvme(m, vids)
    return a, lid, vids


def assert_intact(m, vids, keys) -> None:
    """Invariants hold, and each block is still found by its key, holding its own bytes."""
    m.check_invariants()
    for v, k in zip(np.asarray(vids).tolist(), keys):
        assert [p.vid for p in m.lookup([k])] == [v], f"block of key {k} was lost"
        got = stored_bytes(m, v)
        assert got is not None and np.array_equal(got, pattern(k)), f"block of key {k} holds wrong bytes"


def idle_blocks_in(mgr, clock, tier: Tier, n: int, first_key: int = 1) -> None:
    """n cached blocks in `tier`, idle, aged one tick apart."""
    a = mgr.attach(f"fill-{tier.label}")
    lid = mgr.register_layout(LAYOUT)
    for k in range(first_key, first_key + n):
        clock.advance(1)
        vids = mgr.allocate(a, lid, 1, tier=tier)
        mgr.view(int(vids[0]))[:] = pattern(k)
        mgr.free(a, mgr.commit(a, vids, keys=[k]))


def full_disk(offsets, sources):
    """An NVMe arena's write_blocks on a full disk."""
    raise OSError(errno.ENOSPC, "No space left on device")


def drained_down(m, tier: Tier) -> None:
    """`tier` (64 blocks) drained to its low watermark, its blocks moved down, none dropped."""
    placed = m.stats()["placement"]
    assert placed["evicted"] == 0 and placed["demoted"] > 0, placed
    assert m.stats()["tiers"][tier.label]["blocks"] <= int(m.placement.watermarks[tier].low * 64) + 1
    m.check_invariants()


def failing_disk(m, monkeypatch) -> tuple[list[bool], list[int]]:
    """NVMe's writes fail with ENOSPC while `failing[0]`; `writes` lists each batch's size."""
    nvme = m.arenas[Tier.NVME]
    write, writes, failing = nvme.write_blocks, [], [True]

    def disk(offsets, sources):
        writes.append(len(offsets))
        if failing[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(offsets, sources)

    monkeypatch.setattr(nvme, "write_blocks", disk)
    return failing, writes
