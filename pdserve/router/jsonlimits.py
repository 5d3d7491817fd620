"""Bounds on the free-form JSON a client sends (schemas, tool parameters, tool-call arguments).

A value nested hundreds of levels deep parses, but then cannot be serialized into the inbox
message (pydantic's serializer stops near 255 levels) and, deeper, makes Python's recursive code
raise RecursionError. Every free-form value is therefore checked against :data:`MAX_JSON_DEPTH`
where it is parsed, iteratively, and refused with a 400 naming its field. (The request body itself
is parsed by pydantic-core, which refuses bodies nested deeper than ~200 levels with a 400.)
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.errors import InvalidRequestError

MAX_JSON_DEPTH = 64
"""Most levels of nested objects/arrays in one free-form value (a JSON schema, tool arguments)."""


def check_depth(value: Any, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise InvalidRequestError naming ``param`` when ``value`` nests more than ``limit`` levels
    of objects/arrays (iterative: any depth is safe to check)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise InvalidRequestError(f"{param} is nested more than {limit} levels deep", param)
        stack.extend((child, depth + 1) for child in children)


def load_json(text: str, param: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """``text`` parsed as JSON, at most ``limit`` levels deep; InvalidRequestError naming ``param``
    otherwise (never RecursionError)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(f"{param} is nested more than {limit} levels deep", param) from None
    except ValueError as e:
        raise InvalidRequestError(f"{param} is not valid JSON: {e}", param) from None
    check_depth(value, param, limit)
    return value
