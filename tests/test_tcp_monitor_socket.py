"""A tcp endpoint's monitoring socket (daemon/keygate.py): monitoring-key clients connect to a port
of its own that each daemon writes into the monitoring file, which the loop reads only while their
calls have taken no more than their share, and which answers for its own daemon alone. Each test
stands for a hole a review found in an earlier version (on the shared request socket, a flood of
refused calls took 40-60% of the loop)."""

from __future__ import annotations

import dataclasses
import logging
import stat

import pytest
from monitor_helpers import daemon_at, monitoring_dealer, next_message, served
from test_tcp_keys import free_port

from dflash2 import protocol as P
from dflash2.client.transport import Transport
from dflash2.errors import DaemonUnavailable
from dflash2.tcpkeys import MonitorKeys, load, load_or_make, monitor_path, node_id, record_port


def test_the_monitoring_socket_is_not_read_while_its_calls_owe_the_loop(tmp_path, make_manager):
    """Calls over the monitoring key were answered on the serving processes' socket and refused once
    past their share, and the refusals themselves took the loop: a flood of pings took it 40-60% of
    the time (a review). They come by a socket of their own now, which the loop does not read while
    they owe it: a flood waits in ZeroMQ's queue at no cost to the loop."""
    import zmq

    from dflash2.daemon import keygate

    keys, srv = served(tmp_path, make_manager)
    ctx = zmq.Context()
    sock = monitoring_dealer(ctx, keys, srv.monitoring_port)
    try:
        gate = srv._gate
        sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        frames = next_message(gate)
        assert type(frames) is keygate.ReadOnlyFrames and frames.sock is not None
        srv._answer(frames)
        assert sock.poll(5000) and P.decode_reply(sock.recv_multipart()).ok  # answered on its own socket
        gate.charge(1.0)  # (a walk of a large table)
        sock.send_multipart(P.encode_request(P.Op.PING, 2, None))
        assert next_message(gate, within_s=1.0) is None  # owed: not read (it waits, queued)
        gate._monitor_owed_s = 0.0  # (paid back)
        frames = next_message(gate)
        assert frames is not None and P.decode_request(frames[1:]).call_id == 2
        gate.charge(3600.0)  # a flood: what it owes is capped, and so is the other monitoring users' wait
        assert gate._owed() <= keygate.MONITOR_OWED_MAX_S
    finally:
        sock.close(0)
        ctx.term()
        srv.close()


def test_the_request_socket_refuses_the_monitoring_key_and_the_monitoring_socket_the_key_files(tmp_path, make_manager):
    import zmq

    keys, srv = served(tmp_path, make_manager)
    ctx = zmq.Context()
    try:
        request_port = int(srv._sock.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
        wrong = monitoring_dealer(ctx, keys, request_port)  # the monitoring key at the request socket
        engine = ctx.socket(zmq.DEALER)  # the key file's at the monitoring socket
        engine.setsockopt(zmq.LINGER, 0)
        engine.setsockopt(zmq.CURVE_SERVERKEY, keys.keys.server_public)
        engine.setsockopt(zmq.CURVE_PUBLICKEY, keys.keys.client_public)
        engine.setsockopt(zmq.CURVE_SECRETKEY, keys.keys.client_secret)
        engine.connect(f"tcp://127.0.0.1:{srv.monitoring_port}")
        for sock in (wrong, engine):
            sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        assert next_message(srv._gate, within_s=1.0) is None
        with pytest.raises(zmq.Again):
            srv._sock.recv(zmq.NOBLOCK)
        wrong.close(0)
        engine.close(0)
    finally:
        ctx.term()
        srv.close()


def test_refused_and_oversized_monitoring_messages_are_charged_and_never_decoded(tmp_path, make_manager, monkeypatch):
    """Refused calls were decoded in full (headers up to 1 MB, twice) and never charged, nor was the
    receipt of a message of millions of frames: a monitoring-key holder took most of the loop (a
    review: 86% of the daemon's CPU)."""
    from dflash2.daemon import keygate

    keys, srv = served(tmp_path, make_manager)
    try:
        gate = srv._gate

        def message(op, header_pad=0, received_s=0.0):
            frames = keygate.ReadOnlyFrames([b"peer", *P.encode_request(op, 5, None, {"pad": "x" * header_pad})])
            frames.received_s = received_s
            return frames

        srv._answer(message(P.Op.ATTACH, received_s=0.1))  # refused (AccessDenied): its receipt is charged
        assert gate._owed() >= 0.1
        decoded = []
        with monkeypatch.context() as m:
            m.setattr(keygate.P, "decode_request", lambda frames: decoded.append(1))
            big = message(P.Op.STATS, header_pad=keygate.MONITOR_HEADER_BYTES)
            reply = P.decode_reply(gate.refusal(big))
        assert reply.error_type == "AccessDenied" and "a header of at most 4096 bytes" in reply.error_message
        assert decoded == []  # (refused unread)
        srv._answer(message(P.Op.STATS, received_s=1.0))  # answered, its receipt charged past the burst
        assert gate._owed() > keygate.MONITOR_BURST_S and gate.next_monitoring(64) is None
    finally:
        srv.close()


def test_a_monitoring_call_refused_for_its_size_is_answered_under_its_own_id(tmp_path, make_manager):
    """One with an array frame or a header over 4 KiB was refused under id 0, which its client dropped
    as not its own (it waited out its timeout), and one of two frames was told of arrays and header
    sizes it did not have (a review): its own id, and the protocol's own refusal for too few frames."""
    from dflash2.daemon import keygate

    _, srv = served(tmp_path, make_manager)
    try:
        def refusal(*frames):
            return srv._gate.refusal(keygate.ReadOnlyFrames([b"peer", *frames]))
        with_array = refusal(*P.encode_request(P.Op.PING, 8, None, {}), b"")
        padded = P.encode_request(P.Op.STATS, 9, None, {"pad": "x" * keygate.MONITOR_HEADER_BYTES})
        for frames, call_id in ((with_array, 8), (refusal(*padded), 9)):
            reply = P.decode_reply(frames)
            assert (reply.error_type, reply.call_id) == ("AccessDenied", call_id), reply
        assert refusal(P.MAGIC, P.VERSION_FRAME) is None
        reply = P.decode_reply(srv.service.handle_frames([P.MAGIC, P.VERSION_FRAME]))
        assert reply.error_type == "ProtocolError" and "at least 3 frames" in reply.error_message, reply
    finally:
        srv.close()


@pytest.mark.parametrize("request_comes", [False, True])
def test_the_whole_turn_a_monitoring_message_causes_is_charged_and_never_a_requests_call(
        tmp_path, make_manager, monkeypatch, request_comes):
    """Only a monitoring call's receipt and its answer were charged: the loop's wake-up it caused, the
    request socket's failed read after it and the loop's checks after the answer went uncounted, about
    as much again for a ping (a flood of pings took ~9% of the loop, charged 5%: a review). Each part
    takes a tick of the gate's clock here (the step 100): the turn is charged whole, from the
    wake-up to the loop's next wait, and neither the step nor a request read in that turn is."""
    import zmq

    from dflash2.daemon import keygate

    keys, srv = served(tmp_path, make_manager)
    ctx = zmq.Context()
    sock = monitoring_dealer(ctx, keys, srv.monitoring_port)
    gate, now, charged, woke = srv._gate, [0.0], [], []
    tick = 1 / 64  # (of the gate's clock: six of them stay within the burst, so the message is read at once)

    def taking(ticks, f):
        def part(*args, **kwargs):
            now[0] += ticks * tick
            return f(*args, **kwargs)
        return part

    def request_after_wake(flags=0):
        if request_comes and woke and not charged:  # (a request came between the wake-up and the read)
            return [b"peer", *P.encode_request(P.Op.PING, 9, None)]
        return srv_recv(flags)

    def call(frames, again=None):
        if P.peek_call_id(frames) == 9:
            now[0] += 50 * tick  # (the request's call)
        else:
            now[0] += tick
            srv.stop()  # (after this turn)
        return handle(frames, again)

    def wait(s, timeout_ms):
        ready = gate_wait(s, timeout_ms)
        woke.append(ready)
        return ready

    try:
        sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        assert gate._monitoring.poll(5000)  # (queued: it wakes the loop's first wait)
        srv_recv, handle, gate_wait = srv._recv, srv.service.handle_frames, gate.wait
        next_monitoring = gate.next_monitoring
        gate.clock = lambda: now[0]
        real_charge = gate.charge
        monkeypatch.setattr(gate, "charge", lambda seconds: (charged.append(seconds), real_charge(seconds)))
        monkeypatch.setattr(gate, "wait", wait)
        # (read once its message has woken the loop: the first turn steps, the second waits)
        monkeypatch.setattr(gate, "next_monitoring", lambda most: next_monitoring(most) if woke else None)
        monkeypatch.setattr(keygate, "recv_frames", taking(1, keygate.recv_frames))  # the receipt
        monkeypatch.setattr(srv, "_recv", taking(1, request_after_wake))  # the request socket's read
        monkeypatch.setattr(srv.service, "queue_empty", taking(1, srv.service.queue_empty))
        monkeypatch.setattr(srv.service, "handle_frames", call)
        monkeypatch.setattr(srv, "_draining", taking(1, srv._draining))  # the loop's checks after the call
        monkeypatch.setattr(srv, "_duel_pending", taking(1, srv._duel_pending))
        monkeypatch.setattr(srv, "_tick", taking(100, srv._tick))
        srv.serve_forever()
        assert woke[0] is True
        assert sock.poll(5000) and P.decode_reply(sock.recv_multipart()).ok
        # wake-up: the failed read and the empty queue (or the read of the request, not its call);
        # the message: its receipt and call; after it: the loop's two checks
        assert charged == [tick * n for n in ([1] if request_comes else [2]) + [2, 2]]
    finally:
        sock.close(0)
        ctx.term()
        srv.close()


def test_the_daemon_writes_its_monitoring_port_into_the_file_each_start_keeping_mode_and_group(tmp_path):
    key_file = tmp_path / "keys" / "node.key"
    monitor = monitor_path(key_file)
    port = free_port()
    mine = (node_id(), port)
    with daemon_at(tmp_path / "d", port, key_file, tmp_path / "run"):
        first = load(monitor).ports[mine]
        assert first != port
        monitor.chmod(0o640)
    assert mine not in load(monitor).ports  # removed at the clean stop
    with daemon_at(tmp_path / "d", port, key_file, tmp_path / "run"):
        assert stat.S_IMODE(monitor.stat().st_mode) == 0o640  # (rewritten with the new port, mode kept)
        now = load(monitor).ports[mine]
        assert f"port.{node_id()}.{port} = {now}" in monitor.read_text()
        transport = Transport(f"tcp://127.0.0.1:{port}", 5.0, key_file=monitor)
        try:
            assert transport.call(P.Op.PING).ok  # at the port written now
        finally:
            transport.close()


def test_two_daemons_sharing_a_key_file_each_answer_their_own_monitoring_users(tmp_path):
    """The monitoring file held one port, the last started daemon's: a monitoring user of the first
    was answered by the second, silently (a review)."""
    key_file = tmp_path / "keys" / "node.key"
    ports = [free_port(), free_port()]
    with daemon_at(tmp_path / "a", ports[0], key_file, tmp_path / "run") as pid_a, \
            daemon_at(tmp_path / "b", ports[1], key_file, tmp_path / "run") as pid_b:
        for port, pid in zip(ports, (pid_a, pid_b)):
            transport = Transport(f"tcp://127.0.0.1:{port}", 10.0, key_file=monitor_path(key_file))
            try:
                assert transport.call(P.Op.STATS).result["daemon"]["pid"] == pid
            finally:
                transport.close()
        assert sorted(load(monitor_path(key_file)).ports) == sorted((node_id(), p) for p in ports)


def test_a_second_daemon_on_the_same_port_number_at_another_address_says_it_takes_the_line(tmp_path):
    """A review: daemons on 127.0.0.1:P and 127.0.0.2:P sharing a key file (the default one is named
    by the port alone) share the monitoring file's line for P on this node: the second's start
    replaced the first's silently, and the first's monitoring users timed out as if it were stuck.
    The second's log now says so, naming the process that listens on the replaced port."""
    key_file = tmp_path / "keys" / "node.key"
    port = free_port()
    with daemon_at(tmp_path / "a", port, key_file, tmp_path / "run") as pid_a, \
            daemon_at(tmp_path / "b", port, key_file, tmp_path / "run", host="127.0.0.2"):
        said = (tmp_path / "b" / "daemon.log").read_text()
    assert f"for request port {port} on this node, where (pid {pid_a}: " in said, said[-3000:]
    assert "another dflash2d on this port number at another address, sharing the key file?" in said
    assert "for request port" not in (tmp_path / "a" / "daemon.log").read_text()


@pytest.mark.parametrize("between", ["nothing", "the key file removed"])
def test_a_monitoring_transport_follows_its_daemon_across_a_restart(tmp_path, between):
    """A restarted daemon binds another monitoring port: a monitoring transport kept connecting to the
    old one, and its calls timed out for good, while the key file's transport was answered; with the key
    file removed between (new keys, the monitoring file made again, its mode kept), it kept the old keys
    and was refused for good (reviews)."""
    key_file = tmp_path / "keys" / "node.key"
    port = free_port()
    with daemon_at(tmp_path / "d", port, key_file, tmp_path / "run") as first:
        transport = Transport(f"tcp://127.0.0.1:{port}", 5.0, key_file=monitor_path(key_file))
        assert transport.call(P.Op.STATS).result["daemon"]["pid"] == first
    if between == "the key file removed":
        key_file.unlink()
    try:
        with daemon_at(tmp_path / "d", port, key_file, tmp_path / "run") as second:
            assert transport.call(P.Op.STATS).result["daemon"]["pid"] == second
    finally:
        transport.close()


def test_a_monitoring_message_wakes_the_loops_wait(tmp_path, make_manager):
    """The loop waited on the request socket alone: a monitoring call on an idle daemon waited out
    its timeout (90-200 ms a call, a review)."""
    import zmq

    keys, srv = served(tmp_path, make_manager)
    ctx = zmq.Context()
    sock = monitoring_dealer(ctx, keys, srv.monitoring_port)
    try:
        assert not srv._gate.wait(srv._sock, 50)  # (nothing came)
        sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
        assert srv._gate.wait(srv._sock, 5000)
        srv._gate.charge(1.0)  # owed: the monitoring socket is left out of the wait
        assert not srv._gate.wait(srv._sock, 50)
    finally:
        sock.close(0)
        ctx.term()
        srv.close()


def test_a_stale_line_sending_monitoring_users_to_another_daemon_is_said(tmp_path):
    """A daemon killed before it could remove its line leaves a port the system may give another
    daemon's monitoring socket later: its monitoring users were answered by that daemon, its stats
    shown as theirs (a review). The client asks who answers first."""
    key_file = tmp_path / "keys" / "node.key"
    gone, there = free_port(), free_port()
    with daemon_at(tmp_path / "b", there, key_file, tmp_path / "run"):
        keys, _ = load_or_make(key_file)
        record_port(key_file, keys, gone, load(monitor_path(key_file)).ports[node_id(), there])  # (the killed one's)
        transport = Transport(f"tcp://127.0.0.1:{gone}", 5.0, key_file=monitor_path(key_file))
        try:
            for op in (P.Op.PING, P.Op.STATS):  # (each call is checked by the daemon that answers it)
                with pytest.raises(DaemonUnavailable, match=f"is the daemon's of port {there}, not port {gone}'s: the "
                                                            f"monitoring key file's line for port {gone} is stale"):
                    transport.call(op)
        finally:
            transport.close()


def test_the_monitoring_socket_drops_a_sender_of_a_large_frame(tmp_path, make_manager):
    """It took the request socket's frames of 4 MiB: one refused message of 100 of them took 400 MiB
    of the daemon's memory first (a review)."""
    import zmq

    from dflash2.daemon import keygate

    keys, srv = served(tmp_path, make_manager)
    ctx = zmq.Context()
    big = monitoring_dealer(ctx, keys, srv.monitoring_port)
    try:
        big.send_multipart([*P.encode_request(P.Op.PING, 1, None), b"x" * (keygate.MONITOR_HEADER_BYTES + 65)])
        assert next_message(srv._gate, within_s=1.0) is None  # (dropped with its connection, never queued)
        small = monitoring_dealer(ctx, keys, srv.monitoring_port)
        small.send_multipart(P.encode_request(P.Op.PING, 2, None))
        frames = next_message(srv._gate)
        assert frames is not None and P.decode_request(frames[1:]).call_id == 2
        small.close(0)
    finally:
        big.close(0)
        ctx.term()
        srv.close()


def test_a_failed_handshake_at_the_monitoring_socket_is_logged(tmp_path, make_manager, caplog):
    """Only the request socket's were watched: a client with another daemon's key at the monitoring
    port left no line (a review)."""
    import time as _time

    import zmq

    from dflash2.tcpkeys import TcpKeys

    keys, srv = served(tmp_path, make_manager)
    ctx = zmq.Context()
    other = TcpKeys.fresh()  # (another daemon's server key)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, other.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.monitor.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.monitor.client_secret)
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.daemon"):
            sock.connect(f"tcp://127.0.0.1:{srv.monitoring_port}")
            sock.send_multipart(P.encode_request(P.Op.PING, 1, None))
            deadline = _time.monotonic() + 10  # (the first refusal is logged at once; a later one at the close)
            while _time.monotonic() < deadline and "whose handshake failed" not in caplog.text \
                    and not srv._gate._unlogged:
                _time.sleep(0.05)
            srv.close()
        assert "at the monitoring socket, whose handshake failed" in caplog.text, caplog.text
    finally:
        sock.close(0)
        ctx.term()


def test_a_clean_stop_after_the_monitoring_file_was_removed_logs_no_error(tmp_path):
    """Removing the monitoring file to revoke its readers, as README says, made the next clean stop log
    an error with a traceback naming a lambda (a review)."""
    key_file = tmp_path / "keys" / "node.key"
    with daemon_at(tmp_path / "d", free_port(), key_file, tmp_path / "run"):
        monitor_path(key_file).unlink()
    log = (tmp_path / "d" / "daemon.log").read_text()
    assert "ERROR" not in log and "Traceback" not in log, log
    assert "the monitoring port's line is not removed" in log


def test_a_read_only_client_checks_the_port_a_ping_or_stats_answer_names(tmp_path):
    """Beside the daemon's check of the port each monitoring call names: an answer from a daemon that
    does not check it (not this release) is refused by the client where it names its request port."""
    path = tmp_path / "k.key.monitor"
    keys = dataclasses.replace(MonitorKeys.fresh(load_or_make(tmp_path / "k.key")[0].keys.server_public),
                               ports={(node_id(), 8): 9})
    path.write_text(keys.text())
    transport = Transport("tcp://127.0.0.1:8", 1.0, key_file=path)
    try:
        transport._check_answerer(P.Op.PING, P.Reply(1, True, {"request_port": 8}))  # (its own: fine)
        transport._check_answerer(P.Op.PING, P.Reply(1, True, {"version": 3}))  # (none named: fine)
        for result in ({"request_port": 7}, {"daemon": {"request_port": 7}}):
            with pytest.raises(DaemonUnavailable, match="where the daemon of port 7 answered: that line is stale"):
                transport._check_answerer(P.Op.STATS, P.Reply(1, True, result))
    finally:
        transport.close()


@pytest.mark.parametrize("bad", ["35201", 35201.0, [35201], True, -1, 0, 70000])
def test_a_request_port_that_is_no_port_number_is_refused_naming_the_argument(tmp_path, make_manager, bad):
    """A review: a monitoring call's request_port of "35201", 35201.0 or [35201] was answered as if it
    named this daemon (the stale-line check skipped), and True or -1 was told the key file's line was
    stale; a ProtocolError names the argument."""
    from dflash2.daemon import keygate

    keys, srv = served(tmp_path, make_manager)

    def ask(port):
        frames = keygate.ReadOnlyFrames([b"peer", *P.encode_request(P.Op.PING, 7, None, {"request_port": port})])
        frames.sock = srv._gate._monitoring
        refusal = srv._gate.refusal(frames)
        return P.decode_reply(refusal if refusal is not None else srv.service.handle_frames(frames[1:]))
    try:
        assert ask(srv.service.request_port).ok
        reply = ask(bad)
        assert not reply.ok and reply.error_type == "ProtocolError", (bad, reply)
        assert "argument 'request_port' must be the tcp port (1-65535)" in reply.error_message, reply.error_message
    finally:
        srv.close()
