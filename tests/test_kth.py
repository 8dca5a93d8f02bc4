"""kth.py: the k-th lowest score found among few, exactly what a partition of them all answers."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2 import kth
from dflash2.kth import kth_lowest


def scores_of(shape: str, n: int, rng: np.random.Generator) -> np.ndarray:
    values = rng.random(n).astype(np.float32)
    if shape == "tied at the bottom":  # a served cache's never-read blocks: a fifth score alike, lowest
        values[rng.random(n) < 0.2] = -4.19
    elif shape == "tied in the middle":
        values[rng.random(n) < 0.3] = np.float32(0.05)
    elif shape == "few values":
        values = rng.integers(0, 7, size=n).astype(np.float32)
    elif shape == "with NaN":
        values[rng.random(n) < 0.01] = np.nan
    elif shape == "sorted":
        values.sort()
    return values


SHAPES = ["random", "tied at the bottom", "tied in the middle", "few values", "with NaN", "sorted"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_the_kth_lowest_is_what_a_partition_answers(shape, masked):
    rng = np.random.default_rng(SHAPES.index(shape) + 10 * masked)
    n = 3 * kth.WORTH
    values = scores_of(shape, n, rng)
    where = rng.random(n) < 0.7 if masked else None
    kept = values if where is None else values[where]
    for k in (1, 2, 17, 100, len(kept) // 100, len(kept) // 5, len(kept) // 2, len(kept) - 1, len(kept)):
        want = np.partition(kept, k - 1)[k - 1]
        got = kth_lowest(values, k, where=where)
        assert got.dtype == values.dtype and (got == want or (np.isnan(got) and np.isnan(want))), (k, got, want)


def test_small_sets_and_a_bad_k():
    values = np.array([3, 1, 2, 1], dtype=np.float32)
    assert [kth_lowest(values, k) for k in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert kth_lowest(values, 1, where=np.array([True, False, True, False])) == 2
    for k in (0, 5):
        with pytest.raises(ValueError, match=f"k={k} of 4"):
            kth_lowest(values, k)
    with pytest.raises(ValueError, match="k=1 of 0"):
        kth_lowest(values, 1, where=np.zeros(4, dtype=bool))


@pytest.mark.parametrize("shape", ["random", "tied at the bottom", "tied in the middle"])
def test_a_small_k_never_partitions_most_of_the_scores(shape, monkeypatch):
    """The point of kth.py: where 1% is asked of many scores, whether or not a fifth tie at the
    k-th, no partition runs over more than a few times k of them (a partition of every score, for a
    k inside a tie at the bottom, took 4-20 times as long as over random ones)."""
    rng = np.random.default_rng(SHAPES.index(shape))
    n = 8 * kth.WORTH
    values = scores_of(shape, n, rng)
    sizes = []
    partition = np.partition
    monkeypatch.setattr(np, "partition", lambda a, k, *args, **kw: sizes.append(len(a)) or partition(a, k, *args, **kw))
    k = n // 100
    got = kth_lowest(values, k)
    monkeypatch.undo()
    assert got == np.partition(values, k - 1)[k - 1]
    assert sizes and max(sizes) <= 4 * k, sizes


def sampled(n: int) -> np.ndarray:
    """The positions kth's sample reads among n scores."""
    return (kth.SPREAD * n).astype(np.int64)


def test_a_bar_under_the_kth_falls_back_to_the_whole_partition():
    """Every sampled score is 0 and no other: the bar lies under the k-th (fewer than k at or under
    it), and the answer is the whole partition's, not the bar (a review)."""
    n = 3 * kth.WORTH
    values = np.ones(n, dtype=np.float32)
    values[sampled(n)] = 0
    k = int(np.count_nonzero(values == 0)) + 5
    assert kth_lowest(values, k) == np.partition(values, k - 1)[k - 1] == 1.0


def test_exactly_k_scores_strictly_under_the_bar():
    """The sample holds 2.0 only (the bar) and exactly k distinct scores off the sample lie under
    it: the k-th is the largest of them, not the bar (a review)."""
    n = 3 * kth.WORTH
    values = np.full(n, 3.0, dtype=np.float32)
    values[sampled(n)] = 2.0
    k = 50
    values[np.flatnonzero(values == 3.0)[:k]] = np.linspace(0.0, 1.0, k, dtype=np.float32)
    assert kth_lowest(values, k) == np.partition(values, k - 1)[k - 1] == 1.0


@pytest.mark.parametrize("share", [0.3, 0.25, 0.2, 0.13])
def test_a_k_past_an_eighth_partitions_the_scores_once(monkeypatch, share):
    """Where k is past n / (4 * MARGIN), the bar would stand past a quarter of the scores, and the
    gather and partition under it, or the whole partition after it, cost more than the whole
    partition alone: it runs at once (k of 30% cost 1.7x, of 25% 1.75x, reviews)."""
    values = np.random.default_rng(3).random(4 * kth.WORTH).astype(np.float32)
    sizes = []
    partition = np.partition
    monkeypatch.setattr(np, "partition", lambda a, k, *args, **kw: sizes.append(len(a)) or partition(a, k, *args, **kw))
    k = int(share * len(values))
    got = kth_lowest(values, k)
    monkeypatch.undo()
    assert got == np.partition(values, k - 1)[k - 1] and sizes == [len(values)]


def chains_leaves_cold(n: int, depth: int) -> np.ndarray:
    """LRU-like scores of n // depth chains in consecutive rows, each deeper block colder (a chain's
    unread tail)."""
    d = np.tile(np.arange(depth), n // depth)
    return 20.0 + (1.0 - d / depth) + np.repeat(np.arange(n // depth), depth) * 1e-9


@pytest.mark.parametrize("depth,chains", [(16, 1 << 16), (64, 1 << 14), (256, 1 << 12), (16, 75025),
                                          (16, 28657), (155, 6765), (17, 75025), (8, 196418)])
def test_the_sample_has_no_period_for_equal_chains_to_alias_with(depth, chains):
    """Chains of a length that divides a stride (16 deep among 2**20 rows: a stride of 256 sampled
    the roots alone, the hottest), or a count of chains near a Fibonacci number (a golden-ratio
    sequence's every sample a root): the bar still bounds the k-th, no whole partition after a
    wasted pass (make_room 1.85x, reviews)."""
    values = chains_leaves_cold(depth * chains, depth)
    for k in (1, len(values) // 100):
        assert kth._under_a_bar(values, k, len(values), None) == np.partition(values, k - 1)[k - 1]
