"""A lean Redis connection for the hot round trips, the router's outbox read and inbox send and the
worker's outbox publish (its one round trip per engine step): commands packed once into bytes, replies parsed by hiredis in an asyncio protocol, and none of
redis-py's per-command machinery (pipeline objects, argument packing, response callbacks, pool
checkout, retry and timeout contexts), which cost about two and a half times the round trip itself
(measured on one outbox read: ~130 µs of CPU through a pipeline, ~36 µs here).

redis-py opens the connection, so TLS, AUTH, HELLO, CLIENT SETNAME and SELECT are exactly its own;
then this takes the transport over. Errors are redis-py's classes, so callers keep their error
handling: ``ConnectionError`` when the connection is lost (and for the replies redis-py counts as
one: ``LOADING``, too many clients; and ``READONLY``, a primary turned replica), ``TimeoutError``
past the client's socket timeout: the connection is then dropped and the next call opens another
(numbered: :attr:`LeanConnection.generation`; a caller that must know which server it talks to, the
outbox reader, identifies each new one before using it, and pins its round trips to it). An
error reply of one command (``ResponseError`` and its subclasses, mapped as redis-py maps them)
leaves the connection as it is. Only a single server's client has a lean path (``redis://``,
``rediss://``, ``unix://``): :func:`lean_connection` returns None for a Redis Cluster (each key's
commands go to its own shard) and for a Sentinel-managed primary (in the failover test with this
path, requests were lost to first-token timeouts, as they were before it: workers dropped a live
router's work when a failover lost its key, since fixed; redis-py's connections serve there until
the failover test has been run with this path), and the caller keeps redis-py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import connection_kwargs

logger = logging.getLogger(__name__)

Arg = bytes | str | int


def pack(*args: Arg) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    return b"*%d\r\n" % len(args) + b"".join(map(bulk, args))


def bulk(arg: Arg) -> bytes:
    """One argument as a RESP bulk string (commands whose last argument changes keep the rest packed)."""
    data = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack_head(*args: Arg) -> bytes:
    """A command of ``len(args) + 1`` arguments packed without its last: ``pack_head(*a) + bulk(x)``
    is ``pack(*a, x)``, for commands sent often with only the last argument changing."""
    return pack(*args, b"")[: -len(bulk(b""))]


class _Replies(asyncio.Protocol):
    """Hands each round trip its replies, in order (several may be in flight on one connection)."""

    def __init__(
        self,
        transport: asyncio.Transport,
        owner: object = None,
        timeout_s: float | None = None,
        generation: int = 0,
    ) -> None:
        self.transport = transport
        self.generation = generation  # which of its LeanConnection's connections this is
        self.owner = owner  # what opened the transport (asyncio's StreamWriter closes it when collected)
        self.timeout_s = timeout_s
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: collections.deque[tuple[int, list[Any], asyncio.Future[list[Any]], float]] = (
            collections.deque()
        )
        """(replies expected, replies so far, their future, loop.time() when sent), oldest first."""
        self.lost: Exception | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    def send(self, packed: bytes, count: int) -> asyncio.Future[list[Any]]:
        """Write ``packed`` (``count`` commands); the future of their replies."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[Any]] = loop.create_future()
        self.waiting.append((count, [], done, loop.time()))
        self.transport.write(packed)
        if self._watchdog is None and self.timeout_s is not None:
            self._watchdog = loop.call_later(self.timeout_s, self._check)
        return done

    def _check(self) -> None:
        """The socket timeout, one timer per connection (not one per round trip): replies come in
        order, so only the oldest round trip waiting can be late; it fails with TimeoutError and the
        connection is dropped (the replies still due would answer the next round trip)."""
        self._watchdog = None
        if not self.waiting or self.lost is not None or self.timeout_s is None:
            return
        loop = asyncio.get_running_loop()
        _, _, done, sent_at = self.waiting[0]
        late_in = sent_at + self.timeout_s - loop.time()
        if late_in > 0:
            self._watchdog = loop.call_later(late_in, self._check)
            return
        self.waiting.popleft()
        if not done.done():
            done.set_exception(TimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))
        self.connection_lost(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while waiting:
            reply = self.reader.gets()
            if reply is False:
                return
            count, replies, done, _ = waiting[0]
            replies.append(reply)
            if len(replies) == count:
                waiting.popleft()
                if not done.done():
                    done.set_result(replies)
        if self.reader.gets() is not False:  # a reply nobody asked for: the stream is out of step
            self.connection_lost(ConnectionError("Redis sent a reply nobody asked for"))

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ConnectionError):
            self.lost = exc
        else:  # None: the server closed it (end of file)
            self.lost = ConnectionError(f"connection lost: {exc or 'closed by the server'}")
        while self.waiting:
            done = self.waiting.popleft()[2]
            if not done.done():
                done.set_exception(self.lost)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.transport.close()


class LeanConnection:
    """One dedicated connection of a single Redis server's client."""

    def __init__(self, client: aioredis.Redis, name: str) -> None:
        self.client = client
        self.name = name  # for logs: what this connection is for
        self.timeout_s = connection_kwargs(client).get("socket_timeout") or None
        self.retry = client.get_retry()
        self.generation = 0
        """How many connections this has opened: the number of the newest (0: none yet). Another
        connection may reach another server (restarted, failed over) behind the same address."""
        self._replies: _Replies | None = None
        self._opening: asyncio.Lock = asyncio.Lock()

    async def call(self, packed: bytes, count: int, raise_on_error: bool = True) -> list[Any]:
        """:meth:`execute` with the client's retries of connection errors and timeouts, as
        redis-py's own pipelines (a command whose reply was lost may run twice)."""
        retry = self.retry
        if retry is None:
            return await self.execute(packed, count, raise_on_error)
        return await retry.call_with_retry(lambda: self.execute(packed, count, raise_on_error), self._dropped)

    async def _dropped(self, error: Exception) -> None:
        self.close()

    @property
    def connected(self) -> int:
        """The :attr:`generation` of the open connection; 0 when there is none."""
        replies = self._replies
        return 0 if replies is None or replies.lost is not None else replies.generation

    async def connect(self) -> int:
        """The :attr:`generation` of the open connection, opening one (redis-py's handshake, with
        the client's retries) when there is none."""
        return self.connected or (await self._open()).generation

    async def execute(
        self, packed: bytes, count: int, raise_on_error: bool = True, generation: int | None = None
    ) -> list[Any]:
        """Send ``packed`` (``count`` commands) and return their replies. An error reply is raised
        (the first one), or left in the list (``raise_on_error=False``); one that redis-py counts as
        a connection error (READONLY, LOADING, ...) always drops the connection and is raised.
        ``generation`` (from :meth:`connect`): only on that connection; once it is lost,
        ConnectionError with nothing sent, rather than a new connection to a server not seen yet."""
        replies = self._replies
        if generation is not None:
            if replies is None or replies.lost is not None or replies.generation != generation:
                raise ConnectionError(f"the Redis connection of {self.name} was lost")
        elif replies is None or replies.lost is not None:
            replies = await self._open()
        try:
            result = await replies.send(packed, count)
        except asyncio.CancelledError:  # its replies still come, after a blocking command maybe:
            self._drop(replies)  # later round trips must not wait behind them
            raise
        first_error = None
        for i, reply in enumerate(result):
            if isinstance(reply, ResponseError):
                error = result[i] = _redis_error(reply)
                if isinstance(error, ConnectionError):
                    self._drop(replies)
                    raise error
                first_error = first_error or error
        if first_error is not None and raise_on_error:
            raise first_error
        return result

    def close(self) -> None:
        if self._replies is not None:
            self._drop(self._replies)

    def _drop(self, replies: _Replies) -> None:
        """Close ``replies``' connection (not a newer one another call may have opened since)."""
        if self._replies is replies:
            self._replies = None
        if replies.lost is None:
            replies.connection_lost(ConnectionError("connection closed"))

    async def _open(self) -> _Replies:
        async with self._opening:
            if self._replies is not None and self._replies.lost is None:
                return self._replies
            conn = self.client.connection_pool.make_connection()
            await conn.connect()  # redis-py's handshake, with the client's retries
            writer = getattr(conn, "_writer", None)
            transport = getattr(writer, "transport", None)
            if transport is None:  # pragma: no cover - a redis-py without asyncio streams
                await conn.disconnect()
                raise ConnectionError("this redis-py's connections expose no transport")
            conn._reader = conn._writer = None  # taken over: redis-py must not close it when collected
            self.generation += 1
            replies = _Replies(transport, writer, self.timeout_s, self.generation)
            transport.set_protocol(replies)
            self._replies = replies
            logger.debug("lean Redis connection %d for %s open", self.generation, self.name)
            return replies


def _redis_error(reply: ResponseError) -> ResponseError | ConnectionError:
    """An error reply as redis-py raises it (``READONLY`` too, which its Sentinel connections make a
    ConnectionError: the primary was demoted, the next connection finds the new one)."""
    message = str(reply)
    if message.startswith("READONLY"):
        return ConnectionError(f"the server is a replica now ({message})")
    error: ResponseError | ConnectionError = BaseParser.parse_error(message)
    return error


def lean_connection(client: RedisClient, name: str) -> LeanConnection | None:
    """A lean connection of ``client``'s server; None for a Redis Cluster or Sentinel client."""
    if isinstance(client, aioredis.RedisCluster) or isinstance(
        client.connection_pool, SentinelConnectionPool
    ):
        return None
    return LeanConnection(client, name)
