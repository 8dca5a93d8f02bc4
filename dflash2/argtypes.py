"""argparse `type=` functions of the operator commands (`dflash2 bench`, `history`, `status`): a bad
count, size or duration is a usage error naming the option (exit 2), not a ZeroDivisionError, a
negative sleep or a silently empty run deep inside the command."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    return _bounded(int, text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _bounded(int, text, 0, "an integer >= 0")


MAX_BLOCKS = 1 << 40  # a table of more blocks than this is no machine's (its metadata alone: tens of TB)


def block_count(text: str, low: int = 0) -> int:
    """A number of blocks from `low` to MAX_BLOCKS (a count past numpy's int64 ended a replay in a
    TypeError traceback, a review)."""
    value = _bounded(int, text, low, "a positive integer" if low else "an integer >= 0")
    if value > MAX_BLOCKS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BLOCKS} (2^40) blocks, got {text!r}")
    return value


def positive_block_count(text: str) -> int:
    return block_count(text, 1)


def positive_float(text: str) -> float:
    value = _bounded(float, text, 0.0, "a positive number")
    if not 0 < value < float("inf"):  # 0, inf and nan are no durations
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def block_kib(text: str) -> int:
    """A block size in KiB for the benches that make their own blocks: a power of two from 16 to 4096."""
    kib = positive_int(text)
    if kib & (kib - 1) or not 16 <= kib <= 4096:
        raise argparse.ArgumentTypeError(f"must be a power of two from 16 to 4096, not {kib}")
    return kib


MAX_SECONDS = 1e6  # about eleven days: longer waits are typing mistakes (and overflow sleep and poll)


def seconds(text: str) -> float:
    """A duration in seconds: positive and at most MAX_SECONDS."""
    value = positive_float(text)
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, {MAX_SECONDS:g}], got {text!r}")
    return value


def endpoint(text: str) -> str:
    """ipc://PATH or tcp://HOST:PORT (what `daemon.endpoint` accepts), a PATH as long as a socket's may be."""
    from dflash2.endpoints import check_socket_path, endpoint_parts

    try:
        endpoint_parts(text)
        check_socket_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _bounded(kind, text: str, low, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value
