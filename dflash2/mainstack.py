"""The main thread's stack, grown up front where the address space is limited.

A thread's stack is mapped whole when the thread starts (RLIMIT_STACK's size: weighed by `--check`
and start-up, daemon/roomnow.py). The main thread's is not: the kernel grows it a page at a time as
calls go deeper, each growth taken from the address space there and then. Under a limit (RLIMIT_AS:
`ulimit -v`, systemd's LimitAS=) a daemon whose heap had taken the rest could not grow it, and the
first call that went deeper than any before died with a segmentation fault: a review's sweep, 4 KiB
blocks with `heat` at `ulimit -v 700000`, in heat's rescore after the tables' growth had failed
(MemoryError); reproduced with the heap exhausted and a call through a few thousand C frames.

Start-up grows it to MAIN_STACK_BYTES (RLIMIT_STACK where that is less) before taking anything, and
`--check` weighs the growth with the threads' stacks: an address space that has no room for it then
stops start-up with a clear line, not a crash while serving. Grown without a limit too: a strict
overcommit policy (vm.overcommit_memory 2) refuses a stack's growth as it refuses any other. The growth takes address space only:
the kernel extends the stack's mapping down to the one page written (through a read(2), so that a
refusal is an error, EFAULT, not a fault), and the pages between stay untouched until used.
"""

from __future__ import annotations

import mmap
import os

# What the main thread's stack is grown to (RLIMIT_STACK where less: the most it could ever grow).
# glibc gives each other thread RLIMIT_STACK (8 MiB by default), and Python's own recursion limit
# stops well within it.
MAIN_STACK_BYTES = 8 << 20
MAPS = "/proc/self/maps"


def stack_span(maps: str = MAPS) -> tuple[int, int] | None:
    """(start, end) addresses of the main thread's stack mapping ("[stack]" in /proc/self/maps), or
    None where it is not listed (not Linux)."""
    try:
        with open(maps) as f:
            for line in f:
                if line.rstrip().endswith("[stack]"):
                    start, end = line.split()[0].split("-")
                    return int(start, 16), int(end, 16)
    except OSError:
        return None
    return None


def main_stack_target() -> int:
    """The size the main thread's stack is grown to: MAIN_STACK_BYTES, or RLIMIT_STACK's soft limit
    less a page where that is smaller (a stack may not reach its limit)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    if soft == resource.RLIM_INFINITY or soft > MAIN_STACK_BYTES:
        return MAIN_STACK_BYTES
    return max(0, int(soft) - mmap.PAGESIZE)


def main_stack_short() -> int:
    """Bytes of address space the main thread's stack still takes to reach `main_stack_target`
    (0 where grown, or where the stack's mapping is not listed)."""
    span = stack_span()
    return 0 if span is None else max(0, main_stack_target() - (span[1] - span[0]))


def grow_main_stack() -> str | None:
    """Grow the main thread's stack to `main_stack_target` now: what was done, for the log; None
    where there was nothing to grow. OSError naming the sizes where the kernel refused (no room left
    under the limit, or a mapping in the way)."""
    import ctypes

    span, target = stack_span(), main_stack_target()
    if span is None or span[1] - span[0] >= target:
        return None
    lowest = (span[1] - target) & ~(mmap.PAGESIZE - 1)
    page = (ctypes.c_char * 1).from_address(lowest)  # (not touched here: the kernel writes it, below)
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        os.readv(fd, [page])  # (a fault the kernel cannot serve is EFAULT here, not a SIGSEGV)
    except OSError as exc:
        raise OSError(exc.errno, f"the main thread's stack could not grow from {span[1] - span[0]} bytes to "
                                 f"{span[1] - lowest}: {exc.strerror}") from None
    finally:
        os.close(fd)
    now = stack_span()
    grown = 0 if now is None else now[1] - now[0]
    if grown < span[1] - lowest:
        raise OSError(f"the main thread's stack did not grow: {grown} bytes after writing {span[1] - lowest} "
                      "below its top")
    return (f"the main thread's stack grown to {grown} bytes up front (it was {span[1] - span[0]}): under an "
            "address-space limit or strict overcommit, growing it while serving could fail, a crash")
