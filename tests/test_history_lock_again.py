"""The history lock where the state folder is removed and made again under a running daemon
(historylock.py): the daemon takes the new folder's lock again before it writes there, so a second
daemon given the folder keeps its history in memory; where the second took it first, the first gives
the file up. Before, both appended to one file (a review: time going back, a false restart on every
row of `dflash2 history`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from types import SimpleNamespace

from dflash2.history import make_history
from observe_helpers import service  # noqa: F401  (a fixture)

CFG = SimpleNamespace(history_enabled=True)


def test_a_folder_made_again_is_locked_again_before_it_is_written(service, tmp_path, clock, caplog):
    caplog.set_level(logging.INFO, logger="dflash2.history")
    state = tmp_path / "state"
    first = make_history(CFG, state, endpoint="ipc:///a.sock", clock=clock)
    first.record(service.stats())
    clock.advance(1.0)
    shutil.rmtree(state)
    first.record(service.stats())  # the folder is gone: the sample waits in memory
    clock.advance(1.0)
    state.mkdir(mode=0o700)
    first.record(service.stats())  # written again, under the new folder's lock taken again
    clock.advance(1.0)
    second = make_history(CFG, state, endpoint="ipc:///b.sock", clock=clock)
    try:
        assert second.path is None and first.path == state / "history.jsonl"
        for _ in range(3):
            first.record(service.stats())
            second.record(service.stats())
            clock.advance(1.0)
        times = [json.loads(line)["t"] for line in (state / "history.jsonl").read_text().splitlines()]
        assert len(times) == 5 and times == sorted(times)  # the first's two waiting, then its three
        assert "was made again: its lock taken again" in caplog.text
    finally:
        first.close()
        second.close()


def test_where_another_daemon_took_the_folder_made_again_the_first_gives_the_file_up(service, tmp_path, clock,
                                                                                   caplog):
    state = tmp_path / "state"
    first = make_history(CFG, state, endpoint="ipc:///a.sock", clock=clock)
    first.record(service.stats())
    clock.advance(1.0)
    shutil.rmtree(state)
    state.mkdir(mode=0o700)
    second = make_history(CFG, state, endpoint="ipc:///b.sock", clock=clock)  # it takes the new folder first
    try:
        assert second.path == state / "history.jsonl"
        for _ in range(3):
            second.record(service.stats())
            first.record(service.stats())
            clock.advance(1.0)
        assert first.path is None and len(first.since()) == 4  # kept in memory, not written
        assert len((state / "history.jsonl").read_text().splitlines()) == 3  # the second's alone
        assert "another daemon took it; this one keeps its history in memory only" in caplog.text
    finally:
        first.close()
        second.close()


def test_a_folder_moved_into_place_holding_another_daemons_history_is_not_taken(service, tmp_path, clock, caplog):
    """The folder replaced by one another daemon wrote (restored, moved into place; that daemon
    stopped, its lock free): its samples are not appended to nor its lock taken, as a start would not
    (the running daemon appended to it and put its own names in its lock, a review)."""
    state, other = tmp_path / "state", tmp_path / "other"
    b = make_history(CFG, other, endpoint="ipc:///b.sock", clock=clock)
    for _ in range(3):
        b.record(service.stats())
        clock.advance(1.0)
    b.close()
    a = make_history(CFG, state, endpoint="ipc:///a.sock", clock=clock)
    a.record(service.stats())
    shutil.rmtree(state)
    os.rename(other, state)
    clock.advance(1.0)
    a.record(service.stats())
    try:
        assert len((state / "history.jsonl").read_text().splitlines()) == 3
        assert "b.sock" in (state / "history.lock").read_text() and a.path is None
        assert "was made again, holding another daemon's history" in caplog.text
    finally:
        a.close()


def test_a_fifo_at_the_lock_path_is_refused_not_taken_for_another_daemon(service, tmp_path, clock, caplog):
    """A FIFO put at history.lock: refused as a failed write, each sample trying again, no fd left
    open (it was flocked, its truncation failed and its fd leaked; the next sample found it locked
    by that fd and gave the file up to "another daemon", a review)."""
    state = tmp_path / "state"
    a = make_history(CFG, state, endpoint="ipc:///a.sock", clock=clock)
    a.record(service.stats())
    os.remove(state / "history.lock")
    os.mkfifo(state / "history.lock", 0o600)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        clock.advance(1.0)
        a.record(service.stats())
    after = len(os.listdir("/proc/self/fd"))
    try:
        assert a.path is not None and after == before
        assert "another daemon" not in caplog.text and "is not a regular file of this user's" in caplog.text
    finally:
        a.close()


def _made_again(service, tmp_path, clock, mode):
    """A daemon's history (a.sock) that wrote a sample, its state folder then removed and made again
    with `mode`: (the history, the folder)."""
    state = tmp_path / "state"
    a = make_history(CFG, state, endpoint="ipc:///a.sock", clock=clock)
    a.record(service.stats())
    shutil.rmtree(state)
    state.mkdir()
    os.chmod(state, mode)
    return a, state


def test_a_folder_made_again_open_to_others_or_with_a_nul_in_its_lock(service, tmp_path, clock, caplog):
    """As a start would: a folder made again open to other users is made owner-only before it is
    written (it was written as it was), and a lock line holding a NUL is no name (ValueError out of
    every sample, and out of a start; a review)."""
    a, state = _made_again(service, tmp_path, clock, 0o777)
    (state / "history.lock").write_bytes(b"4242\nipc:///x\x00y/b.sock\n")
    clock.advance(1.0)
    try:
        a.record(service.stats())
        assert a.path is not None and (state.stat().st_mode & 0o022) == 0
        assert "was writable by other users" in caplog.text
    finally:
        a.close()
    b = make_history(CFG, state, endpoint="ipc:///b.sock", clock=clock)  # a start over such a lock
    b.close()


def test_a_lock_that_cannot_be_had_in_a_folder_open_to_others_is_said_once(service, tmp_path, clock, caplog):
    """A folder made again sticky and open to all, its lock a link: each sample fails to take the
    lock (said once per streak); the folder's warning came with every sample too (a review)."""
    a, state = _made_again(service, tmp_path, clock, 0o1777)
    (state / "history.lock").symlink_to(tmp_path / "elsewhere")
    try:
        for _ in range(5):
            clock.advance(1.0)
            a.record(service.stats())
        assert caplog.text.count("cannot write") == 1 and "writable by other users" not in caplog.text
    finally:
        a.close()
