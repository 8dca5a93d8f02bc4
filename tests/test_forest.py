"""forest.subtree_heights (pointer jumping) and the leaving order it gives placement: the same
victims, in the same order, as a walk of the tree one level per round."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2 import forest
from dflash2.ancestry import closed_upward
from dflash2.forest import MAP_BYTES, SPARSE_SPAN, local_parents, lowest_levels, reaches_marked, subtree_heights
from dflash2.table.columns import NO_ROW
from dflash2.tiers import Tier

from conftest import SMALL


def heights_by_recursion(parent, blocked):
    """The definition, one node at a time."""
    n = len(parent)
    kids = [[] for _ in range(n)]
    for i, p in enumerate(parent):
        if p >= 0:
            kids[p].append(i)

    def h(i):
        below = [h(k) for k in kids[i]]
        if blocked[i] or any(b < 0 for b in below):
            return -1
        return 1 + max(below) if below else 0
    return [h(i) for i in range(n)]


def test_a_chain_counts_down_to_its_leaf_and_a_block_holds_everything_above_it():
    chain = np.array([-1, 0, 1, 2, 3])
    assert subtree_heights(chain, np.zeros(5, bool)).tolist() == [4, 3, 2, 1, 0]
    held = np.zeros(5, bool)
    held[3] = True
    assert subtree_heights(chain, held).tolist() == [-1, -1, -1, -1, 0]


def test_a_deep_chain_takes_logarithmic_rounds_and_the_right_heights():
    n = 5000
    parent = np.arange(-1, n - 1)
    assert (subtree_heights(parent, np.zeros(n, bool)) == np.arange(n - 1, -1, -1)).all()


def test_branches_take_the_longest_path_down():
    #      0
    #    1   2
    #   3     4
    #         5
    parent = np.array([-1, 0, 0, 1, 2, 4])
    assert subtree_heights(parent, np.zeros(6, bool)).tolist() == [3, 1, 2, 0, 1, 0]


def test_bad_parent_arrays_are_refused():
    with pytest.raises(ValueError, match="cycle"):
        subtree_heights(np.array([1, 0]), np.zeros(2, bool))
    with pytest.raises(ValueError, match="outside"):
        subtree_heights(np.array([-1, 5]), np.zeros(2, bool))
    with pytest.raises(ValueError, match="blocked flags"):
        subtree_heights(np.array([-1, 0]), np.zeros(3, bool))


@st.composite
def forests(draw):
    n = draw(st.integers(0, 60))
    # parents point to lower indices: a forest, with chains, branches and several roots
    parent = [draw(st.integers(-1, i - 1)) if i else -1 for i in range(n)]
    blocked = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # relabel at random so that parents are not always lower than their children
    perm = draw(st.permutations(range(n)))
    inv = {old: new for new, old in enumerate(perm)}
    out_parent = [-1] * n
    out_blocked = [False] * n
    for old in range(n):
        out_parent[inv[old]] = inv[parent[old]] if parent[old] >= 0 else -1
        out_blocked[inv[old]] = blocked[old]
    return np.array(out_parent, dtype=np.int64), np.array(out_blocked, dtype=bool)


@settings(max_examples=300, deadline=None)
@given(forests())
def test_heights_match_the_definition(forest):
    parent, blocked = forest
    assert subtree_heights(parent, blocked).tolist() == heights_by_recursion(parent.tolist(), blocked.tolist())


@settings(max_examples=200, deadline=None)
@given(forests(), st.data())
def test_peaks_are_each_subtrees_largest_value(forest, data):
    """subtree_heights' `values`: the largest value in each node's subtree, itself included (what a
    policy of strict order takes its blocks by: placement.py `_leaving`)."""
    parent, blocked = forest
    n = len(parent)
    values = np.array(data.draw(st.lists(st.integers(-50, 50), min_size=n, max_size=n)), dtype=np.float64)
    kids = [[] for _ in range(n)]
    for i, p in enumerate(parent.tolist()):
        if p >= 0:
            kids[p].append(i)

    def peak(i):
        return max([values[i]] + [peak(k) for k in kids[i]])

    heights, peaks = subtree_heights(parent, blocked, values)
    assert heights.tolist() == heights_by_recursion(parent.tolist(), blocked.tolist())
    assert peaks.tolist() == [peak(i) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(forests(), st.data())
def test_lowest_levels_are_the_heights_of_the_head_that_weighs_enough(forest, data):
    """lowest_levels: where it answers, every node of height h or less has its height (as
    subtree_heights gives it) and every other node -1, h the first height at which those nodes weigh
    `enough`, or the tallest where they never do; None only where that h lies past `levels`."""
    parent, blocked = forest
    n = len(parent)
    weight = np.array(data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)), dtype=np.int64)
    enough = data.draw(st.integers(0, 5 * n + 5))
    levels = data.draw(st.integers(0, 8))
    full = np.array(heights_by_recursion(parent.tolist(), blocked.tolist()), dtype=np.int64)
    tallest = int(full.max()) if (full >= 0).any() else -1
    h = next((h for h in range(tallest + 1) if weight[(full >= 0) & (full <= h)].sum() >= enough), tallest)
    got = lowest_levels(parent, blocked, weight, enough, levels)
    if h >= levels:
        assert got is None
        return
    assert got is not None and got.tolist() == np.where(full <= h, full, -1).tolist()


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([(0, 0), (forest.SPARSE_SPAN, forest.MAP_BYTES), (10 ** 9, 10 ** 18)]))
def test_local_parents_index_each_rows_parent_among_the_rows(data, span_bytes):
    """local_parents through its sparse map (entries outside `rows` never written) or its search
    ((0, 0): always; 10**9: never): each row's parent's index among the rows, -1 where the parent is
    none (any negative value) or not among them, whatever garbage the map's other entries hold."""
    forest.SPARSE_SPAN, forest.MAP_BYTES = span_bytes
    try:
        check_local_parents(data)
    finally:
        forest.SPARSE_SPAN, forest.MAP_BYTES = SPARSE_SPAN, MAP_BYTES


def check_local_parents(data):
    table = data.draw(st.integers(1, 5000))
    rows = data.draw(st.lists(st.integers(0, table - 1), unique=True, max_size=60))
    parents = [data.draw(st.integers(-3, table - 1)) for _ in rows]
    where = {row: i for i, row in enumerate(rows)}
    want = [where.get(p, -1) if p >= 0 else -1 for p in parents]
    got = local_parents(np.array(rows, dtype=np.int64), np.array(parents, dtype=np.int32))
    assert got.dtype == np.int64 and got.tolist() == want


def test_a_few_rows_of_a_large_table_are_searched_not_mapped(monkeypatch):
    """A 1,024-block chain among 16 million rows: no map of the table's size (mapped fresh and
    faulted in at every call past 32 MiB: 3.4 ms against a search's 33 us, a review)."""
    made = []
    empty = np.empty
    monkeypatch.setattr(np, "empty", lambda size, *args, **kw: made.append(size) or empty(size, *args, **kw))
    rows = np.arange(16_000_000 - 1024, 16_000_000, dtype=np.int64)
    got = local_parents(rows, rows - 1)
    monkeypatch.undo()
    assert got.tolist() == list(range(-1, 1023)) and max(made, default=0) < 16 * len(rows)


def test_a_choice_among_a_million_rows_is_mapped_not_searched(monkeypatch):
    """50,000 rows scattered over a million (a choice of 5%): the map, 4 MB, costs a third of the
    search (a review: the search taken past 16 entries a row cost 2.5-3x)."""
    searched = []
    monkeypatch.setattr(np, "searchsorted", lambda *args, **kw: searched.append(1) or pytest.fail("searched"))
    rows = np.sort(np.random.default_rng(0).choice(1_000_000, 50_000, replace=False))
    got = local_parents(rows, rows - 1)
    monkeypatch.undo()
    assert not searched and got.tolist() == [i - 1 if i and rows[i - 1] == rows[i] - 1 else -1
                                             for i in range(len(rows))]


def test_a_choice_over_a_full_table_of_2_to_the_23_rows_is_searched(monkeypatch):
    """Its map (the highest row near 2**23: 32 MiB less a few bytes) is mapped fresh and faulted in at
    every call, as one past 32 MiB: the search (10,000 scattered rows: 3.5 ms mapped against 0.19
    searched, a review)."""
    searched = []
    real = np.searchsorted
    monkeypatch.setattr(np, "searchsorted", lambda *a, **kw: searched.append(1) or real(*a, **kw))
    rows = np.sort(np.random.default_rng(1).choice(2 ** 23, 10_000, replace=False))
    local_parents(rows, rows - 1)
    monkeypatch.undo()
    assert searched


def test_local_parents_ignore_what_the_map_held_before():
    """The map is taken unwritten: memory a previous call left full of indices must not pass for
    this call's (freed and taken again at once by numpy's allocator)."""
    rows, parents = np.arange(100_000, dtype=np.int64), np.arange(-1, 99_999, dtype=np.int64)
    assert local_parents(rows, parents).tolist() == list(range(-1, 99_999))
    few = np.array([5, 70_000], dtype=np.int64)
    assert local_parents(few, np.array([70_000, 69_999])).tolist() == [1, -1]


def test_lowest_levels_stop_at_the_level_that_weighs_enough_exactly():
    # 0 <- 1 <- 2 and 3 <- 4, heights 2 1 0 1 0; 5 waits on a child outside (blocked), 6 under it
    parent, blocked = np.array([-1, 0, 1, -1, 3, -1, 5]), np.array([0, 0, 0, 0, 0, 1, 0], dtype=bool)
    weight = np.ones(7, dtype=np.int64)
    assert lowest_levels(parent, blocked, weight, 3, 8).tolist() == [-1, -1, 0, -1, 0, -1, 0]
    assert lowest_levels(parent, blocked, weight, 4, 8).tolist() == [-1, 1, 0, 1, 0, -1, 0]
    assert lowest_levels(parent, blocked, weight, 99, 8).tolist() == [2, 1, 0, 1, 0, -1, 0]
    assert lowest_levels(parent, blocked, weight, 99, 2) is None
    assert lowest_levels(parent, blocked, weight, 99, 3).tolist() == [2, 1, 0, 1, 0, -1, 0]


def test_lowest_levels_with_the_last_node_a_parent_resolving_late():
    """0 a lone root leaf, 3 <- 1 <- 2: the roots' round must not count a child of node -1 (the last
    node, 3) resolved (a review: without the guard 3's height came out 1)."""
    parent, blocked = np.array([-1, 3, 1, -1]), np.zeros(4, dtype=bool)
    assert subtree_heights(parent, blocked).tolist() == [0, 1, 0, 2]
    assert lowest_levels(parent, blocked, np.ones(4), 99, 8).tolist() == [0, 1, 0, 2]


def test_lowest_levels_refuses_arrays_of_other_lengths():
    with pytest.raises(ValueError, match="2 blocked flags and 3 weights for 3 nodes"):
        lowest_levels(np.array([-1, 0, 1]), np.zeros(2, bool), np.ones(3), 1, 4)


def leaving_by_levels(placement, tier, below, evict, scores):
    """The walk placement used before: one round of numpy calls per tree level."""
    c = placement.table.cols
    if evict:
        remaining = c.nkids.copy()
    else:
        remaining = c.kids[0].astype(np.int32)
        for t in range(1, int(tier) + 1):
            remaining += c.kids[t]
    rows = np.flatnonzero(below)
    levels = []
    front = rows[remaining[rows] == 0]
    while len(front):
        levels.append(front)
        up = c.parent[front]
        up = up[up != NO_ROW]
        up = up[below[up]]
        if not len(up):
            break
        np.subtract.at(remaining, up, 1)
        up = np.unique(up)
        front = up[remaining[up] == 0]
    if not levels:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([level[np.argsort(scores[level], kind="stable")] for level in levels])


@pytest.mark.parametrize("seed", range(12))
def test_placement_leaves_in_the_order_of_the_level_walk(make_manager, clock, seed):
    """Random prefix trees over two tiers (some blocks pinned, some children already below): every
    cut of the scores picks the same rows in the same order as the walk a level per round."""
    rng = np.random.default_rng(seed)
    mgr = make_manager(hbm_blocks=120, dram_blocks=200)
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    t = mgr.table
    made = []
    for _ in range(50):
        parent = None
        if made and rng.random() < 0.8:
            parent = int(made[rng.integers(len(made))])
        n = int(rng.integers(1, 6))
        vids = mgr.allocate(c, lid, n)
        if vids is None:
            break
        keys = [int(k) for k in rng.integers(1, 2**62, size=n)]
        t.commit(c, vids, keys=keys, parent=parent)
        mgr.free(c, vids)
        made.extend(int(v) for v in vids)
        clock.advance(float(rng.random()))
    rows = t.rows(np.array(made, dtype=np.int64))
    down = rows[rng.random(len(rows)) < 0.15]
    mgr.placement.mover.move(down[t.evictable(down) & (t.cols.nkids[down] == 0)], Tier.DRAM)
    pinned = rows[rng.random(len(rows)) < 0.05]
    t.pin(c, t.vids(pinned))
    scores = rng.integers(0, 6, size=t.cols.capacity).astype(np.float32)  # many ties
    for tier in (Tier.HBM, Tier.DRAM):
        for evict in (False, True):
            reach = mgr.placement.movable(tier, evict=evict)
            for cut in range(6):
                below = reach & (scores <= cut)
                want = leaving_by_levels(mgr.placement, tier, below, evict, scores)
                got = mgr.placement._leaving(tier, np.flatnonzero(below), evict, scores)
                assert got.tolist() == want.tolist(), (tier, evict, cut)
                # With a room to make: the head of that order that holds it (all of it where none does).
                slots = np.cumsum(mgr.placement._slot_bytes(tier, want))
                for need in (1, 3 * SMALL.block_bytes, 40 * SMALL.block_bytes, 10 ** 9):
                    head = mgr.placement._leaving(tier, np.flatnonzero(below), evict, scores, need_bytes=need)
                    assert head.tolist() == want[:len(head)].tolist(), (tier, evict, cut, need)
                    assert len(head) == len(want) or slots[len(head) - 1] >= need, (tier, evict, cut, need)
    mgr.check_invariants()


def _chain(mgr, client, lid, keys, parent=None):
    vids = mgr.allocate(client, lid, len(keys))
    vids = mgr.commit(client, vids, keys=keys, parent=parent)
    mgr.free(client, vids)
    return vids


def test_a_chain_is_evicted_in_one_table_call_in_any_order_or_not_at_all(make_manager):
    """evict drops a parent with its children in one call (it took a call per level); a set that
    leaves a cached child behind, or holds a pinned block, is refused whole: nothing is dropped."""
    from dflash2.errors import PinnedBlock

    mgr = make_manager(hbm_blocks=16)
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    t = mgr.table
    chain = _chain(mgr, c, lid, [1, 2, 3, 4, 5])
    side = _chain(mgr, c, lid, [6], parent=int(chain[1]))
    rows = t.rows(chain)
    with pytest.raises(PinnedBlock, match="cached children that stay"):
        t.evict(rows[[1, 3, 0, 2, 4]])  # block 2's child 6 is not among them
    assert len(mgr.lookup([1, 2, 3, 4, 5], lid)) == 5
    t.pin(c, side)
    with pytest.raises(PinnedBlock):
        t.evict(np.concatenate([rows, t.rows(side)]))
    t.unpin(c, side)
    with pytest.raises(ValueError, match="twice"):
        t.evict(np.concatenate([rows, rows[:1]]))
    t.evict(np.concatenate([rows[[1, 3, 0, 2, 4]], t.rows(side)]))
    assert mgr.lookup([1], lid) == [] and t.cols.live == 0
    mgr.check_invariants()


def test_a_refused_chain_is_dropped_in_one_eviction(make_manager, clock):
    """Admission refusing a whole cold chain (demoted into the full last tier) drops it in one call
    (it took a round per level); a refused parent whose child is admitted is demoted with it."""
    mgr = make_manager(hbm_blocks=8, dram_blocks=8, policy="heat")
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    hot = _chain(mgr, c, lid, list(range(100, 108)))
    for _ in range(3):  # DRAM's blocks are referenced more often than the chain that will come
        mgr.acquire(c, hot)
        mgr.release(c, hot)
    clock.advance(1)
    mgr.placement.make_room(Tier.HBM, 8 * 16384)  # hot chain to DRAM, DRAM now full
    _chain(mgr, c, lid, list(range(1, 9)))  # the cold chain admission will refuse
    calls = []
    evict = mgr.table.evict

    def counting(rows):
        calls.append(len(rows))
        return evict(rows)
    mgr.table.evict = counting
    clock.advance(1)
    assert mgr.placement.make_room(Tier.HBM, 8 * 16384)
    assert mgr.lookup(list(range(1, 9)), lid) == []
    assert len(mgr.lookup(list(range(100, 108)), lid)) == 8
    assert calls == [8] and mgr.placement.stats.not_admitted == 8
    mgr.check_invariants()


def ancestors_by_walk(cols, rows):
    """The walk promotion used for every list: each row's path up to a row already listed."""
    seen: dict[int, None] = {}
    for r in rows:
        path, p = [], r
        while p >= 0 and p not in seen:
            path.append(p)
            p = int(cols.parent[p])
        for q in reversed(path):
            seen[q] = None
    return list(seen)


@pytest.mark.parametrize("seed", range(8))
def test_a_prefix_listed_ancestors_first_is_its_own_list_and_others_are_walked(make_manager, seed):
    """Promotion brings each block's cached ancestors first. A list that already holds every parent
    ahead of its child (a request's prefix as it reads it) is returned as it is, without the walk;
    any other list (a parent missing, after its child, or listed twice) is walked: the same result."""
    rng = np.random.default_rng(seed)
    mgr = make_manager(hbm_blocks=200)
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    made = []
    for _ in range(30):
        parent = int(made[rng.integers(len(made))]) if made and rng.random() < 0.7 else None
        made.extend(int(v) for v in _chain(mgr, c, lid, [int(k) for k in rng.integers(1, 2**62, 4)], parent))
    t = mgr.table
    rows = t.rows(np.array(made, dtype=np.int64))
    walked = 0
    for _ in range(40):
        leaf = int(rows[rng.integers(len(rows))])
        prefix = ancestors_by_walk(t.cols, [leaf])  # root first: closed upward
        cases = [prefix, prefix[1:], prefix[::-1], prefix + prefix[-1:],
                 rng.permutation(rows[:20]).tolist(), sorted(rows[:20].tolist())]
        for case in cases:
            arr = np.array(case, dtype=np.int64)
            want = ancestors_by_walk(t.cols, case)
            assert mgr.placement.with_ancestors(arr, Tier.HBM).tolist() == want
            walked += not closed_upward(arr, t.cols.parent)
    assert closed_upward(np.array(ancestors_by_walk(t.cols, [int(rows[-1])]), dtype=np.int64), t.cols.parent)
    assert walked  # the walk itself ran too


@st.composite
def forests_with_marks(draw):
    n = draw(st.integers(1, 60))
    parent = [draw(st.integers(-1, i - 1)) if i else -1 for i in range(n)]  # parents before children: no cycle
    marked = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    nodes = sorted(set(draw(st.lists(st.integers(0, n - 1), max_size=n))))
    return np.array(parent), np.array(marked), np.array(nodes, dtype=np.int64)


def reaches_by_walk(parent, marked, nodes) -> list[bool]:
    """The definition: from each node climb while inside `nodes`, looking at the first node outside."""
    inside = set(nodes.tolist())

    def reaches(i):
        while True:
            if marked[i]:
                return True
            if i not in inside or parent[i] < 0:
                return False
            i = parent[i]
    return [reaches(i) for i in nodes.tolist()]


@given(forests_with_marks())
@settings(max_examples=300, deadline=None)
def test_reaches_marked_walks_up_through_the_nodes_only(case):
    parent, marked, nodes = case
    assert reaches_marked(parent, marked, nodes).tolist() == reaches_by_walk(parent, marked, nodes)


@given(forests_with_marks(), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_reaches_marked_takes_its_shortcut_only_where_the_walk_agrees(case, random):
    """Nodes numbered in any order (a table's rows are reused: a parent may come after its child),
    and marks closed downward (every child of a marked node marked, as a drain's cold cut usually
    is: the one-pass answer) or not (the walk): both give the definition's answer."""
    parent, marked, nodes = case
    n = len(parent)
    order = list(range(n))
    random.shuffle(order)
    new = np.array(order)  # node i is numbered new[i]
    shuffled = np.full(n, -1)
    shuffled[new] = np.where(parent >= 0, new[np.maximum(parent, 0)], -1)
    marks = np.zeros(n, dtype=bool)
    marks[new] = marked
    closed = marks.copy()
    for i in range(n):  # parents before children in the original numbering: one pass closes it
        if parent[i] >= 0 and closed[new[parent[i]]]:
            closed[new[i]] = True
    at = np.sort(new[nodes])
    for m in (marks, closed):
        assert reaches_marked(shuffled, m, at).tolist() == reaches_by_walk(shuffled, m, at)


def test_reaches_marked_refuses_a_cycle():
    """Nodes 0 and 1 are each other's parent; node 3 lies under the marked node 2, so the walk runs."""
    parent, marked = np.array([1, 0, -1, 2]), np.array([False, False, True, False])
    with pytest.raises(ValueError, match="cycle"):
        reaches_marked(parent, marked, np.arange(4))
    # With no unmarked node under a mark, nothing is walked and nothing reaches a mark but the marks.
    assert reaches_marked(parent, np.zeros(4, dtype=bool), np.arange(4)).tolist() == [False] * 4
