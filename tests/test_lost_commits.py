"""A commit given up on (its client timed out) before it ran leaves the writer none of its blocks,
whether it arrives late or never (lost with a socket that never connected to a stopped daemon, or
never sent: it waited behind the client's other calls): its `forget` names the blocks, and those the
writer was still writing are freed (Client.commit, the sglang backend, rely on it). The late
commit's side of it: test_sessions.py."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from conftest import SMALL
from stall_helpers import behind_a_stalled_call
from test_sessions import _held, attach, call, daemon, hbm_used, published, service  # noqa: F401  (fixtures)

from dflash2 import protocol as P
from dflash2.client import Client, DaemonUnavailable, Transport, transport
from dflash2.daemon.service import Parked
from dflash2.errors import CopiesRunning
from dflash2.keys import chain_keys
from dflash2.protocol import Op


def test_a_forgotten_commit_that_never_arrives_frees_the_blocks_it_names(service):
    """A commit lost with its socket (queued on a fresh one while the daemon was stopped, dropped when
    that one was closed at the timeout) never arrives: its `forget` names the blocks, and those still
    the writer's, being written, are freed (one it pins at its release). Before, the forget noted the
    call alone, and the blocks stayed the writer's until it detached (a review's script)."""
    c, other = attach(service), attach(service, "other")
    vids = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 4}, call_id=1).arrays[0],
                         P.PLACE_DTYPE)["vid"].copy()
    assert call(service, Op.ACQUIRE, c, {}, [vids[3:].tobytes()], call_id=2).ok  # to read it after the commit
    theirs = service.manager.allocate(other, 0, 1)  # another writer's
    cached = published(service, c, n=1)  # committed: no longer being written
    stale = service.manager.allocate(c, 0, 1)
    service.manager.free(c, stale)
    named = np.concatenate([vids, theirs, cached, stale]).astype(P.VIDS_DTYPE)
    assert hbm_used(service) == 6
    assert call(service, Op.FORGET, c, {"call": 3}, [named.tobytes()], call_id=4).result == {"undone": False}
    assert hbm_used(service) == 3  # the pinned one, the other writer's and the cached one
    service.manager.check_invariants()
    assert call(service, Op.RELEASE, c, {}, [vids[3:].tobytes()], call_id=5).ok
    assert hbm_used(service) == 2
    keys = np.asarray(chain_keys(range(16 * 4), 16, "lost-commit"), P.KEYS_DTYPE)
    late = call(service, Op.COMMIT, c, {}, [vids.tobytes(), keys.tobytes()], call_id=3)  # (should it come after all)
    assert late.error_type == "CallForgotten" and hbm_used(service) == 2
    assert call(service, Op.FORGET, c, {"call": 3}, [named.tobytes()], call_id=4).ok  # a repeat changes nothing
    assert hbm_used(service) == 2 and len(service.manager.lookup(chain_keys(range(16), 16, "sessions"))) == 1
    service.manager.check_invariants()


@pytest.mark.parametrize("arrays, why", [([b"\0" * 7], "not a whole number"),
                                         ([b"", b""], "forget reads 1 array frame at most, got 2")])  # (protocol.ARRAYS)
def test_a_forget_with_a_bad_block_ids_frame_is_refused_and_forgets_nothing(service, arrays, why):
    c = attach(service)
    reply = call(service, Op.FORGET, c, {"call": 2}, arrays, call_id=3)
    assert reply.error_type == "ProtocolError" and why in reply.error_message
    assert call(service, Op.ALLOCATE, c, {"layout": 0, "n": 1}, call_id=2).ok, "not forgotten: it runs"


def test_a_late_commit_parked_on_copies_in_flight_stays_refused_when_run_again(service, monkeypatch):
    """Freeing its blocks met copies in flight (CopiesRunning: the server parks the call and runs it
    again, whole): the forgotten mark had gone first, and the commit ran on its second try."""
    c = attach(service)
    vids = np.frombuffer(call(service, Op.ALLOCATE, c, {"layout": 0, "n": 2}, call_id=1).arrays[0],
                         P.PLACE_DTYPE)["vid"].copy()
    assert call(service, Op.FORGET, c, {"call": 2}, call_id=3).ok  # (an older client's: no block ids)
    free, tries = service.manager.free, []

    def free_after_copies(client, ids):
        tries.append(len(ids))
        if len(tries) == 1:
            raise CopiesRunning()
        return free(client, ids)
    monkeypatch.setattr(service.manager, "free", free_after_copies)
    service.parking = True
    keys = np.asarray(chain_keys(range(16 * 2), 16, "parked-late-commit"), P.KEYS_DTYPE)
    frames = P.encode_request(Op.COMMIT, 2, c, {}, [vids.tobytes(), keys.tobytes()], token=service.sessions[c].token)
    parked = service.handle_frames(frames)
    assert isinstance(parked, Parked) and hbm_used(service) == 2
    reply = P.decode_reply(service.handle_frames(frames, again=parked))
    assert reply.error_type == "CallForgotten" and tries == [2, 2]
    assert hbm_used(service) == 0 and not service.manager.lookup(keys.tolist())
    service.manager.check_invariants()


def test_the_block_ids_of_forgets_waiting_to_be_sent_are_bounded(tmp_path, monkeypatch):
    """Past MAX_FORGET_IDS, the oldest commits' forgets go without their block ids (the forgets themselves stay)."""
    monkeypatch.setattr(transport, "MAX_FORGET_IDS", 3)
    t = Transport(f"ipc://{tmp_path}/no-daemon.sock")
    try:
        for call_id, n in ((1, 2), (2, 1), (3, 2)):
            t._note_forget(7, call_id, np.arange(n, dtype=P.VIDS_DTYPE).tobytes())
        assert [(call, frame is not None) for _, call, frame in t._forgets.values()] == [(1, False), (2, True), (3, True)]
    finally:
        t.close()


def test_a_commit_lost_on_a_stopped_daemon_leaves_none_of_its_blocks_held(daemon):
    """A call times out on a stopped daemon (the socket is made again), then a commit, on the fresh
    socket, which cannot connect to a daemon that does not run: closed at the timeout, it drops the
    commit unsent. Forgotten all the same, it leaves the writer nothing (Client.commit, the sglang
    backend): before, its blocks stayed the writer's for the process's life (a review's script)."""
    c = Client.connect(daemon.endpoint, name="writer", layouts=[SMALL], timeout_s=0.5, heartbeat=False)
    try:
        keys = chain_keys(range(16 * 4), 16, "lost-commit")
        vids = c.allocate(c.layouts[0], 4)["vid"]
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailable):
                c.lookup(keys[:1])
            with pytest.raises(DaemonUnavailable, match="asked it to give back"):
                c.commit(vids, keys=keys)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c.ping()  # on the socket the forgets went on, after them
        assert len(c.lookup(keys)) == 0, "the commit never ran"
        assert _held(daemon.endpoint)[0] == 0
    finally:
        c.close()


def test_a_commit_that_timed_out_behind_another_threads_call_leaves_none_of_its_blocks_held(daemon):
    """Never sent (it waited for the client's lock until its timeout), it sent no `forget` either:
    its blocks stayed the writer's. Its `forget` goes with the client's next call."""
    c = Client.connect(daemon.endpoint, name="writer", layouts=[SMALL], timeout_s=0.5, heartbeat=False)
    try:
        keys = chain_keys(range(16 * 2), 16, "unsent-commit")
        vids = c.allocate(c.layouts[0], 2)["vid"]
        with behind_a_stalled_call(daemon, c), pytest.raises(DaemonUnavailable, match="never sent"):
            c.commit(vids, keys=keys)
        c.ping()
        assert len(c.lookup(keys)) == 0 and _held(daemon.endpoint)[0] == 0
    finally:
        c.close()
