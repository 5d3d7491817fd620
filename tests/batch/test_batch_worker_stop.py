"""A batch worker stops at once: rq's teardown must not wait out its pubsub thread's read (a real
rq worker on a real Redis)."""

from __future__ import annotations

import threading
import time
import uuid

import redis
from rq import Queue

from pdserve.batch.worker import PdserveBatchWorker


def test_the_pubsub_thread_that_read_the_unsubscribe_first_does_not_hold_up_the_stop(redis_url: str) -> None:
    """rq's teardown unsubscribes from the worker's channel, then stops (and joins) the thread that
    reads it. When that thread reads the unsubscribe reply before it is told to stop, redis-py has it
    wait for a new subscription for as long as its poll (rq's: 60 s), and the join waits with it:
    `pdserve up` then took 35 s (its grace, then SIGKILL) to stop in 2 of 13 tries with a batch
    running. Here the thread is made to lose that race every time."""
    connection = redis.Redis.from_url(redis_url)
    queue = Queue(f"stop-{uuid.uuid4().hex[:8]}", connection=connection)
    worker = PdserveBatchWorker([queue], connection=connection, name=f"stop-{uuid.uuid4().hex[:8]}")
    worker.subscribe()
    pubsub = worker.pubsub
    assert pubsub is not None
    deadline = time.monotonic() + 5
    while not pubsub.subscribed:
        assert time.monotonic() < deadline, "the pubsub thread never subscribed"
        time.sleep(0.01)
    pubsub.unsubscribe()  # what teardown does first; the thread reads the reply ...
    while pubsub.subscribed:
        assert time.monotonic() < deadline, "the pubsub thread never read the unsubscribe reply"
        time.sleep(0.01)
    time.sleep(0.2)  # ... and goes back to waiting before it is told to stop
    t0 = time.monotonic()
    stop = threading.Thread(target=worker.unsubscribe, daemon=True)
    stop.start()
    stop.join(10)
    took = time.monotonic() - t0
    connection.close()
    assert not stop.is_alive() and took < 2.5, f"the worker's unsubscribe took {took:.1f} s"
