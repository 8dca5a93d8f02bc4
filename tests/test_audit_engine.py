"""An engine's use of the client: views by vid follow the daemon's pin counts, and a block pinned
below HBM by a host-side reader is named when a GPU reader asks for it, not answered "no room"."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2.client import DaemonError, chain_keys
from dflash2.client.held import HeldPlaces
from dflash2.errors import ArenaError
from dflash2.protocol import PLACE_DTYPE


@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


def published(client, n=2, namespace="engine") -> np.ndarray:
    keys = chain_keys(range(16 * n), 16, namespace)
    vids = client.commit(client.allocate(client.layouts[0], n)["vid"], keys=keys)
    client.free(vids)
    return vids


def test_a_block_stays_viewable_until_its_last_pin_goes(connect):
    c = connect("engine")
    [vid] = published(c, 1)
    c.acquire([vid])
    c.acquire([vid])  # a second thread of the engine reads the same prefix
    c.view_bytes(int(vid))[:4] = np.frombuffer(b"KV!!", np.uint8)
    c.release([vid])
    assert bytes(c.view_bytes(int(vid))[:4]) == b"KV!!", "one pin is still held"
    c.release([vid])
    with pytest.raises(ArenaError, match="not being written or acquired by this client"):
        c.view(int(vid))


def test_freeing_a_reference_leaves_a_pinned_block_viewable(connect):
    c = connect("engine")
    [vid] = published(c, 1)
    c.add_ref([vid])
    c.acquire([vid])
    c.free([vid])  # the request's reference goes; its pin stays
    assert c.view(int(vid)) is not None
    c.release([vid])
    with pytest.raises(ArenaError):
        c.view(int(vid))


def test_threads_sharing_a_client_keep_each_others_pins(connect):
    c = connect("engine")
    vids = published(c, 4)
    errors = []

    def reader():
        try:
            for _ in range(50):
                c.acquire(vids)
                for v in vids:
                    c.view_bytes(int(v))  # still pinned by this thread, whatever the others released
                c.release(vids)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    c.check()


def test_held_places_count_pins_and_writes():
    held = HeldPlaces()
    rec = np.zeros(1, dtype=PLACE_DTYPE)
    rec["vid"] = 7
    held.writing(rec)
    held.pinned(rec)
    held.written([7])
    assert held.place(7) is not None  # pinned
    held.released([7])
    assert held.place(7) is None
    held.released([7])  # a release the client never pinned here: nothing to drop
    assert held.place(7) is None


def test_held_places_of_many_blocks_follow_each_vid():
    """Calls of many blocks: each vid's place is its latest record, pins are counted per vid (one
    listed twice in a call counts twice), and a vid goes once nobody writes or pins it."""
    held = HeldPlaces()
    recs = np.zeros(20, dtype=PLACE_DTYPE)
    recs["vid"] = np.arange(100, 120)
    recs["offset"] = np.arange(20) * 4096
    held.writing(recs)
    again = recs[:10].copy()
    again["tier"] = 1  # the same blocks, pinned after a move: the later record wins
    held.pinned(again)
    held.pinned(np.concatenate([recs[:3], recs[:3]]))  # vids 100-102 pinned twice more
    held.written(recs["vid"])
    assert [held.place(v) is not None for v in range(100, 120)] == [True] * 10 + [False] * 10
    assert held.place(105)["tier"] == 1 and held.place(105)["offset"] == 5 * 4096
    assert held.place(101)["tier"] == 0  # its latest record is the second pin's
    held.released(np.concatenate([recs["vid"][:10], recs["vid"][:3]]))  # 100-102: two pins of three
    assert [held.place(v) is not None for v in range(100, 110)] == [True] * 3 + [False] * 7
    held.released([100, 101, 102, 100])  # 100's last pin, then one it never had here
    assert all(held.place(v) is None for v in range(100, 120))


def test_a_block_pinned_in_dram_by_a_host_reader_is_named_to_a_gpu_reader(connect):
    host, gpu = connect("host-reader"), connect("gpu-engine")
    lid = host.layouts[0]
    keys = chain_keys(range(32), 16, "host")
    vids = host.commit(host.allocate(lid, 2, tier="dram")["vid"], keys=keys)
    host.free(vids)
    assert host.acquire(vids, tier="dram") is not None  # pinned where they lie, in DRAM
    with pytest.raises(DaemonError) as e:
        gpu.acquire(vids)
    assert e.value.kind == "PinnedBlock"
    assert f"block {int(vids[0]):#x} lies in dram, pinned there by a reader of that tier" in str(e.value)
    gpu.check()
    host.release(vids)
    places = gpu.acquire(vids)
    assert places is not None and set(places["tier"].tolist()) == {0}  # in HBM now
    gpu.release(vids)


def test_a_block_still_being_written_in_dram_is_named_to_a_reader_in_hbm(connect):
    """Only committed blocks move between tiers: an acquire into HBM of a block a host-side writer
    has not committed says so (before, "no room now" with HBM empty, which no retry could mend)."""
    writer = connect("host-writer")
    [vid] = writer.allocate(writer.layouts[0], 1, tier="dram")["vid"]
    with pytest.raises(DaemonError) as e:
        writer.acquire([vid])
    assert e.value.kind == "IllegalTransition"
    assert f"block {int(vid):#x} lies in dram and is WRITING, not committed" in str(e.value)
    writer.check()
    [vid] = writer.commit([vid], keys=chain_keys(range(16), 16, "host-writer"))
    places = writer.acquire([vid])
    assert places is not None and places["tier"].tolist() == [0]
    writer.release([vid])


def test_an_engine_keeps_reading_its_pinned_block_after_commit_deduplicates_it(connect):
    """Two engines compute the same block; the second pins its own copy (to keep reading it after
    commit), writes it and commits after the first: its view keeps its bytes, its release by the id
    it pinned succeeds, and the copy is freed then (the cached block stays)."""
    first, second = connect("first"), connect("second")
    lid = first.layouts[0]
    keys = chain_keys(range(16), 16, "shared")
    [cached] = first.commit(first.allocate(lid, 1)["vid"], keys=keys)
    first.free([cached])
    [copy] = second.allocate(lid, 1)["vid"]
    assert second.acquire([copy]) is not None
    second.view_bytes(int(copy))[:4] = np.frombuffer(b"mine", np.uint8)
    [held] = second.commit([copy], keys=keys)
    assert held == cached
    free_before = second.stats()["tiers"]["hbm"]["free_bytes"]
    assert bytes(second.view_bytes(int(copy))[:4]) == b"mine", "the pinned copy is where it was"
    second.release([copy])
    assert second.stats()["tiers"]["hbm"]["free_bytes"] > free_before, "the copy's slot is given back"
    second.free([held])
    assert len(second.lookup(keys)) == 1  # the cached block stays
    second.check()


def test_the_daemon_brings_up_the_window_ahead_of_each_read(connect):
    """Over the socket: once an acquire is answered, the blocks beyond it on the chain the reader
    looked up come up to HBM (the config's prefetch window), before the reader asks for them."""
    c = connect("engine")
    lid = c.layouts[0]
    keys = chain_keys(range(16 * 12), 16, "window")
    vids = c.commit(c.allocate(lid, 12)["vid"], keys=keys)
    c.free(vids)
    hbm_blocks = c.stats()["tiers"]["hbm"]["capacity_bytes"] // SMALL.block_bytes
    filler = c.allocate(lid, hbm_blocks)  # every idle block of HBM goes down to DRAM for these
    c.free(filler["vid"])
    assert set(c.places(vids)["tier"].tolist()) == {1}, "the chain lies in DRAM"
    found = c.lookup(keys)["vid"]
    first = c.stats()["prefetch"]["window"]
    assert (c.places(found[:first])["tier"] == 0).all()  # the first window, at the lookup
    assert (c.places(found[first:])["tier"] == 1).all()
    assert c.acquire(found[:first]) is not None
    c.release(found[:first])
    ahead = found[first: first + c.stats()["prefetch"]["window"]]
    assert len(ahead) and (c.places(ahead)["tier"] == 0).all(), "the window beyond the read came up after the reply"
