"""A started BatchRunner and its Reaper on a real Redis, in-process (each test on a cluster of its
own), and batches in given states: what the batch tests build on."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
import redis
from rq.timeouts import TimerDeathPenalty

from pdserve.batch import jobs
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import BatchMetrics, BatchRunner
from pdserve.batch.settings import BatchWorkerSettings
from pdserve.batch.worker import PdserveBatchWorker
from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.batchstore.batches import BatchObject
from pdserve.cli import build_parser
from pdserve.scheduler.keys import Keys

T = TypeVar("T")
CHAT = "/v1/chat/completions"


def with_runner(
    redis_url: str,
    fn: Callable[[BatchRunner, Reaper], Awaitable[T]],
    *flags: str,
    timeout_s: float = 60,
    **knobs: Any,
) -> T:
    """Run ``fn`` with a started runner (and its reaper) on a cluster of its own; ``flags``: more
    ``pdserve batch-worker`` flags, ``knobs``: BatchWorkerSettings fields set after parsing."""
    argv = ["batch-worker", "--redis-url", redis_url, "--cluster", f"t{uuid.uuid4().hex[:8]}", *flags]
    settings = dataclasses.replace(BatchWorkerSettings.from_args(build_parser().parse_args(argv)), **knobs)
    connection = redis.Redis.from_url(redis_url)
    queue = BatchQueue(connection, Keys(settings.router.cluster))

    async def main() -> T:
        runner = BatchRunner(settings, queue, BatchMetrics())
        await runner.start()
        try:
            return await fn(runner, Reaper(runner))
        finally:
            await runner.stop()

    try:
        return asyncio.run(asyncio.wait_for(main(), timeout_s))
    finally:
        connection.close()


async def batch_with_lines(runner: BatchRunner, n: int, done: int, text: str = "ok") -> BatchObject:
    """A batch ``in_progress`` with ``n`` lines, the first ``done`` of them answered with ``text``."""
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": {"model": "m", "messages": []}}
        for i in range(n)
    ]
    file = await runner.files.create("in.jsonl", "batch", b"\n".join(map(orjson.dumps, lines)) + b"\n")
    store = runner.batches
    batch = await store.create(file.id, CHAT, "24h", None)
    moved = await store.update(batch.id, ("validating",), status="in_progress", total=n, chunks=0)
    assert moved is not None
    for i in range(done):
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
        record = {
            "id": f"batch_req_{i}",
            "custom_id": f"req-{i}",
            "response": {"status_code": 200, "request_id": f"r{i}", "body": body},
            "error": None,
        }
        assert await store.record(batch.id, i, record, False)
    return await store.get(batch.id)


class ThreadWorker(PdserveBatchWorker):
    """``pdserve batch-worker``'s rq worker, run in a thread of a test (signals stay the main thread's)."""

    death_penalty_class = TimerDeathPenalty  # no SIGALRM outside the main thread (jobs have no timeout)

    def _install_signal_handlers(self) -> None:
        pass


async def work_queue(runner: BatchRunner) -> None:
    """Run the jobs waiting in the runner's rq queue, as a batch worker's main thread does (their
    coroutines on this event loop), until the queue is empty."""
    jobs.install(runner, asyncio.get_running_loop())
    queue = runner.queue
    worker = ThreadWorker([queue.queue], connection=queue.connection, name=f"test-{uuid.uuid4().hex[:8]}")
    await asyncio.to_thread(worker.work, burst=True, with_scheduler=False)
