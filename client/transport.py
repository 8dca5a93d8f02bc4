"""One request/reply channel to dflash2d: a DEALER socket, call ids, a timeout on every call.

Replies are matched by call id. After a timeout the socket is thrown away and a new one made (a new
identity), so a late reply to the timed-out call can never be taken for the answer to a later one.
A timed-out call that hands its client something (protocol.UNDOABLE: blocks, a reservation, pins)
may still run in a daemon that was only slow; the client never learns what it got, so the new socket
first tells the daemon to `forget` the call: given back if it ran, refused if it arrives later. A
`forget` is sent again on every new socket until the daemon answers it: one queued on a socket that
the next timeout throws away would otherwise be lost with it. A commit's `forget` names the blocks
the commit named: the daemon frees those still being written when the commit has not run, as it may
never arrive (queued on a socket that had not connected yet, a stopped daemon's, it was lost with it).
A timed-out `release` or `free` (protocol.RETRIED: it gives something back) is sent again the same
way, as a `retry` naming it, until answered: the daemon runs it once (it notes the calls it ran), so
that a pin or a reference is given back, and never two (pins are counted per client: another
thread's would go). Both are bounded (MAX_FORGETS, MAX_RETRIES), logged when past them: the oldest
retry is dropped, and the second oldest forget (`_note_forget`). A call that finds no socket (none
could be made since a timeout) is noted so too, before its error.
A call waits in slices of GONE_CHECK_S and asks its `gone` test (the client's: nothing holds the
daemon's liveness object or segments any more) after each: a daemon killed while a call waits ends
the call at once instead of after the whole request_timeout_s.
A tcp endpoint's socket speaks CURVE with the keys of the daemon's key file (dflash2/tcpkeys.py);
a handshake the daemon refuses ends the call at once with AccessDenied (a monitor of the socket's
handshake events, read in the same slices).
Not thread-safe on its own: the client serialises calls with a lock, and the heartbeat thread has a
transport of its own (ZeroMQ sockets must not be shared between threads).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from dflash2.endpointlock import holder
from dflash2 import protocol as P
from dflash2.endpoints import tcp_key_path
from dflash2.errors import (AccessDenied, DaemonError, DaemonUnavailable, DFlash2Error, ProtocolError, UnreadableReply,
                            VersionMismatch)
from dflash2.tcpkeys import KeyFileError, load as load_keys, node_id
from dflash2.zmqio import HANDSHAKE_FAILED, NOBLOCK, descriptors_left, recv_frames, send_frames

log = logging.getLogger("dflash2.client")


# Descriptors a connect leaves free: ZeroMQ's I/O thread (made with the context's first socket), the
# call socket, the heartbeat's, the arena mappings' files, and a fresh socket after a timeout.
CONNECT_DESCRIPTORS = 16
# ... and over tcp, each socket's handshake monitor besides (an inproc pair: two more per socket; a
# client left with 16 attached, and its heartbeat's socket then could not connect: its lease lapsed).
TCP_CONNECT_DESCRIPTORS = 20


def check_descriptors(endpoint: str) -> None:
    """DaemonUnavailable when this process has too few descriptors left to connect: libzmq aborted
    the whole serving process (`Too many open files (src/epoll.cpp)`, exit 134) when its I/O thread
    found none, and raised a raw ZMQError when a socket found none."""
    left = descriptors_left()
    need = TCP_CONNECT_DESCRIPTORS if endpoint.startswith("tcp://") else CONNECT_DESCRIPTORS
    if left is not None and left[0] < need:
        raise DaemonUnavailable(f"cannot connect to {endpoint}: this process has {max(left[0], 0)} file descriptors "
                                f"left of its limit of {left[1]} and connecting needs {need} (raise "
                                "`ulimit -n`, or close files)")


def pid_namespace() -> int | None:
    """Inode of this process's pid namespace, sent at attach: when it equals the daemon's, the
    daemon can see at once that our pid is gone instead of waiting for the lease to lapse."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


# Unanswered `forget`s kept to send again (the daemon notes up to KEEP_FORGOTTEN, 1024, of those
# that come before their call, and can give back what any of its last KEEP_CALLS, 64, calls handed
# out: daemon/sessions.py; the forget of an older one that ran is answered `expired`, logged). At 8
# the oldest was dropped first: on a stopped daemon the oldest call is the one it receives (sent on
# the socket that had connected), and its blocks stayed held.
MAX_FORGETS = 256
# ... and the block ids of the commits among them, 2^20 ids (8 MiB) at most together, the newest
# first: past that, an older commit's forget goes without them (refused when it arrives, the commit
# frees them all the same; lost, its blocks stay the writer's).
MAX_FORGET_IDS = 1 << 20
# Unanswered releases and frees kept to send again (the daemon knows the last KEEP_RAN, 256, of each
# client's that ran: daemon/sessions.py), and their block ids, 2^20 (8 MiB) at most together, the
# newest kept: past either, the oldest is dropped, logged (its pins or references stay held until
# the client detaches).
MAX_RETRIES = 128
MAX_RETRY_IDS = 1 << 20
# Of those, at most this many are in flight on a socket at once; the next goes as each is answered.
# The daemon queues at most 64 replies for one connection, a burst as if none were read (daemon/
# server.py REPLIES_QUEUED_PER_PEER) and drops the rest: all of them sent in one go after a stall
# (up to 384) lost tens of their replies, and at times the reply to the call sent after them (a
# review's script: `ping` timed out on an idle daemon).
PENDING_IN_FLIGHT = 16
GONE_CHECK_S = 0.05  # a waiting call asks whether the daemon has ended this often (a flock test per mapping)
# (... by receiving with that timeout, the socket's RCVTIMEO: a poll before each receive cost a
# call a few microseconds more, pyzmq building a poller for it.)


def check_timeout(value) -> float:
    """A call's timeout: a number of seconds above 0, inf for none (0 or less gave each call about
    1 ms, a detach among them, whose session then held its blocks until its lease lapsed; NaN and a
    string failed deep in a lock or a comparison)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or math.isnan(value) or value <= 0:
        raise ValueError(f"timeout_s must be a number of seconds above 0 (inf: none), got {value!r}")
    return float(value)


class Transport:
    def __init__(self, endpoint: str, timeout_s: float = 5.0, *, context: zmq.Context | None = None,
                 version: int = P.VERSION, gone: Callable[[], bool] | None = None,
                 key_file: os.PathLike | None = None):
        """`key_file`: a tcp endpoint's (dflash2/tcpkeys.py; default: tcp-PORT.key in the runtime
        folder); AccessDenied when it cannot be read. Unused for an ipc endpoint."""
        self.endpoint = endpoint
        # (tcp_key_path: None for an ipc endpoint, whose socket's mode guards it)
        tcp = endpoint.startswith("tcp://")
        self.key_file = Path(key_file) if key_file is not None and tcp else tcp_key_path(endpoint)
        self._keys = None
        if self.key_file is not None:
            try:
                self._keys = load_keys(self.key_file)
            except KeyFileError as e:
                where = "" if key_file is not None else (
                    "; with no daemon.tcp_key_file this process looks in its own runtime folder ($XDG_RUNTIME_DIR/dflash2, "
                    "else /tmp/dflash2-$UID), which must be the daemon's: else name the daemon's file in daemon.tcp_key_file")
                raise AccessDenied(f"cannot attach to the tcp endpoint {endpoint}: {e}{where}") from None
        # Keys of the monitoring key file (this process may not read the key file): the daemon answers
        # it ping, stats, history and check only (tcpkeys.py). Its errors name that file.
        self.read_only = self._keys is not None and self._keys.read_only
        self._connect_to = endpoint
        # The request port a read-only transport names, whose monitoring port it looks up, and whose
        # daemon it must reach (`_check_answerer`).
        self._request_port = int(endpoint.rpartition(":")[2]) if self.read_only else None
        # The monitoring file's identity (inode, mtime) when `_follow_port` last read it (stat first,
        # then read: a change after the stat is read at the next call).
        self._monitoring_file = None
        if self.read_only:
            self.key_file = self._keys.path
            self._connect_to = self._monitoring_endpoint(self._keys)
        self._monitor: zmq.Socket | None = None  # a tcp socket's handshake events (_check_handshake)
        self.timeout_s = check_timeout(timeout_s)
        self.gone = gone  # whether the daemon has ended (None: no way to tell; calls wait out their timeout)
        self.version = version  # only tests speak another version
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self.taken = 0  # calls whose giving up (a forget, a retry) this transport has taken on
        self.token: str | None = None  # the session token attach returned, sent with every call
        # `forget` calls the daemon has not answered yet: their call id -> (client, the call forgotten,
        # a commit's block ids frame or None)
        self._forgets: dict[int, tuple[int, int, bytes | None]] = {}
        # `retry` calls the daemon has not answered yet: their call id -> (client, the release or free
        # timed out, its call id, its block ids frame)
        self._retries: dict[int, tuple[int, P.Op, int, bytes]] = {}
        # The `forget`s and `retry`s queued on this socket and not answered yet (PENDING_IN_FLIGHT):
        # those not among them go with the next call, or as these are answered.
        self._in_flight: set[int] = set()
        self._sock: zmq.Socket | None = None  # None once closed, or while a fresh one could not be made
        self._closed = False
        self._open()

    def _open(self) -> None:
        """A new socket; DaemonUnavailable when none can be made (no descriptor left: the ZMQError
        went to the caller raw, and left a closed socket behind that every later call tried to use)."""
        try:
            sock = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError as e:
            raise DaemonUnavailable(f"cannot make a socket for {self.endpoint}: {e}") from None
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # a tcp://[::1]:PORT endpoint (IPv4 ones still work)
        sock.setsockopt(zmq.RCVTIMEO, int(GONE_CHECK_S * 1000))
        try:
            if self._keys is not None:
                sock.setsockopt(zmq.CURVE_SERVERKEY, self._keys.server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.client_public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._keys.client_secret)
                self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
                self._failed_handshakes = 0
            sock.connect(self._connect_to)
        except zmq.ZMQError as e:
            self._close_socket(sock)
            raise DaemonUnavailable(f"cannot connect to {self.endpoint!r}: {e} (an endpoint is ipc://PATH or "
                                    "tcp://HOST:PORT)") from None
        self._sock = sock
        self._in_flight = set()  # (what went on the old socket goes again on this one)

    def _close_socket(self, sock: zmq.Socket, linger_s: float = 0.0) -> None:
        """`linger_s`: how long ZeroMQ may still send what the socket has queued (0: dropped at once; inf:
        until sent, in the background: the process's exit does not wait for it, as this context is not ended)."""
        if self._monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        sock.close(-1 if math.isinf(linger_s) else int(linger_s * 1000))

    def _check_handshake(self) -> None:
        """AccessDenied when the tcp daemon refused this socket's CURVE handshake: a wrong or stale key
        file, or a daemon without keys (a call waited out its whole timeout, blaming the daemon).
        A handshake failing without detail twice in a row is a server key that is not the daemon's, or
        a server without CURVE (which fails a try so too, or with a protocol error: timing decides).
        The socket goes (it would retry the handshake for ever); the call never reached the daemon."""
        if self._monitor is None:
            return
        why = None
        while why is None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = (f"refused this client's key: the {'monitoring ' if self.read_only else ''}key file's client "
                       "key is not the daemon's" + (" (made again since: its readers need the new file)"
                                                     if self.read_only else ""))
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = "does not speak CURVE (a dflash2d before tcp keys, or not a dflash2d)"
            else:
                self._failed_handshakes += 1
                if self._failed_handshakes >= 2:
                    why = ("did not accept this client's handshake: the key file holds another daemon's key (or "
                           "one since made again: its file was removed), or the server there does not speak CURVE "
                           "(a dflash2d before tcp keys, or not a dflash2d)")
        self._close_socket(self._sock)
        self._sock = None
        raise AccessDenied(f"dflash2d at {self.endpoint} {why} ({'monitoring ' if self.read_only else ''}key file "
                           f"{self.key_file})") from None

    def _monitoring_endpoint(self, keys) -> str:
        """Where the daemon at this endpoint answers the monitoring key: the port it wrote into the
        monitoring file for its request port. AccessDenied when there is none."""
        host = self.endpoint.rpartition(":")[0]
        port = keys.ports.get((node_id(), self._request_port))
        if port is None:
            raise AccessDenied(f"cannot connect to the tcp endpoint {self.endpoint}: the monitoring key file "
                               f"{self.key_file} names no monitoring port for port {self._request_port} of this node "
                               "(the daemon there writes it at each start and removes it as it stops: is it running?)")
        return f"{host}:{port}"

    def _follow_port(self) -> None:
        """A read-only transport's socket moves to the port now in the monitoring file, when the file
        has changed since it was read (a daemon restarted on this endpoint binds another)."""
        try:
            st = os.stat(self.key_file)
        except OSError:
            return  # (gone: the call says the daemon does not answer)
        if (st.st_ino, st.st_mtime_ns) == self._monitoring_file:
            return
        self._monitoring_file = (st.st_ino, st.st_mtime_ns)
        try:
            keys = load_keys(self.key_file)
            where = self._monitoring_endpoint(keys)
        except (KeyFileError, AccessDenied):
            return  # (kept as it was; a call that is not answered says so)
        if where != self._connect_to or keys != self._keys:  # (a new port, or new keys: made again)
            self._connect_to, self._keys = where, keys
            if self._sock is not None:  # (the call opens one to the new port)
                self._close_socket(self._sock)
                self._sock = None

    def _check_answerer(self, op: P.Op, reply: P.Reply) -> None:
        """A read-only call's answer, where it names the request port of the daemon that gave it (ping
        and stats do): DaemonUnavailable when that is not this endpoint's (a stale line in the
        monitoring file, and a daemon that does not check the port each call names: not this release)."""
        result = reply.result if isinstance(reply.result, dict) else {}
        daemon = result.get("daemon")
        serves = result.get("request_port", daemon.get("request_port") if isinstance(daemon, dict) else None)
        if isinstance(serves, int) and serves != self._request_port:
            raise DaemonUnavailable(f"{op.value}: the monitoring key file {self.key_file} sends port "
                                    f"{self._request_port}'s monitoring users to {self._connect_to}, where the daemon "
                                    f"of port {serves} "
                                    "answered: that line is stale (a daemon killed before it could remove it), and no "
                                    f"daemon serving {self.endpoint} has written one since: is it running?")

    def reset(self, linger_s: float = 0.0) -> None:
        """A fresh socket: whatever the old one still had coming is dropped with it (what it had queued
        to send too, unless `linger_s`). When none can be made (DaemonUnavailable), the next call makes
        it and sends the `forget`s first."""
        if self._sock is not None:
            self._close_socket(self._sock, linger_s)
            self._sock = None
        self._open()

    def let_go(self) -> None:
        """Close the socket, its daemon having ended; the next call makes a fresh one. Left open, ZeroMQ
        reconnected it to the next daemon on the endpoint without end: where that one's key file was made
        again, a failed handshake several times a second for as long as an idle client lived, each one
        counted in that daemon's refusals (a review)."""
        if self._sock is not None:
            self._close_socket(self._sock)
            self._sock = None

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._close_socket(self._sock)
            self._sock = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _unsent(self) -> bool:
        """Whether a `forget` or `retry` not yet answered is not in flight on this socket either."""
        return len(self._forgets) + len(self._retries) > len(self._in_flight)

    def _send_pending(self) -> bool:
        """Queue the `forget`s and `retry`s not yet answered nor in flight on this socket, without
        waiting, up to PENDING_IN_FLIGHT in flight: their answers are taken off as they come
        (`_answered`, which sends the next). False when they cannot even be queued."""
        if self._sock is None:
            return False
        try:
            for fid, (owner, call, written) in list(self._forgets.items()):
                if len(self._in_flight) >= PENDING_IN_FLIGHT:
                    return True
                if fid not in self._in_flight:
                    self._queue(self._forgets, fid, P.Op.FORGET, owner, {"call": call},
                                None if written is None else [written])
            for rid, (owner, op, call, vids) in list(self._retries.items()):
                if len(self._in_flight) >= PENDING_IN_FLIGHT:
                    return True
                if rid not in self._in_flight:
                    self._queue(self._retries, rid, P.Op.RETRY, owner, {"op": op.value, "call": call}, [vids])
        except zmq.ZMQError:
            return False
        except BaseException:  # (cut off between a message's frames: the socket would take the next frames as
            if self._sock is not None:  # its rest, a garbled request never answered nor sent again, a review)
                self._close_socket(self._sock)
                self._sock = None  # (the next call makes one, and sends them all again)
            raise
        return True

    def _queue(self, pending: dict, call_id: int, op: P.Op, client: int, args: dict, arrays) -> None:
        """Queue one pending `forget` or `retry` without waiting; one that cannot be encoded (a frame
        past what the daemon accepts) is dropped, logged: kept, it failed every later call."""
        try:
            frames = P.encode_request(op, call_id, client, args, arrays, version=self.version, token=self.token)
        except ProtocolError as e:
            del pending[call_id]
            log.warning("dflash2: a %s that cannot be sent to dflash2d at %s is dropped: %s", op.value, self.endpoint, e)
            return
        send_frames(self._sock, frames, NOBLOCK, copy=False)
        self._in_flight.add(call_id)

    def _answered(self, reply: P.Reply) -> None:
        """A reply to an earlier call: a `forget` or a `retry` the daemon has taken (one it refused, an
        older daemon's unknown op say, is logged: the call may not have run), or a late reply."""
        self._in_flight.discard(reply.call_id)
        forgot = self._forgets.pop(reply.call_id, None)
        if forgot is not None and reply.ok and reply.result.get("expired"):
            log.warning("dflash2: call %d, given up after a timeout, ran at dflash2d at %s and is too old to undo "
                        "(more of this client's calls that hand something out ran since than the daemon keeps): "
                        "what it handed out may stay held until this client detaches", forgot[1], self.endpoint)
        retried = self._retries.pop(reply.call_id, None)
        if retried is not None and not reply.ok:
            _, op, call, vids = retried
            log.warning("dflash2: the %s of %d blocks (call %d) sent again after a timeout was refused by dflash2d at "
                        "%s (%s: %s): what it gives back may stay held until this client detaches", op.value,
                        len(vids) // P.VIDS_DTYPE.itemsize, call, self.endpoint, reply.error_type, reply.error_message)

    def call(self, op: P.Op, client: int | None = None, args: dict | None = None,
             arrays: list[bytes] | None = None, timeout_s: float | None = None, waited_s: float = 0.0) -> P.Reply:
        """Send one request and wait for its reply. DaemonUnavailable on timeout, DaemonError (or
        VersionMismatch) on an error reply. `waited_s`: of the timeout, what the call already spent
        before it could be sent (behind other threads' calls on the same client)."""
        if self._closed:
            raise DaemonUnavailable(f"{op.value}: the connection to {self.endpoint} is closed")
        if self.read_only:
            self._follow_port()
            # The request port it asks about, which the daemon that answers checks against its own (a
            # line a killed daemon left may name a port another daemon holds now; checked by the
            # client once a socket, ZeroMQ's reconnects to a new holder of the port went unchecked).
            args = {**(args or {}), "request_port": self._request_port}
        if self._sock is None:  # the last fresh socket could not be made
            try:
                self._open()
            except DaemonUnavailable as e:
                # Never sent: what such a call needs is kept to go with the next call that makes a
                # socket, as for one that never came to be sent (`give_up_unsent`): a commit's
                # `forget` naming its blocks, a release's or free's `retry`; other calls handed
                # nothing out (a `forget` of each pushed real ones out, a review). Before, the call
                # was lost: a release's pins stayed held, a commit's blocks the writer's, until detach.
                raise DaemonUnavailable(f"{op.value}: {e}{self._keep_unsent(op, client, arrays)}") from None
            self._send_pending()
        elif self._unsent():  # noted since, or more than PENDING_IN_FLIGHT (`_send_pending`)
            self._send_pending()
        call_id = next(self._ids)
        try:
            # (In here: cut off before it is sent, it is given up as after a timeout, its forget or retry
            # noted; before, a commit's or release's was lost, what it named held until detach, a review.
            # Cut off before this, the caller keeps it to send later: `taken` says which.)
            self.taken += 1
            try:
                frames = P.encode_request(op, call_id, client, args, arrays, version=self.version, token=self.token)
            except ProtocolError as e:  # (nothing sent: raised here, as this call's own)
                raise ProtocolError(str(e)) from None
            timeout = self.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout - waited_s
            try:
                send_frames(self._sock, frames, copy=False)
            except zmq.ZMQError as e:
                # (Not sent: forgotten all the same, so that a commit's blocks are the writer's no more.)
                undo = self._give_up(op, client, call_id, arrays)
                raise DaemonUnavailable(f"{op.value}: cannot send to {self.endpoint}: {e}{undo}") from None
            while True:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    undo = self._give_up(op, client, call_id, arrays)
                    pid = holder(self.endpoint)
                    raise DaemonUnavailable(f"{op.value}: no reply from dflash2d at {self.endpoint} within "
                                            f"{timeout:g}s (" + ("daemon gone or stuck" if pid is None else
                                                               f"dflash2d pid {pid} holds the endpoint: stuck or busy, "
                                                               "or starting or stopping") + f"{undo}" + (
                                                "; or the monitoring key's calls have taken their share of the "
                                                "daemon's loop, and wait up to a minute" if self.read_only else "")
                                            + ")")
                sock = self._sock
                last = left_s < GONE_CHECK_S  # the call's last slice: no longer than what is left of it
                if last:
                    sock.setsockopt(zmq.RCVTIMEO, max(1, int(left_s * 1000)))
                try:
                    reply_frames = recv_frames(sock)
                except zmq.Again:
                    self._check_handshake()
                    if self.gone is not None and self.gone():
                        waited = timeout - (deadline - time.monotonic())
                        undo = self._give_up(op, client, call_id, arrays)
                        raise DaemonUnavailable(f"{op.value}: dflash2d at {self.endpoint} ended while this call "
                                                f"waited {waited:.2f}s for its reply (nothing holds its liveness "
                                                f"object or shared memory any more{undo})")
                    continue
                if last:
                    sock.setsockopt(zmq.RCVTIMEO, int(GONE_CHECK_S * 1000))
                try:
                    reply = P.decode_reply(reply_frames)
                except VersionMismatch as e:
                    raise VersionMismatch(f"{op.value}: {e}") from None
                except ProtocolError as e:
                    raise UnreadableReply(f"{op.value}: the reply from {self.endpoint} cannot be "
                                      f"read: {e}") from None
                if reply.call_id != call_id:
                    self._answered(reply)  # not ours: a `forget`'s, a `retry`'s, or a late reply
                    if self._unsent():
                        self._send_pending()
                    continue
                if not reply.ok:
                    if reply.error_type == "VersionMismatch":
                        raise VersionMismatch(f"dflash2d at {self.endpoint}: {reply.error_message}")
                    if reply.error_type == "DaemonUnavailable":  # (a call parked as the daemon stops)
                        raise DaemonUnavailable(f"{op.value}: dflash2d at {self.endpoint}: {reply.error_message}")
                    if reply.error_type == "AccessDenied":  # (a call the monitoring key may not make)
                        raise AccessDenied(f"dflash2d at {self.endpoint} refused {reply.error_message}")
                    raise DaemonError(reply.error_type, reply.error_message)
                if self.read_only:
                    self._check_answerer(op, reply)
                return reply
        except BaseException as e:
            if self.raised_here(e):
                raise
            # Cut off by an exception of the caller's while it waited (a request deadline's SIGALRM,
            # Ctrl-C): the call may still run, as after a timeout; given up so (a forget or retry,
            # a fresh socket, rid of any half-sent message). Before, what it handed out stayed held
            # under ids the engine never learned, for the client's life (a review).
            self._give_up(op, client, call_id, arrays)
            raise

    def raised_here(self, error: BaseException) -> bool:
        """Whether `error` is this transport's own answer to a call (raised by one of its methods), not
        an exception of the caller's that cut the call off: a signal handler's, whatever its class (a
        handler's call of the same client raises CallInProgress, of another client that one's errors:
        taken for this call's own, a release that had run was kept to send again, a review)."""
        if not isinstance(error, DFlash2Error):
            return False
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return tb is not None and tb.tb_frame.f_locals.get("self") is self

    def _give_up(self, op: P.Op, client: int | None, call_id: int, arrays: list[bytes] | None = None) -> str:
        """A call left unanswered: a fresh socket (a late reply can never be taken for a later call's),
        and, for a call that hands something out, a `forget` queued on it; for a release or free, a
        `retry` (module docstring). Returns what the error says of them ("" when none could be queued).
        They are noted before the fresh socket is made: when none can be (no descriptor left) they
        are sent by the call that makes one (before, they were lost, and the blocks stayed held until
        detach)."""
        undo, later = "", ""
        if op in P.UNDOABLE and client is not None:
            self._note_forget(client, call_id, arrays[0] if op == P.Op.COMMIT and arrays else None)
            undo = "; asked it to give back whatever the call handed out, should it run"
            later = ": the next call asks it to give back what this one handed out"
        elif op in P.RETRIED and client is not None and arrays:
            undo = self._note_retry(client, op, call_id, arrays[0])
            later = ": the next call sends it again"
        try:
            # A detach queued on a socket that had not connected (a fresh one, the daemon stopped) was
            # dropped with it: the daemon, run again, let the lease lapse and set the live process's
            # blocks aside for minutes, though it had closed (a review). It goes once the daemon runs;
            # not where the daemon has ended: lingering, it was kept for the process's life (a descriptor
            # each, Context.term() hung for good) and sent to the next daemon there, an error (a review).
            linger = op == P.Op.DETACH and not (self.gone is not None and self.gone())
            self.reset(math.inf if linger else 0.0)
        except DaemonUnavailable as e:
            return f"; no fresh socket ({e}){later if undo else ''}"
        if (self._forgets or self._retries) and not self._send_pending():
            undo = ""
        return undo

    def give_up_unsent(self, client: int, op: P.Op, vids: bytes) -> None:
        """A commit, release or free of `vids` (a block ids frame) that never came to be sent (it timed
        out waiting for the client's other calls), under a call id never sent: a commit's `forget`,
        so that the daemon frees its blocks as for one sent and lost, or the release or free as a
        `retry`; sent now, and on every new socket until answered."""
        self._keep_unsent(op, client, [vids])
        self._send_pending()

    def _keep_unsent(self, op: P.Op, client: int | None, arrays: list[bytes] | None) -> str:
        """Keep what a call that was never sent needs sent later (`give_up_unsent`'s rule); returns
        what its error says of it."""
        if client is None or not arrays or op not in (P.Op.COMMIT, *P.RETRIED):
            return ""
        if op == P.Op.COMMIT:
            self._note_forget(client, next(self._ids), arrays[0])
            return ": the next call that makes a socket asks it to free the blocks this commit named"
        return self._note_retry(client, op, next(self._ids), arrays[0]) + ": the next call that makes one sends it"

    def _note_retry(self, client: int, op: P.Op, call_id: int, vids: bytes) -> str:
        """Keep a release or free (`call_id`) to send again until answered (MAX_RETRIES, MAX_RETRY_IDS:
        past them the oldest is dropped, logged). Returns what the timed-out call's error says of it."""
        self._retries[next(self._ids)] = (client, op, call_id, vids)
        ids = sum(len(frame) for _, _, _, frame in self._retries.values()) // P.VIDS_DTYPE.itemsize
        while len(self._retries) > 1 and (len(self._retries) > MAX_RETRIES or ids > MAX_RETRY_IDS):
            oldest = next(iter(self._retries))
            self._in_flight.discard(oldest)
            _, old_op, old_call, frame = self._retries.pop(oldest)
            ids -= len(frame) // P.VIDS_DTYPE.itemsize
            log.warning("dflash2: the releases and frees that timed out unanswered by dflash2d at %s are more than "
                        "this client keeps to send again (%d, of %d block ids): the oldest, a %s of %d blocks (call %d), "
                        "is dropped: its pins or references stay held until this client detaches", self.endpoint,
                        MAX_RETRIES, MAX_RETRY_IDS, old_op.value, len(frame) // P.VIDS_DTYPE.itemsize, old_call)
        return f"; sent again on every new socket until it answers (it runs once), {len(self._retries)} such unanswered"

    def _note_forget(self, client: int, call_id: int, written: bytes | None) -> None:
        """Keep a `forget` of `call_id` to send until answered (MAX_FORGETS, MAX_FORGET_IDS). Past
        MAX_FORGETS the second oldest goes, logged: the oldest is the one call a stopped daemon
        receives (sent on the socket that had connected), so its `forget` is the one that counts; the
        later calls, lost with sockets that never connected, never run (dropping the oldest, past 256
        timeouts of a frozen daemon, left that call's blocks held with no word, a review)."""
        self._forgets[next(self._ids)] = (client, call_id, written)
        while len(self._forgets) > MAX_FORGETS:
            second = list(itertools.islice(self._forgets, 2))[1]
            self._in_flight.discard(second)
            _, lost_call, _ = self._forgets.pop(second)
            log.warning("dflash2: the calls that timed out unanswered by dflash2d at %s are more than this client "
                        "keeps `forget`s of (%d): that of call %d is dropped (should that call run late, what it "
                        "hands out stays held until this client detaches)", self.endpoint, MAX_FORGETS, lost_call)
        ids = 0
        for fid, (owner, call, frame) in reversed(list(self._forgets.items())):
            ids += 0 if frame is None else len(frame) // P.VIDS_DTYPE.itemsize
            if frame is not None and ids > MAX_FORGET_IDS:
                self._forgets[fid] = (owner, call, None)
                log.warning("dflash2: the commits that timed out unanswered by dflash2d at %s name more than %d "
                            "block ids together: the `forget` of commit %d goes without its %d (should that commit "
                            "never arrive, its blocks stay this client's to write until it detaches)", self.endpoint,
                            MAX_FORGET_IDS, call, len(frame) // P.VIDS_DTYPE.itemsize)
