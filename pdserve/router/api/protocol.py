"""OpenAI request bodies parsed into what a worker runs: its prompts and one SamplingParams per choice.

A body is checked against its model's types (request_models.py), its fields' policies
(request_fields.py), the router's size bounds (:class:`InputLimits`) and SamplingParams's value
ranges; its token ids against the vocabulary later, once the live instances tell its size
(:meth:`ParsedRequest.check_vocab`). Every problem raises InvalidRequestError naming the field.

Chat requests without ``max_tokens``/``max_completion_tokens`` (and completions with an explicit
``"max_tokens": null``) are sent with ``fill_max_tokens``: the worker then generates up to
"model length - prompt length" tokens.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Literal

from pdserve.errors import InvalidRequestError, RequestTooLongError
from pdserve.router.api.input_limits import InputLimits, check_prompt_chars
from pdserve.router.api.jsonlimits import check_depth, load_json
from pdserve.router.api.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MESSAGE_FIELDS,
    FieldPolicy,
    refuse,
    unknown_field,
    validate_body,
)
from pdserve.router.api.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CommonRequest,
    CompletionRequest,
)
from pdserve.router.api.tools import ToolUse, template_call, template_tools, tool_use_of
from pdserve.sampling_params import MAX_TOKEN_ID, MAX_TOKENS, SamplingParams, shown

MAX_N = 16
"""Most choices per prompt (``n``); each is an independent request to the cluster."""
_UNBOUNDED = MAX_TOKENS  # "no max_tokens" in SamplingParams: validated so, then replaced by the worker
_SEED_SPAN = 2**64


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
            f"best_of must equal n ({n}), got {shown(req.best_of)}: choosing the best of more samples is not supported",
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


def _validate(model: type[CommonRequest], body: bytes, policy: FieldPolicy) -> Any:
    req = validate_body(model, body)
    refuse(req, policy)
    return req


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
        raise InvalidRequestError(
            f"prompt token ids must be in 0..{MAX_TOKEN_ID}, got {shown(bad)}", "prompt"
        )
    return ids


def message_dict(index: int, m: ChatMessage) -> dict[str, Any]:
    """Message ``index`` as the chat template takes it (text parts joined; refused fields: a 400)."""
    where = f"messages[{index}]"
    refuse(m, MESSAGE_FIELDS, where + ".")
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
                raise InvalidRequestError(unknown_field(name), name)
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
    req: CommonRequest,
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


def _guided(req: CommonRequest) -> dict[str, Any] | None:
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
    req: CommonRequest,
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
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {shown(n)}", "n")
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
