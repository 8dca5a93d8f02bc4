"""A pydantic validation error of the config as the one line a user reads: `KEY: PROBLEM`, the key as
its dotted path (quoted where a key is empty, dotted or does not print), a misspelt key's nearest
valid name, and how to nest a dotted key written flat."""

from __future__ import annotations

import difflib
import json
import typing

from pydantic import BaseModel, ValidationError

from dflash2.errors import ConfigError


def first_error(exc: ValidationError, root: type[BaseModel]) -> ConfigError:
    """One ConfigError from pydantic's list for a config of model `root`: the first problem, keyed by
    its dotted path."""
    # A misspelt key also shows up as a missing one: name the misspelling first, it is the cause.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = first["loc"]
    key = dotted_key(loc)
    if first["type"] == "extra_forbidden":
        problem = "unknown key" + _suggestion(root, loc) + _nesting_hint(loc)
        if len(loc) == 1 and key != loc[0]:  # quoted: say where it is, so that it cannot read as a path
            key += " (at the top level)"
    elif first["type"] == "missing":
        problem = "required key is missing"
    elif first["type"] == "string_pattern_mismatch" and loc[:1] == ("layouts",) and loc[-1:] == ("[key]",):
        # (the layout name's pattern, which was all it said: `'^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'`)
        problem = (f"not a layout name: a letter or digit, then letters, digits, '.', '_' or '-', 64 characters at "
                   f"most (got {json.dumps(first['input'])}, {len(first['input'])} characters)")
    else:
        problem = first["msg"].removeprefix("Value error, ")
        if first["type"] == "float_type" and type(first.get("input")) is int:
            # (JSON allows 10**400: "should be a valid number" of a number, and no bound named)
            problem = "a number past a float's range" + _bounds(root, loc)
        if "input" in first and not isinstance(first["input"], (dict, list)):
            problem += f" (got {json.dumps(first['input'])})"
    if len(errors) > 1:
        problem += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return ConfigError(key or "config", problem)


def dotted_key(loc: tuple, markers: bool = True) -> str:
    """`loc` as a dotted path; `markers` False: `loc` is the file's own keys (no pydantic marker among
    them: a key named "[key]" is a key, dropped as the marker it named the object above it, a review)."""
    key = ""
    for part in loc:
        if markers and part == "[key]":  # pydantic's marker for a bad dict key: the key itself is already named
            continue
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            part = _key_text(str(part))
            key += f".{part}" if key else part
    return key


def _key_text(part: str) -> str:
    """A key as it goes into a dotted path: as is when that is unambiguous, else JSON-quoted (an
    empty key, one with a dot, a bracket (a list's index is written so), a quote, spaces at its ends or a
    character that does not print: the error stays one line and names exactly the key in the file)."""
    plain = part and part.isprintable() and part.strip() == part and not any(c in part for c in '.["\\')
    return part if plain else json.dumps(part)


def _nesting_hint(loc: tuple) -> str:
    """For a dotted key written flat (`"memory.dram_capacity_mb": 5`): how to write it nested."""
    last = loc[-1]
    if not isinstance(last, str) or "." not in last.strip(".") or not last.isprintable():
        return ""
    parts = last.split(".")
    nested = "".join(f'{{"{p}": ' for p in parts) + "..." + "}" * len(parts)
    return f"; keys are nested objects, not dotted names: write {nested}"


def _suggestion(root: type[BaseModel], loc: tuple) -> str:
    """`; did you mean `x`?` for a misspelt key, using the model that the key was found in."""
    model: object = root
    parts = list(loc[:-1])
    while parts:
        part = parts.pop(0)
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return ""
        annotation = model.model_fields[part].annotation
        if typing.get_origin(annotation) is dict and parts:
            parts.pop(0)  # the dict key (a layout name) is not a field
        model = _model_in(annotation)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _bounds(root: type[BaseModel], loc: tuple) -> str:
    """`; give a number >= 0 and <= 1`: the bounds of the field at `loc`, or "" where none is found."""
    model: object = root
    field = None
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return ""
        field = model.model_fields[part]
        model = _model_in(field.annotation)
    words = [f"{op} {getattr(m, attr):g}" for m in (field.metadata if field else ())
             for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
             if getattr(m, attr, None) is not None]
    return f"; give a number {' and '.join(words)}" if words else ""


def _model_in(annotation: object) -> object:
    """The pydantic model inside Optional[...] / dict[str, ...], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
