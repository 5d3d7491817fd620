"""Schemathesis hooks for ``test_fuzz.py`` (loaded by path through ``SCHEMATHESIS_HOOKS``): a
generated body may also come with one of its numbers made long (up to past the 4300 digits
Python's ``int()`` reads), one of its strings made of digits with a unit after them (as
``completion_window``'s count) or one of its mapping keys made of digits (as ``logit_bias``'s token
ids), or one of the number fields or numeric maps its operation's schema declares set long (a generated
body rarely has them), so that the fuzz reaches the number parsing of every field of every
route's body."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import schemathesis
from hypothesis import strategies as st

sys.set_int_max_str_digits(0)  # this process writes the long integers as JSON

DIGITS = (1, 10, 19, 20, 39, 309, 4300, 4301, 6000)
"""Lengths around every bound a number meets: 64 bits, a float's range, Python's int() limit."""
Path = tuple[Any, ...]


def sites(value: Any, path: Path = ()) -> Iterator[tuple[str, Path]]:
    """``(kind, path)`` of every number, string and mapping key in ``value``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield "key", (*path, key)
            yield from sites(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from sites(item, (*path, i))
    elif isinstance(value, bool):
        return
    elif isinstance(value, (int, float)):
        yield "number", path
    elif isinstance(value, str):
        yield "string", path


def mutated(body: Any, site: tuple[str, Path], digits: int, unit: str) -> Any:
    """A copy of ``body`` with the number, string or key at ``site`` made of ``digits`` digits."""
    kind, path = site
    long = "9" * digits
    new = _copy(body)
    parent = new
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if kind == "key":
        parent[long] = parent.pop(last)
    elif kind == "number":
        parent[last] = int(long)
    else:
        parent[last] = long + unit
    return new


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def numeric_fields(context: Any) -> list[tuple[str, str]]:
    """``(name, kind)`` of the top-level properties of the operation's JSON body schema that hold a
    number (``number``) or map keys to numbers (``map``: token ids, as ``logit_bias`` does)."""
    operation = getattr(context, "operation", None)
    found: list[tuple[str, str]] = []
    for body in getattr(operation, "body", None) or []:
        if "json" not in body.media_type:
            continue
        root = body.optimized_schema
        schema = _resolve(root, root)
        for name, prop in (schema.get("properties") or {}).items():
            options = [_resolve(root, o) for o in _resolve(root, prop).get("anyOf", [prop])]
            if any(o.get("type") in ("integer", "number") for o in options):
                found.append((name, "number"))
            elif any(
                _resolve(root, o.get("additionalProperties") or {}).get("type") == "number" for o in options
            ):
                found.append((name, "map"))
    return found


def _resolve(root: dict, schema: Any) -> dict:
    """``schema`` with its ``$ref`` (into the bundled schema ``root``) followed."""
    while isinstance(schema, dict) and "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema if isinstance(schema, dict) else {}


def with_long(body: Any, field: tuple[str, str], digits: int) -> Any:
    """``body`` (an object; else a new one) with ``field`` a number, or a map of one key, of ``digits`` digits."""
    new = _copy(body) if isinstance(body, dict) else {}
    name, kind = field
    new[name] = int("9" * digits) if kind == "number" else {"9" * digits: 1}
    return new


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
    strategies = [st.just(body)]
    found = list(sites(body)) if isinstance(body, (dict, list)) else []
    if found:
        strategies.append(
            st.builds(
                mutated,
                st.just(body),
                st.sampled_from(found),
                st.sampled_from(DIGITS),
                st.sampled_from(("", "s", "m", "h", "d")),
            )
        )
    fields = numeric_fields(context)
    if fields:  # the body schema's number fields and numeric maps, which a generated body rarely has
        strategies.append(
            st.builds(with_long, st.just(body), st.sampled_from(fields), st.sampled_from(DIGITS))
        )
    return st.one_of(*strategies)
