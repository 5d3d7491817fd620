"""The lean Redis connection (lean_redis.py) against a real Redis: RESP packing, pipelined round trips,
redis-py's errors on error replies, timeouts, lost connections and a demoted primary, and redis-py's own
handshake."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    ResponseError,
    TimeoutError,
)

from pdserve.localredis.embedded import EmbeddedRedis, free_port
from pdserve.scheduler.lean_redis import (
    Arg,
    LeanConnection,
    _redis_error,
    bulk,
    lean_connection,
    pack,
    pack_head,
)
from pdserve.scheduler.redis_client import RedisSettings

T = TypeVar("T")
NAME = "lean-redis-test"
"""The client name of the tests' connections (to find them in CLIENT LIST)."""


def with_lean(url: str, fn: Callable[[LeanConnection, aioredis.Redis], Awaitable[T]], **overrides: Any) -> T:
    """Run ``fn(lean, client)`` with a client made as pdserve makes them (``overrides``: RedisSettings
    fields) and a lean connection of it; both closed afterwards."""

    async def main() -> T:
        client = RedisSettings.from_url(url, client_name=NAME, **overrides).connect()
        assert isinstance(client, aioredis.Redis)
        lean = lean_connection(client, "test")
        assert isinstance(lean, LeanConnection)
        try:
            return await fn(lean, client)
        finally:
            lean.close()
            await client.aclose()

    return asyncio.run(main())


async def wait_blocked(client: aioredis.Redis, not_id: int | None = None) -> int:
    """The id of this test's connection blocked in a command (other than ``not_id``), once there is one."""
    for _ in range(300):
        for entry in await client.client_list():
            if entry["name"] == NAME and "b" in entry["flags"] and int(entry["id"]) != not_id:
                return int(entry["id"])
        await asyncio.sleep(0.01)
    raise AssertionError("no lean connection got blocked")


def test_pack_is_redis_pys_encoding_and_binary_values_round_trip(
    redis_url: str, redis_client: redis.Redis
) -> None:
    packer = Connection()
    commands: list[tuple[Arg, ...]] = [
        (b"SET", "clé", 42),
        ("INCRBY", b"n", -7),
        (b"ECHO", b""),
        (b"XADD", b"k", b"*", b"f", b"\r\n\x00\xff$3\r\n*1\r\n"),
        (b"XREAD", b"COUNT", 10, b"BLOCK", 1000, b"STREAMS", "s", b"0-0"),
    ]
    for args in commands:
        assert pack(*args) == b"".join(packer.pack_command(*args)), args
        assert pack_head(*args[:-1]) + bulk(args[-1]) == pack(*args), args
    payload = bytes(range(256)) + b"\r\n$5\r\n*2\r\n"

    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[Any, Any]:
        (entry_id,) = await lean.execute(pack(b"XADD", b"lean:s", b"*", b"data", payload), 1)
        (entries,) = await lean.execute(pack(b"XRANGE", b"lean:s", b"-", b"+"), 1)
        return entry_id, entries

    entry_id, entries = with_lean(redis_url, main)
    assert entries == [[entry_id, [b"data", payload]]]
    assert redis_client.xrange("lean:s") == [(entry_id, {b"data": payload})]


def test_replies_in_order_and_error_replies_raised_or_left_in_place(
    redis_url: str, redis_client: redis.Redis
) -> None:
    batch = pack(b"SET", b"s", b"text") + pack(b"INCR", b"s") + pack(b"INCR", b"n") + pack(b"GET", b"s")

    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[list[Any], list[Any]]:
        with pytest.raises(ResponseError, match="not an integer"):
            await lean.execute(batch, 4)
        first = lean._replies
        replies = await lean.execute(batch, 4, raise_on_error=False)
        after = await lean.execute(pack(b"GET", b"n") + pack(b"ECHO", b"still in step"), 2)
        assert lean._replies is first and first is not None and first.lost is None  # the connection is kept
        return replies, after

    replies, after = with_lean(redis_url, main)
    assert replies[0] == b"OK" and replies[2:] == [2, b"text"]  # INCR n ran in both batches
    assert isinstance(replies[1], ResponseError) and "not an integer" in str(replies[1])
    assert after == [b"2", b"still in step"]


def test_concurrent_round_trips_on_one_connection_each_get_their_replies(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> list[list[Any]]:
        await lean.execute(pack(b"PING"), 1)
        first = lean._replies

        async def one(i: int) -> list[Any]:  # replies of many sizes: some span several reads
            return await lean.execute(
                pack(b"INCRBY", f"c{i}", i) + pack(b"ECHO", b"%d:" % i + b"x" * 997 * i), 2
            )

        results = await asyncio.gather(*(one(i) for i in range(100)))
        assert lean._replies is first  # all on the one connection
        return results

    results = with_lean(redis_url, main)
    assert results == [[i, b"%d:" % i + b"x" * 997 * i] for i in range(100)]


def test_a_timeout_raises_and_drops_the_connection_so_its_late_reply_confuses_no_one(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[Any, ...]:
        (first_id,) = await lean.execute(pack(b"CLIENT", b"ID"), 1)
        first = lean._replies
        with pytest.raises(TimeoutError):
            await lean.execute(pack(b"BLPOP", b"q", 2), 1)  # outlasts the 0.3 s socket timeout
        assert first is not None and first.lost is not None
        await asyncio.sleep(0.1)  # the server sees the abandoned connection go
        await client.rpush(b"q", b"item")  # an abandoned BLPOP would take it
        (second_id,) = await lean.execute(pack(b"CLIENT", b"ID"), 1)
        echo = await lean.execute(pack(b"ECHO", b"after"), 1)
        return first_id, second_id, echo, await client.lrange(b"q", 0, -1)

    first_id, second_id, echo, queue = with_lean(redis_url, main, socket_timeout_s=0.3)
    assert second_id != first_id and echo == [b"after"]
    assert queue == [b"item"]


def test_the_timeout_counts_from_each_round_trips_own_send(redis_url: str) -> None:
    """One timer serves a connection: round trips answered in time never time out however long the
    connection lives, and a late one fails one socket timeout after it was sent, not after the first."""

    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[float, bool]:
        for _ in range(10):  # 0.5 s of quick round trips: past the 0.3 s timeout in all
            assert await lean.execute(pack(b"PING"), 1) == [b"PONG"]
            await asyncio.sleep(0.05)
        replies = lean._replies
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await lean.execute(pack(b"BLPOP", b"never", 2), 1)
        return time.monotonic() - t0, replies is not None and replies.lost is not None

    waited, dropped = with_lean(redis_url, main, socket_timeout_s=0.3)
    assert 0.25 <= waited < 0.6, waited
    assert dropped


def test_a_killed_connection_fails_execute_while_call_reconnects_and_retries(
    private_redis: EmbeddedRedis,
) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[Any, ...]:
        blocked = asyncio.ensure_future(lean.execute(pack(b"BLPOP", b"q", 5), 1))
        killed = await wait_blocked(client)
        await client.execute_command("CLIENT", "KILL", "ID", killed)
        with pytest.raises(ConnectionError):
            await blocked
        (after,) = await lean.execute(pack(b"CLIENT", b"ID"), 1)  # the next one opens a new connection

        retried = asyncio.ensure_future(lean.call(pack(b"BLPOP", b"q", 5), 1))
        killed_too = await wait_blocked(client)
        await client.execute_command("CLIENT", "KILL", "ID", killed_too)
        again = await wait_blocked(client, not_id=killed_too)  # the retry, blocked on a new connection
        await client.rpush(b"q", b"item")
        return killed, after, killed_too, again, await retried

    killed, after, killed_too, again, (reply,) = with_lean(private_redis.url, main, socket_timeout_s=10)
    assert after != killed and killed_too == after and again != killed_too
    assert reply == [b"q", b"item"]


def test_a_restarted_server_fails_execute_and_the_next_call_reconnects(private_redis: EmbeddedRedis) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> list[Any]:
        await lean.execute(pack(b"SET", b"k", b"1"), 1)
        blocked = asyncio.ensure_future(lean.execute(pack(b"BLPOP", b"q", 5), 1))
        await wait_blocked(client)
        private_redis.stop(kill=True)
        with pytest.raises(ConnectionError):
            await blocked
        with pytest.raises(ConnectionError):  # down: no connection to open
            await lean.execute(pack(b"PING"), 1)
        private_redis.start()
        return await lean.call(pack(b"GET", b"k") + pack(b"PING"), 2)

    assert with_lean(private_redis.url, main, retries=1, connect_timeout_s=0.2) == [None, b"PONG"]


def test_a_round_trip_pinned_to_a_connection_is_never_sent_on_another(private_redis: EmbeddedRedis) -> None:
    """Each connection opened is numbered; a round trip given a number goes out on that connection
    only, and once it is lost fails with nothing sent (another connection may reach another server,
    one its caller, the outbox reader, has not identified yet)."""

    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[Any, ...]:
        first = await lean.connect()
        assert await lean.connect() == first  # the open one
        (killed,) = await lean.execute(pack(b"CLIENT", b"ID"), 1, generation=first)
        await client.execute_command("CLIENT", "KILL", "ID", killed)
        for _ in range(100):
            if lean._replies is None or lean._replies.lost is not None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ConnectionError, match="lost"):
            await lean.execute(pack(b"INCR", b"n"), 1, generation=first)
        sent_anyway = await client.get(b"n")
        second = await lean.connect()
        incr = await lean.execute(pack(b"INCR", b"n"), 1, generation=second)
        with pytest.raises(ConnectionError, match="lost"):  # an older number: not this connection
            await lean.execute(pack(b"INCR", b"n"), 1, generation=first)
        return first, second, sent_anyway, incr, await client.get(b"n")

    first, second, sent_anyway, incr, n = with_lean(private_redis.url, main)
    assert (second, sent_anyway, incr, n) == (first + 1, None, [1], b"1")


def test_readonly_closes_the_connection_and_raises_connection_error(private_redis: EmbeddedRedis) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> tuple[Any, ...]:
        assert await lean.execute(pack(b"SET", b"k", b"1"), 1) == [b"OK"]
        first = lean._replies
        # demoted: a replica (read-only) of a primary that is not there, still serving its data
        await client.execute_command("REPLICAOF", "127.0.0.1", free_port())
        with pytest.raises(ConnectionError, match="replica") as raised:
            await lean.execute(pack(b"GET", b"k") + pack(b"SET", b"k", b"2"), 2, raise_on_error=False)
        assert "READONLY" in str(raised.value)
        assert first is not None and first.lost is not None and lean._replies is None
        reply = await lean.execute(pack(b"GET", b"k"), 1)  # reads still work, on a new connection
        assert lean._replies is not None and lean._replies is not first
        with pytest.raises(ConnectionError, match="replica"):  # raise_on_error=True: READONLY wins too
            await lean.execute(pack(b"SET", b"k", b"3"), 1)
        return reply, await client.get(b"k")

    assert with_lean(private_redis.url, main) == ([b"1"], b"1")


def test_the_handshake_is_redis_pys_auth_select_and_client_name(private_redis: EmbeddedRedis) -> None:
    password = "s3cret pass"
    with redis.Redis(port=private_redis.port) as admin:
        admin.config_set("requirepass", password)
    url = f"redis://:s3cret%20pass@127.0.0.1:{private_redis.port}/3"

    async def main(lean: LeanConnection, client: aioredis.Redis) -> list[Any]:
        return await lean.execute(pack(b"CLIENT", b"GETNAME") + pack(b"SET", b"where", b"db3"), 2)

    assert with_lean(url, main) == [NAME.encode(), b"OK"]
    with redis.Redis(port=private_redis.port, password=password, db=3) as db3:
        assert db3.get("where") == b"db3"
    with redis.Redis(port=private_redis.port, password=password, db=0) as db0:
        assert db0.get("where") is None

    async def refused(lean: LeanConnection, client: aioredis.Redis) -> None:
        with pytest.raises(AuthenticationError):
            await lean.execute(pack(b"PING"), 1)

    with_lean(f"redis://:wrong@127.0.0.1:{private_redis.port}/3", refused)


def test_lean_connection_is_none_for_cluster_and_sentinel_clients_and_lean_for_a_plain_one() -> None:
    async def main() -> None:
        port = free_port()  # nothing listens there: making the clients must not connect
        cluster = RedisSettings.from_url(f"redis+cluster://127.0.0.1:{port}").connect()
        sentinel = RedisSettings.from_url(f"redis+sentinel://127.0.0.1:{port}/main").connect()
        plain = RedisSettings.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.7).connect()
        try:
            assert isinstance(cluster, aioredis.RedisCluster)
            assert lean_connection(cluster, "cluster") is None
            assert lean_connection(sentinel, "sentinel") is None
            lean = lean_connection(plain, "plain")
            assert isinstance(lean, LeanConnection)
            assert lean.client is plain and lean.timeout_s == 0.7
        finally:
            await cluster.aclose()
            await sentinel.aclose()
            await plain.aclose()

    asyncio.run(main())


def test_garbage_collection_leaves_the_taken_over_transport_open(redis_url: str) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> None:
        assert await lean.execute(pack(b"PING"), 1) == [b"PONG"]
        first = lean._replies
        gc.collect()  # redis-py's Connection object, now unreferenced, closes its writer when collected
        await asyncio.sleep(0.05)  # a closed transport reports it on a later loop turn
        assert first is not None and first.lost is None and not first.transport.is_closing()
        assert await lean.execute(pack(b"PING"), 1) == [b"PONG"]
        assert lean._replies is first and first.lost is None

    with_lean(redis_url, main)


def test_a_reply_nobody_asked_for_drops_the_connection(redis_url: str) -> None:
    async def main(lean: LeanConnection, client: aioredis.Redis) -> None:
        assert await lean.execute(pack(b"ECHO", b"a") + pack(b"ECHO", b"b"), 1) == [b"a"]  # count too low
        first = lean._replies
        assert first is not None
        for _ in range(100):
            if first.lost is not None:
                break
            await asyncio.sleep(0.01)
        assert isinstance(first.lost, ConnectionError)
        assert await lean.execute(pack(b"ECHO", b"c"), 1) == [b"c"]  # not b"b": a new connection

    with_lean(redis_url, main)


def test_error_replies_become_redis_pys_exceptions() -> None:
    """An error reply maps to the class redis-py raises for it: LOADING and READONLY are connection
    errors (retried on a new connection), a command's own error stays a ResponseError."""
    loading = _redis_error(ResponseError("LOADING Redis is loading the dataset in memory"))
    assert isinstance(loading, BusyLoadingError) and isinstance(loading, ConnectionError)
    readonly = _redis_error(ResponseError("READONLY You can't write against a read only replica."))
    assert isinstance(readonly, ConnectionError) and "replica" in str(readonly)
    assert isinstance(_redis_error(ResponseError("NOAUTH Authentication required.")), AuthenticationError)
    wrongtype = _redis_error(ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))
    assert type(wrongtype) is ResponseError and not isinstance(wrongtype, ConnectionError)
