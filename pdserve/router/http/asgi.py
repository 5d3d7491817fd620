"""What every router endpoint shares at the ASGI level: the request id, the size-limited body, and
the ONE path a JSON answer or an error takes out (:func:`send_json`, :func:`send_error`).

The generation and tokenize endpoints are raw ASGI apps and call these directly; the operator
endpoints (FastAPI handlers) return a :class:`JsonResponse`, which is sent by the same
:func:`send_json`, so every JSON body carries the same headers and every error is OpenAI's shape.
"""

from __future__ import annotations

import logging
import uuid

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.router.api.errors import BodyTooLargeError, error_status

logger = logging.getLogger(__name__)

__all__ = [
    "ClientGone",
    "JsonResponse",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "error_response",
    "read_body",
    "request_id",
    "send_error",
    "send_json",
]

JSON = b"application/json"
MAX_REQUEST_ID_LEN = 128
MAX_LENGTH_DIGITS = 18
"""A Content-Length of more digits is larger than any body limit (and ``int()`` is never asked to
read thousands of them)."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def request_id(headers: list[tuple[bytes, bytes]], default: str | None = None) -> str:
    """The client's ``x-request-id`` (checked: 1-128 visible ASCII characters), else ``default``
    or a fresh uuid4 hex."""
    for name, value in headers:
        if name == b"x-request-id":
            if (
                0 < len(value) <= MAX_REQUEST_ID_LEN
                and value.isascii()
                and all(33 <= c <= 126 for c in value)
            ):
                return value.decode()
            raise InvalidRequestError(
                f"x-request-id must be 1-{MAX_REQUEST_ID_LEN} visible ASCII characters", "x-request-id"
            )
    return default or uuid.uuid4().hex


async def read_body(headers: list[tuple[bytes, bytes]], receive: Receive, limit: int) -> bytes:
    """The request body; BodyTooLargeError past ``limit`` bytes, by Content-Length and by counting
    (so chunked bodies are caught too, without reading more than ``limit`` of them)."""
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit():
                raise InvalidRequestError("invalid Content-Length header", None)
            if len(value) > MAX_LENGTH_DIGITS or int(value) > limit:
                raise BodyTooLargeError(limit)
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False) and message["type"] == "http.request":
        if len(body) > limit:
            raise BodyTooLargeError(limit)
        return body
    parts, size = [body], len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(limit)
        parts.append(chunk)
    if message["type"] == "http.disconnect":
        raise ClientGone()
    return b"".join(parts)


async def send_json(
    send: Send, status: int, body: bytes, rid: str, headers: dict[str, str] | None = None
) -> None:
    """Send a whole JSON response (``body`` already serialized) with its ``x-request-id``."""
    raw = [
        (b"content-type", JSON),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode("latin-1")),  # as ASGI servers decode headers: the bytes echo back
    ]
    if headers:
        raw.extend((k.encode(), v.encode()) for k, v in headers.items())
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, exc: BaseException, rid: str) -> None:
    """Send ``exc`` as OpenAI's error body with its status (:func:`~.errors.error_status`)."""
    status, body, headers = error_status(exc)
    if status >= 500 and not isinstance(exc, PdserveError):
        logger.error("request %s failed", rid, exc_info=exc)
    await send_json(send, status, orjson.dumps(body), rid, headers)


class JsonResponse(Response):
    """What a FastAPI-served endpoint returns: a JSON body sent by :func:`send_json` (with
    ``headers`` given here; it sends nothing else)."""

    media_type = "application/json"

    def __init__(
        self, content: object, rid: str, status_code: int = 200, headers: dict[str, str] | None = None
    ) -> None:
        self.rid = rid
        self.extra_headers = headers or {}
        super().__init__(orjson.dumps(content), status_code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, self.status_code, bytes(self.body), self.rid, self.extra_headers)


def error_response(exc: BaseException, rid: str) -> JsonResponse:
    """``exc`` as a :class:`JsonResponse` in OpenAI's error shape (what :func:`send_error` sends)."""
    status, body, headers = error_status(exc)
    return JsonResponse(body, rid, status, headers)
