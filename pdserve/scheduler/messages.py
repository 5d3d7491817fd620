"""The messages' codec: every stream message in one discriminated union (:data:`Message`), encoded as
compact JSON (:func:`encode`, ``None`` fields left out) and decoded with clear errors
(:func:`decode_message`, :func:`decode_as`), refusing a schema newer than this code reads."""

from __future__ import annotations

from typing import Annotated, Any, get_args

import orjson
from pydantic import BaseModel, Field, ValidationError

from pdserve.errors import MessageError
from pdserve.scheduler.inbox_messages import InboxMessage
from pdserve.scheduler.message_schema import _M, SCHEMA_VERSION
from pdserve.scheduler.outbox_messages import StepOutput

Message = Annotated[InboxMessage | StepOutput, Field(discriminator="type")]
"""Every stream message, discriminated by ``type``."""

MESSAGE_TYPES: dict[str, type[BaseModel]] = {
    cls.model_fields["type"].default: cls for cls in (*get_args(InboxMessage), StepOutput)
}


def encode(msg: BaseModel) -> bytes:
    """Serialize a message (or registration value) to compact JSON; ``None`` fields are left out.

    pydantic-core's serializer writes the same JSON as ``orjson.dumps(msg.model_dump())`` in ~80%
    of the time (no intermediate dict: 14 vs 17 µs for a 32-item step); decoding uses orjson.
    """
    return msg.model_dump_json(exclude_none=True).encode()


def decode_message(data: bytes | str) -> Message:
    """Parse one stream message; raise MessageError with a clear reason when it cannot be used."""
    raw = _load(data)
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {kind!r}; known types: {sorted(MESSAGE_TYPES)}")
    return _validate(cls, raw, str(kind))  # type: ignore[return-value]


def decode_as(cls: type[_M], data: bytes | str) -> _M:
    """Parse a value that must be of one model (a registration value, or a message of known type)."""
    return _validate(cls, _load(data), cls.__name__)


def _load(data: bytes | str) -> dict[str, Any]:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise MessageError(f"message is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise MessageError(f"message must be a JSON object, got {type(raw).__name__}")
    v = raw.get("v", SCHEMA_VERSION)
    if isinstance(v, int) and not isinstance(v, bool) and v > SCHEMA_VERSION:
        raise MessageError(
            f"message schema v{v} is newer than this pdserve understands (v{SCHEMA_VERSION}); "
            "upgrade this process"
        )
    return raw


def _validate(cls: type[_M], raw: dict[str, Any], what: str) -> _M:
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<message>'}: {err['msg']}" for err in e.errors()
        )
        raise MessageError(f"invalid {what} message: {problems}") from None
