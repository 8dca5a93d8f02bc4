"""The client library's arguments and what a block holds, against a real dflash2d process (a review of
2026-12-04): each bad argument is refused by name before anything is sent or given up, and nothing
of the daemon's state changes. Each failed before its fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from daemon_proc import DaemonProcess

from dflash2.client import Client, DaemonError
from dflash2.errors import LayoutError, QuotaExceeded
from dflash2.layout import Layout
from dflash2.protocol import Op

from conftest import SMALL


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


def test_float_block_ids_are_refused_and_publish_nothing(connect):
    """Ids near 2^61 as floats were cut to multiples of 512: a commit of block 1 committed block 0,
    whose unwritten bytes every later lookup of the key read."""
    c = connect("writer")
    lid = c.layouts[0]
    placed = c.allocate(lid, 2)
    c.view_bytes(placed[1])[:] = 7
    floats = placed["vid"].astype(np.float64)
    for call in (lambda: c.commit(floats[1:], keys=[1234]), lambda: c.free(floats),
                 lambda: c.release(floats), lambda: c.acquire(floats), lambda: c.add_ref(floats),
                 lambda: c.commit([int(placed["vid"][1]) + 0.0], keys=[1234]), lambda: c.free([True])):
        with pytest.raises(TypeError, match="block ids are integers"):
            call()
    assert len(c.lookup([1234])) == 0  # nothing was committed
    (vid,) = c.commit(placed["vid"][1:], keys=[1234])
    assert vid == placed["vid"][1]
    c.free(c.commit(placed["vid"][:1]))
    c.free([vid])
    (found,) = c.lookup([1234])
    held = c.acquire([found["vid"]])
    assert (np.asarray(c.view_bytes(held[0])) == 7).all()
    c.release([found["vid"]])
    c.check()


@pytest.mark.parametrize("call, name", [
    (lambda c, lid: c.allocate(lid, 2.9), "n"),
    (lambda c, lid: c.allocate(0.9, 1), "layout"),
    (lambda c, lid: c.reserve(lid, 16.9), "tokens"),
    (lambda c, lid: c.reserve(lid, 16, priority=1.5), "priority"),
    (lambda c, lid: c.take(1.0, 1), "reservation_id"),
    (lambda c, lid: c.commit(c.allocate(lid, 1)["vid"], parent=1.5), "parent"),
    (lambda c, lid: c.lookup([1], layout=True), "layout"),
])
def test_float_and_bool_counts_and_ids_are_refused_by_name(connect, call, name):
    """`int()` made 2.9 blocks 2, layout 0.9 layout 0 and parent 1.5 parent 1 without a word."""
    c = connect("x")
    with pytest.raises(TypeError, match=f"{name} must be an integer"):
        call(c, c.layouts[0])
    assert c.stats()["daemon"]["errors"] == 0


@pytest.mark.parametrize("deadline", ["30", True, "abc", [1.0]])
def test_a_reservations_deadline_that_is_no_number_is_refused_by_name(connect, deadline):
    """`float()` took "30" as 30 s and True as 1 s without a word, and "abc" failed with Python's own
    message, naming no argument (a review); refused before anything is sent."""
    c = connect("x")
    with pytest.raises(TypeError, match="deadline_s must be a number of seconds"):
        c.reserve(c.layouts[0], 16, deadline_s=deadline)
    assert c.stats()["reservations"]["reserved_blocks"] == 0 and c.stats()["daemon"]["errors"] == 0
    assert c.reserve(c.layouts[0], 16, deadline_s=np.float32(30)).granted  # a number of any kind is taken


@pytest.mark.parametrize("timeout", [0, -1, math.nan, -math.inf, "5", True])
def test_a_timeout_that_is_not_a_positive_number_is_refused_before_attaching(daemon, timeout):
    """0 or less gave each call about 1 ms (a detach timed out, its session held until its lease
    lapsed); NaN and a string failed deep in a lock or a comparison."""
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds above 0"):
        Client.connect(daemon.endpoint, name="t", layouts=[SMALL], timeout_s=timeout)
    with Client.connect(daemon.endpoint, name="watch", timeout_s=5) as w:
        assert [c["name"] for c in w.stats()["clients"]] == ["watch"]


def test_a_reservation_reply_with_a_field_this_client_does_not_know_is_read():
    """A newer daemon may append fields (protocol.py): `Reservation(**result)` raised TypeError,
    and the engine never learned the id of the reservation it held."""
    from dflash2.client.reservation import reservation_of

    r = reservation_of({"outcome": "granted", "reservation_id": 7, "reason": "", "position": None,
                        "est_wait_s": None, "granted_blocks": 4})
    assert r.granted and r.reservation_id == 7


def test_a_layout_name_past_the_bound_is_refused_in_process_and_by_the_daemon(connect):
    """Names had no bound: a client's megabyte names stayed in the daemon for its life."""
    with pytest.raises(LayoutError, match="more than 512"):
        Layout("x" * 513, num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", tokens_per_block=16)
    c = connect("x")
    raw = {**SMALL.to_dict(), "name": "x" * 1_000_000}
    with pytest.raises(DaemonError, match="more than 512") as e:
        c._call(Op.REGISTER_LAYOUT, {"layout": raw})
    assert e.value.kind == "LayoutError"


def test_a_refused_release_names_the_block(connect):
    c = connect("x")
    lid = c.layouts[0]
    vids = c.commit(c.allocate(lid, 40)["vid"], keys=list(range(1, 41)))
    c.acquire(vids[:39])
    for listed in (vids[39:], vids):  # the per-row path and the whole-array one (more than SMALL)
        with pytest.raises(DaemonError, match=f"holds 0 pin\\(s\\) on block {int(vids[39]):#x}") as e:
            c.release(listed)
        assert e.value.kind == "NotOwner"
    c.release(vids[:39])
    c.check()


def test_a_block_holds_at_most_max_holds_references_and_pins(make_manager, monkeypatch):
    """The int32 columns wrapped to a negative count at 2^31 (a client's 32,769 calls of 65,536
    copies of one id): past the bound a call is refused whole, the counts as they were."""
    from dflash2.table import release

    monkeypatch.setattr(release, "MAX_HOLDS", 100)
    mgr = make_manager(hbm_blocks=8)
    a, b = mgr.attach("a"), mgr.attach("b")
    lid = mgr.register_layout(SMALL)
    (vid,) = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[5])
    mgr.add_ref(b, [vid] * 99)  # 100 with a's own
    with pytest.raises(QuotaExceeded, match=f"block {int(vid):#x} would hold more than 100 references"):
        mgr.add_ref(b, [vid, vid])
    assert mgr.table.cols.refs[mgr.table.rows([vid])[0]] == 100 and mgr.table.clients[b].refs.total() == 99
    mgr.table.pin(b, [vid] * 100)
    with pytest.raises(QuotaExceeded, match="more than 100 pins"):
        mgr.table.pin(b, [vid])
    assert mgr.table.cols.pins[mgr.table.rows([vid])[0]] == 100
    mgr.check_invariants()


def test_a_deduplicating_commit_moves_many_references_at_once(make_manager):
    """A writer holding its block 200,000 times commits it under a cached key: the references move
    to the cached twin in one step (one Python step a reference held the loop 1.6 s at 3.3 million),
    counted right."""
    mgr = make_manager(hbm_blocks=8)
    a, w = mgr.attach("a"), mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    (cached,) = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[9])
    mine = mgr.allocate(w, lid, 1)
    for _ in range(4):
        mgr.add_ref(w, np.repeat(mine, 50_000))
    (got,) = mgr.commit(w, mine, keys=[9])
    assert got == cached
    holder = mgr.table.clients[w]
    assert holder.refs[mgr.table.rows([cached])[0]] == 200_001
    assert mgr.table.cols.refs[mgr.table.rows([cached])[0]] == 200_002
    mgr.check_invariants()
    mgr.detach(w)
    assert mgr.table.cols.refs[mgr.table.rows([cached])[0]] == 1
    mgr.check_invariants()


def test_a_deduplicating_commit_that_would_pass_max_holds_is_refused_before_anything_changes(make_manager,
                                                                                             monkeypatch):
    """A writer's references moved onto the cached twin unchecked: successive commits added them up
    past 2^31 and the int32 count wrapped (a review's script)."""
    from dflash2.table import release

    monkeypatch.setattr(release, "MAX_HOLDS", 100)
    mgr = make_manager(hbm_blocks=8)
    a, w = mgr.attach("a"), mgr.attach("w")
    lid = mgr.register_layout(SMALL)
    (cached,) = mgr.commit(a, mgr.allocate(a, lid, 1), keys=[9])
    mgr.add_ref(a, [cached] * 59)  # 60 on the cached block
    mine = mgr.allocate(w, lid, 1)
    mgr.add_ref(w, list(mine) * 40)  # 41 on the writer's
    with pytest.raises(QuotaExceeded, match="content key 0x9: its cached block would hold 101 references"):
        mgr.commit(w, mine, keys=[9])
    rows = mgr.table.rows([cached, mine[0]])
    assert mgr.table.cols.refs[rows].tolist() == [60, 41]
    assert mgr.table.cols.state[rows[1]] == 2  # (still WRITING: the commit changed nothing)
    mgr.free(a, [cached] * 20)
    assert mgr.commit(w, mine, keys=[9]).tolist() == [cached]  # 40 + 41 fit now
    mgr.check_invariants()


def test_block_ids_of_numpy_and_python_integers_mixed_are_read_exactly():
    """numpy promotes a list of uint64 and Python ints to float64: it was refused as floats."""
    from dflash2.client.client import vid_array

    assert vid_array([np.uint64(0x2000000000000001), 0x2000000000000002]).tolist() == [
        0x2000000000000001, 0x2000000000000002]
    assert vid_array([]).tolist() == [] and vid_array([np.int64(3), 4]).tolist() == [3, 4]
    with pytest.raises(TypeError, match="got 2.0"):
        vid_array([np.uint64(1), 2.0])


@pytest.mark.parametrize("vids", [[None], [5, None], None])
def test_a_none_among_block_ids_is_named(vids):
    """`None` was taken for "no bad id" and reached int(): an error naming neither the ids nor it."""
    from dflash2.client.client import vid_array

    with pytest.raises(TypeError, match="block ids are integers, got None"):
        vid_array(vids)


def test_chain_keys_takes_one_sequence_of_integer_token_ids():
    """A batch of one (`input_ids` of shape [1, N]) gave no key at all, and float ids were cut to
    others' (1.5 keyed as 1), each without a word (a review)."""
    from dflash2.keys import chain_keys

    ids = list(range(64))
    assert chain_keys(np.array(ids, dtype=np.int32), 16, "m") == chain_keys(ids, 16, "m") and len(chain_keys(ids, 16, "m")) == 4
    assert chain_keys([], 16, "m") == []
    with pytest.raises(ValueError, match=r"1-D\), got shape \(1, 64\): pass input_ids\[0\]"):
        chain_keys(np.array([ids]), 16, "m")
    with pytest.raises(TypeError, match="token ids are integers, got 1.5"):
        chain_keys([1.5] * 16, 16, "m")
    with pytest.raises(TypeError, match="token ids are integers, got an array of float32"):
        chain_keys(np.ones(16, dtype=np.float32), 16, "m")
    # numpy promotes a list of uint64 and Python ints to float64: keyed as the integers they are
    assert chain_keys([np.uint64(0)] + ids[1:], 16, "m") == chain_keys(ids, 16, "m")
    for bad in (True, 16.0):
        with pytest.raises(TypeError, match="tokens_per_block is an integer"):
            chain_keys(ids, bad, "m")
    for bad in (5, b"m", None):  # (an AttributeError from inside the hash, a review)
        with pytest.raises(TypeError, match="namespace is a str, got"):
            chain_keys(ids, 16, bad)


@pytest.mark.parametrize("n", [2, 1])
def test_a_view_of_the_whole_places_array_is_refused_by_name(connect, n):
    """`view(places)` for `view(places[0])` failed inside numpy ("only 0-dimensional arrays can be
    converted to Python scalars"), a review."""
    c = connect("v")
    places = c.allocate(c.layouts[0], n, tier="dram")
    with pytest.raises(TypeError, match=r"one place record \(PLACE_DTYPE: places\[i\]\)"):
        c.view(places)


def test_a_commit_of_one_int_id_with_a_key_commits_it(connect):
    """commit(vid) took a single id; commit(vid, keys=[k]) failed: "object of type 'int' has no len()"."""
    c = connect("c")
    (vid,) = c.allocate(c.layouts[0], 1, tier="dram")["vid"]
    (done,) = c.commit(int(vid), keys=[1234])
    assert c.lookup([1234], tier="dram")["vid"].tolist() == [int(done)]


@pytest.mark.parametrize("layout", [SMALL.to_dict(), "small"])
def test_a_layout_that_is_not_a_Layout_is_refused_by_name(daemon, connect, layout):
    """A dict or a name failed as "'dict' object has no attribute 'to_dict'" (a review)."""
    with pytest.raises(TypeError, match="a layout is a dflash2.layout.Layout"):
        Client.connect(daemon.endpoint, name="l", layouts=[layout]).close()
    with pytest.raises(TypeError, match="a layout is a dflash2.layout.Layout"):
        connect("r").register_layout(layout)


@pytest.mark.parametrize("device, error, message", [
    (True, TypeError, "device must be an integer, got True"),  # (served GPU 1's pool)
    ("0", TypeError, "device must be an integer, got '0'"),  # (a format's traceback, then the daemon's refusal)
    (1.0, TypeError, "device must be an integer, got 1.0"),  # (an index's TypeError on a GPU node)
    (-1, ValueError, "device must be a CUDA device number"),
])
def test_a_device_that_is_not_a_device_number_is_refused_before_attaching(daemon, device, error, message):
    with pytest.raises(error, match=message):
        Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], device=device)
    with Client.connect(daemon.endpoint, name="checker", layouts=[SMALL]) as checker:
        assert [x["name"] for x in checker.stats()["clients"]] == ["checker"]


def test_layouts_given_as_an_iterator_are_viewable_and_one_layout_is_refused_by_name(daemon):
    """An iterator of layouts (a dict's values(), a generator) was registered at attach, then zipped
    with the ids as empty: every view said its layout "was not registered by this client". One Layout
    or one rate failed as "object is not iterable", naming nothing (a review)."""
    with Client.connect(daemon.endpoint, name="iter", layouts=(lay for lay in [SMALL])) as c:
        (place,) = c.allocate(c.layouts[0], 1)
        assert tuple(c.view(place).shape) == SMALL.shape
    with pytest.raises(TypeError, match="layouts is a sequence of dflash2.layout.Layout, not one Layout"):
        Client.connect(daemon.endpoint, name="one", layouts=SMALL)
    with pytest.raises(TypeError, match="prefill_tokens_per_s is one rate per layout"):
        Client.connect(daemon.endpoint, name="rate", layouts=[SMALL], prefill_tokens_per_s=1000.0)
    with Client.connect(daemon.endpoint, name="checker", layouts=[SMALL]) as checker:
        assert [x["name"] for x in checker.stats()["clients"]] == ["checker"]
