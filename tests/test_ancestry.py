"""A promotion's list of blocks with their cached ancestors (dflash2/ancestry.py): the paths walked
are kept, so that a chain read in pieces (sglang's backend: 64 pages an acquire) is walked up to
its root once, not once a piece; a kept path is checked link by link before it is used, so the list
is always the one the walk gives, whatever changed in the table since."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2 import ancestry
from dflash2.ancestry import Ancestry, ChainMemo
from dflash2.tiers import Tier

from conftest import SMALL
from test_forest import ancestors_by_walk


def _counting_walks(monkeypatch) -> list[int]:
    calls = []
    real = ancestry.walk

    def counted(rows, parent):
        calls.append(len(rows))
        return real(rows, parent)

    monkeypatch.setattr(ancestry, "walk", counted)
    return calls


def _piece_under(mgr, client, lid, keys, parent, tier):
    vids = mgr.allocate(client, lid, len(keys), tier=tier)
    vids = mgr.commit(client, vids, keys=keys, parent=parent)
    mgr.free(client, vids)
    return vids


def test_a_chain_read_in_pieces_is_walked_to_its_root_once(make_manager, monkeypatch):
    """A reader acquires a chain 64 blocks at a time, each piece below HBM and not listed from the
    root: the first piece walks the prefix above it, every later one is listed from the path kept
    (the walk ran once a piece, 6.4 ms a piece 32,768 deep), and each list is the walk's."""
    walks = _counting_walks(monkeypatch)
    mgr = make_manager(hbm_blocks=2700, dram_blocks=700)
    w, r = mgr.attach("w"), mgr.attach("r")
    lid = mgr.register_layout(SMALL)
    keys = iter(range(1, 10**6))
    prefix = _piece_under(mgr, w, lid, [next(keys) for _ in range(2000)], None, Tier.HBM)
    parent = int(prefix[-1])
    for i in range(10):
        vids = _piece_under(mgr, w, lid, [next(keys) for _ in range(64)], parent, Tier.DRAM)
        parent = int(vids[-1])
        rows = mgr.table.rows(vids)
        assert mgr.placement.with_ancestors(rows, Tier.HBM).tolist() == ancestors_by_walk(mgr.table.cols, rows.tolist())
        places = mgr.acquire(r, vids.tolist())
        assert places is not None and [p.tier for p in places] == [Tier.HBM] * 64
        mgr.release(r, vids.tolist())
        assert len(walks) == 1, f"piece {i}: walked {len(walks)} times"
    assert walks == [64]


def test_a_prefix_read_from_its_root_needs_no_walk_for_the_pieces_after_it(make_manager, monkeypatch):
    walks = _counting_walks(monkeypatch)
    mgr = make_manager(hbm_blocks=300, dram_blocks=300)
    w = mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    first = _piece_under(mgr, w, lid, list(range(1, 65)), None, Tier.DRAM)
    second = _piece_under(mgr, w, lid, list(range(100, 164)), int(first[-1]), Tier.DRAM)
    t = mgr.table
    assert mgr.placement.with_ancestors(t.rows(first), Tier.HBM).tolist() == t.rows(first).tolist()
    both = t.rows(np.concatenate([first, second])).tolist()
    assert mgr.placement.with_ancestors(t.rows(second), Tier.HBM).tolist() == both
    assert walks == []


def test_requests_that_share_a_prefix_each_list_their_own_piece_from_it(make_manager, monkeypatch):
    """A system prompt's chain, and under it each request's own blocks: the first request's piece
    walks the prefix, and the prefix is kept on its own, so every other request's piece is listed
    from it (before, each walked the whole prefix: 288 against 13 us at 2,000 deep, a review)."""
    walks = _counting_walks(monkeypatch)
    mgr = make_manager(hbm_blocks=900, dram_blocks=400)
    w = mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    keys = iter(range(1, 10**6))
    prefix = _piece_under(mgr, w, lid, [next(keys) for _ in range(500)], None, Tier.HBM)
    t = mgr.table
    for _ in range(6):
        own = _piece_under(mgr, w, lid, [next(keys) for _ in range(16)], int(prefix[-1]), Tier.DRAM)
        rows = t.rows(own)
        assert mgr.placement.with_ancestors(rows, Tier.HBM).tolist() == ancestors_by_walk(t.cols, rows.tolist())
    assert walks == [16]


def test_a_list_with_a_negative_row_is_walked_as_before(make_manager):
    """No row is negative (`table.rows` refuses such vids); the walk reads none as a row, and a list
    with one is not taken for a piece of a kept path (a review's fuzz: [-7] listed as [0, -7])."""
    mgr = make_manager(hbm_blocks=40, dram_blocks=40)
    w = mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    first = _piece_under(mgr, w, lid, list(range(1, 9)), None, Tier.HBM)
    last = int(mgr.table.rows(first)[-1])
    mgr.placement.with_ancestors(mgr.table.rows(first), Tier.HBM)  # (kept)
    mgr.table.cols.parent[-1] = last  # the table's last row reads as a child of the kept path's end
    assert mgr.placement.with_ancestors(np.array([-1], dtype=np.int64), Tier.HBM).tolist() == []


@st.composite
def histories(draw):
    """A forest of n rows (parent[i] < i: acyclic) and a history of lookups and changes to it."""
    n = draw(st.integers(2, 40))
    parent = [draw(st.integers(-1, i - 1)) for i in range(n)]
    ops = draw(st.lists(st.tuples(st.sampled_from(["piece", "rows", "relink", "cut"]),
                                  st.integers(0, n - 1), st.integers(0, n - 1), st.integers(-1, n - 1)),
                        min_size=1, max_size=40))
    return parent, ops


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_list_is_the_walks_whatever_changed_since_a_path_was_kept(history):
    """Pieces of paths (which the kept paths serve), any rows, and links cut or moved between them
    (a block dropped, a row reused under another parent): every list equals the walk's."""
    parent, ops = history
    col = np.array(parent, dtype=np.int32)
    table = types.SimpleNamespace(cols=types.SimpleNamespace(parent=col))
    anc = Ancestry(table)  # (only the parent column is read)
    for op, a, b, c in ops:
        if op == "cut":
            col[a] = -1
        elif op == "relink":
            col[a] = min(c, a - 1)  # (still below a: the forest stays acyclic)
        else:
            if op == "piece":  # a stretch of the path from the root down to a, from b's place on
                path = ancestors_by_walk(types.SimpleNamespace(parent=col), [a])
                rows = path[min(b, len(path) - 1):]
            else:
                rows = list(dict.fromkeys([a, b, max(c, 0)]))
            got = anc.with_ancestors(np.array(rows, dtype=np.int64))
            assert got.tolist() == ancestors_by_walk(types.SimpleNamespace(parent=col), rows)
        memo = anc.memo
        assert memo._rows == sum(len(p) for p in memo._paths.values())


def test_the_kept_paths_are_bounded_in_rows_and_in_number(monkeypatch):
    monkeypatch.setattr(ChainMemo, "KEEP_ROWS", 100)
    monkeypatch.setattr(ChainMemo, "KEEP_PATHS", 3)
    memo = ChainMemo()
    for start in range(0, 50, 10):
        memo.keep(np.arange(start, start + 10))
    assert len(memo) == 3 and memo._rows == 30
    memo.keep(np.arange(200, 226))  # longer than a quarter of the rows kept: not kept
    assert len(memo) == 3 and memo._rows == 30
    memo.keep(np.arange(300, 325))
    assert len(memo) == 3 and memo._rows == 45
    parent = np.full(400, -1, dtype=np.int32)
    parent[301:325] = np.arange(300, 324)
    assert memo.path_to(324, parent).tolist() == list(range(300, 325))
    parent[310] = -1  # a link cut since: a miss, and the path let go
    assert memo.path_to(324, parent) is None and len(memo) == 2
    with pytest.raises(KeyError):
        memo._forget(324)
