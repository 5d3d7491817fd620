"""Test helper shared by the scheduler tests: run a coroutine against a fresh client of the real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from pdserve.scheduler import RedisSettings

T = TypeVar("T")


def run(redis_url: str, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        client = RedisSettings.from_url(redis_url).connect()
        try:
            return await fn(client)
        finally:
            await client.aclose()

    return asyncio.run(main())
