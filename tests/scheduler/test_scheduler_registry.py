"""Registry, live set, cache and heartbeat against a real Redis (short TTLs, real waiting)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio as aioredis
from redis_support import run

from pdserve.errors import ControlPlaneError
from pdserve.scheduler import (
    SCHEMA_VERSION,
    Heartbeat,
    InstanceInfo,
    InstanceRegistry,
    Keys,
    KVInfo,
    LiveSetCache,
    LoadInfo,
    RedisSettings,
    RouterInfo,
    RouterRegistry,
)

KEYS = Keys("reg-test")


def info(instance_id: str, running: int = 0) -> InstanceInfo:
    return InstanceInfo(
        id=instance_id,
        role="decode",
        model="tiny",
        version="0.1.0",
        host="h",
        pid=1,
        started_at=0.0,
        kv=KVInfo(block_size=16, num_blocks=64, free_blocks=64, dtype="float32", layout="block_major"),
        load=LoadInfo(running=running),
        max_model_len=512,
    )


def _commandstats(client: redis.Redis) -> dict[str, int]:
    """Successful calls of each command (an EVALSHA refused with NOSCRIPT does not count)."""
    stats = client.info("commandstats").items()
    return {k.removeprefix("cmdstat_"): v["calls"] - v.get("failed_calls", 0) for k, v in stats}


def test_register_writes_key_ttl_and_index_in_one_script(redis_url: str, redis_client: redis.Redis) -> None:
    clock_now = 1_800_000_000.0
    redis_client.config_resetstat()

    async def main(r: aioredis.Redis) -> None:
        await InstanceRegistry(r, KEYS, ttl_s=6.0, clock=lambda: clock_now).register(info("d0", running=3))

    run(redis_url, main)
    stats = _commandstats(redis_client)
    assert (stats.get("evalsha"), stats.get("set"), stats.get("zadd"), stats.get("multi")) == (1, 1, 1, None)
    key = "pdserve:{reg-test}:instance:d0"
    assert 5000 < redis_client.pttl(key) <= 6000
    assert orjson.loads(redis_client.get(key))["load"]["running"] == 3
    assert redis_client.zscore("pdserve:{reg-test}:instances", "d0") == (clock_now + 6.0) * 1000


def test_stopped_worker_leaves_live_set_within_ttl_and_index(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(r: aioredis.Redis) -> None:
        registry = InstanceRegistry(r, KEYS, ttl_s=1.0)
        await registry.register(info("d0"))
        await registry.register(info("d1"))
        assert [i.id for i in await registry.live()] == ["d0", "d1"]
        t0 = time.monotonic()
        for _ in range(6):  # d1 keeps beating, d0 stopped
            await asyncio.sleep(0.25)
            await registry.heartbeat(info("d1"))
            if [i.id for i in await registry.live()] == ["d1"]:
                break
        assert time.monotonic() - t0 <= 1.3
        assert [i.id for i in await registry.live()] == ["d1"]
        assert await r.zrange(KEYS.instances, 0, -1) == [b"d1"]  # pruned

    run(redis_url, main)


def test_prune_spares_ids_whose_score_is_in_the_future(redis_url: str, redis_client: redis.Redis) -> None:
    """A key that vanished while its id re-registered (score ahead) must keep its index entry."""

    async def main(r: aioredis.Redis) -> None:
        registry = InstanceRegistry(r, KEYS, ttl_s=30)
        await registry.register(info("d0"))
        await r.delete(KEYS.instance("d0"))
        assert await registry.live() == []
        assert await r.zscore(KEYS.instances, "d0") is not None
        assert await registry.live(now=time.time() + 60) == []
        assert await r.zscore(KEYS.instances, "d0") is None

    run(redis_url, main)


def test_deregister_get_alive_and_unreadable_values(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        registry = InstanceRegistry(r, KEYS)
        for i in ("d0", "d1", "d2"):
            await registry.register(info(i))
        await registry.deregister("d1")
        assert await r.zscore(KEYS.instances, "d1") is None and await registry.get("d1") is None
        assert (await registry.get("d0")) == info("d0")
        assert await registry.alive(["d0", "d1", "d2", "d0"]) == {"d0", "d2"}
        newer = {**info("d2").model_dump(), "v": SCHEMA_VERSION + 1}
        await r.set(KEYS.instance("d2"), orjson.dumps(newer), px=5000)
        assert [i.id for i in await registry.live()] == ["d0"]  # skipped, not fatal

    run(redis_url, main)


def test_routers_use_their_own_keys(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        routers = RouterRegistry(r, KEYS)
        await routers.register(RouterInfo(id="r1", host="h", pid=1, port=8000, started_at=0.0))
        assert [x.id for x in await routers.live()] == ["r1"]
        assert await InstanceRegistry(r, KEYS).live() == []

    run(redis_url, main)
    assert redis_client.exists("pdserve:{reg-test}:router:r1")
    assert redis_client.zscore("pdserve:{reg-test}:routers", "r1") is not None


class CountingRegistry(InstanceRegistry):
    """A real registry that counts its Redis reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0

    async def live(self, now: float | None = None) -> list[InstanceInfo]:
        self.reads += 1
        await asyncio.sleep(0.02)  # let concurrent callers pile up
        return await super().live(now)


def test_live_set_cache_staleness_bound_and_shared_refresh(redis_url: str, redis_client: redis.Redis) -> None:
    now = [100.0]

    async def main(r: aioredis.Redis) -> None:
        registry = CountingRegistry(r, KEYS)
        cache = LiveSetCache(registry, max_age_s=0.5, clock=lambda: now[0])
        await registry.register(info("d0"))
        results = await asyncio.gather(*(cache.get() for _ in range(20)))
        assert registry.reads == 1 and all([i.id for i in res] == ["d0"] for res in results)
        await registry.register(info("d1"))
        now[0] += 0.49
        assert [i.id for i in await cache.get()] == ["d0"] and registry.reads == 1  # within max_age
        now[0] += 0.02
        assert [i.id for i in await cache.get()] == ["d0", "d1"] and registry.reads == 2
        cache.invalidate()
        await cache.get()
        assert registry.reads == 3

    run(redis_url, main)


def test_live_set_cache_propagates_redis_errors() -> None:
    async def main() -> None:
        client = RedisSettings(port=1, retries=0, connect_timeout_s=0.2).connect()
        cache = LiveSetCache(InstanceRegistry(client, KEYS))
        with pytest.raises(ControlPlaneError, match="listing live instances"):
            await cache.get()
        await client.aclose()

    asyncio.run(main())


def test_heartbeat_renews_reports_load_and_deregisters(redis_url: str, redis_client: redis.Redis) -> None:
    load = [0]

    async def main(r: aioredis.Redis) -> None:
        registry = InstanceRegistry(r, KEYS, ttl_s=0.3)
        async with Heartbeat(registry, lambda: info("d0", running=load[0])) as hb:
            assert hb.interval_s == pytest.approx(0.1)
            await asyncio.sleep(0.45)  # longer than the TTL: alive only because it was renewed
            load[0] = 7
            await asyncio.sleep(0.25)
            live = await registry.live()
            assert [(i.id, i.load.running) for i in live] == [("d0", 7)]
        assert await registry.live() == [] and not await r.exists(KEYS.instance("d0"))

    run(redis_url, main)


def test_a_heartbeat_held_past_two_intervals_says_what_held_it(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An event loop blocked past the TTL lets the key expire with no failed beat to log: the next
    beat says how long it came after the last one, and that the loop (not Redis) held it."""

    async def main(r: aioredis.Redis) -> None:
        registry = InstanceRegistry(r, KEYS, ttl_s=0.3)  # beats every 0.1 s
        async with Heartbeat(registry, lambda: info("d0")):
            await asyncio.sleep(0.15)
            time.sleep(0.5)  # the loop held (an engine call on it, say): the key expires meanwhile
            await asyncio.sleep(0.15)

    with caplog.at_level(logging.WARNING, logger="pdserve.scheduler.registry"):
        run(redis_url, main)
    late = [rec.getMessage() for rec in caplog.records if "came" in rec.getMessage()]
    assert any(float(m.split("woke ")[1].split(" s")[0]) >= 0.3 for m in late), late


def test_heartbeat_survives_errors_and_re_registers(redis_url: str, redis_client: redis.Redis) -> None:
    """Redis errors and a failing info() are logged, not fatal; the key comes back afterwards."""
    broken = [False]

    def current() -> InstanceInfo:
        if broken[0]:
            raise RuntimeError("load probe failed")
        return info("d0")

    async def main(r: aioredis.Redis) -> None:
        good = InstanceRegistry(r, KEYS, ttl_s=0.3)
        unreachable = RedisSettings(port=1, retries=0, connect_timeout_s=0.1).connect()
        hb = Heartbeat(good, current, max_backoff_s=0.1)
        await hb.start()
        good.redis = unreachable  # Redis "goes away" under the running heartbeat
        await asyncio.sleep(0.5)
        assert not await r.exists(KEYS.instance("d0"))  # expired while Redis was unreachable
        good.redis = r
        broken[0] = True
        await asyncio.sleep(0.2)
        broken[0] = False
        await asyncio.sleep(0.3)
        assert await r.exists(KEYS.instance("d0"))  # re-created by a later beat
        await hb.stop()
        assert not await r.exists(KEYS.instance("d0"))
        await unreachable.aclose()

    run(redis_url, main)


def test_a_failing_heartbeat_retries_at_least_once_per_interval(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """After an outage the key is back within about one beat interval of Redis answering, however
    long the outage was: workers take a router whose key stays missing for a TTL for dead."""

    async def main(r: aioredis.Redis) -> None:
        registry = InstanceRegistry(r, KEYS, ttl_s=0.6)  # beats every 0.2 s
        unreachable = RedisSettings(port=1, retries=0, connect_timeout_s=0.1).connect()
        hb = Heartbeat(registry, lambda: info("d0"))
        await hb.start()
        registry.redis = unreachable  # failing beats at 0.2, 0.3, 0.5, 0.9, 1.7 s, then 3.3 s if uncapped
        await asyncio.sleep(2.0)
        assert not await r.exists(KEYS.instance("d0"))
        registry.redis = r
        back_at = time.monotonic()
        while not await r.exists(KEYS.instance("d0")):
            assert time.monotonic() - back_at < 0.5, "the heartbeat waited out its backoff"
            await asyncio.sleep(0.01)
        await hb.stop()
        await unreachable.aclose()

    run(redis_url, main)


def test_heartbeat_start_fails_loudly_when_redis_is_down() -> None:
    async def main() -> None:
        client = RedisSettings(port=1, retries=0, connect_timeout_s=0.2).connect()
        with pytest.raises(ControlPlaneError, match="registering instance d0"):
            await Heartbeat(InstanceRegistry(client, KEYS), lambda: info("d0")).start()
        await client.aclose()

    asyncio.run(main())
