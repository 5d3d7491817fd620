"""OpenAI request bodies: parsing, type checks, and conversion into what a worker runs.

pydantic checks only types (strict: ``"5"`` or ``true`` is not a number); value ranges are checked
by :class:`~pdserve.scheduler.sampling_params.SamplingParams` so they live in one place, except the
sizes of ``stop`` and ``stop_token_ids``, which are router settings (:class:`InputLimits`), and token
ids against the vocabulary, which only the live instances know (:meth:`ParsedRequest.check_vocab`).
Unknown fields are ignored. Every problem raises :class:`InvalidRequestError` whose ``param`` names
the field.

Chat requests without ``max_tokens``/``max_completion_tokens`` (and completions with an explicit
``"max_tokens": null``) send ``sampling["max_tokens"] = None``: the worker then generates up to
"model length - prompt length" tokens.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.errors import InvalidRequestError
from pdserve.scheduler.sampling_params import MAX_TOKEN_ID, SamplingParams

if TYPE_CHECKING:
    from pdserve.router.settings import RouterSettings

MAX_N = 16
"""Most choices per request (``n``); each is an independent request to the cluster."""
_UNBOUNDED = 2**31 - 1  # stands for "no max_tokens" while SamplingParams validates
_SEED_SPAN = 2**64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. ``strict`` is accepted and the schema is always enforced."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI's plus vLLM-style extras). ``None`` = default."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None
    """Extension (as vLLM's): each choice also carries the generated ``token_ids``."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    """Structured output (``response_format`` as OpenAI's, ``guided_*`` as vLLM's): :func:`_guided`."""


class CompletionRequest(_Common):
    """``POST /v1/completions``. ``prompt``: a string, token ids, or a list holding one of those."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``. The worker applies the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class InputLimits:
    """Sizes of request fields that the router bounds (from ``--max-stop-strings`` and friends)."""

    max_stop_strings: int
    max_stop_string_len: int
    max_stop_token_ids: int

    @classmethod
    def of(cls, settings: RouterSettings) -> InputLimits:
        return cls(settings.max_stop_strings, settings.max_stop_string_len, settings.max_stop_token_ids)

    def check(self, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
        """Raise InvalidRequestError naming ``stop`` or ``stop_token_ids`` when one is too large."""
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


@dataclasses.dataclass(slots=True)
class ParsedRequest:
    """A validated request, ready to be sent ``n`` times (one GenerateRequest per choice)."""

    kind: Literal["completion", "chat"]
    model: str | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    samplings: list[dict[str, Any]]
    """One ``SamplingParams`` dict per choice (seeded choices get ``seed + i``)."""
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool = False

    @property
    def n(self) -> int:
        return len(self.samplings)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise InvalidRequestError naming ``prompt`` or ``stop_token_ids`` when a token id is not
        below ``vocab_size`` (None: no instance said, nothing to check). Parsing already checked >= 0."""
        if vocab_size is None:
            return
        for name, ids in (
            ("prompt", self.prompt_token_ids),
            ("stop_token_ids", self.samplings[0]["stop_token_ids"]),
        ):
            if ids and (bad := max(ids)) >= vocab_size:
                raise InvalidRequestError(
                    f"token id {bad} in {name} is outside the model's vocabulary of {vocab_size} tokens", name
                )


def parse_completion(body: bytes, limits: InputLimits) -> ParsedRequest:
    """Validate a completions body; raise InvalidRequestError naming the bad field."""
    req = _validate(CompletionRequest, body)
    limits.check(req.stop, req.stop_token_ids)
    prompt, token_ids = _prompt(req.prompt)
    if req.echo:
        raise InvalidRequestError("echo is not supported", "echo")
    params = _sampling(req, req.max_tokens, "max_tokens", req.logprobs, "logprobs")
    return _parsed("completion", req, params, req.max_tokens is None, prompt=prompt, prompt_token_ids=token_ids,
                   logprobs=req.logprobs is not None)  # fmt: skip


def parse_chat(body: bytes, limits: InputLimits) -> ParsedRequest:
    """Validate a chat completions body; raise InvalidRequestError naming the bad field."""
    req = _validate(ChatCompletionRequest, body)
    limits.check(req.stop, req.stop_token_ids)
    if not req.messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    if req.max_completion_tokens is not None:
        max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_name = req.max_tokens, "max_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(req, max_tokens, max_name, num_logprobs, "top_logprobs")
    return _parsed("chat", req, params, max_tokens is None, messages=messages, logprobs=bool(req.logprobs))


def _validate(model: type[_Common], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None


def _invalid(e: ValidationError) -> InvalidRequestError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidRequestError(f"request body is not valid JSON: {err['msg']}", None)
    if not err["loc"]:
        return InvalidRequestError("request body must be a JSON object", None)
    param, in_union = _param(err["loc"])
    if err["type"] == "missing":
        return InvalidRequestError(f"{param} is required", param)
    field = param.rsplit(".", 1)[-1]
    if in_union and field in _UNION_SHAPES:
        return InvalidRequestError(f"invalid {param}: expected {_UNION_SHAPES[field]}", param)
    return InvalidRequestError(f"invalid {param}: {err['msg']}", param)


_UNION_SHAPES = {
    "prompt": "a string, a list of token ids, or a list holding one string or one list of token ids",
    "guided_json": "a JSON schema (an object, or a string holding one)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text content parts",
}


def _param(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """``('messages', 0, 'content', 'str')`` -> ``('messages[0].content', True)``: the field path, and
    whether pydantic tagged the error with a union member (then its message describes one member only).
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or part.startswith(("list[", "dict[", "function-")):
            return out, True
        else:
            out += f".{part}" if out else part
    return out, False


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _prompt(prompt: str | list[Any]) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    first = prompt[0]
    if isinstance(first, int):
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token ids must be in 0..{MAX_TOKEN_ID}, got {bad}", "prompt")
        return None, prompt
    if len(prompt) != 1:
        raise InvalidRequestError("batched prompts are not supported: send one prompt per request", "prompt")
    return (first, None) if isinstance(first, str) else _prompt(first)


def _message(index: int, m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content part of type {part.type!r} is not supported (text only)",
                    f"messages[{index}].content",
                )
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    return out


def _sampling(
    req: _Common, max_tokens: int | None, max_name: str, logprobs: int | None, logprobs_name: str
) -> SamplingParams:
    kwargs = {name: value for name in _SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
    kwargs["max_tokens"] = _UNBOUNDED if max_tokens is None else max_tokens
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if (guided := _guided(req)) is not None:
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
        found.append(("response_format", {"kind": "json", "spec": fmt.json_schema.schema_}))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"guided_json is not valid JSON: {e}", "guided_json") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("guided_json must be a JSON schema object", "guided_json")
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
    *,
    logprobs: bool,
    **prompt: Any,
) -> ParsedRequest:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}", "n")
    base = dict(vars(params))  # to_dict() (dataclasses.asdict) deep-copies: ~70 µs per request
    if unbounded:
        base["max_tokens"] = None  # the worker fills in "model length - prompt length"
    samplings = [base] + [_choice_sampling(base, i) for i in range(1, n)]
    stream = bool(req.stream)
    include_usage = bool(stream and req.stream_options is not None and req.stream_options.include_usage)
    return ParsedRequest(
        kind=kind, model=req.model, prompt=prompt.get("prompt"), prompt_token_ids=prompt.get("prompt_token_ids"),
        messages=prompt.get("messages"), samplings=samplings, stream=stream, include_usage=include_usage,
        logprobs=logprobs, return_token_ids=bool(req.return_token_ids),
    )  # fmt: skip


def _choice_sampling(base: dict[str, Any], i: int) -> dict[str, Any]:
    """Choice ``i`` of a seeded request uses ``seed + i`` (wrapped into the valid seed range)."""
    if base["seed"] is None:
        return base
    seed = base["seed"] + i
    if seed >= _SEED_SPAN:
        seed -= _SEED_SPAN
    return {**base, "seed": seed}
