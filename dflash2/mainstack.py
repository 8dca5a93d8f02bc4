"""The main thread's stack, grown up front at start-up.

A thread's stack is mapped whole when the thread starts (RLIMIT_STACK's size: weighed by `--check`
and start-up, daemon/roomnow.py). The main thread's is not: the kernel grows it a page at a time as
calls go deeper, each growth taken from the address space there and then. Under a limit (RLIMIT_AS:
`ulimit -v`, systemd's LimitAS=) a process whose heap has taken the rest cannot grow it, and the
first call that goes deeper than any before dies with a segmentation fault (reproduced with the
heap exhausted and a call through 600 C frames: tests/test_mainstack.py). (The crash a sweep found
in `heat`'s rescore at `ulimit -v 700000`, first taken for this one, was numpy's own, a later review
found: docs/known-gaps.md.)

Start-up grows it to MAIN_STACK_BYTES (RLIMIT_STACK less a page where that is no more) before taking
anything, and `--check` weighs the growth with the threads' stacks: an address space that has no
room for it then stops start-up with a clear line, not a crash while serving. Grown without a limit
too: a strict overcommit policy (vm.overcommit_memory 2) refuses a stack's growth as it refuses any
other. The growth takes address space only: the kernel extends the stack's mapping down to the one
page written (through a readv(2), so that a refusal is an error, EFAULT, not a fault), and the pages
between stay untouched until used. Only where nothing is mapped there or within the kernel's guard
gap below (another mapping would take the write instead, a review: a page mapped at the address on
purpose had a byte zeroed).
"""

from __future__ import annotations

import mmap
import os

# What the main thread's stack is grown to (RLIMIT_STACK less a page where that is no more: the most
# it could ever grow).
# glibc gives each other thread RLIMIT_STACK (8 MiB by default), and Python's own recursion limit
# stops well within it.
MAIN_STACK_BYTES = 8 << 20
MAPS = "/proc/self/maps"
# The gap the kernel keeps between a growing stack and the mapping below it (stack_guard_gap: 256
# pages by default); a mapping nearer than that stops the growth.
GUARD_GAP_BYTES = 1 << 20


def mappings(maps: str = MAPS) -> list[tuple[int, int, str]]:
    """(start, end, name) of each mapping in /proc/self/maps (empty where it cannot be read)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        start, end = fields[0].split("-")
        out.append((int(start, 16), int(end, 16), fields[5].strip() if len(fields) > 5 else ""))
    return out


def stack_span(maps: str | list[tuple[int, int, str]] = MAPS) -> tuple[int, int] | None:
    """(start, end) addresses of the main thread's stack mapping ("[stack]" in /proc/self/maps, or in
    `maps` as `mappings` read it), or None where it is not listed (not Linux)."""
    listed = mappings(maps) if isinstance(maps, str) else maps
    return next(((start, end) for start, end, name in listed if name == "[stack]"), None)


def main_stack_target() -> int:
    """The size the main thread's stack is grown to: MAIN_STACK_BYTES, or RLIMIT_STACK's soft limit
    less a page where that is no more (a stack may not reach its limit: the default, 8 MiB, too)."""
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

    listed, target = mappings(), main_stack_target()  # (read once)
    span = stack_span(listed)
    if span is None or span[1] - span[0] >= target:
        return None
    lowest = (span[1] - target) & ~(mmap.PAGESIZE - 1)
    below = [(start, end, name) for start, end, name in listed if end > lowest - GUARD_GAP_BYTES and start < span[0]]
    if below:  # (the write would land in it, or the kernel would refuse to grow into its gap)
        start, end, name = below[-1]
        raise OSError(f"the main thread's stack could not grow from {span[1] - span[0]} bytes to {span[1] - lowest}: "
                      f"a mapping ({name or 'anonymous'}, {start:#x}-{end:#x}) lies within its growth or the "
                      f"kernel's guard gap below it")
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
