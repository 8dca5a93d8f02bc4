import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dflash2.table.keyindex import EMPTY, KeyIndex


def _apply(index: KeyIndex, ref: dict, insert: bool, key: int, row: int) -> None:
    """Insert key -> row (when absent) or remove the key (when present), in the index and in a dict."""
    if insert and key not in ref:
        index.insert(key, row)
        ref[key] = row
    elif not insert and key in ref:
        index.remove(key)
        del ref[key]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=300))
def test_matches_a_dict(ops):
    """Keys crowd a few home slots (small range) so probing and backward-shift deletion are exercised."""
    ki, ref = KeyIndex(4), {}
    for i, (insert, k) in enumerate(ops):
        _apply(ki, ref, insert, k << 40 | 1 if k % 2 else k, i)
        assert len(ki) == len(ref)
    for key, row in ref.items():
        assert ki.get(key) == row
    probe = np.array(sorted(set(ref) | {3, 5 << 40 | 1}), dtype=np.uint64)
    assert ki.lookup(probe).tolist() == [ref.get(int(k), -1) for k in probe]


def test_growth_keeps_everything():
    ki = KeyIndex(4)
    keys = np.random.default_rng(1).integers(1, 2**63, 5000, dtype=np.uint64)
    for i, k in enumerate(keys):
        ki.insert(int(k), i)
    assert ki.lookup(keys).tolist() == list(range(5000))
    ki.finish()  # (one-key inserts move a doubling's entries over a few slots at a time)
    assert ki.nbytes <= 12 * 4 * 5000


def test_growth_places_a_run_that_wraps_past_the_last_slot():
    """Keys whose homes are the last slot (their product with FIB is all ones at the top) form a run
    that wraps round to the first slots, before and after the table doubles: the doubling places
    entries in home order and wraps the run's end; every key stays found, and removable."""
    from dflash2.keys import FIB

    inverse = pow(FIB, -1, 1 << 64)
    crowded = [((1 << 64) - 1 - j) * inverse % (1 << 64) for j in range(40)]  # homes: the last slot
    low = [j * inverse % (1 << 64) or 1 for j in range(1, 12)]  # homes: slot 0
    keys = crowded + low + np.random.default_rng(3).integers(1, 2**63, 40, dtype=np.uint64).tolist()
    index, ref = KeyIndex(16), {}
    for i, k in enumerate(keys):
        index.insert(int(k), i)
        ref[int(k)] = i
        assert index.lookup(np.array(list(ref), dtype=np.uint64)).tolist() == list(ref.values())
    assert len(index._keys) >= 128  # it doubled on the way
    assert (index._keys[:8] != 0).all(), "the crowded run wrapped round to the first slots"
    for k in crowded[::3] + low[::2]:
        index.remove(int(k))
        del ref[int(k)]
    assert index.lookup(np.array(list(ref), dtype=np.uint64)).tolist() == list(ref.values())
    assert (index.lookup(np.array(crowded[::3], dtype=np.uint64)) == EMPTY).all()


class _Stretches(KeyIndex):
    MOVE_SLOTS = 5  # a doubling's entries move over a few slots a call: lookups meet both tables
    MOVE_SLOTS_ONE = 2  # (one-key calls move theirs one at a time, the others as a batch)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 3)), max_size=300))
def test_doubling_by_stretches_matches_a_dict(ops):
    """Keys crowd the first and the last home slots (the runs that wrap round the end, and the first
    empty slot after them, which the doubling starts from) and a few others; removals between the
    doublings leave holes. Every key stays found, every absent one absent."""
    from dflash2.keys import FIB

    inverse = pow(FIB, -1, 1 << 64)
    index, ref = _Stretches(4), {}
    for i, (insert, j, where) in enumerate(ops):
        product = [j, (1 << 64) - 1 - j, (1 << 63) + j, (j + 1) << 58][where]  # home: first, last, middle, spread
        _apply(index, ref, insert, product * inverse % (1 << 64) or 1, i)
    probe = np.array(sorted(ref) + [7, 9], dtype=np.uint64)
    assert index.lookup(probe).tolist() == [ref.get(int(k), -1) for k in probe]
    assert [index.get(int(k)) for k in probe] == [ref.get(int(k), -1) for k in probe]
    index.finish()
    assert not index.moving and index.lookup(probe).tolist() == [ref.get(int(k), -1) for k in probe]
    assert len(index) == len(ref) == int((index._keys != 0).sum())


def test_doubling_places_the_run_at_slot_zero_before_the_rest():
    """Keys whose homes are slot 0 fill the first slots, before the first empty one where the
    doubling's order starts: they are placed first (at their homes), not after the last stretch's
    entries (past empty slots, where no lookup would reach them). With no run wrapping round the
    end to push them past the last slot, nothing else would put them right."""
    from dflash2.keys import FIB

    inverse = pow(FIB, -1, 1 << 64)
    at_zero = [j * inverse % (1 << 64) for j in range(1, 7)]  # products below 2**58: home 0 at any size
    middle = [((1 << 63) + j) * inverse % (1 << 64) for j in range(40)]  # home: the middle slot
    index, ref = _Stretches(4), {}
    for i, k in enumerate(at_zero + middle):
        index.insert(k, i)
        ref[k] = i
        assert index.lookup(np.array(list(ref), dtype=np.uint64)).tolist() == list(ref.values())
    assert len(index._keys) >= 128 and index._rows[:6].tolist() == list(range(6))


def test_consecutive_keys_spread_over_the_table():
    """Keys that are not hashes (a trace's block ids, counters) must not pile into one probe run:
    a lookup of an absent key and every removal walk the run they land in."""
    index = KeyIndex(16)
    keys = np.arange(1, 8193, dtype=np.uint64)
    for i, k in enumerate(keys.tolist()):
        index.insert(k, i)
    used = np.concatenate([index._keys != 0, [False]])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], used.astype(np.int8)])))
    longest = int(np.max(edges[1::2] - edges[::2]))
    assert longest < 100, f"a probe run of {longest} slots"
    assert np.array_equal(index.lookup(keys), np.arange(8192))
    for k in keys[::2].tolist():
        index.remove(k)
    assert np.array_equal(index.lookup(keys[1::2]), np.arange(1, 8192, 2))
    assert (index.lookup(keys[::2]) == EMPTY).all()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 80), min_size=1, max_size=200, unique=True), st.data())
def test_removing_many_at_once_matches_a_dict(inserted, data):
    """Keys crowd a few home slots (small range) so that removed keys sit inside and at the ends of
    long probe runs, several in one run, and runs wrap around the table's end."""
    ki, ref = KeyIndex(4), {}
    for i, k in enumerate(inserted):
        key = k << 40 | 1 if k % 3 else k
        ki.insert(key, i)
        ref[key] = i
    gone = data.draw(st.lists(st.sampled_from(sorted(ref)), unique=True, max_size=len(ref)))
    ki.remove_many(np.array(gone, dtype=np.uint64))
    for key in gone:
        del ref[key]
    assert len(ki) == len(ref)
    ki.finish()  # (one-key inserts move a doubling's entries over a few slots at a time)
    assert int((ki._keys != 0).sum()) == len(ref)
    for key, row in ref.items():
        assert ki.get(key) == row
    assert (ki.lookup(np.array(gone, dtype=np.uint64)) == EMPTY).all()
    for key in list(ref)[::2]:  # single removals still work on what remove_many left
        ki.remove(key)
        del ref[key]
    assert ki.lookup(np.array(sorted(ref), dtype=np.uint64)).tolist() == [ref[k] for k in sorted(ref)]


def test_removing_many_refuses_an_absent_or_repeated_key_and_removes_nothing():
    ki = KeyIndex(16)
    for i, k in enumerate((5, 6, 7)):
        ki.insert(k, i)
    with pytest.raises(KeyError, match="0x9 is not indexed"):
        ki.remove_many(np.array([5, 9], dtype=np.uint64))
    with pytest.raises(KeyError, match="given twice"):
        ki.remove_many(np.array([6, 6], dtype=np.uint64))
    assert len(ki) == 3 and ki.lookup(np.array([5, 6, 7], dtype=np.uint64)).tolist() == [0, 1, 2]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(1, 300), max_size=12)), max_size=120))
def test_a_doubling_under_way_matches_a_dict(ops):
    """Inserts, removals (one and many), lookups and gets while a doubling's entries move over a few
    slots a call, the next doubling often beginning before the last ended: every answer is a dict's.
    Keys crowd a few homes (a small range, shifted) so runs are long, and wrap round the end."""
    index, ref, row = _Stretches(4), {}, 0
    seen_moving = False
    for op, ks in ops:
        ks = [k << 40 | 1 if k % 2 else k for k in dict.fromkeys(ks)]
        if op == 0:  # insert_many of the new ones
            new = [k for k in ks if k not in ref]
            index.insert_many(np.array(new, dtype=np.uint64), np.arange(row, row + len(new), dtype=np.int32))
            ref.update({k: row + i for i, k in enumerate(new)})
            row += len(new)
        elif op == 1:  # inserts, one at a time; a key present is a KeyError, nothing changed
            for k in ks:
                if k in ref:
                    with pytest.raises(KeyError):
                        index.insert(k, 0)
                else:
                    index.insert(k, row)
                    ref[k], row = row, row + 1
        elif op == 2:  # remove_many of the present ones; with an absent one, a KeyError and no change
            present = [k for k in ks if k in ref]
            if len(present) < len(ks):
                with pytest.raises(KeyError):
                    index.remove_many(np.array(ks, dtype=np.uint64))
            index.remove_many(np.array(present, dtype=np.uint64))
            for k in present:
                del ref[k]
        elif op == 3:  # removals, one at a time
            for k in ks:
                if k in ref:
                    index.remove(k)
                    del ref[k]
                else:
                    with pytest.raises(KeyError):
                        index.remove(k)
        seen_moving |= index.moving
        probe = np.array(ks + list(ref)[:20] + [7], dtype=np.uint64)
        assert index.lookup(probe).tolist() == [ref.get(int(k), -1) for k in probe]
        assert [index.get(int(k)) for k in probe[:10]] == [ref.get(int(k), -1) for k in probe[:10]]
        assert len(index) == len(ref)
    if len(ref) > 40:
        assert seen_moving
    index.finish()
    assert int((index._keys != 0).sum()) == len(ref)
    assert index.lookup(np.array(list(ref), dtype=np.uint64)).tolist() == list(ref.values())


def test_one_key_calls_move_a_few_slots_and_the_move_ends_before_the_next_doubling():
    """A one-key insert or remove moves MOVE_SLOTS_ONE of the smaller table's slots, not a batch's
    MOVE_SLOTS: a commit on the per-key path (its keys partly cached) moved the whole table in one
    call, 244 ms at two million keys (a review's script). Inserted one at a time, the keys still
    move over before the table doubles again."""
    ki = KeyIndex(64)  # 128 slots
    keys = np.random.default_rng(9).integers(1, 2**63, 1000, dtype=np.uint64).tolist()
    for i, k in enumerate(keys[:64]):
        ki.insert(k, i)
    assert not ki.moving
    ki.insert(keys[64], 64)  # the 65th key doubles it
    assert ki.moving and ki._old_next == ki.MOVE_SLOTS_ONE
    ki.remove(keys[0])
    assert ki._old_next == 2 * ki.MOVE_SLOTS_ONE
    i = 65
    while ki.moving:
        slots = ki.slots
        ki.insert(keys[i], i)
        assert ki.slots == slots, "doubled again before the last doubling's entries moved"
        i += 1
    assert ki.lookup(np.array(keys[1:i], dtype=np.uint64)).tolist() == list(range(1, i))


def test_the_background_step_moves_a_doubling_on_without_inserts(make_manager, monkeypatch):
    """A daemon whose clients only look up after the index doubled: each background step moves
    MOVE_SLOTS more, so the move ends (lookups stop looking in two tables, the smaller one's memory
    goes) without waiting for inserts or removals."""
    from conftest import SMALL
    monkeypatch.setattr(KeyIndex, "MOVE_SLOTS", 64)
    mgr = make_manager(hbm_blocks=4096)
    c = mgr.attach("c")
    lid = mgr.register_layout(SMALL)
    key = 1
    while not mgr.table.keys.moving:
        vids = mgr.commit(c, mgr.allocate(c, lid, 256), keys=list(range(key, key + 256)))
        mgr.free(c, vids)
        key += 256
    steps = 0
    while mgr.table.keys.moving:
        mgr.tick()
        steps += 1
        assert steps <= mgr.table.keys.slots // 2 // 64
    assert [p.vid for p in mgr.lookup(list(range(1, key)), lid)][-1] == int(vids[-1])
    mgr.check_invariants()
