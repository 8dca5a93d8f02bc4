"""Which mechanism moves an HBM<->DRAM batch (policy only, on a CPU), and how a copy-engine batch is
cut into driver calls."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2.cuda.copy_engine import FIRST_SLICE, slices
from dflash2.transfer.route import Mechanism, choose, split

KIB = 1024


@pytest.mark.parametrize("block_kib, to_host, busy, expected", [
    (16, True, False, Mechanism.KERNEL),
    (16, False, False, Mechanism.KERNEL),
    (16, True, True, Mechanism.KERNEL),  # the engines move 16 KiB blocks at 4-32 GB/s
    (32, False, True, Mechanism.KERNEL),
    (64, True, False, Mechanism.KERNEL),  # one way, device to host: the kernel is faster at 64 KiB
    (64, False, False, Mechanism.ENGINES),  # one way, host to device: the engines are
    (64, True, True, Mechanism.ENGINES),  # both ways: the engines fill the duplex link
    (64, False, True, Mechanism.ENGINES),
    (127, True, False, Mechanism.KERNEL),
    (128, True, False, Mechanism.ENGINES),
    (1024, True, False, Mechanism.ENGINES),
    (1024, False, True, Mechanism.ENGINES),
])
def test_route(block_kib, to_host, busy, expected):
    assert choose(block_kib * KIB, to_host, busy) is expected


def test_no_engines_means_the_kernel_everywhere():
    for size in (0, 16 * KIB, 64 * KIB, 1 << 30):
        for to_host in (True, False):
            for busy in (True, False):
                assert choose(size, to_host, busy, engines_available=False) is Mechanism.KERNEL


def test_negative_block_size_is_an_error():
    with pytest.raises(ValueError, match="block size must be >= 0, got -1"):
        choose(-1, True, False)
    with pytest.raises(ValueError, match="block sizes must be >= 0, got -5"):
        split(np.array([16 * KIB, -5]), True, False)


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("busy", [True, False])
def test_a_batch_goes_whole_where_its_smallest_copy_goes_when_that_is_the_engines(to_host, busy):
    for sizes_kib in ([256, 1024], [64, 256], [128, 128], [512]):
        sizes = np.array(sizes_kib) * KIB
        whole = choose(int(sizes.min()), to_host, busy) is Mechanism.ENGINES
        assert split(sizes, to_host, busy).tolist() == [whole] * len(sizes), sizes_kib
    assert split(np.array([], dtype=np.int64), to_host, busy).tolist() == []


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("busy", [True, False])
def test_a_mixed_batch_sends_its_large_copies_to_the_engines_only_beside_kernel_only_ones(to_host, busy):
    """Two layouts in one batch (16 KiB and 256 KiB blocks), or singles beside coalesced runs: the
    copies of 256 KiB and more take the engines, the small ones the kernel. A mix whose small
    copies the engines could take as well (64 KiB) is not split: it goes where its smallest goes."""
    sizes = np.array([16, 256, 32, 1024, 300, 63]) * KIB
    assert split(sizes, to_host, busy).tolist() == [False, True, False, True, True, False]
    assert not split(np.array([16, 128, 200]) * KIB, to_host, busy).any(), "nothing of 256 KiB: all kernel"
    mixed_64 = np.array([16, 64, 256]) * KIB
    assert not split(mixed_64, to_host, busy).any(), "a 64 KiB copy and a 16 KiB one: whole, on the kernel"
    whole = choose(64 * KIB, to_host, busy) is Mechanism.ENGINES
    assert split(np.array([64, 256]) * KIB, to_host, busy).tolist() == [whole, whole]
    assert not split(sizes, to_host, busy, engines_available=False).any()


@pytest.mark.parametrize("n", [0, 1, FIRST_SLICE - 1, FIRST_SLICE, FIRST_SLICE + 1, 1000, 1024, 4097])
def test_slices_cover_the_batch_once_in_doubling_runs(n):
    runs = slices(n)
    covered = [i for lo, hi in runs for i in range(lo, hi)]
    assert covered == list(range(n))
    for k, (lo, hi) in enumerate(runs[:-1]):
        assert hi - lo == FIRST_SLICE << k
    if runs:
        assert 0 < runs[-1][1] - runs[-1][0] <= FIRST_SLICE << (len(runs) - 1)
    assert len(runs) <= max(1, n.bit_length())  # few driver calls


def test_the_other_direction_stays_busy_for_the_hold_after_its_last_start():
    from dflash2.transfer.route import DUPLEX_HOLD_S, other_busy
    assert other_busy(True, None) and other_busy(True, 10.0)
    assert not other_busy(False, None)  # never started a batch
    assert other_busy(False, 0.0) and other_busy(False, DUPLEX_HOLD_S / 2)
    assert not other_busy(False, DUPLEX_HOLD_S) and not other_busy(False, 1.0)


def test_coalesce_merges_runs_contiguous_on_both_sides_only():
    import numpy as np
    from dflash2.transfer.route import coalesce
    k = 16 * KIB
    src = np.array([0, k, 2 * k, 10 * k, 11 * k, 20 * k, 30 * k])
    dst = np.array([5 * k, 6 * k, 7 * k, 0, 9 * k, 1 * k, 2 * k])
    nb = np.full(7, k)
    s, d, n = coalesce(src, dst, nb)
    # 0-2 contiguous both sides; 3-4 contiguous in src only; 5-6 in dst only
    assert s.tolist() == [0, 10 * k, 11 * k, 20 * k, 30 * k]
    assert d.tolist() == [5 * k, 0, 9 * k, 1 * k, 2 * k]
    assert n.tolist() == [3 * k, k, k, k, k]
    assert n.sum() == nb.sum()
    # mixed sizes join when they abut; nothing to join leaves the arrays as they were
    s, d, n = coalesce(np.array([0, 100]), np.array([50, 150]), np.array([100, 16]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0], [50], [116])
    s, d, n = coalesce(np.array([0]), np.array([0]), np.array([8]))
    assert n.tolist() == [8]
    s, d, n = coalesce(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert len(n) == 0


def test_kernel_metadata_is_packed_into_the_upload_buffer_as_the_kernel_reads_it():
    """[sources, destinations, sizes, chunk starts]: written straight into the pinned buffer (larger
    than needed, as the ring's are), each copy's chunks counted up (a partial chunk is one)."""
    from dflash2.cuda.kernels import CHUNK, meta_words, pack_meta

    src = np.array([0, 4096, 1 << 20], dtype=np.int64)
    dst = np.array([32, 16, 48], dtype=np.int64)
    nbytes = np.array([CHUNK, 3 * CHUNK + 16, 16], dtype=np.int64)
    buffer = np.full(2 * meta_words(3), -1, dtype=np.int64)
    meta = pack_meta(src, dst, nbytes, out=buffer)
    assert meta.base is buffer or np.shares_memory(meta, buffer)
    assert meta.tolist() == [*src, *dst, *nbytes, 0, 1, 5, 6]
    assert (buffer[meta_words(3):] == -1).all(), "nothing written past the batch's words"
    assert pack_meta(src, dst, nbytes).tolist() == meta.tolist()


def test_a_demotion_of_chains_leaves_first_moves_each_chain_in_one_copy():
    """A demotion lists its blocks leaves first, level by level across chains: a chain's blocks lay
    a chain's length apart in the batch, and the slots taken for them were paired in the list's
    order, so that no two copies joined (bench swap --chain 1024 with 256 KiB blocks: 1,024 copies
    a batch, the promotions into the freed slots too, and moves in pieces lost their lead). Slots
    are paired in the sources' order (table.begin_move) and copies of 64 KiB or more are taken in
    that order (route.coalesce): one copy per chain."""
    from dflash2.layout import Layout
    from dflash2.manager import BlockManager, TierSpec
    from dflash2.tiers import Tier
    from dflash2.transfer.route import SORT_MIN_BYTES, coalesce

    big = Layout("big", num_layers=8, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
    assert big.block_bytes == SORT_MIN_BYTES
    page = 1 << 20
    mgr = BlockManager([TierSpec(Tier.HBM, 4 * page, page, 256), TierSpec(Tier.DRAM, 4 * page, page, 4096)],
                       clock=lambda: 0.0)
    try:
        a = mgr.attach("a")
        lid = mgr.register_layout(big)
        chains = [mgr.table.rows(mgr.commit(a, mgr.allocate(a, lid, 16), keys=range(k, k + 16)))
                  for k in (1, 101)]
        leaves_first = np.stack([c[::-1] for c in chains], axis=1).ravel()  # tip of each, then the next level
        move = mgr.mover.prepare(leaves_first, Tier.DRAM)
        src = mgr.table.cols.offset[move.rows]
        s, d, n = coalesce(src, move.dst_offsets, mgr.table.block_bytes(move.rows))
        assert len(n) <= 2 and n.sum() == 32 * big.block_bytes, (s, d, n)  # (the chains lie side by side here)
        assert mgr.mover.complete(move).all()
        mgr.check_invariants()
    finally:
        mgr.close()


def test_copies_under_64_kib_keep_their_order():
    """Sorting a scattered batch costs about 18 us (1,024 copies), where a 16 KiB batch starts in
    90-150: copies under SORT_MIN_BYTES join only as listed."""
    from dflash2.transfer.route import coalesce
    k = 16 * KIB
    src, dst = np.array([2 * k, 0, k]), np.array([2 * k, 0, k])
    s, d, n = coalesce(src, dst, np.full(3, k))
    assert (s.tolist(), n.tolist()) == ([2 * k, 0], [k, 2 * k])
    s, d, n = coalesce(src * 4, dst * 4, np.full(3, 4 * k))  # 64 KiB: in the sources' order, one copy
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0], [0], [12 * k])
