"""A drain's cold cut ranked by the hottest block under each (dflash2/coldcut.py): peaks pushed up
over the blocks at or above a rising edge, the same as pushed up over the whole tier."""

from types import SimpleNamespace

import numpy as np
import pytest

from dflash2 import coldcut
from dflash2.forest import subtree_heights, subtree_peaks


def random_table(rng, n: int, tiers: int = 3, roots: float = 0.1, rising: float = 0.3):
    """Columns of a table of `n` rows in prefix trees (parents at lower rows, then shuffled), each
    row in one of `tiers` tiers or free (-1), and scores that rise from parent to child on about
    `rising` of the edges."""
    parent = np.array([-1 if i == 0 or rng.random() < roots else int(rng.integers(max(0, i - 8), i))
                       for i in range(n)])
    tier = rng.integers(-1, tiers, n).astype(np.int8)
    scores = np.zeros(n)
    for i in range(n):  # (parents first)
        base = scores[parent[i]] if parent[i] >= 0 else 10.0
        scores[i] = base + (rng.random() if rng.random() < rising else -rng.random())
    perm = rng.permutation(n)
    where = np.argsort(perm)  # old row -> new row
    parent = np.where(parent[perm] >= 0, where[np.maximum(parent[perm], 0)], -1).astype(np.int32)
    return SimpleNamespace(tier=tier[perm], parent=parent), scores[perm]


def walked_peaks(cols, tier: int, scores: np.ndarray) -> np.ndarray:
    """The peaks by walking up from every row of the tier through its rows (the definition)."""
    out = scores.astype(np.float64).copy()
    for row in np.flatnonzero(cols.tier == tier):
        up = cols.parent[row]
        while up >= 0 and cols.tier[up] == tier:
            out[up] = max(out[up], scores[row])
            up = cols.parent[up]
    return out


CLIMBS = {"rounds": {"LEVEL_ROWS": 0, "WALK_BELOW": 0},  # numpy rounds only, never over budget
          "walk": {"WALK_BELOW": 10**9, "WALK_ROWS": 0},  # the walk in Python only
          "whole": {"LEVEL_ROWS": 10**9, "WALK_ROWS": 10**9},  # every call over budget: the whole tier
          "shipped": {}}


@pytest.mark.parametrize("rising", [0.0, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("climb", sorted(CLIMBS))
def test_peaks_are_the_highest_score_under_each_row_in_its_tier(monkeypatch, rising, climb):
    """Whatever share of the edges rise, and whichever way the rows above them are found (numpy
    rounds, the walk in Python, or the pass over the whole tier where the climb's budget runs out),
    each row of the tier peaks at the highest score of its subtree in the tier, and rows of other
    tiers keep their own scores."""
    for name, value in CLIMBS[climb].items():
        monkeypatch.setattr(coldcut, name, value)
    rng = np.random.default_rng(int(rising * 100) + len(climb))
    for _ in range(30):
        cols, scores = random_table(rng, int(rng.integers(1, 400)), rising=rising)
        for tier in range(3):
            got = coldcut.peak_scores(cols, tier, scores)
            assert np.array_equal(got, walked_peaks(cols, tier, scores))
            if rising == 0.0:
                assert got is scores  # nothing rises: no copy, no pass


@pytest.mark.parametrize("trunk, leaves, climbed", [(40, 100, True), (100, 20, False)])
def test_the_climb_counts_each_row_once_a_level(monkeypatch, trunk, leaves, climbed):
    """A trunk of `trunk` blocks (falling scores) with `leaves` rising leaves under its last, a round
    counted as 10 rows: the climb goes up the trunk once, not once per leaf (40 x 11 of a budget of
    4 x 140), and a trunk too deep for the budget (100 x 11 of 4 x 120) goes to the pass over the
    whole tier; the same peaks either way."""
    monkeypatch.setattr(coldcut, "LEVEL_ROWS", 10)
    monkeypatch.setattr(coldcut, "WALK_BELOW", 0)  # (numpy rounds all the way up)
    parent = np.array([-1] + list(range(trunk - 1)) + [trunk - 1] * leaves, dtype=np.int32)
    scores = np.concatenate([np.arange(trunk, 0, -1.0), np.full(leaves, 100.0)])
    cols = SimpleNamespace(tier=np.zeros(trunk + leaves, dtype=np.int8), parent=parent)
    climbs = []
    at_or_above = coldcut._at_or_above
    monkeypatch.setattr(coldcut, "_at_or_above", lambda *a: climbs.append(at_or_above(*a)) or climbs[-1])
    assert np.array_equal(coldcut.peak_scores(cols, 0, scores), walked_peaks(cols, 0, scores))
    assert (climbs[0] is not None) == climbed
    if climbed:
        assert climbs[0].sum() == trunk  # the trunk, at or above the leaves' parent


@pytest.mark.parametrize("walk_rows, walked", [(16, True), (10**4, False)])
def test_a_rise_under_a_deep_prefix_is_walked_up(monkeypatch, walk_rows, walked):
    """Two chains 3,000 deep beside 50,000 one-block chains, one block rising at the bottom of each
    deep one (a request's first block written under a prefix it read, under lru): the two rows walk up
    in Python, 6,000 steps at 16 rows a step of a budget of 4 x 56,000 rows, not 3,000 rounds of numpy
    calls; a step counted as 10,000 rows sends the call to the pass over the whole tier. The same
    peaks either way."""
    monkeypatch.setattr(coldcut, "WALK_ROWS", walk_rows)
    depth, singles = 3000, 50_000
    parent = np.concatenate([[-1], np.arange(depth - 1), [-1], np.arange(depth, 2 * depth - 1),
                             np.full(singles, -1)]).astype(np.int32)
    scores = np.concatenate([np.full(depth, 5.0), np.full(depth, 7.0), np.zeros(singles)])
    scores[[depth - 1, 2 * depth - 1]] = [9.0, 8.0]
    cols = SimpleNamespace(tier=np.zeros(len(parent), dtype=np.int8), parent=parent)
    climbs = []
    at_or_above = coldcut._at_or_above
    monkeypatch.setattr(coldcut, "_at_or_above", lambda *a: climbs.append(at_or_above(*a)) or climbs[-1])
    peaks = coldcut.peak_scores(cols, 0, scores)
    assert peaks.tolist() == [9.0] * depth + [8.0] * depth + [0.0] * singles
    assert (climbs[0] is not None) == walked


def test_the_cold_mask_is_closed_downward_and_holds_the_thresholds_share():
    """Every child in the tier of a cold row is cold, and the cut holds ceil(t*n) rows of the tier
    or more (ties at the cutoff)."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        cols, scores = random_table(rng, int(rng.integers(2, 300)), rising=0.5)
        for t in (0.05, 0.5, 0.9):
            cold = coldcut.cold_mask(cols, 0, scores, t)
            in_tier = cols.tier == 0
            assert not (cold & ~in_tier).any()
            kids = np.flatnonzero(in_tier & (cols.parent >= 0))
            kids = kids[in_tier[cols.parent[kids]]]
            assert not (cold[cols.parent[kids]] & ~cold[kids]).any()
            assert cold.sum() >= np.ceil(t * in_tier.sum() - 1e-9)


def test_subtree_peaks_match_subtree_heights_peaks():
    """The peaks alone, scattered where no branch shares an ancestor: those subtree_heights pushes
    up with ufunc.at, on branching trees with ties."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        parent = np.array([-1 if i == 0 or rng.random() < 0.1 else int(rng.integers(0, i)) for i in range(n)])
        values = rng.integers(0, 5, n).astype(np.float64)
        _, peaks = subtree_heights(parent, np.zeros(n, dtype=bool), values)
        assert np.array_equal(subtree_peaks(parent, values), peaks)
    with pytest.raises(ValueError, match="cycle"):
        subtree_peaks(np.array([1, 0]), np.zeros(2))
    with pytest.raises(ValueError, match="outside"):
        subtree_peaks(np.array([5]), np.zeros(1))
    with pytest.raises(ValueError, match="2 values for 1 nodes"):
        subtree_peaks(np.array([-1]), np.zeros(2))
