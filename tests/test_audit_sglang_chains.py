"""The chain tips sglang's backend holds (client/sglang/chains.py), through the backend and the real
daemon: how deep a chain it holds, what it lets go (a call sglang passes no prefix keys, a clear, the
tips of a client replaced since, those held past HOLD_S), and the tier's pages by its slots. Runs
where sglang is importable (README, "sglang"), like test_sglang.py."""

from __future__ import annotations

import pytest

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
except Exception as exc:  # not installed, or installed without its dependencies
    pytest.skip(f"sglang is not importable here ({type(exc).__name__}: {exc}); run these tests in the sglang "
                "environment (README, 'sglang')", allow_module_level=True)

from daemon_proc import DaemonProcess
from dflash2.client import Client
from dflash2.client.sglang import chains
from dflash2.client.sglang.chains import HeldTips
from dflash2.client.sglang.pages import store_page
from test_sglang import a_process_of_its_own, backends, daemon  # noqa: F401  (fixtures; the first autouse)
from test_sglang import PAGE, fill, host_pool, indices, make_backend


def writer(daemon, backends):
    """A backend over test_sglang's daemon (DRAM 16 MiB: 4,096 pages of 1 KiB in 4 KiB slots, a 32nd
    of them 128), its host pool's pages 1-8 filled."""
    pool = host_pool()
    b = make_backend(daemon[0], pool)
    backends.append(b)
    fill(pool, list(range(1, 9)), seed=4)
    return b


def told(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


@pytest.fixture
def small_dram(config_file, backends):
    """`make(policy)`: a daemon of DRAM 1 MiB and no NVMe (256 pages of 1 KiB in 4 KiB slots: more
    single-use writes drop cached pages from the cache), and two backends over one host pool whose
    pages 0-63 are filled."""
    procs = []

    def make(policy: str = "lru"):
        path = config_file(memory={"hbm_capacity_mb": 8, "dram_capacity_mb": 1, "nvme_capacity_mb": 0,
                                   "nvme_path": None, "page_kb": 64}, policy={"name": policy})
        procs.append(DaemonProcess(path).start())
        pool = host_pool(tokens=512)
        pair = make_backend(path, pool), make_backend(path, pool)
        backends.extend(pair)
        fill(pool, list(range(64)), seed=5)
        return pool, *pair
    yield make
    for proc in procs:
        proc.stop()


def flood(other) -> None:
    """80 x 64 single-use pages of 1 KiB through `other`: 5 MiB into the DRAM tier of 1 MiB."""
    for r in range(80):
        assert other.batch_set_v1([f"o{r}-{k}" for k in range(64)], indices(list(range(64)))) == [True] * 64


def test_a_chain_backed_up_in_batches_keeps_its_link_while_other_writes_fill_the_cache(small_dram):
    """sglang backs a request up in batches, each naming the keys before it. Between two batches
    another server writes more single-use pages than the DRAM tier holds (no NVMe): the first
    batch's last page, freed by the backend before, was dropped, and the second batch was stored
    where no lookup of the request reaches it (batch_exists 0 of 4). The backend keeps its
    reference on a batch's last page until the next batch links to it (chains.py)."""
    _, writer, other = small_dram("heat")
    first = [f"chain-{i}" for i in range(3)]
    # (sglang passes the first batch of a chain its prefix keys too: none, `[]`)
    assert writer.batch_set_v1(first, indices([1, 2, 3]), told([])) == [True] * 3
    flood(other)
    assert writer.batch_set_v1(["chain-3"], indices([4]), told(first)) == [True]
    assert writer.batch_exists(first + ["chain-3"]) == 4
    assert writer.counters["commits_unlinked"] == 0
    # The writer holds its chain's tip; the other's chains, 64 pages deep, are beyond a backend's
    # share (a 32nd of the 256 pages of 1 KiB the tier holds): none held.
    assert len(writer.tips) == 1 and len(other.tips) == 0


def test_the_tier_is_counted_by_the_slots_its_pages_take(daemon, backends):
    b = writer(daemon, backends)
    assert b.tips.max_pages == 4096 // 32
    taken = 0
    while b.client.allocate(b.layout_id, 1, tier="dram") is not None:
        taken += 1
    assert taken == 4096  # (the pages the tier holds, as HeldTips counts them)


def test_a_chain_deeper_than_the_share_is_not_held(daemon, backends):
    """The depth counts the prefix sglang names (a hold keeps the whole chain from being dropped)."""
    b = writer(daemon, backends)
    assert b.batch_set_v1(["a1"], indices([1]), told([f"p{i}" for i in range(127)])) == [True]
    assert len(b.tips) == 1 and b.tips.pages == 128
    assert b.batch_set_v1(["b1"], indices([2]), told([f"q{i}" for i in range(128)])) == [True]
    assert len(b.tips) == 1 and b.tips.pages == 128  # 129 deep: given up at once
    assert b.client.detach()["dereferenced"] == 1


def test_a_call_sglang_passes_no_prefix_keys_keeps_no_tip_but_links_its_own_batches(daemon, backends):
    b = writer(daemon, backends)
    b.chunk_pages = 2
    keys = [f"k{i}" for i in range(6)]
    assert b.batch_set_v1(keys, indices([1, 2, 3, 4, 5, 6])) == [True] * 6  # (extra_info None: sglang's generic path)
    assert b.batch_set_v1(["x"], indices([7]), told(None)) == [True]  # (hicache_storage_pass_prefix_keys off)
    assert len(b.tips) == 0 and b.batch_exists(keys) == 6
    assert b.client.detach()["dereferenced"] == 0


@pytest.mark.parametrize("failing", [1, 2])
def test_a_call_without_prefix_keys_whose_free_fails_keeps_no_tip(daemon, backends, monkeypatch, failing):
    """The first or second chunk's free answered an error after it ran (the chunk committed, its tip
    kept for the next): the call ends there and lets that tip go (reviews: it let the chunk before's
    go, already gone; the first's, it kept, the call failing as a whole)."""
    from dflash2.errors import DaemonError

    b = writer(daemon, backends)
    b.chunk_pages = 2
    real, calls = b.client.free, []

    def free(vids):
        calls.append(1)
        out = real(vids)
        if len(calls) == failing:
            raise DaemonError("Simulated", "the free's answer was an error")
        return out
    monkeypatch.setattr(b.client, "free", free)
    stored = [True, True] if failing == 2 else []  # (a call whose first chunk failed fails as a whole)
    pages = b.batch_set_v1([f"k{i}" for i in range(6)], indices([1, 2, 3, 4, 5, 6]))
    assert pages == stored + [False] * (6 - len(stored))
    monkeypatch.setattr(b.client, "free", real)
    assert len(b.tips) == 0 and b.client.detach()["dereferenced"] == 0


def test_a_clear_lets_the_tips_go_at_the_next_store(daemon, backends, monkeypatch):
    b = writer(daemon, backends)
    assert b.batch_set_v1(["c1", "c2"], indices([1, 2]), told([])) == [True, True]
    assert len(b.tips) == 1
    with monkeypatch.context() as m:  # (sglang's scheduler thread, under the backend's lock: no daemon call)
        m.setattr(b.client, "free", lambda vids: pytest.fail("a clear called the daemon"))
        assert b.clear() is True
    assert len(b.tips) == 0
    assert b.batch_set_v1(["c3"], indices([3]), told([])) == [True]
    assert len(b.tips) == 1 and b.client.detach()["dereferenced"] == 1  # c3's alone


def test_a_call_without_prefix_keys_that_ends_early_keeps_no_tip(daemon, backends, monkeypatch):
    b = writer(daemon, backends)
    b.chunk_pages = 2
    real, calls = b.client.allocate, []

    def second_refused(*a, **kw):
        calls.append(1)
        return real(*a, **kw) if len(calls) == 1 else None
    monkeypatch.setattr(b.client, "allocate", second_refused)
    assert b.batch_set_v1(["e1", "e2", "e3", "e4"], indices([1, 2, 3, 4])) == [True, True, False, False]
    assert len(b.tips) == 0 and b.client.detach()["dereferenced"] == 0


def test_tips_held_past_hold_s_go_at_the_next_store(daemon, backends, monkeypatch):
    b = writer(daemon, backends)
    now = [0.0]
    b.tips = HeldTips(b.client, b.tips.max_pages * 32, clock=lambda: now[0])
    assert b.batch_set_v1(["t1"], indices([2])) == [True]  # (no prefix keys: nothing held)
    assert b.batch_set_v1(["s1"], indices([1]), told([])) == [True]
    now[0] = chains.HOLD_S + 1
    assert b.batch_exists(["s1"]) == 1 and len(b.tips) == 1  # (a store lets them go, not a lookup)
    # A store that commits nothing (its page cached already): the stale tip goes all the same
    assert b.batch_set_v1(["t1"], indices([2]), told([])) == [True]
    assert len(b.tips) == 0 and b.client.detach()["dereferenced"] == 0
    # (a store that would write under a stale tip keeps it: tests/test_sglang_chains.py)


def test_a_store_through_a_client_other_than_the_tips_holds_nothing(daemon, backends):
    """A storage thread still on the client a reattach replaced: the tips belong to the new one, and
    a vid of one daemon must never be freed on another's client."""
    b = writer(daemon, backends)
    other = Client.connect(b.client.endpoint, name="other")
    try:
        b.tips = HeldTips(other, b.tips.max_pages * 32)
        assert b.batch_set_v1(["o1", "o2"], indices([1, 2]), told([])) == [True, True]
        assert len(b.tips) == 0
        assert b.client.detach()["dereferenced"] == 0 and other.detach()["dereferenced"] == 0
    finally:
        other.close()


def test_a_write_refused_lets_the_backends_holds_go_and_is_tried_again(small_dram, monkeypatch):
    """Held chains are not moved down for a write's room: a tier full of them (here one backend's,
    its share raised to the whole tier) refused the next write. The backend lets its own go (but the
    parent the write goes under) and tries once more."""
    monkeypatch.setattr(chains, "HELD_PAGES_SHARE", 1.0)
    _, b, _ = small_dram("lru")
    for c in range(4):  # 4 chains of 64 pages: the 256 pages the tier holds
        assert b.batch_set_v1([f"c{c}-{i}" for i in range(64)], indices(list(range(64))), told([])) == [True] * 64
    assert len(b.tips) == 4 and b.tips.pages == 256
    # Under the oldest chain (lru's first to go once let go): it stays held, and links
    assert b.batch_set_v1(["d0"], indices([1]), told([f"c0-{i}" for i in range(64)])) == [True]
    assert len(b.tips) == 1 and b.batch_exists([f"c0-{i}" for i in range(64)] + ["d0"]) == 65
    assert b.counters["writes_refused"] == 0 and b.counters["commits_unlinked"] == 0


def test_a_call_without_prefix_keys_keeps_its_tip_for_its_own_next_chunk(small_dram):
    """Between two chunks of one call another server writes more than the DRAM tier holds (no NVMe):
    the first chunk's tip is held, and the second links under it."""
    pool, b, other = small_dram("heat")
    b.chunk_pages = 2

    def write(i, raw):
        if i == 2:  # the second chunk's blocks are allocated: the flood meanwhile
            flood(other)
        store_page(pool, (i + 1) * PAGE, raw)
    keys = ["f1", "f2", "f3", "f4"]
    assert b._store(b.client, keys, write, None) == [True] * 4
    assert b.counters["commits_unlinked"] == 0 and b.batch_exists(keys) == 4
    assert len(b.tips) == 0


@pytest.mark.parametrize("when", ["write", "free"])
def test_a_write_refused_keeps_the_tips_other_stores_write_under(small_dram, monkeypatch, when):
    """Two stores of one backend at once (sglang's storage threads): while B writes its second chunk
    under its first chunk's tip (`write`), or frees the rest of its first chunk (`free`), A's write is
    refused and A lets the backend's tips go; B's next parent stays held (it went too, two reviews:
    then dropped by other writes, and B's chunk unlinked)."""
    pool, b, other = small_dram("heat")
    b.chunk_pages = 2
    real_allocate, real_free, refuse, frees = b.client.allocate, b.client.free, [0], []

    def allocate(*a, **kw):
        if refuse[0]:
            refuse[0] -= 1
            return None
        return real_allocate(*a, **kw)

    def a_refused():
        refuse[0] = 1  # A's first allocate refused (a full tier); it lets z1 go and tries again
        assert b._store(b.client, ["a1"], lambda i, raw: store_page(pool, 9 * PAGE, raw), told([])) == [True]

    def free(vids):
        frees.append(1)
        out = real_free(vids)
        if when == "free" and len(frees) == 1:  # B's free of its first chunk's other block
            a_refused()
        return out
    monkeypatch.setattr(b.client, "allocate", allocate)
    monkeypatch.setattr(b.client, "free", free)

    def write(i, raw):
        if i == 2:  # B's second chunk is allocated
            if when == "write":
                a_refused()
            flood(other)
        store_page(pool, (i + 1) * PAGE, raw)
    assert b.batch_set_v1(["z1"], indices([8]), told([])) == [True]  # (a tip of the backend's, to let go)
    keys = ["f1", "f2", "f3", "f4"]
    assert b._store(b.client, keys, write, None) == [True] * 4
    assert b.counters["commits_unlinked"] == 0 and b.batch_exists(keys) == 4
    assert b.client.detach()["dereferenced"] == 1  # a1's tip: z1's went at A's refusal, B's at its end


def test_a_store_under_a_tip_held_past_hold_s_keeps_it_until_it_links(small_dram):
    """The store's own `stale()` gives up the tips held past HOLD_S, but not the one it writes under:
    its parent, protected first (`writing`), stays held while other writes fill the tier."""
    pool, b, other = small_dram("heat")
    now = [0.0]
    b.tips = HeldTips(b.client, b.tips.max_pages * 32, clock=lambda: now[0])
    first = ["h1", "h2"]
    assert b.batch_set_v1(first, indices([1, 2]), told([])) == [True, True]
    now[0] = chains.HOLD_S + 1

    def write(i, raw):
        flood(other)  # (its blocks allocated, before its commit under h2)
        store_page(pool, 3 * PAGE, raw)
    assert b._store(b.client, ["h3"], write, told(first)) == [True]
    assert b.counters["commits_unlinked"] == 0 and b.batch_exists(first + ["h3"]) == 3


def test_two_requests_of_one_prefix_both_link_under_it(small_dram, monkeypatch):
    """Two stores of one backend under the same held tip p1 (two requests sharing a prefix, two
    storage threads): A commits under it first and ends; a third store's write is refused and lets
    the backend's tips go, and other writes fill the tier before B commits. A's commit took p1's hold
    (B's protection notwithstanding), the let-go took A's tip, which had kept p1: B's commit went
    unlinked (a review). p1 stays held until the last store under it commits."""
    pool, b, other = small_dram("heat")
    real_allocate, refuse = b.client.allocate, [0]

    def allocate(*a, **kw):
        if refuse[0]:
            refuse[0] -= 1
            return None
        return real_allocate(*a, **kw)
    monkeypatch.setattr(b.client, "allocate", allocate)
    assert b.batch_set_v1(["p1"], indices([1]), told([])) == [True]

    def write(i, raw):
        if i == 0:  # B's blocks are allocated
            assert b._store(b.client, ["a1"], lambda i, raw: store_page(pool, 9 * PAGE, raw), told(["p1"])) == [True]
            refuse[0] = 1  # C's first allocate refused: it lets the tips go and tries again
            assert b._store(b.client, ["c1"], lambda i, raw: store_page(pool, 10 * PAGE, raw), told([])) == [True]
            flood(other)
        store_page(pool, (i + 2) * PAGE, raw)
    assert b._store(b.client, ["b1", "b2"], write, told(["p1"])) == [True, True]
    assert b.counters["commits_unlinked"] == 0 and b.batch_exists(["p1", "b1", "b2"]) == 3
