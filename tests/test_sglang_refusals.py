"""A read the daemon gives no room (a page on NVMe moves up into DRAM to be read, and every DRAM block
is pinned or being written by another reader) is a miss, which sglang recomputes: the backend says so
in a warning with the daemon's reason, at most once a REFUSAL_LOG_S (it said nothing, where a refused
write is said; a review's script). Skipped where sglang is not importable (test_sglang.py)."""

from __future__ import annotations

import logging

import pytest
from conftest import config_file  # noqa: F401  (fixture)
from daemon_proc import DaemonProcess
from test_sglang import backends, fill, host_pool, indices, make_backend  # noqa: F401  (fixture; skips without sglang)

from dflash2.client import Client

DRAM, NVME = 1, 2


@pytest.fixture
def small_dram(config_file, tmp_path):
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 1, "nvme_capacity_mb": 4,
                               "nvme_path": str(tmp_path / "nvme.cache"), "page_kb": 64})
    proc = DaemonProcess(path).start()
    yield path
    proc.stop()


def test_a_read_refused_room_is_a_miss_said_once_a_while_with_the_daemons_reason(small_dram, backends, caplog):
    pool = host_pool(tokens=256)
    b = make_backend(small_dram, pool)
    backends.append(b)
    fill(pool, list(range(1, 9)), seed=1)
    old = [f"old-{i}" for i in range(4)]
    assert b.batch_set_v1(old, indices([1, 2, 3, 4])) == [True] * 4
    newer = 0
    while set(b.client.lookup(b.keys.keys(old), b.layout_id, tier="dram")["tier"].tolist()) != {NVME}:
        assert newer < 200, "never demoted"
        assert b.batch_set_v1([f"new{newer}-{i}" for i in range(8)], indices(list(range(1, 9)))) == [True] * 8
        newer += 1
    other = Client.connect(config=small_dram, name="other-reader", host_only=True)
    try:
        lid = other.register_layout(b.client.layout(b.layout_id))
        for n in range(newer):  # another reader pins every page in DRAM and writes into the rest
            found = other.lookup(b.keys.keys([f"new{n}-{i}" for i in range(8)]), lid, tier="dram")
            here = found[found["tier"] == DRAM]["vid"]
            if len(here):
                assert other.acquire(here, tier="dram") is not None
        while other.allocate(lid, 1, tier="dram") is not None:
            pass
        assert b.batch_exists(old) == 4
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
            assert b.batch_get_v1(old, indices([5, 6, 7, 8])) == [False] * 4
            assert b.batch_get_v1(old, indices([5, 6, 7, 8])) == [False] * 4  # within the minute: counted, not said
        [line] = [r.getMessage() for r in caplog.records]
        assert "the daemon gave no room to read 4 cached pages now, misses that sglang recomputes" in line
        assert "DRAM could not be given room for them now" in line and "1 reads refused so far" in line
        assert b.counters["reads_refused"] == 2 and b.counters["page_misses"] == 8
    finally:
        other.close()


def test_a_write_refused_room_is_said_once_a_while_with_the_daemons_reason(small_dram, backends, caplog):
    """Every DRAM block pinned or being written by another reader: a store has no room. It was said at
    every batch, without the daemon's reason (a review); now once a REFUSAL_LOG_S, with the reason, and
    counted (`writes_refused`). sglang keeps the pages in its host cache, as before."""
    pool = host_pool(tokens=256)
    b = make_backend(small_dram, pool)
    backends.append(b)
    fill(pool, list(range(1, 9)), seed=1)
    other = Client.connect(config=small_dram, name="other-writer", host_only=True)
    try:
        lid = other.register_layout(b.client.layout(b.layout_id))
        while other.allocate(lid, 1, tier="dram") is not None:  # DRAM full of blocks being written
            pass
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash2.sglang"):
            assert b.batch_set_v1(["w-1", "w-2"], indices([1, 2])) == [False] * 2
            assert b.batch_set_v1(["w-3", "w-4"], indices([3, 4])) == [False] * 2  # within the minute: counted
        [line] = [r.getMessage() for r in caplog.records]
        assert "the daemon gave no room to store 2 pages now; sglang keeps them in its host cache" in line
        assert "(1 writes refused so far" in line and "DRAM is full of blocks that cannot move now" in line
        assert b.counters["writes_refused"] == 2
    finally:
        other.close()


KEYS = [f"count-{i}" for i in range(4)]


def test_the_daemons_lookup_figures_count_what_sglang_asked_once(config_file, backends):
    """Two requests share a 4-page prompt: the first's hit query misses 4 and backs them up, the
    second's hits 4 and reads them. The daemon's lookup figures counted the backup's own lookup and
    the read's second lookup too: 8 hits and 8 misses (a review). Only the hit query counts now."""
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        pool = host_pool()
        b = make_backend(path, pool)
        backends.append(b)
        fill(pool, [1, 2, 3, 4], seed=31)
        assert b.batch_exists(KEYS) == 0
        assert b.batch_set_v1(KEYS, indices([1, 2, 3, 4])) == [True] * 4
        assert b.batch_exists(KEYS) == 4
        assert b.batch_get_v1(KEYS, indices([5, 6, 7, 8])) == [True] * 4
        st = b.client.stats()
        assert (st["lookup_blocks_found"], st["lookup_misses"]) == (4, 4)
        # The read's misses are counted whichever way it ends: the daemon gone, a read misses whole.
        proc.stop()
        assert b.batch_get_v1(KEYS[:2], indices([5, 6])) == [False, False]
        assert b.batch_get_v1(KEYS[:2], indices([5, 6])) == [False, False]  # (within RETRY_S: no call)
        assert (b.counters["pages_got"], b.counters["page_misses"]) == (4, 4)
    finally:
        proc.stop()


def test_a_page_another_server_cached_meanwhile_counts_deduplicated(config_file, backends):
    """Two servers back up one prefix at once: B's lookup finds nothing, A commits, B's commit finds
    A's blocks. B counted its pages stored (a review); they are deduplicated."""
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        pool_a, pool_b = host_pool(), host_pool()
        a, b = make_backend(path, pool_a), make_backend(path, pool_b)
        backends += [a, b]
        fill(pool_a, [1, 2, 3, 4], seed=7)
        fill(pool_b, [1, 2, 3, 4], seed=7)
        alloc = b.client.allocate

        def racing(*args, **kw):
            assert a.batch_set_v1(KEYS, indices([1, 2, 3, 4])) == [True] * 4  # A commits first
            return alloc(*args, **kw)

        b.client.allocate = racing
        assert b.batch_set_v1(KEYS, indices([1, 2, 3, 4])) == [True] * 4
        b.client.allocate = alloc
        assert sum(t["blocks"] for t in a.client.stats()["tiers"].values()) == 4
        assert (b.counters["pages_deduplicated"], b.counters["pages_set"]) == (4, 0)
    finally:
        proc.stop()


def test_threads_waiting_on_a_reattach_that_falls_back_for_good_get_no_exception(config_file, backends,
                                                                                   monkeypatch):
    """The restarted daemon's tiers cannot hold a page: the thread that reattaches falls back for
    good (its client None), and a storage thread that waited on the reattach then read the client's
    lease on None: an AttributeError into sglang's thread (a review)."""
    import threading
    import time

    from dflash2.client.sglang.pages import PageFormatError
    path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 16, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64})
    proc = DaemonProcess(path).start()
    try:
        b = make_backend(path, host_pool())
        backends.append(b)
        entered = threading.Event()

        def fit(client, layout):
            entered.set()
            time.sleep(0.5)  # (the other thread reaches the lock meanwhile)
            raise PageFormatError("a page takes more than the restarted daemon's whole dram tier")

        monkeypatch.setattr(b, "_fit_tiers", fit)
        b.client.lease_lost = True  # as after the daemon restarted
        errors, results = [], []

        def call():
            try:
                results.append(b.batch_exists(KEYS))
            except BaseException as e:  # what sglang's storage thread would get
                errors.append(repr(e))

        first = threading.Thread(target=call)
        first.start()
        assert entered.wait(5)
        second = threading.Thread(target=call)
        second.start()
        first.join(10)
        second.join(10)
        assert not errors and results == [0, 0] and b.fallback_reason
    finally:
        proc.stop()
