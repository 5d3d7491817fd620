"""``pdserve batch-worker``: an rq worker whose jobs run batch lines through an in-process router.

The main thread runs rq's :class:`~rq.SimpleWorker` (jobs in this process, no fork: the router,
its Redis connections and its outbox reader are made once); a second thread runs the event loop
with the router, the reaper and the jobs' coroutines. SIGTERM or Ctrl-C: running chunks stop
taking lines, finish those in flight, and the worker exits (the reaper re-enqueues what is left).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from prometheus_client import start_http_server
from rq import SimpleWorker

from pdserve.batch import jobs
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import BatchMetrics, BatchRunner
from pdserve.batch.settings import BatchWorkerSettings
from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_client import RedisSettings

logger = logging.getLogger(__name__)

PUBSUB_POLL_S = 1.0
"""How long rq's pubsub thread (its worker's channel: suspend, kill-horse commands) waits per read.
rq's own 60 s is also how long a stop may wait for it (``PdserveBatchWorker.subscribe``)."""


class PdserveBatchWorker(SimpleWorker):
    """rq's in-process worker, telling the runner to wind down when rq is asked to stop."""

    runner: BatchRunner | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def request_stop(self, signum: Any, frame: Any) -> None:
        if self.runner is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(setattr, self.runner, "stopping", True)
        super().request_stop(signum, frame)

    def subscribe(self) -> None:
        """rq's, with a pubsub thread that reads for ``PUBSUB_POLL_S`` at a time rather than 60 s.

        rq's teardown unsubscribes, then stops the thread and waits for it (redis-py 8.2's ``stop()``
        joins it without a timeout). When the thread reads the unsubscribe reply before it is told
        to stop, it goes back to waiting for a subscription for one whole read: with rq's 60 s, a
        SIGTERM mid-batch kept the worker up to a minute (3 stops in 12 here; ``pdserve up`` killed
        it after its 35 s grace); with 1 s, at most a second.
        """
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]  # rq: "= None"
            sleep_time=PUBSUB_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler
        )


def run_batch_worker(settings: BatchWorkerSettings) -> int:
    redis_settings = RedisSettings.from_url(settings.router.redis_url, client_name=settings.name)
    connection = redis_settings.connect_sync()
    keys = Keys(settings.router.cluster)
    queue = BatchQueue(connection, keys)
    metrics = BatchMetrics()
    runner = BatchRunner(settings, queue, metrics)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            await runner.start()
        except BaseException as e:
            failure.append(e)
            ready.set()
            return
        reaper = asyncio.create_task(Reaper(runner).run())
        ready.set()
        try:
            await asyncio.Event().wait()  # until the loop is stopped
        finally:
            reaper.cancel()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), name="batch-loop", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        raise failure[0]
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=metrics.registry)
    jobs.install(runner, loop)
    worker = PdserveBatchWorker([queue.queue], connection=connection, name=settings.name)
    worker.runner, worker.loop = runner, loop
    logger.info(
        "batch worker %s on queue %s (%d lines at once, spare capacity below %.0f %% of max_num_seqs)",
        settings.name,
        queue.queue.name,
        settings.concurrency,
        settings.max_load * 100,
    )
    try:
        worker.work(with_scheduler=False, logging_level=logging.getLevelName(logging.getLogger().level))
    finally:
        asyncio.run_coroutine_threadsafe(runner.stop(), loop).result(timeout=30)
        connection.close()
    logger.info("batch worker %s stopped", settings.name)
    return 0
