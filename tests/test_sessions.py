"""Sessions: a client id is not a credential (every call carries the token attach returned), and a
call its client gave up on (timed out) leaves nothing held that the client does not know of."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest
from conftest import SMALL
from daemon_proc import DaemonProcess

from dflash2 import protocol as P
from dflash2.client import Client, DaemonError, DaemonUnavailable, Transport
from dflash2.daemon import forgetting
from dflash2.daemon.service import Service
from dflash2.daemon.sessions import KEEP_CALLS, KEEP_FORGOTTEN
from dflash2.errors import ArenaError
from dflash2.keys import chain_keys
from dflash2.protocol import Op


@pytest.fixture
def service(make_manager, clock):
    return Service(make_manager(hbm_blocks=16, dram_blocks=16), lease_timeout_s=10.0, heartbeat_interval_s=2.0,
                   clock=clock)


def call(svc, op, client=None, args=None, arrays=None, *, call_id=1, token=...):
    if token is ...:
        token = svc.sessions[client].token if client is not None else None
    return P.decode_reply(svc.handle_frames(P.encode_request(op, call_id, client, args, arrays, token=token)))


def attach(svc, name="c") -> int:
    reply = call(svc, Op.ATTACH, args={"name": name, "pid": 0, "layouts": [SMALL.to_dict()]})
    assert reply.ok and len(reply.result["token"]) == P.TOKEN_CHARS
    return reply.result["client"]


def vids_frame(vids) -> list[bytes]:
    return [np.asarray(vids, dtype=P.VIDS_DTYPE).tobytes()]


def hbm_used(svc) -> int:
    return svc.manager.stats()["tiers"]["hbm"]["blocks"]


def pins(svc) -> int:
    return int(svc.manager.table.cols.pins.sum())


def published(svc, client, n=4) -> np.ndarray:
    m = svc.manager
    vids = m.allocate(client, 0, n)
    out = m.commit(client, vids, chain_keys(range(16 * n), 16, "sessions"))
    m.free(client, out)
    return out


# -- tokens ----------------------------------------------------------------------------------
def test_another_processs_token_cannot_act_for_a_client(service, clock):
    victim, other = attach(service, "victim"), attach(service, "other")
    vids = published(service, victim)
    assert call(service, Op.ACQUIRE, victim, {}, vids_frame(vids)).ok
    pinned = pins(service)
    seen = service.sessions[victim].last_seen
    clock.advance(5.0)
    for token in ("0" * P.TOKEN_CHARS, service.sessions[other].token, ""):
        for op, arrays in ((Op.RELEASE, vids_frame(vids)), (Op.DETACH, None), (Op.HEARTBEAT, None)):
            reply = call(service, op, victim, {}, arrays, token=token)
            assert not reply.ok and reply.error_type == "WrongToken", (op, token, reply)
            assert f"client {victim}" in reply.error_message
    assert victim in service.sessions and pins(service) == pinned == len(vids)
    assert service.sessions[victim].last_seen == seen  # a refused call renews no lease
    assert call(service, Op.RELEASE, victim, {}, vids_frame(vids)).ok  # its own token still works


def test_a_call_without_a_token_is_refused_by_name(service):
    c = attach(service)
    reply = call(service, Op.HEARTBEAT, c, token=None)
    assert not reply.ok and "heartbeat needs the session token attach returned (header.token)" in reply.error_message
    reply = call(service, Op.HEARTBEAT, c, token=7)
    assert not reply.ok and "header.token must be the session token" in reply.error_message


def test_stats_lists_clients_without_their_tokens(service):
    c = attach(service)
    st = call(service, Op.STATS).result
    assert [x["client"] for x in st["clients"]] == [c]
    assert service.sessions[c].token not in str(st)


# -- forget ----------------------------------------------------------------------------------
def test_a_forgotten_call_that_ran_is_given_back(service):
    c = attach(service)
    lid = 0
    cached = published(service, c)
    used = hbm_used(service)
    calls = [
        (Op.ALLOCATE, {"layout": lid, "n": 3}, None),
        (Op.RESERVE, {"layout": lid, "tokens": 16 * 2}, None),
        (Op.ACQUIRE, {}, vids_frame(cached)),
        (Op.ADD_REF, {}, vids_frame(cached[:1])),
    ]
    for i, (op, args, arrays) in enumerate(calls, start=10):
        assert call(service, op, c, args, arrays, call_id=i).ok
    assert hbm_used(service) > used
    assert pins(service) == len(cached) and service.manager.stats()["reservations"]["granted"] == 1
    for i, _ in enumerate(calls, start=10):
        assert call(service, Op.FORGET, c, {"call": i}, call_id=100 + i).result == {"undone": True}
    assert hbm_used(service) == used and pins(service) == 0
    assert service.manager.stats()["reservations"]["granted"] == 0
    assert not +service.manager.table.client(c).refs  # the add_ref's reference is dropped
    assert service.counters["calls_undone"] == 4
    service.manager.check_invariants()


def taken(reply) -> list[int]:
    assert reply.ok, reply
    return np.frombuffer(reply.arrays[0], dtype=P.PLACE_DTYPE)["vid"].tolist()


@pytest.mark.parametrize("first_take", [2, 4])
def test_a_forgotten_take_gives_its_blocks_back_to_the_reservation(service, first_take):
    """The engine's retry finds its reservation whole (before, the undo freed the blocks to anyone
    and a take of the reservation's last blocks left it unknown), the blocks given back first."""
    c = attach(service)
    rid = call(service, Op.RESERVE, c, {"layout": 0, "tokens": 64}, call_id=1).result["reservation_id"]
    got = taken(call(service, Op.TAKE, c, {"reservation": rid, "n": first_take}, call_id=2))
    assert call(service, Op.FORGET, c, {"call": 2}, call_id=3).result == {"undone": True}
    assert call(service, Op.RESERVATION, c, {"reservation": rid}, call_id=4).result["outcome"] == "granted"
    assert service.manager.stats()["reservations"]["reserved_blocks"] == 4 and hbm_used(service) == 4
    service.manager.check_invariants()
    again = taken(call(service, Op.TAKE, c, {"reservation": rid, "n": 4}, call_id=5))
    assert again[:first_take] == got and len(set(again)) == 4
    assert call(service, Op.FORGET, c, {"call": 2}, call_id=6).result == {"undone": False}  # once only
    service.manager.check_invariants()


@pytest.mark.parametrize("ended_by", ["cancel", "expiry"])
def test_a_forgotten_take_of_a_reservation_that_ended_since_frees_its_blocks(service, clock, ended_by):
    c = attach(service)
    rid = call(service, Op.RESERVE, c, {"layout": 0, "tokens": 64, "deadline_s": 5.0},
               call_id=1).result["reservation_id"]
    taken(call(service, Op.TAKE, c, {"reservation": rid, "n": 2}, call_id=2))
    if ended_by == "cancel":
        assert call(service, Op.CANCEL, c, {"reservation": rid}, call_id=3).ok
    else:
        clock.advance(6.0)
    assert call(service, Op.FORGET, c, {"call": 2}, call_id=4).result == {"undone": True}
    service.manager.admission.tick()
    assert hbm_used(service) == 0 and service.manager.stats()["reservations"]["granted"] == 0
    reply = call(service, Op.TAKE, c, {"reservation": rid, "n": 1}, call_id=5)
    assert not reply.ok and reply.error_type == "ReservationError"
    service.manager.check_invariants()


@pytest.mark.parametrize("cached_already", [False, True])
def test_a_forgotten_commit_that_ran_drops_the_writers_references(service, cached_already):
    """A commit leaves the writer references on the blocks it returns, which are not the ones it
    named when a key was cached already: a writer that timed out never learned them, and its free
    of the ids it named failed (or was lost), holding the blocks in the cache for its whole life."""
    c = attach(service)
    keys = chain_keys(range(16 * 2), 16, "forgotten-commit")
    if cached_already:
        m = service.manager
        m.free(c, m.commit(c, m.allocate(c, 0, 2), keys))
    places = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 2}, call_id=1).arrays[0], P.PLACE_DTYPE)
    reply = call(service, Op.COMMIT, c, {}, [places["vid"].tobytes(), np.asarray(keys, P.KEYS_DTYPE).tobytes()],
                 call_id=2)
    assert reply.ok
    assert call(service, Op.FORGET, c, {"call": 2}, call_id=3).result == {"undone": True}
    assert not +service.manager.table.client(c).refs, "no reference of the writer is left"
    assert len(service.manager.lookup(keys)) == 2, "the blocks stay cached"
    service.manager.check_invariants()


def test_a_commit_that_arrives_after_its_forget_frees_the_blocks_it_names(service):
    """Not run: the blocks stay the writer's, being written, and the free it sent after the forget
    may be lost with a socket the daemon never read: they are freed, not left held."""
    c = attach(service)
    places = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 3}, call_id=1).arrays[0], P.PLACE_DTYPE)
    assert hbm_used(service) == 3
    assert call(service, Op.FORGET, c, {"call": 2}, call_id=3).result == {"undone": False}
    keys = np.asarray(chain_keys(range(16 * 3), 16, "late-commit"), P.KEYS_DTYPE)
    reply = call(service, Op.COMMIT, c, {}, [places["vid"].tobytes(), keys.tobytes()], call_id=2)
    assert not reply.ok and reply.error_type == "CallForgotten"
    assert hbm_used(service) == 0 and not service.manager.lookup(keys.tolist())
    service.manager.check_invariants()


def test_a_late_commit_of_blocks_one_of_which_the_writer_pins_frees_them_all(service):
    """The writer pinned one of them to read it after the commit: the free of them all was refused
    for it, and all three stayed held, being written, until the client detached (a review)."""
    c = attach(service)
    places = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 3}, call_id=1).arrays[0], P.PLACE_DTYPE)
    assert call(service, Op.ACQUIRE, c, {}, [places["vid"][2:].tobytes()], call_id=2).ok
    assert call(service, Op.FORGET, c, {"call": 3}, call_id=4).result == {"undone": False}
    keys = np.asarray(chain_keys(range(16 * 3), 16, "late-commit-pinned"), P.KEYS_DTYPE)
    reply = call(service, Op.COMMIT, c, {}, [places["vid"].tobytes(), keys.tobytes()], call_id=3)
    assert not reply.ok and reply.error_type == "CallForgotten"
    assert hbm_used(service) == 1  # the pinned one, kept for its pin
    service.manager.check_invariants()
    assert call(service, Op.RELEASE, c, {}, [places["vid"][2:].tobytes()], call_id=5).ok
    assert hbm_used(service) == 0 and not service.manager.lookup(keys.tolist())
    service.manager.check_invariants()


def test_a_late_commit_lets_go_of_one_reference_of_a_pinned_block_another_request_shares(service):
    """The writer's second request shares its block (add_ref) and it pins it: the refused commit let
    go of both references, the release freed the block, and that request's free failed (a review)."""
    c = attach(service)
    vids = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 2}, call_id=1).arrays[0],
                         P.PLACE_DTYPE)["vid"].copy()
    assert call(service, Op.ADD_REF, c, {}, [vids.tobytes()], call_id=2).ok  # two references each
    assert call(service, Op.ACQUIRE, c, {}, [vids[1:].tobytes()], call_id=3).ok
    assert call(service, Op.FORGET, c, {"call": 4}, call_id=5).result == {"undone": False}
    keys = np.asarray(chain_keys(range(16 * 2), 16, "late-commit-shared"), P.KEYS_DTYPE)
    assert call(service, Op.COMMIT, c, {}, [vids.tobytes(), keys.tobytes()], call_id=4).error_type == "CallForgotten"
    assert service.manager.table.cols.refs[service.manager.table.rows(vids)].tolist() == [1, 1]
    assert call(service, Op.RELEASE, c, {}, [vids[1:].tobytes()], call_id=6).ok
    assert call(service, Op.FREE, c, {}, [vids.tobytes()], call_id=7).ok  # the other request's references
    assert hbm_used(service) == 0
    service.manager.check_invariants()


def test_a_block_kept_for_its_pin_after_a_late_commit_says_why_it_is_not_live(service):
    c = attach(service)
    vids = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=1).arrays[0],
                         P.PLACE_DTYPE)["vid"].copy()
    assert call(service, Op.ACQUIRE, c, {}, [vids.tobytes()], call_id=2).ok
    assert call(service, Op.FORGET, c, {"call": 3}, call_id=4).ok
    keys = np.asarray(chain_keys(range(16), 16, "late-commit-why"), P.KEYS_DTYPE)
    assert call(service, Op.COMMIT, c, {}, [vids.tobytes(), keys.tobytes()], call_id=3).error_type == "CallForgotten"
    again = call(service, Op.ACQUIRE, c, {}, [vids.tobytes()], call_id=5)
    assert again.error_type == "UnknownBlock" and "its commit was given up, and not run" in again.error_message
    assert call(service, Op.DETACH, c, {}, call_id=6).ok
    assert hbm_used(service) == 0


def test_a_call_that_arrives_after_its_forget_is_not_run(service):
    c = attach(service)
    assert call(service, Op.FORGET, c, {"call": 5}, call_id=6).result == {"undone": False}
    reply = call(service, Op.ALLOCATE, c, {"layout": 0, "n": 3}, call_id=5)
    assert not reply.ok and reply.error_type == "CallForgotten" and "call 5" in reply.error_message
    assert hbm_used(service) == 0
    assert service.counters["calls_refused_forgotten"] == 1
    # The heartbeat thread counts its call ids apart: one that matches a forgotten id still runs.
    assert call(service, Op.FORGET, c, {"call": 9}, call_id=7).ok
    assert call(service, Op.HEARTBEAT, c, call_id=9).ok
    assert call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=9).error_type == "CallForgotten"


def test_forget_keeps_a_bounded_memory(service):
    c = attach(service)
    for i in range(1, 3 * KEEP_CALLS):
        reply = call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=i)
        places = np.frombuffer(reply.arrays[0], dtype=P.PLACE_DTYPE)
        assert len(places) == 1 and call(service, Op.FREE, c, {}, vids_frame(places["vid"]), call_id=10_000 + i).ok
    for i in range(1, 3 * KEEP_FORGOTTEN):
        assert call(service, Op.FORGET, c, {"call": 100_000 + i}, call_id=50_000 + i).ok
    session = service.sessions[c]
    assert len(session.undo) == KEEP_CALLS and len(session.forgotten) == KEEP_FORGOTTEN
    # The oldest call is no longer kept: forgetting it undoes nothing (and says so).
    assert call(service, Op.FORGET, c, {"call": 1}, call_id=999).result == {"undone": False, "expired": True}
    assert len(session.expired) == 3 * KEEP_CALLS - 1 - KEEP_CALLS


def test_a_forget_of_a_call_that_ran_past_the_undo_window_says_it_expired(service, caplog):
    """It took the branch of a call that never arrived: answered undone=False, logged "it will not
    run" of a call that had run, noted to be refused (a later call of that id was), and the pin it
    handed out stayed held with no word (a review). Now the answer, and a warning, say it is held."""
    c = attach(service)
    vids = published(service, c, n=1)
    assert call(service, Op.ACQUIRE, c, {}, vids_frame(vids), call_id=5).ok  # ran: one pin
    for i in range(KEEP_CALLS):  # as many undoable calls after it (the engine's other threads, say)
        places = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=10 + i).arrays[0],
                               dtype=P.PLACE_DTYPE)
        assert call(service, Op.FREE, c, {}, vids_frame(places["vid"]), call_id=1000 + i).ok
    with caplog.at_level(logging.WARNING, logger="dflash2.daemon"):
        reply = call(service, Op.FORGET, c, {"call": 5}, call_id=2000)
    assert reply.ok and reply.result == {"undone": False, "expired": True}
    assert (f"client {c} gave up on its acquire (call 5), which ran and is too old to undo (past the client's "
            f"last {KEEP_CALLS} undoable calls") in caplog.text and "will not run" not in caplog.text
    assert 5 not in service.sessions[c].forgotten and pins(service) == 1  # held, as said
    assert call(service, Op.RELEASE, c, {}, vids_frame(vids), call_id=2001).ok
    again = call(service, Op.ACQUIRE, c, {}, vids_frame(vids), call_id=5)  # an id used again is not refused
    assert again.ok and pins(service) == 1
    service.manager.check_invariants()


def test_the_client_warns_of_a_forget_answered_expired(tmp_path, caplog):
    t = Transport(f"ipc://{tmp_path}/no-daemon.sock")
    try:
        t._note_forget(7, 5, None)
        (fid,) = t._forgets
        with caplog.at_level(logging.WARNING, logger="dflash2.client"):
            t._answered(P.Reply(fid, True, {"undone": False, "expired": True}))
        assert not t._forgets and "call 5, given up after a timeout, ran at dflash2d" in caplog.text
        assert "what it handed out may stay held until this client detaches" in caplog.text
    finally:
        t.close()


def test_an_undo_that_no_longer_applies_is_logged_not_raised(service, caplog):
    c = attach(service)
    places = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 2}, call_id=1).arrays[0],
                           dtype=P.PLACE_DTYPE)
    assert call(service, Op.FREE, c, {}, vids_frame(places["vid"]), call_id=2).ok
    reply = call(service, Op.FORGET, c, {"call": 1}, call_id=3)
    assert reply.ok and reply.result == {"undone": False}
    assert "giving back what it handed out failed" in caplog.text
    service.manager.check_invariants()


# -- end to end: a daemon that is only slow --------------------------------------------------
@pytest.fixture
def daemon(config_file, tmp_path):
    proc = DaemonProcess(config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})).start()
    yield proc
    proc.stop()


def _held(endpoint) -> tuple[int, int]:
    t = Transport(endpoint)
    try:
        st = t.call(Op.STATS).result
    finally:
        t.close()
    return st["tiers"]["hbm"]["blocks"], st["daemon"]["calls_undone"] + st["daemon"]["calls_refused_forgotten"]


@pytest.mark.parametrize("what, timeouts", [("allocate", 1), ("reserve", 1), ("allocate", 3)])
def test_a_timed_out_call_of_a_stopped_daemon_leaves_nothing_held(daemon, what, timeouts):
    """The daemon is stopped (SIGSTOP) while the calls are on their way, so the client times out;
    once it runs again, each call either runs and is given back, or arrives after its `forget` and
    is refused. Either way the client holds nothing it does not know of. With several timeouts in a
    row, each new socket carries every `forget` not yet answered: the earlier sockets' are lost."""
    c = Client.connect(daemon.endpoint, name="impatient", layouts=[SMALL], timeout_s=5.0, heartbeat=False)
    try:
        lid = c.layouts[0]
        assert _held(daemon.endpoint) == (0, 0)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            for _ in range(timeouts):
                with pytest.raises(DaemonUnavailable, match="asked it to give back whatever the call handed out"):
                    if what == "allocate":
                        c._call(Op.ALLOCATE, {"layout": lid, "n": 8}, timeout_s=0.3)
                    else:
                        c._call(Op.RESERVE, {"layout": lid, "tokens": 16 * 8}, timeout_s=0.3)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c.ping()  # on the socket the forgets went on, after them: their answers come first
        used, given_back = _held(daemon.endpoint)
        assert used == 0 and 1 <= given_back <= timeouts
        assert not c._transport._forgets, "every forget answered"
        assert c.allocate(lid, 2) is not None  # the client goes on as before
        assert _held(daemon.endpoint)[0] == 2
    finally:
        c.close()


@pytest.mark.parametrize("token", ["é" * 8, "\udcff", "0" * 31 + "G", "x" * P.TOKEN_CHARS])
def test_a_token_that_is_not_hex_is_refused_and_the_service_keeps_serving(service, token):
    c = attach(service)
    frames = P.encode_request(Op.HEARTBEAT, 1, c, {}, token=token)
    reply = P.decode_reply(service.handle_frames(frames))  # never raises
    assert not reply.ok and reply.error_type == "ProtocolError" and "header.token must be" in reply.error_message
    assert call(service, Op.HEARTBEAT, c).ok


def test_a_release_that_timed_out_leaves_no_view_by_vid(daemon):
    """It may have run: a block no longer pinned may move, so the client gives up its pin whatever
    the answer (a second release is how to be sure; NotOwner then says the daemon had let it go)."""
    c = Client.connect(daemon.endpoint, name="reader", layouts=[SMALL], timeout_s=5.0, heartbeat=False)
    try:
        keys = chain_keys(range(16), 16, "timed-out-release")
        [vid] = c.commit(c.allocate(c.layouts[0], 1)["vid"], keys=keys)
        c.free([vid])
        c.acquire([vid])
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            c._transport.timeout_s = 0.3
            with pytest.raises(DaemonUnavailable):
                c.release([vid])
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            c._transport.timeout_s = 5.0
        with pytest.raises(ArenaError, match="not being written or acquired"):
            c.view(int(vid))
        with pytest.raises(DaemonError, match="NotOwner"):
            c.release([vid])  # it had run once the daemon went on
    finally:
        c.close()


def test_a_commit_that_timed_out_leaves_no_view_by_vid(daemon):
    """It may have run: a committed block may move (under another client's reservation, say), and a
    view by vid would then read or write whatever lies in its old slot."""
    c = Client.connect(daemon.endpoint, name="writer", layouts=[SMALL], timeout_s=5.0, heartbeat=False)
    try:
        [vid] = c.allocate(c.layouts[0], 1)["vid"]
        c.view_bytes(int(vid))[:] = 7
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            c._transport.timeout_s = 0.3
            with pytest.raises(DaemonUnavailable):
                c.commit([vid], keys=chain_keys(range(16), 16, "timed-out-commit"))
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            c._transport.timeout_s = 5.0
        with pytest.raises(ArenaError, match="not being written or acquired"):
            c.view(int(vid))
        c.ping()  # on the socket the forget went on, after it
        assert _held(daemon.endpoint)[1] == 1  # run and given back, or refused when it came: either way ...
        with pytest.raises(DaemonError):
            c.free([vid])  # ... the writer holds nothing of it (cached with no reference, or freed)
    finally:
        c.close()


def test_many_calls_timed_out_at_once_are_all_given_back_and_repeats_change_nothing(service, caplog):
    """20 allocations that timed out on a stopped daemon, their forgets sent again on each new socket
    (so arriving before and after their calls, repeatedly): none of them leaves a block held. With 8
    kept on each side, the 9th left what it handed out held until detach (a review's script)."""
    import logging

    c = attach(service)
    ran = list(range(1, 11))      # ten arrived and ran before their forgets
    early = list(range(11, 21))   # ten whose forgets came first
    for i in ran:
        assert call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=i).ok
    forget_id = iter(range(1000, 10_000))
    with caplog.at_level(logging.INFO, logger="dflash2.daemon"):
        for _ in range(3):  # each forget sent again on each new socket
            for i in ran + early:
                assert call(service, Op.FORGET, c, {"call": i}, call_id=next(forget_id)).ok
    for i in early:
        assert call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=i).error_type == "CallForgotten"
    for i in ran + early:  # and once more after all that
        assert call(service, Op.FORGET, c, {"call": i}, call_id=next(forget_id)).result == {"undone": False}
    assert hbm_used(service) == 0
    assert service.counters["calls_undone"] == 10 and service.counters["calls_refused_forgotten"] == 10
    assert caplog.text.count("before it ran") == 10, "a repeat is not logged again"


def test_undos_hold_their_own_ids_and_a_bounded_number_of_them(service, monkeypatch):
    """An undo keeps its call's block ids as an array of its own, not a view of the request's frame
    (the lambdas kept every such call's whole request alive: 30-37 MB a client of 65,536-id calls, a
    soak), and a client's undos hold KEEP_UNDO_IDS ids at most together, the last call's always."""
    monkeypatch.setattr(forgetting, "KEEP_UNDO_IDS", 4)
    c = attach(service)
    for i in range(1, 5):
        assert call(service, Op.ALLOCATE, c, {"layout": 0, "n": 2}, call_id=i).result["allocated"]
    session = service.sessions[c]
    assert list(session.undo) == [3, 4] and session.undo_ids == 4
    for _, undo, _ in session.undo.values():
        assert [a.base for a in undo.args if isinstance(a, np.ndarray)] == [None]
    assert call(service, Op.FORGET, c, {"call": 4}, call_id=5).result == {"undone": True}
    assert list(session.undo) == [3] and session.undo_ids == 2
    big = call(service, Op.ALLOCATE, c, {"layout": 0, "n": 6}, call_id=6)  # more than the bound alone: kept
    assert big.result["allocated"] and list(session.undo) == [6] and session.undo_ids == 6
    assert call(service, Op.FORGET, c, {"call": 6}, call_id=7).result == {"undone": True}
    assert session.undo_ids == 0 and hbm_used(service) == 3 * 2  # calls 1 and 2 (pushed out) and 3 hold theirs


def test_a_process_that_proc_does_not_show_is_asked_by_a_signal(monkeypatch):
    """/proc mounted with hidepid=2 hides a process that is not dumpable, and a /proc from another
    pid namespace names other processes: a running client was taken for gone, its client detached
    and its blocks freed while it ran (a review's script, `unshare --pid --fork`). A pid that /proc
    does not show is asked by signal 0; a /proc that is not the daemon's namespace's is not read."""
    import builtins

    from dflash2.daemon import sessions

    real_open = builtins.open

    def hiding(path, *a, **kw):
        if str(path) == f"/proc/{os.getpid()}/stat":
            raise FileNotFoundError(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", hiding)
    assert sessions.pid_alive(os.getpid()), "running: /proc does not show it"
    assert not sessions.pid_alive(sessions.PID_MAX - 1), "no such process"
    monkeypatch.setattr(os, "readlink", lambda path: "1")  # /proc of another namespace
    assert sessions._own_procfs() is False


# -- a row reused past 2^31 times --------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 8, 9])
def test_a_row_reused_past_two_to_the_31_serves_calls_of_any_size(service, n):
    """Free rows are reused last in, first out, so one row takes an engine's churn of one-block
    requests (1,184 a second: 10-21 days to 2^31 reuses, a review's script). From generation 2^31
    its ids lie past 2^63: the reply of a call of 8 blocks or fewer failed with an OverflowError
    after the call had run, leaving the block or pin held under an id the client never learned."""
    m = service.manager
    c = attach(service)
    taken = m.table.cols.take_rows(n)  # the rows the next allocation takes, made to have been reused
    m.table.cols.give_rows(taken[::-1])
    m.table.cols.gen[taken] = 1 << 31  # as 2^31 - first_gen reuses leave them
    reply = call(service, Op.ALLOCATE, c, {"layout": 0, "n": n})
    assert reply.ok, reply.error_message
    places = np.frombuffer(reply.arrays[0], dtype=P.PLACE_DTYPE)
    assert (places["vid"] < 0).all() and sorted(m.table.rows(places["vid"]).tolist()) == sorted(taken.tolist())
    keys = np.asarray(chain_keys(range(16 * n), 16, "reused"), dtype=P.KEYS_DTYPE).tobytes()
    committed = call(service, Op.COMMIT, c, {}, [*vids_frame(places["vid"]), keys])
    assert committed.ok, committed.error_message
    assert np.frombuffer(committed.arrays[0], dtype=P.VIDS_DTYPE).tolist() == places["vid"].tolist()
    found = call(service, Op.LOOKUP, c, {"layout": 0}, [keys])
    assert found.ok, found.error_message
    got = np.frombuffer(found.arrays[0], dtype=P.PLACE_DTYPE)
    assert got["vid"].tolist() == places["vid"].tolist()
    acquired = call(service, Op.ACQUIRE, c, {}, vids_frame(got["vid"]))
    assert acquired.ok, acquired.error_message
    assert call(service, Op.RELEASE, c, {}, vids_frame(got["vid"])).ok
    m.check_invariants()
