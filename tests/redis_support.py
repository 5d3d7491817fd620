"""Test helpers on the real Redis: run a coroutine against a fresh client, read a request's deltas
from a router's outbox."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import redis
import redis.asyncio as aioredis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from pdserve.scheduler import RedisSettings, RequestDelta, StepOutput
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.outbox_reader import DeltaQueue
from pdserve.scheduler.streams import FIELD

T = TypeVar("T")


def sync_client(redis_url: str) -> redis.Redis | RedisCluster:
    """A synchronous client for any URL pdserve accepts (a Sentinel's primary; a cluster, whose
    FLUSHDB reaches every primary)."""
    s = RedisSettings.from_url(redis_url)
    auth = {"username": s.username, "password": s.password}
    if s.mode == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in s.nodes], **auth)
    if s.mode == "sentinel":
        sentinels = Sentinel(list(s.nodes), sentinel_kwargs={"password": s.sentinel_password})
        return sentinels.master_for(s.service_name, db=s.db, **auth)
    return redis.Redis.from_url(redis_url)


def run(redis_url: str, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        client = RedisSettings.from_url(redis_url).connect()
        try:
            return await fn(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


async def outbox_deltas(
    redis: aioredis.Redis, outbox: str, request_id: str, timeout_s: float = 20
) -> AsyncIterator[RequestDelta]:
    """The deltas of ``request_id`` in the outbox stream ``outbox``, from its start, as they come;
    AssertionError when none is final within ``timeout_s``."""
    last = b"0-0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = await redis.xread({outbox: last}, block=500)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                for delta in decode_as(StepOutput, fields[FIELD]).items:
                    if delta.request_id == request_id:
                        yield delta
                        if delta.is_final:
                            return
    raise AssertionError(f"{request_id} got no final event within {timeout_s:g} s")


def one_delta_step(seq: int) -> StepOutput:
    """Instance d0's step output carrying request a's token ``seq`` as its delta ``seq``."""
    return StepOutput(instance_id="d0", items=[RequestDelta(request_id="a", token_ids=[seq], seq=seq)])


async def seqs_until(queue: DeltaQueue, last: int, timeout_s: float) -> list[int | str]:
    """The seqs of the deltas read until ``last`` arrives (an error's kind instead, and then stop;
    ``"timeout"`` last if neither came within ``timeout_s``)."""
    got: list[int | str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            delta = await asyncio.wait_for(queue.get(), max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            return [*got, "timeout"]
        if delta.error is not None:
            return [*got, delta.error.kind]
        assert delta.seq is not None
        got.append(delta.seq)
        if delta.seq == last:
            return got
