import numpy as np
import pytest

from dflash2.errors import UnknownPolicy
from dflash2.placement import Watermark
from dflash2.policy import make_policy, policy_names
from dflash2.tiers import Tier

from conftest import SMALL
from placement_helpers import fill, tier_of


def test_registry_lists_valid_names():
    assert {"lru", "lfu"} <= set(policy_names())
    with pytest.raises(UnknownPolicy, match="valid: .*lfu.*lru"):
        make_policy("nope")


def test_cold_threshold_limits_each_pass(make_manager, clock):
    mgr = make_manager(hbm_blocks=10, dram_blocks=20, cold_threshold=0.2,
                       watermarks={Tier.HBM: Watermark(0.5, 0.1)})
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    for k in range(1, 11):
        clock.advance(1)
        fill(mgr, a, lid, [k])
    before = mgr.placement._cold_mask(Tier.HBM, mgr.policy.scores_all(mgr.table, clock()))
    assert before.sum() == 2  # the coldest fifth of 10
    assert not mgr.placement.make_room(Tier.HBM, 10 * 16384, cold_only=True)
    # Only the blocks cold when it started go, however much room was asked for: the cut is not
    # taken again over what is left after each round.
    assert mgr.placement.stats.demoted == 2
    assert (mgr.table.cols.tier[np.flatnonzero(before)] == int(Tier.DRAM)).all()


@pytest.mark.parametrize("threshold, blocks, cold", [(0.05, 16, 1), (0.1, 16, 2), (0.1, 30, 3), (0.5, 16, 8),
                                                     (0.2, 10, 2), (0.34, 3, 2)])
def test_cold_blocks_are_those_below_the_threshold_percentile(make_manager, clock, threshold, blocks, cold):
    """DESIGN: cold when a block's heat percentile in its tier is below the threshold. The i-th
    lowest of n stands at i/n, so ceil(t*n) blocks are cold: rounded down, 0.05 of a 16-block tier
    left none cold, and a tier over its high watermark never drained."""
    mgr = make_manager(hbm_blocks=blocks, dram_blocks=4 * blocks, cold_threshold=threshold)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    for k in range(1, blocks + 1):
        clock.advance(1)
        fill(mgr, a, lid, [k])
    found = mgr.placement._cold_mask(Tier.HBM, mgr.policy.scores_all(mgr.table, clock()))
    assert int(found.sum()) == cold


def test_descendants_leave_a_tier_before_their_ancestors(make_manager, clock):
    mgr = make_manager(hbm_blocks=6, dram_blocks=20)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, a, lid, [1, 2, 3, 4])
    clock.advance(10)
    # touch the root and the leaf: by LRU the middle blocks would go first; prefix order forbids
    # a parent leaving before its child, so the leaf (newest!) must leave before its ancestors.
    mgr.table.touch(mgr.table.rows(chain[[0, 3]]))
    mgr.placement.make_room(Tier.HBM, 6 * 16384 - 2 * 16384 + 16384)  # free 3 blocks
    tiers = [tier_of(mgr, v) for v in chain]
    assert tiers == [Tier.HBM, Tier.DRAM, Tier.DRAM, Tier.DRAM]
    mgr.check_invariants()


def test_a_cold_chain_is_demoted_whole_in_one_batch(make_manager, clock):
    """A demotion takes a cold chain with its descendants in one move (one batch), leaves first,
    not one level per round: per-level rounds made the demotions of prefix-tree workloads batches
    of one or two blocks, each a copy launch of its own."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=32)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    cold = fill(mgr, a, lid, [1, 2, 3, 4, 5, 6, 7, 8])
    clock.advance(10)
    # a second chain whose root is cold but whose leaf is hot: the leaf holds its ancestors up
    held = fill(mgr, a, lid, [11, 12, 13])
    clock.advance(10)
    warm = fill(mgr, a, lid, [21, 22, 23, 24])
    mgr.table.touch(mgr.table.rows(held[[2]]))
    order = []
    start = mgr.mover.start

    def recording(rows, dst, *args):
        order.append([int(v) for v in mgr.table.vids(np.asarray(rows))])
        return start(rows, dst, *args)
    mgr.mover.start = recording
    mgr.placement.make_room(Tier.HBM, mgr.placement.free_bytes(Tier.HBM) + 8 * 16384)
    assert [tier_of(mgr, v) for v in cold] == [Tier.DRAM] * 8
    assert [tier_of(mgr, v) for v in held] == [Tier.HBM] * 3, "the hot leaf keeps its chain up"
    assert [tier_of(mgr, v) for v in warm] == [Tier.HBM] * 4
    assert order == [[int(v) for v in cold[::-1]]], "one move, leaves first"
    assert mgr.mover.stats[(Tier.HBM, Tier.DRAM)].batches == 1
    mgr.check_invariants()


def test_a_cold_chain_is_evicted_whole_in_one_selection(make_manager, clock):
    """On the last tier a cold chain goes in one selection pass (dropped leaves first), not one
    pass per level: each pass scans the whole table."""
    mgr = make_manager(hbm_blocks=12)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    cold = fill(mgr, a, lid, [1, 2, 3, 4, 5, 6, 7, 8])
    clock.advance(10)
    warm = fill(mgr, a, lid, [11, 12, 13, 14])
    passes = []
    select = mgr.placement.select

    def counting(*args, **kw):
        passes.append(1)
        return select(*args, **kw)
    mgr.placement.select = counting
    assert mgr.placement.make_room(Tier.HBM, 8 * 16384)
    assert mgr.lookup([1], lid) == [] and len(mgr.lookup([11, 12, 13, 14], lid)) == 4
    assert mgr.placement.stats.evicted == 8 and len(passes) == 1
    mgr.check_invariants()


def test_eviction_on_the_last_tier_drops_leaves_first(make_manager, clock):
    mgr = make_manager(hbm_blocks=4)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    fill(mgr, a, lid, [1, 2, 3, 4])
    mgr.placement.make_room(Tier.HBM, 2 * 16384)
    assert len(mgr.lookup([1, 2, 3, 4], lid)) == 2, "the two leaves went, the prefix stayed"
    assert mgr.placement.stats.evicted == 2
    mgr.check_invariants()


def test_promotion_brings_the_prefix_first(make_manager, clock):
    mgr = make_manager(hbm_blocks=4, dram_blocks=4, nvme_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, a, lid, [1, 2, 3])
    rows = mgr.table.rows(chain)
    mgr.mover.move(rows[::-1][:3], Tier.DRAM)
    mgr.mover.move(rows, Tier.NVME)
    assert {tier_of(mgr, v) for v in chain} == {Tier.NVME}
    got = mgr.acquire(a, chain[2:])  # asks for the leaf only
    assert got is not None and got[0].tier == Tier.HBM
    assert [tier_of(mgr, v) for v in chain] == [Tier.HBM] * 3, "ancestors came up too"
    assert mgr.access.reads[Tier.NVME] == 1 and mgr.access.hbm_hit_ratio == 0.0
    mgr.release(a, chain[2:])
    mgr.acquire(a, chain)
    assert mgr.access.hbm_hit_ratio == 3 / 4
    mgr.check_invariants()


def test_lru_and_lfu_choose_differently(make_manager, clock):
    victims = {}
    for name in ("lru", "lfu"):
        mgr = make_manager(hbm_blocks=3, policy=name)
        a = mgr.attach("a")
        lid = mgr.register_layout(SMALL)
        v1 = fill(mgr, a, lid, [1])
        for _ in range(5):  # block 1 is used often, long ago
            mgr.acquire(a, v1)
            mgr.release(a, v1)
        clock.advance(5)
        fill(mgr, a, lid, [2])
        clock.advance(5)
        fill(mgr, a, lid, [3])
        mgr.placement.make_room(Tier.HBM, 16384)
        victims[name] = [k for k in (1, 2, 3) if not mgr.lookup([k], lid)]
    assert victims == {"lru": [1], "lfu": [2]}


def test_admission_refusal_drops_instead_of_demoting(make_manager, clock):
    from dflash2.policy.lru import LRUPolicy

    class NoDram(LRUPolicy):
        name = "test-no-dram"

        def admit(self, table, rows, tier, now):
            return np.zeros(len(rows), dtype=bool)

    mgr = make_manager(hbm_blocks=2, dram_blocks=4, policy=NoDram())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    fill(mgr, a, lid, [1, 2])
    mgr.placement.make_room(Tier.HBM, 16384 * 2)
    assert mgr.stats()["tiers"]["dram"]["blocks"] == 0
    assert mgr.placement.stats.not_admitted == 2


def test_lookup_prefetches_the_first_window_and_reads_count_it(make_manager, clock):
    mgr = make_manager(hbm_blocks=8, dram_blocks=16, prefetch_window=2)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, a, lid, [1, 2, 3, 4])
    mgr.mover.move(mgr.table.rows(chain[::-1]), Tier.DRAM)
    # HBM is nearly empty (below its low watermark): the window of 2 doubles to 4 on first use
    found = mgr.lookup([1, 2, 3, 4, 5], lid)
    assert [p.vid for p in found] == chain.tolist()
    assert [tier_of(mgr, v) for v in chain] == [Tier.HBM] * 4
    mgr.acquire(a, chain)
    assert mgr.access.reads[Tier.HBM] == 4, "every read was served from HBM without waiting"
    assert mgr.stats()["prefetch"] == {"window": 4, "useful": 4, "wasted": 0, "pending": 0}
    mgr.release(a, chain)
    # HBM full above its high watermark: back to the configured window
    filler = mgr.allocate(a, lid, 4)
    mgr.mover.move(mgr.table.rows(chain[::-1]), Tier.DRAM)
    mgr.commit(a, mgr.allocate(a, lid, 4))
    mgr.lookup([1, 2, 3, 4], lid)
    assert mgr.prefetcher.window == 2
    assert filler is not None
    mgr.check_invariants()


def test_host_side_readers_write_and_pin_in_dram(make_manager, clock):
    """A host-side client (sglang's storage backend) writes blocks into DRAM and pins them where
    they are; only blocks on NVMe move (up to DRAM, not HBM)."""
    mgr = make_manager(hbm_blocks=4, dram_blocks=8, nvme_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    vids = mgr.commit(a, mgr.allocate(a, lid, 3, tier=Tier.DRAM), keys=[1, 2, 3])
    assert [tier_of(mgr, v) for v in vids] == [Tier.DRAM] * 3
    mgr.mover.move(mgr.table.rows(vids[2:]), Tier.NVME)
    places = mgr.acquire(a, vids, up_to=Tier.DRAM)
    assert [p.tier for p in places] == [Tier.DRAM] * 3
    assert mgr.stats()["tiers"]["hbm"]["blocks"] == 0
    with pytest.raises(ValueError, match="memory tier"):
        mgr.allocate(a, lid, 1, tier=Tier.NVME)
    mgr.check_invariants()


def test_a_copy_that_cannot_start_leaves_every_block_where_it_was(make_manager, tmp_path, instance_name):
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2.errors import ArenaError
    from dflash2.manager import BlockManager
    from dflash2.transfer.host import HostTransferBackend
    from conftest import specs
    sp = specs(4, 8)
    arenas = {Tier.HBM: SharedMemoryArena.create(f"{instance_name}-h", sp[0].capacity_bytes, Tier.HBM),
              Tier.DRAM: SharedMemoryArena.create(f"{instance_name}-d", sp[1].capacity_bytes, Tier.DRAM, alignment=4096)}
    backend = HostTransferBackend(arenas)
    mgr = BlockManager(sp, arenas=arenas, backend=backend)
    try:
        a = mgr.attach("a")
        lid = mgr.register_layout(SMALL)
        vids = mgr.commit(a, mgr.allocate(a, lid, 3))
        backend.close()  # a real backend that refuses new work
        with pytest.raises(ArenaError):
            mgr.mover.move(mgr.table.rows(vids), Tier.DRAM)
        assert [tier_of(mgr, v) for v in vids] == [Tier.HBM] * 3
        assert mgr.table.cols.state[mgr.table.rows(vids)].tolist() == [3, 3, 3]
        mgr.check_invariants()
    finally:
        mgr.close()


def test_a_partial_promotion_never_puts_a_block_above_its_prefix(make_manager, clock):
    mgr = make_manager(hbm_blocks=3, dram_blocks=8, nvme_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chain = fill(mgr, a, lid, [1, 2, 3])
    rows = mgr.table.rows(chain)
    mgr.mover.move(rows[::-1], Tier.DRAM)
    mgr.mover.move(rows[2:], Tier.NVME)  # P1, P2 in DRAM, C on NVMe
    held = mgr.commit(a, mgr.allocate(a, lid, 2))  # HBM keeps one free slot
    mgr.acquire(a, held)  # pinned: cannot make room
    mgr.placement.promote(rows[2:], Tier.HBM)
    tiers = [tier_of(mgr, v) for v in chain]
    assert tiers == sorted(tiers), f"a block above its prefix: {tiers}"
    mgr.check_invariants()


def test_blocks_of_a_second_layout_get_room_among_scattered_holes(make_manager, clock):
    """Free slots of one size do not hold blocks of another: room is made for the size asked."""
    from conftest import SMALL_FP8
    mgr = make_manager(hbm_blocks=8, dram_blocks=16)
    a = mgr.attach("a")
    l16, l8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    vids = [int(fill(mgr, a, l8, [k])[0]) for k in range(1, 17)]  # 16 fp8 blocks fill every page
    for v in vids[::2]:  # holes in every page: fp8 slots free, no page empty
        mgr.table.evict(mgr.table.rows([v]))
    assert mgr.placement.free_bytes(Tier.HBM) > 0 and mgr.placement.free_bytes(Tier.HBM, SMALL.block_bytes) == 0
    got = mgr.allocate(a, l16, 2)
    assert got is not None
    mgr.check_invariants()


@pytest.mark.parametrize("pieces", [True, False])
def test_a_promotion_demotes_while_its_earlier_pieces_come_up(tmp_path, instance_name, clock, pieces):
    """Promoting large blocks into a full HBM makes room piece by piece: the demotions that free
    room for one piece start while the previous piece is still coming up (both directions of the
    link at once). Small blocks make all the room first. Every byte lands where it belongs."""
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2.manager import BlockManager
    from dflash2.transfer.base import TransferBackend
    from dflash2.transfer.host import HostTransferBackend
    from conftest import specs

    class Recording(TransferBackend):
        """The real host backend, with a log of when each batch starts and is waited for."""

        def __init__(self, inner):
            self.inner, self.log = inner, []

        def start(self, batch):
            job = self.inner.start(batch)
            name = f"{'up' if batch.dst_tier < batch.src_tier else 'down'}{len(self.log)}"
            self.log.append(("start", name))
            wait = job.wait

            def logged_wait():
                self.log.append(("wait", name))
                return wait()
            job.wait = logged_wait
            return job

        def close(self):
            self.inner.close()

    sp = specs(4, 16)
    arenas = {Tier.HBM: SharedMemoryArena.create(f"{instance_name}-h", sp[0].capacity_bytes, Tier.HBM),
              Tier.DRAM: SharedMemoryArena.create(f"{instance_name}-d", sp[1].capacity_bytes, Tier.DRAM, alignment=4096)}
    backend = Recording(HostTransferBackend(arenas))
    mgr = BlockManager(sp, arenas=arenas, backend=backend, clock=clock)
    mgr.placement.PROMOTE_PIECE_BYTES = 2 * SMALL.block_bytes  # pieces of two blocks
    assert SMALL.block_bytes < mgr.placement.PROMOTE_PIECES_MIN_BLOCK
    if pieces:
        mgr.placement.PROMOTE_PIECES_MIN_BLOCK = SMALL.block_bytes
    try:
        a = mgr.attach("a")
        lid = mgr.register_layout(SMALL)
        data = {}

        def written(vids):
            for v in vids:
                view = mgr.view(v)
                view[:] = np.random.default_rng(v).integers(0, 256, view.size, dtype=np.uint8)
                data[v] = bytes(view)
            return vids
        chain = written(mgr.commit(a, mgr.allocate(a, lid, 4), keys=[11, 12, 13, 14]).tolist())
        mgr.mover.move(mgr.table.rows(chain)[::-1], Tier.DRAM)  # the chain waits in DRAM
        for k in range(1, 5):  # and HBM fills up
            written(mgr.commit(a, mgr.allocate(a, lid, 1), keys=[k]).tolist())
        assert mgr.placement.free_bytes(Tier.HBM) < SMALL.block_bytes
        backend.log.clear()
        assert mgr.placement.promote(mgr.table.rows(chain), Tier.HBM).all()
        log = backend.log
        first_up = next(name for what, name in log if what == "start" and name.startswith("up"))
        up_waited = log.index(("wait", first_up))
        downs_during_up = [name for what, name in log[log.index(("start", first_up)):up_waited]
                           if what == "start" and name.startswith("down")]
        assert bool(downs_during_up) == pieces, log
        assert [tier_of(mgr, v) for v in chain] == [Tier.HBM] * 4
        for v, b in data.items():
            assert bytes(mgr.view(v)) == b, f"block {v} changed on its way"
        mgr.check_invariants()
    finally:
        mgr.close()


@pytest.mark.parametrize("pieces", [True, False])
def test_random_promotions_keep_every_byte(tmp_path, instance_name, clock, pieces):
    """Three real tiers (shared memory and an NVMe file), HBM kept full, blocks of two sizes: random
    groups of blocks go down and come back up together, in pieces of one block making room as they
    go, or with all room made first. Room is always found (free slots of one size do not hold the
    other), every block keeps its bytes and the table stays consistent after every step."""
    from dflash2.arena.nvme import NvmeArena
    from dflash2.arena.shm import SharedMemoryArena
    from dflash2.manager import BlockManager
    from dflash2.transfer.host import HostTransferBackend
    from conftest import SMALL_FP8, specs
    sp = specs(8, 12, 24)
    arenas = {Tier.HBM: SharedMemoryArena.create(f"{instance_name}-h", sp[0].capacity_bytes, Tier.HBM),
              Tier.DRAM: SharedMemoryArena.create(f"{instance_name}-d", sp[1].capacity_bytes, Tier.DRAM, alignment=4096),
              Tier.NVME: NvmeArena.create(str(tmp_path / "nvme.cache"), sp[2].capacity_bytes, staging_bytes=64 * 1024)}
    mgr = BlockManager(sp, arenas=arenas, backend=HostTransferBackend(arenas), clock=clock, swap_batch_size=3)
    if pieces:
        mgr.placement.PROMOTE_PIECES_MIN_BLOCK = 0
        mgr.placement.PROMOTE_PIECE_BYTES = SMALL.block_bytes
    rng = np.random.default_rng(11)
    try:
        a = mgr.attach("a")
        lids = [mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)]
        data, key = {}, 1
        for _ in range(30):  # fill the tiers: HBM fills, older blocks go down
            lid = lids[int(rng.integers(2))]
            got = mgr.allocate(a, lid, 1)
            if got is None:
                size = mgr.table.layout(lid).block_bytes
                assert mgr.placement.make_room(Tier.HBM, size, block_bytes=size)
                got = mgr.allocate(a, lid, 1)
            v = int(mgr.commit(a, got, keys=[key])[0])
            key += 1
            view = mgr.view(v)
            view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)
            data[v] = bytes(view)
        c = mgr.table.cols
        pieces_seen = 0
        for _ in range(60):
            group = rng.choice(list(data), size=int(rng.integers(2, 6)), replace=False)
            rows = mgr.table.rows(group.tolist())
            below = Tier.NVME if rng.random() < 0.5 else Tier.DRAM
            mgr.mover.move(rows[c.tier[rows] < int(below)], below)
            up = rows[c.tier[rows] > int(Tier.HBM)]
            pieces_seen += len(up) > 1
            assert mgr.placement.promote(up, Tier.HBM).all(), "room could be made for every block"
            mgr.check_invariants()
            for v, b in data.items():  # the ones in memory tiers (the promoted ones among them)
                if mgr.place(v).tier != Tier.NVME:
                    assert bytes(mgr.view(v)) == b, f"block {v:#x} changed"
        assert pieces_seen > 20  # the loop did promote several blocks at once
    finally:
        mgr.close()


def test_a_selection_ranks_only_the_rows_that_may_leave(make_manager, clock, monkeypatch):
    """A promotion or reservation into a full HBM makes exactly its room: one selection a call. Its
    cut partitioned every row's score (the others set to +inf), ~10 ms at a million blocks of which
    HBM holds a tenth. The cut is the k-th lowest score among the rows that may leave: ranked among
    them alone it is the same value, so the victims are the same (the lowest scores, ties by row)."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=64)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    for k in range(40):  # most of the table lies in DRAM
        mgr.free(a, mgr.commit(a, mgr.allocate(a, lid, 1, tier=Tier.DRAM), keys=[1000 + k]))
    hbm = []
    for k in range(8):
        clock.advance(1)
        hbm.append(fill(mgr, a, lid, [k + 1])[0])
    mgr.acquire(a, [hbm[2], hbm[5]])  # read again: hotter
    mgr.release(a, [hbm[2], hbm[5]])
    mgr.acquire(a, [hbm[6]])  # pinned: may not leave
    ranked = []
    partition = np.partition
    monkeypatch.setattr(np, "partition", lambda a, k, *args, **kw: ranked.append(len(a)) or partition(a, k, *args, **kw))
    victims = mgr.placement.select(Tier.HBM, 3 * 16384, evict=False)
    monkeypatch.undo()
    assert ranked and max(ranked) <= 7 < mgr.table.cols.capacity
    rows = mgr.table.rows([v for v in hbm if v != hbm[6]])
    scores = mgr.policy.scores_all(mgr.table, clock())[rows]
    assert victims.tolist() == rows[np.lexsort((rows, scores))][:3].tolist()


@pytest.mark.parametrize("seed", range(5))
def test_the_cut_takes_the_rows_at_or_under_the_kth_lowest_reachable_score(make_manager, monkeypatch, seed):
    """The cut is the k-th lowest reachable score (kth.py finds it among few), over the reachable
    rows gathered (a small share of the table) or over every score: every reachable row scored at or
    under it, ties at the cut included, and no other row."""
    pl = make_manager(hbm_blocks=8).placement
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 20, size=40000).astype(np.float32)  # many ties
    for share in (0.05, 0.6, 1.0):
        reach = rng.random(len(scores)) < share
        n_reach = int(reach.sum())
        for k in (1, 7, n_reach // 100, max(1, n_reach // 2), n_reach):
            want = reach & (scores <= np.partition(scores[reach], k - 1)[k - 1])
            for gather_below in (1, 10 ** 9):  # gather the reachable rows / pass over every score
                monkeypatch.setattr(pl, "GATHER_BELOW", gather_below)
                assert (pl._at_or_below_cut(reach.copy(), n_reach, scores, k) == want).all(), (share, k)


def test_a_move_of_two_sizes_takes_the_larger_ones_slots_first(clock):
    """A batch of blocks of two sizes going down into a tier whose room for the larger size is an
    empty slab of the smaller one (no free page), and whose smaller size has free slots elsewhere
    too: room was made for each size, largest first, counting that slab for the larger. The
    batch's slots were taken layout by layout, smaller first here: its first slot came off that
    empty slab (freed last, on top of its free list), and the larger block found no room; the
    retry of the same batch failed the same way, so nothing moved. The blocks could not be dropped
    either (each a parent of a block below), so an allocation in the tier above was refused while
    every block was idle, and every retry too (soak7's final probe: DRAM 160 of 512 blocks, its
    141 cached blocks idle, NVMe 15 MB free)."""
    from dflash2.layout import Layout
    from dflash2.manager import BlockManager, TierSpec

    page = 64 << 10  # a page holds 4 blocks of SMALL (16 KiB) or 2 of BIG (32 KiB)
    big = Layout("big", num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
    assert (SMALL.block_bytes, big.block_bytes) == (16 << 10, 32 << 10)
    mgr = BlockManager([TierSpec(Tier.HBM, 4 * page, page, 256), TierSpec(Tier.DRAM, 2 * page, page, 4096),
                        TierSpec(Tier.NVME, 2 * page, page, 4096)], clock=clock)
    a = mgr.attach("a")
    small_id, big_id = mgr.register_layout(SMALL), mgr.register_layout(big)  # the smaller one first
    heads = [fill(mgr, a, big_id, [1])[0], fill(mgr, a, small_id, [2])[0]]
    tails = [fill(mgr, a, small_id, [10 + i], parent=int(h))[0] for i, h in enumerate(heads)]
    filler = fill(mgr, a, small_id, [20, 21, 22, 23])
    down = mgr.table.rows(np.concatenate([tails, filler]))
    assert mgr.mover.move(down, Tier.DRAM).all() and mgr.mover.move(down, Tier.NVME).all()
    # NVMe: page 0 holds the two tails and two free slots, page 1 is an empty slab of SMALL.
    mgr.placement._evict(mgr.table.rows(filler))
    nvme = mgr.table.allocators[Tier.NVME]
    assert nvme.free_bytes == 6 * SMALL.block_bytes and nvme.blocks_free(big.block_bytes) == 2
    assert mgr.mover.move(mgr.table.rows(heads), Tier.DRAM).all()
    mgr.check_invariants()

    got = mgr.allocate(a, small_id, 8, tier=Tier.DRAM)  # the whole of DRAM: both heads must go down
    assert got is not None, mgr.allocate_refusal
    assert [tier_of(mgr, v) for v in np.concatenate([heads, tails])] == [Tier.NVME] * 4
    mgr.check_invariants()
    mgr.free(a, got)


def test_a_move_that_cannot_start_whole_moves_the_leading_blocks_that_fit(clock):
    """Blocks of two sizes going down into a tier whose only room is one free page: the smaller
    block leads, then the larger. Their batch needs two pages (a page is cut for one size) and
    found no room; the retry took the leading blocks that fit counted size by size, and each size
    counted the same free page: both, so the retry failed the same way and nothing moved. Both
    were dropped instead (idle, cached), though the leading one fitted, and its move alone made
    all the room the allocation needed. The retry is halved until its batch starts."""
    from dflash2.layout import Layout
    from dflash2.manager import BlockManager, TierSpec

    page = 64 << 10  # a page holds 4 blocks of SMALL (16 KiB) or 2 of BIG (32 KiB)
    big = Layout("big", num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
    assert (SMALL.block_bytes, big.block_bytes) == (16 << 10, 32 << 10)
    mgr = BlockManager([TierSpec(Tier.HBM, 2 * page, page, 256), TierSpec(Tier.DRAM, 2 * page, page, 4096)],
                       clock=clock)
    a, b = mgr.attach("a"), mgr.attach("b")
    small_id, big_id = mgr.register_layout(SMALL), mgr.register_layout(big)
    # HBM: page 0 a slab of SMALL holding `first` alone, page 1 a slab of BIG holding `second` (older
    # first: the victims are [first, second]).
    first = fill(mgr, a, small_id, [1])
    clock.advance(1)
    second = fill(mgr, a, big_id, [2])
    # DRAM: page 0 full of b's blocks (held: never dropped), page 1 free.
    held = mgr.allocate(b, small_id, 4, tier=Tier.DRAM)
    dram = mgr.table.allocators[Tier.DRAM]
    assert dram.blocks_free(SMALL.block_bytes) == 4 and dram.blocks_free(big.block_bytes) == 2
    assert mgr.mover.leading_that_fit(mgr.table.rows(np.concatenate([first, second])), Tier.DRAM) == 2
    mgr.check_invariants()

    clock.advance(1)
    got = mgr.allocate(a, big_id, 2)  # HBM holds one more BIG: `first`'s page must be emptied
    assert got is not None, mgr.allocate_refusal
    assert mgr.placement.stats.evicted == 0 and mgr.placement.stats.demoted == 1
    assert [tier_of(mgr, v) for v in np.concatenate([first, second])] == [Tier.DRAM, Tier.HBM]
    mgr.check_invariants()
    mgr.free(a, got)
    mgr.free(b, held)
    mgr.check_invariants()


def test_a_round_that_moves_nothing_down_makes_no_selection_to_drop(make_manager, clock):
    """Every HBM block pinned: making room selects once, finds nothing, and stops; a second
    selection, to drop blocks instead, could find none (dropping needs all that moving down does)
    and cost a pass over the table."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    mgr.acquire(a, fill(mgr, a, lid, list(range(1, 9))))
    passes = []
    select = mgr.placement.select
    mgr.placement.select = lambda *args, **kw: passes.append(kw["evict"]) or select(*args, **kw)
    assert not mgr.placement.make_room(Tier.HBM, 16384)
    assert passes == [False]
    mgr.check_invariants()


def test_a_refusal_beside_them_does_not_drop_admitted_blocks_a_slower_tier_has_room_for(make_manager, clock):
    """HBM holds 2 (under 1, held in DRAM by it: a parent never lands below its child) and 99,
    which the policy refuses below. Making room drops 99; 2 finds DRAM stuck and must go past it
    to NVMe, which has room. The refusal's drop counted as progress and skipped the pass past
    DRAM, and 2 was then dropped as if no tier below had room (Belady in `bench policy`, which
    refuses blocks never used again, found less than LRU with DRAM and NVMe)."""
    from dflash2.policy.lru import LRUPolicy

    class Refuses99(LRUPolicy):
        name = "test-refuses-99"

        def admit(self, table, rows, tier, now):
            return table.cols.key[rows] != 99

    mgr = make_manager(hbm_blocks=2, dram_blocks=1, nvme_blocks=4, policy=Refuses99())
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    (root,) = fill(mgr, a, lid, [1])
    assert mgr.placement.make_room(Tier.HBM, 16384 * 2)
    assert tier_of(mgr, root) == Tier.DRAM
    clock.advance(1)
    (leaf,) = fill(mgr, a, lid, [2], parent=int(root))
    clock.advance(1)
    fill(mgr, a, lid, [99])
    assert mgr.placement.make_room(Tier.HBM, 16384 * 2)
    assert mgr.placement.stats.not_admitted == 1 and mgr.placement.stats.evicted == 1  # 99 only
    assert [f.tier for f in mgr.lookup([1, 2], lid)] == [Tier.DRAM, Tier.NVME]
    assert mgr.placement.stats.past_full == 1
    mgr.check_invariants()
