"""The daemon's logs: one JSON object per line for machines, or plain text for a terminal.

`logging.format: json` (the default) writes lines such as

    {"ts": "2025-01-01T12:00:00.123Z", "level": "info", "logger": "dflash2.swap",
     "event": "dflash2_swap", "msg": "dflash2_swap", "direction": "hbm->dram", "batches": 1, "blocks": 64, ...}

Every record carries `event`: the name of a structured event, or `log` for a plain message. Fields
passed in `extra=` become top-level keys. The events the daemon emits:

    dflash2_enabled   (the start-up line, `DFlash2: enabled, ...`, as its msg, on stdout: console_line)
    dflash2_warning   (a warning found before logging was set up: the environment, the config)
    dflash2_error     (why start-up failed, on stderr, before the exit code)
    dflash2_start     endpoint, device, total_bytes, committed_bytes, policy, metrics_port, history
    dflash2_fallback  what, reason          (a part the config asked for is not used: e.g. no GPU)
    dflash2_swap      direction, batches, blocks, failed, bytes, seconds, over_s   (batch moves: a
                      direction's first after a quiet spell at once, then one line per 10 s summing
                      those since; swaplog.py)
    dflash2_swap_batch  direction, blocks, failed, bytes, seconds   (each batch move, at debug)
    dflash2_shutdown  clients_released, uptime_s, signal   (the stop signal's name)

`logging.format: text` writes `TIME LEVEL LOGGER: MESSAGE key=value ...` with the same fields.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import sys
from typing import IO

# Attributes every LogRecord has; whatever else a record carries came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def record_fields(record: logging.LogRecord) -> dict:
    """The structured fields a record was given through `extra=` (`event` included)."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _timestamp(record: logging.LogRecord) -> str:
    t = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def console_line(fmt: str, message: str, *, level: str = "info", event: str = "log",
                 logger: str = "dflash2.daemon") -> str:
    """A line the daemon prints itself rather than logs (its start-up line on stdout; warnings and
    errors on stderr before its logging is set up, or when start-up fails): as it is in `text`
    format, and in `json` one JSON record with it as `msg`, so that the journal (stdout and stderr
    together) stays one JSON object per line for `jq`."""
    if fmt != "json":
        return message
    record = logging.LogRecord(logger, getattr(logging, level.upper()), "", 0, message, None, None)
    record.event = event
    return JsonFormatter().format(record)


_KEYS = ("ts", "level", "logger", "event", "msg", "exc")  # every record's own: no field replaces them


class JsonFormatter(logging.Formatter):
    """One strict JSON object per record, on one line; never raises on an odd field: an object JSON
    has no form for is repr'd, a non-finite float written as a string ("nan"; json.dumps wrote NaN,
    which strict parsers such as jq's refuse), a key that is not a string made one, and a field
    named as one of the record's own keys kept as `field_NAME` (it replaced the message or time)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record)
        out = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
               "event": fields.pop("event", "log"), "msg": record.getMessage()}
        out.update((f"field_{k}" if k in _KEYS else k, v) for k, v in fields.items())
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        try:
            return json.dumps(out, default=repr, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):  # (a non-finite float or a key of another kind, somewhere)
            return json.dumps(_strict(out), default=repr, separators=(",", ":"), allow_nan=False)


def silence_stdout() -> None:
    """Point stdout (fd 1) at /dev/null after a write to it failed (a reader gone, a full disk): the
    text still buffered there would fail again, in a traceback, at the interpreter's exit flush."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def _strict(value):
    """`value` with every non-finite float a string and every dict key a string, as JSON holds them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else _key(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _key(key) -> str:
    """A dict key as json.dumps writes it (3 -> "3", True -> "true", None -> "null"), else its repr."""
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return repr(key)


class TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER: MESSAGE key=value ...` for someone reading a terminal."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        fields.pop("event", None)
        if fields:
            extra = " ".join(f"{k}={v}" for k, v in fields.items())
            head, sep, tail = line.partition("\n")  # keep a traceback below the fields
            line = f"{head} {extra}{sep}{tail}"
        return line


def configure(fmt: str, level: str, stream: IO[str] | None = None) -> logging.Handler:
    """Route every logger of this process to one handler on `stream` (stderr) in `fmt`.

    The daemon is a process of its own, so it owns the root logger; earlier handlers are replaced."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return handler


def event(logger: logging.Logger, name: str, message: str | None = None, *, level: int = logging.INFO,
          **fields) -> None:
    """Log the structured event `name` with `fields` as top-level keys."""
    logger.log(level, message or name, extra={"event": name, **fields})
