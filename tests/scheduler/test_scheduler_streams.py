"""Inbox and outbox streams against a real Redis: delivery, redelivery, trimming, outages."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis
from redis_support import run

from pdserve.errors import ControlPlaneError
from pdserve.localredis.embedded import EmbeddedRedis
from pdserve.scheduler import (
    ANY_ATTEMPT,
    GenerateRequest,
    Inbox,
    Keys,
    Outbox,
    OutboxReader,
    RedisSettings,
    RequestDelta,
    StepOutput,
    Usage,
    send_to_inbox,
)
from pdserve.scheduler.messages import encode
from pdserve.scheduler.outbox_reader import DeltaQueue

KEYS = Keys("streams-test")


def gen(request_id: str, router_id: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, router_id=router_id, prompt="hi", deadline=time.time() + 60)


def delta(request_id: str, *tokens: int, final: bool = False) -> RequestDelta:
    usage = Usage(prompt_tokens=1, completion_tokens=len(tokens)) if final else None
    return RequestDelta(
        request_id=request_id, token_ids=list(tokens), finish_reason="stop" if final else None, usage=usage
    )


async def drain(queue: DeltaQueue, n: int, timeout: float = 2.0) -> list[RequestDelta]:
    return [await asyncio.wait_for(queue.get(), timeout) for _ in range(n)]


# -- inbox ------------------------------------------------------------------------------------------


def test_send_read_ack_deletes(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        inbox = Inbox(r, KEYS, "p0")
        await inbox.ensure_group()
        for i in range(3):
            await send_to_inbox(r, KEYS, "p0", gen(f"q{i}"))
        got = await inbox.read(count=10, block_ms=100)
        assert [m.request_id for _, m in got] == ["q0", "q1", "q2"]
        assert await inbox.pending() == 3
        await inbox.ack([entry_id for entry_id, _ in got])
        assert await inbox.pending() == 0 and await r.xlen(KEYS.inbox("p0")) == 0
        assert await inbox.read(count=10, block_ms=50) == []

    run(redis_url, main)
    assert 590 <= redis_client.ttl("pdserve:streams-test:inbox:{p0}") <= 600


def test_pending_entries_are_re_read_after_restart_but_not_after_ack(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(r: aioredis.Redis) -> None:
        first = Inbox(r, KEYS, "p0", consumer="p0-w")
        await first.ensure_group()
        for i in range(3):
            await send_to_inbox(r, KEYS, "p0", gen(f"q{i}"))
        assert len(await first.read(count=10, block_ms=100)) == 3  # "crash" before acking
        await send_to_inbox(r, KEYS, "p0", gen("q3"))

        restarted = Inbox(r, KEYS, "p0", consumer="p0-w")
        pending = await restarted.read(count=2, block_ms=100)
        assert [m.request_id for _, m in pending] == ["q0"]  # the backlog one at a time
        pending += await restarted.read(count=2, block_ms=100)
        pending += await restarted.read(count=2, block_ms=100)
        assert [m.request_id for _, m in pending] == ["q0", "q1", "q2"]
        new = await restarted.read(count=10, block_ms=100)
        assert [m.request_id for _, m in new] == ["q3"]
        await restarted.ack([e for e, _ in pending + new])

        again = Inbox(r, KEYS, "p0", consumer="p0-w")
        assert await again.read(count=10, block_ms=50) == []

    run(redis_url, main)


def test_undecodable_entries_are_dead_lettered_and_reported(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(r: aioredis.Redis) -> None:
        inbox = Inbox(r, KEYS, "p0")
        await inbox.ensure_group()
        key = KEYS.inbox("p0")
        await r.xadd(
            key, {b"m": b'{"v":1,"type":"generate","request_id":"bad","router_id":"r9","deadline":"x"}'}
        )
        await r.xadd(key, {b"m": b"\x80garbage"})
        await r.xadd(key, {b"m": StepOutput(instance_id="x", items=[]).model_dump_json().encode()})
        await send_to_inbox(r, KEYS, "p0", gen("good"))
        got = await inbox.read(count=10, block_ms=100)
        assert [m.request_id for _, m in got] == ["good"]
        assert await r.xlen(KEYS.dead_letters("p0")) == 3
        assert await r.xlen(key) == 1 and await inbox.pending() == 1  # only the good one is left
        reader = OutboxReader(r, KEYS, "r9")
        queue = reader.subscribe("bad")
        async with reader:
            (event,) = await drain(queue, 1)
        assert event.error is not None and event.error.kind == "invalid_message"
        assert "deadline" in event.error.message and event.finish_reason == "error"

    run(redis_url, main)


def test_a_message_that_crashes_every_restart_is_dead_lettered_and_its_request_failed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A worker that dies while handling ``poison`` (before its ack) re-reads it at every restart
    under the same id: after ``max_deliveries`` deliveries it goes to the dead-letter stream with
    the reason, and its router gets a final error. The entries read in the same batch were
    re-read one at a time and acked, so they do not count up with it."""

    async def main(r: aioredis.Redis) -> None:
        inbox = Inbox(r, KEYS, "p1", consumer="p1", max_deliveries=3)
        await inbox.ensure_group()
        for request_id in ("before", "poison", "after"):
            await send_to_inbox(r, KEYS, "p1", gen(request_id, router_id="r7"))
        assert len(await inbox.read(count=10, block_ms=100)) == 3  # delivery 1, then the crash
        for _ in (2, 3):  # deliveries 2 and 3: each restart: what was handled is acked, the poison crashes it
            restarted = Inbox(r, KEYS, "p1", consumer="p1", max_deliveries=3)
            while True:
                got = await restarted.read(count=10, block_ms=50)
                assert len(got) == 1
                if got[0][1].request_id == "poison":
                    break  # crashed while handling it
                await restarted.ack([got[0][0]])
        final = Inbox(r, KEYS, "p1", consumer="p1", max_deliveries=3)
        got = await final.read(count=10, block_ms=50)
        got += await final.read(count=10, block_ms=50)
        assert [m.request_id for _, m in got] == ["after"]  # the poison is not handed over a 4th time
        await final.ack([e for e, _ in got])
        assert await final.pending() == 0 and await r.xlen(KEYS.inbox("p1")) == 0
        (dead,) = await r.xrange(KEYS.dead_letters("p1"))
        assert b'"request_id":"poison"' in dead[1][b"m"] and b"delivered 3 times" in dead[1][b"error"]
        reader = OutboxReader(r, KEYS, "r7")
        queue = reader.subscribe("poison")
        async with reader:
            (event,) = await drain(queue, 1)
        assert event.finish_reason == "error" and event.error is not None
        assert event.error.kind == "internal_error" and not event.error.retryable
        assert "crashed or was killed" in event.error.message

    run(redis_url, main)


def test_read_recreates_an_expired_inbox_and_group(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        inbox = Inbox(r, KEYS, "p0")
        await inbox.ensure_group()
        assert await inbox.read(block_ms=10) == []
        await r.delete(KEYS.inbox("p0"))  # expired, or Redis restarted without persistence
        await send_to_inbox(r, KEYS, "p0", gen("q0"))
        assert [m.request_id for _, m in await inbox.read(block_ms=100)] == ["q0"]

    run(redis_url, main)


def test_inbox_length_is_bounded(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        async with r.pipeline(transaction=False) as pipe:
            for i in range(3000):
                await send_to_inbox(r, KEYS, "p0", gen(f"q{i}"), pipeline=pipe, maxlen=500)
            await pipe.execute()
        assert 500 <= await r.xlen(KEYS.inbox("p0")) <= 600  # ~ trimming: one node (100) of slack

    run(redis_url, main)


# -- outbox -----------------------------------------------------------------------------------------


def test_one_step_is_demultiplexed_in_order(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        reader = OutboxReader(r, KEYS, "r1")
        qa, qb, qc = reader.subscribe("a"), reader.subscribe("b"), reader.subscribe("c")
        outbox = Outbox(r, KEYS)
        async with reader:
            items = [delta("a", 1), delta("b", 10), delta("a", 2), delta("c", 100), delta("zombie", 9)]
            await outbox.publish("r1", StepOutput(instance_id="d0", items=items))
            await outbox.publish_many("d0", {"r1": [delta("a", 3, final=True), delta("b", 11, final=True)]})
            a, b, c = await drain(qa, 3), await drain(qb, 2), await drain(qc, 1)
        assert [d.token_ids for d in a] == [[1], [2], [3]] and a[-1].is_final
        assert [d.token_ids for d in b] == [[10], [11]] and b[-1].usage is not None
        assert [d.token_ids for d in c] == [[100]]
        assert reader.num_dropped == 1 and reader.num_dispatched == 6

    run(redis_url, main)


def test_lean_publish_writes_what_a_pipeline_writes(redis_url: str, redis_client: redis.Redis) -> None:
    """A single server's outbox publishes go out pre-packed on a lean connection: the same entry,
    bound and expiry as redis-py's pipeline (still used with a caller's pipeline); an error reply
    (here a key of another type) is a ControlPlaneError, and the connection serves on."""

    async def main(r: aioredis.Redis) -> None:
        outbox = Outbox(r, KEYS, ttl_s=123)
        assert outbox._lean is not None
        items = [delta("a", 1, 2), delta("b", 3, final=True)]
        await outbox.publish_many("d0", {"r1": items, "r2": [], "r3": [delta("c", 4)]})
        pipe = r.pipeline(transaction=False)
        await outbox.publish_many("d0", {"r1": items}, pipeline=pipe)
        await pipe.execute()
        lean, piped = [e[1][b"m"] for e in await r.xrange(KEYS.outbox("r1"))]
        assert lean == piped == encode(StepOutput(instance_id="d0", items=items))
        assert 0 < await r.ttl(KEYS.outbox("r1")) <= 123 and 0 < await r.ttl(KEYS.outbox("r3")) <= 123
        assert not await r.exists(KEYS.outbox("r2"))
        await r.set(KEYS.outbox("r4"), "not a stream")
        with pytest.raises(ControlPlaneError, match="WRONGTYPE"):
            await outbox.publish("r4", StepOutput(instance_id="d0", items=items))
        await outbox.publish("r3", StepOutput(instance_id="d0", items=items))
        assert await r.xlen(KEYS.outbox("r3")) == 2
        outbox.close()

    run(redis_url, main)


def test_subscribe_twice_is_refused_and_unsubscribe_drops(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        reader = OutboxReader(r, KEYS, "r1")
        reader.subscribe("a")
        with pytest.raises(ValueError, match="already in flight"):
            reader.subscribe("a")
        reader.unsubscribe("a")
        reader.unsubscribe("a")
        queue = reader.subscribe("a")
        await reader.stop()
        (event,) = await drain(queue, 1)  # stop() ends whoever is still waiting
        assert event.error is not None and event.error.retryable and event.attempt == ANY_ATTEMPT

    run(redis_url, main)


def test_outbox_is_trimmed_by_its_reader_and_capped_without_one(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(r: aioredis.Redis) -> None:
        outbox = Outbox(r, KEYS, maxlen=200)
        key = KEYS.outbox("r1")
        reader = OutboxReader(r, KEYS, "r1", count=64)
        queue = reader.subscribe("a")
        async with reader:
            for i in range(1000):
                await outbox.publish("r1", StepOutput(instance_id="d0", items=[delta("a", i)]))
            got = await drain(queue, 1000)
            await asyncio.sleep(0.05)
            await outbox.publish("r1", StepOutput(instance_id="d0", items=[delta("a", 1000)]))  # wakes a trim
            await drain(queue, 1)
            await asyncio.sleep(0.05)
            assert await r.xlen(key) <= 1
        assert [d.token_ids[0] for d in got] == list(range(1000))
        assert 590 <= await r.ttl(key) <= 600
        for i in range(2000):  # nobody reads: the cap holds
            await outbox.publish("r2", StepOutput(instance_id="d0", items=[delta("b", i)]))
        assert 200 <= await r.xlen(KEYS.outbox("r2")) <= 300

    run(redis_url, main)


# -- outages: a private redis-server that the tests stop and restart ----------------------------------


def test_reader_fails_waiting_requests_when_redis_stays_unreachable(private_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        r = RedisSettings.from_url(private_redis.url, retries=0, connect_timeout_s=0.2).connect()
        reader = OutboxReader(r, KEYS, "r1", block_ms=100, fail_after_s=0.3, max_backoff_s=0.1)
        queue = reader.subscribe("a")
        async with reader:
            await asyncio.sleep(0.2)
            private_redis.stop(kill=True)
            t0 = time.monotonic()
            (event,) = await drain(queue, 1, timeout=3)
            assert time.monotonic() - t0 < 1.5
            assert event.error is not None and event.error.retryable
            assert event.error.kind == "control_plane_unavailable" and not reader.healthy
            (refused,) = await drain(reader.subscribe("b"), 1, timeout=0.1)  # new requests fail at once
            assert refused.error is not None
            private_redis.start()
            for _ in range(60):
                if reader.healthy:
                    break
                await asyncio.sleep(0.05)
            assert reader.healthy
            queue = reader.subscribe("c")
            await Outbox(r, KEYS).publish("r1", StepOutput(instance_id="d0", items=[delta("c", 5)]))
            (event,) = await drain(queue, 1)
            assert event.token_ids == [5]
        await r.aclose()

    asyncio.run(main())


def test_reader_fails_requests_in_flight_when_redis_restarted(private_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        r = RedisSettings.from_url(private_redis.url, retries=0, connect_timeout_s=0.2).connect()
        reader = OutboxReader(r, KEYS, "r1", block_ms=100, fail_after_s=30, max_backoff_s=0.05)
        queue = reader.subscribe("a")
        async with reader:
            await asyncio.sleep(0.2)
            private_redis.stop(kill=True)
            private_redis.start()  # back fast, but empty: events in flight are gone
            (event,) = await drain(queue, 1, timeout=3)
            assert event.error is not None and event.error.kind == "control_plane_restarted"
        await r.aclose()

    asyncio.run(main())


def test_the_primary_is_confirmed_by_role_and_run_id(private_redis: EmbeddedRedis, tmp_path) -> None:
    """What the watcher asks before blaming instances missing from the live set: a server demoted to
    a replica (it serves its new primary's older data) is not confirmed and fails nothing; a
    restarted one is not confirmed and fails every request in flight."""
    other = EmbeddedRedis(workdir=tmp_path / "other")
    (tmp_path / "other").mkdir()
    other.start()

    async def main() -> None:
        r = RedisSettings.from_url(private_redis.url, retries=0, connect_timeout_s=0.2).connect()
        reader = OutboxReader(r, KEYS, "r1", block_ms=100, fail_after_s=30, max_backoff_s=0.05)
        queue = reader.subscribe("a")  # (not started: its own reconnect would see the restart first)
        assert await reader.confirm_primary()
        await r.execute_command("REPLICAOF", "127.0.0.1", other.port)
        assert not await reader.confirm_primary()
        await r.execute_command("REPLICAOF", "NO", "ONE")
        assert await reader.confirm_primary()
        assert queue.empty()
        private_redis.stop(kill=True)
        private_redis.start()
        assert not await reader.confirm_primary()  # the pooled connection died with it
        assert not await reader.confirm_primary()  # a new one: another run_id
        (event,) = await drain(queue, 1)
        assert event.error is not None and event.error.kind == "control_plane_restarted"
        await r.aclose()

    try:
        asyncio.run(main())
    finally:
        other.stop(kill=True)


def test_a_delta_queue_keeps_order_and_survives_a_getter_that_timed_out() -> None:
    """One request's deltas come out in the order they went in, get() waits for the next one, and a
    get() cancelled by a timeout (a tokenize request's wait) leaves the queue usable."""

    async def main() -> None:
        queue = DeltaQueue()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.get(), 0.01)
        assert queue.empty()
        waiting = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.put_nowait(RequestDelta(request_id="a", text="1"))
        queue.put_nowait(RequestDelta(request_id="a", text="2"))
        assert (await waiting).text == "1"
        assert queue.get_nowait().text == "2"
        assert queue.empty()
        with pytest.raises(IndexError):
            queue.get_nowait()

    asyncio.run(main())
