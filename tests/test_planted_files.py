"""Other local users on a shared node (reviews' scripts, as uid 65534): files another user plants
where the daemon's go (/dev/shm names, the NVMe file, the history file) and the moment after the
socket's bind. Each failed before its fix: start-up ended in a traceback at every start, the NVMe
tier served from a file its owner could read, history lines went where another user's link pointed,
and another user connected to the socket before it was made owner-only. The tests that act as
another user need root (seteuid) and skip without it."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path

import pytest
from conftest import write_config
from observe_helpers import running_daemon
from test_other_user import as_other_user

from dflash2 import protocol as P
from dflash2.arena.shm import SharedMemoryArena
from dflash2.daemon import startup
from dflash2.errors import ArenaError
from dflash2.history import History, make_history, sample_of
from dflash2.tiers import Tier

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
OTHER = 65534  # the other local user (and, where a daemon runs as non-root, the daemon's user)
PLANTER_UID = 54321


# -- /dev/shm ---------------------------------------------------------------------------------------
def _unused_pid() -> int:
    pid = int(open("/proc/sys/kernel/pid_max").read()) - 3
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


class _NoPrevious:
    previous_pid = None
    replaced_socket = False


def _plant(name: str, mode: int) -> str:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.close(fd)
    os.chmod(path, mode)
    os.chown(path, PLANTER_UID, PLANTER_UID)
    return path


@root_only
def test_another_users_file_in_dev_shm_does_not_crash_the_daemons_start_up():
    path = _plant(f"dflash2-{_unused_pid()}-alive", 0o644)
    try:
        with as_other_user():  # (the daemon's user here: not root)
            startup.clean_up_killed("ipc:///nowhere/d.sock", _NoPrevious())  # (PermissionError: exit 1)
    finally:
        os.unlink(path)


@root_only
def test_a_segment_name_planted_by_another_user_is_a_named_start_up_error():
    name = f"dflash2-{_unused_pid()}-hbm"
    path = _plant(name, 0o600)
    try:
        with as_other_user(), pytest.raises(ArenaError, match=rf"{path} already exists, a file of uid {PLANTER_UID}"):
            SharedMemoryArena.create(name, 1 << 16, Tier.HBM)  # (it raised PermissionError: a traceback, exit 1)
    finally:
        os.unlink(path)


# -- the NVMe file --------------------------------------------------------------------------------------
@root_only
def test_the_nvme_tier_refuses_another_users_file_at_its_path():
    from dflash2.arena.nvme import NvmeArena
    base = Path(tempfile.mkdtemp(prefix="others-", dir="/tmp"))
    base.chmod(0o755)  # (pytest's tmp_path is root's own: the other user could not reach into it)
    scratch = base / "scratch"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)  # a shared scratch disk, like /tmp
    path = scratch / "dflash2.cache"
    with as_other_user():
        path.touch()
        path.chmod(0o666)  # planted empty, before the daemon's first start
    try:
        with pytest.raises(ArenaError, match=rf"NVMe tier file {path} is not this user's \(uid {OTHER}.*mode 666"):
            NvmeArena(path, 1 << 20, staging_bytes=1 << 20)
        assert path.stat().st_size == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_cache_file_of_this_user_open_to_others_is_made_owner_only(tmp_path, caplog):
    from dflash2.arena.nvme import NvmeArena
    path = tmp_path / "nvme" / "c.bin"
    old = os.umask(0)
    try:
        NvmeArena(path, 1 << 20, staging_bytes=1 << 20).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
        NvmeArena(path, 1 << 20, staging_bytes=1 << 20).remove()
    assert "was open to other users (mode 644): made owner-only" in caplog.text


def test_a_file_of_this_user_that_is_not_a_cache_file_is_refused_with_its_mode_kept(tmp_path, caplog):
    """A review: a shared data file named as memory.nvme_path (as root: any root-owned 0644 file) was
    made owner-only, every other user losing it, and only then refused as not a cache file."""
    from dflash2.arena.nvme import NvmeArena
    victim = tmp_path / "shared-data.bin"
    victim.write_bytes(b"precious data other users read\n")
    victim.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="dflash2.arena"):
        with pytest.raises(ArenaError, match=f"{victim} exists and is not a dflash2 NVMe cache file"):
            NvmeArena(victim, 1 << 20, staging_bytes=1 << 20)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert victim.read_bytes() == b"precious data other users read\n"
    assert "made owner-only" not in caplog.text


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_device_or_fifo_at_the_nvme_path_is_refused_untouched(tmp_path, kind):
    """A review: `"nvme_path": "/dev/null"` in a root daemon's config made /dev/null owner-only (0600)
    for every user of the node, then failed the start; a FIFO the same. Refused now before it is
    opened (opening a device may act: a watchdog's starts it), its mode as it was."""
    from dflash2.arena.nvme import NvmeArena
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif os.geteuid() != 0:
        pytest.skip("mknod needs root")
    else:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a private /dev/null
    path.chmod(0o666)
    with pytest.raises(ArenaError, match=rf"memory.nvme_path {path} is not a regular file \({'p' if kind == 'fifo' else 'c'}rw"):
        NvmeArena(path, 1 << 20, staging_bytes=1 << 20)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666


def test_a_path_that_became_a_fifo_after_it_was_looked_at_is_refused_untouched(tmp_path):
    """What was opened is looked at again: the path may name something else by then."""
    from dflash2.arena import nvmefiles
    path = tmp_path / "fifo"
    os.mkfifo(path)
    path.chmod(0o666)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    with pytest.raises(ArenaError, match="is not a regular file"):
        nvmefiles._own_file(fd, str(path))
    with pytest.raises(OSError):
        os.fstat(fd)  # (closed by the refusal)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666


# -- the history file -------------------------------------------------------------------------------------
def _history(state: Path) -> History:
    cfg = type("Cfg", (), {"history_enabled": True})()
    return make_history(cfg, state)


def test_history_is_owner_only_under_any_umask_and_never_written_through_a_link(tmp_path):
    state = tmp_path / "state"
    old = os.umask(0)
    try:
        h = _history(state)
        h._append(b'{"t": 1}\n')
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (state, state / "history.jsonl")}
    assert modes == {"state": 0o700, "history.jsonl": 0o600}, modes
    victim = tmp_path / "victim"
    victim.write_text("someone's file\n")
    (state / "history.jsonl").unlink()
    (state / "history.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        h._append(b'{"t": 2}\n')
    assert victim.read_text() == "someone's file\n"
    h.close()


def test_a_link_in_the_history_files_place_is_named_at_start_and_not_read(tmp_path, caplog):
    # A review: the link was read back as this daemon's history, then each write failed with
    # "too many levels of symbolic links", and the log never said it was a link.
    real = tmp_path / "elsewhere.jsonl"
    real.write_text('{"t": 1}\n')
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "history.jsonl").symlink_to(real)
    (state / "history.jsonl.1").symlink_to(real)
    with caplog.at_level(logging.INFO, logger="dflash2.history"):
        h = _history(state)
    assert h.path is None and "is a link, which the daemon never writes through" in caplog.text, caplog.text
    assert "read back" not in caplog.text
    h.close()
    (state / "history.jsonl").unlink()  # (the rotated one a link: skipped, said)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash2.history"):
        h = _history(state)
    assert h.path == state / "history.jsonl" and not h.samples, caplog.text
    assert "history.jsonl.1 is not a regular file: skipped" in caplog.text
    h.close()
    assert real.read_text() == '{"t": 1}\n'


@root_only
@pytest.mark.parametrize("name", ["history.jsonl", "history.jsonl.1"])
def test_another_users_history_file_is_named_at_start_and_not_read(tmp_path, caplog, name):
    # A review: another user's regular file there (one `sudo dflash2d` left) was read back as this
    # daemon's history, then every write refused it ("not a regular file of this user's") while the
    # log said it kept trying, and each sample since the start was lost at the next restart.
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    stats = {"tiers": {}, "reads": {}, "moves": {}, "hbm_hit_ratio": None,
             "reservations": {"granted": 0, "deferred": 0, "reserved_blocks": 0}}
    theirs = History.encode([sample_of(stats, 1000.0)]).decode()
    (state / name).write_text(theirs)
    os.chown(state / name, OTHER, OTHER)
    with caplog.at_level(logging.INFO, logger="dflash2.history"):
        h = _history(state)
    h.close()
    assert h.path is None and not h.samples, caplog.text
    assert f"history: {state / name} is another user's file (uid {OTHER}" in caplog.text, caplog.text
    assert "remove it, or chown it to uid 0" in caplog.text and len(caplog.records) == 1, caplog.text
    assert (state / name).read_text() == theirs and (state / name).stat().st_uid == OTHER


def test_an_earlier_releases_history_open_to_others_is_made_owner_only(tmp_path, caplog):
    """A review's script: a folder and file an earlier release made under umask 000 (0777, 0666) kept
    their modes: anyone could put a FIFO or a link in the file's place."""
    state = tmp_path / "state"
    old = os.umask(0)
    try:
        state.mkdir(mode=0o777)
        (state / "history.jsonl").write_text("")
    finally:
        os.umask(old)
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        h = _history(state)
        h._append(b'{"t": 1}\n')
        h.close()
    assert stat.S_IMODE(state.stat().st_mode) == 0o755 and stat.S_IMODE((state / "history.jsonl").stat().st_mode) == 0o600
    assert "was writable by other users (mode 777)" in caplog.text and "was open to other users (mode 666)" in caplog.text


def test_a_shared_state_folder_keeps_its_mode_and_the_rotated_history_is_made_owner_only(tmp_path, caplog):
    """A review's script: a root daemon given a sticky 1777 folder (like /tmp) as daemon.state_dir made
    it 1755, locking every other user out of it; and an earlier release's history.jsonl.1 (0666)
    stayed open, so another user could append forged samples that the next start reads back."""
    shared, own = tmp_path / "shared", tmp_path / "own"
    for folder in (shared, own):
        folder.mkdir()
    shared.chmod(0o1777)
    own.chmod(0o777)
    old = os.umask(0)
    try:
        (own / "history.jsonl.1").write_text('{"t": 0}\n')
    finally:
        os.umask(old)
    (own / "notes.txt").write_text("the operator's")  # a folder holding more than the history's files
    with caplog.at_level(logging.WARNING, logger="dflash2.history"):
        for folder in (shared, own):
            _history(folder).close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and stat.S_IMODE(own.stat().st_mode) == 0o777
    assert caplog.text.count("writable by other users") == 2 and "give the daemon a daemon.state_dir" in caplog.text
    assert stat.S_IMODE((own / "history.jsonl.1").stat().st_mode) == 0o600


def test_a_fifo_in_the_history_files_place_fails_the_write_at_once(tmp_path):
    """A review's script: open() of a FIFO put in the file's place blocked the daemon's loop thread
    (which writes the history) for good."""
    state = tmp_path / "state"
    h = _history(state)
    (state / "history.jsonl").unlink(missing_ok=True)
    os.mkfifo(state / "history.jsonl", 0o600)
    started = time.monotonic()
    with pytest.raises(OSError):
        h._append(b'{"t": 1}\n')
    assert time.monotonic() - started < 2
    h.close()


@root_only
def test_check_says_start_up_would_refuse_another_users_nvme_file(tmp_path):
    import contextlib
    import io
    from dflash2.daemon import main as dmain
    cfg = write_config(tmp_path)
    path = tmp_path / "nvme.cache"
    path.touch()
    os.chown(path, OTHER, OTHER)
    os.chmod(path, 0o666)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert dmain.main(["--config", cfg, "--check"]) == 0
    now = [line for line in out.getvalue().splitlines() if line.startswith("now: ") and "nvme.cache" in line]
    assert now and f"is not this user's (uid {OTHER}" in now[-1] and "start-up would fail now (exit 4)" in now[-1], now


# -- the socket ---------------------------------------------------------------------------------------------
def _recv(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b


def _racer(path: str, seconds: float) -> str:
    """Connect in a loop; on success speak ZMTP 3.0 (NULL, DEALER) and ask for stats."""
    end = time.time() + seconds
    while time.time() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        s.settimeout(5)
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        _recv(s, 64)
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(bytes([4, len(ready)]) + ready)
        time.sleep(0.5)  # the daemon's chmod has run by now
        out = b""
        frames = P.encode_request(P.Op.STATS, 1, None, {})
        for i, f in enumerate(frames):
            out += bytes([1 if i < len(frames) - 1 else 0, len(f)]) + f
        s.sendall(out)
        got = []
        while True:
            flags = _recv(s, 1)[0]
            n = struct.unpack(">Q", _recv(s, 8))[0] if flags & 2 else _recv(s, 1)[0]
            body = _recv(s, n)
            if flags & 4:
                continue
            got.append(body)
            if not flags & 1:
                break
        reply = P.decode_reply(got)
        mode = os.stat(path).st_mode & 0o777
        return f"served stats (ok={reply.ok}, pid {reply.result.get('pid')}) through a socket now mode {mode:o}"
    return ""


@root_only
def test_no_other_user_connects_while_the_socket_is_bound_but_not_yet_owner_only():
    base = Path(tempfile.mkdtemp(prefix="tperms5-", dir="/tmp"))
    base.chmod(0o755)
    run = base / "run"
    run.mkdir(mode=0o755)  # the container's /run/dflash2
    sock = run / "d.sock"
    cfg = write_config(base, daemon={"endpoint": f"ipc://{sock}", "state_dir": str(base / "state")})
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # another user's process
        os.close(r)
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            os.write(w, _racer(str(sock), 25.0).encode())
        finally:
            os._exit(0)
    os.close(w)
    old = os.umask(0)
    try:
        for _ in range(5):
            with running_daemon(cfg, str(base / "d.log")):
                time.sleep(1.5)
            if os.waitpid(child, os.WNOHANG)[0]:
                break
        else:
            os.kill(child, 9)
            os.waitpid(child, 0)
        result = os.read(r, 4096).decode()
    finally:
        os.umask(old)
        os.close(r)
        shutil.rmtree(base, ignore_errors=True)
    assert not result, f"uid {OTHER}, which may not use the 0600 socket, connected as it was bound and was {result}"


def test_every_folder_the_daemon_makes_is_owner_only_under_umask_000(tmp_path):
    """A review: under umask 000 `mkdir(parents=True)` made the folders above the last 0777 (~/.local,
    ~/.local/state, ~/.cache, a missing runtime folder's parents): any user could rename the daemon's
    own folder away and put one of theirs in its place. Folders already there keep their modes."""
    from dflash2.arena.nvme import NvmeArena
    from dflash2.daemon.endpoint import EndpointLock
    from dflash2.files import make_private_folders
    from dflash2.tcpkeys import load_or_make

    tmp_path.chmod(0o755)
    old = os.umask(0)
    try:
        _history(tmp_path / "h1" / "h2" / "state").close()
        NvmeArena(tmp_path / "n1" / "n2" / "nvme.cache", 1 << 20, staging_bytes=64 << 10).remove()
        lock = EndpointLock(f"ipc://{tmp_path}/e1/e2/d.sock", tmp_path)
        lock.acquire()
        lock.release()
        load_or_make(tmp_path / "k1" / "k2" / "tcp-5555.key")
    finally:
        os.umask(old)
    made = [p for p in tmp_path.rglob("*") if p.is_dir()]
    assert len(made) == 9, made
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {p.name: "0o700" for p in made}
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755  # (one that was there keeps its mode)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        make_private_folders(tmp_path / "file")
    assert make_private_folders(tmp_path / "new") is True and make_private_folders(tmp_path / "new") is False


def test_private_folders_are_made_where_a_path_through_a_link_names_them(tmp_path):
    # A review: `a/link/../state` was cut as text to `a/state` (abspath), made there, and then
    # refused as "not a folder"; the kernel's reading, as os.makedirs's, is beside the link's target.
    from dflash2.files import make_private_folders

    real = tmp_path / "disk" / "sub"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    assert make_private_folders(tmp_path / "link" / ".." / "state" / "deeper") is True
    assert (tmp_path / "disk" / "state" / "deeper").is_dir() and not (tmp_path / "state").exists()
    assert stat.S_IMODE((tmp_path / "disk" / "state").stat().st_mode) == 0o700
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert make_private_folders("rel/a/") is True and (tmp_path / "rel" / "a").is_dir()
    finally:
        os.chdir(cwd)
