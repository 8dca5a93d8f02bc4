"""The main thread's stack grown up front (dflash2/mainstack.py): under an address-space limit a daemon
whose heap had taken the rest died with a segmentation fault in the first call that went deeper than
any before (a review's sweep: heat's rescore at `ulimit -v 700000`)."""

from __future__ import annotations

import glob
import mmap
import resource
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import write_config

from dflash2.mainstack import MAIN_STACK_BYTES, main_stack_target, stack_span

LIMIT = 1 << 30  # RLIMIT_AS of the processes below (a bare interpreter maps a few tens of MB)

# The address space left after the stack's growth (or not) all taken but 1 MiB, as a daemon's heap
# took it; then a call through 600 C frames (about 3 MiB of stack, 5 KiB a frame here).
DEEP = textwrap.dedent("""
    import mmap, sys
    from dflash2.mainstack import grow_main_stack
    from dflash2.arena.shm import address_space
    said = grow_main_stack() if sys.argv[1] == "grow" else None
    sys.setrecursionlimit(10000)
    def deep(n):
        return 0 if n == 0 else sorted([1], key=lambda x: deep(n - 1))[0]
    limit, used = address_space()
    rest = mmap.mmap(-1, limit - used - (1 << 20))
    deep(600)
    print("deep ok:", said, flush=True)
""")


# The tests that make the kernel refuse or need the growth: where RLIMIT_STACK is below about 3 MiB
# (`ulimit -s 1024`) the deep call overflows any stack, and a growth under 1 MiB fits in the room left.
needs_room = pytest.mark.skipif(main_stack_target() < 4 << 20, reason="RLIMIT_STACK below 4 MiB")


def _limited(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT)))


@needs_room
def test_a_grown_stack_serves_a_deep_call_after_the_heap_took_the_rest():
    grown = _limited(DEEP, "grow")
    assert grown.returncode == 0, grown.stderr
    assert "deep ok: the main thread's stack grown to" in grown.stdout
    # The control: the same call where the stack was not grown first is the crash the review saw.
    bare = _limited(DEEP, "none")
    assert bare.returncode == -11, (bare.returncode, bare.stderr[-500:])


@needs_room
def test_a_growth_the_kernel_refuses_is_an_error_naming_the_sizes():
    script = textwrap.dedent("""
        import mmap
        from dflash2.mainstack import grow_main_stack
        from dflash2.arena.shm import address_space
        limit, used = address_space()
        rest = mmap.mmap(-1, limit - used - (1 << 20))
        try:
            grow_main_stack()
        except OSError as e:
            print("refused:", e)
    """)
    out = _limited(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: [Errno 14] the main thread's stack could not grow from "), out.stdout
    assert f" bytes to {main_stack_target()}: Bad address" in out.stdout


def test_the_target_is_within_rlimit_stack():
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    target = main_stack_target()
    assert target == MAIN_STACK_BYTES if soft == resource.RLIM_INFINITY or soft > MAIN_STACK_BYTES \
        else target == soft - mmap.PAGESIZE


@needs_room
def test_start_up_refused_the_growth_exits_4_with_one_line_and_takes_nothing(tmp_path):
    """The kernel refuses for real: the address space is taken, all but 1 MiB, just before the growth."""
    path = write_config(tmp_path, memory={"nvme_capacity_mb": 0, "nvme_path": None},
                        daemon={"state_dir": str(tmp_path / "state")})
    run = textwrap.dedent(f"""
        import mmap, sys
        import dflash2.daemon.startup as startup
        from dflash2.arena.shm import address_space
        real = startup.grow_main_stack
        def grow():
            limit, used = address_space()
            rest = mmap.mmap(-1, limit - used - (1 << 20))
            try:
                return real()
            finally:
                rest.close()
        startup.grow_main_stack = grow
        from dflash2.daemon.main import main
        sys.exit(main(['--config', {str(path)!r}]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path), preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT)))
    try:
        _, err = proc.communicate(timeout=60)
    finally:  # (a daemon that grew its stack after all serves: stopped here)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 4, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        "dflash2d: error: cannot start: [Errno 14] the main thread's stack could not grow from"), err
    assert "under an address-space limit, ulimit -v, or a strict overcommit policy" in errors[0]
    assert "Traceback" not in err and "took" not in err and not glob.glob(f"/dev/shm/dflash2-{proc.pid}-*")


@pytest.mark.parametrize("limited", [True, False])
def test_a_serving_daemon_has_its_main_stack_grown(tmp_path, limited):
    """With or without a limit (a strict overcommit policy refuses a stack's growth too)."""
    path = write_config(tmp_path)
    limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))) if limited else None
    with open(tmp_path / "daemon.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash2.daemon.main", "--config", path], stdout=subprocess.PIPE,
                                stderr=log, text=True, cwd=str(tmp_path), preexec_fn=limit)
    stuck = threading.Timer(60, proc.kill)  # (a daemon that never says it serves)
    stuck.start()
    try:
        for line in proc.stdout:
            if line.startswith("DFlash2: enabled"):
                break
        span = stack_span(f"/proc/{proc.pid}/maps")
    finally:
        stuck.cancel()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    said = (tmp_path / "daemon.log").read_text()
    assert proc.returncode == 0, said
    assert span is not None and span[1] - span[0] >= main_stack_target() - mmap.PAGESIZE, (span, said)
    assert "the main thread's stack grown to" in said


def test_a_mapping_in_the_way_is_named_and_left_as_it_was():
    """A page mapped where the growth would write (or within the kernel's guard gap below): the write
    zeroed its byte, then "did not grow" (a review). Now refused before any write, the mapping named."""
    script = textwrap.dedent("""
        import ctypes, mmap
        from dflash2.mainstack import grow_main_stack, main_stack_target, stack_span
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        start, end = stack_span()
        at = (end - main_stack_target()) & ~(mmap.PAGESIZE - 1)
        MAP_FIXED_NOREPLACE = 0x100000
        got = libc.mmap(at, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
        assert got == at, (hex(at), got, ctypes.get_errno())
        ctypes.memset(at, 0x5A, 1)
        try:
            grow_main_stack()
        except OSError as e:
            print("refused:", e)
        print("byte:", ctypes.string_at(at, 1).hex(), "stack:", stack_span() == (start, end))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused: the main thread's stack could not grow from " in out.stdout, out.stdout
    assert "a mapping (anonymous, 0x" in out.stdout and "lies within its growth or the kernel's guard gap" in out.stdout
    assert out.stdout.rstrip().endswith("byte: 5a stack: True")
