"""Dead letters: an inbox message whose handling crashed the worker at every
restart is dead-lettered after ``--max-deliveries`` deliveries, its client gets an error, and
``pdserve status`` shows the instance's dead letters. The worker service in this process (echo
engine, real Redis)."""

from __future__ import annotations

import asyncio
import time
import uuid

from redis_support import outbox_deltas

from pdserve import status_read, status_table
from pdserve.engine.config import EngineConfig
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import (
    GenerateRequest,
    Inbox,
    Keys,
    RedisSettings,
    RouterInfo,
    RouterRegistry,
    send_to_inbox,
)
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings

ROUTER = "router-dl"


def generate(request_id: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        router_id=ROUTER,
        prompt_token_ids=[7, 8],
        deadline=time.time() + 60,
        sampling=SamplingParams(max_tokens=3, temperature=0.0),
    )


def test_a_message_that_crashed_every_restart_is_dead_lettered_and_its_client_told(
    redis_url, tmp_path, cluster
) -> None:
    """``poison`` was delivered to this instance id 3 times, and each time the instance died
    before acking it (what Redis records of a worker killed while handling it; the next entry,
    ``fine``, was delivered with it once). Restarted under that id with ``--max-deliveries 3``,
    the worker hands ``poison`` over no more: it is in the dead-letter stream, its router gets a
    final error, ``fine`` is served, and ``pdserve status`` counts the dead letter."""
    instance_id = f"mixed-{uuid.uuid4().hex[:6]}"
    keys = Keys(cluster)

    async def main() -> None:
        redis = RedisSettings.from_url(redis_url).connect()
        await RouterRegistry(redis, keys, ttl_s=30).register(
            RouterInfo(id=ROUTER, host="h", pid=1, port=1, started_at=0.0)
        )
        crashed = Inbox(redis, keys, instance_id)
        await crashed.ensure_group()
        await send_to_inbox(redis, keys, instance_id, generate("poison"))
        await send_to_inbox(redis, keys, instance_id, generate("fine"))
        assert len(await crashed.read(count=64, block_ms=100)) == 2  # delivery 1 of both; died
        for _ in range(2):  # two restarts, each re-reading the backlog and dying on the first entry
            (entry,) = await Inbox(redis, keys, instance_id).read(count=64, block_ms=100)
            assert entry[1].request_id == "poison"

        service = WorkerService(
            WorkerSettings(
                model_dir=tmp_path,
                role="mixed",
                redis_url=redis_url,
                cluster=cluster,
                ttl_s=3.0,
                engine_kind="echo",
                instance_id=instance_id,
                max_deliveries=3,
                engine=EngineConfig(num_blocks=64),
            )
        )
        task = asyncio.create_task(service.run())
        try:
            poison = [d async for d in outbox_deltas(redis, keys.outbox(ROUTER), "poison")]
            fine = [d async for d in outbox_deltas(redis, keys.outbox(ROUTER), "fine")]
            (failure,) = poison
            assert failure.finish_reason == "error" and failure.error is not None
            assert failure.error.kind == "internal_error" and not failure.error.retryable
            assert "crashed or was killed" in failure.error.message
            assert [t for d in fine for t in d.token_ids] == [7, 8, 7] and fine[-1].error is None
            (dead,) = await redis.xrange(keys.dead_letters(instance_id))
            assert b'"request_id":"poison"' in dead[1][b"m"]
            shown = await status_read.read(redis, cluster)
            (row,) = [i for i in shown["instances"] if i["id"] == instance_id]
            assert row["inbox_dead"] == 1 and row["inbox_pending"] == 0
            assert "0 (0 pending, 1 dead)" in status_table.render(shown)
            assert not task.done() and service.failed is None
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
            await redis.aclose()

    asyncio.run(main())
