"""Prefetch accounting where the daemon parks an acquire on its own NVMe reads (placement.read_later and
parking, as Service sets them): a prefetch that left HBM unread is wasted, once, whoever brings it back.
Split from test_reads_and_prefetch.py."""

from __future__ import annotations

import pytest
from conftest import SMALL

from dflash2.tiers import Tier


def _lookup_then_down_to_nvme(m, reader, keys: list[int]) -> list[int]:
    """`reader`'s lookup prefetches its DRAM chain to HBM; before it reads them, they leave HBM for
    NVMe unread (prefetches wasted). Returns their vids."""
    lid = m.register_layout(SMALL)
    m.free(reader, m.commit(reader, m.allocate(reader, lid, len(keys), tier=Tier.DRAM), keys))
    found = m.table.vids(m.lookup_rows(keys, lid, client=reader)).tolist()
    assert [m.place(v).tier for v in found] == [Tier.HBM] * len(keys) and m.prefetcher.pending == len(keys)
    assert m.mover.move(m.table.rows(found), Tier.NVME).all()
    return found


def _acquire_as_the_daemon(m, client, vids, parking: bool):
    """With `parking`, as the daemon's Service serves an acquire: NVMe reads left in flight, and a
    call parked on its copies runs again, whole, once they have ended (own_parks counted)."""
    from dflash2.errors import CopiesRunning

    if not parking:
        return m.acquire_rows(client, vids)
    m.placement.read_later, own = True, 0
    try:
        while True:
            m.placement.parking, m.placement.own_parks = True, own
            try:
                return m.acquire_rows(client, vids)
            except CopiesRunning as e:
                own += e.own
            m.placement.parking = False
            m.settle()  # (the server answers other calls until they have ended)
    finally:
        m.placement.read_later = m.placement.parking = False
        m.placement.own_parks = 0


@pytest.mark.parametrize("parking", [False, True])
def test_a_prefetch_that_left_hbm_unread_is_wasted_when_its_read_brings_it_back(small_nvme_manager, parking):
    """A parked acquire promotes its blocks from NVMe before it looks at the prefetches among them:
    one that had left HBM unread was counted useful (a review). It is wasted, parked or not."""
    m = small_nvme_manager
    a = m.attach("a")
    found = _lookup_then_down_to_nvme(m, a, [11, 12, 13, 14])
    assert _acquire_as_the_daemon(m, a, found, parking) is not None
    assert m.access.reads == {Tier.NVME: 4}
    assert (m.prefetcher.useful, m.prefetcher.wasted, m.prefetcher.pending) == (0, 4, 0)
    m.check_invariants()


@pytest.mark.parametrize("parking", [False, True])
def test_a_prefetch_that_left_hbm_and_another_reader_brought_back_is_no_debt(small_nvme_manager, parking):
    """b's parked acquire brings a's unread prefetches back from NVMe: it counted them useful, and a
    debt for a that outlived their stay below HBM, so a's reads of them from HBM, waiting for
    nothing, were not HBM hits (a review)."""
    m = small_nvme_manager
    a, b = m.attach("a"), m.attach("b")
    found = _lookup_then_down_to_nvme(m, a, [21, 22, 23, 24])
    assert _acquire_as_the_daemon(m, b, found, parking) is not None  # b waits for the NVMe reads
    assert m.acquire_rows(a, found) is not None  # a finds them in HBM: no wait
    assert m.access.reads == {Tier.NVME: 4, Tier.HBM: 4}, m.access.reads
    assert (m.prefetcher.useful, m.prefetcher.wasted) == (0, 4) and not m.prefetcher.settles
    m.check_invariants()


def test_a_prefetch_again_in_flight_when_its_reader_parks_is_useful(small_nvme_manager):
    """A pending prefetch that left HBM unread is prefetched again (its NVMe read in flight) as its
    reader's acquire comes: the acquire parks on that copy and reads the block from HBM once it has
    landed. The first prefetch was wasted (counted as the second landed), the second read in HBM:
    useful. The acquire's `left`, taken before it parked, counted it wasted again (a review: 0/2)."""
    m = small_nvme_manager
    a = m.attach("a")
    found = _lookup_then_down_to_nvme(m, a, [31])  # prefetched to HBM, then demoted to NVMe unread
    assert m.prefetcher.pending == 1 and m.place(found[0]).tier == Tier.NVME
    m.placement.read_later = True  # (the daemon's: the window's NVMe read left in flight)
    try:
        m.prefetcher.ahead(found, 0, a, waits=False)
    finally:
        m.placement.read_later = False
    assert _acquire_as_the_daemon(m, a, found, parking=True) is not None
    assert (m.prefetcher.useful, m.prefetcher.wasted, m.prefetcher.pending) == (1, 1, 0)


def test_a_parked_acquire_reads_what_its_lookup_waited_for_from_where_it_came(small_nvme_manager, monkeypatch):
    """The daemon's order: a's lookup waits for its window's DRAM->HBM copies (step s); a step passes
    (s+1); a's acquire of the window and a block on NVMe parks on the slow NVMe read; the step due
    meanwhile settles the copies (s+2), and the claim on the window lapses; the call runs again. Its
    request waited for the window's swap-in: read from DRAM, not HBM hits (a review: the claim was
    looked at on the run again only, and the figures hung on the disk's speed)."""
    import time

    from test_parked_calls import HeldDisk

    from dflash2.errors import CopiesRunning

    m = small_nvme_manager
    a = m.attach("a")
    lid = m.register_layout(SMALL)
    m.free(a, m.commit(a, m.allocate(a, lid, 2, tier=Tier.DRAM), [31, 32]))
    far = m.commit(a, m.allocate(a, lid, 1, tier=Tier.DRAM), [41])
    m.free(a, far)
    assert m.mover.move(m.table.rows(far), Tier.NVME).all()
    window = m.table.vids(m.lookup_rows([31, 32], lid, client=a)).tolist()
    assert [m.place(v).tier for v in window] == [Tier.HBM] * 2 and m.prefetcher.pending == 2
    m.tick()
    disk = HeldDisk(m, monkeypatch)
    m.placement.read_later, m.placement.parking, m.placement.own_parks = True, True, 0
    try:
        with pytest.raises(CopiesRunning):
            m.acquire_rows(a, window + list(far), call=7)
        m.placement.parking = False
        assert disk.reading.wait(10)
        disk.release()
        deadline = time.monotonic() + 10
        while m.copies_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        m.tick()
        m.placement.parking, m.placement.own_parks = True, 1
        assert m.acquire_rows(a, window + list(far), call=7) is not None
    finally:
        m.placement.read_later = m.placement.parking = False
        m.placement.own_parks = 0
    assert dict(m.access.reads) == {Tier.DRAM: 2, Tier.NVME: 1}
    assert (m.prefetcher.useful, m.prefetcher.wasted) == (2, 0) and not m._came_from
    m.check_invariants()
