"""pdserve's one exception tree, and the error vocabulary that crosses processes.

    PdserveError                 internal_error
    ├── ConfigError              configuration_error   bad model folder, flag or configuration value
    ├── InvalidRequestError      invalid_request       a request field is wrong (``param`` names it)
    │   ├── RequestTooLongError  context_length_exceeded   prompt + max_tokens can never fit
    │   ├── NotFoundError        not_found             a file or batch id that does not exist
    │   └── ConflictError        conflict              the state forbids it (deleting a batch's input)
    ├── EngineError              engine_error          the engine failed while running a request
    ├── TransferError            kv_transfer_failed    KV cache bytes could not be moved
    │   └── KVChecksumError      kv_checksum_mismatch  KV bytes arrived other than they were read
    ├── ControlPlaneError        control_plane_unavailable   Redis unreachable, too old, or refusing
    │   ├── ControlPlaneRestartedError  control_plane_restarted   Redis came back empty
    │   └── ControlPlaneFullError       control_plane_full        Redis is at its maxmemory
    ├── MessageError             invalid_message       a control-plane message cannot be understood
    ├── UnavailableError         unavailable           an instance cannot take or keep the request
    │   ├── InstanceLostError    instance_unavailable  it left the live set mid-request
    │   └── RouterStoppingError  router_stopping       the router is shutting down
    ├── RequestTimeoutError      timeout               a deadline passed
    ├── QuotaExceededError       quota_exceeded        an API key holds what its quota allows
    └── ClientDisconnectedError  client_disconnected   the client went away

Each class's ``kind`` is its name on the wire: a worker or the scheduler that fails a request
sends ``ErrorInfo.of(exc)`` (kind, message, ``param``, retryable), and the router maps the kind
back to its class and through its one table to an HTTP status and OpenAI body. Foreign errors
(Paddle, Redis, transfer engines) are translated into this tree at one boundary per library.
"""

from __future__ import annotations

from typing import ClassVar


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""

    kind: ClassVar[str] = "internal_error"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(PdserveError, ValueError):
    """A model folder, flag or configuration value is missing or invalid."""

    kind = "configuration_error"


class InvalidRequestError(PdserveError, ValueError):
    """A request is invalid; ``param`` names the offending field (OpenAI's ``error.param``)."""

    kind = "invalid_request"


class RequestTooLongError(InvalidRequestError):
    """The prompt plus ``max_tokens`` can never fit into the model length or the KV cache."""

    kind = "context_length_exceeded"


class NotFoundError(InvalidRequestError):
    """A file or batch id names nothing (deleted, expired, or never created)."""

    kind = "not_found"


class ConflictError(InvalidRequestError):
    """The request conflicts with the current state (deleting a file an active batch reads)."""

    kind = "conflict"


class EngineError(PdserveError, RuntimeError):
    """The engine failed while running a request."""

    kind = "engine_error"


class TransferError(PdserveError, RuntimeError):
    """KV cache bytes could not be moved between two instances."""

    kind = "kv_transfer_failed"


class KVChecksumError(TransferError):
    """The KV blocks a decode instance received differ from the digests their writer took as it
    read them: nothing is decoded from them, and the request is retried elsewhere."""

    kind = "kv_checksum_mismatch"


class ControlPlaneError(PdserveError, RuntimeError):
    """Redis, the control plane, is unreachable, too old, or refused a command (HTTP 503 upstream)."""

    kind = "control_plane_unavailable"


class ControlPlaneRestartedError(ControlPlaneError):
    """Redis restarted (a new ``run_id``): events of requests in flight may be lost."""

    kind = "control_plane_restarted"


class ControlPlaneFullError(ControlPlaneError):
    """Redis refused a write because it holds its ``maxmemory`` and evicts nothing (``noeviction``):
    retrying soon does not help until files or batches are deleted or expire (HTTP 507)."""

    kind = "control_plane_full"


class MessageError(PdserveError, ValueError):
    """A control-plane message cannot be understood: bad JSON, unknown ``type``, newer ``v``, bad field."""

    kind = "invalid_message"


class UnavailableError(PdserveError, RuntimeError):
    """An instance cannot take or keep the request now (draining, stopping, no room): try elsewhere."""

    kind = "unavailable"


class InstanceLostError(UnavailableError):
    """An instance the request depends on left the live set."""

    kind = "instance_unavailable"


class RouterStoppingError(UnavailableError):
    """The router that owns the request is shutting down."""

    kind = "router_stopping"


class RequestTimeoutError(PdserveError, TimeoutError):
    """The request missed a deadline (first token, reserve, or the whole request)."""

    kind = "timeout"


class QuotaExceededError(PdserveError, RuntimeError):
    """An API key holds as many files, bytes or batches in flight as its quota allows (HTTP 429,
    no ``Retry-After``: waiting helps only once its files expire or its batches end)."""

    kind = "quota_exceeded"


class ClientDisconnectedError(PdserveError, ConnectionError):
    """The client closed the connection before the request finished."""

    kind = "client_disconnected"


def error_classes(root: type[PdserveError] = PdserveError) -> list[type[PdserveError]]:
    """``root`` and every class below it that is imported (the router adds a few leaves)."""
    found = [root]
    for sub in root.__subclasses__():
        found += error_classes(sub)
    return found


def class_of_kind(kind: str) -> type[PdserveError]:
    """The class a wire ``kind`` names; an unknown kind (a newer peer) reads as PdserveError."""
    return next((c for c in error_classes() if c.kind == kind), PdserveError)
