"""The endpoint's lock file (daemon/endpoint.py): which daemon serves an endpoint, and which one
before it did not shut down cleanly."""

from __future__ import annotations

import os

import pytest

from dflash2.daemon.endpoint import EndpointBusy, EndpointLock


def test_a_lock_file_left_by_a_killed_daemon_names_it(tmp_path):
    lock = EndpointLock(f"ipc://{tmp_path}/d.sock", tmp_path)
    lock.lock_path.write_text("4242")
    lock.acquire()
    try:
        assert lock.previous_pid == 4242
        assert lock.lock_path.read_text() == str(os.getpid())
        with pytest.raises(EndpointBusy, match=f"pid {os.getpid()}"):
            EndpointLock(f"ipc://{tmp_path}/d.sock", tmp_path).acquire()
    finally:
        lock.release()
    assert not lock.lock_path.exists()


def test_a_lock_file_naming_our_own_pid_is_a_killed_predecessors(tmp_path):
    # A container's daemon is pid 1 every time: the lock file its killed predecessor left names our
    # own pid, and that predecessor's segments (dflash2-1-*) are still to be removed; before, only
    # those the new daemon happened to create again under the same name were, and a tier the config
    # no longer has kept its segment for good.
    lock = EndpointLock(f"ipc://{tmp_path}/d.sock", tmp_path)
    lock.lock_path.write_text(str(os.getpid()))
    lock.acquire()
    try:
        assert lock.previous_pid == os.getpid()
    finally:
        lock.release()


def test_a_lock_taken_on_a_file_its_owner_removed_meanwhile_is_taken_again(tmp_path, monkeypatch):
    # The daemon that held the endpoint stops (removes its lock file, then lets go) just as the next
    # one opens that file and locks it: the lock it then holds is on a file no longer at the path, and
    # a third daemon would make a new one and serve the endpoint too (replacing the socket).
    from dflash2.daemon import endpoint

    endpoint_ = f"ipc://{tmp_path}/d.sock"
    first = EndpointLock(endpoint_, tmp_path)
    first.acquire()
    real_flock = endpoint.fcntl.flock

    def flock_after_the_first_stops(fd, op):
        if first._fd >= 0:
            first.release()  # between our open and our lock
        return real_flock(fd, op)

    monkeypatch.setattr(endpoint.fcntl, "flock", flock_after_the_first_stops)
    second = EndpointLock(endpoint_, tmp_path)
    second.acquire()
    monkeypatch.setattr(endpoint.fcntl, "flock", real_flock)
    try:
        assert second.lock_path.read_text() == str(os.getpid())
        with pytest.raises(EndpointBusy):
            EndpointLock(endpoint_, tmp_path).acquire()
    finally:
        second.release()


def test_a_live_socket_whose_lock_file_was_removed_is_not_replaced(tmp_path):
    """A daemon's lock file removed under it (a clean-up of the runtime folder): the next daemon
    unlinked the live socket and served in its place without a word, the first left serving no one
    with its memory (a review). A socket a process listens on is refused; a dead one's is replaced."""
    import socket

    path = tmp_path / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    try:
        lock = EndpointLock(f"ipc://{path}", tmp_path)
        with pytest.raises(EndpointBusy, match="a process is listening on .*d.sock although no lock file names it"):
            lock.acquire()
        assert path.exists() and not lock.lock_path.exists()  # the socket left to its process, our lock gone
    finally:
        listener.close()  # now a dead socket's file, as a killed daemon leaves it
    lock = EndpointLock(f"ipc://{path}", tmp_path)
    lock.acquire()
    try:
        assert lock.replaced_socket and not path.exists()
    finally:
        lock.release()


def test_a_live_socket_whose_backlog_is_full_is_not_replaced(tmp_path):
    """A live process that does not accept (stopped, `kill -STOP`, while clients kept connecting):
    Linux refuses a connect to its full backlog at once with EAGAIN, not after the timeout, and the
    socket was taken for a dead daemon's and replaced (a review)."""
    import socket

    path = tmp_path / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    waiting = []
    try:
        while True:  # (the backlog filled: connections nobody accepts)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.setblocking(False)
            waiting.append(peer)
            try:
                peer.connect(str(path))
            except BlockingIOError:
                break
        lock = EndpointLock(f"ipc://{path}", tmp_path)
        with pytest.raises(EndpointBusy, match="a process is listening on .*d.sock although no lock file names it"):
            lock.acquire()
        assert path.exists()
    finally:
        for peer in waiting:
            peer.close()
        listener.close()


def test_a_socket_this_user_may_not_connect_to_is_neither_taken_for_a_dead_ones_nor_removed(tmp_path, monkeypatch):
    """Another user's socket (mode 0600) in a shared folder: connect() is denied (EACCES), which was
    taken for a dead daemon's refusal: the socket was removed (a folder without the sticky bit), or
    the start failed with "its lock file ...: Operation not permitted", our lock file left naming us
    (a review's `runuser -u nobody`). Denied is said, the socket and no lock of ours left."""
    import errno
    import socket

    from dflash2.daemon import endpoint as E

    class Denied(socket.socket):
        def connect(self, address):
            raise PermissionError(errno.EACCES, "Permission denied")

    path = tmp_path / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    monkeypatch.setattr(E.socket, "socket", Denied)
    try:
        lock = EndpointLock(f"ipc://{path}", tmp_path)
        with pytest.raises(EndpointBusy, match="d.sock is a socket this user may not connect to"):
            lock.acquire()
        assert path.exists() and not lock.lock_path.exists()
    finally:
        listener.close()


def test_check_says_another_daemon_serves_the_ipc_endpoint(config_file, tmp_path):
    """`--check` of a config whose ipc endpoint a running daemon serves said nothing of it, and
    start-up then exited 4 (a review; a tcp endpoint's port already had its line)."""
    import contextlib
    import io

    from daemon_proc import DaemonProcess

    from dflash2.daemon import main as dmain

    path = config_file(daemon={"endpoint": f"ipc://{tmp_path}/d.sock"})

    def now_lines() -> list[str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert dmain.main(["--config", path, "--check"]) == 0
        return [line for line in out.getvalue().splitlines() if line.startswith("now: ")]

    assert not [line for line in now_lines() if "is serving" in line]
    proc = DaemonProcess(path).start()
    try:
        said = [line for line in now_lines() if "is serving" in line]
        assert said == [f"now: another dflash2d (pid {proc.proc.pid}) is serving ipc://{tmp_path}/d.sock "
                        "(daemon.endpoint; a dflash2d serving this config holds it too): start-up would fail now "
                        "(exit 4)"], said
    finally:
        proc.stop()


def test_check_says_a_socket_listened_on_without_a_lock_file_fails_the_start(tmp_path):
    """A process listening on the ipc socket while no lock file names it: start-up refuses it (exit 4,
    above), and `dflash2d --check` said nothing of it (exit 0, no `now:` line). A dead one's socket,
    which start-up replaces, is not said."""
    import socket

    from dflash2.daemon.roomnow import ports_now

    path = tmp_path / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    try:
        assert ports_now(f"ipc://{path}", "127.0.0.1", 0) == [
            f"a process is listening on {path} although no lock file names it (a dflash2d whose d.sock.lock was "
            "removed, or another program) (daemon.endpoint): start-up would fail now (exit 4)"]
    finally:
        listener.close()
    assert ports_now(f"ipc://{path}", "127.0.0.1", 0) == []
