"""Outbox messages: what an instance publishes to a router's outbox, one ``StepOutput`` per engine step
holding each request's ``RequestDelta`` (tokens, logprobs, usage, timing, or the error that ended it)
(docs/design.md, "Outbox messages")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.errors import PdserveError
from pdserve.scheduler.message_schema import _Message, _Model

ANY_ATTEMPT = -1
"""``RequestDelta.attempt`` of events that end every attempt (e.g. the router lost Redis)."""


class TopLogprob(_Model):
    token_id: int
    token: str
    logprob: float


class LogprobInfo(_Model):
    """Logprob of one sampled (or prompt) token, with the requested number of best alternatives.

    ``logprob`` None: a prompt's first token, which nothing precedes. ``rank``: 1 + how many tokens
    are likelier (given for prompt tokens; vLLM's ``prompt_logprobs`` show it)."""

    token_id: int
    token: str
    logprob: float | None = None
    top: list[TopLogprob] = Field(default_factory=list)
    rank: int | None = None


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from a prefix cache (in splitwise: the prefill instance's)."""


class ErrorInfo(_Model):
    """A failure as it crosses processes: the ``kind`` of its class in :mod:`pdserve.errors`, the
    message, the request field it concerns, and whether another instance may succeed. The router
    maps the kind to an HTTP status and OpenAI body in one table; nobody else picks codes."""

    kind: str
    message: str
    param: str | None = None
    retryable: bool = False

    @classmethod
    def of(cls, error: PdserveError, *, retryable: bool = False) -> ErrorInfo:
        return cls(
            kind=error.kind, message=error.message or str(error), param=error.param, retryable=retryable
        )


class Timing(_Model):
    """Where the first token's time went, measured by the instance that produced it (its own clock).

    ``s_ttft_s``: from the ``generate`` reaching that instance to the engine sampling the first
    token (queueing in its engine included); ``queue_s``: the part of it the request waited in the
    engine before its first prefill chunk ran (the rest is prefill); ``kv_transfer_s``: the
    splitwise KV write that followed.
    """

    s_ttft_s: float
    queue_s: float | None = None
    kv_transfer_s: float | None = None


class RequestDelta(_Model):
    """What happened to one request: new tokens, its finish, or its failure.

    A finished request has ``finish_reason`` set (and ``usage``); a failed one has ``error`` set
    and ``finish_reason == "error"``. ``attempt`` lets the router drop events of a superseded try
    (:data:`ANY_ATTEMPT` applies to whichever attempt is current).
    """

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobInfo] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    attempt: int = 0
    timing: Timing | None = None  # on the delta that carries the first token
    prompt_text: str | None = None
    """The prompt's text, on the delta with the first token of a request that asked (``echo``)."""
    prompt_logprobs: list[LogprobInfo] | None = None
    """One per prompt token (the first without ``logprob``), on the delta with the first token of a
    request whose sampling asked (``prompt_logprobs``); in splitwise the prefill instance sends it."""
    seq: int | None = None
    """This delta's number within its attempt (0, 1, 2, ..., across prefill and decode): the router
    drops a number it already accepted (a send repeated by a retry) and fails the attempt on a gap.
    ``None``: not numbered (a failure, or an event the router made itself)."""

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @classmethod
    def failure(
        cls, request_id: str, error: PdserveError, *, retryable: bool = False, attempt: int = 0
    ) -> RequestDelta:
        """The final event of a request that failed with ``error``."""
        info = ErrorInfo.of(error, retryable=retryable)
        return cls(request_id=request_id, finish_reason="error", error=info, attempt=attempt)


class StepOutput(_Message):
    """Instance -> router outbox: one engine step's deltas for the requests of ONE router.

    The batched exception to the top-level ``request_id`` rule: each item carries its own. Events
    outside a step (a rejection before running, a prefill-side failure) use the same shape with one
    item, so a router handles exactly one event type.
    """

    type: Literal["step"] = "step"
    instance_id: str
    items: list[RequestDelta]
