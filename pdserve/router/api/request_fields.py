"""Which fields each request object takes, and how a bad body is reported.

Every field of a request object is accounted for (:class:`FieldPolicy`: honoured, advisory,
rejected); an unknown one is refused. Every problem raises :class:`InvalidRequestError` whose
``param`` names the field.

The plain sampling fields of both bodies (:data:`SAMPLING_FIELDS`) are generated from
SamplingParams's declarations (sampling_params.py) and map onto its fields of the same name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pdserve.errors import InvalidRequestError
from pdserve.router.api.jsonlimits import MAX_NUMBER_DIGITS, long_number_field
from pdserve.sampling_params import SamplingField, declared


@dataclasses.dataclass(frozen=True)
class FieldPolicy:
    """What one request object does with each of its fields: every field of OpenAI's request
    models (and of pdserve's vLLM-style extras) is in exactly one class.

    ``honoured``: accepted and acted on. ``advisory``: accepted, type-checked and ignored, only where
    OpenAI documents the field as a hint or as bookkeeping on its side that changes no output
    (``user``, ``metadata``, ``store``: pdserve stores nothing, ``service_tier``: there is one tier,
    the prompt-cache hints). ``rejected``: a non-null value is a 400 naming the field, with the
    reason given here (``None``/``null`` means "not given"). A field in none of them is a 400 too.
    """

    honoured: frozenset[str]
    advisory: frozenset[str] = frozenset()
    rejected: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def fields(self) -> frozenset[str]:
        return self.honoured | self.advisory | frozenset(self.rejected)


SAMPLING_FIELDS: dict[str, SamplingField] = {f.name: how for f, how in declared() if how.request is not None}
"""The plain sampling fields of both bodies: the SamplingParams fields of the same name."""
EXTRAS = frozenset(
    {
        *(name for name, how in SAMPLING_FIELDS.items() if how.request == "extension"),
        "return_token_ids",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "response_format",  # OpenAI's on chat; on completions as vLLM takes it
    }
)
"""pdserve's vLLM-style extensions (honoured; OpenAI clients send them through ``extra_body``)."""
_COMMON = frozenset(
    {
        "model",
        "n",
        "stream",
        "stream_options",
        "max_tokens",
        *(name for name, how in SAMPLING_FIELDS.items() if how.request == "openai"),
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
    }
)
_GUIDED = {"guided_grammar": "pdserve takes no grammars: use guided_regex, guided_choice or a JSON schema"}
_FUNCTIONS = "deprecated by OpenAI: use tools and tool_choice"

COMPLETION_FIELDS = FieldPolicy(
    honoured=_COMMON | EXTRAS | {"prompt", "echo", "logprobs", "best_of"},
    advisory=frozenset({"user"}),
    rejected={"suffix": "pdserve does not fill in text before a suffix", **_GUIDED},
)
_CHAT_ADVISORY = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)
_CHAT_REJECTED = {
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "audio": "the model produces text only",
    "modalities": 'the model produces text only (["text"] is accepted)',
    "prediction": "pdserve does not use predicted outputs",
    "web_search_options": "pdserve does not search the web",
    "reasoning_effort": "the model does not reason",
    "verbosity": "pdserve does not steer verbosity",
    "moderation": "pdserve runs no moderation",
    **_GUIDED,
}
CHAT_FIELDS = FieldPolicy(
    honoured=_COMMON
    | EXTRAS
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
    advisory=_CHAT_ADVISORY,
    rejected=_CHAT_REJECTED,
)
MESSAGE_FIELDS = FieldPolicy(
    honoured=frozenset({"role", "content", "name", "tool_calls", "tool_call_id"}),
    rejected={
        "function_call": "deprecated by OpenAI: use tool_calls",
        "audio": "the model takes text only",
        "refusal": "the model takes text content only",
    },
)
STREAM_OPTIONS_FIELDS = FieldPolicy(
    honoured=frozenset({"include_usage"}), advisory=frozenset({"include_obfuscation"})
)
TEXT_PART_FIELDS = FieldPolicy(
    honoured=frozenset({"type", "text"}), advisory=frozenset({"prompt_cache_breakpoint"})
)
_DEFAULTS: dict[str, Any] = {"modalities": ["text"]}
"""Rejected fields whose value here means "the default" and is accepted."""

_M = TypeVar("_M", bound=BaseModel)


def validate_body(model: type[_M], body: bytes) -> _M:
    """``body`` as ``model``; InvalidRequestError naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e, body) from None


def unknown_field(param: str) -> str:
    """The message refusing the unknown field ``param``."""
    return f"unknown field {param} (pdserve refuses the fields it does not know rather than ignore them)"


def refuse(obj: BaseModel, policy: FieldPolicy, prefix: str = "") -> None:
    """Raise InvalidRequestError naming the first rejected field that ``obj`` has a value for."""
    given = obj.model_fields_set  # a field the body does not give holds its default
    if given.isdisjoint(policy.rejected):
        return
    for name, why in policy.rejected.items():
        if name not in given:
            continue
        value = getattr(obj, name)
        if value is not None and (name not in _DEFAULTS or value != _DEFAULTS[name]):
            raise InvalidRequestError(f"{prefix}{name} is not supported: {why}", prefix + name)


def _invalid(e: ValidationError, body: bytes) -> InvalidRequestError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        if _OUT_OF_RANGE in err["msg"] and (param := long_number_field(body)) is not None:
            return InvalidRequestError(
                f"invalid {param}: a number of more than {MAX_NUMBER_DIGITS} digits", param
            )
        return InvalidRequestError(f"request body is not valid JSON: {err['msg']}", None)
    if not err["loc"]:
        return InvalidRequestError("request body must be a JSON object", None)
    param, in_union = _param(err["loc"])
    if err["type"] == "missing":
        return InvalidRequestError(f"{param} is required", param)
    if err["type"] == "extra_forbidden":
        return InvalidRequestError(unknown_field(param), param)
    field = param.rsplit(".", 1)[-1]
    if in_union and field in _UNION_SHAPES:
        return InvalidRequestError(f"invalid {param}: expected {_UNION_SHAPES[field]}", param)
    return InvalidRequestError(f"invalid {param}: {err['msg']}", param)


_UNION_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "guided_json": "a JSON schema (an object, or a string holding one)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text content parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def _param(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """``('messages', 0, 'content', 'str')`` -> ``('messages[0].content', True)``: the field path, and
    whether pydantic tagged the error with a union member (then its message describes one member only).
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or part.startswith(("list[", "dict[", "function-", "literal[")):
            return out, True
        elif part[:1].isupper():  # a model member of a union (NamedToolChoice): its fields follow
            continue
        else:
            out += f".{part}" if out else part
    return out, False


_OUT_OF_RANGE = "number out of range"
"""How pydantic-core refuses a number of more than MAX_NUMBER_DIGITS digits (without its field)."""
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})
