"""Calls lost before the daemon answers, in the client's transport: more timeouts than it keeps
`forget`s of, on a stopped daemon, and a call that finds no socket (the last fresh one could not be
made). A review found both left things held with no word: the forget dropped past MAX_FORGETS was the
oldest, the one call a stopped daemon receives; and a release or commit that found no socket was
neither sent nor kept to send again (pins held, blocks the writer's, until detach)."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest
from conftest import SMALL
from test_sessions import _held, daemon  # noqa: F401  (fixture)

from dflash2 import protocol as P
from dflash2.client import Client, DaemonUnavailable, Transport, transport
from dflash2.errors import DaemonError, ProtocolError
from dflash2.keys import chain_keys
from dflash2.protocol import Op


def test_past_max_forgets_the_oldest_forget_stays_and_the_drop_is_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(transport, "MAX_FORGETS", 3)
    t = Transport(f"ipc://{tmp_path}/no-daemon.sock")
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.client"):
            for call_id in range(1, 6):
                t._note_forget(7, call_id, None)
        assert [call for _, call, _ in t._forgets.values()] == [1, 4, 5]
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "that of call 2 is dropped" in said[0] and "call 3" in said[1]
    finally:
        t.close()


def test_dropping_a_commits_block_ids_is_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(transport, "MAX_FORGET_IDS", 3)
    t = Transport(f"ipc://{tmp_path}/no-daemon.sock")
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2.client"):
            for call_id, n in ((1, 2), (2, 2)):
                t._note_forget(7, call_id, np.arange(n, dtype=P.VIDS_DTYPE).tobytes())
        assert "the `forget` of commit 1 goes without its 2" in caplog.text
    finally:
        t.close()


def test_more_timeouts_than_forgets_kept_on_a_stopped_daemon_leave_nothing_held(daemon, monkeypatch):
    """The first call goes on the socket that had connected, and runs once the daemon does; the
    others are lost with sockets that never connected. Its `forget` must be among those kept."""
    monkeypatch.setattr(transport, "MAX_FORGETS", 4)
    c = Client.connect(daemon.endpoint, name="impatient", layouts=[SMALL], timeout_s=0.05, heartbeat=False)
    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            for _ in range(transport.MAX_FORGETS + 2):
                with pytest.raises(DaemonUnavailable):
                    c._call(Op.ALLOCATE, {"layout": c.layouts[0], "n": 1})
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c._transport.timeout_s = 5.0
        for _ in range(3):
            c.ping()
        assert _held(daemon.endpoint)[0] == 0
    finally:
        c.close()


def test_forgets_after_a_stall_go_a_few_at_a_time_and_every_reply_arrives(daemon):
    """A review's script: after a stall, the forgets of 200 timed-out calls went in one burst on the
    fresh socket; the daemon queues 64 replies for a connection and dropped tens of them (logged as
    a client that does not read its replies), and at times the reply to the call sent after them:
    `ping` timed out on an idle daemon. At most PENDING_IN_FLIGHT go at once, the next as each is
    answered: the calls after the stall are answered, and the forgets drain over a few of them."""
    c = Client.connect(daemon.endpoint, name="w", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            c._transport.timeout_s = 0.01  # (200 timeouts quickly)
            for _ in range(200):
                with pytest.raises(DaemonUnavailable):
                    c._call(Op.ALLOCATE, {"layout": c.layouts[0], "n": 1})
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c._transport.timeout_s = 5.0
        assert len(c._transport._forgets) == 200
        for _ in range(200 // transport.PENDING_IN_FLIGHT + 1):
            c.ping()
            assert len(c._transport._in_flight) <= transport.PENDING_IN_FLIGHT
        assert not c._transport._forgets
        assert _held(daemon.endpoint)[0] == 0
    finally:
        c.close()
    assert not [line for line in daemon.log().splitlines() if "dropped" in line]


def no_socket(monkeypatch, c: Client) -> None:
    """The client's last fresh socket could not be made (no descriptor left: an engine at its
    `ulimit -n`), and none can be made now."""
    c._transport._close_socket(c._transport._sock)
    c._transport._sock = None

    def cannot(self):
        raise DaemonUnavailable(f"cannot make a socket for {self.endpoint}: Too many open files")

    monkeypatch.setattr(Transport, "_open", cannot)


def test_a_release_that_finds_no_socket_is_sent_again_once_one_can_be_made(daemon, monkeypatch):
    c = Client.connect(daemon.endpoint, name="reader", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        keys = chain_keys(range(16 * 2), 16, "no-socket")
        vids = c.commit(c.allocate(c.layouts[0], 2)["vid"], keys=keys)
        c.free(vids)
        assert c.acquire(vids) is not None  # a pin on each
        no_socket(monkeypatch, c)
        with pytest.raises(DaemonUnavailable, match="Too many open files.*sent again on every new socket"):
            c.release(vids)
        monkeypatch.undo()
        c.ping()  # makes the socket; the release goes first
        c.ping()
        assert c.detach()["unpinned"] == 0
    finally:
        c.close()


def test_a_call_that_finds_no_socket_and_hands_nothing_out_keeps_no_forget(daemon, monkeypatch):
    """Never sent, an allocate handed nothing out: a `forget` of each such call (an engine at its
    `ulimit -n` calls on, each failing at once) pushed real ones out past MAX_FORGETS (a review)."""
    c = Client.connect(daemon.endpoint, name="busy", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        no_socket(monkeypatch, c)
        for _ in range(3):
            with pytest.raises(DaemonUnavailable, match="Too many open files"):
                c._call(Op.ALLOCATE, {"layout": c.layouts[0], "n": 1})
        assert not c._transport._forgets and not c._transport._retries
    finally:
        monkeypatch.undo()
        c.close()


def test_a_commit_that_finds_no_socket_leaves_the_writer_none_of_its_blocks(daemon, monkeypatch):
    c = Client.connect(daemon.endpoint, name="writer", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        keys = chain_keys(range(16 * 3), 16, "no-socket-commit")
        vids = c.allocate(c.layouts[0], 3)["vid"]
        no_socket(monkeypatch, c)
        with pytest.raises(DaemonUnavailable, match="Too many open files.*free the blocks this commit named"):
            c.commit(vids, keys=keys)
        monkeypatch.undo()
        c.ping()
        c.ping()
        assert _held(daemon.endpoint)[0] == 0 and len(c.lookup(keys)) == 0
    finally:
        c.close()


def test_a_call_too_large_for_the_daemon_is_refused_before_it_waits(daemon):
    """Timed out behind another thread's call, a free of more ids than a frame holds was kept to send
    later, and every later call failed on it with a ProtocolError about a `retry` (a review)."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=1.0, heartbeat=False)
    try:
        big = np.arange(1, P.MAX_FRAME_BYTES // 8 + 2, dtype=P.VIDS_DTYPE)
        c._lock.acquire()  # another thread's call holds the client
        try:
            with pytest.raises(ProtocolError, match="free: a frame of .* more than the daemon accepts"):
                c.free(big)
        finally:
            c._lock.release()
        assert not c._unsent
        for _ in range(3):
            c.ping()
    finally:
        c.close()


def test_a_pending_retry_that_cannot_be_encoded_is_dropped_said(tmp_path, caplog):
    t = Transport(f"ipc://{tmp_path}/no-daemon.sock")
    try:
        t._note_retry(7, Op.FREE, 1, np.zeros(P.MAX_FRAME_BYTES // 8 + 1, dtype=P.VIDS_DTYPE).tobytes())
        t._note_retry(7, Op.FREE, 2, np.zeros(1, dtype=P.VIDS_DTYPE).tobytes())
        with caplog.at_level(logging.WARNING, logger="dflash2.client"):
            assert t._send_pending()
        assert [call for _, _, call, _ in t._retries.values()] == [2] and not t._unsent()
        assert "a retry that cannot be sent to dflash2d" in caplog.text
    finally:
        t.close()


def test_a_release_or_free_the_daemon_refuses_keeps_what_it_names(daemon):
    """A release (or free) refused whole (one id the daemon does not know: it ran none of it) gave the
    pins (the block being written) up on the client's side: the daemon still pinned the block, yet the
    client would not view it, and was told never to release again (a review). They stay now."""
    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        lid = c.layouts[0]
        placed = c.allocate(lid, 1)
        (vid,) = c.commit(placed["vid"], keys=[4242])
        c.free([vid])
        (found,) = c.lookup([4242])
        c.acquire([found["vid"]])
        with pytest.raises(DaemonError, match="UnknownBlock"):
            c.release([found["vid"], 999])
        assert c.view_bytes(int(found["vid"])).nbytes == SMALL.block_bytes  # still pinned, still viewable
        c.release([found["vid"]])  # mended and sent again: it runs
        writing = int(c.allocate(lid, 1)["vid"][0])
        with pytest.raises(DaemonError, match="UnknownBlock"):
            c.free([writing, 999])
        c.view_bytes(writing)[:] = 7  # still being written, and its writer's
        c.commit([writing], keys=[77])
        c.check()
    finally:
        c.close()


def test_a_release_whose_reply_cannot_be_read_gives_its_pins_up_and_one_never_sent_keeps_them(daemon, monkeypatch):
    """A review: an unreadable reply (UnreadableReply, a DaemonError) was taken for the daemon's
    refusal, and the pins kept viewable, though the release had run and the block could move; and a
    release the library refused before sending (a frame too large: ProtocolError) gave pins up that
    the daemon still held."""
    from dflash2.client import transport as T
    from dflash2.errors import ArenaError, UnreadableReply

    c = Client.connect(daemon.endpoint, name="engine", layouts=[SMALL], timeout_s=2.0, heartbeat=False)
    try:
        (vid,) = c.commit(c.allocate(c.layouts[0], 1)["vid"], keys=[4242])
        c.free([vid])
        assert c.acquire([vid]) is not None
        with pytest.raises(ProtocolError, match="release: a frame of"):
            c.release(np.full(P.MAX_FRAME_BYTES // 8 + 1, vid, dtype=P.VIDS_DTYPE))  # never sent
        assert c.view_bytes(int(vid)).nbytes == SMALL.block_bytes  # its pin kept
        assert c.acquire([vid]) is not None  # a second pin
        real = T.P.decode_reply

        def mangled(frames):  # the release's reply arrives mangled (it ran at the daemon)
            reply = real(frames)
            if reply.ok and reply.result == {} and not reply.arrays:
                raise P.ProtocolError("mangled")
            return reply
        monkeypatch.setattr(T.P, "decode_reply", mangled)
        with pytest.raises(UnreadableReply):
            c.release([vid])
        monkeypatch.undo()
        c.release([vid])  # the other pin (the first release ran)
        with pytest.raises(ArenaError):
            c.view_bytes(int(vid))
    finally:
        released = c.close()
    assert not any(released.values()), released
