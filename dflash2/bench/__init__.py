"""Benchmark commands: each prints JSON figures (`dflash2 bench NAME --json`)."""

import argparse


class OptionError(ValueError):
    """A benchmark option with a value it cannot run with; `dflash2 bench` prints it as a usage
    error (exit 2). Any other exception is a bug and keeps its traceback."""


# argparse `type=` of counts and sizes: a bad value is a usage error naming the option (exit 2), not
# a ZeroDivisionError (or a silently empty run) deep inside the benchmark.
def positive_int(text: str) -> int:
    return _bounded(int, text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _bounded(int, text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    value = _bounded(float, text, 0.0, "a positive number")
    if not 0 < value < float("inf"):  # 0, inf and nan are no durations
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _bounded(kind, text: str, low, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


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
