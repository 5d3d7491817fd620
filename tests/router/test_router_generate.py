"""The generation path against scripted workers: what the router sends, what the client gets."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import redis
from router_support import (
    ROUTER_ID,
    FakeWorker,
    answer,
    decode_rest,
    deltas_for,
    instance,
    prefill_then_forward,
    redis_conn,
    router,
    run,
    served_router,
    silent,
    sse_events,
)

from pdserve.errors import MessageError, RequestTooLongError, UnavailableError
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import (
    ANY_ATTEMPT,
    GenerateRequest,
    InboxMessage,
    Prefilled,
    RequestDelta,
    ReserveBlocks,
    StepOutput,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
CACHED = {"prompt_tokens_details": {"cached_tokens": 0}}  # no prefix cache: always 0


def dispatcher(client: httpx.AsyncClient):
    return client.app.state.router.dispatcher  # type: ignore[attr-defined]


def test_completion_non_stream(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            before = time.time()
            resp = await client.post(
                "/v1/completions",
                headers={"x-request-id": "abc"},
                json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0},
            )
            assert resp.status_code == 200 and resp.headers["x-request-id"] == "abc"
            body = resp.json()
            [msg] = worker.received
            assert body == {
                "id": f"cmpl-{msg.request_id}",
                "object": "text_completion",
                "created": body["created"],
                "model": "tiny",
                "choices": [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": 3,
                    "completion_tokens": 2,
                    "total_tokens": 5,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
            assert abs(body["created"] - time.time()) < 5
            assert isinstance(msg, GenerateRequest)
            assert re.fullmatch("[0-9a-f]{32}", msg.request_id)  # the router's id, not x-request-id
            assert (msg.router_id, msg.attempt) == (ROUTER_ID, 0)
            assert (msg.prompt, msg.prompt_token_ids, msg.messages) == ("hi", None, None)
            assert msg.sampling == SamplingParams(max_tokens=5, temperature=0.0)
            assert msg.disaggregate_info is None
            assert before + 599 < msg.deadline < time.time() + 601
            assert dispatcher(client).in_flight == {} and dispatcher(client).generations == {}
            await worker.stop()

    run(main())


def test_prompt_forms_and_chat_max_tokens(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            for prompt in ([1, 2, 3], ["text"], [[4, 5]]):
                assert (await client.post("/v1/completions", json={"prompt": prompt})).status_code == 200
            parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
            chat = {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": parts, "name": "ann"},
                ],
                "stop": "x",
            }
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
            both = {**CHAT, "max_tokens": 9, "max_completion_tokens": 4}
            assert (await client.post("/v1/chat/completions", json=both)).status_code == 200
            reqs = worker.requests()
            assert [(m.prompt, m.prompt_token_ids) for m in reqs[:3]] == [
                (None, [1, 2, 3]),
                ("text", None),
                (None, [4, 5]),
            ]
            max_tokens = [None if m.fill_max_tokens else m.sampling.max_tokens for m in reqs]
            assert max_tokens == [16, 16, 16, None, 4]  # chat default: None, the worker fills it in
            assert reqs[3].messages == [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "ab", "name": "ann"},
            ]
            assert reqs[3].sampling.stop == ["x"] and reqs[3].prompt is None
            await worker.stop()

    run(main())


def test_token_ids_are_checked_against_the_smallest_vocabulary_of_the_model(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            workers = [
                await FakeWorker(r, info).start()
                for info in (
                    instance("m0", vocab_size=100),
                    instance("m1", vocab_size=50),
                    instance("o0", model="other", vocab_size=10),
                )
            ]
            for body, param in (
                ({"model": "tiny", "prompt": [1, 50, 2]}, "prompt"),
                ({"model": "tiny", "prompt": [[7, 99]]}, "prompt"),
                ({"model": "tiny", "prompt": "hi", "stop_token_ids": [3, 50]}, "stop_token_ids"),
                ({"model": "other", "prompt": [10]}, "prompt"),
            ):
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 400, resp.text
                error = resp.json()["error"]
                assert (error["type"], error["param"]) == ("invalid_request_error", param)
                assert "vocabulary of" in error["message"]
            # the bound is the smallest vocabulary of the model asked for, not of the cluster
            ok = {"model": "tiny", "prompt": [0, 49], "stop_token_ids": [49], "max_tokens": 2}
            assert (await client.post("/v1/completions", json=ok)).status_code == 200
            chat = {**CHAT, "stop_token_ids": [49]}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
            assert sorted(str(m.prompt_token_ids) for w in workers for m in w.requests()) == [
                "None",
                "[0, 49]",
            ]
            assert not workers[2].requests()
            for w in workers:
                await w.stop()
            # instances that do not say their vocabulary size: nothing to check against
            old = await FakeWorker(r, instance("m2")).start()
            await asyncio.sleep(0.1)  # the live set is cached for 50 ms in tests
            big = {"model": "tiny", "prompt": [10**6], "stop_token_ids": [10**6]}
            assert (await client.post("/v1/completions", json=big)).status_code == 200
            assert old.requests()[0].prompt_token_ids == [10**6]
            await old.stop()

    run(main())


def test_splitwise_sends_one_message_to_prefill(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            p = await FakeWorker(r, instance("p0", "prefill", host="h1"), prefill_then_forward).start()
            d = await FakeWorker(r, instance("d0", "decode", host="h1"), decode_rest).start()
            before = time.time()
            resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "sw"})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert (
                body["id"] == f"chatcmpl-{p.received[0].request_id}" and body["object"] == "chat.completion"
            )
            assert body["choices"] == [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello world!"},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ]
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, **CACHED}
            [msg] = p.received
            assert isinstance(msg, GenerateRequest) and msg.messages == CHAT["messages"]
            info = msg.disaggregate_info
            assert info is not None
            assert (info.request_id, info.router_id, info.protocol) == (msg.request_id, ROUTER_ID, "shm")
            assert (info.prefill.id, info.prefill.host, info.decode.id, info.decode.host) == (
                "p0",
                "h1",
                "d0",
                "h1",
            )
            assert info.decode.transfer["protocols"] == ["shm", "tcp"]
            dl = info.deadlines
            assert before + 9 < dl.reserve < before + 11
            assert dl.transfer == dl.first_token  # default: a prompt queued at P may use its whole budget
            assert before + 59 < dl.first_token < before + 61
            await d.wait_for(lambda w: len(w.received) == 2)
            assert [type(m) for m in d.received] == [ReserveBlocks, Prefilled]  # nothing from the router
            # across hosts: the first common non-shm protocol
            await d.stop()
            d = await FakeWorker(r, instance("d1", "decode", host="h2"), decode_rest).start()
            await asyncio.sleep(0.1)
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
            assert p.requests()[1].disaggregate_info.protocol == "tcp"
            assert dispatcher(client).in_flight == {}
            await p.stop()
            await d.stop()

    run(main())


def test_chat_stream_shapes(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            p = await FakeWorker(r, instance("p0", "prefill"), prefill_then_forward).start()
            d = await FakeWorker(r, instance("d0", "decode"), decode_rest).start()
            resp = await client.post(
                "/v1/chat/completions",
                headers={"x-request-id": "s1"},
                json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            )
            assert resp.status_code == 200 and resp.headers["x-request-id"] == "s1"
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            rid = p.requests()[0].request_id
            for c in chunks:
                assert (c["id"], c["object"], c["model"]) == (
                    f"chatcmpl-{rid}",
                    "chat.completion.chunk",
                    "tiny",
                )
            assert [c["choices"] for c in chunks] == [
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                [{"index": 0, "delta": {"content": "Hello"}, "logprobs": None, "finish_reason": None}],
                [{"index": 0, "delta": {"content": " world"}, "logprobs": None, "finish_reason": None}],
                [{"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": "stop"}],
                [],
            ]
            assert [c["usage"] for c in chunks[:-1]] == [None] * 4
            assert chunks[-1]["usage"] == {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "total_tokens": 6,
                **CACHED,
            }
            # without include_usage: no usage key and no usage chunk
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            events = sse_events(resp.text)
            assert all("usage" not in c for c in events[:-1]) and len(events) == 5
            await p.stop()
            await d.stop()

    run(main())


def test_logprobs_shapes(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            resp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 1, "stream": True})
            chunks = sse_events(resp.text)[:-1]
            assert [c["choices"][0]["logprobs"] for c in chunks] == [
                {
                    "tokens": ["Hello"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{"Hello": -0.5}],
                    "text_offset": [0],
                },
                {
                    "tokens": [" world"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{" world": -0.5}],
                    "text_offset": [5],
                },
            ]
            assert worker.requests()[0].sampling.logprobs == 1
            resp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 0})
            lp = resp.json()["choices"][0]["logprobs"]
            assert lp["tokens"] == ["Hello", " world"] and lp["text_offset"] == [0, 5]
            resp = await client.post(
                "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1}
            )
            content = resp.json()["choices"][0]["logprobs"]["content"]
            assert content[1] == {
                "token": " world",
                "logprob": -0.5,
                "bytes": list(b" world"),
                "top_logprobs": [{"token": " world", "logprob": -0.5, "bytes": list(b" world")}],
            }
            assert worker.requests()[2].sampling.logprobs == 1
            assert (await client.post("/v1/chat/completions", json=CHAT)).json()["choices"][0][
                "logprobs"
            ] is None
            await worker.stop()

    run(main())


def test_n_fans_out_seeded_requests(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            resp = await client.post(
                "/v1/completions", headers={"x-request-id": "nn"}, json={"prompt": "x", "n": 3, "seed": 7}
            )
            body = resp.json()
            assert [c["index"] for c in body["choices"]] == [0, 1, 2]
            assert all(c["text"] == "Hello world" for c in body["choices"])
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9, **CACHED}
            reqs = worker.requests()
            rid = reqs[0].request_id.rsplit("-", 1)[0]
            assert sorted((m.request_id, m.sampling.seed) for m in reqs) == [
                (f"{rid}-0", 7),
                (f"{rid}-1", 8),
                (f"{rid}-2", 9),
            ]
            resp = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True})
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]"
            by_index: dict[int, list] = {0: [], 1: []}
            for c in events[:-1]:
                [choice] = c["choices"]
                by_index[choice["index"]].append(choice)
            for choices in by_index.values():
                assert choices[0]["delta"] == {"role": "assistant", "content": ""}
                assert "".join(c["delta"].get("content", "") for c in choices) == "Hello world"
                assert choices[-1]["finish_reason"] == "stop"
            assert all(m.sampling.seed is None for m in worker.requests()[3:])
            await worker.stop()

    run(main())


def test_batched_prompts_fan_out_in_openai_choice_order(redis_url: str, redis_client: redis.Redis) -> None:
    """A list of prompts with n = 2: choice index = prompt * n + i, each generation gets its own
    prompt (seeded choice i of every prompt: seed + i), usage counts each prompt once."""

    async def prompt_sized(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            size = len(msg.prompt) if msg.prompt is not None else len(msg.prompt_token_ids)
            text = msg.prompt if msg.prompt is not None else str(msg.prompt_token_ids)
            for delta in deltas_for(msg, [f"<{text}>", "."], prompt_tokens=size):
                await worker.publish(msg.router_id, delta)

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), prompt_sized).start()
            body = {"prompt": ["a", "bcd", "efghij"], "n": 2, "seed": 5, "max_tokens": 4}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert [(c["index"], c["text"]) for c in out["choices"]] == [
                (0, "<a>."),
                (1, "<a>."),
                (2, "<bcd>."),
                (3, "<bcd>."),
                (4, "<efghij>."),
                (5, "<efghij>."),
            ]
            assert out["usage"] == {
                "prompt_tokens": 1 + 3 + 6,
                "completion_tokens": 12,
                "total_tokens": 22,
                **CACHED,
            }
            reqs = sorted(worker.requests(), key=lambda m: int(m.request_id.rsplit("-", 1)[1]))
            rid = reqs[0].request_id.rsplit("-", 1)[0]
            assert [(m.request_id, m.prompt, m.sampling.seed) for m in reqs] == [
                (f"{rid}-{i}", p, 5 + i % 2)
                for i, p in enumerate(["a", "a", "bcd", "bcd", "efghij", "efghij"])
            ]
            ids = await client.post(
                "/v1/completions",
                json={"prompt": [[1, 2], [3]], "stream": True, "stream_options": {"include_usage": True}},
            )
            events = sse_events(ids.text)
            texts: dict[int, str] = {0: "", 1: ""}
            for e in events[:-2]:
                texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
            assert texts == {0: "<[1, 2]>.", 1: "<[3]>."}
            assert events[-2]["usage"]["prompt_tokens"] == 3 and events[-1] == "[DONE]"
            assert [m.prompt_token_ids for m in worker.requests()[6:]] == [[1, 2], [3]]
            await worker.stop()

    run(main())


def test_echo_prefixes_the_prompt_once(redis_url: str, redis_client: redis.Redis) -> None:
    """A text prompt is echoed by the router; a token-id prompt's text comes from the worker
    (``echo`` asked, ``prompt_text`` on the first token's delta), never again after a migration."""

    async def with_prompt_text(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            done = len(msg.resume_token_ids or ())
            deltas = deltas_for(msg, ["Hello", " world"][done:], start=done)
            if msg.echo:
                deltas[0].prompt_text = "".join(f"[{t}]" for t in msg.prompt_token_ids)
            for delta in deltas:
                await worker.publish(msg.router_id, delta)

    async def half_then_fail(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            first = deltas_for(msg, ["Hello", " world"])[0]
            first.prompt_text = "[7]" if msg.echo else None
            await worker.publish(
                msg.router_id,
                first,
                RequestDelta.failure(
                    msg.request_id, UnavailableError("bye"), retryable=True, attempt=msg.attempt
                ),
            )

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), with_prompt_text).start()
            for body, texts in (
                ({"prompt": "Say:", "echo": True}, ["Say:Hello world"]),
                (
                    {"prompt": [[7, 8], [9]], "echo": True, "n": 2},
                    ["[7][8]Hello world"] * 2 + ["[9]Hello world"] * 2,
                ),
                ({"prompt": ["a", "b"], "echo": False}, ["Hello world"] * 2),
            ):
                resp = await client.post("/v1/completions", json=body)
                assert [c["text"] for c in resp.json()["choices"]] == texts, resp.text
                streamed = sse_events(
                    (await client.post("/v1/completions", json={**body, "stream": True})).text
                )
                assert streamed[0]["choices"][0]["text"] == texts[streamed[0]["choices"][0]["index"]][:-6]
            assert [m.echo for m in worker.requests()] == [None, None] + [True] * 8 + [None] * 4
            await worker.stop()
        async with router(redis_url, decode_policy="round_robin") as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), half_then_fail).start()
            m1 = await FakeWorker(r, instance("m1"), with_prompt_text).start()
            resp = await client.post("/v1/completions", json={"prompt": [7], "echo": True})
            assert resp.json()["choices"][0]["text"] == "[7]Hello world"
            assert [(m.echo, m.resume_token_ids) for m in m1.requests()] == [(None, [100])]
            await m0.stop()
            await m1.stop()

    run(main())


def test_retry_on_a_retryable_error_ignores_the_old_attempt(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def refuse(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(
                msg.router_id,
                RequestDelta.failure(
                    msg.request_id, UnavailableError("no free KV blocks"), retryable=True, attempt=msg.attempt
                ),
            )

    async def late_then_answer(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            stale = RequestDelta(
                request_id=msg.request_id, token_ids=[1], text="STALE", attempt=msg.attempt - 1
            )
            await worker.publish(msg.router_id, stale)  # e.g. a late event of the first attempt
            await answer(worker, msg)

    async def main() -> None:
        async with router(redis_url, decode_policy="round_robin") as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), refuse).start()
            m1 = await FakeWorker(r, instance("m1"), late_then_answer).start()
            for stream in (False, True):
                resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
                assert resp.status_code == 200
                text = (
                    resp.json()["choices"][0]["text"]
                    if not stream
                    else "".join(c["choices"][0]["text"] for c in sse_events(resp.text)[:-1])
                )
                assert text == "Hello world"
            assert [m.attempt for m in m0.requests()] == [0, 0]
            assert [m.attempt for m in m1.requests()] == [1, 1]
            await m0.wait_for(lambda w: len(w.aborts()) == 2)
            assert [a.attempt for a in m0.aborts()] == [0, 0]
            assert dispatcher(client).num_retries == 2 and dispatcher(client).in_flight == {}
            await m0.stop()
            await m1.stop()

    run(main())


def test_a_failure_after_tokens_migrates_and_continues(redis_url: str, redis_client: redis.Redis) -> None:
    """Tokens reached the caller, then the instance failed (retryable): the request moves to another
    instance with the delivered tokens to resume from, and the answer continues with no duplicate
    or gap, streamed or not. With max_migrations 0 the stream ends with the error instead."""

    async def half_then_fail(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(
                msg.router_id,
                deltas_for(msg, ["Hello", " world"])[0],
                RequestDelta.failure(
                    msg.request_id, UnavailableError("bye"), retryable=True, attempt=msg.attempt
                ),
            )

    async def main() -> None:
        async with router(redis_url, decode_policy="round_robin") as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), half_then_fail).start()
            m1 = await FakeWorker(r, instance("m1")).start()
            resp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 1})
            body = resp.json()
            assert body["choices"][0]["text"] == "Hello world"  # not "HelloHello world"
            assert body["choices"][0]["logprobs"]["tokens"] == ["Hello", " world"]
            assert body["usage"]["completion_tokens"] == 2
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            events = sse_events(resp.text)
            assert resp.status_code == 200 and events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world"
            assert [m.resume_token_ids for m in m1.requests()] == [[100], [100]]
            assert [m.disaggregate_info for m in m1.requests()] == [None, None]
            assert dispatcher(client).num_migrations == 2 and dispatcher(client).num_retries == 0
            await m0.stop()
            await m1.stop()
        async with (
            router(redis_url, decode_policy="round_robin", max_migrations=0) as client,
            redis_conn(redis_url) as r,
        ):
            m0 = await FakeWorker(r, instance("m0"), half_then_fail).start()
            m1 = await FakeWorker(r, instance("m1")).start()
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            events = sse_events(resp.text)
            assert resp.status_code == 200 and events[0]["choices"][0]["text"] == "Hello"
            assert events[-2]["error"]["code"] == "unavailable" and events[-1] == "[DONE]"
            assert events[-2]["error"]["message"] == "bye"
            assert m1.requests() == []
            await m0.stop()
            await m1.stop()

    run(main())


async def publish_twice(worker: FakeWorker, router_id: str, delta: RequestDelta) -> None:
    """The same outbox XADD twice in one pipeline (what redis-py's retry of a pipeline whose reply
    was lost does)."""
    step = StepOutput(instance_id=worker.id, items=[delta])
    pipe = worker.redis.pipeline(transaction=False)
    await worker.outbox.publish(router_id, step, pipeline=pipe)
    await worker.outbox.publish(router_id, step, pipeline=pipe)
    await pipe.execute()


def test_repeated_deltas_are_dropped_and_a_gap_fails_the_attempt(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Every outbox entry twice: the client's text is exact. A numbered delta that skips one: the
    attempt fails (retryable) and migrates, never silently missing text."""

    async def each_twice(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            done = len(msg.resume_token_ids or ())
            for seq, delta in enumerate(deltas_for(msg, ["Hello", " world"][done:], start=done)):
                await publish_twice(worker, msg.router_id, delta.model_copy(update={"seq": seq}))

    async def skip_one(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            hello, world = deltas_for(msg, ["Hello", " world", "!"])[::2]
            await worker.publish(msg.router_id, hello.model_copy(update={"seq": 0}))
            await worker.publish(msg.router_id, world.model_copy(update={"seq": 2}))

    async def main() -> None:
        async with router(redis_url, decode_policy="round_robin") as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), each_twice).start()
            for stream in (False, True):
                resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
                assert resp.status_code == 200
                if stream:
                    events = sse_events(resp.text)
                    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world"
                else:
                    assert resp.json()["choices"][0]["text"] == "Hello world"
                    assert resp.json()["usage"]["completion_tokens"] == 2
            await m0.stop()
        async with router(redis_url, decode_policy="round_robin") as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), skip_one).start()
            m1 = await FakeWorker(r, instance("m1"), each_twice).start()
            for stream in (False, True):
                resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
                text = (
                    resp.json()["choices"][0]["text"]
                    if not stream
                    else "".join(c["choices"][0]["text"] for c in sse_events(resp.text)[:-1])
                )
                assert text == "Hello world"  # not "Hello!", nor "Hello" twice
            assert [m.resume_token_ids for m in m1.requests()] == [[100], [100]]
            assert dispatcher(client).num_migrations == 2
            await m0.wait_for(lambda w: len(w.aborts()) == 2)
            await m0.stop()
            await m1.stop()

    run(main())


def test_an_instance_that_stalls_after_tokens_is_left_and_the_stream_continues(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Alive (its key renewed) but silent after the first token: after stall_timeout_s the request
    migrates to another instance and the stream completes."""

    async def first_token_only(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(msg.router_id, deltas_for(msg, ["Hello", " world"])[0])

    async def main() -> None:
        async with (
            router(redis_url, decode_policy="round_robin", stall_timeout_s=0.5) as client,
            redis_conn(redis_url) as r,
        ):
            m0 = await FakeWorker(r, instance("m0"), first_token_only).start()
            m1 = await FakeWorker(r, instance("m1")).start()
            started = time.monotonic()
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            events = sse_events(resp.text)
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello world"
            assert 0.5 <= time.monotonic() - started < 3
            assert [m.resume_token_ids for m in m1.requests()] == [[100]]
            await m0.wait_for(lambda w: len(w.aborts()) == 1)  # the stalled attempt is aborted
            await m0.stop()
            await m1.stop()

    run(main())


def test_retries_are_bounded(redis_url: str, redis_client: redis.Redis) -> None:
    async def refuse(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(
                msg.router_id,
                RequestDelta.failure(
                    msg.request_id, UnavailableError("no free KV blocks"), retryable=True, attempt=msg.attempt
                ),
            )

    async def main() -> None:
        async with router(redis_url, retry_attempts=1) as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), refuse).start()
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["type"] == "service_unavailable"
            assert resp.json()["error"]["code"] == "unavailable"
            assert [m.attempt for m in m0.requests()] == [0, 1]  # the only instance, tried again
            await m0.stop()

    run(main())


def test_retry_when_the_instance_key_expires(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url, decode_policy="round_robin") as client, redis_conn(redis_url) as r:
            dead = await FakeWorker(r, instance("m0"), silent, ttl_s=0.3).start()  # never renews its key
            m1 = await FakeWorker(r, instance("m1")).start()
            await asyncio.sleep(0.1)
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert resp.status_code == 200
            assert "".join(
                c["choices"][0]["delta"].get("content", "") for c in sse_events(resp.text)[:-1]
            ) == ("Hello world")
            assert [m.attempt for m in dead.requests()] == [0] and [m.attempt for m in m1.requests()] == [1]
            await dead.wait_for(lambda w: len(w.aborts()) == 1)
            await dead.stop(deregister=False)
            await m1.stop()

    run(main())


def test_worker_error_before_the_stream_is_an_http_status(redis_url: str, redis_client: redis.Redis) -> None:
    async def too_long(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(
                msg.router_id,
                RequestDelta.failure(
                    msg.request_id,
                    RequestTooLongError("prompt is too long (5000 > 2048 tokens)", "messages"),
                    attempt=msg.attempt,
                ),
            )

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), too_long).start()
            for stream in (False, True):
                resp = await client.post(
                    "/v1/chat/completions",
                    json={**CHAT, "stream": stream},
                    headers={"x-request-id": f"e{stream}"},
                )
                assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
                assert resp.headers["x-request-id"] == f"e{stream}"
                assert resp.json()["error"]["message"] == "prompt is too long (5000 > 2048 tokens)"
                assert resp.json()["error"]["type"] == "invalid_request_error"
                assert resp.json()["error"]["code"] == "context_length_exceeded"
                assert resp.json()["error"]["param"] == "messages"
            await worker.stop()

    run(main())


def test_failures_after_the_stream_started_end_with_an_error_event(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def first_token_only(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(msg.router_id, deltas_for(msg, ["Hello", " world"])[0])

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            p = await FakeWorker(r, instance("p0", "prefill"), first_token_only).start()
            d = await FakeWorker(r, instance("d0", "decode"), silent, ttl_s=0.3).start()  # dies
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert resp.status_code == 200
            events = sse_events(resp.text)
            assert events[1]["choices"][0]["delta"] == {"content": "Hello"}
            assert events[-2] == {
                "error": {
                    "message": "instance d0 stopped responding",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "instance_unavailable",
                    "status": 503,
                }
            }
            assert events[-1] == "[DONE]"
            await p.wait_for(lambda w: len(w.aborts()) == 1)  # the pair of the request gets Abort
            await d.wait_for(lambda w: len(w.aborts()) == 1)
            assert dispatcher(client).in_flight == {}
            await p.stop()
            await d.stop(deregister=False)

    run(main())


def test_deadlines_end_requests_with_timeout(redis_url: str, redis_client: redis.Redis) -> None:
    async def first_token_only(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest) and msg.prompt == "one":
            await worker.publish(msg.router_id, deltas_for(msg, ["Hello", " world"])[0])

    async def main() -> None:
        async with (
            router(redis_url, request_timeout_s=0.4, first_token_timeout_s=0.2) as client,
            redis_conn(redis_url) as r,
        ):
            worker = await FakeWorker(r, instance("m0"), first_token_only).start()
            started = time.monotonic()
            resp = await client.post("/v1/completions", json={"prompt": "none"})
            assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout"
            assert "no first token within 0.2 s" in resp.json()["error"]["message"]
            assert time.monotonic() - started < 1.0
            resp = await client.post("/v1/completions", json={"prompt": "one", "stream": True})
            events = sse_events(resp.text)
            assert resp.status_code == 200 and events[0]["choices"][0]["text"] == "Hello"
            assert events[-2]["error"]["type"] == "timeout" and events[-1] == "[DONE]"
            assert "did not finish within 0.4 s" in events[-2]["error"]["message"]
            await worker.wait_for(lambda w: len(w.aborts()) == 2)
            await worker.stop()

    run(main())


def test_any_attempt_events_apply_to_the_current_attempt(redis_url: str, redis_client: redis.Redis) -> None:
    async def lost(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(
                msg.router_id,
                RequestDelta.failure(msg.request_id, MessageError("bad message"), attempt=ANY_ATTEMPT),
            )

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), lost).start()
            resp = await client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 502 and resp.json()["error"]["message"] == "bad message"
            await worker.stop()

    run(main())


def test_client_disconnect_aborts_prefill_and_decode(redis_url: str, redis_client: redis.Redis) -> None:
    async def first_token_only(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await worker.publish(msg.router_id, deltas_for(msg, ["Hello", " world"])[0])

    async def main() -> None:
        async with served_router(redis_url) as client, redis_conn(redis_url) as r:
            p = await FakeWorker(r, instance("p0", "prefill"), first_token_only).start()
            d = await FakeWorker(r, instance("d0", "decode"), silent).start()
            await asyncio.sleep(0.1)
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={"x-request-id": "gone"},
            ) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if "Hello" in line:
                        break  # the client walks away mid-stream
            await p.wait_for(lambda w: len(w.aborts()) == 1)
            await d.wait_for(lambda w: len(w.aborts()) == 1)
            assert p.aborts()[0].request_id == p.requests()[0].request_id and d.aborts()[0].attempt == 0
            assert "disconnected" in d.aborts()[0].reason
            assert dispatcher(client).generations == {} and dispatcher(client).in_flight == {}
            await p.stop()
            await d.stop()

    run(main())


def test_the_openai_client_reads_every_shape(redis_url: str, redis_client: redis.Redis) -> None:
    import openai

    async def main() -> None:
        async with served_router(redis_url) as http, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            await asyncio.sleep(0.1)
            client = openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="none", max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            chat = await client.chat.completions.create(
                model="tiny", messages=CHAT["messages"], logprobs=True, top_logprobs=1
            )
            assert chat.choices[0].message.content == "Hello world" and chat.usage.total_tokens == 5
            assert chat.choices[0].logprobs.content[0].token == "Hello"
            stream = await client.chat.completions.create(
                model="tiny", messages=CHAT["messages"], stream=True, stream_options={"include_usage": True}
            )
            pieces, usage = [], None
            async for chunk in stream:
                pieces += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            assert "".join(pieces) == "Hello world" and usage.completion_tokens == 2
            completion = await client.completions.create(model="tiny", prompt="hi", n=2, seed=1)
            assert [c.text for c in completion.choices] == ["Hello world"] * 2
            with pytest.raises(openai.NotFoundError, match="gpt-9"):
                await client.completions.create(model="gpt-9", prompt="hi")
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
            assert info.value.body["param"] == "max_tokens"
            await client.close()
            await worker.stop()

    run(main())


def _nested(levels: int) -> str:
    """A JSON object ``levels`` objects deep."""
    return '{"a": ' * (levels - 1) + "{}" + "}" * (levels - 1)


def test_a_deeply_nested_request_fails_alone(redis_url: str, redis_client: redis.Redis) -> None:
    """Four requests of one event-loop turn, one with a guided_json 400 levels deep: that one is a
    400 naming the field, the three others are served (no batch-wide 503); deeper still, and
    bodies nested 1500 deep, are 400s, never a 500 or a RecursionError."""
    deep = {**CHAT, "guided_json": _nested(400)}

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            resps = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=CHAT if i != 2 else deep) for i in range(4))
            )
            assert [resp.status_code for resp in resps] == [200, 200, 400, 200]
            assert resps[2].json()["error"]["param"] == "guided_json"
            assert "levels deep" in resps[2].json()["error"]["message"]
            assert all(
                resp.json()["choices"][0]["message"]["content"] == "Hello world" for resp in resps[::3]
            )
            tool_call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": _nested(1500)},
            }
            cases = [
                ({**CHAT, "guided_json": _nested(1500)}, "guided_json"),
                ({**CHAT, "guided_json": json.loads(_nested(100))}, "guided_json"),
                (
                    {
                        **CHAT,
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "x", "schema": json.loads(_nested(100))},
                        },
                    },
                    "response_format.json_schema.schema",
                ),
                (
                    {
                        **CHAT,
                        "tools": [
                            {
                                "type": "function",
                                "function": {"name": "f", "parameters": json.loads(_nested(100))},
                            }
                        ],
                    },
                    "tools[0].function.parameters",
                ),
                (
                    {"messages": [*CHAT["messages"], {"role": "assistant", "tool_calls": [tool_call]}]},
                    "messages[1].tool_calls[0].function.arguments",
                ),
            ]
            for body, param in cases:
                resp = await client.post("/v1/chat/completions", json=body)
                assert (resp.status_code, resp.json()["error"]["param"]) == (400, param), resp.text
            deep_body = (
                '{"messages": [{"role": "user", "content": "hi"}], "guided_json": ' + _nested(1500) + "}"
            )
            resp = await client.post(
                "/v1/chat/completions", content=deep_body, headers={"content-type": "application/json"}
            )
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
            assert len(worker.requests()) == 3
            await worker.stop()

    run(main())


def test_a_slow_reader_is_not_taken_for_a_stalled_worker(redis_url: str, redis_client: redis.Redis) -> None:
    """The stall check measures the worker's progress (when the router receives its deltas), not
    the client's pace: a caller that pauses past stall_timeout_s while the worker keeps producing
    gets its whole text from the same attempt, with no migration."""
    from pdserve.router.api.input_limits import InputLimits
    from pdserve.router.api.protocol import parse_completion
    from pdserve.router.routing.generation import open_generations

    texts = [f" t{i}" for i in range(12)]

    async def steady(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            for delta in deltas_for(msg, texts):
                await worker.publish(msg.router_id, delta)
                await asyncio.sleep(0.1)

    async def main() -> None:
        async with router(redis_url, stall_timeout_s=0.4) as client, redis_conn(redis_url) as r:
            m0 = await FakeWorker(r, instance("m0"), steady).start()
            d = dispatcher(client)
            limits = InputLimits.of(client.app.state.router.settings)  # type: ignore[attr-defined]
            parsed = parse_completion(b'{"prompt": "x", "stream": true}', limits)
            [gen] = await open_generations(d, parsed, "slow-reader", "tiny")
            try:
                got = [(await gen.next()).text]
                await asyncio.sleep(0.9)  # the worker keeps producing meanwhile
                while not gen.finished:
                    got.append((await gen.next()).text)
                    await asyncio.sleep(0.15)  # slower than the worker, for longer than the timeout
            finally:
                gen.close()
            assert "".join(got) == "".join(texts)
            assert (gen.migrations, d.num_migrations, gen.error) == (0, 0, None)
            assert len(m0.requests()) == 1 and m0.aborts() == []
            await m0.stop()

    run(main())


def test_the_deadline_counts_from_arrival_not_from_admission(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A request that waited for a slot has that much less time: its deadline is arrival + timeout."""

    async def slow(worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await asyncio.sleep(0.8)
            await answer(worker, msg)

    async def main() -> None:
        async with router(redis_url, max_in_flight=1, max_queued=4) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), slow).start()
            first = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await worker.wait_for(lambda w: len(w.requests()) == 1)
            sent = time.time()
            second = await client.post("/v1/completions", json={"prompt": "b"})
            assert (await first).status_code == 200 and second.status_code == 200
            late = worker.requests()[1]
            timeout = client.app.state.router.settings.request_timeout_s  # type: ignore[attr-defined]
            assert late.deadline < sent + timeout + 0.3  # not (admitted ~0.8 s later) + timeout
            await worker.stop()

    run(main())


def test_a_retry_does_not_count_the_failed_attempt_as_load(redis_url: str, redis_client: redis.Redis) -> None:
    """The prefill instance of an attempt dies: the retry keeps the decode instance that is still
    the better one (more free KV) — the failed attempt is no load on it any more."""

    async def main() -> None:
        async with (
            router(redis_url, prefill_policy="least_load", decode_policy="least_load") as client,
            redis_conn(redis_url) as r,
        ):
            p0 = await FakeWorker(r, instance("p0", "prefill"), silent, ttl_s=0.3).start()  # dies
            d0 = await FakeWorker(r, instance("d0", "decode", free_blocks=100), silent).start()
            d1 = await FakeWorker(r, instance("d1", "decode", free_blocks=50), silent).start()
            request = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            await p0.wait_for(lambda w: len(w.requests()) == 1)
            assert p0.requests()[0].disaggregate_info.decode.id == "d0"
            p1 = await FakeWorker(r, instance("p1", "prefill")).start()
            resp = await request
            assert resp.status_code == 200 and dispatcher(client).num_retries == 1
            assert [m.disaggregate_info.decode.id for m in p1.requests()] == ["d0"]
            await d0.wait_for(lambda w: [a.attempt for a in w.aborts()] == [0])
            for worker in (p1, d0, d1):
                await worker.stop()
            await p0.stop(deregister=False)

    run(main())


def test_a_batch_workers_router_marks_its_requests_as_background(redis_url: str) -> None:
    """The flag the instances schedule batch lines by: set by a batch worker's router only."""

    async def main() -> None:
        for background in (False, True):
            async with router(redis_url, background=background) as client, redis_conn(redis_url) as r:
                worker = await FakeWorker(r, instance("m0")).start()
                resp = await client.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
                )
                assert resp.status_code == 200
                [msg] = worker.received
                assert msg.background is (True if background else None)
                await worker.stop()

    run(main())
