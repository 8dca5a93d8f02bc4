"""Service without sockets: leases lapse on a fake clock, and what a lapsed client held is kept out of
reuse (set aside) or freed (moved out of test_service_bad_input.py, whose helpers it uses)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import zmq
from conftest import SMALL
from test_service_bad_input import attach, call, token_of
from test_service_bad_input import service  # noqa: F401,F811 (a fixture, used by name)

from dflash2 import protocol as P
from dflash2.client import Transport
from dflash2.daemon.service import Service
from dflash2.keys import chain_keys
from dflash2.protocol import Op
from dflash2.reservations import AdmissionSettings


def test_lease_lapses_and_dead_pids_are_noticed(service, clock):
    from dflash2.daemon.sessions import pid_namespace

    quiet = attach(service, "quiet", pid=4242)
    dying = attach(service, "dying", pid=4343, pid_ns=pid_namespace())
    keys = chain_keys(range(32), 16, "lease")
    placed = np.frombuffer(call(service, Op.ALLOCATE, dying, {"layout": 0, "n": 2}).arrays[0], P.PLACE_DTYPE)
    published = np.frombuffer(call(service, Op.COMMIT, dying, {}, [placed["vid"].tobytes(),
                                    np.asarray(keys, P.KEYS_DTYPE).tobytes()]).arrays[0], P.VIDS_DTYPE)
    call(service, Op.ACQUIRE, dying, {}, [published.tobytes()])
    assert call(service, Op.RESERVE, dying, {"layout": 0, "tokens": 32}).result["outcome"] == "granted"
    service.dead_pids.add(4343)
    assert service.expire_leases() == [dying]  # a dead pid in our namespace: at once
    assert len(np.frombuffer(call(service, Op.LOOKUP, quiet, {}, [np.asarray(keys, P.KEYS_DTYPE).tobytes()])
                             .arrays[0], P.PLACE_DTYPE)) == 2  # published blocks stay
    assert call(service, Op.STATS).result["reservations"]["granted"] == 0
    clock.advance(10.5)
    assert service.expire_leases() == [quiet]  # a silent one: after the lease timeout
    assert call(service, Op.HEARTBEAT, quiet).error_type == "UnknownClient"
    assert call(service, Op.CHECK).ok


def _sessions_one_by_one(service, clock, n: int) -> tuple[list[int], int]:
    """A process that attaches a session per request and drops each (no detach, no heartbeat), its pid
    in the daemon's namespace and alive: `n` sessions lapse one at a time, oldest first, then it attaches
    once more. (Its sessions, and the last one.)"""
    from dflash2.daemon.sessions import pid_namespace

    clients = []
    for i in range(n):
        clients.append(attach(service, f"req{i}", pid=os.getpid(), pid_ns=pid_namespace()))
        clock.advance(0.1)
    clock.advance(service.lease_timeout_s - n * 0.1)
    for _ in range(n + 5):
        clock.advance(0.1)
        service.expire_leases()
    return clients, attach(service, "again", pid=os.getpid(), pid_ns=pid_namespace())


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_sessions_of_one_process_set_aside_one_by_one_say_so_a_line_each(make_manager, clock, caplog, share):
    """Each lapse carried the set-aside session into every later one's share with a line each, 740,000
    lines (128 MB of log) for 1,664 sessions in 50 s, and each attach listed every earlier set-aside
    session (a review). A line a lapse, and an attach's line of bounded length; under a share < 1 the
    shares carry as before, and under a whole share, where no share is enforced, nothing is carried
    (N^2 entries: 5,000 sessions, +50 MB) nor said."""
    svc = Service(make_manager(hbm_blocks=16, dram_blocks=16, admission=AdmissionSettings(max_client_share=share)),
                  lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock, pid_alive=lambda pid: True)
    n = 40
    with caplog.at_level("INFO", logger="dflash2.daemon"):
        clients, again = _sessions_one_by_one(svc, clock, n)
    assert not svc.sessions.keys() - {again}
    carried = [r.getMessage() for r in caplog.records if "count against" in r.getMessage()]
    shares = svc.manager.admission.shares
    if share == 1.0:
        assert not carried and not shares._carried
    else:
        assert 0 < len(carried) <= n + 1, len(carried)  # (n * (n - 1) / 2 before)
        assert max(map(len, carried)) < 400, max(carried, key=len)
        assert shares._carried[again] == set(clients)  # the new session carries every set-aside one
    assert call(svc, Op.CHECK).ok


def _hbm_free(svc) -> int:
    hbm = call(svc, Op.STATS).result["tiers"]["hbm"]
    return hbm["capacity_bytes"] - hbm["used_bytes"]


@pytest.mark.parametrize("pid_ns", ["ours", "another"])
def test_a_lapsed_client_whose_process_may_run_keeps_its_private_blocks_out_of_reuse(service, clock, pid_ns):
    """A client that stopped answering but whose process lives (or cannot be seen: another pid
    namespace) may resume the writes it was making into its allocated blocks. Freed at once, their
    slots went to other blocks, which the resumed writes then overwrote: cached blocks every client
    read as hits (soak 2: 16 of 16 wrong in a repro). They stay set aside until the process is gone,
    or `daemon.set_aside_leases` (30) leases; its references to what it published are released as
    before, and its pins are kept as long (a resumed reader: test_stalled_reader.py)."""
    from dflash2.daemon.sessions import pid_namespace

    ns = pid_namespace() if pid_ns == "ours" else None
    stalled = attach(service, "stalled", pid=4444, pid_ns=ns)
    keys = chain_keys(range(32), 16, "kept")
    placed = np.frombuffer(call(service, Op.ALLOCATE, stalled, {"layout": 0, "n": 2}).arrays[0], P.PLACE_DTYPE)
    published = np.frombuffer(call(service, Op.COMMIT, stalled, {}, [placed["vid"].tobytes(),
                                    np.asarray(keys, P.KEYS_DTYPE).tobytes()]).arrays[0], P.VIDS_DTYPE)
    call(service, Op.ACQUIRE, stalled, {}, [published.tobytes()])
    writing = np.frombuffer(call(service, Op.ALLOCATE, stalled, {"layout": 0, "n": 3}).arrays[0], P.PLACE_DTYPE)
    free_before = _hbm_free(service)
    clock.advance(10.5)
    assert service.expire_leases() == [stalled]
    assert call(service, Op.HEARTBEAT, stalled).error_type == "UnknownClient"
    st = call(service, Op.STATS).result
    assert st["set_aside"] == {"clients": 1, "blocks": 3, "pinned": 2}, st["set_aside"]
    assert _hbm_free(service) == free_before, "the blocks it was writing stay taken"
    other = attach(service, "other", pid=0)
    got = np.frombuffer(call(service, Op.ALLOCATE, other, {"layout": 0, "n": 13}).arrays[0], P.PLACE_DTYPE)
    assert not set(got["offset"].tolist()) & set(writing["offset"].tolist()), "a set-aside slot was reused"
    assert call(service, Op.CHECK).ok
    free_then = _hbm_free(service)

    def later(seconds):  # `other` keeps its lease
        clock.advance(seconds)
        call(service, Op.HEARTBEAT, other)
        service.expire_leases()
    if pid_ns == "ours":
        later(10.0)
        assert call(service, Op.STATS).result["set_aside"]["clients"] == 1, "its process still runs"
        service.dead_pids.add(4444)  # ... until it is gone
        later(0.0)
    else:
        for _ in range(30 - 1):
            later(10.0)
        later(9.0)
        assert call(service, Op.STATS).result["set_aside"]["clients"] == 1, "cannot be seen: held a while"
        later(1.0)
    assert call(service, Op.STATS).result["set_aside"] == {"clients": 0, "blocks": 0, "pinned": 0}
    assert _hbm_free(service) == free_then + 3 * SMALL.block_bytes
    assert call(service, Op.CHECK).ok


def test_set_aside_leases_0_frees_a_lapsed_clients_blocks_at_once(make_manager, clock):
    svc = Service(make_manager(hbm_blocks=16), lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock,
                  pid_alive=lambda pid: True, set_aside_leases=0)
    stalled = attach(svc, "stalled", pid=4646)
    call(svc, Op.ALLOCATE, stalled, {"layout": 0, "n": 3})
    clock.advance(10.5)
    assert svc.expire_leases() == [stalled]
    assert call(svc, Op.STATS).result["set_aside"] == {"clients": 0, "blocks": 0, "pinned": 0}
    assert call(svc, Op.STATS).result["tiers"]["hbm"]["used_bytes"] == 0


def test_a_lapsed_client_whose_process_is_gone_is_freed_at_once(service, clock):
    from dflash2.daemon.sessions import pid_namespace

    gone = attach(service, "gone", pid=4545, pid_ns=pid_namespace())
    call(service, Op.ALLOCATE, gone, {"layout": 0, "n": 3})
    service.dead_pids.add(4545)
    assert service.expire_leases() == [gone]
    assert call(service, Op.STATS).result["set_aside"] == {"clients": 0, "blocks": 0, "pinned": 0}
    assert call(service, Op.STATS).result["tiers"]["hbm"]["used_bytes"] == 0


@pytest.mark.parametrize("where", ["call", "after_reply"])
def test_a_call_longer_than_the_lease_expires_nobody(service, clock, tmp_path, monkeypatch, where):
    """A call that runs past the lease (a large promotion from NVMe), or the work after its reply (a
    reader's prefetch window): neither its own client nor one whose heartbeat queued up meanwhile
    may lapse. The clock is the service's fake one; the stall advances it and holds the server until
    the other client's heartbeat is waiting on its socket. The call is read by the drain before a
    due step, whose time budget it overruns, so the step runs with the heartbeat still queued (a
    lease credit capped at one lease lapsed that client)."""
    from dflash2.daemon import server as server_mod
    from dflash2.daemon.server import Server

    monkeypatch.setattr(server_mod, "DRAIN_BUDGET_TICKS", 0.0)
    server = Server(service, f"ipc://{tmp_path}/d.sock", tick_interval_s=1e-6)
    slow, waiting = attach(service, "slow", pid=1), attach(service, "waiting", pid=2)
    plain = service._handlers[Op.LOOKUP]

    def stall():
        assert server._sock.poll(10_000, zmq.POLLIN), "the heartbeat never reached the daemon"
        clock.advance(3 * service.lease_timeout_s)

    def long_call(req):
        if where == "call":
            stall()
        return plain(req)

    prefetch, stalled = service.manager.run_prefetch, []

    def long_prefetch():
        if where == "after_reply" and service.counters["requests"] >= 4 and not stalled:
            stalled.append(1)
            stall()
        prefetch()

    service._handlers[Op.LOOKUP] = long_call
    monkeypatch.setattr(service.manager, "run_prefetch", long_prefetch)
    # A window is due after every reply (the service runs the prefetch only then).
    monkeypatch.setattr(type(service.manager.prefetcher), "due", property(lambda self: True))
    # One peer queues a ping and then the long call before the loop starts (one pipe: in that
    # order): the loop's first receive answers the ping, the drain before the due step the call.
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.connect(server.endpoint)
    peer.send_multipart(P.encode_request(Op.PING, 1, None, {}))
    peer.send_multipart(P.encode_request(Op.LOOKUP, 2, slow, {}, [b""], token=token_of(service, slow)))
    time.sleep(0.2)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    b = Transport(server.endpoint, timeout_s=10.0)
    b.token = token_of(service, waiting)
    try:
        thread.start()
        while service.counters["requests"] < 4:  # two attaches, the ping, then the long call has begun
            time.sleep(0.001)
        assert b.call(Op.HEARTBEAT, waiting).ok
        replies = [P.decode_reply(peer.recv_multipart()) for _ in range(2) if peer.poll(10_000)]
        assert [r.ok for r in replies] == [True, True]
        server.stop()
        thread.join()
    finally:
        server.stop()
        b.close()
        peer.close(0)
        ctx.term()
        server.close()
    assert service.counters["leases_expired"] == 0
    assert set(service.sessions) == {slow, waiting}


def test_a_lease_credit_covers_the_longest_call_and_one_lease_more(service, clock):
    quiet = attach(service, "quiet", pid=1)
    clock.advance(45.0)  # lease 10 s: silent for 45 s, the queue last empty 45 s ago
    assert service.expire_leases(behind_s=45.0, longest_call_s=40.0) == []  # held up by a 40 s call
    # A 20 s call: judged as of 30 s ago (the call and a lease), silent 15 s before then.
    assert service.expire_leases(behind_s=45.0, longest_call_s=20.0) == [quiet]
