"""The stream interval (``RequestHandler.stream_interval_s``): a request's tokens that come sooner than
the interval after its previous delta wait and go with the next one; its first token and its end
never wait. A mixed instance in this process (the stub engine), a real Redis outbox, a manual clock."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from router_support import run
from splitwise_support import ROUTER, Instance, ManualClock, Pair, StubEngine, token_for

from pdserve.scheduler import (
    Abort,
    GenerateRequest,
    Keys,
    RedisSettings,
    RequestDelta,
    RouterInfo,
    RouterRegistry,
)
from pdserve.worker.handler import RequestHandler

PROMPT = [3, 1, 4, 1, 5]


@contextlib.asynccontextmanager
async def mixed(redis_url: str, stream_interval_s: float) -> AsyncIterator[tuple[Pair, Instance]]:
    """A live router and a mixed instance whose handler has the given stream interval."""
    redis = RedisSettings.from_url(redis_url).connect()
    keys = Keys(f"interval-{uuid.uuid4().hex[:8]}")
    p = Pair(redis, keys, ManualClock())
    await RouterRegistry(redis, keys).register(RouterInfo(id=ROUTER, host="h", pid=1, port=1, started_at=0.0))
    inst = await p.instance("mixed", "mixed", StubEngine())
    inst.handler = RequestHandler(
        inst.handler.ctx, "mixed", RouterRegistry(redis, keys), stream_interval_s=stream_interval_s
    )
    try:
        yield p, inst
    finally:
        await inst.engine.close()
        await redis.aclose()


def generate(p: Pair, max_tokens: int) -> GenerateRequest:
    return p.request(PROMPT, max_tokens=max_tokens).model_copy(update={"disaggregate_info": None})


async def produce(
    redis_url: str, stream_interval_s: float, max_tokens: int, advance_before: set[int]
) -> list[RequestDelta]:
    """Run one request to its end, one step at a time, the clock moved 1.5 s before each step whose
    number (from 1) is in ``advance_before``; its deltas in the outbox, and the instance."""
    async with mixed(redis_url, stream_interval_s) as (p, inst):
        await p.send(inst, generate(p, max_tokens))
        assert await inst.receive() == 1
        step = 0
        while inst.engine.unfinished:
            step += 1
            if step in advance_before:
                p.clock.advance(1.5)
            assert await inst.step() == 1
        assert step == max_tokens
        assert not inst.handler.owners and not inst.handler._held and not inst.handler._sent_at
        assert not inst.handler._seqs
        return await p.events()


def test_without_clock_moving_only_the_first_token_and_the_end_are_published(redis_url: str) -> None:
    async def main() -> None:
        held = await produce(redis_url, 1.0, 6, set())
        plain = await produce(redis_url, 0.0, 6, set())
        expected = [token_for(PROMPT, i) for i in range(6)]

        assert len(plain) == 6  # interval 0: every step its own delta
        assert [d.seq for d in plain] == list(range(6))

        first, end = held
        assert (first.seq, first.token_ids, first.finish_reason) == (0, expected[:1], None)
        assert first.timing is not None and first.usage is None
        assert (end.seq, end.token_ids, end.finish_reason) == (1, expected[1:], "length")
        assert end.usage is not None and end.usage.completion_tokens == 6 and end.error is None
        assert end.timing is None  # the first token's timing stays on the first delta

        assert [t for d in held for t in d.token_ids] == [t for d in plain for t in d.token_ids] == expected
        assert "".join(d.text for d in held) == "".join(d.text for d in plain) != ""
        assert end.usage == plain[-1].usage and end.finish_reason == plain[-1].finish_reason

    run(main())


def test_tokens_are_published_when_the_interval_has_passed(redis_url: str) -> None:
    async def main() -> None:
        # steps 1..9 make tokens 0..8; the clock moves 1.5 s (past the 1 s interval) before steps 3 and 7
        events = await produce(redis_url, 1.0, 9, {3, 7})
        expected = [token_for(PROMPT, i) for i in range(9)]
        assert [d.token_ids for d in events] == [expected[:1], expected[1:3], expected[3:7], expected[7:]]
        assert [d.seq for d in events] == [0, 1, 2, 3]
        assert [d.finish_reason for d in events] == [None, None, None, "length"]
        # the clock moving before step 2 already lets that step out: it is past the interval after token 0
        events = await produce(redis_url, 1.0, 5, {2, 3})
        expected = [token_for(PROMPT, i) for i in range(5)]
        assert [d.token_ids for d in events] == [expected[:1], expected[1:2], expected[2:3], expected[3:]]
        assert [d.seq for d in events] == [0, 1, 2, 3]

    run(main())


def test_an_abort_drops_the_held_tokens_and_the_state(redis_url: str) -> None:
    async def main() -> None:
        async with mixed(redis_url, 1.0) as (p, inst):
            msg = generate(p, 8)
            await p.send(inst, msg)
            await inst.receive()
            for _ in range(3):  # token 0 goes out, tokens 1 and 2 are held
                assert await inst.step() == 1
            handler = inst.handler
            (key,) = handler.owners
            assert handler._held[key].token_ids == [token_for(PROMPT, 1), token_for(PROMPT, 2)]
            assert key in handler._sent_at
            assert [(d.seq, d.token_ids) for d in await p.events()] == [(0, [token_for(PROMPT, 0)])]

            await p.send(inst, Abort(request_id=msg.request_id, reason="client gone"))
            await inst.receive()
            assert key not in handler._held and key not in handler._sent_at
            assert key not in handler.owners and key not in handler._seqs
            p.clock.advance(5)  # even past the interval, nothing of it goes out
            while inst.engine.unfinished:
                await inst.step()  # the engine's abort output: dropped
            assert [(d.seq, d.token_ids) for d in await p.events()] == [(0, [token_for(PROMPT, 0)])]
            assert not handler._held and not handler._sent_at and not handler.owners and not handler._seqs
            assert not inst.stub.requests and sorted(inst.stub.free) == list(range(inst.stub.num_blocks))

    run(main())


def test_held_tokens_go_out_on_the_timer_when_the_request_stops_stepping(redis_url: str) -> None:
    """Tokens held for a request the engine does not step for a while (preempted, waiting) go out
    from the handler's timer once the interval passed, not only with its next step."""

    async def main() -> None:
        async with mixed(redis_url, 1.0) as (p, inst):
            await p.send(inst, generate(p, 8))
            await inst.receive()
            for _ in range(3):  # token 0 goes out, tokens 1 and 2 are held
                assert await inst.step() == 1
            await inst.handler.tick()  # within the interval: still held
            await inst.handler.ctx.messenger.flush()
            assert [d.seq for d in await p.events()] == [0]
            p.clock.advance(1.5)
            await inst.handler.tick()
            await inst.handler.ctx.messenger.flush()
            events = await p.events()
            assert [(d.seq, d.token_ids) for d in events] == [
                (0, [token_for(PROMPT, 0)]),
                (1, [token_for(PROMPT, 1), token_for(PROMPT, 2)]),
            ]
            while inst.engine.unfinished:  # the rest follows, numbered on
                p.clock.advance(1.5)
                await inst.step()
            events = await p.events()
            assert [d.seq for d in events] == list(range(len(events)))
            assert [t for d in events for t in d.token_ids] == [token_for(PROMPT, i) for i in range(8)]

    run(main())
