"""The router's FastAPI application: lifespan (Redis, registration, outbox reader, watcher) and the
small operator endpoints. The generation endpoints are raw ASGI apps from :mod:`.serving`, each
registered once (:meth:`RouterApp.add_raw_post`); every endpoint answers JSON and errors through
:mod:`.asgi`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize`` and ``/detokenize`` (:mod:`.tokenize`), ``GET /health``
(the process is up), ``GET /ready`` (Redis answers and something can generate), ``GET /version``, ``GET /v1/instances`` (the live set plus this router's
in-flight counts, for operators; no data-plane endpoints unless ``?details=1`` with an API key), ``GET /metrics`` (Prometheus text; open like /health; 404 with
``--no-metrics``); the Batch API (:mod:`.batch_api`): ``POST``/``GET /v1/files``,
``GET``/``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``POST``/``GET /v1/batches``,
``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve import __version__
from pdserve.errors import PdserveError
from pdserve.router.api.errors import AuthenticationError, ModelNotFoundError, NoCapacityError, error_body
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.api.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pdserve.router.http.asgi import JsonResponse, error_response, send_error
from pdserve.router.http.batch_api import add_batch_routes
from pdserve.router.http.serving import GenerateEndpoint
from pdserve.router.http.settings import RouterSettings
from pdserve.router.http.state import RouterState
from pdserve.router.http.tenants import ANONYMOUS, TENANT, key_digest
from pdserve.router.http.tokenize import TokenizeEndpoint
from pdserve.scheduler.registration import InstanceInfo

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0
"""/ready answers within this long even when Redis hangs (a probe must not time out instead)."""


GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
"""Besides /v1/*: the routes that use an instance's work, guarded by --api-key too."""


class RawPostRoute(APIRoute):
    """``POST path`` served by a raw ASGI endpoint: FastAPI only documents its request body (in
    /openapi.json) and answers other methods with 405; the endpoint reads and checks the body itself."""

    def __init__(self, path: str, endpoint: ASGIApp, body: type[BaseModel], summary: str, name: str) -> None:
        super().__init__(
            path, _Documented(body), methods=["POST"], summary=summary, name=name, response_model=None
        )
        self.app = endpoint


class _Documented:
    """A FastAPI endpoint whose signature is ``(body: <body>)``, for the schema only: a
    :class:`RawPostRoute` never calls it."""

    def __init__(self, body: type[BaseModel]) -> None:
        param = inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body)
        self.__signature__ = inspect.Signature([param], return_annotation=None)

    async def __call__(self, body: Any) -> None:  # pragma: no cover - never called
        raise AssertionError("served by the raw endpoint")


class RouterApp(FastAPI):
    """FastAPI with a direct path to the raw endpoints (:meth:`add_raw_post`): a POST to one of them
    skips the middleware stack and route matching (measurably cheaper per request); everything
    else, and every other method on those paths, goes through FastAPI as usual."""

    def __init__(self, api_keys: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes: dict[str, ASGIApp] = {}
        self.api_keys = [(k.encode(), key_digest(k.encode())) for k in sorted(api_keys)]

    def add_raw_post(
        self, path: str, endpoint: ASGIApp, body: type[BaseModel], summary: str, name: str
    ) -> None:
        """Register ``endpoint`` for ``POST path`` once: the fast path, the 405 for other methods and
        the OpenAPI entry (``body`` as its request schema) come from this one call."""
        self.fast_routes[path] = endpoint
        self.router.routes.append(RawPostRoute(path, endpoint, body, summary, name))

    def tenant(self, scope: Scope) -> str | None:
        """The request's tenant (``tenants``): anonymous when no keys are set, or on a path that
        needs none; else /v1/*, /tokenize and /detokenize need ``Authorization: Bearer <one of the
        keys>`` and the tenant is that key's digest; None: not authorized."""
        path = scope["path"]
        if not self.api_keys or not (path.startswith("/v1/") or path in GUARDED_PATHS):
            return ANONYMOUS
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        # compare with every key (constant time each), so timing says nothing about which one is close
        found = None
        for key, digest in self.api_keys:
            if hmac.compare_digest(token, key):
                found = digest
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and TENANT not in scope:  # else set by TrustedTenant (in-process)
            tenant = self.tenant(scope)
            if tenant is None:
                await send_error(send, AuthenticationError(), uuid.uuid4().hex)
                return
            scope[TENANT] = tenant
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: RouterSettings) -> RouterApp:
    """The router application; Redis is connected by its lifespan (run it, or serve it with uvicorn)."""
    state = RouterState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = RouterApp(
        api_keys=settings.api_keys, title="pdserve router", version=__version__, lifespan=lifespan
    )
    app.state.router = state
    app.add_raw_post(
        "/v1/completions",
        GenerateEndpoint(state, parse_completion, "/v1/completions"),
        CompletionRequest,
        "Create a completion (OpenAI API)",
        "completions",
    )
    app.add_raw_post(
        "/v1/chat/completions",
        GenerateEndpoint(state, parse_chat, "/v1/chat/completions"),
        ChatCompletionRequest,
        "Create a chat completion (OpenAI API)",
        "chat_completions",
    )
    app.add_raw_post(
        "/tokenize",
        TokenizeEndpoint(state, detokenize=False),
        TokenizeRequest,
        "Token ids of a prompt or chat (vLLM's shape)",
        "tokenize",
    )
    app.add_raw_post(
        "/detokenize",
        TokenizeEndpoint(state, detokenize=True),
        DetokenizeRequest,
        "The text of token ids (vLLM's shape)",
        "detokenize",
    )
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    _add_operator_routes(app, state)
    add_batch_routes(app, state)
    return app


def _add_operator_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """The process is up (says nothing about Redis or instances: see /ready)."""
        return JsonResponse({"status": "ok", "router_id": state.settings.router_id}, _rid(request))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text exposition of this router's metrics (pdserve/router/http/metrics.py)."""
        if state.metrics is None:
            raise StarletteHTTPException(404, "metrics are off (--no-metrics)")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """200 when Redis answers and some instance can generate (decode or mixed), else 503."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return error_response(e, _rid(request))
        if state.reader is not None and not state.reader.healthy:
            why = "lost contact with Redis" if state.reader.alive else "outbox reader stopped (see its log)"
            return error_response(NoCapacityError(f"the router {why}"), _rid(request))
        generating = [i for i in live if not i.draining and i.role in ("decode", "mixed")]
        if not generating:
            reason = (
                "no instance is registered" if not live else "no decode or mixed instance can take requests"
            )
            return error_response(NoCapacityError(reason), _rid(request))
        body = {
            "status": "ready",
            "router_id": state.settings.router_id,
            "models": sorted({i.model for i in generating}),
        }
        return JsonResponse(body, _rid(request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The models of the live set, in OpenAI's list shape."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return error_response(e, _rid(request))
        return JsonResponse({"object": "list", "data": models_list(live)}, _rid(request))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """One model of the live set as an OpenAI model object; 404 ``model_not_found`` when no live
        instance serves it."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return error_response(e, _rid(request))
        found = models_list([i for i in live if i.model == model_id])
        if not found:
            return error_response(ModelNotFoundError(model_id), _rid(request))
        return JsonResponse(found[0], _rid(request))

    @app.get("/version")
    async def version(request: Request) -> Response:
        """The pdserve version this router runs."""
        return JsonResponse({"version": __version__}, _rid(request))

    @app.get("/v1/instances")
    async def instances(request: Request) -> Response:
        """The live set as registered, plus this router's in-flight requests per instance."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return error_response(e, _rid(request))
        in_flight = state.dispatcher.in_flight
        details = bool(state.settings.api_keys) and request.query_params.get("details") == "1"
        body = {
            "router_id": state.settings.router_id,
            "instances": [
                {**instance_view(i, details), "in_flight": in_flight.get(i.id, 0)}
                for i in sorted(live, key=lambda i: i.id)
            ],
            "in_flight": sum(in_flight.values()),
            "requests": len(state.dispatcher.generations),
            "retries": state.dispatcher.num_retries,
            "migrations": state.dispatcher.num_migrations,
        }
        return JsonResponse(body, _rid(request))


BUFFER_FIELDS = frozenset({"addr", "length", "handle", "ref_counter", "event"})
"""Fields of a transfer endpoint that locate registered memory or open it (mooncake's buffer,
cuda_ipc's IPC handles): never served over HTTP."""


def instance_view(info: InstanceInfo, details: bool) -> dict[str, Any]:
    """One registration as /v1/instances shows it. ``transfer.endpoint`` (where the KV cache can be
    written: data-plane addresses, segment names) is left out unless ``details`` (the router has API
    keys and the request asked ``?details=1``); even then buffer addresses and lengths are not shown."""
    view = info.model_dump()
    endpoint = view["transfer"].pop("endpoint", None)
    if details and endpoint:
        view["transfer"]["endpoint"] = {
            protocol: {k: v for k, v in peer.items() if k not in BUFFER_FIELDS}
            if isinstance(peer, dict)
            else peer
            for protocol, peer in endpoint.items()
        }
    return view


def models_list(live: list[InstanceInfo]) -> list[dict]:
    """One OpenAI model object per model name (``created`` = its oldest instance's start)."""
    by_model: dict[str, list[InstanceInfo]] = {}
    for info in live:
        by_model.setdefault(info.model, []).append(info)
    return [
        {
            "id": model,
            "object": "model",
            "created": int(min(i.started_at for i in infos)),
            "owned_by": "pdserve",
            "max_model_len": min(i.max_model_len for i in infos),
        }
        for model, infos in sorted(by_model.items())
    ]


async def _live(state: RouterState) -> list[InstanceInfo]:
    try:
        return await asyncio.wait_for(state.dispatcher.live.get(), READY_TIMEOUT_S)
    except TimeoutError:
        raise NoCapacityError(f"Redis did not answer within {READY_TIMEOUT_S:g} s") from None


def _rid(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths (404) and wrong methods (405) in OpenAI's error shape."""
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    body = error_body(str(exc.detail), "invalid_request_error", None, code)
    return JsonResponse(body, _rid(request), exc.status_code, dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(exc, _rid(request))
