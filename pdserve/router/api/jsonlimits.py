"""Bounds on the free-form JSON a client sends (schemas, tool parameters, tool-call arguments).

A value nested hundreds of levels deep parses, but then cannot be serialized into the inbox
message (pydantic's serializer stops near 255 levels) and, deeper, makes Python's recursive code
raise RecursionError. Every free-form value is therefore checked against :data:`MAX_JSON_DEPTH`
where it is parsed, iteratively, and refused with a 400 naming its field. (The request body itself
is parsed by pydantic-core, which refuses bodies nested deeper than ~200 levels with a 400.)

Numbers are bounded too: Python's ``int()`` refuses more than 4300 digits with a ValueError (a 500
where nobody maps it). pydantic-core refuses such a number in a body as "out of range" without
naming it (:func:`long_number_field` finds its field for the 400), and the JSON that comes inside a
string (``guided_json``, tool-call arguments) is parsed with numbers of at most
:data:`MAX_NUMBER_DIGITS` digits, before ``int()`` or ``float()`` sees them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pdserve.errors import InvalidRequestError

MAX_JSON_DEPTH = 64
"""Most levels of nested objects/arrays in one free-form value (a JSON schema, tool arguments)."""
MAX_NUMBER_DIGITS = 4300
"""Most digits of one JSON number (Python's own bound on ``int()`` of a string, and pydantic-core's
on a body's numbers)."""


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
    """``text`` parsed as JSON, at most ``limit`` levels deep and with numbers of at most
    MAX_NUMBER_DIGITS digits; InvalidRequestError naming ``param`` otherwise (never RecursionError,
    nor the ValueError of ``int()``)."""
    try:
        value = json.loads(text, parse_int=_bounded(int, param), parse_float=_bounded(float, param))
    except RecursionError:
        raise InvalidRequestError(f"{param} is nested more than {limit} levels deep", param) from None
    except InvalidRequestError:
        raise
    except ValueError as e:
        raise InvalidRequestError(f"{param} is not valid JSON: {e}", param) from None
    check_depth(value, param, limit)
    return value


class _TooLong:
    """Stands for a number of more than MAX_NUMBER_DIGITS digits in a parsed value."""


_TOO_LONG = _TooLong()


def _digits(text: str) -> int:
    return sum(c.isdigit() for c in text)


def _bounded(parse: Callable[[str], Any], param: str) -> Callable[[str], Any]:
    """``parse`` for numbers of at most MAX_NUMBER_DIGITS digits; InvalidRequestError naming ``param``
    for a longer one (before ``int()`` raises a ValueError of its own, or ``float()`` reads megabytes)."""

    def bounded(text: str) -> Any:
        if len(text) > MAX_NUMBER_DIGITS and _digits(text) > MAX_NUMBER_DIGITS:
            raise InvalidRequestError(
                f"{param} holds a number of more than {MAX_NUMBER_DIGITS} digits", param
            )
        return parse(text)

    return bounded


def long_number_field(body: bytes) -> str | None:
    """The field (``max_tokens``, ``prompt[2]``, ``logit_bias.17``) of the first number in the JSON
    ``body`` with more than MAX_NUMBER_DIGITS digits, which pydantic-core refused without naming it;
    None if there is none (or the body is not JSON after all). No number is converted: each stands
    for itself by its length only."""

    def number(text: str) -> Any:
        return _TOO_LONG if len(text) > MAX_NUMBER_DIGITS and _digits(text) > MAX_NUMBER_DIGITS else 0

    try:
        value = json.loads(body, parse_int=number, parse_float=number)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if item is _TOO_LONG:
            return path or None
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None
