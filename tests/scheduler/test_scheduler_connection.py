"""RedisSettings parsing, the client it builds, and the startup wait (against a real Redis)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.errors import ConfigError, ControlPlaneError
from pdserve.scheduler import (
    Inbox,
    InstanceRegistry,
    Keys,
    Outbox,
    OutboxReader,
    RedisSettings,
    RequestDelta,
    StepOutput,
    check_server_version,
    redis_errors,
    wait_for_redis,
)
from pdserve.scheduler.redis_client import ReplicaWait, redact_url
from pdserve.scheduler.redis_server import redis_address

KEYS = Keys("conn-test")


def test_plain_url() -> None:
    s = RedisSettings.from_url("redis://cache.local:6380/2")
    assert (s.host, s.port, s.db, s.ssl, s.username, s.password) == (
        "cache.local",
        6380,
        2,
        False,
        None,
        None,
    )


def test_defaults_without_port_or_db() -> None:
    s = RedisSettings.from_url("redis://cache.local")
    assert (s.host, s.port, s.db) == ("cache.local", 6379, 0)


def test_tls_user_password_db() -> None:
    s = RedisSettings.from_url("rediss://svc:p%40ss%3Aw0rd@redis.example.com:6390/3?ssl_cert_reqs=none")
    assert s.ssl and s.ssl_cert_reqs == "none"
    assert (s.username, s.password, s.host, s.port, s.db) == (
        "svc",
        "p@ss:w0rd",
        "redis.example.com",
        6390,
        3,
    )
    assert "p@ss" not in repr(s)
    assert s.display_url == "rediss://svc:***@redis.example.com:6390/3"


def test_password_only_and_db_query() -> None:
    s = RedisSettings.from_url("redis://:secret@h?db=5")
    assert (s.username, s.password, s.db) == (None, "secret", 5)
    assert s.display_url == "redis://:***@h:6379/5"


def test_unix_socket() -> None:
    s = RedisSettings.from_url("unix:///run/redis.sock?db=1")
    assert (s.unix_socket_path, s.db) == ("/run/redis.sock", 1)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://h:1/0", "unsupported Redis URL scheme"),
        ("redis://h/x", "db must be a number"),
        ("redis://h:99999999/0", "bad port"),
        ("redis://h/0?bogus=1", "unknown Redis URL option 'bogus'"),
        ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("unix://", "needs a socket path"),
        ("redis+sentinel://s1:26379", "needs the monitored primary's name"),
        ("redis+sentinel://s1/a/b/c", "path is /<service>"),
        ("redis+sentinel://s1:x/mymaster", "bad port 'x'"),
        ("redis+sentinel://s1,,s2/mymaster", "empty host"),
        ("redis+cluster://n1:7000/1", "only db 0"),
        ("redis+cluster://n1:7000?db=2", "only db 0"),
        ("redis+cluster://n1?sentinel_password=x", "unknown Redis URL option 'sentinel_password'"),
        ("rediss+sentinel://s1/m", "TLS to a Sentinel or a Cluster is not supported"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisSettings.from_url(url)


def test_sentinel_url_lists_sentinels_service_db_and_separate_sentinel_credentials() -> None:
    url = (
        "redis+sentinel://app:p%40ss@s1:5000,s2,[::1]:5002/mymaster/3?sentinel_password=sp%26w&client_name=r"
    )
    s = RedisSettings.from_url(url)
    assert (s.mode, s.nodes, s.service_name, s.db) == (
        "sentinel",
        (("s1", 5000), ("s2", 26379), ("::1", 5002)),
        "mymaster",
        3,
    )
    assert (s.username, s.password, s.sentinel_password, s.client_name) == ("app", "p@ss", "sp&w", "r")
    assert s.display_url == "redis+sentinel://app:***@s1:5000,s2:26379,[::1]:5002/mymaster/3"
    assert "p%40ss" not in redact_url(url) and "sp%26w" not in redact_url(url)
    assert "p@ss" not in repr(s) and "sp&w" not in repr(s)


def test_cluster_url_lists_startup_nodes() -> None:
    s = RedisSettings.from_url("redis+cluster://:pw@n1:7000,n2:7001,n3")
    assert (s.mode, s.nodes, s.db, s.password) == (
        "cluster",
        (("n1", 7000), ("n2", 7001), ("n3", 6379)),
        0,
        "pw",
    )
    assert s.display_url == "redis+cluster://:***@n1:7000,n2:7001,n3:6379"


def test_sentinel_and_cluster_clients_are_built_for_their_nodes() -> None:
    async def main() -> None:
        sentinel = RedisSettings.from_url("redis+sentinel://:pw@s1:5000,s2:5001/mymaster/2").connect()
        pool = sentinel.connection_pool
        assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
        assert [
            (r.connection_pool.connection_kwargs["host"], r.connection_pool.connection_kwargs["port"])
            for r in pool.sentinel_manager.sentinels
        ] == [("s1", 5000), ("s2", 5001)]
        assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "pw")
        assert pool.connection_kwargs["retry"].get_retries() == 3
        await sentinel.aclose()
        cluster = RedisSettings.from_url("redis+cluster://n1:7000,n2:7001").connect()
        assert isinstance(cluster, aioredis.RedisCluster)
        assert sorted(cluster.nodes_manager.startup_nodes) == ["n1:7000", "n2:7001"]
        assert redis_address(cluster) == "cluster n1:7000,n2:7001"
        assert cluster.get_connection_kwargs()["decode_responses"] is False
        await cluster.aclose()

    asyncio.run(main())


def test_replica_wait_fails_writes_no_replica_acknowledged(redis_url: str, redis_client) -> None:
    """A server without replicas: WAIT 1 times out with 0, so the publish fails (to be retried);
    WAIT 0 passes; a cluster URL refuses the flag."""

    async def main() -> None:
        client = RedisSettings.from_url(redis_url).connect()
        step = StepOutput(instance_id="i0", items=[RequestDelta(request_id="q", token_ids=[1], text="a")])
        try:
            await Outbox(client, KEYS, wait=ReplicaWait(0)).publish("r1", step)
            started = time.monotonic()
            with pytest.raises(ControlPlaneError, match="0 of 1 replicas acknowledged within 50 ms"):
                await Outbox(client, KEYS, wait=ReplicaWait(1, 50)).publish("r1", step)
            assert time.monotonic() - started < 5  # bounded by the timeout, not hung
        finally:
            await client.aclose()

    asyncio.run(main())
    with pytest.raises(ConfigError, match="--redis-wait-replicas needs one primary"):
        ReplicaWait(1).check_url("redis+cluster://n1:7000")
    ReplicaWait(1).check_url("redis+sentinel://s1/m")
    with pytest.raises(ConfigError, match="--redis-wait-replicas must be >= 0"):
        ReplicaWait(-1)


def test_bad_scheme_message_hides_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        RedisSettings.from_url("http://u:hunter2@h/0")
    assert "hunter2" not in str(info.value)


def test_connect_builds_a_resilient_bytes_client() -> None:
    async def main() -> None:
        client = RedisSettings.from_url("rediss://u:pw@h:7000/4", health_check_interval_s=7).connect()
        pool = client.connection_pool
        kw = pool.connection_kwargs
        assert pool.connection_class.__name__ == "SSLConnection"
        assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == ("h", 7000, 4, "u", "pw")
        assert kw["health_check_interval"] == 7 and kw["socket_keepalive"] is True
        assert kw.get("decode_responses", False) is False
        assert kw["retry"].get_retries() == 3
        await client.aclose()

    asyncio.run(main())


def test_wait_for_redis_returns_the_version(redis_url: str) -> None:
    async def main() -> str:
        client = RedisSettings.from_url(redis_url).connect()
        try:
            return await wait_for_redis(client, timeout_s=5)
        finally:
            await client.aclose()

    major, minor = (int(p) for p in asyncio.run(main()).split(".")[:2])
    assert (major, minor) >= (6, 2)


def test_wait_for_redis_on_a_closed_port_fails_fast_and_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed

    async def main() -> None:
        client = RedisSettings.from_url(f"redis://127.0.0.1:{port}/0", retries=0).connect()
        try:
            await wait_for_redis(client, timeout_s=0.5)
        finally:
            await client.aclose()

    t0 = time.monotonic()
    with pytest.raises(ControlPlaneError, match=rf"Redis at 127.0.0.1:{port}/0 is unreachable after 0.5 s"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 2.0


def test_tls_against_a_plain_port_names_tls(redis_url: str) -> None:
    plain = redis_url.replace("redis://", "rediss://")

    async def main() -> None:
        client = RedisSettings.from_url(plain, retries=0).connect()
        try:
            await wait_for_redis(client, timeout_s=1.5)
        finally:
            await client.aclose()

    with pytest.raises(ControlPlaneError, match="TLS handshake did not complete") as exc:
        asyncio.run(main())
    assert "rediss:// needs one; a plain Redis port takes redis://" in str(exc.value)


def test_version_check_and_error_translation(redis_url: str) -> None:
    async def main() -> None:
        client = RedisSettings.from_url(redis_url).connect()
        try:
            with pytest.raises(ControlPlaneError, match=r"pdserve needs >= 99.0"):
                await check_server_version(client, (99, 0))
        finally:
            await client.aclose()

    asyncio.run(main())
    with (
        pytest.raises(ControlPlaneError, match="Redis failed while doing x: boom") as info,
        redis_errors("doing x"),
    ):
        raise RedisConnectionError("boom")
    assert isinstance(info.value.__cause__, RedisConnectionError)


def test_clients_that_decode_responses_or_time_out_before_a_block_are_refused() -> None:
    async def main() -> None:
        text_client = aioredis.Redis(decode_responses=True)
        for build in (
            lambda: Inbox(text_client, Keys(), "p0"),
            lambda: OutboxReader(text_client, Keys(), "r1"),
            lambda: InstanceRegistry(text_client, Keys()),
        ):
            with pytest.raises(ValueError, match="decode_responses=False"):
                build()
        client = RedisSettings(socket_timeout_s=1.0).connect()
        with pytest.raises(
            ValueError, match=r"block_ms=1000 must stay below the client's socket timeout \(1.0 s\)"
        ):
            OutboxReader(client, Keys(), "r1", block_ms=1000)
        with pytest.raises(ValueError, match="block_ms=5000"):
            await Inbox(client, Keys(), "p0").read(block_ms=5000)
        await text_client.aclose()
        await client.aclose()

    asyncio.run(main())


def test_a_write_on_a_connection_uvloop_closed_is_a_control_plane_error() -> None:
    """A server that dies while redis-py sets a new connection up closes uvloop's transport under it,
    and the write raises a bare RuntimeError: a Redis failure the callers retry, not a crash of the
    loop that made it (a worker's prefix-index loop stopped its instance on it)."""
    import uvloop

    async def main() -> None:
        server = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.abort()  # what uvloop does on a reset
        await asyncio.sleep(0)
        with (
            pytest.raises(ControlPlaneError, match="sending: the connection closed"),
            redis_errors("sending"),
        ):
            writer.writelines([b"PING\r\n"])
        with pytest.raises(RuntimeError, match="a bug"), redis_errors("sending"):
            raise RuntimeError("a bug")  # any other RuntimeError stays what it is
        server.close()

    uvloop.run(main())
