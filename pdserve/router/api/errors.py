"""The router's errors and the ONE place where pdserve's exception tree becomes an OpenAI error body.

The router adds a few leaves to the tree of :mod:`pdserve.errors` (HTTP-only situations)::

    PdserveError
    ├── InvalidRequestError
    │   ├── ModelNotFoundError     the requested model is not served by any live instance -> 404
    │   ├── BodyTooLargeError      the body exceeds --max-body-bytes (a file --max-file-bytes) -> 413
    │   └── AuthenticationError    no valid API key (--api-key) -> 401
    ├── OverloadedError            --max-in-flight running and --max-queued waiting -> 429 + Retry-After
    ├── NoCapacityError            nothing can serve the request now -> 503 + Retry-After
    └── UpstreamError              a worker's ErrorInfo: mapped by its ``kind``, like a local error

:func:`error_status` maps any exception to ``(status, body, headers)``; ``tests/router/test_router_errors.py``
fails when a class of the tree (and so a ``kind`` any producer can send) has no deliberate entry
in :data:`ERROR_MAP`.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from pdserve.errors import (
    ClientDisconnectedError,
    ConfigError,
    ConflictError,
    ControlPlaneError,
    ControlPlaneFullError,
    ControlPlaneRestartedError,
    EngineError,
    InstanceLostError,
    InvalidRequestError,
    KVChecksumError,
    MessageError,
    NotFoundError,
    PdserveError,
    QuotaExceededError,
    RequestTimeoutError,
    RequestTooLongError,
    RouterStoppingError,
    TransferError,
    UnavailableError,
    class_of_kind,
)
from pdserve.scheduler.outbox_messages import ErrorInfo

RETRY_AFTER_S = 1
"""``Retry-After`` of 503 answers: the live set refreshes twice a second, a retry soon may succeed."""


class ModelNotFoundError(InvalidRequestError):
    """No live instance serves the requested model (OpenAI answers 404 ``model_not_found``)."""

    kind = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or is not served by any live instance.", "model"
        )


class BodyTooLargeError(InvalidRequestError):
    """The request body (or ``what`` in it, such as an uploaded file) is larger than the router accepts."""

    kind = "request_too_large"

    def __init__(self, limit: int, what: str = "request body", param: str | None = None) -> None:
        super().__init__(f"{what} exceeds the limit of {limit} bytes", param)


class AuthenticationError(InvalidRequestError):
    """The request did not carry one of the router's API keys (OpenAI answers 401 ``invalid_api_key``)."""

    kind = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__(
            "Incorrect or missing API key: send one of this router's keys as 'Authorization: Bearer KEY'",
            None,
        )


class OverloadedError(PdserveError, RuntimeError):
    """This router runs --max-in-flight requests and --max-queued wait already (OpenAI's 429)."""

    kind = "rate_limit_exceeded"

    def __init__(self, limit: int, queue: int) -> None:
        super().__init__(
            f"this router is at its limit ({limit} requests running, {queue} waiting); retry shortly", None
        )


class NoCapacityError(PdserveError, RuntimeError):
    """No instance (pair) can take the request now: none registered, all draining, or only prefill."""

    kind = "no_capacity"


class UpstreamError(PdserveError, RuntimeError):
    """Another process ended the request; ``info.kind`` names the class of the tree it raised."""

    kind = "upstream"  # never sent: its info's kind is what is mapped

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message, info.param)
        self.info = info


@dataclass(frozen=True)
class ErrorKind:
    """How one exception class is shown to an OpenAI client."""

    status: int
    type: str
    code: str | None = None
    retry_after: bool = False


ERROR_MAP: dict[type[BaseException], ErrorKind] = {
    PdserveError: ErrorKind(500, "server_error", "internal_error"),
    ConfigError: ErrorKind(500, "server_error", "configuration_error"),
    InvalidRequestError: ErrorKind(400, "invalid_request_error"),
    RequestTooLongError: ErrorKind(400, "invalid_request_error", "context_length_exceeded"),
    ModelNotFoundError: ErrorKind(404, "invalid_request_error", "model_not_found"),
    NotFoundError: ErrorKind(404, "invalid_request_error", "not_found"),
    ConflictError: ErrorKind(409, "invalid_request_error", "conflict"),
    BodyTooLargeError: ErrorKind(413, "invalid_request_error", "request_too_large"),
    AuthenticationError: ErrorKind(401, "invalid_request_error", "invalid_api_key"),
    OverloadedError: ErrorKind(429, "requests", "rate_limit_exceeded", retry_after=True),
    EngineError: ErrorKind(500, "server_error", "engine_error"),
    TransferError: ErrorKind(503, "service_unavailable", "kv_transfer_failed", retry_after=True),
    KVChecksumError: ErrorKind(503, "service_unavailable", "kv_checksum_mismatch", retry_after=True),
    ControlPlaneError: ErrorKind(503, "service_unavailable", "control_plane_unavailable", retry_after=True),
    ControlPlaneRestartedError: ErrorKind(
        503, "service_unavailable", "control_plane_restarted", retry_after=True
    ),
    ControlPlaneFullError: ErrorKind(507, "insufficient_storage", "control_plane_full"),
    QuotaExceededError: ErrorKind(429, "insufficient_quota", "quota_exceeded"),
    MessageError: ErrorKind(502, "bad_gateway", "invalid_message"),
    UnavailableError: ErrorKind(503, "service_unavailable", "unavailable", retry_after=True),
    InstanceLostError: ErrorKind(503, "service_unavailable", "instance_unavailable", retry_after=True),
    RouterStoppingError: ErrorKind(503, "service_unavailable", "router_stopping", retry_after=True),
    NoCapacityError: ErrorKind(503, "service_unavailable", "no_capacity", retry_after=True),
    RequestTimeoutError: ErrorKind(504, "timeout", "timeout"),
    ClientDisconnectedError: ErrorKind(499, "client_disconnected", "client_disconnected"),
    # UpstreamError: mapped through the class its ErrorInfo.kind names (see error_status).
    UpstreamError: ErrorKind(500, "server_error"),
}
"""Every class of the exception tree -> its HTTP status and OpenAI ``type``/``code``."""

_INTERNAL = ErrorKind(500, "server_error", "internal_error")


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_status(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """Map any exception to ``(HTTP status, OpenAI error body, extra headers)``.

    Exceptions outside pdserve's tree are bugs: they become a 500 without their text, which is
    logged by the caller instead (it may hold internals).
    """
    cls = class_of_kind(exc.info.kind) if isinstance(exc, UpstreamError) else type(exc)
    kind = kind_of(cls)
    if kind is None:
        return _INTERNAL.status, error_body("internal server error", _INTERNAL.type, None, _INTERNAL.code), {}
    param = getattr(exc, "param", None)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    headers = {"retry-after": str(RETRY_AFTER_S)} if kind.retry_after else {}
    return kind.status, error_body(message, kind.type, param, kind.code), headers


def kind_of(cls: type[BaseException]) -> ErrorKind | None:
    """The table entry of ``cls`` or of its nearest ancestor; None outside pdserve's tree."""
    return next((ERROR_MAP[c] for c in cls.__mro__ if c in ERROR_MAP), None)


def error_event(exc_or_info: BaseException | ErrorInfo) -> bytes:
    """The SSE event that ends a stream which already sent bytes (never a silent cut)."""
    exc = UpstreamError(exc_or_info) if isinstance(exc_or_info, ErrorInfo) else exc_or_info
    status, body, _ = error_status(exc)
    body["error"]["status"] = status
    return b"data: " + orjson.dumps(body) + b"\n\n"
