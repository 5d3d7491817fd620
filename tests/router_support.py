"""Helpers of the router tests (no tests here): a router app with its lifespan, instance
registrations, and a scripted protocol peer that plays a worker with the real scheduler API
(reads its inbox with ``Inbox``, publishes ``StepOutput`` with ``Outbox``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn

from pdserve.localredis.embedded import free_port
from pdserve.router import RouterSettings, create_app
from pdserve.scheduler import (
    Abort,
    GenerateRequest,
    Inbox,
    InboxMessage,
    InstanceInfo,
    InstanceRegistry,
    Keys,
    KVInfo,
    LoadInfo,
    LogprobInfo,
    Outbox,
    Prefilled,
    RedisSettings,
    RequestDelta,
    ReserveBlocks,
    StepOutput,
    TopLogprob,
    TransferInfo,
    Usage,
    send_to_inbox,
)

CLUSTER = "router-test"
KEYS = Keys(CLUSTER)
ROUTER_ID = "r-test"
MODEL = "tiny"
WEIGHTS_DIGEST = "0123456789abcdef0123456789abcdef"  # one checkpoint: every pair is allowed


def instance(
    instance_id: str,
    role: str = "mixed",
    *,
    model: str = MODEL,
    host: str = "h1",
    protocols: tuple[str, ...] = ("shm", "tcp"),
    draining: bool = False,
    running: int = 0,
    waiting: int = 0,
    waiting_prefill_tokens: int = 0,
    free_blocks: int = 100,
    vocab_size: int | None = None,
    prefix_caching: bool = False,
) -> InstanceInfo:
    """A registration value as a worker would write it."""
    return InstanceInfo(
        id=instance_id,
        role=role,
        model=model,
        version="0.1.0",
        host=host,
        pid=1,
        started_at=1000.0,
        kv=KVInfo(
            block_size=16,
            num_blocks=128,
            free_blocks=free_blocks,
            dtype="float32",
            layout="block-major",
            block_bytes=2 * 2 * 16 * 2 * 8 * 4,  # layers, block size, KV heads, head dim, float32
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            prefix_caching=prefix_caching,
            weights_digest=WEIGHTS_DIGEST,
        ),
        load=LoadInfo(running=running, waiting=waiting, waiting_prefill_tokens=waiting_prefill_tokens),
        transfer=TransferInfo(protocols=list(protocols)),
        max_model_len=2048,
        draining=draining,
        vocab_size=vocab_size,
    )


def settings(redis_url: str, **overrides: Any) -> RouterSettings:
    fields: dict[str, Any] = {
        "redis_url": redis_url,
        "cluster": CLUSTER,
        "router_id": ROUTER_ID,
        "watch_interval_s": 0.05,
        "live_set_max_age_s": 0.05,
        "redis_wait_s": 5.0,
    }
    fields.update(overrides)
    return RouterSettings(**fields)


def run(coro: Awaitable[Any], timeout_s: float = 20.0) -> Any:
    """Run a test's coroutine; a hang fails the test within ``timeout_s`` instead of pytest's 300 s."""

    async def bounded() -> Any:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()
            raise AssertionError(f"test did not finish within {timeout_s} s")
        return task.result()

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def redis_conn(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = RedisSettings.from_url(redis_url).connect()
    try:
        yield client
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def router(redis_url: str, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A router app with its lifespan running, and an in-process client to it."""
    app = create_app(settings(redis_url, **overrides))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


@contextlib.asynccontextmanager
async def served_router(redis_url: str, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A router served by a real uvicorn on a free loopback port (for disconnects and real sockets)."""
    port = free_port()
    app = create_app(settings(redis_url, port=port, **overrides))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
    finally:
        server.should_exit = True
        await task


Handler = Callable[["FakeWorker", InboxMessage], Awaitable[None]]


class FakeWorker:
    """A scripted instance: registered with the real InstanceRegistry, fed by its real inbox.

    ``handler`` answers each message; the default one answers a GenerateRequest with "Hello",
    " world" and a finish with usage. ``received`` records every message in order.
    """

    def __init__(
        self, redis: aioredis.Redis, info: InstanceInfo, handler: Handler | None = None, ttl_s: float = 6.0
    ) -> None:
        self.redis = redis
        self.info = info
        self.handler = handler or answer
        self.registry = InstanceRegistry(redis, KEYS, ttl_s=ttl_s)
        self.inbox = Inbox(redis, KEYS, info.id)
        self.outbox = Outbox(redis, KEYS)
        self.received: list[InboxMessage] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def id(self) -> str:
        return self.info.id

    async def start(self) -> FakeWorker:
        await self.inbox.ensure_group()
        await self.registry.register(self.info)
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._stopping = True  # the read loop ends within one 20 ms block
            await asyncio.wait_for(self._task, 2.0)
            self._task = None
        if deregister:
            await self.registry.deregister(self.id)

    async def _run(self) -> None:
        while not self._stopping:
            for entry_id, msg in await self.inbox.read(count=64, block_ms=20):
                self.received.append(msg)
                await self.inbox.ack([entry_id])
                await self.handler(self, msg)

    async def publish(self, router_id: str, *deltas: RequestDelta) -> None:
        await self.outbox.publish(router_id, StepOutput(instance_id=self.id, items=list(deltas)))

    def requests(self) -> list[GenerateRequest]:
        return [m for m in self.received if isinstance(m, GenerateRequest)]

    def aborts(self) -> list[Abort]:
        return [m for m in self.received if isinstance(m, Abort)]

    async def wait_for(self, predicate: Callable[[FakeWorker], bool], timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.id}: condition not met; received {self.received}")
            await asyncio.sleep(0.01)


def token(i: int, text: str, logprob: float = -0.5) -> LogprobInfo:
    return LogprobInfo(
        token_id=i, token=text, logprob=logprob, top=[TopLogprob(token_id=i, token=text, logprob=logprob)]
    )


def deltas_for(
    msg: GenerateRequest | ReserveBlocks,
    texts: list[str],
    *,
    start: int = 0,
    finish: str = "stop",
    prompt_tokens: int = 3,
) -> list[RequestDelta]:
    """One delta per text piece (token ids 100+i), the last one final with usage."""
    out = []
    for i, text in enumerate(texts, start):
        last = i == start + len(texts) - 1
        out.append(
            RequestDelta(
                request_id=msg.request_id,
                token_ids=[100 + i],
                text=text,
                attempt=msg.attempt,
                logprobs=[token(100 + i, text)],
                finish_reason=finish if last else None,
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=start + len(texts))
                if last
                else None,
            )
        )
    return out


async def answer(worker: FakeWorker, msg: InboxMessage) -> None:
    """Default worker script: a whole request answered with "Hello world" (two deltas); a resumed
    one (a migration) with the deltas after its ``resume_token_ids``."""
    if isinstance(msg, GenerateRequest):
        done = len(msg.resume_token_ids or ())
        for delta in deltas_for(msg, ["Hello", " world"][done:], start=done):
            await worker.publish(msg.router_id, delta)


async def prefill_then_forward(worker: FakeWorker, msg: InboxMessage) -> None:
    """Prefill script: publish the first token, then hand the request to decode (ReserveBlocks +
    Prefilled in decode's inbox), as a real prefill instance does."""
    if not isinstance(msg, GenerateRequest) or msg.disaggregate_info is None:
        return
    info = msg.disaggregate_info
    first = RequestDelta(
        request_id=msg.request_id,
        token_ids=[100],
        text="Hello",
        attempt=msg.attempt,
        logprobs=[token(100, "Hello")],
    )
    await worker.publish(msg.router_id, first)
    reserve = ReserveBlocks(
        request_id=msg.request_id,
        router_id=msg.router_id,
        num_tokens=3,
        reply_to=worker.id,
        deadline=msg.deadline,
        deadlines=info.deadlines,
        sampling=msg.sampling,
        prompt_token_ids=[1, 2, 3],
        attempt=msg.attempt,
    )
    prefilled = Prefilled(
        request_id=msg.request_id, first_token=100, prompt_token_ids=[1, 2, 3], attempt=msg.attempt
    )
    await send_to_inbox(worker.redis, KEYS, info.decode.id, reserve)
    await send_to_inbox(worker.redis, KEYS, info.decode.id, prefilled)


async def decode_rest(worker: FakeWorker, msg: InboxMessage) -> None:
    """Decode script: after ReserveBlocks, stream " world" and the finish."""
    if isinstance(msg, ReserveBlocks):
        for delta in deltas_for(msg, [" world", "!"], start=1):
            await worker.publish(msg.router_id, delta)
    elif isinstance(msg, GenerateRequest):
        await answer(worker, msg)


async def silent(worker: FakeWorker, msg: InboxMessage) -> None:
    """A worker that never answers (deadlines, disconnects and dead instances)."""


def sse_events(text: str) -> list[Any]:
    """The data payloads of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    import orjson

    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out
