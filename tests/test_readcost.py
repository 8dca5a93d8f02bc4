"""Cost-aware reuse: tiers' read bandwidth measured from real moves, engines' prefill rates, lookups
that do not offer blocks slower to load than to recompute, placement that does not keep them below."""

from __future__ import annotations

import time

import numpy as np
import pytest
from daemon_proc import DaemonProcess

from dflash2.assemble import build_manager
from dflash2.client import DaemonError, chain_keys
from dflash2.config import load_config
from dflash2.layout import Layout
from dflash2.metrics import _access_families
from dflash2.readcost import MIN_SAMPLE_BYTES, ReadCost
from dflash2.status import render
from dflash2.tiers import Tier

from conftest import SMALL

MIB = 1 << 20
FAST_ENGINE = 1e12  # tokens per second: recomputing a block takes picoseconds, any read back is slower
SLOW_ENGINE = 1.0  # one token per second: every read back is faster


# -- the mechanism --------------------------------------------------------------------------
def test_an_unmeasured_path_has_no_figure_and_judges_nothing():
    rc = ReadCost()
    rc.set_rate(1, 0, FAST_ENGINE)
    assert rc.bandwidth(Tier.DRAM, Tier.HBM) is None
    assert rc.worth(1, [SMALL], np.array([0]), np.array([int(Tier.DRAM)]), Tier.HBM).all()
    rc.observe(Tier.DRAM, Tier.HBM, MIN_SAMPLE_BYTES - 1, 1.0)  # below the sample floor
    assert rc.bandwidth(Tier.DRAM, Tier.HBM) is None


def test_each_copy_reports_its_own_time_not_the_time_it_queued(tmp_path, instance_name):
    """The host backend copies one batch at a time: a batch started behind another reports only
    its own copy time, so the two reports add up to no more than the wall time of both."""
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2.transfer.base import CopyBatch
    from dflash2.transfer.host import HostTransferBackend
    arenas = {t: SharedMemoryArena.create(f"{instance_name}-{t.label}", 64 * MIB, t) for t in (Tier.HBM, Tier.DRAM)}
    backend = HostTransferBackend(arenas)
    try:
        offsets = np.arange(256, dtype=np.int64) * (256 << 10)
        sizes = np.full(256, 256 << 10, dtype=np.int64)
        t0 = time.perf_counter()
        jobs = [backend.start(CopyBatch(Tier.DRAM, Tier.HBM, offsets, offsets, sizes)) for _ in range(2)]
        assert all(job.wait().all() for job in jobs)
        wall = time.perf_counter() - t0
        assert all(job.seconds > 0 for job in jobs)
        assert jobs[0].seconds + jobs[1].seconds <= wall
    finally:
        backend.close()
        for arena in arenas.values():
            arena.close()


def test_the_figure_follows_the_machine():
    rc = ReadCost(decay=0.5)
    for _ in range(20):
        rc.observe(Tier.DRAM, Tier.HBM, MIB, 0.001)  # 1 MiB per ms
    for _ in range(20):
        rc.observe(Tier.DRAM, Tier.HBM, MIB, 0.01)  # ten times slower now
    assert rc.bandwidth(Tier.DRAM, Tier.HBM) == pytest.approx(MIB / 0.01, rel=1e-3)


def test_a_read_from_two_tiers_down_adds_the_hops_when_the_direct_path_is_unmeasured():
    rc = ReadCost()
    rc.observe(Tier.NVME, Tier.DRAM, 2 * MIB, 1.0)
    rc.observe(Tier.DRAM, Tier.HBM, 4 * MIB, 1.0)
    assert rc.seconds_per_byte(Tier.NVME, Tier.HBM) == pytest.approx(1 / (2 * MIB) + 1 / (4 * MIB))
    rc.observe(Tier.NVME, Tier.HBM, 8 * MIB, 1.0)
    assert rc.seconds_per_byte(Tier.NVME, Tier.HBM) == pytest.approx(1 / (8 * MIB))
    assert rc.seconds_per_byte(Tier.HBM, Tier.HBM) == 0.0


def test_a_block_is_offered_when_it_loads_faster_than_it_is_recomputed():
    rc = ReadCost()
    rc.observe(Tier.DRAM, Tier.HBM, 16 * MIB, 1.0)  # 16 MiB/s: a 16 KiB block loads in 1/1024 s
    load = SMALL.block_bytes / (16 * MIB)
    recompute_rate = SMALL.tokens_per_block / load  # the rate at which recomputing takes as long
    tiers = np.array([int(Tier.HBM), int(Tier.DRAM)])
    rc.set_rate(1, 0, recompute_rate * 0.9)  # recomputing takes a little longer: worth the read
    assert rc.worth(1, [SMALL], np.zeros(2, dtype=np.int64), tiers, Tier.HBM).tolist() == [True, True]
    rc.set_rate(1, 0, recompute_rate * 1.1)  # recomputing is quicker: the DRAM block is not offered
    assert rc.worth(1, [SMALL], np.zeros(2, dtype=np.int64), tiers, Tier.HBM).tolist() == [True, False]
    # Another client without a rate, and a host-side reader already in DRAM, are not judged.
    assert rc.worth(2, [SMALL], np.zeros(2, dtype=np.int64), tiers, Tier.HBM).all()
    assert rc.worth(1, [SMALL], np.zeros(2, dtype=np.int64), tiers, Tier.DRAM).all()
    # Only a client that gave a rate is judged (lookups of the others skip the check): a rate
    # withdrawn (None) or a client gone is no longer judged, and its blocks are offered again.
    assert rc.judges(1) and not rc.judges(2) and not rc.judges(None)
    rc.set_rate(1, 0, None)
    assert not rc.judges(1) and rc.worth(1, [SMALL], np.zeros(2, dtype=np.int64), tiers, Tier.HBM).all()
    rc.set_rate(1, 0, recompute_rate * 1.1)
    rc.drop_client(1)
    assert not rc.judges(1) and rc.worth(1, [SMALL], np.zeros(2, dtype=np.int64), tiers, Tier.HBM).all()


def test_placement_judges_a_layout_by_its_slowest_engine_and_only_when_all_gave_a_rate():
    rc = ReadCost()
    rc.observe(Tier.NVME, Tier.HBM, 16 * MIB, 1.0)
    lids = np.array([0])
    rc.set_rate(1, 0, FAST_ENGINE)
    assert not rc.keeps([SMALL], lids, Tier.NVME).any()
    rc.set_rate(2, 0, None)  # a client of the layout that did not say: keep its blocks
    assert rc.keeps([SMALL], lids, Tier.NVME).all()
    rc.set_rate(2, 0, SLOW_ENGINE)  # it gains from a read back: keep them
    assert rc.keeps([SMALL], lids, Tier.NVME).all()
    rc.drop_client(2)
    assert not rc.keeps([SMALL], lids, Tier.NVME).any()
    assert rc.keeping_rate(0) == FAST_ENGINE


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 10**400, True, "fast"])
def test_a_bad_prefill_rate_is_refused(bad):
    with pytest.raises(ValueError, match="prefill rate"):
        ReadCost().set_rate(1, 0, bad)


# -- a real host manager --------------------------------------------------------------------
@pytest.fixture
def mgr(config_file, instance_name):
    m = build_manager(load_config(config_file(kv_block={"block_size": 16, "prefetch_window": 0})),
                      instance=instance_name)
    yield m
    m.close()


def publish_in_dram(m, client, lid, keys):
    """A chain written by a host-side writer straight into DRAM, published, held by nobody."""
    vids = m.allocate(client, lid, len(keys), tier=Tier.DRAM)
    for i, v in enumerate(vids.tolist()):
        m.view(v)[:] = i % 251
    vids = m.commit(client, vids, keys=keys)
    m.free(client, vids)
    return vids


def test_a_lookup_stops_before_blocks_that_load_slower_than_a_recompute(mgr):
    a = mgr.attach("engine")
    lid = mgr.register_layout(SMALL)
    keys = list(range(1, 81))
    vids = publish_in_dram(mgr, a, lid, keys)
    assert mgr.acquire(a, vids[:70]) is not None  # 70 x 16 KiB come up: the DRAM path is measured
    mgr.release(a, vids[:70])
    assert mgr.read_cost.bandwidth(Tier.DRAM, Tier.HBM) is not None
    assert mgr.stats()["read_cost"]["bytes_per_s"]["dram->hbm"] > 0

    assert len(mgr.lookup_rows(keys, lid, client=a)) == 80, "no rate given: everything is offered"
    mgr.set_prefill_rate(a, lid, FAST_ENGINE)
    rows = mgr.lookup_rows(keys, lid, client=a)
    assert mgr.table.vids(rows).tolist() == vids[:70].tolist(), "the prefix ends at the first block in DRAM"
    assert mgr.access.withheld == 10
    assert len(mgr.lookup_rows(keys, lid, reader=Tier.DRAM, client=a)) == 80, "a host reader reads DRAM in place"
    mgr.set_prefill_rate(a, lid, SLOW_ENGINE)
    assert len(mgr.lookup_rows(keys, lid, client=a)) == 80
    mgr.check_invariants()

    # What Prometheus sees (the families built from the same stats snapshot the daemon serves).
    families = {f.name: f for f in _access_families(mgr.stats())}
    assert [s.value for s in families["dflash2_lookup_withheld_blocks"].samples if s.name.endswith("_total")] == [10]
    bandwidth = {s.labels["direction"]: s.value for s in families["dflash2_read_bandwidth_bytes_per_second"].samples}
    assert bandwidth["dram->hbm"] == mgr.read_cost.bandwidth(Tier.DRAM, Tier.HBM) > 0


def test_blocks_are_dropped_instead_of_demoted_to_a_tier_too_slow_for_their_engines(mgr):
    a = mgr.attach("engine")
    lid = mgr.register_layout(SMALL)
    first = publish_in_dram(mgr, a, lid, list(range(1, 81)))
    rows = mgr.table.rows(first)
    assert mgr.mover.move(rows, Tier.NVME).all()
    assert mgr.acquire(a, first) is not None  # 80 blocks up from NVMe: the NVMe path is measured
    mgr.release(a, first)
    assert mgr.read_cost.bandwidth(Tier.NVME, Tier.HBM) is not None

    second = publish_in_dram(mgr, a, lid, list(range(1001, 1011)))
    mgr.set_prefill_rate(a, lid, FAST_ENGINE)
    assert mgr.placement.make_room(Tier.DRAM, mgr.placement.free_bytes(Tier.DRAM) + 10 * SMALL.block_bytes)
    assert mgr.placement.stats.not_kept >= 10
    assert not len(mgr.lookup_rows(list(range(1001, 1011)), lid)), "dropped, not kept on NVMe"
    assert mgr.table.tier_blocks()[Tier.NVME] == 0
    mgr.check_invariants()

    # Another engine of the layout without a rate: the blocks go down to NVMe again.
    b = mgr.attach("other")
    mgr.set_prefill_rate(b, lid, None)
    third = publish_in_dram(mgr, a, lid, list(range(2001, 2011)))
    kept_before = mgr.placement.stats.not_kept
    assert mgr.placement.make_room(Tier.DRAM, mgr.placement.free_bytes(Tier.DRAM) + 10 * SMALL.block_bytes)
    assert mgr.placement.stats.not_kept == kept_before
    assert mgr.table.tier_blocks()[Tier.NVME] >= 10
    del second, third


# -- through the daemon ---------------------------------------------------------------------
@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(kv_block={"block_size": 16, "prefetch_window": 0})).start()
    yield proc
    proc.stop()


def test_an_engine_gives_its_prefill_rate_and_lookups_withhold_slow_blocks(connect):
    c = connect(prefill_tokens_per_s=[None])
    lid = c.layouts[0]
    keys = chain_keys(range(80 * 16), 16, "readcost")
    places = c.allocate(lid, 80, tier="dram")
    vids = c.commit(places["vid"], keys)
    assert c.acquire(vids[:70]) is not None  # brought up: the daemon measures its DRAM path
    c.release(vids[:70])
    c.free(vids)
    assert c.stats()["read_cost"]["bytes_per_s"]["dram->hbm"] > 0

    found, withheld = c.lookup_with_cost(keys, lid)
    assert (len(found), withheld) == (80, 0)
    c.set_prefill_rate(lid, FAST_ENGINE)
    found, withheld = c.lookup_with_cost(keys, lid)
    assert (len(found), withheld) == (70, 10)
    assert c.stats()["lookup_withheld"] == 10
    view = render(c.stats())
    assert "read back: dram->hbm " in view
    assert "withheld (slower to load than to recompute, or on an NVMe disk backing off after failed reads) 10" in view
    c.set_prefill_rate(lid, None)
    assert len(c.lookup(keys, lid)) == 80

    fast = connect(name="fast", prefill_tokens_per_s=[FAST_ENGINE])
    assert len(fast.lookup(keys, lid)) == 70
    other = fast.register_layout(Layout("other", num_layers=1, num_kv_heads=1, head_dim=64, dtype="fp16",
                                        tokens_per_block=16), prefill_tokens_per_s=SLOW_ENGINE)
    assert other != lid


@pytest.mark.parametrize("rates, message", [
    ([0], "positive number"), (["fast"], "positive number"), ([10**400], "positive number"),
    ([1.0, 2.0], "2 prefill rates for 1 layouts"),
])
def test_a_bad_prefill_rate_at_attach_is_refused_with_its_reason(connect, rates, message):
    with pytest.raises(DaemonError, match=message):
        connect(prefill_tokens_per_s=rates)


def test_a_bad_prefill_rate_later_is_refused_and_changes_nothing(connect):
    c = connect(prefill_tokens_per_s=[SLOW_ENGINE])
    with pytest.raises(DaemonError, match="positive number"):
        c.set_prefill_rate(c.layouts[0], -5)
    with pytest.raises(DaemonError, match="layout"):
        c.set_prefill_rate(12345, 1.0)
    assert c.stats()["read_cost"]["prefill_rates"] == 1


def test_a_node_of_several_pools_shows_each_pools_read_bandwidth(make_manager, clock):
    """A node of several GPUs keeps a measurement per pool (its stats under `devices`); the gauge and
    `dflash2 status` read only the top level, which such a node has not: they showed nothing."""
    from dflash2.daemon.service import Service
    from dflash2.status import render

    pools = {0: make_manager(hbm_blocks=8, dram_blocks=8), 1: make_manager(hbm_blocks=8, dram_blocks=8)}
    for gpu, m in pools.items():
        m.read_cost.observe(Tier.DRAM, Tier.HBM, 8 << 20, 0.001 * (gpu + 1))
    st = Service(pools, lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock).stats()
    families = {f.name: f for f in _access_families(st)}
    bandwidth = {(s.labels["gpu"], s.labels["direction"]): s.value
                 for s in families["dflash2_read_bandwidth_bytes_per_second"].samples}
    assert bandwidth == {(str(gpu), "dram->hbm"): m.read_cost.bandwidth(Tier.DRAM, Tier.HBM) for gpu, m in pools.items()}
    assert bandwidth[("0", "dram->hbm")] > bandwidth[("1", "dram->hbm")] > 0
    [line] = [line for line in render(st).splitlines() if line.startswith("read back:")]
    assert "GPU 0 dram->hbm" in line and "GPU 1 dram->hbm" in line


def test_demotions_are_measured_but_not_shown_as_read_back(make_manager, clock):
    """A review: with blocks only gone down, `dflash2 status` said "read back: hbm->dram 1.5 GiB/s;
    dram->nvme unmeasured", and the read-bandwidth metric had those directions: demotions' speed."""
    from dflash2.daemon.service import Service
    from dflash2.status import render

    mgr = make_manager(hbm_blocks=8, dram_blocks=8)
    mgr.read_cost.observe(Tier.HBM, Tier.DRAM, 8 << 20, 0.001)  # a demotion, measured
    st = Service({0: mgr}, lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock).stats()
    assert "hbm->dram" in st["read_cost"]["bytes_per_s"]  # (kept in the JSON: every path the daemon measures)
    assert "hbm->dram" not in render(st)  # (no read back measured, nothing withheld: no line)
    families = {f.name: f for f in _access_families(st)}
    assert not families["dflash2_read_bandwidth_bytes_per_second"].samples
    mgr.read_cost.observe(Tier.DRAM, Tier.HBM, 8 << 20, 0.001)  # a read back
    st = Service({0: mgr}, lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock).stats()
    [line] = [line for line in render(st).splitlines() if line.startswith("read back:")]
    assert "dram->hbm" in line and "hbm->dram" not in line, line


def test_a_path_judged_too_slow_is_measured_again_after_a_while():
    """A path judged too slow carries no more batches (its blocks neither offered nor kept there), so
    its figure never changed: one slow batch (a disk busy for it) turned that tier off for the
    layout until a restart (a review's script, in process: 650 blocks dropped, no hits). Once no
    batch has crossed it for STALE_S its blocks are offered and kept again, and measured anew."""
    from dflash2.readcost import STALE_S
    now = [0.0]
    rc = ReadCost(clock=lambda: now[0])
    rc.set_rate(1, 0, 1e6)  # 16 tokens recomputed in 16 µs: a 16 KiB block must load at 1 GB/s or more
    dram, one = np.array([int(Tier.DRAM)]), np.array([0])
    rc.observe(Tier.DRAM, Tier.HBM, MIN_SAMPLE_BYTES, 10.0)  # one stalled batch: 0.1 MB/s
    assert not rc.worth(1, [SMALL], one, dram, Tier.HBM).any()
    assert not rc.keeps([SMALL], one, Tier.DRAM).any()
    now[0] += STALE_S / 2
    assert not rc.worth(1, [SMALL], one, dram, Tier.HBM).any()  # still judged
    now[0] += STALE_S
    assert rc.worth(1, [SMALL], one, dram, Tier.HBM).all() and rc.keeps([SMALL], one, Tier.DRAM).all()
    assert rc.bandwidth(Tier.DRAM, Tier.HBM) == pytest.approx(MIN_SAMPLE_BYTES / 10.0)  # the stats' figure
    rc.observe(Tier.DRAM, Tier.HBM, MIN_SAMPLE_BYTES, 1e-4)  # the next batch: the path is fast now
    assert rc.bandwidth(Tier.DRAM, Tier.HBM) == pytest.approx(MIN_SAMPLE_BYTES / 1e-4)  # measured afresh
    assert rc.worth(1, [SMALL], one, dram, Tier.HBM).all() and rc.keeps([SMALL], one, Tier.DRAM).all()
