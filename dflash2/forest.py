"""Passes over a set of prefix-tree nodes in O(log depth) vectorised rounds (pointer jumping).

A prefix chain is as deep as its prompt is long in blocks (a 256k-token prompt of 256-token blocks
is 1,024 deep), so a pass that walks the tree one level per round costs one round of numpy calls
per block of the chain: making room for one long prefix took ~10 ms of selection for a copy of
~1 ms. Here every round doubles how far each node sees up its chain (node -> parent -> grandparent
-> 4th ancestor ...), so a chain of depth D takes ceil(log2 D) rounds whatever its length. One
pass walks a level a round on purpose: `lowest_levels`, for a room that a few levels of many chains
hold (at most the caller's number of rounds, each over the last level only).

Nodes are local indices 0..n-1; `parent[i]` is i's parent among them, or -1 when i's parent is not
in the set (a root here). Pure numpy: no table, no policy.
"""

from __future__ import annotations

import numpy as np


def ranked(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, rows[order]): `rows` sorted, and where each sorted one stands in `rows`."""
    order = np.argsort(rows, kind="stable")
    return order, rows[order]


# local_parents' map spans the table up to the highest row: a search instead where the map would be
# past MAP_BYTES and past SPARSE_SPAN entries a row. glibc maps an allocation of 32 MiB or more fresh
# at every call, its header and page rounding counted: a map 4 KiB under 32 MiB was mapped so too (a
# table of 2**23 rows, whose highest row makes a map of 32 MiB less 1 KiB: 19x the search, a review).
SPARSE_SPAN = 16
MAP_BYTES = (32 << 20) - (64 << 10)


def local_parents(rows: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Per row of `rows` (distinct table rows), the index in `rows` of its parent `parents[i]` (a
    table row, or any negative value for none), or -1 where the parent is not among `rows`: the
    `parent` array the passes here take. Found through a map from table row to index, left
    unwritten but at `rows` (a sparse set: an entry read elsewhere is garbage, clipped into range and
    refused by the check that the row there is the parent): 1.3 ms against 3.9 for a search per row
    over the 195,098 rows of a choice at a million blocks (an experiment, the 2-core VM), and 2.5-3x
    the search for 10,000-50,000 rows of a million (a review). Where the map would be past MAP_BYTES
    and span more than SPARSE_SPAN entries a row (a chain of a table of millions), the search: a map
    that large is mapped fresh and faulted in at every call (a 1,024-block chain of a table of 16
    million rows 3.4 ms against 33 us, a review)."""
    rows = np.asarray(rows, dtype=np.int64)
    n = len(rows)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    parents = np.asarray(parents, dtype=np.int64)
    linked = parents >= 0
    size = int(max(rows.max(), parents.max())) + 1
    index_type = np.int32 if n <= np.iinfo(np.int32).max else np.int64
    if size * np.dtype(index_type).itemsize > MAP_BYTES and size > SPARSE_SPAN * n:
        order = np.argsort(rows, kind="stable")
        at = np.minimum(np.searchsorted(rows[order], parents), n - 1)
        return np.where(linked & (rows[order][at] == parents), order[at], -1)
    index = np.empty(size, dtype=index_type)
    index[rows] = np.arange(n, dtype=index.dtype)
    at = index[np.where(linked, parents, 0)].astype(np.int64)
    np.clip(at, 0, n - 1, out=at)
    return np.where(linked & (rows[at] == parents), at, -1)


def _forest_of(parent, per_node: int, what: str, caller: str) -> np.ndarray:
    """`parent` as int64, checked: `per_node` of `what` for its nodes, every parent -1 or a node."""
    parent = np.asarray(parent, dtype=np.int64)
    n = len(parent)
    if per_node != n:
        raise ValueError(f"{caller}: {per_node} {what} for {n} nodes")
    if n and (parent.min() < -1 or parent.max() >= n):
        raise ValueError(f"{caller}: a parent index lies outside the set")
    return parent


def subtree_heights(parent: np.ndarray, blocked: np.ndarray, values: np.ndarray | None = None):
    """Per node, the length of the longest path down from it to a leaf of its subtree (0 for a
    leaf), or -1 when the node or any node below it is `blocked` (held back by something outside
    the set). So a node's height is >= 0 exactly when its whole subtree can go, and the heights
    order the nodes leaves first: a node's height exceeds each of its children's. With `values`
    (one per node), also the largest value in each node's subtree, itself included: (heights,
    peaks), pushed up the same rounds."""
    parent = _forest_of(parent, len(blocked), "blocked flags", "subtree_heights")
    held = np.array(blocked, dtype=bool)
    depth = (parent >= 0).astype(np.int64)  # distance to jump[i]; 0 at a root
    jump = parent.copy()  # i's 2**k-th ancestor in round k (-1: past the root)
    rounds = []
    for _ in range(64):  # 2**64 levels: a parent array with a cycle is refused below instead of looping
        has = np.flatnonzero(jump >= 0)
        if not len(has):
            break
        up = jump[has]
        rounds.append((has, up))
        # Held back below => held back: after round k every ancestor within 2**(k+1) - 1 of a blocked
        # node is marked.
        held[up[held[has]]] = True
        # Wyllie's list ranking: distances add along the jump, then the jump doubles (both from
        # the old values).
        depth[has] += depth[up]
        jump[has] = jump[up]
    else:
        raise ValueError("subtree_heights: the parent links form a cycle")
    # Deepest leaf under each node, pushed up the same jumps: after round k each node has seen its
    # descendants within 2**(k+1) - 1 levels.
    deepest = depth.copy()
    peaks = None if values is None else np.array(values, copy=True)
    for has, up in rounds:
        np.maximum.at(deepest, up, deepest[has])
        if peaks is not None:
            np.maximum.at(peaks, up, peaks[has])
    heights = deepest - depth
    heights[held] = -1
    return heights if peaks is None else (heights, peaks)


def subtree_peaks(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per node, the largest of `values` in its subtree, itself included (float64): `subtree_heights`'
    peaks without its heights. Pushed up as the jumps double: in round k every node hands what it has
    seen (its descendants within 2**k - 1 levels) to its 2**k-th ancestor. A scatter of the larger
    value, then ufunc.at only where nodes sharing an ancestor (a branch) left it short: maximum.at
    over every node of every round cost 12 ns a node (250-340 ms for a million rows in chains of 16
    to 1,024 on the 2-core VM, against 100-200 so)."""
    parent = _forest_of(parent, len(values), "values", "subtree_peaks")
    peaks = np.array(values, dtype=np.float64, copy=True)
    jump = parent.copy()
    for _ in range(64):  # 2**64 levels: a parent array with a cycle is refused below instead of looping
        has = np.flatnonzero(jump >= 0)
        if not len(has):
            return peaks
        up = jump[has]
        seen = peaks[has]  # (from this round's old values: gathered whole before the scatter)
        peaks[up] = np.maximum(peaks[up], seen)
        short = peaks[up] < seen  # an ancestor two of them reach kept the other's value
        if short.any():
            np.maximum.at(peaks, up[short], seen[short])
        jump[has] = jump[up]
    raise ValueError("subtree_peaks: the parent links form a cycle")


def lowest_levels(parent: np.ndarray, blocked: np.ndarray, weight: np.ndarray, enough: float,
                  levels: int) -> np.ndarray | None:
    """`subtree_heights` of the nodes of the lowest heights only: levels peeled from the leaves up
    until the nodes of heights 0..h weigh at least `enough` in all (`weight`: one per node), or until
    no further node can go. Per node its height where that is at most h, else -1 (taller, or held
    back: a node resolves the round its last child did, and a blocked node never does, nor do its
    ancestors). So every node of height h or less has its height, and the order leaves-first by
    height begins as the whole set's does. None where `levels` rounds were not enough: the caller
    takes the whole set's heights instead. A round costs a pass over the last level only: where the
    victims are a few levels of many chains, far fewer nodes than the pointer jumping of every node
    (a fifth of a million blocks tied at the cut: 195,098 nodes, 32 ms of `_leaving`, an
    experiment's profile)."""
    parent = np.asarray(parent, dtype=np.int64)
    n = len(parent)
    if len(blocked) != n or len(weight) != n:
        raise ValueError(f"lowest_levels: {len(blocked)} blocked flags and {len(weight)} weights for {n} nodes")
    blocked = np.asarray(blocked, dtype=bool)
    heights = np.full(n, -1, dtype=np.int64)
    pending = np.bincount(parent[parent >= 0], minlength=n)  # children among the nodes, not yet resolved
    level = np.flatnonzero((pending == 0) & ~blocked)
    total = 0
    for h in range(levels):
        if not len(level):
            return heights  # every node that can go has its height: the whole set's
        heights[level] = h
        total += weight[level].sum()
        if total >= enough:
            return heights
        up, count = np.unique(parent[level], return_counts=True)
        if len(up) and up[0] < 0:
            up, count = up[1:], count[1:]
        pending[up] -= count
        level = up[(pending[up] == 0) & ~blocked[up]]
    return heights if not len(level) else None


# reaches_marked's jump targets besides ancestors: the walk from there ends here, or reached a mark.
_END, _HIT = -1, -2


def reaches_marked(parent: np.ndarray, marked: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Per node of `nodes` (indices into `parent`), whether it or an ancestor is `marked`, walking up
    only through `nodes`: a parent outside them is looked at (marked or not) but not climbed past.
    `parent`: every index's parent, or any negative value for none (a table's parent column).

    First one pass: an unmarked node reaches a mark only if some unmarked node of its path has a
    marked parent (the first mark above it). Where no node has, the marked nodes are the answer: a
    set closed downward already (a million rows in chains of 16 or 256: 6-9 ms on the 2-core VM,
    against 52-72 for the walk below; an experiment). Otherwise pointer jumping (Wyllie): each unresolved node's
    jump target doubles its reach every round, so a chain of depth D costs ceil(log2 D) rounds of
    gathers, not a round per level; a target of _HIT (a mark reached) or _END (a root, or the top of
    `nodes`, with no mark) resolves the node. A cycle through `nodes` is refused whenever that walk
    runs."""
    nodes = np.asarray(nodes, dtype=np.int64)
    if len(marked) != len(parent):
        raise ValueError(f"reaches_marked: {len(marked)} marks for {len(parent)} parents")
    marked = np.asarray(marked, dtype=bool)
    up = parent[nodes]
    mine = marked[nodes]
    below_a_mark = ~mine & (up >= 0)
    below_a_mark[below_a_mark] = marked[up[below_a_mark]]
    if not below_a_mark.any():
        return mine
    index = np.int32 if len(parent) < np.iinfo(np.int32).max else np.int64  # half the bytes to gather
    jump = np.full(len(parent), _END, dtype=index)
    jump[nodes] = np.where(up >= 0, up, _END)
    jump[marked] = _HIT  # a marked node resolves whoever reaches it, inside `nodes` or not
    live = nodes[jump[nodes] >= 0].astype(index)
    for _ in range(64):  # 2**64 levels: a cycle through `nodes` is refused below instead of looping
        if not len(live):
            break
        # From this round's old values: the gather is taken whole before the scatter.
        further = jump[jump[live]]
        jump[live] = further
        live = live[further >= 0]
    else:
        raise ValueError("reaches_marked: the parent links form a cycle")
    return jump[nodes] == _HIT


def marked_or_above(parent: np.ndarray, marked: np.ndarray) -> np.ndarray:
    """Per node, whether it or a descendant among the nodes is marked (`parent`: local, -1 for none):
    the marks spread up their chains by pointer jumping, each round marking the nodes 2**r levels
    above the marked ones, so a chain of depth D takes ceil(log2 D) + 1 rounds."""
    out = np.asarray(marked, dtype=bool).copy()
    jump = np.asarray(parent, dtype=np.int64).copy()
    for _ in range(64):  # (a cycle stops here: it is no prefix tree)
        up = jump[out]
        out[up[up >= 0]] = True
        has = jump >= 0
        if not has.any():
            break
        nxt = np.full(len(jump), -1, dtype=np.int64)
        nxt[has] = jump[jump[has]]
        jump = nxt
    return out
