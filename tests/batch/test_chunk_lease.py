"""A chunk's lease: held while the chunk runs and released when it ends, even when the task that
renews it swallows its cancellation (a real BatchRunner on a real Redis)."""

from __future__ import annotations

import asyncio
import uuid

from pdserve.batch.runner import BatchMetrics, BatchRunner
from pdserve.batch.settings import BatchWorkerSettings
from pdserve.cli import build_parser


def test_a_chunk_ends_and_frees_its_lease_when_the_renewal_swallows_a_cancel(redis_url: str) -> None:
    argv = ["batch-worker", "--redis-url", redis_url, "--cluster", f"t{uuid.uuid4().hex[:8]}"]
    settings = BatchWorkerSettings.from_args(build_parser().parse_args(argv))

    async def main() -> tuple[bool, bool, float, int]:
        runner = BatchRunner(settings, queue=None, metrics=BatchMetrics())  # type: ignore[arg-type]
        await runner.start()
        try:
            store = runner.batches
            batch = await store.create("file-x", "/v1/chat/completions", "24h", None)
            batch = await store.update(batch.id, ("validating",), status="in_progress", total=1, chunks=1)
            assert batch is not None
            renew = runner._hold_lease
            swallowed = asyncio.Event()

            async def renews_through_one_cancel(batch_id: str, chunk: int, job_id: str) -> None:
                # as a Redis call on CPython < 3.12 may (wait_for, gh-86296): the first cancel is lost
                try:
                    await renew(batch_id, chunk, job_id)
                except asyncio.CancelledError:
                    swallowed.set()
                    await renew(batch_id, chunk, job_id)

            runner._hold_lease = renews_through_one_cancel  # type: ignore[method-assign]
            lease = store.keys.batch_lease(batch.id, 0)
            loop = asyncio.get_running_loop()
            async with runner._owned(batch, "in_progress", 0, "job-0") as holder:
                assert holder is not None
                await asyncio.sleep(0.2)
                held = bool(await store.redis.exists(lease))
                ending = loop.time()
            ended_in = loop.time() - ending
            return held and holder.done(), swallowed.is_set(), ended_in, await store.redis.exists(lease)
        finally:
            await runner.stop()

    held, swallowed, ended_in, left = asyncio.run(asyncio.wait_for(main(), 20))
    assert held and swallowed
    assert ended_in < 2.0  # a lease holder that ran on would have kept the chunk (and its job) forever
    assert left == 0
