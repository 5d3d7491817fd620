"""Schemathesis hooks for ``test_fuzz.py`` (loaded by path through ``SCHEMATHESIS_HOOKS``): a
generated JSON body may also come with one of its numbers made long (up to past the 4300 digits
Python's ``int()`` reads), one of its strings made of digits with a unit after them (as
``completion_window``'s count) or one of its mapping keys made of digits (as ``logit_bias``'s token
ids), so that the fuzz reaches the number parsing of every field of every route's body."""

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


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
    found = list(sites(body)) if isinstance(body, (dict, list)) else []
    if not found:
        return st.just(body)
    changed = st.builds(
        mutated,
        st.just(body),
        st.sampled_from(found),
        st.sampled_from(DIGITS),
        st.sampled_from(("", "s", "m", "h", "d")),
    )
    return st.one_of(st.just(body), changed)
