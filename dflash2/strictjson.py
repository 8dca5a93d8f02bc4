"""JSON read as a config file is: a key named twice in one object is refused, by its dotted path.

Python's json keeps the last of two equal keys, silently: `"high": 0.9, "high": 0.95` would run on
0.95 whichever the user meant. The pairs hook sees one object's pairs, not where the object lies,
and three tiers have a `high`: an error naming only "high" did not say which (a review). So an
object that names a key twice is kept as parsed, marked, and found by a walk once the whole text is
read, in the file's order.
"""

from __future__ import annotations

import json


class KeyTwice(Exception):
    """`path` (dotted; `[i]` for a list's item) is named twice in one object."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


class _Doubled(dict):
    key = ""  # the key it names twice (the first such)


def loads(text: str) -> object:
    """`json.loads(text)`; KeyTwice for the first key named twice in one object (json's own errors
    as json raises them)."""
    data = json.loads(text, object_pairs_hook=_pairs)
    if (doubled := _doubled_path(data)) is not None:
        raise KeyTwice(doubled)
    return data


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


def _doubled_path(data: object, path: str = "") -> str | None:
    if isinstance(data, _Doubled):
        return f"{path}.{data.key}" if path else data.key
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _doubled_path(value, f"{path}[{key}]" if isinstance(data, list) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None
