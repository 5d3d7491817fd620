"""The messenger's ordered publish buffer against a real Redis: steps posted while a publish is on the
wire go out merged (one entry per router), ``publish``/``flush`` wait for everything before them, and
a Redis outage holds the buffer (nothing lost, nothing raised) until Redis answers or the TTL passes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis
from redis_support import run

from pdserve.localredis.embedded import EmbeddedRedis
from pdserve.scheduler import Keys, LogprobInfo, RedisSettings, RequestDelta, StepOutput, Usage
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.streams import FIELD
from pdserve.worker.messenger import Messenger, merge_deltas

R1, R2 = "router-a", "router-b"


def keys() -> Keys:
    return Keys(f"publish-{uuid.uuid4().hex[:8]}")


def delta(request_id: str, seq: int, *tokens: int, final: bool = False) -> RequestDelta:
    usage = Usage(prompt_tokens=1, completion_tokens=seq + 1) if final else None
    return RequestDelta(
        request_id=request_id,
        token_ids=list(tokens),
        text="".join(f"<{t}>" for t in tokens),
        seq=seq,
        finish_reason="stop" if final else None,
        usage=usage,
    )


async def entries(r: aioredis.Redis, k: Keys, router_id: str) -> list[list[RequestDelta]]:
    """The outbox of ``router_id``: each entry's deltas, entry by entry."""
    stream: Any = await r.xrange(k.outbox(router_id))
    return [decode_as(StepOutput, fields[FIELD]).items for _id, fields in stream]


def bounded(redis_url: str, fn: Callable[[aioredis.Redis], Awaitable[None]], timeout_s: float = 20) -> None:
    """``run`` on a fresh client; a hang (a publish never resolved) fails within ``timeout_s``."""
    run(redis_url, lambda r: asyncio.wait_for(fn(r), timeout_s))


def flat(batches: list[list[RequestDelta]]) -> list[tuple[str, int | None, list[int]]]:
    return [(d.request_id, d.seq, d.token_ids) for batch in batches for d in batch]


def test_steps_posted_during_a_publish_go_out_merged_in_order(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(r: aioredis.Redis) -> None:
        k = keys()
        messenger = Messenger(r, k, "inst-1")
        posted: dict[str, list[RequestDelta]] = {R1: [], R2: []}
        futures = []
        for step in range(5):
            by_router = {
                R1: [delta("a", step, 10 + step), delta("b", step, 20 + step)],
                R2: [delta("c", step, 30 + step)],
            }
            for router_id, deltas in by_router.items():
                posted[router_id] += [d.model_copy(deep=True) for d in deltas]
            futures.append(messenger.post(by_router))
            if step == 0:
                await asyncio.sleep(0)  # the flusher takes step 0 and puts it on the wire
                assert not futures[0].done()
        assert not any(f.done() for f in futures)  # post never waits
        assert await messenger.flush() is True
        assert all(f.done() and f.result() is True for f in futures)

        got = {router_id: await entries(r, k, router_id) for router_id in (R1, R2)}
        for router_id in (R1, R2):
            batches = got[router_id]
            assert 1 < len(batches) < 5  # fewer entries than posted steps
            assert [len(b) for b in batches] == [len(posted[router_id]) // 5, 4 * len(posted[router_id]) // 5]
            assert flat(batches) == flat([posted[router_id]])  # every delta once, in posting order
            assert len(batches) == messenger.num_publishes
        for request_id, base in (("a", 10), ("b", 20), ("c", 30)):
            mine = [
                d for router_id in (R1, R2) for b in got[router_id] for d in b if d.request_id == request_id
            ]
            assert [d.seq for d in mine] == list(range(5))
            assert [t for d in mine for t in d.token_ids] == [base + i for i in range(5)]
        assert messenger.num_publishes == 2 and not messenger.backlogged

    bounded(redis_url, main)


def test_publish_returns_once_it_and_everything_posted_before_are_in_redis(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main(r: aioredis.Redis) -> None:
        k = keys()
        messenger = Messenger(r, k, "inst-1")
        on_wire = messenger.post({R1: [delta("a", 0, 1)]})
        await asyncio.sleep(0)  # on the wire now
        queued = messenger.post({R1: [delta("a", 1, 2)], R2: [delta("x", 0, 7)]})
        assert not on_wire.done() and not queued.done()
        assert await messenger.publish({R1: [delta("b", 0, 3, final=True)]}) is True
        # right after: the publish's own delta and both earlier posts are in the outboxes
        assert on_wire.done() and queued.done()
        assert flat(await entries(r, k, R1)) == [("a", 0, [1]), ("a", 1, [2]), ("b", 0, [3])]
        assert flat(await entries(r, k, R2)) == [("x", 0, [7])]
        assert on_wire.result() is True and queued.result() is True

    bounded(redis_url, main)


def test_flush_waits_for_the_batch_on_the_wire(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        k = keys()
        messenger = Messenger(r, k, "inst-1")
        sent = messenger.post({R1: [delta("a", 0, 1), delta("a", 1, 2)]})
        await asyncio.sleep(0)  # the flusher took the batch: nothing is pending, one batch is in flight
        assert not sent.done() and messenger.num_publishes == 0
        assert await messenger.flush() is True
        assert sent.done() and sent.result() is True and messenger.num_publishes == 1
        assert flat(await entries(r, k, R1)) == [("a", 0, [1]), ("a", 1, [2])]
        # nothing posted and nothing in flight: flush returns at once, nothing is written
        assert await messenger.flush() is True
        assert messenger.num_publishes == 1 and len(await entries(r, k, R1)) == 1

    bounded(redis_url, main)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_posts_wait_out_a_redis_restart_in_order(private_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        r = RedisSettings.from_url(private_redis.url, retries=0, connect_timeout_s=0.2).connect()
        k = keys()
        messenger = Messenger(r, k, "inst-1", give_up_after_s=30)
        try:
            assert await messenger.publish({R1: [delta("a", 0, 1)]}) is True  # connected, then Redis goes
            private_redis.stop(kill=True)
            first = messenger.post({R1: [delta("a", 1, 2)]})
            await until(lambda: messenger.backlogged)
            second = messenger.post({R1: [delta("a", 2, 3)], R2: [delta("b", 0, 4)]})
            third = messenger.post({R1: [delta("a", 3, 5, final=True)]})
            await asyncio.sleep(0.3)
            assert not first.done() and not second.done() and not third.done()
            assert messenger.backlogged and messenger.num_send_retries > 0

            private_redis.start()  # back, empty: what was sent before is gone, the buffer is not
            assert await asyncio.wait_for(asyncio.shield(first), 10) is True
            assert await asyncio.wait_for(messenger.flush(), 10) is True
            assert second.result() is True and third.result() is True
            assert not messenger.backlogged
            assert flat(await entries(r, k, R1)) == [("a", 1, [2]), ("a", 2, [3]), ("a", 3, [5])]
            assert flat(await entries(r, k, R2)) == [("b", 0, [4])]
        finally:
            await r.aclose()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_send_is_given_up_after_give_up_after_s(private_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        r = RedisSettings.from_url(private_redis.url, retries=0, connect_timeout_s=0.2).connect()
        messenger = Messenger(r, keys(), "inst-1", give_up_after_s=0.4)
        try:
            private_redis.stop(kill=True)
            sent = messenger.post({R1: [delta("a", 0, 1)]})
            await until(lambda: messenger.backlogged)
            assert await asyncio.wait_for(asyncio.shield(sent), 10) is False  # reported, not raised
            assert not messenger.backlogged
            assert await messenger.flush() is False  # the flush after it reports the give-up...
            assert await messenger.flush() is True  # ... once: nothing was given up since
        finally:
            await r.aclose()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_merge_deltas_joins_tokens_text_and_logprobs_and_takes_the_second_end() -> None:
    first = delta("a", 3, 1, 2)
    first.prompt_text = "echo"
    end = delta("a", 4, 3, final=True)
    end.logprobs = [LogprobInfo(token_id=3, token="<3>", logprob=-0.5)]
    merged = merge_deltas(first, end)
    assert merged.token_ids == [1, 2, 3] and merged.text == "<1><2><3>"
    assert merged.logprobs is not None and [lp.token_id for lp in merged.logprobs] == [3]
    assert merged.seq == 3 and merged.prompt_text == "echo"
    assert merged.finish_reason == "stop" and merged.usage == end.usage and merged.is_final


def test_an_event_that_cannot_be_encoded_fails_its_batch_and_the_buffer_goes_on(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A bug (a delta pydantic cannot serialize: a lone surrogate) loses its own batch, reported as
    False, and the publisher keeps sending what is posted after it."""

    async def main(r: aioredis.Redis) -> None:
        k = keys()
        messenger = Messenger(r, k, "inst-1")
        bad = delta("a", 0, 1)
        bad.text = "\ud800"
        assert await messenger.post({R1: [bad]}) is False
        assert await messenger.publish({R1: [delta("b", 0, 2)]}) is True
        assert flat(await entries(r, k, R1)) == [("b", 0, [2])]

    bounded(redis_url, main)
