"""The metadata path's shortcuts agree with the plain forms they stand in for: each is checked
against a reference written out here, on inputs that take both its fast and its general branch."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dflash2.counts import ADD_AT_MOST, add_at, distinct, repeats, unique
from dflash2.invariants import check_invariants
from dflash2.keys import FIB
from dflash2.policy.admission import COUNTER_MAX, FrequencySketch
from dflash2.policy.ghosts import MAX_GHOST_BITS, MIN_GHOST_BITS, TAG_SHIFT, GhostKeys, GhostTable, ghost_bits
from dflash2.policy.split import CAPACITY_FALL, HYSTERESIS, AdaptiveSplit
from dflash2.table.keyindex import EMPTY, KeyIndex
from dflash2.tiers import Tier

from conftest import SMALL

small_ints = st.lists(st.integers(0, 5), max_size=40)


@settings(max_examples=100, deadline=None)
@given(small_ints)
def test_distinct_and_repeats_match_a_set(values):
    a = np.array(values, dtype=np.int8)
    assert distinct(a) == sorted(set(values))
    assert all(type(v) is int for v in distinct(a))
    assert repeats(a) == (len(set(values)) < len(values))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62) | st.integers(0, 9), max_size=60))
def test_unique_matches_numpys_unique(values):
    """The sort path stands in for np.unique on rows, vids and keys (numpy 2 hashes, 10x slower at
    1,024 rows): the same values, in the same order, of the same type."""
    a = np.array(values, dtype=np.int64)
    got = unique(a)
    assert got.dtype == a.dtype and got.tolist() == np.unique(a).tolist() == sorted(set(values))
    keys = np.array([v % 2**64 for v in values], dtype=np.uint64)
    assert unique(keys).tolist() == np.unique(keys).tolist()


@pytest.mark.parametrize("n", [0, 1, 7, ADD_AT_MOST, ADD_AT_MOST + 1, 1000])
@pytest.mark.parametrize("delta", [1, -1])
def test_add_at_counts_every_occurrence_of_an_index(n, delta):
    """Both branches (np.add.at up to ADD_AT_MOST indices, counts beyond): an index listed k times
    moves its counter by k * delta."""
    index = np.random.default_rng(n).integers(0, 50, n)
    counts = np.zeros(50, dtype=np.int32)
    add_at(counts, index, delta)
    assert counts.tolist() == (delta * np.bincount(index, minlength=50)).tolist()


def _reference_sketch_add(table: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Conservative update of a whole batch: the counters at each key's minimum (as the batch found
    them) grow by the number of the batch's keys that name them, saturating at COUNTER_MAX."""
    counts = table.reshape(-1)[cells]
    est = counts.min(axis=0)
    grow = (counts == est) & (est < COUNTER_MAX)
    flat = table.reshape(-1)
    cells = cells[grow]
    for cell in np.unique(cells).tolist():
        flat[cell] = min(int(flat[cell]) + int((cells == cell).sum()), COUNTER_MAX)
    return np.minimum(est.astype(np.int64) + 1, COUNTER_MAX)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 3000), max_size=40), min_size=1, max_size=12))
def test_the_sketch_counts_as_its_reference_with_and_without_repeated_counters(batches):
    """A narrow sketch (64 counters a row): batches repeat keys and their counters collide, which
    takes the general branch; distinct batches take the fast one."""
    sketch = FrequencySketch(width=64, sample_factor=1000)
    mirror = sketch.table.copy()
    for batch in batches:
        keys = np.array(batch, dtype=np.uint64)
        want = _reference_sketch_add(mirror, sketch._cells(keys)) if len(keys) else np.zeros(0, np.int64)
        got = sketch.add(keys)
        assert got.tolist() == want.tolist()
        assert np.array_equal(sketch.table, mirror)
        assert np.array_equal(sketch.estimate(keys), mirror.reshape(-1)[sketch._cells(keys)].min(axis=0))


def test_ghost_keys_hash_as_the_ghost_tables_define_it():
    keys = np.array([1, 0xFFFF_FFFF_0000_0000, 2**64 - 1, 12345], dtype=np.uint64)
    g = GhostKeys(keys)
    for bits in (12, 20):
        mixed = [(int(k) ^ (int(k) >> 29)) for k in keys.tolist()]
        assert g.slots(bits).tolist() == [((m * FIB) % 2**64) >> (64 - bits) for m in mixed]
    hashes = [((m * FIB) % 2**64) for m in mixed]
    assert g.tag.tolist() == [max(1, (h >> TAG_SHIFT) & 0xFFFF_FFFF) for h in hashes]  # 0 is stored as 1
    part = g.take(np.array([False, True, False, True]))
    assert part.keys.tolist() == [keys[1], keys[3]] and part.slots(16).tolist() == g.slots(16)[[1, 3]].tolist()
    table = GhostTable(1000, payload=True)
    table.remember(part, np.uint32(7), 1)
    assert len(table.recall(keys[[0, 2]])[0]) == 0  # plain arrays and hashed keys find the same slots
    assert table.recall(keys[[3]])[0].tolist() == [7]
    assert len(table.recall(GhostKeys(keys[[1]]))[0]) == 1 and len(table.recall(part)[0]) == 0  # spoken once
    table.remember(keys[[0]], np.uint32(9), 0)
    assert table.recall(keys[[0, 0]])[0].tolist() == [9]  # asked twice in one batch: it speaks once


def _distinct_slot_keys(rng, n):
    """n keys whose slots differ in the smallest ghost table (so in every larger one)."""
    keys = rng.integers(1, 2**63, size=8 * n, dtype=np.int64).astype(np.uint64)
    _, first = np.unique(GhostKeys(keys).slots(MIN_GHOST_BITS), return_index=True)
    return keys[np.sort(first)[:n]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("distinct", [True, False])
def test_a_ghost_table_grows_keeping_its_ghosts(monkeypatch, seed, distinct):
    """Random remembers, recalls and growths (one doubling or several at once, the next begun while
    ghosts still move over a few slots a call): each recall returns, of the keys asked, the departure
    number and payload of their last departure not yet recalled, each once (a ghost speaks once).
    With keys of distinct slots nothing is missed; with keys that share slots a ghost may be
    forgotten, but none ever speaks for a departure that did not happen. Before, the tables were made
    anew at each doubling of the block table: every recent departure was forgotten."""
    monkeypatch.setattr(GhostTable, "MOVE_SLOTS", 97)  # (moves spread over many calls)
    rng = np.random.default_rng(seed)
    keys = _distinct_slot_keys(rng, 600) if distinct else rng.integers(1, 20000, size=3000).astype(np.uint64)
    g = GhostTable(1, payload=True)
    assert g.bits == MIN_GHOST_BITS
    model: dict[int, tuple[int, int]] = {}  # key -> (seq, payload) of its last departure not recalled
    for step in range(400):
        op = rng.random()
        batch = np.unique(rng.choice(keys, size=int(rng.integers(1, 40))))
        if op < 0.5:
            pay = int(rng.integers(0, 2))
            g.remember(batch, np.uint32(step), pay)
            model.update({int(k): (step, pay) for k in batch.tolist()})
        elif op < 0.95:
            seq, payload = g.recall(batch)
            got = sorted(zip(seq.tolist(), payload.tolist()))
            want = sorted(model.pop(int(k)) for k in batch.tolist() if int(k) in model)
            if distinct:
                assert got == want
            else:
                assert not Counter(got) - Counter(want)  # (a multiset within the departures)
        elif g.bits < MAX_GHOST_BITS:
            g.grow(min(MAX_GHOST_BITS, g.bits + int(rng.choice([1, 1, 3]))))
    assert g.bits > MIN_GHOST_BITS + 2
    if distinct:
        assert g.ghosts() == len(model)
    with pytest.raises(ValueError, match="at most"):
        g.grow(MAX_GHOST_BITS + 1)
    assert ghost_bits(1 << (MAX_GHOST_BITS + 3)) == MAX_GHOST_BITS
    empty = GhostTable(1, payload=True)
    empty.grow(MAX_GHOST_BITS)  # (made anew: nothing to keep)
    assert empty.bits == MAX_GHOST_BITS and empty.ghosts() == 0 and not len(empty.recall(keys)[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 5000), st.integers(0, 5000), st.booleans()),
                min_size=1, max_size=3))
def test_the_split_picks_sides_as_its_rule_says(tiers):
    """`update_sides` per tier: the first list gives up blocks first once it holds more than its
    target plus the hysteresis margin, the second once the first holds fewer than the target minus it
    (both of the capacity cut to what the tier holds over CAPACITY_FALL; here the first list alone)."""
    split = AdaptiveSplit(len(tiers), 1024)
    for t, (share, cap, first, out) in enumerate(tiers):
        split.share[t], split.capacity[t], split.sizes[t, 0], split.first_out[t] = share, cap, first, out
    before = split.first_out.copy()
    want = before.copy()
    for t, (share, cap, first, _) in enumerate(tiers):
        cap = min(cap, first / CAPACITY_FALL)
        target, margin = share * cap, max(1.0, HYSTERESIS * cap)
        if first > target + margin:
            want[t] = True
        elif first < target - margin:
            want[t] = False
    assert split.update_sides() == bool((want != before).any())
    assert split.first_out.tolist() == want.tolist()


@pytest.mark.parametrize("first, out, want", [(490, True, True), (489, True, False), (510, False, False),
                                              (511, False, True)])
def test_the_split_keeps_its_side_within_the_hysteresis_band_edges_included(first, out, want):
    """Target 500 of 1,000 blocks, margin 10: a side changes only past the band's edges."""
    split = AdaptiveSplit(1, 1024)
    split.share[0], split.capacity[0], split.sizes[0, 0], split.first_out[0] = 0.5, 1000, first, out
    assert split.update_sides() == (want != out)
    assert bool(split.first_out[0]) == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 5), st.integers(-1, 5)), max_size=30))
def test_the_split_recounts_list_sizes_as_codes_move(moves):
    """Rows move from code `old` to code `new` (-1: not counted); sizes stay per (tier, list)."""
    split = AdaptiveSplit(3, 1024)
    split.sizes[:] = 50
    old = np.array([m[0] for m in moves], dtype=np.int8)
    new = np.array([m[1] for m in moves], dtype=np.int8)
    want = np.full(6, 50)
    for o, n in moves:
        want[o] -= o >= 0
        want[n] += n >= 0
    split.recount(old, new)
    assert split.sizes.reshape(-1).tolist() == want.tolist()
    assert split.capacity.tolist() == split.sizes.sum(axis=1).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 400), max_size=30, unique=True), max_size=8), st.data())
def test_inserting_many_keys_at_once_matches_a_dict(batches, data):
    """Batches of new keys (small range: crowded probe runs) go in at once, between single inserts
    and removals; the index grows as one insert after another would."""
    ki, ref = KeyIndex(4), {}
    row = 0
    for batch in batches:
        fresh = [k for k in batch if k not in ref]
        rows = list(range(row, row + len(fresh)))
        row += len(fresh)
        ki.insert_many(np.array(fresh, dtype=np.uint64), np.array(rows))
        ref.update(zip(fresh, rows))
        for k in data.draw(st.lists(st.sampled_from(sorted(ref)), max_size=3, unique=True)) if ref else []:
            ki.remove(k)
            del ref[k]
        assert len(ki) == len(ref)
        assert 2 * len(ki) <= len(ki._keys)
    for key, r in ref.items():
        assert ki.get(key) == r
    probe = np.array(sorted(set(ref) | {401, 402}), dtype=np.uint64)
    assert ki.lookup(probe).tolist() == [ref.get(int(k), EMPTY) for k in probe]


def test_inserting_key_zero_many_at_once_is_refused_and_nothing_changes():
    ki = KeyIndex(4)
    ki.insert(5, 0)
    with pytest.raises(ValueError, match="no key"):
        ki.insert_many(np.array([7, 0], dtype=np.uint64), np.array([1, 2]))
    assert len(ki) == 1 and ki.get(7) == EMPTY and ki.get(5) == 0


def test_a_commit_of_new_keys_chains_them_in_their_tiers(make_manager):
    """A commit whose keys are all new (published in arrays): each block's parent is the one before
    it, the first's the given parent, counted among the parent's children of the block's own tier;
    a commit that deduplicates one key (published one block at a time) chains the same way."""
    mgr = make_manager(hbm_blocks=16, dram_blocks=16)
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    root = mgr.allocate(c, lid, 1)
    root = mgr.commit(c, root, keys=[100])
    below = mgr.allocate(c, lid, 3, tier=Tier.DRAM)
    held = mgr.commit(c, below, keys=[101, 102, 103], parent=int(root[0]))
    rows = mgr.table.rows(held)
    cols = mgr.table.cols
    assert cols.parent[rows].tolist() == [int(mgr.table.rows(root)[0]), rows[0], rows[1]]
    assert cols.tier[rows].tolist() == [1, 1, 1]
    assert cols.kids[1, mgr.table.rows(root)[0]] == 1 and cols.kids[0, mgr.table.rows(root)[0]] == 0
    assert cols.nkids[rows].tolist() == [1, 1, 0]
    assert mgr.table.keys.lookup(np.array([100, 101, 102, 103], dtype=np.uint64)).tolist() == \
        [int(mgr.table.rows(root)[0]), *rows.tolist()]
    check_invariants(mgr.table)
    # A second writer of 101..104: 101-103 deduplicate, 104 is new and chains under 103's block.
    d = mgr.attach("b")
    twin = mgr.commit(d, mgr.allocate(d, lid, 4), keys=[101, 102, 103, 104], parent=int(root[0]))
    assert twin[:3].tolist() == held.tolist()
    assert cols.parent[mgr.table.rows(twin[3:])].tolist() == [rows[2]]
    check_invariants(mgr.table)
