"""pdserve's one exception tree.

    PdserveError
    ├── ConfigError            bad model folder, bad flag value, unusable configuration
    ├── InvalidRequestError    a request field is wrong (``param`` names it) -> HTTP 400
    │   └── RequestTooLongError  prompt + max_tokens can never fit (model length or KV cache)
    ├── EngineError            the engine failed while running a request
    ├── TransferError          KV cache bytes could not be moved between instances
    ├── ControlPlaneError      Redis (the control plane) is unreachable, too old, or refused a command
    └── MessageError           a control-plane message is not valid JSON, of an unknown type, of a newer
                               schema version, or has a bad field

Foreign errors (Paddle, Redis, transfer engines) are translated into these at one boundary per
library; the router maps this tree onto OpenAI error bodies in one place.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError, ValueError):
    """A model folder, flag or configuration value is missing or invalid."""


class InvalidRequestError(PdserveError, ValueError):
    """A request is invalid; ``param`` names the offending field (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """The prompt plus ``max_tokens`` can never fit into the model length or the KV cache."""


class EngineError(PdserveError, RuntimeError):
    """The engine failed while running a request."""


class TransferError(PdserveError, RuntimeError):
    """KV cache bytes could not be moved between two instances."""


class ControlPlaneError(PdserveError, RuntimeError):
    """Redis, the control plane, is unreachable, too old, or refused a command (HTTP 503 upstream)."""


class MessageError(PdserveError, ValueError):
    """A control-plane message cannot be understood: bad JSON, unknown ``type``, newer ``v``, bad field."""
