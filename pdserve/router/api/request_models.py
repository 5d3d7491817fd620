"""The pydantic models of the OpenAI request bodies (and of /tokenize, /detokenize).

pydantic checks only types (strict: ``"5"`` or ``true`` is not a number); value ranges are checked
by :class:`~pdserve.sampling_params.SamplingParams` so they live in one place. Each model declares
exactly the fields of its :class:`~pdserve.router.api.request_fields.FieldPolicy`.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.json_schema import SkipJsonSchema

from pdserve.router.api.request_fields import SAMPLING_FIELDS
from pdserve.router.api.strict import StrictModel
from pdserve.router.api.tools import NamedToolChoice, Tool, ToolCall
from pdserve.sampling_params import SamplingParams

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


if TYPE_CHECKING:  # the fields are made at runtime: read them with CommonRequest.given_sampling()
    _SamplingBody = StrictModel
else:
    _SamplingBody = _sampling_body()


class CommonRequest(_SamplingBody):
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
    """Structured output (``response_format`` as OpenAI's, ``guided_*`` as vLLM's), read by the parser
    (protocol.py)."""
    guided_grammar: Rejected = None

    def given_sampling(self) -> dict[str, Any]:
        """The plain sampling fields the body sets (not null), by SamplingParams field name (a new
        dict each call)."""
        return {
            name: value
            for name in self.model_fields_set
            if name in SAMPLING_FIELDS and (value := getattr(self, name)) is not None
        }


class CompletionRequest(CommonRequest):
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


class ChatCompletionRequest(CommonRequest):
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
