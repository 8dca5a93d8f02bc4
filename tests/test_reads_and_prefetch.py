"""Block reads and the prefetch window over a real host manager: which reads are HBM hits (a host
reader's are not; a block the reader's own lookup swapped in is not), and how the window follows
each reader's position on the chains its lookups found."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL
from observe_helpers import scrape
from fault_helpers import make_mgr  # noqa: F401  (a fixture: real host managers with NVMe)

from dflash2.daemon.service import Service
from dflash2.manager import Watermark
from dflash2.metrics import DaemonMetrics
from dflash2.tiers import Tier


@pytest.fixture
def service(make_manager, clock):
    return Service(make_manager(hbm_blocks=8, dram_blocks=16), lease_timeout_s=10, heartbeat_interval_s=1, clock=clock)


def _chain_in_dram(m, c, n=4, first_key=100) -> list[int]:
    """n published blocks of one chain, all in DRAM (pushed there by a later allocation)."""
    vids = m.allocate(c, 0, n)
    keys = list(range(first_key, first_key + n))
    m.commit(c, vids, keys)
    m.free(c, vids)
    filler = m.allocate(c, 0, 8)  # HBM full of private blocks: the chain goes down
    m.free(c, filler)
    assert all(p.tier.label == "dram" for p in m.places_of_rows(m.table.lookup(keys, 0)))
    return keys


def test_host_side_reads_are_neither_hbm_hits_nor_misses(service):
    """A host reader (tier dram, sglang's host pool) reads blocks where they lie: counted apart, so
    that the HBM hit ratio and its alert speak of the HBM readers only."""
    m = service.manager
    c = m.attach("host-reader")
    m.register_layout(SMALL)
    keys = _chain_in_dram(m, c)
    metrics = DaemonMetrics(service)
    before = dict(m.access.reads)
    found = m.table.vids(m.lookup_rows(keys, 0, reader=Tier.DRAM, client=c)).tolist()
    assert m.acquire_rows(c, found, Tier.DRAM) is not None
    assert dict(m.access.reads) == before and m.access.host_reads == {Tier.DRAM: 4}
    metrics.refresh(force=True)
    got = scrape(metrics)
    assert got[("dflash2_host_reads_total", (("tier", "dram"),))] == 4
    assert got[("dflash2_cache_misses_total", (("tier", "hbm"),))] == before.get(Tier.DRAM, 0)
    assert service.stats()["host_reads"] == {"dram": 4}


def test_blocks_the_readers_own_lookup_swapped_in_are_not_hbm_hits(make_manager, clock):
    """The lookup's prefetch brought them up while the reader waited: for the HBM hit ratio they
    were read from DRAM. Another client reading them afterwards finds them in HBM: hits."""
    m = make_manager(hbm_blocks=8, dram_blocks=16, prefetch_window=4)
    a, b = m.attach("a"), m.attach("b")
    m.register_layout(SMALL)
    keys = _chain_in_dram(m, a)
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()
    assert all(p.tier.label == "hbm" for p in m.places_of_rows(m.table.lookup(keys, 0))), "prefetched"
    assert m.acquire_rows(a, found) is not None
    assert m.access.reads == {Tier.DRAM: 4} and m.prefetcher.useful == 4
    m.release(a, found)
    assert m.acquire_rows(b, found) is not None
    assert m.access.reads == {Tier.DRAM: 4, Tier.HBM: 4}
    # Prefetched for one reader, read first by another: that one did not wait, a hit.
    m.release(b, found)
    keys2 = _chain_in_dram(m, a, first_key=200)
    found2 = m.table.vids(m.lookup_rows(keys2, 0, client=a)).tolist()
    assert m.acquire_rows(b, found2) is not None
    assert m.access.reads[Tier.HBM] == 8
    # ... and the reader that waited for them still reads them from DRAM: the same figures whoever
    # reads first (before, the first reader settled them and the waiting one's read was a hit, a review).
    m.release(b, found2)
    assert m.acquire_rows(a, found2) is not None
    assert m.access.reads == {Tier.DRAM: 8, Tier.HBM: 8} and m.prefetcher.useful == 8
    m.release(a, found2)
    assert m.acquire_rows(a, found2) is not None and m.access.reads[Tier.HBM] == 12  # once only


def test_a_waiting_readers_debt_ends_as_its_blocks_leave_hbm(make_manager):
    """Read first by another reader, then demoted before the waiting reader reads them: its read
    brings them up itself, counted from where they lie then, once."""
    m = make_manager(hbm_blocks=8, dram_blocks=16, prefetch_window=4)
    a, b = m.attach("a"), m.attach("b")
    m.register_layout(SMALL)
    found = m.table.vids(m.lookup_rows(_chain_in_dram(m, a), 0, client=a)).tolist()
    assert m.acquire_rows(b, found) is not None
    m.release(b, found)
    m.free(a, m.allocate(a, 0, 8))  # HBM full of private blocks: the chain goes down again
    m.tick()
    assert m.acquire_rows(a, found) is not None
    assert m.access.reads == {Tier.HBM: 4, Tier.DRAM: 4} and not m.prefetcher.settles


def test_a_prefetch_its_reader_never_reads_is_wasted_when_the_reader_leaves(make_manager):
    """A reader looks up (its window comes up), then detaches without reading: those prefetches were
    for nothing. Before, they stayed pending, counted neither way, for as long as HBM had room (a
    review); the windows brought up after its reads too. Another reader's stay pending."""
    m = make_manager(hbm_blocks=64, dram_blocks=64, prefetch_window=2)
    a, b = m.attach("a"), m.attach("b")
    m.register_layout(SMALL)
    keys, theirs = list(range(300, 316)), list(range(400, 404))
    m.free(a, m.commit(a, m.allocate(a, 0, 20), keys + theirs))
    assert m.placement.make_room(Tier.HBM, m.specs[Tier.HBM].capacity_bytes)
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()
    assert m.acquire_rows(a, found[:2]) is not None
    m.run_prefetch()  # the window after a's read comes up for a
    m.release(a, found[:2])
    ours = m.prefetcher.pending
    other = m.table.vids(m.lookup_rows(theirs, 0, client=b)).tolist()
    assert ours > 2 and m.prefetcher.pending > ours and m.prefetcher.wasted == 0
    m.detach(a)
    assert (m.prefetcher.useful, m.prefetcher.wasted) == (2, 0)  # (another reader may still read them)
    m.tick()
    assert (m.prefetcher.useful, m.prefetcher.wasted) == (2, ours)
    assert m.acquire_rows(b, other) is not None and m.prefetcher.useful == 2 + len(other)


def _two_readers_of_a_dram_chain(make_manager, first_key: int):
    """A manager (HBM 8, DRAM 16, window 4), a writer and two readers, and the keys of a chain of 4 the
    writer published, pushed down to DRAM."""
    m = make_manager(hbm_blocks=8, dram_blocks=16, prefetch_window=4)
    m.register_layout(SMALL)
    w, a, b = m.attach("w"), m.attach("a"), m.attach("b")
    keys = list(range(first_key, first_key + 4))
    m.free(w, m.commit(w, m.allocate(w, 0, 4), keys))
    m.free(w, m.allocate(w, 0, 8))  # the chain goes down to DRAM
    return m, w, a, b, keys


@pytest.mark.parametrize("detach_first", [False, True])
def test_a_prefetch_read_from_hbm_is_useful_whether_its_reader_left_first_or_not(make_manager, detach_first):
    """Counted wasted at the detach, a window another reader then read from HBM was no useful
    prefetch, though the same read before the detach was (a review): now wasted only if nobody reads
    it by the next step."""
    m, w, a, b, keys = _two_readers_of_a_dram_chain(make_manager, 100)
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()  # a's lookup brings them up
    if detach_first:
        m.detach(a)
    assert m.acquire_rows(b, found) is not None  # b reads all four, from HBM
    m.detach(b) if detach_first else m.detach(a)
    m.tick()
    assert (m.prefetcher.useful, m.prefetcher.wasted, dict(m.access.reads)) == (4, 0, {Tier.HBM: 4})


def test_a_left_readers_block_brought_up_again_for_another_is_that_ones(make_manager):
    """Left by a reader that detached, pushed down unread, then brought up by another reader's
    lookup before the step: the step counted the second reader's prefetch wasted, and its read, which
    waited for the copy, an HBM hit (a review of the mend)."""
    m, w, a, b, keys = _two_readers_of_a_dram_chain(make_manager, 100)
    m.lookup_rows(keys, 0, client=a)  # a's lookup brings them up
    m.detach(a)
    m.free(w, m.allocate(w, 0, 8))  # down again, unread (no step between)
    found = m.table.vids(m.lookup_rows(keys, 0, client=b)).tolist()  # b's lookup brings them up: b waits
    m.tick()
    assert m.acquire_rows(b, found) is not None
    assert (m.prefetcher.useful, m.prefetcher.wasted, dict(m.access.reads)) == (4, 4, {Tier.DRAM: 4})


def test_a_waiting_readers_debt_does_not_outlive_the_next_steps(make_manager, clock):
    """Its lookup waited, another reader read the blocks first, and its own request went away: an
    hour later its next request finds the chain in HBM, waits for nothing, and reads hits. The debt
    kept until its read made those reads from DRAM (a review)."""
    m, w, a, b, keys = _two_readers_of_a_dram_chain(make_manager, 1)
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()  # a's lookup waits for the swap-in
    assert m.acquire_rows(b, found) is not None  # b reads them first (and keeps them): hits
    for _ in range(3):
        clock.advance(1.0)
        m.tick()
    again = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()  # a's next request: all in HBM
    assert m.acquire_rows(a, again) is not None
    assert m.access.reads == {Tier.HBM: 8} and not m.prefetcher.settles


def test_a_lookups_own_prefetch_read_steps_later_is_an_hbm_hit(make_manager, clock):
    """Its lookup waited for the swap-in and no acquire followed (the request went away); steps
    later the same client reads the blocks, which have sat in HBM: it waits for nothing, hits. The
    waited-for claim kept until read made those reads from DRAM (a review: {'dram': 2} for the
    first window of a chain). Still a useful prefetch: read while in HBM."""
    m, w, a, b, keys = _two_readers_of_a_dram_chain(make_manager, 1)
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()  # a's lookup waits for the swap-in
    for _ in range(2):
        clock.advance(1.0)
        m.tick()
    assert all(p.tier.label == "hbm" for p in m.places_of_rows(m.table.lookup(keys, 0))), "still in HBM"
    assert m.acquire_rows(a, found) is not None
    assert m.access.reads == {Tier.HBM: 4} and (m.prefetcher.useful, m.prefetcher.wasted) == (4, 0)


def test_a_lookups_own_prefetch_read_first_by_another_steps_later_owes_nothing(make_manager, clock):
    """The same claim read first by another reader after those steps: no debt is made for the
    waiting reader (the same figures whoever reads first)."""
    m, w, a, b, keys = _two_readers_of_a_dram_chain(make_manager, 1)
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()
    for _ in range(2):
        clock.advance(1.0)
        m.tick()
    assert m.acquire_rows(b, found) is not None
    assert not m.prefetcher.settles, "a debt for a claim that had lapsed"
    assert m.acquire_rows(a, found) is not None
    assert m.access.reads == {Tier.HBM: 8}


def test_the_window_follows_the_readers_position(make_manager, clock):
    """A reader's acquires move its read position along the chain its lookup found: the window
    beyond it comes up once the acquire is answered (not waited for: those reads are HBM hits), and
    it doubles while HBM is below its low watermark."""
    m = make_manager(hbm_blocks=64, dram_blocks=64, prefetch_window=2)
    a = m.attach("reader")
    m.register_layout(SMALL)
    keys = list(range(300, 324))
    vids = m.allocate(a, 0, len(keys))
    m.free(a, m.commit(a, vids, keys))
    assert m.placement.make_room(Tier.HBM, 64 * SMALL.block_bytes)  # the whole chain down to DRAM
    rows = m.table.lookup(keys, 0)
    assert (m.table.cols.tier[rows] == int(Tier.DRAM)).all()
    chain = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()
    first = int(np.count_nonzero(m.table.cols.tier[rows] == int(Tier.HBM)))
    assert first == m.prefetcher.window  # the first window, while the reader waited
    read = 0
    while read < len(chain):
        part = chain[read: read + 4]
        assert m.acquire_rows(a, part) is not None
        m.release(a, part)
        read += len(part)
        m.run_prefetch()  # what the daemon does once it has answered
        ahead = chain[read: read + m.prefetcher.window]
        if ahead:
            assert (m.table.cols.tier[m.table.rows(ahead)] == int(Tier.HBM)).all(), read
    assert m.prefetcher.window > 2  # doubled: HBM stayed below its low watermark
    # Only the first window was waited for (read from DRAM); everything after it was a hit.
    assert m.access.reads[Tier.DRAM] == first and m.access.reads[Tier.HBM] == len(chain) - first
    assert m.prefetcher.useful == len(chain) and m.prefetcher.wasted == 0


def test_the_window_follows_each_of_a_clients_requests(make_manager, clock):
    """An engine reads several requests' prefixes at once: an acquire moves the window of the
    chain that holds its blocks, whichever was looked up last."""
    m = make_manager(hbm_blocks=64, dram_blocks=64, prefetch_window=2)
    a = m.attach("engine")
    m.register_layout(SMALL)
    chains = []
    for first in (400, 500):
        keys = list(range(first, first + 12))
        m.free(a, m.commit(a, m.allocate(a, 0, 12), keys))
        chains.append(keys)
    assert m.placement.make_room(Tier.HBM, 64 * SMALL.block_bytes)  # both chains down to DRAM
    one, two = (m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist() for keys in chains)
    two_before = m.table.cols.tier[m.table.rows(two)].copy()
    first = int(np.count_nonzero(m.table.cols.tier[m.table.rows(one)] == int(Tier.HBM)))
    assert m.acquire_rows(a, one[:first]) is not None  # the first request reads on, past its first window
    m.run_prefetch()
    ahead = one[first:first + m.prefetcher.window]
    assert ahead and (m.table.cols.tier[m.table.rows(ahead)] == int(Tier.HBM)).all()
    assert (m.table.cols.tier[m.table.rows(two)] == two_before).all()  # the other request's chain: untouched


def _down_chain(m, a, first_key, n):
    keys = list(range(first_key, first_key + n))
    m.free(a, m.commit(a, m.allocate(a, 0, n), keys))
    return keys


def _reader_of_dram_chains(make_manager, *chains: tuple[int, int]):
    """A manager (HBM 64, DRAM 64, window 2), a reader, and chains of (first key, length) it
    published, all pushed down to DRAM: (manager, reader, keys of each chain)."""
    m = make_manager(hbm_blocks=64, dram_blocks=64, prefetch_window=2)
    a = m.attach("reader")
    m.register_layout(SMALL)
    keys = [_down_chain(m, a, first, n) for first, n in chains]
    assert m.placement.make_room(Tier.HBM, 64 * SMALL.block_bytes)
    return m, a, keys


def test_a_block_read_twice_in_one_acquire_settles_its_prefetch_once(make_manager, clock):
    m, a, [keys] = _reader_of_dram_chains(make_manager, (600, 4))
    found = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()
    assert m.prefetcher.pending
    assert m.acquire_rows(a, [found[0], found[0]]) is not None  # one pin per occurrence
    assert m.table.cols.pins[m.table.rows([found[0]])[0]] == 2 and m.prefetcher.useful == 1


def test_a_prefetch_gone_from_hbm_unread_is_wasted_in_the_figures_at_once(make_manager, clock):
    """The prefetch figures of `stats()` (`dflash2 status`, the metrics): `pending` is prefetched blocks
    in HBM not read yet, and one pushed out of HBM unread is wasted. Both were settled only at the next
    background step, every policy.rescore_interval_ms (up to an hour): until then a window pushed out
    of HBM read as pending and none of it as wasted (a review). Counted once: the step adds nothing."""
    m, a, [keys] = _reader_of_dram_chains(make_manager, (610, 8))
    m.lookup_rows(keys, 0, client=a)
    n = m.prefetcher.pending
    assert n and m.stats()["prefetch"]["pending"] == n and m.stats()["prefetch"]["wasted"] == 0
    assert m.placement.make_room(Tier.HBM, 64 * SMALL.block_bytes)  # every idle block goes down, the window too
    assert not (m.table.cols.tier[m.table.lookup(keys, 0)] == int(Tier.HBM)).any()
    figures = m.stats()["prefetch"]
    assert (figures["pending"], figures["wasted"], figures["useful"]) == (0, n, 0)
    m.tick()
    assert (m.prefetcher.pending, m.prefetcher.wasted, m.prefetcher.useful) == (0, n, 0)


@pytest.mark.parametrize("after_step", [False, True])
def test_another_readers_window_is_not_the_room_for_a_prefetch(make_manager, clock, after_step):
    """A window brought up for a read that has not come yet keeps its old score: without being kept
    out of the room another reader's prefetch makes, it would be the first block to go. `after_step`:
    the same past a background step: a window was kept out of that room only until the next step
    (which may come a moment after it came up), and then, its score old, it was the first block another
    reader's prefetch pushed out, unread (a review: a daemon's reader lost its window to another's
    lookup 0.5 s after it came up). Kept while it waits for its reader; a read asked for still takes
    it after idle blocks (below), and a drain as ever (its protection there lasts one step)."""
    m = make_manager(hbm_blocks=16, dram_blocks=64, prefetch_window=2,
                     **({"watermarks": {Tier.HBM: Watermark(high=1.0, low=0.85)}}  # (no drain: the step settles)
                        if after_step else {}))
    a, b = m.attach("a"), m.attach("b")
    m.register_layout(SMALL)
    one, two = _down_chain(m, a, 700, 8), _down_chain(m, b, 800, 8)
    assert m.placement.make_room(Tier.HBM, 16 * SMALL.block_bytes)
    filler = _down_chain(m, a, 900, 16)  # HBM full of idle blocks read just now
    assert m.stats()["tiers"]["hbm"]["blocks"] == 16
    chain_a = m.table.vids(m.lookup_rows(one, 0, client=a)).tolist()
    assert m.acquire_rows(a, chain_a[:2]) is not None
    m.release(a, chain_a[:2])
    m.run_prefetch()
    window = [v for v in chain_a[2:] if m.table.cols.tier[m.table.rows([v])[0]] == int(Tier.HBM)]
    assert window, "a's window came up"
    if after_step:
        m.tick()
        assert m.prefetcher.pending == len(window)  # (not read yet, still in HBM)
    chain_b = m.table.vids(m.lookup_rows(two, 0, client=b)).tolist()
    assert m.acquire_rows(b, chain_b[:2]) is not None
    m.run_prefetch()
    assert (m.table.cols.tier[m.table.rows(window)] == int(Tier.HBM)).all(), "a's window stayed for its read"
    if after_step:
        assert m.acquire_rows(a, window) is not None and m.prefetcher.wasted == 0
    assert filler


def test_a_read_takes_an_unread_prefetchs_room_after_idle_blocks(make_manager, clock):
    """Kept out of every promotion's room, a window brought up for a read that had not come refused
    another read "full of blocks being written or pinned" until the next step sent it down unread (a
    review): a read asked for beats a guess. Idle blocks go first, then the unread prefetch's."""
    m = make_manager(hbm_blocks=4, dram_blocks=16, prefetch_window=1)
    a, b = m.attach("a"), m.attach("b")
    m.register_layout(SMALL)
    ahead, wanted, other = _down_chain(m, a, 700, 2), _down_chain(m, b, 800, 2), _down_chain(m, b, 900, 1)
    idle = _down_chain(m, a, 950, 1)
    assert m.placement.make_room(Tier.HBM, 4 * SMALL.block_bytes)
    m.acquire_rows(a, m.table.vids(m.table.lookup(idle, 0)))
    m.release(a, m.table.vids(m.table.lookup(idle, 0)))  # HBM: one idle block, read just now
    window = m.table.vids(m.lookup_rows(ahead, 0, client=a)).tolist()  # a's window: two blocks up, unread
    tier = lambda vids: m.table.cols.tier[m.table.rows(vids)].tolist()  # noqa: E731
    assert tier(window) == [int(Tier.HBM)] * 2 and m.stats()["tiers"]["hbm"]["blocks"] == 3
    pinned = m.table.vids(m.table.lookup(wanted, 0))
    assert m.acquire_rows(b, pinned) is not None  # room: the free slot, then the idle block
    assert tier(window) == [int(Tier.HBM)] * 2 and tier(m.table.vids(m.table.lookup(idle, 0))) != [int(Tier.HBM)]
    assert m.acquire_rows(b, m.table.vids(m.table.lookup(other, 0))) is not None, m.acquire_refusal
    assert sorted(tier(window)) == [int(Tier.HBM), int(Tier.DRAM)]  # one of the window's blocks made way
    m.check_invariants()


def test_probe_lookups_are_not_followed(make_manager, clock):
    m, a, [keys, *probes] = _reader_of_dram_chains(make_manager, (1000, 12), *((2000 + 10 * i, 1) for i in range(20)))
    chain = m.table.vids(m.lookup_rows(keys, 0, client=a)).tolist()
    for p in probes:  # "is the page before mine cached?", twenty times
        m.lookup_rows(p, 0, client=a, probe=True)
    first = int(np.count_nonzero(m.table.cols.tier[m.table.rows(chain)] == int(Tier.HBM)))
    assert m.acquire_rows(a, chain[:first]) is not None
    m.run_prefetch()
    assert m.table.cols.tier[m.table.rows([chain[first]])[0]] == int(Tier.HBM), "the request's window still follows"
    assert all(m.table.cols.tier[m.table.rows(m.table.vids(m.table.lookup(p, 0)))[0]] == int(Tier.DRAM) for p in probes)



def test_a_read_that_waits_for_its_prefetch_window_in_flight_is_no_hbm_hit(make_mgr):
    """DESIGN: an HBM hit is a read served from HBM "without waiting for a swap-in". The daemon
    leaves the next window's NVMe reads in flight after a reply; a reader that comes before they end
    waits for them (parked), and its reads were counted as HBM hits once they had landed."""
    from fault_helpers import chain_on_nvme

    from dflash2.table import BlockState

    m = make_mgr(prefetch_window=2)
    keys = list(range(1, 13))
    a, lid, _ = chain_on_nvme(m, keys)
    m.placement.read_later = True  # as the daemon's loop sets it while it serves
    try:
        chain = m.table.vids(m.lookup_rows(keys, lid, client=a)).tolist()
        m.settle()  # the lookup's own window, which this reader waits for (its own lookup: no hits either)
        first = [v for v in chain if m.place(v).tier == Tier.HBM]
        assert first and m.acquire_rows(a, first) is not None
        m.release(a, first)
        assert m.access.reads == {Tier.NVME: len(first)}
        m.run_prefetch()  # after the reply: the next window's reads, left in flight
        rows = m.table.rows(chain)
        flying = [v for v, s in zip(chain, m.table.cols.state[rows].tolist()) if s == int(BlockState.MIGRATING)]
        assert flying and m.placement.in_flight
        assert m.acquire_rows(a, flying) is not None  # waits for them
        assert m.access.reads == {Tier.NVME: len(first) + len(flying)}, m.access.reads
        assert m.prefetcher.useful == len(first) + len(flying)
    finally:
        m.placement.read_later = False
    m.check_invariants()


def test_an_acquire_that_finds_no_room_settles_no_prefetch(make_manager):
    """An acquire answering None (no room) read nothing: it counted the reader's prefetched blocks
    as useful and settled them, and its retry then took those its own lookup had brought up as
    HBM hits (they came from DRAM)."""
    m = make_manager(hbm_blocks=4, dram_blocks=16, prefetch_window=2)
    a, b = m.attach("a"), m.attach("b")
    lid = m.register_layout(SMALL)
    keys = list(range(100, 104))
    vids = m.commit(a, m.allocate(a, lid, 4), keys=keys)
    m.free(a, vids)
    m.placement.make_room(Tier.HBM, 4 * SMALL.block_bytes)  # all of it down to DRAM
    found = m.table.vids(m.lookup_rows(keys, lid, client=a)).tolist()  # its prefetch brings them up
    assert m.prefetcher.pending == 4
    held = m.allocate(b, lid, 2)  # two of them go down again: b writes there
    assert m.acquire_rows(a, found) is None
    assert (m.prefetcher.useful, m.prefetcher.wasted, m.prefetcher.pending) == (0, 0, 4) and not m.access.reads
    m.free(b, held)
    assert m.acquire_rows(a, found) is not None
    assert m.access.reads == {Tier.DRAM: 4}, m.access.reads
    assert (m.prefetcher.useful, m.prefetcher.wasted) == (2, 2)
    m.check_invariants()


@pytest.mark.parametrize("policy", ["heat", "lfu", "lru"])
def test_an_acquire_that_finds_no_room_is_no_access_for_the_policy(make_manager, clock, policy):
    """An acquire answering None (no room in HBM) read nothing: it raised the blocks' hit counts and
    recency, and under heat moved them from first-timers to returning blocks, once per failed try
    (an engine that retries under HBM pressure made a key look reused)."""
    m = make_manager(hbm_blocks=4, dram_blocks=16, policy=policy)
    a, b = m.attach("a"), m.attach("b")
    lid = m.register_layout(SMALL)
    keys = [100, 101]
    m.free(a, m.commit(a, m.allocate(a, lid, 2), keys=keys))
    m.placement.make_room(Tier.HBM, 4 * SMALL.block_bytes)  # the chain goes down to DRAM
    rows = m.lookup_rows(keys, lid, client=a, probe=True)
    vids = m.table.vids(rows).tolist()
    c = m.table.cols
    before = (c.hits[rows].tolist(), c.last_access[rows].tolist())
    split = m.policy.split.describe() if policy == "heat" else None
    held = m.allocate(b, lid, 4)  # HBM full of blocks being written: no room to make
    for _ in range(5):
        clock.advance(1.0)
        assert m.acquire_rows(a, vids) is None
    assert (c.hits[rows].tolist(), c.last_access[rows].tolist()) == before
    if policy == "heat":
        assert m.policy.split.describe() == split
    m.free(b, held)
    assert m.acquire_rows(a, vids) is not None
    assert c.hits[rows].tolist() == [h + 1 for h in before[0]]
    m.check_invariants()


def test_a_probe_lookup_is_not_counted_in_the_lookup_figures(make_manager):
    """A probe asks about blocks (the page before mine; which pages are stored already): counted, an
    sglang server's page was a lookup hit or miss two or three times (a review)."""
    m = make_manager(hbm_blocks=8, dram_blocks=16)
    c = m.attach("c")
    m.register_layout(SMALL)
    keys = _down_chain(m, c, 100, 2)
    m.lookup_rows(keys + [999], 0, client=c, probe=True)
    assert (m.access.lookups, m.access.lookup_blocks_found, m.access.misses) == (0, 0, 0)
    m.lookup_rows(keys + [999], 0, client=c)
    assert (m.access.lookups, m.access.lookup_blocks_found, m.access.misses) == (1, 2, 1)
