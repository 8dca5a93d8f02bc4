"""SharedMemoryArena: a named /dev/shm segment that a second process can map."""

import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from dflash2.arena.shm import SharedMemoryArena, remove_stale, remove_stale_segments
from dflash2.errors import ArenaError, CapacityError
from dflash2.tiers import Tier

CAP = 1 << 20


@pytest.fixture
def name():
    n = f"dflash2-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    try:
        os.unlink(f"/dev/shm/{n}")
    except FileNotFoundError:
        pass


@pytest.fixture
def arena(name):
    a = SharedMemoryArena.create(name, CAP, Tier.DRAM)
    yield a
    a.close()


def test_create_view_and_describe(arena, name):
    assert os.path.exists(f"/dev/shm/{name}")
    assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    v = arena.view(4096, 256)
    v[:] = 7
    assert arena.view(4096, 256).sum() == 7 * 256
    assert np.shares_memory(v, arena.view(0, CAP))  # no copy
    d = arena.describe()
    assert d["name"] == name and d["tier"] == "dram" and d["capacity_bytes"] == CAP


def test_writes_visible_to_a_client_process(arena, name):
    arena.view(0, 4)[:] = [1, 2, 3, 4]
    child = textwrap.dedent(f"""
        from dflash2.arena.shm import SharedMemoryArena, remove_stale, remove_stale_segments
        from dflash2.tiers import Tier
        a = SharedMemoryArena.attach({name!r}, Tier.DRAM)
        assert a.capacity_bytes == {CAP}
        assert list(a.view(0, 4)) == [1, 2, 3, 4]
        a.view(1000, 3)[:] = [9, 8, 7]
        a.close()
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    assert list(arena.view(1000, 3)) == [9, 8, 7]
    assert os.path.exists(f"/dev/shm/{name}")  # the client's close did not unlink


@pytest.mark.parametrize("offset,nbytes", [(-1, 1), (0, CAP + 1), (CAP, 1), (CAP - 10, 11), (0, -1)])
def test_view_out_of_range_raises(arena, offset, nbytes):
    with pytest.raises(ArenaError, match="outside"):
        arena.view(offset, nbytes)


def test_view_after_close_raises(name):
    a = SharedMemoryArena.create(name, CAP, Tier.DRAM)
    a.close()
    with pytest.raises(ArenaError, match="closed"):
        a.view(0, 1)


def test_close_unlinks_and_is_idempotent(name):
    a = SharedMemoryArena.create(name, CAP, Tier.HBM, populate=False)
    v = a.view(0, 16)  # a live view must not make close fail
    a.close()
    a.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    del v


def test_create_twice_raises(arena, name):
    with pytest.raises(ArenaError, match="already exists and a running process holds it"):
        SharedMemoryArena.create(name, CAP, Tier.DRAM)


def test_a_segment_nobody_holds_is_replaced_and_a_held_one_never(name, caplog):
    # A killed daemon's segment: there, sized, but no process holds it.
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 3 * CAP)
    os.close(fd)
    with caplog.at_level("WARNING", logger="dflash2.arena.shm"):
        a = SharedMemoryArena.create(name, CAP, Tier.DRAM)
    assert os.stat(path).st_size == CAP
    assert f"removed shared-memory segment {name} ({3 * CAP} bytes)" in caplog.text
    # A live one (its creator holds it) is never removed, by create or by the sweep.
    assert remove_stale(path) is None and remove_stale_segments(name) == []
    with pytest.raises(ArenaError, match="a running process holds it"):
        SharedMemoryArena.create(name, CAP, Tier.DRAM)
    assert os.stat(path).st_size == CAP
    a.close()
    assert not os.path.exists(path)


def test_attach_missing_raises(name):
    with pytest.raises(ArenaError, match="does not exist"):
        SharedMemoryArena.attach(name, Tier.DRAM)


def test_absurd_size_raises_capacity_error(name):
    with pytest.raises(CapacityError, match=r"needs \d+ bytes .* only \d+ available"):
        SharedMemoryArena.create(name, 1 << 50, Tier.DRAM)
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("bad", ["", "a/b", ".."])
def test_bad_names_raise(bad):
    with pytest.raises(ArenaError, match="name"):
        SharedMemoryArena.create(bad, CAP, Tier.DRAM)


def test_capacity_must_be_aligned(name):
    with pytest.raises(ArenaError, match="multiple"):
        SharedMemoryArena.create(name, CAP + 1, Tier.DRAM)


def test_a_file_size_limit_below_the_segment_is_refused_naming_it(name):
    """A segment is a file in /dev/shm: under a file size limit (ulimit -f) below it, its ftruncate
    failed as "[Errno 27] File too large", naming no limit (a review); nothing is left behind."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (CAP // 2, hard))
    try:
        with pytest.raises(CapacityError, match=rf"dram tier needs a shared-memory segment of {CAP} bytes .*"
                                                rf"may not write past byte {CAP // 2} of a file \(its file size limit, "
                                                r"RLIMIT_FSIZE"):
            SharedMemoryArena.create(name, CAP, Tier.DRAM)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert not os.path.exists(f"/dev/shm/{name}")
