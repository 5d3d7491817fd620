"""What a structured-output constraint may cost to prepare, judged from its JSON before it is compiled.

Shared by the router (refused at validation, before anything is sent) and the worker (refused before
its preparation threads compile it); imports nothing heavy, so any layer may use it.

llguidance's Earley parser holds at most ``MAX_ITEMS_IN_ROW`` items in one row (pinned in
``engine.grammar.LIMITS``). Inside a JSON object, every property that may come next is about four
items: an object of 600 optional properties (none ``required``) compiles, its first mask is computed,
and the parser then gives up at the object's first token ("Current row has 2399 items; max is 2000")
— a 500 after the compile, whose cost grows with the square of those properties (seconds at 64 KiB).
So an object schema of more optional properties than ``--max-optional-properties`` (default
``MAX_ITEMS_IN_ROW // 4`` = 500, the most that still run) is refused as a 400 naming the field, in
microseconds per kilobyte, before any such work.
"""

from __future__ import annotations

from typing import Any

from pdserve.errors import InvalidRequestError

MAX_ITEMS_IN_ROW = 2000
"""llguidance's row bound (its default), pinned by ``engine.grammar.LIMITS``."""
ITEMS_PER_OPTIONAL_PROPERTY = 4
"""A row's items per optional property of the object being parsed (measured: 4n - 1 for n)."""
DEFAULT_MAX_OPTIONAL_PROPERTIES = MAX_ITEMS_IN_ROW // ITEMS_PER_OPTIONAL_PROPERTY
MAX_OPTIONAL_PROPERTIES_HELP = (
    "a JSON schema (response_format, guided_json, a tool's parameters) with an object of more optional "
    "properties (not in its required) than this is refused with 400 naming the field, before it is "
    "compiled: the grammar engine's parser gives up on such an object at its first token, after seconds "
    "of compiling (default %(default)s, the most it runs)"
)

_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names to subschemas."""
_NOT_SCHEMAS = frozenset({"enum", "const", "required", "examples", "default", "x-guidance"})
"""Keywords whose values are data, never subschemas."""


def most_optional_properties(schema: Any) -> int:
    """The most optional properties (in ``properties``, not in ``required``) of any object schema
    within ``schema``, at any depth. Iterative: the router bounded its depth and size already."""
    most = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            most = max(most, sum(1 for name in props if name not in named))
        for key, value in node.items():
            if key in _SCHEMA_MAPS:
                if isinstance(value, dict):
                    stack.extend(value.values())
            elif key not in _NOT_SCHEMAS:
                stack.append(value)
    return most


def check_optional_properties(schema: Any, limit: int, param: str) -> None:
    """Raise InvalidRequestError naming ``param`` when an object in ``schema`` has more than
    ``limit`` optional properties."""
    found = most_optional_properties(schema)
    if found > limit:
        raise InvalidRequestError(
            f"{param} has an object of {found} optional properties; at most {limit} are allowed "
            "(--max-optional-properties): list the ones that must appear in its required, or split it",
            param,
        )
