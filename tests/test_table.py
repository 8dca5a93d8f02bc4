import logging

import numpy as np
import pytest

from dflash2.errors import IllegalTransition, ImmutableBlock, NotOwner, PinnedBlock, UnknownBlock, UnknownClient
from dflash2.table import BlockState
from dflash2.tiers import Tier

from conftest import MLA, SMALL, SMALL_FP8


@pytest.fixture
def mgr(make_manager):
    return make_manager(hbm_blocks=32)


def test_virtual_ids_are_64_bit_stable_and_never_zero(mgr):
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    vids = mgr.allocate(c, lid, 4)
    assert all(v > 0 for v in vids.tolist())
    assert len(set(vids.tolist())) == 4


def test_stale_ids_are_caught_after_reuse(mgr):
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    old = mgr.allocate(c, lid, 1)
    mgr.free(c, old)
    new = mgr.allocate(c, lid, 1)
    assert (int(new[0]) & 0xFFFFFFFF) == (int(old[0]) & 0xFFFFFFFF), "the row is reused"
    with pytest.raises(UnknownBlock, match=hex(int(old[0]))):
        mgr.free(c, old)
    with pytest.raises(UnknownBlock):
        mgr.table.rows([0x7FFF_FFFF_0000_0001])


def test_illegal_transitions_raise(mgr):
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.allocate(c, lid, 1)
    mgr.commit(c, v)
    with pytest.raises(IllegalTransition, match=r"it is committed already \(RESIDENT\); only blocks being written"):
        mgr.commit(c, v)
    keyed = mgr.commit(c, mgr.allocate(c, lid, 1), keys=[77])  # published: no client's private block now
    with pytest.raises(IllegalTransition, match="committed already"):
        mgr.commit(c, keyed, keys=[77])
    with pytest.raises(IllegalTransition):
        mgr.table.open_write(c, v)
    assert mgr.table.cols.state[mgr.table.rows(v)][0] == BlockState.RESIDENT


def test_commit_publishes_and_lookup_finds_the_longest_prefix(mgr):
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(a, mgr.allocate(a, lid, 3), keys=[11, 12, 13])
    found = mgr.lookup([11, 12, 13, 14], lid)
    assert [p.vid for p in found] == v.tolist()
    assert [p.vid for p in mgr.lookup([11, 99, 13], lid)] == v.tolist()[:1]
    assert mgr.lookup([12, 13], lid) != [] and mgr.lookup([99], lid) == []
    # another layout never matches these keys
    other = mgr.register_layout(SMALL_FP8)
    assert mgr.lookup([11], other) == []
    # b may pin a published block, and a's private blocks are off-limits to b
    mgr.acquire(b, v[:1])
    priv = mgr.allocate(a, lid, 1)
    with pytest.raises(NotOwner):
        mgr.acquire(b, priv)
    with pytest.raises(NotOwner):
        mgr.free(b, priv)
    with pytest.raises(NotOwner):
        mgr.commit(b, priv)
    mgr.check_invariants()


def test_commit_of_a_cached_key_deduplicates(mgr):
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    first = mgr.commit(a, mgr.allocate(a, lid, 2), keys=[1, 2])
    used = mgr.table.allocators[Tier.HBM].used_bytes
    second = mgr.commit(b, mgr.allocate(b, lid, 2), keys=[1, 2])
    assert second.tolist() == first.tolist()
    assert mgr.table.allocators[Tier.HBM].used_bytes == used, "one copy kept"
    assert mgr.table.cols.refs[mgr.table.rows(first)].tolist() == [2, 2]
    mgr.check_invariants()


def test_double_free_and_foreign_free(mgr):
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.allocate(a, lid, 1)
    mgr.free(a, v)
    with pytest.raises(UnknownBlock):
        mgr.free(a, v)
    w = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[5])
    mgr.free(a, w)  # published: stays cached
    with pytest.raises(NotOwner, match="double free"):
        mgr.free(a, w)
    assert mgr.lookup([5], lid)[0].vid == int(w[0])
    with pytest.raises(UnknownClient):
        mgr.free(99, w)
    mgr.check_invariants()


def test_pinned_blocks_are_not_freed_or_moved(make_manager):
    mgr = make_manager(hbm_blocks=4, dram_blocks=8)
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.commit(a, mgr.allocate(a, lid, 1))
    mgr.acquire(a, v)
    with pytest.raises(PinnedBlock):
        mgr.free(a, v)
    with pytest.raises(PinnedBlock):
        mgr.mover.move(mgr.table.rows(v), Tier.DRAM)
    assert mgr.place(int(v[0])).tier == Tier.HBM
    mgr.release(a, v)
    with pytest.raises(NotOwner):
        mgr.release(a, v)
    mgr.free(a, v)
    mgr.check_invariants()


def test_client_death_frees_private_and_keeps_published(mgr):
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    pub = mgr.commit(a, mgr.allocate(a, lid, 2), keys=[7, 8])
    priv = mgr.allocate(a, lid, 3)
    mgr.acquire(a, pub)
    out = mgr.detach(a)
    assert out["freed"] == 3 and out["unpinned"] == 2
    with pytest.raises(UnknownBlock):
        mgr.table.rows(priv)
    assert [p.vid for p in mgr.lookup([7, 8], lid)] == pub.tolist()
    assert mgr.acquire(b, pub) is not None
    mgr.check_invariants()


def test_mixed_layouts_share_hbm(mgr):
    a = mgr.attach("a")
    ids = [mgr.register_layout(x) for x in (SMALL, SMALL_FP8, MLA)]
    assert mgr.register_layout(SMALL) == ids[0]
    got = [mgr.allocate(a, lid, 4) for lid in ids]
    assert all(g is not None for g in got)
    st = mgr.stats()["tiers"]["hbm"]
    assert st["block_bytes"] == 4 * (16384 + 8192 + MLA.block_bytes)
    assert st["rounding_waste_bytes"] == st["used_bytes"] - st["block_bytes"]
    mgr.check_invariants()


def test_chained_commit_links_parents(mgr):
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    first = mgr.commit(a, mgr.allocate(a, lid, 2), keys=[1, 2])
    more = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[3], parent=int(first[-1]))
    rows = mgr.table.rows(np.concatenate([first, more]))
    assert mgr.table.cols.parent[rows].tolist() == [-1, rows[0], rows[1]]
    assert mgr.table.cols.nkids[rows].tolist() == [1, 1, 0]
    priv = mgr.commit(a, mgr.allocate(a, lid, 1))
    with pytest.raises(ImmutableBlock):
        mgr.commit(a, mgr.allocate(a, lid, 1), keys=[9], parent=int(priv[0]))


def test_a_block_listed_twice_in_a_commit_is_refused_and_nothing_changes(mgr):
    a = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    v = mgr.allocate(a, lid, 1)
    with pytest.raises(ValueError, match="twice"):
        mgr.commit(a, [int(v[0]), int(v[0])], keys=[11, 22])
    assert mgr.lookup([11], lid) == [] and mgr.lookup([22], lid) == []
    mgr.commit(a, v, keys=[11])
    mgr.check_invariants()


def test_a_key_cached_for_another_layout_is_not_deduplicated(mgr):
    a = mgr.attach("a")
    l16, l8 = mgr.register_layout(SMALL), mgr.register_layout(SMALL_FP8)
    mgr.commit(a, mgr.allocate(a, l16, 1), keys=[5])
    other = mgr.allocate(a, l8, 1)
    with pytest.raises(ImmutableBlock, match="another layout"):
        mgr.commit(a, other, keys=[5])
    assert mgr.table.cols.state[mgr.table.rows(other)][0] == BlockState.WRITING
    mgr.check_invariants()


def test_drop_lost_finds_the_children_of_a_batch_in_one_pass(mgr, monkeypatch):
    """A failed NVMe batch loses up to a swap batch of blocks: their children are found in one pass
    over the parent column for the whole call (one per lost block held the loop ~0.5 s for 1,024 at a million
    blocks), and the outcome is the per-block one: children cut loose, childless orphans dropped,
    held ones kept, the rest of each chain still cached."""
    t = mgr.table
    c = mgr.attach("a")
    lid = mgr.register_layout(SMALL)
    chains = [mgr.commit(c, mgr.allocate(c, lid, 3), keys=[10 * i + 1, 10 * i + 2, 10 * i + 3]) for i in range(6)]
    for v in chains:
        mgr.free(c, v)
    mgr.add_ref(c, chains[0][2:])  # a held child: cut loose, kept until its last reference
    lost = np.concatenate([t.rows(v[1:2]) for v in chains] + [t.rows(chains[5][2:])])  # the middles, and one leaf
    passes = []
    flatnonzero = np.flatnonzero

    def counted(a):
        if np.shape(a) == (t.cols.capacity,):
            passes.append(1)  # a mask over every row
        return flatnonzero(a)
    monkeypatch.setattr(np, "flatnonzero", counted)
    t.drop_lost(lost)
    monkeypatch.undo()
    assert len(passes) <= 1
    rows = [t.rows(v[:1])[0] for v in chains]
    assert all(t.cols.nkids[r] == 0 and t.cols.key[r] != 0 for r in rows), "the roots stay cached, childless"
    held = t.rows(chains[0][2:])[0]
    assert t.cols.parent[held] == -1 and t.cols.state[held] != BlockState.FREE
    assert t.cols.live == 6 + 1
    mgr.free(c, chains[0][2:])
    mgr.check_invariants()


def test_growth_keeps_every_row_and_gives_new_rows_their_fresh_values():
    """The columns double when rows run out: the old rows' values are kept, every new row is free
    with its first generation and tier -1 (not HBM's 0, or whole-table passes would count it in
    HBM), and a new row taken holds each field's fresh value."""
    from dflash2.table.columns import FIELDS, Columns

    cols = Columns(capacity=8, first_gen=7)
    rows = cols.take_rows(8)
    rng = np.random.default_rng(0)
    before = {}
    for name, (dtype, _) in FIELDS.items():
        values = rng.integers(1, 100, size=8).astype(dtype)
        getattr(cols, name)[rows] = values
        before[name] = getattr(cols, name).copy()
    cols.kids[:, rows] = 3
    more = cols.take_rows(3)  # past the capacity: it doubles
    assert cols.capacity == 16 and sorted(more.tolist()) == [8, 9, 10]
    for name, (dtype, fill) in FIELDS.items():
        column = getattr(cols, name)
        assert column.dtype == dtype and column[:8].tolist() == before[name].tolist(), name
        fresh = 7 if name == "gen" else fill
        assert (column[8:11] == np.array(fresh, dtype=dtype)).all(), name
    assert (cols.gen[11:] == 7).all() and (cols.state[11:] == 0).all() and (cols.tier[11:] == -1).all()
    assert (cols.kids[:, :8] == 3).all() and (cols.kids[:, 8:] == 0).all()
    taken = cols.take_rows(1)
    cols.owner[taken] = 5
    cols.give_rows(taken)
    assert cols.owner[taken[0]] == 5  # a free row's other fields are left as they were ...
    again = cols.take_rows(1)
    assert again.tolist() == taken.tolist() and cols.owner[taken[0]] == -1  # ... until it is taken
    assert cols.gen[taken[0]] == 8


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_growth_within_the_reservation_copies_nothing():
    """Rows come from memory reserved up front (rowspace.py): doubling takes a longer view of the same
    memory, so no column moves, and a view taken before the growth sees writes made after it. The
    copy into arrays twice as large held the daemon's loop 37-295 ms at 1M -> 2M rows."""
    from dflash2.table.columns import FIELDS, Columns

    cols = Columns(capacity=8, first_gen=3, reserve=64)
    where = {name: _address(getattr(cols, name)) for name in [*FIELDS, "kids"]}
    early_state = cols.state
    cols.take_rows(8)
    cols.take_rows(30)  # 8 -> 16 -> 32 -> 64: three doublings, all within the 64 rows reserved
    assert cols.capacity == 64 and cols.reserved == 64
    for name, address in where.items():
        assert _address(getattr(cols, name)) == address, f"{name} was copied"
    cols.state[5] = 9
    assert early_state[5] == 9  # the same memory
    assert (cols.gen[8:] == 3).all() and (cols.tier[8:] == -1).all()


def test_growth_past_the_reservation_copies_once_and_says_so(caplog):
    """A table that outgrows its reservation (blocks smaller than assumed) copies into one four times
    its new size, keeping every row, and logs it."""
    from dflash2.table.columns import Columns

    cols = Columns(capacity=4, reserve=4)
    rows = cols.take_rows(4)
    cols.key[rows] = [11, 12, 13, 14]
    cols.kids[2, rows] = [1, 2, 3, 4]
    with caplog.at_level(logging.INFO, logger="dflash2.table"):
        cols.take_rows(1)
    assert cols.capacity == 8 and cols.reserved == 32
    assert cols.key[:4].tolist() == [11, 12, 13, 14] and cols.kids[2, :4].tolist() == [1, 2, 3, 4]
    assert "outgrew their reservation of 4 rows" in caplog.text
    cols.add_kids(np.array([2, 2, 0]), np.array([1, 1, 5]), 1)  # the flat index follows the new stride
    assert cols.kids[2, :4].tolist() == [1, 4, 3, 4] and cols.kids[0, 5] == 1


def test_a_refused_reservation_falls_back_to_plain_arrays_and_says_so(monkeypatch, caplog):
    """Where the system refuses the mapping (strict overcommit, an address-space limit), the table
    takes plain arrays of the rows it needs, warns, and works as before."""
    from dflash2.table import rowspace
    from dflash2.table.columns import Columns

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(rowspace, "reserve", refuse)
    with caplog.at_level(logging.WARNING, logger="dflash2.table"):
        cols = Columns(capacity=4, reserve=1 << 20)
    assert cols.reserved == 4 and "refused a reservation of 1048576 rows" in caplog.text
    rows = cols.take_rows(6)
    assert cols.capacity == 8 and sorted(rows.tolist()) == list(range(6))
    assert (cols.tier == -1).all() and cols.reserved == 8


def test_a_tables_reservation_follows_its_arenas():
    """One row reserved per RESERVE_BLOCK_BYTES of every tier, within the floor and the ceiling."""
    from dflash2.table.rowspace import RESERVE_MAX_ROWS, RESERVE_MIN_ROWS, reserve_rows

    assert reserve_rows([256 << 20, 1 << 30], 1024) == ((256 << 20) + (1 << 30)) // 1024
    assert reserve_rows([1 << 20], 1024) == RESERVE_MIN_ROWS
    assert reserve_rows([1 << 50], 1024) == RESERVE_MAX_ROWS
    assert reserve_rows([1 << 20], RESERVE_MIN_ROWS * 2) == RESERVE_MIN_ROWS * 2


@pytest.mark.parametrize("priority", [200, -129, 127.5, True])
def test_an_allocation_with_a_priority_out_of_range_takes_nothing(priority):
    """The int8 column refused it after the rows and slots were taken: they leaked (in process; the
    daemon refuses such priorities on the wire)."""
    from conftest import FakeClock, SMALL, specs
    from dflash2.manager import BlockManager

    m = BlockManager(specs(4), policy="heat", clock=FakeClock())
    lid, c = m.register_layout(SMALL), m.attach("a")
    with pytest.raises(ValueError, match="priority must be an integer in -128..127"):
        m.allocate(c, lid, 1, priority=priority)
    m.check_invariants()
    assert len(m.allocate(c, lid, 4)) == 4
