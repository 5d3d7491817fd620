"""The worker service in this process (echo engine, real Redis): what happens when Redis refuses a
command, and how a loop that dies ends the instance."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from redis_support import outbox_deltas, sync_client

from pdserve.engine.config import EngineConfig
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import (
    GenerateRequest,
    InstanceRegistry,
    Keys,
    RedisSettings,
    RouterInfo,
    RouterRegistry,
    send_to_inbox,
)
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings

ROUTER = "router-svc"


def settings(redis_url: str, tmp_path, cluster: str) -> WorkerSettings:
    return WorkerSettings(
        model_dir=tmp_path,
        role="mixed",
        redis_url=redis_url,
        cluster=cluster,
        ttl_s=3.0,
        engine_kind="echo",
        instance_id=f"mixed-{uuid.uuid4().hex[:6]}",
        engine=EngineConfig(num_blocks=64),
    )


def model_settings(redis_url: str, tmp_path, cluster: str, model_dir) -> WorkerSettings:
    """``settings`` with a real engine on ``model_dir`` instead of the echo engine."""
    return dataclasses.replace(
        settings(redis_url, tmp_path, cluster), model_dir=model_dir, engine_kind="model"
    )


async def started(service: WorkerService) -> asyncio.Task:
    task = asyncio.create_task(service.run())
    deadline = time.monotonic() + 20
    while await service.registry.get(service.id) is None:
        assert not task.done(), task.exception()
        assert time.monotonic() < deadline, "the worker did not register"
        await asyncio.sleep(0.05)
    return task


async def ask(
    redis, keys: Keys, instance_id: str, request_id: str, n: int, prompt: list[int] | None = None
) -> list[int]:
    """One generate straight into the inbox; the tokens of its final event from the router's outbox."""
    msg = GenerateRequest(
        request_id=request_id,
        router_id=ROUTER,
        prompt_token_ids=prompt or [7, 8],
        deadline=time.time() + 30,
        sampling=SamplingParams(max_tokens=n, temperature=0.0),
    )
    await send_to_inbox(redis, keys, instance_id, msg)
    tokens = []
    async for delta in outbox_deltas(redis, keys.outbox(ROUTER), request_id):
        assert delta.error is None, delta.error
        tokens += delta.token_ids
    return tokens


async def router_registered(redis_url: str, cluster: str):
    """A client and the cluster's keys, with ROUTER registered (workers serve only live routers)."""
    redis = RedisSettings.from_url(redis_url).connect()
    keys = Keys(cluster)
    await RouterRegistry(redis, keys, ttl_s=30).register(
        RouterInfo(id=ROUTER, host="h", pid=1, port=1, started_at=0.0)
    )
    return redis, keys


def test_the_registration_says_the_vocabulary_size(redis_url, tmp_path, tiny_model_dir, cluster) -> None:
    """The router bounds token ids by it: the echo engine says its tokenizer's size, or nothing
    without one (it takes any id)."""
    from pdserve.tokenizer import Tokenizer

    async def registered(model_dir) -> int | None:
        service = WorkerService(
            dataclasses.replace(settings(redis_url, tmp_path, cluster), model_dir=model_dir)
        )
        task = await started(service)
        try:
            return (await service.registry.get(service.id)).vocab_size
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)

    assert asyncio.run(registered(tiny_model_dir)) == Tokenizer.from_dir(tiny_model_dir).vocab_size > 0
    assert asyncio.run(registered(tmp_path)) is None


def test_a_redis_user_denied_xdel_does_not_stop_the_worker(redis_url, tmp_path, cluster) -> None:
    """Acking an inbox entry is XACK+XDEL: when Redis refuses, the worker logs it and keeps serving."""
    admin = sync_client(redis_url)
    admin.execute_command("ACL", "SETUSER", "nodel", "on", ">nodel-pw", "~*", "&*", "+@all", "-xdel")
    limited = redis_url.replace("redis://", "redis://nodel:nodel-pw@")

    async def main() -> None:
        service = WorkerService(settings(limited, tmp_path, cluster))
        redis, keys = await router_registered(redis_url, cluster)
        task = await started(service)
        try:
            assert await ask(redis, keys, service.id, "r1", 5) == [7, 8, 7, 8, 7]
            assert await ask(redis, keys, service.id, "r2", 3) == [7, 8, 7]  # still serving
            assert service.failed is None and not task.done()
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
            await redis.aclose()
        assert service.failed is None

    try:
        asyncio.run(main())
    finally:
        admin.execute_command("ACL", "DELUSER", "nodel")
        admin.close()


def test_a_loop_that_dies_stops_the_instance_and_says_which(redis_url, tmp_path, cluster) -> None:
    async def main() -> None:
        service = WorkerService(settings(redis_url, tmp_path, cluster))
        task = await started(service)

        async def broken() -> None:
            raise RuntimeError("a bug in housekeeping")

        service.handler.tick = broken  # the next housekeeping round dies
        await asyncio.wait_for(task, 30)
        assert service.failed == "housekeeping"  # run_worker turns this into exit status 1
        redis = RedisSettings.from_url(redis_url).connect()
        assert await InstanceRegistry(redis, Keys(cluster)).get(service.id) is None  # deregistered
        await redis.aclose()

    asyncio.run(main())


def test_inbox_messages_do_not_wait_one_engine_step_each(redis_url, tmp_path, cluster) -> None:
    """While the engine takes long steps (the echo engine slowed to 0.25 s a step, like a big model's
    prefill), a burst of 16 generates is admitted together, not one per step: before, every message
    that needs the engine thread queued behind a whole step, and a busy prefill's reserves missed
    their deadline this way."""
    step_s = 0.25

    async def main() -> float:
        service = WorkerService(settings(redis_url, tmp_path, cluster))
        redis, keys = await router_registered(redis_url, cluster)
        task = await started(service)
        engine = service.engine._engine
        fast_step = engine.step

        def slow_step():
            time.sleep(step_s)
            return fast_step()

        engine.step = slow_step
        try:
            busy = asyncio.create_task(ask(redis, keys, service.id, "busy", 24))  # keeps it stepping
            await asyncio.sleep(3 * step_s)
            t0 = time.monotonic()
            got = await asyncio.gather(*(ask(redis, keys, service.id, f"q{i}", 1) for i in range(16)))
            elapsed = time.monotonic() - t0
            assert got == [[7]] * 16
            busy.cancel()
            return elapsed
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 60)
            await redis.aclose()

    elapsed = asyncio.run(main())
    assert elapsed < 6 * step_s, f"16 one-token requests took {elapsed:.2f} s at {step_s} s a step"


def test_the_prefix_index_follows_the_cache_and_comes_back_when_redis_loses_it(
    redis_url, tmp_path, tiny_model_dir, cluster
) -> None:
    """A real engine's cached blocks appear in its set of the prefix index (the prompt's full blocks:
    what a prefill computed), a set Redis lost is re-published in full within a third of the TTL,
    and a clean stop removes it."""
    from pdserve.block_hash import chain_hashes

    prompt = list(range(100, 140))  # 2 full blocks of 16 and a partial one

    async def main() -> tuple[set, set, bool]:
        redis, keys = await router_registered(redis_url, cluster)
        service = WorkerService(model_settings(redis_url, tmp_path, cluster, tiny_model_dir))
        task = await started(service)
        key = keys.prefix_index(service.id)

        async def members(expected: int) -> set:
            deadline = time.monotonic() + 5
            while len(held := await redis.smembers(key)) != expected:
                assert time.monotonic() < deadline, held
                await asyncio.sleep(0.02)
            return held

        try:
            await ask(redis, keys, service.id, "r1", 4, prompt)
            published = await members(2)
            await redis.delete(key)  # Redis lost it
            restored = await members(2)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        gone = not await redis.exists(key)
        await redis.aclose()
        return published, restored, gone

    published, restored, gone = asyncio.run(main())
    assert published == restored == set(chain_hashes(prompt, 16)[:2])
    assert gone


def test_a_decoding_worker_renews_its_prefix_set_rarely_not_every_step(
    redis_url, tmp_path, tiny_model_dir, cluster
) -> None:
    """Steps that change nothing in the cache write nothing to the index but a renewed expiry, and
    that at most once per sixth of the TTL: 96 decode steps of one request, counted in Redis's own
    command statistics (PEXPIRE is the prefix index's alone), not one call per step."""

    async def main() -> tuple[int, float, int]:
        redis, keys = await router_registered(redis_url, cluster)
        service = WorkerService(model_settings(redis_url, tmp_path, cluster, tiny_model_dir))
        task = await started(service)
        try:
            await ask(redis, keys, service.id, "warm", 1, list(range(100, 140)))
            await asyncio.sleep(0.2)  # the publisher's write after that request
            before = (await redis.info("commandstats")).get("cmdstat_pexpire", {}).get("calls", 0)
            t0 = time.monotonic()
            tokens = await ask(redis, keys, service.id, "long", 96, list(range(200, 210)))
            elapsed = time.monotonic() - t0
            after = (await redis.info("commandstats")).get("cmdstat_pexpire", {}).get("calls", 0)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        return after - before, elapsed, len(tokens)

    renewals, elapsed, steps = asyncio.run(main())
    assert steps == 96
    # ttl_s 3: a renewal at most every 0.5 s (and one at either end), besides the writes of the
    # blocks the request fills (106 tokens: 6 full blocks of 16), whose pipelines renew it too
    assert renewals <= 2 + 6 + elapsed / 0.5, (renewals, elapsed)
