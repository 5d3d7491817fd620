"""The router's FastAPI application: lifespan (Redis, registration, outbox reader, watcher) and the
small operator endpoints. The generation endpoints are raw ASGI apps from :mod:`.serving`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize`` and ``/detokenize`` (:mod:`.tokenize`), ``GET /health`` (the process is up), ``GET /ready`` (Redis answers and
something can generate), ``GET /version``, ``GET /v1/instances`` (the live set plus this router's
in-flight counts, for operators), ``GET /metrics`` (Prometheus text; open like /health; 404 with
``--no-metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import orjson
import redis.asyncio as aioredis
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from pdserve import __version__
from pdserve.errors import PdserveError
from pdserve.router.admission import Admission
from pdserve.router.dispatch import Dispatcher
from pdserve.router.errors import (
    AuthenticationError,
    ModelNotFoundError,
    NoCapacityError,
    error_body,
    error_status,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_chat,
    parse_completion,
)
from pdserve.router.serving import GenerateEndpoint, send_error
from pdserve.router.settings import RouterSettings
from pdserve.router.tokenize import TokenizeEndpoint
from pdserve.scheduler.connection import RedisSettings, wait_for_redis
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.messages import InstanceInfo, RouterInfo
from pdserve.scheduler.registry import Heartbeat, InstanceRegistry, LiveSetCache, RouterRegistry
from pdserve.scheduler.streams import OutboxReader

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0
"""/ready answers within this long even when Redis hangs (a probe must not time out instead)."""


class RouterState:
    """What the lifespan builds and every endpoint shares (one per app)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.started_at = time.time()
        self.redis: aioredis.Redis | None = None
        self.reader: OutboxReader | None = None
        self.heartbeat: Heartbeat[RouterInfo] | None = None
        self._dispatcher: Dispatcher | None = None
        self.metrics = RouterMetrics() if settings.metrics else None
        self.admission = Admission(
            settings.max_in_flight, settings.max_queued, settings.first_token_timeout_s
        )

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise NoCapacityError("the router is starting or stopping")
        return self._dispatcher

    async def start(self) -> None:
        """Connect to Redis, start reading the outbox, register, and start the watcher."""
        s = self.settings
        try:
            self.redis = RedisSettings.from_url(s.redis_url, client_name=s.router_id).connect()
            await wait_for_redis(self.redis, s.redis_wait_s)
            keys = Keys(s.cluster)
            observe = self.metrics.on_redis if self.metrics is not None else None
            live = LiveSetCache(
                InstanceRegistry(self.redis, keys, s.ttl_s), s.live_set_max_age_s, observe=observe
            )
            self.reader = OutboxReader(self.redis, keys, s.router_id, observe=observe)
            await self.reader.start()
            self.heartbeat = Heartbeat(RouterRegistry(self.redis, keys, s.ttl_s), self._router_info)
            await self.heartbeat.start()
            dispatcher = Dispatcher(self.redis, keys, live, self.reader, s, metrics=self.metrics)
            if self.metrics is not None:
                self.metrics.watch_live(live)
            dispatcher.start()
            self._dispatcher = dispatcher
        except BaseException:
            await self.stop()
            raise
        logger.info("router %s ready on %s (cluster %s)", s.router_id, s.url, s.cluster)

    async def stop(self) -> None:
        """Stop the watcher, fail what is still in flight, deregister, disconnect."""
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            await dispatcher.stop()
        if self.reader is not None:
            await self.reader.stop()
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.redis is not None:
            await self.redis.aclose()

    def _router_info(self) -> RouterInfo:
        s = self.settings
        return RouterInfo(
            id=s.router_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            port=s.port,
            started_at=self.started_at,
        )


GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
"""Besides /v1/*: the routes that use an instance's work, guarded by --api-key too."""


class RouterApp(FastAPI):
    """FastAPI with a direct path to the generation endpoints: a POST to one of them skips the
    middleware stack and route matching (measurably cheaper per request); everything else, and
    every other method on those paths, goes through FastAPI as usual."""

    def __init__(self, api_keys: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes: dict[str, GenerateEndpoint | TokenizeEndpoint] = {}
        self.api_keys = [k.encode() for k in api_keys]

    def authorized(self, scope: MutableMapping[str, Any]) -> bool:
        """Open when no keys are set; else /v1/*, /tokenize and /detokenize need
        ``Authorization: Bearer <one of the keys>``."""
        path = scope["path"]
        if not self.api_keys or not (path.startswith("/v1/") or path in GUARDED_PATHS):
            return True
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # compare with every key (constant time each), so timing says nothing about which one is close
        return sum(hmac.compare_digest(token.strip(), key) for key in self.api_keys) > 0

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.authorized(scope):
            await send_error(send, AuthenticationError(), uuid.uuid4().hex)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: RouterSettings) -> FastAPI:
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
    for path, parse in (("/v1/completions", parse_completion), ("/v1/chat/completions", parse_chat)):
        endpoint = GenerateEndpoint(state, parse, path)
        app.fast_routes[path] = endpoint
        app.router.routes.insert(0, Route(path, endpoint, methods=["POST"]))  # 405 for other methods
    for path, detokenize in (("/tokenize", False), ("/detokenize", True)):
        app.fast_routes[path] = tokenizer = TokenizeEndpoint(state, detokenize)
        app.router.routes.insert(0, Route(path, tokenizer, methods=["POST"]))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    _add_operator_routes(app, state)
    _document_generation_routes(app)
    return app


def _document_generation_routes(app: FastAPI) -> None:
    """The generation endpoints in /openapi.json with their request schemas (so clients and fuzzers
    see them). Only the schema comes from these routes: a POST never reaches them (the raw ASGI
    endpoint answers first)."""

    @app.post("/v1/completions", summary="Create a completion (OpenAI API)", response_model=None)
    async def completions(body: CompletionRequest) -> None:  # pragma: no cover - documentation only
        raise AssertionError("served by the raw endpoint")

    @app.post("/v1/chat/completions", summary="Create a chat completion (OpenAI API)", response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> None:  # pragma: no cover - documentation only
        raise AssertionError("served by the raw endpoint")

    @app.post("/tokenize", summary="Token ids of a prompt or chat (vLLM's shape)", response_model=None)
    async def tokenize(body: TokenizeRequest) -> None:  # pragma: no cover - documentation only
        raise AssertionError("served by the raw endpoint")

    @app.post("/detokenize", summary="The text of token ids (vLLM's shape)", response_model=None)
    async def detokenize(body: DetokenizeRequest) -> None:  # pragma: no cover - documentation only
        raise AssertionError("served by the raw endpoint")


def _add_operator_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """The process is up (says nothing about Redis or instances: see /ready)."""
        return _json(request, {"status": "ok", "router_id": state.settings.router_id})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text exposition of this router's metrics (pdserve/router/metrics.py)."""
        if state.metrics is None:
            raise StarletteHTTPException(404, "metrics are off (--no-metrics)")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """200 when Redis answers and some instance can generate (decode or mixed), else 503."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return _error(request, e)
        if state.reader is not None and not state.reader.healthy:
            return _error(request, NoCapacityError("the router lost contact with Redis"))
        generating = [i for i in live if not i.draining and i.role in ("decode", "mixed")]
        if not generating:
            reason = (
                "no instance is registered" if not live else "no decode or mixed instance can take requests"
            )
            return _error(request, NoCapacityError(reason))
        body = {
            "status": "ready",
            "router_id": state.settings.router_id,
            "models": sorted({i.model for i in generating}),
        }
        return _json(request, body)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The models of the live set, in OpenAI's list shape."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return _error(request, e)
        return _json(request, {"object": "list", "data": models_list(live)})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """One model of the live set as an OpenAI model object; 404 ``model_not_found`` when no live
        instance serves it."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return _error(request, e)
        found = models_list([i for i in live if i.model == model_id])
        return _json(request, found[0]) if found else _error(request, ModelNotFoundError(model_id))

    @app.get("/version")
    async def version(request: Request) -> Response:
        """The pdserve version this router runs."""
        return _json(request, {"version": __version__})

    @app.get("/v1/instances")
    async def instances(request: Request) -> Response:
        """The live set as registered, plus this router's in-flight requests per instance."""
        try:
            live = await _live(state)
        except PdserveError as e:
            return _error(request, e)
        in_flight = state.dispatcher.in_flight
        body = {
            "router_id": state.settings.router_id,
            "instances": [
                {**i.model_dump(), "in_flight": in_flight.get(i.id, 0)}
                for i in sorted(live, key=lambda i: i.id)
            ],
            "in_flight": sum(in_flight.values()),
            "requests": len(state.dispatcher.generations),
            "retries": state.dispatcher.num_retries,
            "migrations": state.dispatcher.num_migrations,
        }
        return _json(request, body)


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
    except asyncio.TimeoutError:
        raise NoCapacityError(f"Redis did not answer within {READY_TIMEOUT_S:g} s") from None


def _rid(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _json(
    request: Request, body: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(body),
        status,
        {"x-request-id": _rid(request), **(headers or {})},
        media_type="application/json",
    )


def _error(request: Request, exc: BaseException) -> Response:
    status, body, headers = error_status(exc)
    return _json(request, body, status, headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths (404) and wrong methods (405) in OpenAI's error shape."""
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    body = error_body(str(exc.detail), "invalid_request_error", None, code)
    return _json(request, body, exc.status_code, dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(request, exc)
