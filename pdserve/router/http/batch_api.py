"""OpenAI's Files and Batches endpoints (``/v1/files``, ``/v1/batches``) over the stores in Redis.

The router only records: a batch is created ``validating`` with one rq job queued to check its input
file, and batch workers do the rest. Files and batches belong to the tenant (``router.http.tenants``: a
digest of the API key) that made them: another tenant gets 404 for them and does not list them. An upload is bounded while it arrives (by Content-Length, then
by counting what is received), so a huge or endless body costs at most the limit, never a full read;
it takes one of the router's slots (``router.http.admission``) while it is received and stored, and it is
stored piece by piece from the form's spooled file (``FileStore.store``), never held whole. A file's
content is sent the same way, piece by piece as it is read (``FileStore.open``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.datastructures import QueryParams, UploadFile
from starlette.requests import ClientDisconnect

from pdserve.batchstore.batches import ENDPOINTS, BatchObject, BatchStore, window_seconds
from pdserve.batchstore.file_object import HOLD_GRACE_S, PURPOSES, FileObject, new_id
from pdserve.batchstore.files import CHUNK_BYTES, FileStore
from pdserve.errors import ControlPlaneError, InvalidRequestError, NotFoundError, PdserveError
from pdserve.router.api.errors import BodyTooLargeError, NoCapacityError
from pdserve.router.api.request_fields import validate_body
from pdserve.router.api.strict import StrictModel
from pdserve.router.http.asgi import (
    MAX_LENGTH_DIGITS,
    ClientGone,
    JsonResponse,
    Message,
    Receive,
    error_response,
    read_body,
)
from pdserve.router.http.state import RouterState
from pdserve.router.http.tenants import tenant_of
from pdserve.scheduler.redis_server import redis_errors

logger = logging.getLogger(__name__)

FORM_OVERHEAD = 64 * 1024
"""What a multipart body may hold besides the file (boundaries, part headers, ``purpose``)."""
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
CANCELLABLE = ("validating", "in_progress")


class CreateBatchRequest(StrictModel):
    """The body of ``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _body(media_type: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI entry of a body its handler reads itself (FastAPI sees only ``request``)."""
    return {"requestBody": {"required": True, "content": {media_type: {"schema": schema}}}}


_UPLOAD = {"properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"enum": ["batch"]}}}


def add_batch_routes(app: FastAPI, state: RouterState) -> None:
    """Register the Files and Batches endpoints on ``app``."""

    def stores() -> tuple[FileStore, BatchStore]:
        if state.files is None or state.batches is None:
            raise NoCapacityError("the router is starting or stopping")
        return state.files, state.batches

    @app.post("/v1/files", openapi_extra=_body("multipart/form-data", _UPLOAD))
    @_answers
    async def upload_file(request: Request) -> Response:
        """Store a JSONL file (``purpose=batch``); 413 past --max-file-bytes. The upload holds one of
        the router's slots (--max-in-flight) while it is received and stored: when they and the queue
        (--max-queued) are full it is refused with 429, as a generation is."""
        files, _ = stores()
        limit = files.max_bytes + FORM_OVERHEAD
        what = f"the upload (a file of at most {files.max_bytes} bytes, the form {FORM_OVERHEAD} more)"
        too_large = BodyTooLargeError(limit, what, "file")
        length = request.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and (len(length) > MAX_LENGTH_DIGITS or int(length) > limit):
            raise too_large
        await state.admission.enter(1, None)
        try:
            bounded = Request(request.scope, _counting(request.receive, limit, too_large))
            # the file part is spooled (in memory up to 1 MiB, then on disk), then stored in pieces
            async with bounded.form(max_files=1, max_fields=16) as form:
                upload, purpose = form.get("file"), form.get("purpose")
                if not isinstance(upload, UploadFile):
                    raise InvalidRequestError(
                        "file is required: the upload, as a multipart file part", "file"
                    )
                if purpose != "batch":
                    raise InvalidRequestError(f"purpose must be 'batch' (got {purpose!r})", "purpose")
                if upload.size is not None and upload.size > files.max_bytes:
                    raise BodyTooLargeError(files.max_bytes, "the file", "file")
                info = await files.store(upload.filename or "", "batch", _pieces(upload), _owner(request))
        finally:
            state.admission.leave(1)
        return JsonResponse(info.model_dump(mode="json"), _rid(request))

    @app.get("/v1/files")
    @_answers
    async def list_files(request: Request) -> Response:
        """Files newest first (``order=asc``: oldest first), optionally of one ``purpose``."""
        query = request.query_params
        purpose, order = query.get("purpose"), query.get("order", "desc")
        if purpose is not None and purpose not in PURPOSES:
            raise InvalidRequestError(f"purpose must be one of {', '.join(PURPOSES)}", "purpose")
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order must be 'asc' or 'desc'", "order")
        limit = _query_int(query, "limit", 10000, 10000)
        found, more = await stores()[0].list_files(
            purpose, query.get("after"), limit, order == "desc", _owner(request)
        )
        return JsonResponse(_page(found, more), _rid(request))

    @app.get("/v1/files/{file_id}")
    @_answers
    async def get_file(request: Request, file_id: str) -> Response:
        info = await stores()[0].get(file_id, _owner(request))
        return JsonResponse(info.model_dump(mode="json"), _rid(request))

    @app.get("/v1/files/{file_id}/content")
    @_answers
    async def file_content(request: Request, file_id: str) -> Response:
        """The file's bytes, sent piece by piece as they are read (never held whole)."""
        _, size, pieces = await stores()[0].open(file_id, _owner(request))
        headers = {"content-length": str(size), "x-request-id": _rid(request)}
        return StreamingResponse(pieces, media_type="application/jsonl", headers=headers)

    @app.delete("/v1/files/{file_id}")
    @_answers
    async def delete_file(request: Request, file_id: str) -> Response:
        files, batches = stores()
        owner = _owner(request)
        await files.get(file_id, owner)  # 404 for another tenant's file, before anything changes
        for batch_id in await files.readers(file_id):  # left by a batch that ended, or was never made
            if not await batches.is_active(batch_id):
                await files.release(file_id, batch_id)
        await files.delete(file_id, owner)  # 409 while an active batch reads it
        return JsonResponse({"id": file_id, "object": "file", "deleted": True}, _rid(request))

    @app.post("/v1/batches", openapi_extra=_body("application/json", CreateBatchRequest.model_json_schema()))
    @_answers
    async def create_batch(request: Request) -> Response:
        """Record a batch (``validating``) and queue the job that validates its input file."""
        files, batches = stores()
        body = await read_body(request.headers.raw, request.receive, state.settings.max_body_bytes)
        req = validate_body(CreateBatchRequest, body)
        _check_batch(req)
        owner = _owner(request)
        try:  # a batch reads only its own tenant's files
            info = await files.get(req.input_file_id, owner)
        except NotFoundError as e:
            raise NotFoundError(e.message, "input_file_id") from None
        if info.purpose != "batch":
            raise InvalidRequestError(f"file {info.id} is {info.purpose!r}, not 'batch'", "input_file_id")
        queue = state.batch_queue()  # a ConfigError (Redis Cluster) answers before anything exists
        # the file cannot be deleted while the batch is active, and lasts past its window
        batch_id = new_id("batch_")
        await batches.admit(owner, batch_id)  # 429 past the key's --quota-batches, before anything
        until = time.time() + window_seconds(req.completion_window) + HOLD_GRACE_S
        try:
            await files.hold(req.input_file_id, batch_id, until)
            batch = await batches.create(
                req.input_file_id, req.endpoint, req.completion_window, req.metadata, batch_id, owner
            )
        except BaseException as e:
            with contextlib.suppress(PdserveError):
                await batches.not_made(owner, batch_id)
            if isinstance(e, NotFoundError):
                raise NotFoundError(e.message, "input_file_id") from None
            raise
        try:
            with redis_errors("queueing the batch's validation"):
                await asyncio.to_thread(queue.enqueue_validate, batch.id)
        except ControlPlaneError as e:  # fail it now rather than leave it waiting for nothing
            errors = {"object": "list", "data": [{"code": "enqueue_failed", "message": e.message}]}
            with contextlib.suppress(PdserveError):  # else the batch workers' reaper queues it again
                await batches.update(
                    batch.id, ("validating",), status="failed", failed_at=int(time.time()), errors=errors
                )
            raise
        return JsonResponse(batch.model_dump(mode="json"), _rid(request))

    @app.get("/v1/batches")
    @_answers
    async def list_batches(request: Request) -> Response:
        """Batches newest first."""
        query = request.query_params
        limit = _query_int(query, "limit", 20, 100)
        found, more = await stores()[1].list_batches(query.get("after"), limit, _owner(request))
        return JsonResponse(_page(found, more), _rid(request))

    @app.get("/v1/batches/{batch_id}")
    @_answers
    async def get_batch(request: Request, batch_id: str) -> Response:
        batch = await stores()[1].get(batch_id, _owner(request))
        return JsonResponse(batch.model_dump(mode="json"), _rid(request))

    @app.post("/v1/batches/{batch_id}/cancel")
    @_answers
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        """Mark the batch ``cancelling`` and take its still-queued chunks out of the queue (a running
        chunk ends itself on seeing the status); cancelling twice answers the batch as it is."""
        batches = stores()[1]
        await batches.get(batch_id, _owner(request))  # 404 for an unknown id (or another's), first
        queue = state.batch_queue()
        now = int(time.time())
        if await batches.update(batch_id, CANCELLABLE, status="cancelling", cancelling_at=now) is None:
            batch = await batches.get(batch_id)
            if batch.status not in ("cancelling", "cancelled"):
                raise InvalidRequestError(f"cannot cancel a batch that is {batch.status}", "batch_id")
            return JsonResponse(batch.model_dump(mode="json"), _rid(request))
        for job_id in (await batches.chunk_jobs(batch_id)).values():
            try:
                with redis_errors("cancelling a batch job"):
                    await asyncio.to_thread(queue.cancel, job_id)
            except ControlPlaneError as e:  # harmless: the job ends itself when it starts
                logger.warning("batch %s: job %s stays queued: %s", batch_id, job_id, e.message)
        return JsonResponse((await batches.get(batch_id)).model_dump(mode="json"), _rid(request))


def _answers(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Answer pdserve's errors in OpenAI's shape here: past the handler, FastAPI would treat them as
    crashes (logged with a traceback, re-raised by the server)."""

    @functools.wraps(handler)
    async def answer(request: Request, **params: Any) -> Response:
        try:
            return await handler(request, **params)
        except PdserveError as e:
            return error_response(e, _rid(request))
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody is left to read it

    return answer


def _counting(receive: Receive, limit: int, error: Exception) -> Receive:
    """``receive`` that raises ``error`` once more than ``limit`` body bytes have arrived (a chunked
    body has no Content-Length to refuse up front)."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise error
        return message

    return counted


async def _pieces(upload: UploadFile) -> AsyncIterator[bytes]:
    """An uploaded file's bytes from its spooled copy, CHUNK_BYTES at a time."""
    await upload.seek(0)
    while piece := await upload.read(CHUNK_BYTES):
        yield piece


def _check_batch(req: CreateBatchRequest) -> None:
    """The fields of a new batch, checked before anything is stored."""
    if req.endpoint not in ENDPOINTS:
        raise InvalidRequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    window_seconds(req.completion_window)
    meta = req.metadata or {}
    fits = all(len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE for k, v in meta.items())
    if len(meta) > MAX_METADATA_PAIRS or not fits:
        why = f"{MAX_METADATA_PAIRS} pairs, keys of {MAX_METADATA_KEY} and values of {MAX_METADATA_VALUE}"
        raise InvalidRequestError(f"metadata may have at most {why} characters", "metadata")


def _query_int(query: QueryParams, name: str, default: int, most: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 10 else 0
    if not 1 <= value <= most:
        raise InvalidRequestError(f"{name} must be an integer from 1 to {most}, got {raw!r}", name)
    return value


def _page(items: Sequence[FileObject | BatchObject], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    data = [i.model_dump(mode="json") for i in items]
    first, last = (items[0].id, items[-1].id) if items else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


def _owner(request: Request) -> str:
    """The caller's tenant (``router.http.tenants``): what it creates is its, and it sees only that."""
    return tenant_of(request.scope)


def _rid(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex
