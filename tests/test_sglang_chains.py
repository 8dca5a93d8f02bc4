"""The chain tips sglang's backend keeps (client/sglang/chains.py, no sglang import): the limits of
`HeldTips`, and, against the real daemon, that a held tip keeps its chain through the drops other
writes make, where a freed one is dropped and the next batch cannot link to it. The backend's own
use of it is in tests/test_audit_sglang_chains.py (run where sglang is importable)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SMALL
from daemon_proc import DaemonProcess
from dflash2.client import Client
from dflash2.client.sglang.chains import HOLD_S, MAX_HELD_TIPS, HeldTips, Writing, slots
from dflash2.errors import DaemonError


def test_a_tip_is_held_until_a_batch_is_committed_under_it():
    tips = HeldTips(None, 32 * 100)  # (100 pages a backend)
    assert tips.extended(None, 10, 4) == []
    assert tips.extended(10, 11, 8) == [10]  # the parent's reference goes; the chain is held through 11
    assert len(tips) == 1 and tips.pages == 8
    assert tips.extended(None, 20, 1) == [] and len(tips) == 2 and tips.pages == 9


def test_the_oldest_tips_go_beyond_the_count():
    tips = HeldTips(None, 32 * 10_000)
    freed = [vid for t in range(MAX_HELD_TIPS + 3) for vid in tips.extended(None, 100 + t, 1)]
    assert freed == [100, 101, 102] and len(tips) == MAX_HELD_TIPS


def test_the_oldest_tips_go_beyond_the_pages_and_a_chain_alone_beyond_them_too():
    tips = HeldTips(None, 32 * 10)  # 10 pages
    assert tips.extended(None, 1, 4) == [] and tips.extended(None, 2, 4) == []
    assert tips.extended(None, 3, 4) == [1]  # depths 12 > 10: the oldest chain goes
    assert tips.pages == 8
    assert tips.extended(3, 4, 8) == [3, 2]  # chain 3 goes on, 8 deep: 2 goes
    assert tips.extended(None, 6, 2) == []
    assert tips.extended(4, 5, 12) == [4, 5]  # 12 deep: alone beyond the limit, the others stay
    assert len(tips) == 1 and tips.pages == 2


def test_a_tip_committed_twice_holds_both_references_and_gives_both_up():
    tips = HeldTips(None, 32 * 100)
    assert tips.extended(None, 7, 2) == [] and tips.extended(None, 7, 2) == []  # (deduplicated to one block)
    assert len(tips) == 1 and tips.pages == 2
    assert tips.extended(7, 8, 3) == [7, 7] and tips.pages == 3


def test_a_tier_too_small_for_a_share_holds_nothing():
    tips = HeldTips(None, 31)  # a 32nd of it is no page
    assert tips.max_tips == 0
    assert tips.extended(None, 1, 1) == [1] and len(tips) == 0


def test_a_tip_no_later_batch_names_is_given_up_at_once():
    tips = HeldTips(None, 32 * 100)
    assert tips.extended(None, 1, 4) == []
    assert tips.extended(1, 2, 8, keep=False) == [1, 2] and len(tips) == 0 and tips.pages == 0


def test_tips_are_held_hold_s_at_most():
    now = [0.0]
    tips = HeldTips(None, 32 * 100, clock=lambda: now[0])
    assert tips.extended(None, 1, 4) == []
    now[0] = HOLD_S / 2
    assert tips.extended(None, 2, 4) == [] and tips.stale() == []
    now[0] = HOLD_S + 1
    assert tips.stale() == [1] and len(tips) == 1 and tips.pages == 4
    now[0] = 2 * HOLD_S
    assert tips.extended(None, 3, 4) == [2]  # (a batch gives the stale ones up too)
    assert tips.extended(None, 3, 4) == [] and len(tips) == 1  # a tip committed again is held anew


def test_let_go_gives_every_reference_up_through_the_client_it_was_taken_on():
    freed = []

    class Recorder:
        def free(self, vids):
            freed.append(list(vids))

    mine, other = Recorder(), Recorder()
    tips = HeldTips(mine, 32 * 100)
    tips.extended(None, 1, 2), tips.extended(None, 1, 2), tips.extended(None, 2, 2)
    assert tips.let_go(other, "test") == 2  # (a client replaced since: the references went with its session)
    assert freed == [] and len(tips) == 0 and tips.pages == 0
    tips.extended(None, 1, 2), tips.extended(None, 1, 2), tips.extended(None, 2, 2)
    assert tips.let_go(mine, "test") == 2
    assert freed == [[1, 1, 2]] and len(tips) == 0
    tips.extended(None, 1, 2), tips.extended(None, 2, 3), tips.extended(None, 3, 1)
    with tips.writing(mine, 2, True), tips.writing(mine, 1, True) as w, tips.writing(mine, None, True):
        with tips.writing(mine, 3, True):
            pass
        w.protect(3)  # (the store under 1 went on under its own new tip, 3)
        assert tips.let_go(mine, "test") == 1  # what stores will write under stays held
        assert freed[-1] == [1] and len(tips) == 2 and tips.pages == 4
    assert tips._under == {}
    assert tips.let_go(mine, "test") == 2 and freed[-1] == [2, 3]


def test_tips_let_go_later_are_given_up_at_the_next_stale_and_one_can_go_alone():
    tips = HeldTips(None, 32 * 100)
    tips.extended(None, 1, 2), tips.extended(None, 1, 2), tips.extended(None, 2, 2)
    tips.let_go_later()
    assert len(tips) == 0 and tips.pages == 0
    assert sorted(tips.stale()) == [1, 1, 2] and tips.stale() == []
    tips.extended(None, 3, 2), tips.extended(None, 4, 2)
    ended = Writing(tips, None)  # (a store ending: `only` goes with it)
    assert tips.let_go(None, "test", only=3, ending=ended) == 1 and list(tips._held) == [4] and tips.pages == 2
    assert tips.let_go(None, "test", only=3, ending=ended) == 0


def test_a_tip_a_store_will_write_under_outlasts_hold_s_and_the_limits_until_then():
    now = [0.0]
    tips = HeldTips(None, 32 * 4, clock=lambda: now[0])  # 4 pages
    tips.extended(None, 1, 2)
    with tips.writing(None, 1, True):
        now[0] = HOLD_S + 1
        assert tips.stale() == []  # 1 stays while a store will write under it
        assert tips.extended(None, 2, 3) == [2]  # 5 pages: the limit holds by what may go, not 1
    assert tips.stale() == [1] and len(tips) == 0 and tips.pages == 0


def test_a_store_without_prefix_keys_lets_its_last_tip_go_however_it_ends():
    freed = []

    class Recorder:
        def free(self, vids):
            freed.append(list(vids))

    c = Recorder()
    tips = HeldTips(c, 32 * 100)
    with pytest.raises(RuntimeError):
        with tips.writing(c, None, keeps=False) as w:
            tips.extended(None, 5, 2, writing=w)
            raise RuntimeError("the store failed after its first batch")
    assert freed == [[5]] and len(tips) == 0
    with tips.writing(c, None, keeps=True) as w:
        tips.extended(None, 6, 2, writing=w)
    assert len(tips) == 1 and freed == [[5]]


def test_two_stores_under_one_parent_the_last_to_commit_takes_its_hold():
    """Two requests of one prefix, on two storage threads, write under held tip 1: the first to
    commit under it kept it only through its own new tip, which, unprotected once its store ended,
    could go (a refused write's let-go, the limits), and 1 with it before the second linked (a review)."""
    tips = HeldTips(None, 32 * 100)
    tips.extended(None, 1, 2)
    with tips.writing(None, 1, True) as a, tips.writing(None, 1, True) as b:
        assert tips.extended(1, 2, 3, writing=a) == [] and list(tips._held) == [1, 2]  # b writes under 1
        assert tips._under == {1: 1, 2: 1} and (a.vid, a.mine, a.kept) == (2, 2, True)  # (moved in one step)
        assert tips.let_go(None, "test") == 0  # both protected
        assert tips.extended(1, 3, 3, writing=b) == [1] and list(tips._held) == [2, 3]


def test_no_way_out_takes_a_tip_another_store_writes_under():
    """A commit deduplicated onto it and not kept, a call's end (`let_go(only=...)`) and the limits
    gave up every reference of a tip another store was writing under (a review)."""
    tips = HeldTips(None, 32 * 4)  # 4 pages
    tips.extended(None, 5, 2)
    with tips.writing(None, 5, True):
        assert tips.extended(None, 5, 2, keep=False) == [5] and tips._held[5][0] == 1  # the commit's alone
        with tips.writing(None, None, keeps=False) as w:
            assert tips.extended(None, 6, 1, writing=w) == []  # its first chunk, kept for its next
            assert tips.extended(6, 5, 2, writing=w) == [6]  # its second deduplicated onto 5, kept
        assert list(tips._held) == [5] and tips._held[5][0] == 2  # (the call's end took nothing of 5)
        tips.extended(None, 8, 1)
        with tips.writing(None, 9, True) as w:
            assert tips.extended(None, 9, 3, writing=w) == [8]  # 2 + 1 + 3 pages > 4: the unprotected 8 goes
            assert list(tips._held) == [5, 9] and tips.pages == 5  # past the limit by the two protected
    assert tips.extended(None, 10, 1) == [5, 5] and list(tips._held) == [9, 10]  # (once 5 is not)


def test_a_call_without_prefix_keys_leaves_a_hold_on_its_deduplicated_last_tip():
    """Its last chunk deduplicated onto a tip another request holds: that chunk's reference given up
    at once (not kept), the other's hold stays at the call's end; so it does where the call ends
    early after such a chunk (its own reference, kept for a next chunk, alone goes)."""
    tips = HeldTips(None, 32 * 100)
    tips.extended(None, 7, 2)  # (another request's chain, held for its next batch)
    with tips.writing(None, None, keeps=False) as w:
        assert tips.extended(None, 4, 1, writing=w) == []  # its first chunk, kept for its next
        assert tips.extended(4, 7, 2, keep=False, writing=w) == [4, 7]
    assert list(tips._held) == [7] and tips._held[7][0] == 1
    with tips.writing(None, None, keeps=False) as w:  # (one that ends after a chunk deduplicated onto 7)
        assert tips.extended(None, 7, 2, writing=w) == [] and tips._held[7][0] == 2
    assert list(tips._held) == [7] and tips._held[7][0] == 1  # its own reference alone went
    with tips.writing(None, None, keeps=False) as w:  # (its first chunk onto 7, its last under it: a review)
        assert tips.extended(None, 7, 2, writing=w) == [] and tips._held[7][0] == 2
        assert tips.extended(7, 8, 3, keep=False, writing=w) == [7, 8]  # its own on 7 alone, and the commit's
    assert list(tips._held) == [7] and tips._held[7][0] == 1


def test_a_call_without_prefix_keys_gives_up_only_what_it_holds():
    """Its last chunk under a tip it did not keep (beyond the share) that another request holds, or
    under its own kept tip after a clear let every tip go: nothing of the parent's is its to give up
    (the first gave the other's hold up, the second raised KeyError: reviews)."""
    tips = HeldTips(None, 32 * 10)  # 10 pages
    tips.extended(None, 5, 2)  # (another request's, held for its next batch)
    with tips.writing(None, None, keeps=False) as w:
        assert tips.extended(None, 5, 11, writing=w) == [5] and not w.kept  # deduplicated, 11 deep: not held
        assert tips.extended(5, 6, 12, keep=False, writing=w) == [6] and tips._held[5][0] == 1
    with tips.writing(None, None, keeps=False) as w:
        assert tips.extended(None, 7, 1, writing=w) == [] and w.kept
        tips.let_go_later()  # (a clear meanwhile)
        assert tips.extended(7, 8, 2, keep=False, writing=w) == [8] and sorted(tips.stale()) == [5, 7]


def test_a_chain_grown_beyond_the_share_is_held_no_more():
    """Its next batch deeper than the share: the parent's hold goes with the new tip's (a review: it
    stayed as an interior hold until HOLD_S)."""
    tips = HeldTips(None, 32 * 10)
    tips.extended(None, 1, 8)
    with tips.writing(None, 1, True) as w:
        assert tips.extended(1, 2, 12, writing=w) == [1, 2] and len(tips) == 0 and tips.pages == 0


def test_a_tier_counts_the_pages_its_aligned_slots_hold():
    assert slots({"capacity_bytes": 2 << 20, "alignment": 4096}, 1024) == 512
    assert slots({"capacity_bytes": 2 << 20, "alignment": 4096}, 4097) == 256
    assert slots({"capacity_bytes": 2 << 20, "alignment": 4096}, 8192) == 256
    assert slots({"capacity_bytes": 2 << 20}, 1024) == 2048


@pytest.fixture
def heat_daemon(config_file):
    # DRAM of 128 blocks of 16 KiB and no NVMe: other writes drop cached blocks out of the cache
    path = config_file(memory={"hbm_capacity_mb": 1, "dram_capacity_mb": 2, "nvme_capacity_mb": 0,
                               "nvme_path": None, "page_kb": 64},
                       policy={"name": "heat", "cold_threshold": 0.5, "swap_batch_size": 64})
    proc = DaemonProcess(path).start()
    yield proc
    proc.stop()


def _keys(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def _write_chain_piece(c: Client, tips: HeldTips, keys: list[int], parent: int | None, depth: int) -> int:
    """As the backend stores a batch: allocate in DRAM, commit linked, free all but what `tips` keeps."""
    places = c.allocate(0, len(keys), tier="dram")
    assert places is not None
    held = c.commit(places["vid"], keys, parent)
    unheld = np.concatenate([held[:-1], np.asarray(tips.extended(parent, int(held[-1]), depth), dtype=held.dtype)])
    if len(unheld):
        c.free(unheld)
    return int(held[-1])


@pytest.mark.parametrize("held", [True, False])
def test_a_held_tip_keeps_its_chain_through_other_writes(heat_daemon, held):
    """A chain's first batch is written and freed but for its tip; another writer then fills the DRAM
    tier twice over (each block written once, never read). The next batch links under the held tip,
    and the whole chain is found; with no hold (`held=False`, as before) the tip is dropped and the
    commit naming it is refused."""
    with Client.connect(heat_daemon.endpoint, name="writer", layouts=[SMALL]) as c, \
            Client.connect(heat_daemon.endpoint, name="other", layouts=[SMALL]) as other:
        tips = HeldTips(c, 128 if held else 0)  # (a 32nd of 128 blocks: 4 pages)
        tip = _write_chain_piece(c, tips, _keys(1_000, 3), None, 3)
        for i in range(64):
            _write_chain_piece(other, HeldTips(other, 0), _keys(10_000 + 4 * i, 4), None, 4)
        if not held:
            with pytest.raises(DaemonError, match="UnknownBlock: parent block"):
                _write_chain_piece(c, tips, _keys(2_000, 1), tip, 4)
            assert len(c.lookup(_keys(1_000, 3), 0, tier="dram")) < 3
            return
        _write_chain_piece(c, tips, _keys(2_000, 1), tip, 4)
        assert len(c.lookup(_keys(1_000, 3) + _keys(2_000, 1), 0, tier="dram")) == 4
        c.check()


def test_every_reference_a_tip_holds_is_given_up_once(heat_daemon):
    """A tip committed twice (the second commit deduplicated to the first's block: two references)
    is given up twice when a batch links under it; the client then holds just the new tip's."""
    with Client.connect(heat_daemon.endpoint, name="writer", layouts=[SMALL]) as c:
        tips = HeldTips(c, 128)
        tip = _write_chain_piece(c, tips, _keys(1_000, 2), None, 2)
        assert _write_chain_piece(c, tips, _keys(1_000, 2), None, 2) == tip and len(tips) == 1
        _write_chain_piece(c, tips, _keys(2_000, 1), tip, 3)
        assert c.detach()["dereferenced"] == 1
