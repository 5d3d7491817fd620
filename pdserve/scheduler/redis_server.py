"""Talking to the Redis server a client reaches (the client itself comes from redis_client.py): where
it points (:func:`redis_address`, for messages), the startup wait and the version check, what the
server says of itself (``run_id``, role, replication history: was it restarted or failed over?), how
much memory batch data may still take, how long an outage may last, and the one place where
redis-py errors become :class:`~pdserve.errors.ControlPlaneError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import AuthenticationError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.errors import ControlPlaneError, ControlPlaneFullError
from pdserve.scheduler.redis_client import RedisClient, _join_host

logger = logging.getLogger(__name__)

MIN_REDIS_VERSION = (6, 2)
"""XAUTOCLAIM, XTRIM MINID, GETDEL and ZRANGE's BYSCORE/REV forms all arrived in Redis 6.2."""

RedisObserver = Callable[[str, "float | None", "BaseException | None"], None]
"""``observe(op, seconds, error)`` after a Redis round trip of the kind ``op``: its duration (None
where it is not a plain round trip, e.g. a blocking read) and the error that ended it, if any.
For metrics; it must be cheap and must not raise."""


def redis_address(client: RedisClient) -> str:
    """Where a client points, for messages (never includes the password)."""
    if isinstance(client, aioredis.RedisCluster):
        nodes = ",".join(
            sorted(node.name for node in client.get_nodes()) or client.nodes_manager.startup_nodes
        )
        return f"cluster {nodes}"
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        sentinels = ",".join(
            _join_host(
                s.connection_pool.connection_kwargs.get("host", "?"),
                s.connection_pool.connection_kwargs.get("port", "?"),
            )
            for s in pool.sentinel_manager.sentinels
        )
        primary = f", primary {_join_host(*pool.master_address)}" if pool.master_address else ""
        return f"service {pool.service_name!r} via Sentinels {sentinels}{primary} (db {kw.get('db', 0)})"
    if kw.get("path"):
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def connection_kwargs(client: RedisClient) -> dict[str, Any]:
    """The keyword arguments the client's connections are made with (timeouts, decoding, TLS)."""
    if isinstance(client, aioredis.RedisCluster):
        return client.get_connection_kwargs()
    return client.connection_pool.connection_kwargs


def uses_tls(client: RedisClient) -> bool:
    """Whether the client speaks TLS (a ``rediss://`` URL)."""
    if isinstance(client, aioredis.RedisCluster):
        return bool(connection_kwargs(client).get("ssl"))
    return "SSL" in client.connection_pool.connection_class.__name__


def require_bytes_responses(client: RedisClient) -> None:
    """Raise ValueError unless ``client`` returns bytes (``decode_responses=False``, as connect() makes)."""
    if connection_kwargs(client).get("decode_responses"):
        raise ValueError("pdserve's scheduler needs a Redis client with decode_responses=False")


def require_block_below_timeout(client: RedisClient, block_ms: int) -> None:
    """A blocking read must return before the socket timeout, or it fails and is retried blindly."""
    timeout = connection_kwargs(client).get("socket_timeout")
    if timeout is not None and block_ms / 1000 >= timeout:
        raise ValueError(f"block_ms={block_ms} must stay below the client's socket timeout ({timeout} s)")


async def wait_for_redis(
    client: RedisClient,
    timeout_s: float = 10.0,
    *,
    min_version: tuple[int, int] = MIN_REDIS_VERSION,
    max_delay_s: float = 1.0,
) -> str:
    """PING until Redis answers (logging each retry), then check its version; return the version.

    Raises ControlPlaneError when Redis is still unreachable after ``timeout_s``, rejects the
    credentials, or is older than ``min_version``.
    """
    where = redis_address(client)
    deadline = time.monotonic() + timeout_s
    delay = min(0.05, max_delay_s)
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        try:
            await asyncio.wait_for(client.ping(), timeout=max(remaining, 0.05))
            break
        except (AuthenticationError, ResponseError) as e:
            raise ControlPlaneError(f"Redis at {where} refused the connection: {e}") from e
        except (RedisError, OSError, TimeoutError) as e:  # the builtin: asyncio's timeouts
            reason = error_reason(e)
            if uses_tls(client) and (
                isinstance(e, (TimeoutError, RedisTimeoutError, ssl.SSLError)) or "SSL" in reason
            ):
                reason = (
                    f"the TLS handshake did not complete ({reason}): is {where} a TLS port? rediss:// needs "
                    "one; a plain Redis port takes redis://"
                )
            if time.monotonic() + delay >= deadline:
                raise ControlPlaneError(
                    f"Redis at {where} is unreachable after {timeout_s:g} s ({attempts} attempts): {reason}"
                ) from e
            logger.warning(
                "Redis at %s is not reachable (%s); retry %d in %.2f s", where, reason, attempts, delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
    return await check_server_version(client, min_version)


async def check_server_version(client: RedisClient, min_version: tuple[int, int] = MIN_REDIS_VERSION) -> str:
    """Return the server's version string; raise ControlPlaneError if it is older than ``min_version``.

    A server that forbids INFO (some managed services) is assumed recent enough, with a warning.
    """
    with redis_errors("reading the Redis server version"):
        try:
            info = await client.info("server")
        except ResponseError as e:
            logger.warning(
                "cannot check the version of Redis at %s (%s); assuming >= %s",
                redis_address(client),
                e,
                ".".join(map(str, min_version)),
            )
            return "unknown"
    version = str(info.get("redis_version", "0"))
    numbers = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])
    if numbers < min_version:
        need = ".".join(map(str, min_version))
        raise ControlPlaneError(
            f"Redis at {redis_address(client)} is version {version}; pdserve needs >= {need} "
            "(XAUTOCLAIM, XTRIM MINID)"
        )
    return version


async def server_info(client: RedisClient, key: str, section: str = "server") -> dict[str, Any]:
    """``INFO <section>`` of the server holding ``key``: on a cluster, the shard owning its slot (its
    ``run_id`` tells whether the data behind that key was lost to a restart), else the one server."""
    if isinstance(client, aioredis.RedisCluster):
        await client.initialize()  # the slot map (a no-op once known)
        return await client.info(section, target_nodes=client.get_node_from_key(key))
    return await client.info(section)


NO_REPLID = "0" * 40
"""``master_replid2`` of a server that has no previous replication history (never promoted)."""


@dataclasses.dataclass(frozen=True)
class ServerIdentity:
    """Which server answers for a key, and which replication history its data continues: from
    ``INFO server`` and ``INFO replication``. A replica promoted by a failover keeps its primary's
    data under a new ``run_id``, takes a new ``master_replid`` and keeps the old one as
    ``master_replid2``; a restarted server (empty, or loaded from its own older snapshot) has none."""

    run_id: str
    role: str
    replid: str = ""
    replid2: str = ""

    def continues(self, before: ServerIdentity) -> bool:
        """Whether this is another server whose data continues ``before``'s: a replica of it that a
        failover promoted (its ``master_replid2`` is ``before``'s ``master_replid``). False for
        ``before`` itself and for a restarted server."""
        return (
            self.run_id != before.run_id
            and self.role == "master"
            and before.replid not in ("", NO_REPLID)
            and self.replid2 == before.replid
        )


async def server_identity(client: RedisClient, key: str) -> ServerIdentity:
    """:class:`ServerIdentity` of the server holding ``key`` (on a cluster, the shard owning its slot)."""
    target: dict[str, Any] = {}
    if isinstance(client, aioredis.RedisCluster):
        await client.initialize()
        target["target_nodes"] = client.get_node_from_key(key)
    server = await client.info("server", **target)
    try:
        replication = await client.info("replication", **target)
    except ResponseError:  # forbidden (an ACL that allows INFO server): no history, a restart then
        replication = {}
    return identity_from_info(server, replication)


def identity_from_info(server: Mapping[str, Any], replication: Mapping[str, Any]) -> ServerIdentity:
    """:class:`ServerIdentity` from ``INFO server`` and ``INFO replication`` (empty: forbidden), as
    redis-py parses them or as :func:`info_fields` reads a raw reply."""

    def text(info: Mapping[str, Any], name: str) -> str:
        value = info.get(name, "")
        if value == 0 and name == "master_replid2":  # redis-py's INFO parser made "000…0" a number
            return NO_REPLID
        return value.decode() if isinstance(value, bytes) else str(value)

    return ServerIdentity(
        text(server, "run_id"),
        text(replication, "role") or "master",
        text(replication, "master_replid"),
        text(replication, "master_replid2"),
    )


def info_fields(reply: bytes) -> dict[str, str]:
    """The ``name:value`` lines of a raw ``INFO`` reply, as text (for :func:`identity_from_info`)."""
    fields = {}
    for line in reply.decode(errors="replace").splitlines():
        name, colon, value = line.partition(":")
        if colon and not name.startswith("#"):
            fields[name] = value
    return fields


async def server_role(client: RedisClient, key: str) -> str:
    """``ROLE`` of the server holding ``key`` (``master``, ``slave``): a primary that a failover
    demoted still answers reads, with its new primary's data."""
    if isinstance(client, aioredis.RedisCluster):
        await client.initialize()
        reply = await client.execute_command("ROLE", target_nodes=client.get_node_from_key(key))
    else:
        reply = await client.execute_command("ROLE")
    role = reply[0]
    return role.decode() if isinstance(role, bytes) else str(role)


SERVING_RESERVE_MIN_BYTES = 32 << 20
"""The least of Redis's ``maxmemory`` kept for serving (:class:`MemoryRoom`); a tenth when more."""


@dataclasses.dataclass(frozen=True)
class MemoryRoom:
    """How much batch data (uploaded files, batch lines' outcomes) may still add to the server
    holding a key: its ``maxmemory`` less what it uses, less the serving reserve. Heartbeats,
    registrations and the request streams are writes too; batch data never takes the reserve, so a
    Redis filled by batches still serves (at ``maxmemory`` under ``noeviction`` it refuses them all)."""

    used: int
    maxmemory: int

    @property
    def reserve(self) -> int:
        """The part of ``maxmemory`` kept for serving: a tenth, at least SERVING_RESERVE_MIN_BYTES."""
        return min(self.maxmemory, max(self.maxmemory // 10, SERVING_RESERVE_MIN_BYTES))

    @property
    def room(self) -> int:
        """Bytes batch data may still add (negative: it is already into the reserve)."""
        return self.maxmemory - self.reserve - self.used

    def refuse(self, action: str) -> ControlPlaneFullError:
        """The 507 for ``action`` (what would have gone into the reserve)."""
        if self.used >= self.maxmemory:
            return ControlPlaneFullError(_full_message(action))
        mib = 1 << 20
        return ControlPlaneFullError(
            f"Redis is nearly full: {self.used / mib:.1f} MiB used of its maxmemory of "
            f"{self.maxmemory / mib:.1f} MiB, whose last {self.reserve / mib:.1f} MiB are kept for "
            f"serving; {action} was refused; {_FREE_MEMORY}, or keep file bytes on disk (--files-dir)"
        )


async def memory_room(client: RedisClient, key: str) -> MemoryRoom | None:
    """The :class:`MemoryRoom` of the server holding ``key``; None when it has no ``maxmemory``."""
    with redis_errors("reading Redis's memory use"):
        info = await server_info(client, key, "memory")
    maxmemory = int(info.get("maxmemory", 0))
    return MemoryRoom(int(info["used_memory"]), maxmemory) if maxmemory > 0 else None


REDIS_OUTAGE_S = 5.0
"""How long a router's outbox reader waits for an unreachable Redis before it fails every request
waiting on it (:func:`outage_limit_s` adds a Sentinel's failover time with replica waits on); a
worker retries a send at least as long, so nothing a router still waits for is given up."""


async def outage_limit_s(client: RedisClient, failover: bool) -> float:
    """How long Redis may stay unreachable before requests waiting on it fail: ``REDIS_OUTAGE_S``;
    with ``failover`` (replica waits on: a failover loses nothing counted as sent) and a
    Sentinel-managed primary, plus the Sentinels' ``down-after-milliseconds`` for it, since a
    failover starts only once they agree the primary is down (the election and the promotion
    take the rest). The first Sentinel that answers says; none answering: ``REDIS_OUTAGE_S``."""
    if not failover or isinstance(client, aioredis.RedisCluster):
        return REDIS_OUTAGE_S
    pool = client.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return REDIS_OUTAGE_S
    for sentinel in pool.sentinel_manager.sentinels:
        try:
            state = await sentinel.sentinel_master(pool.service_name)
            down_after_ms = int(state["down-after-milliseconds"])
        except (RedisError, OSError, KeyError, TypeError, ValueError) as e:
            logger.debug("a Sentinel did not say its down-after-milliseconds: %s", error_reason(e))
            continue
        return REDIS_OUTAGE_S + down_after_ms / 1000
    return REDIS_OUTAGE_S


_OOM_REPLY = "OOM command not allowed"
"""How Redis refuses a write at its ``maxmemory`` under ``noeviction``."""


_FREE_MEMORY = "delete files or batches, or wait for them to expire, or raise Redis's maxmemory"


def _full_message(action: str) -> str:
    return f"Redis is full (at its maxmemory, and it evicts nothing): {action} was refused; {_FREE_MEMORY}"


@contextlib.contextmanager
def redis_errors(action: str) -> Iterator[None]:
    """Translate redis-py errors raised inside the block into ControlPlaneError naming ``action``."""
    try:
        yield
    except RedisError as e:
        # Redis 6's scripts report a refused write as a script error that quotes the OOM reply;
        # the reply's text is not passed on: a pipeline's quotes its command (a file's bytes)
        if isinstance(e, OutOfMemoryError) or _OOM_REPLY in str(e):
            raise ControlPlaneFullError(_full_message(action)) from e
        raise ControlPlaneError(f"Redis failed while {action}: {error_reason(e)}") from e
    except RuntimeError as e:
        if not _transport_closed(e):
            raise
        raise ControlPlaneError(f"Redis failed while {action}: the connection closed") from e


def _transport_closed(e: RuntimeError) -> bool:
    """uvloop's error for a write on a transport it closed (the server went away while redis-py was
    setting a new connection up): redis-py lets it through as it is, not as a ConnectionError."""
    return "the handler is closed" in str(e)


def error_reason(e: BaseException) -> str:
    """A redis-py error for a message: its text without the client repr that Sentinel's
    ``MasterNotFoundError`` appends ("No master found for 'x' : <redis.asyncio.client.Redis(...)>")."""
    return str(e).split(" : <redis.", 1)[0] or type(e).__name__
