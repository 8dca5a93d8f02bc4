"""A release or free its client timed out on (protocol.RETRIED) gives back what it held all the same:
the client sends it again, as a `retry`, on every new socket until the daemon answers, and the daemon
runs it once, whichever of the two arrives first. Before, one lost with a socket that never connected
to a stopped daemon left its pins or references held for the client's life (the sglang backend's
reads and writes, a review's scripts); and a second release, as the README advised, could drop
another thread's pin (pins are counted per client)."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest
from conftest import SMALL
from stall_helpers import behind_a_stalled_call
from test_sessions import attach, call, daemon, hbm_used, pins, published, service  # noqa: F401  (fixtures)

from dflash2 import protocol as P
from dflash2.client import Client, DaemonUnavailable, Transport, transport
from dflash2.daemon.service import Parked
from dflash2.daemon.sessions import KEEP_RAN
from dflash2.errors import CopiesRunning
from dflash2.keys import chain_keys
from dflash2.protocol import Op


def ids(vids) -> list[bytes]:
    return [np.asarray(vids, dtype=P.VIDS_DTYPE).tobytes()]


def refs(svc) -> int:
    return int(svc.manager.table.cols.refs.sum())


def retry(svc, client, op: str, call_id: int, vids, *, as_call: int):
    return call(svc, Op.RETRY, client, {"op": op, "call": call_id}, ids(vids), call_id=as_call)


@pytest.mark.parametrize("first", ["the call", "its retry"])
def test_a_release_and_its_retry_run_once_whichever_comes_first(service, first):
    """Two pins of one client on each block (two of its threads read them): the release of one, sent
    and sent again, leaves the other's."""
    c = attach(service)
    vids = published(service, c, n=2)
    for acquire in (1, 2):
        assert call(service, Op.ACQUIRE, c, {}, ids(vids), call_id=acquire).ok
    assert pins(service) == 4
    if first == "the call":
        assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=3).ok
        assert retry(service, c, "release", 3, vids, as_call=4).result == {"ran": False}
    else:
        assert retry(service, c, "release", 3, vids, as_call=4).result == {"ran": True}
        assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=3).ok  # late: answered, not run
    assert pins(service) == 2
    assert retry(service, c, "release", 3, vids, as_call=5).result == {"ran": False}  # a repeat on a newer socket
    assert pins(service) == 2
    assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=6).ok  # a new release runs
    assert pins(service) == 0
    service.manager.check_invariants()


@pytest.mark.parametrize("first", ["the call", "its retry"])
def test_a_free_and_its_retry_run_once_whichever_comes_first(service, first):
    c = attach(service)
    m = service.manager
    vids = m.commit(c, m.allocate(c, 0, 2), chain_keys(range(32), 16, "retried-free"))
    assert call(service, Op.ADD_REF, c, {}, ids(vids), call_id=1).ok  # a second request of the client shares them
    assert refs(service) == 4
    if first == "the call":
        assert call(service, Op.FREE, c, {}, ids(vids), call_id=2).ok and refs(service) == 2
        assert retry(service, c, "free", 2, vids, as_call=3).result == {"ran": False, "freed": 0}
    else:
        assert retry(service, c, "free", 2, vids, as_call=3).result["ran"] and refs(service) == 2
        assert call(service, Op.FREE, c, {}, ids(vids), call_id=2).result == {"freed": 0}
    assert refs(service) == 2 and len(m.lookup(chain_keys(range(32), 16, "retried-free"))) == 2
    m.check_invariants()


def test_a_retry_parked_on_copies_in_flight_runs_when_run_again(service, monkeypatch):
    """Parked (CopiesRunning), it changed nothing and was not noted as run: it runs on its second try,
    and the call arriving after it does not."""
    c = attach(service)
    m = service.manager
    vids = m.allocate(c, 0, 2)  # being written: a free frees them
    free, tries = m.free, []

    def free_after_copies(client, vids):
        tries.append(len(vids))
        if len(tries) == 1:
            raise CopiesRunning()
        return free(client, vids)
    monkeypatch.setattr(m, "free", free_after_copies)
    service.parking = True
    frames = P.encode_request(Op.RETRY, 3, c, {"op": "free", "call": 2}, ids(vids), token=service.sessions[c].token)
    parked = service.handle_frames(frames)
    assert isinstance(parked, Parked) and hbm_used(service) == 2
    assert P.decode_reply(service.handle_frames(frames, again=parked)).result == {"ran": True, "freed": 2}
    assert call(service, Op.FREE, c, {}, ids(vids), call_id=2).result == {"freed": 0}
    assert tries == [2, 2] and hbm_used(service) == 0


@pytest.mark.parametrize("first", ["the call", "its retry"])
def test_a_release_refused_is_answered_once_and_leaves_a_pin_taken_since(service, first):
    """Refused (NotOwner: the client held no pin then), it ran: run again, the other of the two would
    give up a pin another of the client's threads has taken since."""
    c = attach(service)
    vids = published(service, c, n=1)
    if first == "the call":
        assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=2).error_type == "NotOwner"
    else:
        assert retry(service, c, "release", 2, vids, as_call=4).error_type == "NotOwner"
    assert call(service, Op.ACQUIRE, c, {}, ids(vids), call_id=3).ok
    if first == "the call":
        assert retry(service, c, "release", 2, vids, as_call=4).result == {"ran": False}
    else:
        assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=2).ok
    assert pins(service) == 1


@pytest.mark.parametrize("args, arrays, why", [
    ({"op": "acquire", "call": 2}, ids([1]), "must be one of ['free', 'release']"),
    ({"op": "free"}, ids([1]), "missing argument 'call'"),
    ({"op": "free", "call": 2}, [], "one array frame"),
    ({"op": "free", "call": 2}, ids([1]) * 2, "retry reads 1 array frame at most, got 2"),
])
def test_a_malformed_retry_is_refused_by_name_and_notes_nothing(service, args, arrays, why):
    c = attach(service)
    vids = published(service, c, n=1)
    assert call(service, Op.ACQUIRE, c, {}, ids(vids), call_id=1).ok
    reply = call(service, Op.RETRY, c, args, arrays, call_id=3)
    assert reply.error_type == "ProtocolError" and why in reply.error_message
    assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=2).ok and pins(service) == 0


def test_the_calls_a_client_ran_are_kept_to_a_bound(service):
    c = attach(service)
    vids = published(service, c, n=1)
    for call_id in range(1, 2 * KEEP_RAN + 1, 2):
        assert call(service, Op.ACQUIRE, c, {}, ids(vids), call_id=call_id).ok
        assert call(service, Op.RELEASE, c, {}, ids(vids), call_id=call_id + 1).ok
    ran = service.sessions[c].ran
    assert len(ran) == KEEP_RAN and next(reversed(ran)) == 2 * KEEP_RAN


def test_a_retry_answered_as_run_stays_answered_after_the_call_left_the_daemons_note(service):
    """A review's script: a retry that found its release run answered {"ran": False}; sent again
    (its reply lost: the client sends it on every new socket until answered) after KEEP_RAN other
    releases, it ran, giving up the pin another thread still held."""
    c = attach(service)
    p, q = published(service, c, n=2)
    for acquire in (1, 2):  # two threads' pins on p
        assert call(service, Op.ACQUIRE, c, {}, ids([p]), call_id=acquire).ok
    assert call(service, Op.RELEASE, c, {}, ids([p]), call_id=3).ok
    assert retry(service, c, "release", 3, [p], as_call=4).result == {"ran": False}
    for call_id in range(10, 10 + 2 * KEEP_RAN + 2, 2):  # other reads, enough to push call 3 out of `ran`
        assert call(service, Op.ACQUIRE, c, {}, ids([q]), call_id=call_id).ok
        assert call(service, Op.RELEASE, c, {}, ids([q]), call_id=call_id + 1).ok
    assert 3 not in service.sessions[c].ran
    assert retry(service, c, "release", 3, [p], as_call=5000).result == {"ran": False}
    assert pins(service) == 1  # the other thread's
    assert call(service, Op.RELEASE, c, {}, ids([p]), call_id=5001).ok


# -- the client ------------------------------------------------------------------------------
def test_the_calls_waiting_to_be_sent_again_are_bounded_and_those_dropped_are_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(transport, "MAX_RETRIES", 2)
    monkeypatch.setattr(transport, "MAX_RETRY_IDS", 4)
    t = Transport(f"ipc://{tmp_path}/no-daemon.sock")
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.client"):
            for call_id, n in ((1, 1), (2, 1), (3, 1), (4, 4)):
                said = t._note_retry(7, Op.RELEASE, call_id, np.arange(n, dtype=P.VIDS_DTYPE).tobytes())
        assert [call for _, _, call, _ in t._retries.values()] == [4]  # 1 and 2 past the count, 3 past the ids
        assert "sent again on every new socket until it answers (it runs once)" in said
        dropped = [r.getMessage() for r in caplog.records]
        assert len(dropped) == 3 and all("stay held until this client detaches" in line for line in dropped)
        assert "a release of 1 blocks (call 1)" in dropped[0] and "(call 3)" in dropped[2]
    finally:
        t.close()


def _acquired_twice(c: Client, name: str):
    keys = chain_keys(range(16 * 2), 16, name)
    vids = c.commit(c.allocate(c.layouts[0], 2)["vid"], keys=keys)
    c.free(vids)
    c.acquire(vids)
    c.acquire(vids)  # two of the client's threads read the same blocks
    return keys, vids


@pytest.mark.parametrize("what", ["release", "free"])
def test_a_release_or_free_lost_on_a_stopped_daemon_runs_once_it_runs_again(daemon, what):
    """A call times out on a stopped daemon (the socket is made again), then the release or free, on
    the fresh socket, which cannot connect to a daemon that does not run: closed at the timeout, it
    drops the call unsent (a review's script: sglang's storage threads, one lookup and one release)."""
    c = Client.connect(daemon.endpoint, name="reader", layouts=[SMALL], timeout_s=0.5, heartbeat=False)
    try:
        keys, vids = _acquired_twice(c, f"lost-{what}")
        if what == "free":
            c.add_ref(vids)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailable):
                c.lookup(keys[:1])
            with pytest.raises(DaemonUnavailable, match="sent again on every new socket until it answers"):
                getattr(c, what)(vids)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c.ping()  # on the socket the retry went on, after it
        assert not c._transport._retries, "the retry was answered"
        released = c.detach()
        assert released["unpinned"] == (2 if what == "release" else 4)
        assert released["dereferenced"] == 0
    finally:
        c.close()


def test_a_release_that_timed_out_behind_another_threads_call_is_sent_with_the_next(daemon):
    """Never sent (it waited for the client's lock until its timeout): it goes with the next call."""
    c = Client.connect(daemon.endpoint, name="reader", layouts=[SMALL], timeout_s=0.5, heartbeat=False)
    try:
        _, vids = _acquired_twice(c, "unsent-release")
        with behind_a_stalled_call(daemon, c), pytest.raises(DaemonUnavailable, match="never sent .*the next call sends it"):
            c.release(vids)
        c.ping()
        assert c.detach()["unpinned"] == 2
    finally:
        c.close()
