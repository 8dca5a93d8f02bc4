"""Benchmark commands: each prints JSON figures (`dflash2 bench NAME --json`)."""

# The argparse types every bench uses (`from dflash2.bench import positive_int, ...`).
from dflash2.argtypes import non_negative_int, positive_float, positive_int  # noqa: F401


class OptionError(ValueError):
    """A benchmark option with a value it cannot run with; `dflash2 bench` prints it as a usage
    error (exit 2). Any other exception is a bug and keeps its traceback."""


class BenchFailed(RuntimeError):
    """A bench that could not finish its run (a client process it started died): `dflash2 bench`
    prints it as one error line, exit 1, and no figures (none of a partial run pass for a whole one)."""


KIB = 1024


def sizes_kib(text: str, multiple_kib: int = 1, repeats: bool = False) -> list[int]:
    """--sizes-kib: comma-separated sizes in KiB, each a positive multiple of `multiple_kib`; bytes.
    `repeats`: a size may come twice (a transfer mix's proportions: 16+16+64)."""
    sizes = []
    for item in text.split(","):
        try:
            kib = int(item)
        except ValueError:
            raise OptionError(f"--sizes-kib: {item!r} is not a number") from None
        if kib <= 0 or kib % multiple_kib:
            what = "size" if multiple_kib == 1 else f"multiple of {multiple_kib}"
            raise OptionError(f"--sizes-kib: {kib} is not a positive {what}")
        if kib * KIB in sizes and not repeats:  # (measured twice, one row each: a bench transfer review)
            raise OptionError(f"--sizes-kib: {kib} is given twice")
        sizes.append(kib * KIB)
    return sizes


def daemon_policy(name: str) -> str:
    """`--policy` of a bench that starts a daemon: a policy the daemon runs (not a bench-only one
    such as belady); OptionError naming the valid ones otherwise."""
    from dflash2.daemon.main import BENCH_ONLY_POLICIES
    from dflash2.policy import policy_names

    online = [p for p in policy_names() if p not in BENCH_ONLY_POLICIES]
    if name not in online:
        raise OptionError(f"--policy: {name!r} is not a policy the daemon runs; valid: {', '.join(online)}")
    return name


def visible_gpu(device: int, what: str):
    """cupy, once CUDA sees a GPU of this index; OptionError saying what is missing otherwise (a
    GPU bench on a machine without one is a command that cannot run here, not a bug)."""
    from dflash2.cuda import cupy
    from dflash2.errors import ArenaError

    try:
        cp = cupy()
    except ArenaError as exc:  # no CuPy
        raise OptionError(f"{what} runs on a GPU: {exc}") from None
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as exc:  # no driver, no device
        raise OptionError(f"{what} runs on a GPU, and CUDA sees none: {exc}") from None
    if device >= count:
        raise OptionError(f"{what}: GPU {device} asked for, CUDA sees {count}")
    return cp
