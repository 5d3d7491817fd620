"""What one key's listings cost does not grow with another key's data: ``GET /v1/batches`` and
``GET /v1/files`` of key B take as many Redis round trips with 10,000 batches (and 2,000 files) of
key A stored as with none. Round trips are counted where redis-py writes a command (or a pipeline)
to the socket: each write is one request and its reply (the listings' scripts loaded first)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection

from pdserve.batchstore.batches import BatchStore
from pdserve.batchstore.files import FileStore
from pdserve.scheduler.keys import Keys

A, B = "a" * 32, "b" * 32  # two keys' digests
CHAT = "/v1/chat/completions"


class CountingConnection(Connection):
    """A connection that counts its writes to the socket (one per command, or per pipeline)."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.writes += 1
        await super().send_packed_command(command, check_health)


async def round_trips(call: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    before = CountingConnection.writes
    result = await call()
    return CountingConnection.writes - before, result


def counted_client(redis_url: str) -> aioredis.Redis:
    plain = aioredis.Redis.from_url(redis_url)
    kwargs = plain.connection_pool.connection_kwargs
    pool = aioredis.ConnectionPool(connection_class=CountingConnection, **kwargs)
    return aioredis.Redis(connection_pool=pool)


async def b_lists(files: FileStore, batches: BatchStore) -> dict[str, tuple[int, list[str]]]:
    """Key B's listings, each with its round trips and what it listed."""
    found: dict[str, tuple[int, list[str]]] = {}
    calls = {
        "batches": lambda: batches.list_batches(None, 20, B),
        "batches after": lambda: batches.list_batches(listed_batches[1], 20, B),
        "files": lambda: files.list_files(None, None, 10000, True, B),
        "files of a purpose": lambda: files.list_files("batch", None, 10000, True, B),
    }
    listed_batches: list[str] = []
    for name, call in calls.items():
        trips, (items, _) = await round_trips(call)
        found[name] = (trips, [i.id for i in items])
        if name == "batches":
            listed_batches = found[name][1]
    return found


def test_key_bs_listings_cost_the_same_with_key_as_10000_batches_stored(redis_url: str, redis_client) -> None:
    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        client = counted_client(redis_url)
        try:
            keys = Keys(f"cost{uuid.uuid4().hex[:8]}")
            files, batches = FileStore(client, keys), BatchStore(client, keys)
            for n in range(3):
                made = await files.create(f"b{n}.jsonl", "batch", b"{}\n", B)
                await batches.create(made.id, CHAT, "24h", None, owner=B)
                await asyncio.sleep(0.002)  # distinct creation ms: a definite order
            await b_lists(files, batches)  # loads the scripts (once per Redis): not a listing's cost
            alone = await b_lists(files, batches)
            a_file = await files.create("a.jsonl", "batch", b"{}\n", A)
            for _ in range(0, 1999, 50):  # 50 at a time: the pool's connections
                await asyncio.gather(*(files.create("a.jsonl", "batch", b"{}\n", A) for _ in range(50)))
            for _ in range(0, 10000, 50):
                await asyncio.gather(
                    *(batches.create(a_file.id, CHAT, "24h", None, owner=A) for _ in range(50))
                )
            beside_a = await b_lists(files, batches)
            a_listed, more = await batches.list_batches(None, 100, A)
            assert len(a_listed) == 100 and more and {b.owner for b in a_listed} == {A}
            return alone, beside_a
        finally:
            await client.aclose()

    alone, beside_a = asyncio.run(asyncio.wait_for(main(), 240))
    print("key B's round trips, alone / beside key A's 10,000 batches and 2,000 files:")
    for name in alone:
        print(f"  {name}: {alone[name][0]} / {beside_a[name][0]}")
    assert beside_a == alone  # the same round trips, and the same items listed
    assert len(alone["batches"][1]) == 3 and len(alone["batches after"][1]) == 1
    assert len(alone["files"][1]) == 3
    assert all(trips <= 2 for trips, _ in alone.values()), alone
