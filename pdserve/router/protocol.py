"""OpenAI request bodies: parsing, type checks, and conversion into what a worker runs.

pydantic checks only types (strict: ``"5"`` or ``true`` is not a number); value ranges are checked
by :class:`~pdserve.sampling_params.SamplingParams` so they live in one place, except the
sizes of ``stop`` and ``stop_token_ids``, which are router settings (:class:`InputLimits`), and token
ids against the vocabulary, which only the live instances know (:meth:`ParsedRequest.check_vocab`).
Every field is accounted for (:class:`FieldPolicy`: honoured, advisory, rejected); an unknown one is
refused. Every problem raises :class:`InvalidRequestError` whose ``param`` names the field.

The plain sampling fields of both bodies (:data:`SAMPLING_FIELDS`) are generated from
SamplingParams's declarations (sampling_params.py) and map onto its fields of the same name.

Chat requests without ``max_tokens``/``max_completion_tokens`` (and completions with an explicit
``"max_tokens": null``) are sent with ``fill_max_tokens``: the worker then generates up to
"model length - prompt length" tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.json_schema import SkipJsonSchema

from pdserve.errors import InvalidRequestError, RequestTooLongError
from pdserve.router.jsonlimits import check_depth, load_json
from pdserve.router.strict import StrictModel
from pdserve.router.tools import (
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolUse,
    template_call,
    template_tools,
    tool_use_of,
)
from pdserve.sampling_params import MAX_TOKEN_ID, SamplingField, SamplingParams, declared

if TYPE_CHECKING:
    from pdserve.router.settings import RouterSettings

MAX_N = 16
"""Most choices per prompt (``n``); each is an independent request to the cluster."""
_UNBOUNDED = 2**31 - 1  # "no max_tokens" in SamplingParams: validated so, then replaced by the worker
_SEED_SPAN = 2**64


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
Rejected = SkipJsonSchema[Any]
"""A field that is refused when given (kept out of /openapi.json: clients should not send it)."""


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``. ``strict`` is accepted and the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _sampling_body() -> type[StrictModel]:
    """A model of :data:`SAMPLING_FIELDS`, each optional (``None`` = SamplingParams's default), typed
    as its SamplingParams field unless declared otherwise (``body_type``)."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {
        name: ((how.body_type or hints[name]) | None, Field(None, description=how.help))
        for name, how in SAMPLING_FIELDS.items()
    }
    return create_model("SamplingBody", __base__=StrictModel, **fields)


if TYPE_CHECKING:  # the fields are made at runtime: read them with _Common.given_sampling()
    _SamplingBody = StrictModel
else:
    _SamplingBody = _sampling_body()


class _Common(_SamplingBody):
    """Fields shared by both endpoints (OpenAI's plus vLLM-style extras). ``None`` = default."""

    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    """Extension (as vLLM's): each choice also carries the generated ``token_ids``."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    """Structured output (``response_format`` as OpenAI's, ``guided_*`` as vLLM's): :func:`_guided`."""
    guided_grammar: Rejected = None

    def given_sampling(self) -> dict[str, Any]:
        """The plain sampling fields the body sets (not null), by SamplingParams field name (a new
        dict each call)."""
        return {
            name: value
            for name in self.model_fields_set
            if name in SAMPLING_FIELDS and (value := getattr(self, name)) is not None
        }


class CompletionRequest(_Common):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of
    token-id lists; each prompt gets ``n`` choices."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    """The completion's text starts with the prompt's; with ``logprobs``, its logprobs cover the
    prompt's tokens first (the first one's null). ``max_tokens`` 0 is allowed then: only the prompt."""
    best_of: int | None = None
    """Accepted when it equals ``n`` (the default): choosing the best of more samples is not done."""
    suffix: Rejected = None


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are taken (other types: a 400)."""

    model_config = ConfigDict(extra="allow", strict=True)  # other part types have other fields
    type: str
    text: str | None = None
    prompt_cache_breakpoint: Any = None


class ChatMessage(StrictModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    """Which call a ``tool`` message answers."""
    function_call: Rejected = None
    audio: Rejected = None
    refusal: Rejected = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``. The worker applies the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Rejected = None
    function_call: Rejected = None
    audio: Rejected = None
    modalities: Rejected = None
    prediction: Rejected = None
    web_search_options: Rejected = None
    reasoning_effort: Rejected = None
    verbosity: Rejected = None
    moderation: Rejected = None


class TokenizeRequest(StrictModel):
    """vLLM's two forms in one: ``prompt`` (completions) or ``messages`` (chat, with ``tools``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for chat (the template writes them)."""
    add_generation_prompt: bool | None = None
    """Chat only (default true): end with the assistant's turn opening, as generation does."""
    return_token_strs: bool | None = None
    """Only false is accepted: per-token strings are not returned."""


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class InputLimits:
    """Sizes of request fields that the router bounds (from ``--max-stop-strings`` and friends)."""

    max_stop_strings: int
    max_stop_string_len: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_prompts: int
    """Most choices (prompts x n) one request fans out to."""
    max_grammar_bytes: int = 64 * 1024
    """Largest structured-output constraint or ``tools``, in bytes of JSON (a worker compiles it)."""
    chars_per_token: int = 32
    """``--max-prompt-chars-per-token``: see :func:`check_prompt_chars`."""

    @classmethod
    def of(cls, settings: RouterSettings) -> InputLimits:
        return cls(
            settings.max_stop_strings,
            settings.max_stop_string_len,
            settings.max_stop_token_ids,
            settings.max_logit_bias,
            settings.max_prompts_per_request,
            settings.max_grammar_bytes,
            settings.max_prompt_chars_per_token,
        )

    def check(self, req: _Common) -> None:
        """Raise InvalidRequestError naming ``stop``, ``stop_token_ids``, ``logit_bias`` or a grammar
        field when one is too large."""
        self.check_grammars(req)
        given = req.given_sampling()
        stop, stop_token_ids, logit_bias = (
            given.get("stop"),
            given.get("stop_token_ids"),
            given.get("logit_bias"),
        )
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise InvalidRequestError(
                f"at most {self.max_stop_strings} stop strings are allowed, got {len(stops)}", "stop"
            )
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_len:
            raise InvalidRequestError(
                f"a stop string may be at most {self.max_stop_string_len} characters, got {longest}", "stop"
            )
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequestError(
                f"at most {self.max_stop_token_ids} stop_token_ids are allowed, got {len(stop_token_ids)}",
                "stop_token_ids",
            )
        if logit_bias is not None and len(logit_bias) > self.max_logit_bias:
            raise InvalidRequestError(
                f"at most {self.max_logit_bias} logit_bias entries are allowed, got {len(logit_bias)}",
                "logit_bias",
            )

    def check_grammars(self, req: _Common) -> None:
        """Raise InvalidRequestError naming the structured-output field (or ``tools``) whose JSON is
        larger than ``max_grammar_bytes``: a worker compiles it, and a huge schema stalls its engine."""
        fmt = req.response_format
        tools = getattr(req, "tools", None)  # chat only
        for param, value in (
            (
                "response_format.json_schema.schema",
                fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
            ),
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice),
            ("tools", [t.model_dump(exclude_none=True) for t in tools] if tools else None),
        ):
            if value is not None and (size := json_bytes(value)) > self.max_grammar_bytes:
                raise InvalidRequestError(
                    f"{param} is {size} bytes of JSON; at most {self.max_grammar_bytes} are allowed "
                    "(--max-grammar-bytes)",
                    param,
                )

    def check_choices(self, num_prompts: int, n: int) -> None:
        """Raise InvalidRequestError naming ``prompt`` (or ``n``) when prompts x n is above the bound."""
        if num_prompts * n > self.max_prompts:
            what = f"{num_prompts} prompts x n = {n}" if num_prompts > 1 else f"n = {n}"
            raise InvalidRequestError(
                f"a request may ask for at most {self.max_prompts} choices (prompts x n), got {what}",
                "prompt" if num_prompts > 1 else "n",
            )


def json_bytes(value: Any) -> int:
    """The size of ``value`` as compact JSON (a string: its UTF-8 bytes)."""
    if isinstance(value, str):
        return len(value.encode())
    try:
        return len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):  # an integer past 64 bits, nesting past 255
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def check_prompt_chars(chars: int, param: str, max_model_len: int | None, chars_per_token: int) -> None:
    """Raise RequestTooLongError naming ``param`` when ``chars`` characters cannot fit into
    ``max_model_len`` tokens (None: no instance said, nothing to check).

    Judged without a tokenizer: the prompt would need tokens of more than ``chars_per_token``
    characters *on average*; real text averages about 4 and no usual vocabulary has tokens near 32,
    so a prompt that could fit is never refused. Refusing here keeps a worker from tokenizing
    megabytes on its engine thread only to refuse them (it would stall, and be retried elsewhere).
    """
    if max_model_len is not None and chars > max_model_len * chars_per_token:
        raise RequestTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; {param} holds {chars} "
            f"characters, more than {max_model_len} tokens of up to {chars_per_token} characters "
            "(--max-prompt-chars-per-token) can hold",
            param,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """One prompt as a worker takes it: exactly one of the three is set."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    """Chat only: the tool definitions the chat template renders."""

    def check_length(self, max_model_len: int, chars_per_token: int) -> None:
        """Raise RequestTooLongError when this prompt can never fit into ``max_model_len`` tokens
        (token ids: a prompt needs room for one generated token; text: :func:`check_prompt_chars`)."""
        if self.token_ids is not None:
            if len(self.token_ids) >= max_model_len:
                raise RequestTooLongError(
                    f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                    f"{len(self.token_ids)} tokens, leaving none to generate",
                    "prompt",
                )
        elif self.text is not None:
            check_prompt_chars(len(self.text), "prompt", max_model_len, chars_per_token)
        elif self.messages is not None:
            chars = sum(len(m.get("content") or "") for m in self.messages)
            check_prompt_chars(chars, "messages", max_model_len, chars_per_token)


@dataclasses.dataclass(slots=True)
class ParsedRequest:
    """A validated request: ``n`` choices (one GenerateRequest each) for each of its prompts."""

    kind: Literal["completion", "chat"]
    model: str | None
    prompts: list[ParsedPrompt]
    samplings: list[SamplingParams]
    """One per choice of a prompt (seeded choices get ``seed + i``)."""
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool = False
    echo: bool = False
    """Each choice's text starts with its prompt's text (with ``logprobs``: its logprobs start
    with the prompt's, ``SamplingParams.prompt_logprobs`` asked from the worker)."""
    echo_only: bool = False
    """``echo`` with ``max_tokens`` 0 (scoring the prompt): the worker generates one token, which the
    router leaves out of the choice (its text, token and logprob; ``completion_tokens`` 0)."""
    prompt_logprobs: bool = False
    """The client asked for vLLM's ``prompt_logprobs``: each choice carries them in vLLM's shape."""
    tool_use: ToolUse | None = None
    """Chat with tools (``tool_choice`` other than none): how the output is read as tool calls."""
    fill_max_tokens: bool = False
    """No ``max_tokens`` was given: the worker fills in the model length minus the prompt length
    (``GenerateRequest.fill_max_tokens``; ``max_tokens`` of the samplings is a placeholder)."""

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return len(self.samplings)

    def choices(self) -> list[tuple[ParsedPrompt, SamplingParams]]:
        """Every choice in OpenAI's order: choice ``i`` of prompt ``p`` has index ``p * n + i``."""
        return [(prompt, sampling) for prompt in self.prompts for sampling in self.samplings]

    def check_length(self, max_model_len: int | None, chars_per_token: int) -> None:
        """Raise RequestTooLongError (400 ``context_length_exceeded``) naming ``prompt`` or
        ``messages`` when a prompt can never fit into ``max_model_len`` (None: nothing to check)."""
        if max_model_len is not None:
            for prompt in self.prompts:
                prompt.check_length(max_model_len, chars_per_token)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise InvalidRequestError naming ``prompt``, ``stop_token_ids`` or ``logit_bias`` when a token
        id is not below ``vocab_size`` (None: no instance said, nothing to check). Parsing already
        checked >= 0."""
        if vocab_size is None:
            return
        sampling = self.samplings[0]
        for name, ids in (
            *(("prompt", p.token_ids) for p in self.prompts),
            ("stop_token_ids", sampling.stop_token_ids),
            ("logit_bias", sampling.logit_bias),
        ):
            if ids and (bad := max(ids)) >= vocab_size:
                raise InvalidRequestError(
                    f"token id {bad} in {name} is outside the model's vocabulary of {vocab_size} tokens", name
                )


def parse_completion(body: bytes, limits: InputLimits) -> ParsedRequest:
    """Validate a completions body; raise InvalidRequestError naming the bad field."""
    req = _validate(CompletionRequest, body, COMPLETION_FIELDS)
    limits.check(req)
    prompts = _prompts(req.prompt)
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise InvalidRequestError(
            f"best_of must equal n ({n}), got {req.best_of}: choosing the best of more samples is not supported",
            "best_of",
        )
    echo_only = bool(req.echo) and req.max_tokens == 0  # OpenAI's way to score a prompt
    prompt_logprobs = req.logprobs if req.echo else None  # legacy echo + logprobs covers the prompt
    max_tokens = 1 if echo_only else req.max_tokens
    params = _sampling(
        req, max_tokens, "max_tokens", req.logprobs, "logprobs", prompt_logprobs=prompt_logprobs
    )
    parsed = _parsed(
        "completion",
        req,
        params,
        req.max_tokens is None,
        prompts,
        limits,
        logprobs=req.logprobs is not None,
        echo=bool(req.echo),
    )
    parsed.echo_only = echo_only
    return parsed


def parse_chat(body: bytes, limits: InputLimits) -> ParsedRequest:
    """Validate a chat completions body; raise InvalidRequestError naming the bad field."""
    req = _validate(ChatCompletionRequest, body, CHAT_FIELDS)
    limits.check(req)
    if not req.messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    messages = [message_dict(i, m) for i, m in enumerate(req.messages)]
    if req.max_completion_tokens is not None:
        max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_name = req.max_tokens, "max_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tool_use = tool_use_of(req.tools, req.tool_choice, req.parallel_tool_calls)
    guided = tool_use.guided() if tool_use is not None else None
    if tool_use is not None and guided is not None and _guided(req) is not None:
        raise InvalidRequestError(
            f"tool_choice {tool_use.mode!r} constrains the output itself: it cannot be combined with "
            "response_format or guided_*",
            "tool_choice",
        )
    params = _sampling(req, max_tokens, max_name, num_logprobs, "top_logprobs", guided)
    tools = template_tools(req.tools or []) if tool_use is not None else None
    parsed = _parsed(
        "chat",
        req,
        params,
        max_tokens is None,
        [ParsedPrompt(messages=messages, tools=tools)],
        limits,
        logprobs=bool(req.logprobs),
    )
    parsed.tool_use = tool_use
    return parsed


def _validate(model: type[_Common], body: bytes, policy: FieldPolicy) -> Any:
    req = validate_body(model, body)
    _refuse(req, policy)
    return req


def validate_body(model: type[_M], body: bytes) -> _M:
    """``body`` as ``model``; InvalidRequestError naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None


def _unknown(param: str) -> str:
    return f"unknown field {param} (pdserve refuses the fields it does not know rather than ignore them)"


def _refuse(obj: BaseModel, policy: FieldPolicy, prefix: str = "") -> None:
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


def _invalid(e: ValidationError) -> InvalidRequestError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidRequestError(f"request body is not valid JSON: {err['msg']}", None)
    if not err["loc"]:
        return InvalidRequestError("request body must be a JSON object", None)
    param, in_union = _param(err["loc"])
    if err["type"] == "missing":
        return InvalidRequestError(f"{param} is required", param)
    if err["type"] == "extra_forbidden":
        return InvalidRequestError(_unknown(param), param)
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


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _prompts(prompt: str | list[Any]) -> list[ParsedPrompt]:
    """The prompts of a completions body (pydantic already checked the shape: one kind per list)."""
    if isinstance(prompt, str):
        return [ParsedPrompt(text=prompt)]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [ParsedPrompt(token_ids=_token_ids(prompt))]
    return [
        ParsedPrompt(text=p) if isinstance(p, str) else ParsedPrompt(token_ids=_token_ids(p)) for p in prompt
    ]


def _token_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise InvalidRequestError("a prompt of token ids must not be empty", "prompt")
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token ids must be in 0..{MAX_TOKEN_ID}, got {bad}", "prompt")
    return ids


def message_dict(index: int, m: ChatMessage) -> dict[str, Any]:
    """Message ``index`` as the chat template takes it (text parts joined; refused fields: a 400)."""
    where = f"messages[{index}]"
    _refuse(m, MESSAGE_FIELDS, where + ".")
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported: the model takes text only",
                    f"{where}.content",
                )
            if part.text is None:
                raise InvalidRequestError("a text content part needs its text", f"{where}.content[{j}].text")
            if part.model_extra:
                name = f"{where}.content[{j}].{next(iter(part.model_extra))}"
                raise InvalidRequestError(_unknown(name), name)
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls is not None:
        out["tool_calls"] = [
            template_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(m.tool_calls)
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _sampling(
    req: _Common,
    max_tokens: int | None,
    max_name: str,
    logprobs: int | None,
    logprobs_name: str,
    guided: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """``guided``: a constraint the request's tools make (else its structured-output fields');
    ``prompt_logprobs``: asked by another field (echo), unless the body gives it itself."""
    kwargs = req.given_sampling()
    kwargs["max_tokens"] = _UNBOUNDED if max_tokens is None else max_tokens
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs.setdefault("prompt_logprobs", prompt_logprobs)
    if (guided := guided or _guided(req)) is not None:
        kwargs["guided"] = guided
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        renamed = {"max_tokens": max_name, "logprobs": logprobs_name}.get(e.param or "", e.param)
        raise InvalidRequestError(e.message.replace(e.param or "", renamed or "", 1), renamed) from None


def _guided(req: _Common) -> dict[str, Any] | None:
    """The structured-output constraint (``SamplingParams.guided``) of ``response_format`` or one
    ``guided_*`` field; at most one of them may constrain the output."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"kind": "json", "spec": {"type": "object"}}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError(
                "response_format.json_schema is required when type is json_schema",
                "response_format.json_schema",
            )
        check_depth(fmt.json_schema.schema_, "response_format.json_schema.schema")
        found.append(("response_format", {"kind": "json", "spec": fmt.json_schema.schema_}))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            schema = load_json(schema, "guided_json")
            if not isinstance(schema, dict):
                raise InvalidRequestError("guided_json must be a JSON schema object", "guided_json")
        else:
            check_depth(schema, "guided_json")
        found.append(("guided_json", {"kind": "json", "spec": schema}))
    if req.guided_regex is not None:
        if not req.guided_regex:
            raise InvalidRequestError("guided_regex must not be empty", "guided_regex")
        found.append(("guided_regex", {"kind": "regex", "spec": req.guided_regex}))
    if req.guided_choice is not None:
        if not req.guided_choice or not all(req.guided_choice):
            raise InvalidRequestError(
                "guided_choice must be a non-empty list of non-empty strings", "guided_choice"
            )
        found.append(("guided_choice", {"kind": "choice", "spec": list(req.guided_choice)}))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise InvalidRequestError(
            f"only one structured-output constraint may be given, got {names}", found[1][0]
        )
    return found[0][1] if found else None


def _parsed(
    kind: Literal["completion", "chat"],
    req: _Common,
    params: SamplingParams,
    unbounded: bool,
    prompts: list[ParsedPrompt],
    limits: InputLimits,
    *,
    logprobs: bool,
    echo: bool = False,
) -> ParsedRequest:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}", "n")
    limits.check_choices(len(prompts), n)
    samplings = [params] + [_choice_sampling(params, i) for i in range(1, n)]
    stream = bool(req.stream)
    include_usage = bool(stream and req.stream_options is not None and req.stream_options.include_usage)
    return ParsedRequest(
        kind=kind,
        model=req.model,
        prompts=prompts,
        samplings=samplings,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        return_token_ids=bool(req.return_token_ids),
        echo=echo,
        prompt_logprobs="prompt_logprobs" in req.given_sampling(),
        fill_max_tokens=unbounded,
    )


def _choice_sampling(base: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of a seeded request uses ``seed + i`` (wrapped into the valid seed range): a
    copy of the validated ``base``, valid by construction, so not validated again."""
    if base.seed is None:
        return base
    seed = base.seed + i
    if seed >= _SEED_SPAN:
        seed -= _SEED_SPAN
    choice = copy.copy(base)
    choice.seed = seed
    return choice
