"""The gate of a tcp endpoint: its request socket speaks CURVE as a server, and a ZAP handler (pyzmq's
authenticator, on a thread of its own) lets in only a client whose key is the key file's client key
(dflash2/tcpkeys.py). A refused connection never reaches the request loop.

Clients of the monitoring key file connect to a socket of their own (`secure(..., monitoring=True)`:
the port the daemon writes into that file at each start), which lets in that key alone, and which
the loop reads (`next_monitoring`) only while the monitoring calls have taken no more than
MONITOR_SHARE of its time, after a burst (`charge`: the whole turn of the loop each causes,
`begin_turn`): a monitoring user calling `check` (a walk of the whole table) or `history` (hours of
samples) back to back, or flooding the socket, would otherwise take the loop from the serving
processes; past it, their messages wait in ZeroMQ's queue at no cost to the loop. They are answered
only the calls of protocol.READ_ONLY (`refusal`). (The ZAP domains keep each key to its socket: the request socket
reads no key off its messages.)

Refusals are logged, at most one line a minute with their count (a port scan would otherwise fill
the log); those counted since the last line are logged once the minute has passed, even if no
refusal follows, and when the gate closes: those of the ZAP handler (a client key that is not the file's) and the handshakes that
fail before it is asked (another daemon's key file, one since made again, not a CURVE client),
which a monitor of the socket's events reports to a thread of the gate's own.

A connection that never speaks is dropped after HANDSHAKE_S (libzmq's default, 30 s, let a user
without the key hold a daemon descriptor per idle connection for that long: 1,000 of them took a
daemon's 1,024 and every new attach timed out, a review). Whoever reaches the port can still open
connections faster than that; the daemon's descriptor limit (raised at start-up) bounds them.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from dflash2 import protocol as P
from dflash2 import threads
from dflash2.errors import AccessDenied, DaemonUnavailable, DFlash2Error, ProtocolError
from dflash2.tcpkeys import DaemonKeys
from dflash2.zmqio import HANDSHAKE_FAILED, recv_frames

log = logging.getLogger("dflash2.daemon")

REFUSALS_LOGGED_EVERY_S = 60.0
HANDSHAKE_S = 2.0
# Calls over the monitoring key take at most this share of the loop's time, after a burst of
# MONITOR_BURST_S: past it their socket is not read until that is paid back.
MONITOR_SHARE = 0.05
MONITOR_BURST_S = 0.25
# The most the monitoring calls may owe: a minute's share past the burst (a message of millions of
# frames, or a flood, would otherwise keep every monitoring user waiting for many times its length).
MONITOR_OWED_MAX_S = MONITOR_BURST_S + 60 * MONITOR_SHARE
REQUEST_DOMAIN, MONITORING_DOMAIN = b"dflash2", b"dflash2-monitoring"  # (the ZAP domains of the two sockets)
MONITOR_HEADER_BYTES = 4096  # (ping, stats, history and check take headers of a few dozen bytes)
MONITOR_QUEUED = 8  # messages queued on a monitoring connection at most, beyond which it is not read


class ReadOnlyFrames(list):
    """A request's frames from the monitoring socket, which is answered only the calls of
    protocol.READ_ONLY."""

    received_s = 0.0  # how long receiving them took
    sock: zmq.Socket | None = None  # the socket they came by, which the reply goes out on


class KeyGate:
    def __init__(self, context: zmq.Context, keys: DaemonKeys, key_file: str):
        from zmq.auth.thread import ThreadAuthenticator

        self.keys = keys.keys
        self.monitor_public = keys.monitor_public
        self.request_port: int | None = None  # the request socket's port (the server's), which monitoring calls name
        self._monitor_owed_s = 0.0  # loop time the monitoring calls took beyond their share ...
        self._monitor_at = time.monotonic()  # ... as of then
        self.clock = time.perf_counter  # what a monitoring turn's length is read off (the tests' own)
        self._turn_at: float | None = None  # when the turn a monitoring message caused began, while it lasts
        self.key_file = key_file
        self._unlogged = 0
        self._last_why = ""
        self._logged_at = -REFUSALS_LOGGED_EVERY_S
        self._lock = threading.Lock()  # (the authenticator's and the monitor's threads count)
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("dflash2.daemon.zap"))
        with threads.stop_signals_blocked():  # (the stop signals stay the main thread's: threads.py)
            self._auth.start()
        for domain in (REQUEST_DOMAIN, MONITORING_DOMAIN):  # (the handler asks `callback` for each socket's)
            self._auth.configure_curve_callback(domain.decode(), credentials_provider=self)
        self._sock: zmq.Socket | None = None
        self._monitoring: zmq.Socket | None = None  # the monitoring key's socket (`secure`)
        self._monitors: list[tuple[zmq.Socket, bool]] = []  # each socket's events, and whether it is the monitoring one
        self._either: zmq.Poller | None = None  # both sockets (`wait`)
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    def secure(self, sock: zmq.Socket, monitoring: bool = False) -> None:
        """Make `sock` (before bind) a CURVE server with the file's server key that lets in the key
        file's client key, or with `monitoring` the monitoring key alone (the ZAP domain tells the
        handler which), whose failed handshakes a thread of the gate's counts (started with the
        monitoring socket's, which comes second). The monitoring socket takes small frames only (a
        larger one drops its sender: a message of 100 frames of 4 MiB, refused, took 400 MiB of the
        daemon's memory first, a review) and few messages queued."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.server_public)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.ZAP_DOMAIN, MONITORING_DOMAIN if monitoring else REQUEST_DOMAIN)
        # (each used by the watcher thread alone from here)
        self._monitors.append((sock.get_monitor_socket(HANDSHAKE_FAILED), monitoring))
        if not monitoring:
            self._sock = sock
            return
        sock.setsockopt(zmq.MAXMSGSIZE, MONITOR_HEADER_BYTES + 64)
        sock.setsockopt(zmq.RCVHWM, MONITOR_QUEUED)
        self._monitoring = sock
        self._watcher = threads.start(threading.Thread(target=self._watch, name="dflash2-tcp-gate", daemon=True))

    def wait(self, sock: zmq.Socket, timeout_ms: int) -> bool:
        """Whether a message came within `timeout_ms` on `sock` (the request socket), or on the
        monitoring socket while its calls owe the loop no more than their burst. A wake-up by the
        monitoring socket alone begins the turn that message causes (`begin_turn`); one that ends here."""
        self.end_turn()
        if self._monitoring is None or self._owed() > MONITOR_BURST_S:
            return bool(sock.poll(timeout_ms, zmq.POLLIN))
        if self._either is None:
            self._either = zmq.Poller()
            self._either.register(sock, zmq.POLLIN)
            self._either.register(self._monitoring, zmq.POLLIN)
        ready = dict(self._either.poll(timeout_ms))
        if self._monitoring in ready and sock not in ready:
            self._turn_at = self.clock()
        return bool(ready)

    def next_monitoring(self, most: int) -> "ReadOnlyFrames | None":
        """The next message on the monitoring socket, if one is queued and the monitoring calls owe
        the loop no more than their burst; else None (a message waits: it costs nothing until read)."""
        if self._monitoring is None or self._owed() > MONITOR_BURST_S:
            return None
        began = self.clock()
        try:
            frames = ReadOnlyFrames(recv_frames(self._monitoring, zmq.NOBLOCK, most))
        except zmq.Again:
            return None
        # (its receipt, whole: a message of millions of empty frames takes seconds; its turn counts it)
        frames.received_s = self.clock() - began
        frames.sock = self._monitoring
        return frames

    def refusal(self, frames: ReadOnlyFrames) -> list[bytes] | None:
        """The error reply to a monitoring-key call it may not make; None for one it may (or that does
        not decode: the service's reply says why, and runs nothing). Sized before it is read: a
        monitoring call is small (`MONITOR_HEADER_BYTES`, no array frames), and one that is not is
        refused without decoding it."""
        if len(frames) < 4:  # (peer id, magic, version, header): the protocol's own refusal says what is missing
            return None
        header = frames[3]
        small = len(frames) == 4 and len(header) <= MONITOR_HEADER_BYTES
        # (its own id, whatever its size: a frame here is at most a few KiB, and a refusal under id 0
        # never reached its call, which waited out its timeout, a review)
        call_id = P.peek_call_id(frames[1:])
        calls = ", ".join(sorted(o.value for o in P.READ_ONLY))
        if not small:
            return P.encode_reply(P.error_reply(call_id, AccessDenied(
                f"a call over the tcp endpoint's monitoring key ({calls}) has no array frames and a header of at "
                f"most {MONITOR_HEADER_BYTES} bytes; this one had {len(frames) - 1} frames, a header of "
                f"{len(header)} bytes")))
        try:
            req = P.decode_request(frames[1:], check_args=False)  # (refused by its op first: AccessDenied)
        except DFlash2Error:
            return None
        op, asked = req.op, req.args.get("request_port")
        if "request_port" in req.args and (type(asked) is not int or not 1 <= asked <= 65535):
            # (a string, a float or a list was answered as if it named this daemon, a bool or -1 told it
            # was a stale line of the key file: a review)
            return P.encode_reply(P.error_reply(call_id, ProtocolError(
                f"{op.value}: argument 'request_port' must be the tcp port (1-65535) of the daemon the call asks "
                f"about, got {asked!r}")))
        if frames.sock is not None and asked is not None and asked != self.request_port:
            return P.encode_reply(P.error_reply(call_id, DaemonUnavailable(
                f"this monitoring socket is the daemon's of port {self.request_port}, not port {asked}'s: the monitoring "
                f"key file's line for port {asked} is stale (a daemon killed before it could remove it), and no daemon "
                f"serving port {asked} has written one since: is it running?")))
        if op not in P.READ_ONLY:
            return P.encode_reply(P.error_reply(call_id, AccessDenied(
                f"{op.value}: this connection holds the tcp endpoint's monitoring key (the key file's .monitor), "
                f"which may call {calls} only; a serving process needs the key file itself ({self.key_file})")))
        return None

    def begin_turn(self, frames: ReadOnlyFrames) -> None:
        """A monitoring message is answered: the loop's turn is charged to the monitoring calls from its
        receipt on until `end_turn`, which the loop calls before it waits, steps or answers a request;
        so is the wake-up it caused (`wait`) with the request socket's read that finds nothing. Charged
        the receipt and the call alone, a flood of pings took the loop about twice what was charged:
        the wake-up, that read and the loop's checks after the call went uncounted (a review)."""
        self.end_turn()  # (one still open is charged as it stands: the receipt is this message's own)
        self._turn_at = self.clock() - frames.received_s
        frames.received_s = 0.0  # (charged with its turn: a parked call's next run is not charged for it again)

    def end_turn(self, close: bool = True) -> None:
        """Charge the turn a monitoring message caused (`begin_turn`) so far; without `close` it goes on
        (the loop's checks after the call are its too)."""
        if self._turn_at is not None:
            now = self.clock()
            self.charge(now - self._turn_at)
            self._turn_at = None if close else now

    def charge(self, seconds: float) -> None:
        """A monitoring-key message took `seconds` of the loop (its turn, or a part of it: `end_turn`)."""
        self._monitor_owed_s = min(MONITOR_OWED_MAX_S, self._owed() + seconds)

    def _owed(self) -> float:
        now = time.monotonic()
        self._monitor_owed_s = max(0.0, self._monitor_owed_s - (now - self._monitor_at) * MONITOR_SHARE)
        self._monitor_at = now
        return self._monitor_owed_s

    def _watch(self) -> None:
        poller = zmq.Poller()
        for monitor, _ in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if not ready:
                    self._log_unlogged(force=False)
                    continue
                for monitor, monitoring in self._monitors:
                    if monitor in ready and recv_monitor_message(monitor)["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                        # (the AUTH ones: counted by `callback`)
                        self._count(("at the monitoring socket, " if monitoring else "") + "whose handshake failed (a "
                                    "client with another daemon's key file, or one since made again, or not a CURVE "
                                    "client)")
        except zmq.ZMQError:
            pass  # (the context ends under it at shutdown)
        finally:
            for monitor, _ in self._monitors:
                monitor.close(0)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP handler's question: may a client with this (Z85) key connect to the socket of
        this domain?"""
        if domain == MONITORING_DOMAIN.decode():
            if client_key == self.monitor_public:
                return True
            self._count("whose client key is not the monitoring key file's (at the monitoring socket)")
            return False
        if client_key == self.keys.client_public:
            return True
        self._count("whose client key is not the one in the key file" + (
            " (it is the monitoring key file's, whose readers connect to the monitoring port written in that "
            "file)" if client_key == self.monitor_public else ""))
        return False

    def _count(self, why: str) -> None:
        with self._lock:
            self._unlogged += 1
            self._last_why = why
        self._log_unlogged(force=False)

    def _log_unlogged(self, force: bool) -> None:
        """The refusals counted since the last line, in one line: when a minute has passed since that
        one, or at once with `force` (the gate closes)."""
        with self._lock:
            now = time.monotonic()
            if self._unlogged and (force or now - self._logged_at >= REFUSALS_LOGGED_EVERY_S):
                log.warning("refused %d tcp connection%s since the last such line; the last %s (%s)", self._unlogged,
                            "" if self._unlogged == 1 else "s", self._last_why, self.key_file)
                self._unlogged, self._logged_at = 0, now

    def close(self) -> None:
        """Before the request socket closes: the monitoring socket closes here."""
        self._stop.set()
        for sock in (self._sock, self._monitoring):
            if sock is not None:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        else:  # (never started: the monitors are this thread's to close)
            for monitor, _ in self._monitors:
                monitor.close(0)
        if self._monitoring is not None:
            self._monitoring.close(0)
            self._monitoring = None
        self._auth.stop()
        self._log_unlogged(force=True)
