"""Coalesced inbox sends against a real Redis: one round trip per loop iteration, per-message errors."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from router_support import KEYS, redis_conn, run

from pdserve.errors import ControlPlaneError, InvalidRequestError
from pdserve.router.routing.sender import InboxSender
from pdserve.scheduler import Abort, GenerateRequest, Inbox
from pdserve.scheduler.redis_client import ReplicaWait


def gen(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, router_id="r1", prompt="hi", deadline=time.time() + 60)


def test_sends_of_one_iteration_share_a_round_trip(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with redis_conn(redis_url) as r:
            sender = InboxSender(r, KEYS)
            await asyncio.gather(*(sender.send(f"w{i % 2}", gen(f"q{i}")) for i in range(10)))
            sender.send_nowait("w0", Abort(request_id="q0", reason="test"))
            await sender.drain()
            assert (sender.num_batches, sender.num_messages) == (2, 11)
            inbox = Inbox(r, KEYS, "w0")
            await inbox.ensure_group()
            got = [m for _, m in await inbox.read(count=20, block_ms=10)]
            assert [m.request_id for m in got] == ["q0", "q2", "q4", "q6", "q8", "q0"]
            assert isinstance(got[-1], Abort)

    run(main())


def test_a_failed_send_raises_only_for_its_message(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.set(KEYS.inbox("broken"), "not a stream")

    async def main() -> None:
        async with redis_conn(redis_url) as r:
            sender = InboxSender(r, KEYS)
            results = await asyncio.gather(
                sender.send("ok", gen("a")), sender.send("broken", gen("b")), return_exceptions=True
            )
            assert results[0] is None
            assert isinstance(results[1], ControlPlaneError) and "broken" in str(results[1])
            sender.send_nowait("broken", Abort(request_id="b", reason="test"))  # logged, never raised
            await sender.drain()

    run(main())


def test_an_unreachable_redis_fails_every_message(redis_url: str) -> None:
    from pdserve.scheduler import RedisSettings

    async def main() -> None:
        r = RedisSettings.from_url("redis://127.0.0.1:1/0", retries=0, connect_timeout_s=0.2).connect()
        try:
            with pytest.raises(ControlPlaneError, match="inbox of w0"):
                await InboxSender(r, KEYS).send("w0", gen("a"))
        finally:
            await r.aclose()

    run(main())


def test_round_trips_and_failures_reach_the_observer(redis_url: str, redis_client: redis.Redis) -> None:
    """The metrics hook: one timed round trip per batch, and the error of a failed one."""
    from pdserve.router.http.metrics import RouterMetrics

    redis_client.set(KEYS.inbox("broken2"), "not a stream")
    metrics = RouterMetrics()

    async def main() -> None:
        async with redis_conn(redis_url) as r:
            sender = InboxSender(r, KEYS, observe=metrics.on_redis)
            await asyncio.gather(*(sender.send("w0", gen(f"o{i}")) for i in range(3)))
            with pytest.raises(ControlPlaneError):
                await sender.send("broken2", gen("o9"))

    run(main())
    text = metrics.render().decode()
    assert 'pdserve_redis_round_trip_seconds_count{op="inbox_send"} 1.0' in text
    assert 'pdserve_redis_errors_total{error="ResponseError",op="inbox_send"} 1.0' in text


def test_a_message_that_cannot_be_encoded_fails_only_its_own_send(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Encoded before it joins the batch: its send raises InvalidRequestError (a 400), the other
    messages of the same iteration (an Abort too) are delivered, and no Redis error is counted."""
    from pdserve.router.http.metrics import RouterMetrics
    from pdserve.sampling_params import SamplingParams

    spec: dict = {}
    for _ in range(400):  # past pydantic's serialization depth
        spec = {"a": spec}
    deep = gen("deep")
    deep.sampling = SamplingParams(guided={"kind": "json", "spec": spec})
    metrics = RouterMetrics()

    async def main() -> None:
        async with redis_conn(redis_url) as r:
            sender = InboxSender(r, KEYS, observe=metrics.on_redis)
            sender.send_nowait("e0", Abort(request_id="z", reason="test"))
            results = await asyncio.gather(
                sender.send("e0", gen("a")),
                sender.send("e0", deep),
                sender.send("e0", gen("b")),
                return_exceptions=True,
            )
            assert results[0] is None and results[2] is None
            assert isinstance(results[1], InvalidRequestError) and "cannot be encoded" in str(results[1])
            inbox = Inbox(r, KEYS, "e0")
            await inbox.ensure_group()
            got = [m.request_id for _, m in await inbox.read(count=20, block_ms=10)]
            # one batch keeps its order; two batches in flight at once (z's, then a's and b's) may
            # reach Redis in either order (each takes a pooled connection of its own)
            assert sorted(got) == ["a", "b", "z"] and got.index("a") < got.index("b")

    run(main())
    assert "pdserve_redis_errors_total{" not in metrics.render().decode()


def test_a_batch_no_replica_acknowledged_fails_every_message(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """--redis-wait-replicas 1 on a Redis without replicas: the batch is written but not counted as
    sent (a failover could lose it), so each send raises and the dispatcher retries it."""

    async def main() -> None:
        async with redis_conn(redis_url) as r:
            sender = InboxSender(r, KEYS, wait=ReplicaWait(1, 50))
            results = await asyncio.gather(
                sender.send("w0", gen("a")), sender.send("w1", gen("b")), return_exceptions=True
            )
            assert all(isinstance(e, ControlPlaneError) and "0 of 1 replicas" in str(e) for e in results), (
                results
            )
            assert await InboxSender(r, KEYS, wait=ReplicaWait(0)).send("w0", gen("c")) is None

    run(main())
