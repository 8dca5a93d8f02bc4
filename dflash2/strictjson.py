"""JSON read as a config file is: a key named twice in one object is refused, by its dotted path.

Python's json keeps the last of two equal keys, silently: `"high": 0.9, "high": 0.95` would run on
0.95 whichever the user meant. The pairs hook sees one object's pairs, not where the object lies,
and three tiers have a `high`: an error naming only "high" did not say which (a review). So an
object that names a key twice is kept as parsed, marked, and found by a walk once the whole text is
read, in the file's order.

A request's header is read so too (protocol.py), once per call on the daemon's loop: the first parse
keeps no marks and walks nothing, its hook a dict of the pairs, compared in length; only a text that
names a key twice is read again, marked, to find where.
"""

from __future__ import annotations

import json


class KeyTwice(Exception):
    """`path` (dotted; `[i]` for a list's item) is named twice in one object; `parts`: its keys and
    list indexes one by one (a key with a dot, a newline or none at all cannot be told from `path`)."""

    def __init__(self, path: str, parts: tuple = ()):
        super().__init__(path)
        self.path = path
        self.parts = parts


class _Doubled(dict):
    key = ""  # the key it names twice (the first such)


class _Twice(Exception):
    """Some object of the text names a key twice (`_first`: where is found by a second parse)."""


def _first(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Twice
    return out


_FIRST = json.JSONDecoder(object_pairs_hook=_first)  # (json.loads with a hook builds a decoder per call)


def loads(text: str | bytes) -> object:
    """`json.loads(text)`; KeyTwice for the first key named twice in one object (json's own errors
    as json raises them)."""
    if isinstance(text, (bytes, bytearray)):  # (as json.loads reads bytes: UTF-8, -16 or -32, a BOM or none)
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    elif text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return decode(text)


def decode(text: str) -> object:
    """`loads` of a str, without json.loads' checks of its encoding: a BOM is not JSON (ValueError)."""
    try:
        return _FIRST.decode(text)
    except _Twice:
        pass
    parts = _doubled_path(json.JSONDecoder(object_pairs_hook=_pairs).decode(text))
    raise KeyTwice("".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(parts)),
                   parts)


def _pairs(pairs: list[tuple[str, object]]) -> dict:
    out, doubled = {}, None
    for key, value in pairs:
        if key in out and doubled is None:
            doubled = key
        out[key] = value
    if doubled is None:
        return out
    marked = _Doubled(out)
    marked.key = doubled
    return marked


def _doubled_path(data: object, path: tuple = ()) -> tuple | None:
    if isinstance(data, _Doubled):
        return (*path, data.key)
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _doubled_path(value, (*path, key))
        if found is not None:
            return found
    return None
