"""What the router refuses or holds back itself, before any instance is bothered: prompts that can
never fit the model length, oversized grammars, and admission that counts choices (and /tokenize)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis
from router_support import FakeWorker, answer, instance, redis_conn, router, run

from pdserve.errors import InvalidRequestError, RequestTimeoutError
from pdserve.router.api.errors import OverloadedError
from pdserve.router.http.admission import Admission
from pdserve.scheduler import GenerateRequest, InboxMessage, RequestDelta, Usage
from pdserve.scheduler.inbox_messages import Tokenize

MODEL_LEN = 2048  # what router_support.instance() registers
CHARS = MODEL_LEN * 32  # the most characters the default --max-prompt-chars-per-token lets through


def assert_refused(resp: Any, param: str, code: str | None = "context_length_exceeded") -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error


def test_a_prompt_that_cannot_fit_is_refused_before_any_worker_sees_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            started = time.monotonic()
            resp = await client.post("/v1/completions", json={"prompt": "x" * 7_000_000})
            assert_refused(resp, "prompt")
            assert time.monotonic() - started < 2.0
            assert "2048 tokens" in resp.json()["error"]["message"]
            ids = await client.post("/v1/completions", json={"prompt": [1] * MODEL_LEN, "max_tokens": 1})
            assert_refused(ids, "prompt")
            listed = await client.post("/v1/completions", json={"prompt": ["ok", "y" * (CHARS + 1)]})
            assert_refused(listed, "prompt")
            tok = await client.post("/tokenize", json={"prompt": "x" * (CHARS + 1)})
            assert_refused(tok, "prompt")
            await asyncio.sleep(0.1)
            assert worker.received == []  # nothing was sent
            fits = await client.post("/v1/completions", json={"prompt": "x" * CHARS, "max_tokens": 2})
            assert fits.status_code == 200, fits.text
            fits = await client.post(
                "/v1/completions", json={"prompt": [1] * (MODEL_LEN - 1), "max_tokens": 1}
            )
            assert fits.status_code == 200, fits.text
            assert len(worker.requests()) == 2
            await worker.stop()

    run(main())


def test_chat_messages_that_cannot_fit_are_refused_naming_messages(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Each message alone could fit; their characters together cannot."""

    async def main() -> None:
        async with router(redis_url, max_prompt_chars_per_token=4) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            half = "z" * (MODEL_LEN * 2 + 1)
            messages = [
                {"role": "system", "content": half},
                {"role": "user", "content": [{"type": "text", "text": half}]},
            ]
            resp = await client.post("/v1/chat/completions", json={"messages": messages})
            assert_refused(resp, "messages")
            tok = await client.post("/tokenize", json={"messages": messages})
            assert_refused(tok, "messages")
            ok = await client.post("/v1/chat/completions", json={"messages": messages[:1]})
            assert ok.status_code == 200, ok.text
            assert len(worker.received) == 1
            await worker.stop()

    run(main())


def big_schema(size: int) -> dict[str, Any]:
    per = len('"p000000":{"type":"string"},')
    return {"type": "object", "properties": {f"p{i:06d}": {"type": "string"} for i in range(size // per + 1)}}


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("response_format", "response_format.json_schema.schema"),
        ("guided_json", "guided_json"),
        ("guided_regex", "guided_regex"),
        ("guided_choice", "guided_choice"),
        ("tools", "tools"),
    ],
)
def test_grammars_larger_than_the_bound_are_refused(
    redis_url: str, redis_client: redis.Redis, field: str, param: str
) -> None:
    schema = big_schema(1_000_000)
    value: Any = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
        "guided_json": schema,
        "guided_regex": "(a|b)" * 200_000,
        "guided_choice": [f"choice {i}" for i in range(100_000)],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }[field]

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            body = {"messages": [{"role": "user", "content": "hi"}], field: value}
            resp = await client.post("/v1/chat/completions", json=body)
            assert_refused(resp, param, None)
            assert "--max-grammar-bytes" in resp.json()["error"]["message"]
            if field != "tools":
                resp = await client.post("/v1/completions", json={"prompt": "hi", field: value})
                assert_refused(resp, param, None)
            assert worker.received == []
            await worker.stop()

    run(main())


def optional_object(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {} for i in range(n)}, "additionalProperties": False}


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("response_format", "response_format.json_schema.schema"),
        ("guided_json", "guided_json"),
        ("guided_json_text", "guided_json"),
        ("tools_required", "tools[1].function.parameters"),
        ("tools_named", "tools[1].function.parameters"),
    ],
)
def test_a_schema_that_would_compile_for_seconds_and_fail_is_refused(
    redis_url: str, redis_client: redis.Redis, field: str, param: str
) -> None:
    """An object of 5,000 optional properties (59 KB, within --max-grammar-bytes) would keep a worker
    compiling for seconds and then fail at its first token: a 400 naming the field, nothing sent.
    The same tools under tool_choice "auto" compile nothing and go through."""
    costly = {"type": "object", "properties": {"rows": {"type": "array", "items": optional_object(5000)}}}
    tools = [
        {"type": "function", "function": {"name": "small", "parameters": optional_object(3)}},
        {"type": "function", "function": {"name": "costly", "parameters": costly}},
    ]
    body: dict[str, Any] = {
        "response_format": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": costly}}
        },
        "guided_json": {"guided_json": costly},
        "guided_json_text": {"guided_json": json.dumps(costly)},
        "tools_required": {"tools": tools, "tool_choice": "required"},
        "tools_named": {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "costly"}}},
    }[field]

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            started = time.monotonic()
            resp = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body}
            )
            assert_refused(resp, param, None)
            message = resp.json()["error"]["message"]
            assert "5000 optional properties" in message and "--max-optional-properties" in message
            if not field.startswith("tools"):
                resp = await client.post("/v1/completions", json={"prompt": "hi", **body})
                assert_refused(resp, param, None)
            assert time.monotonic() - started < 2.0
            assert worker.received == []
            if field == "tools_required":  # "auto": no grammar, the schemas only reach the template
                auto = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2}
                resp = await client.post("/v1/chat/completions", json=auto)
                assert resp.status_code == 200, resp.text
                assert len(worker.requests()) == 1
            await worker.stop()

    run(main())


def test_the_optional_properties_limit_is_a_flag(redis_url: str, redis_client: redis.Redis) -> None:
    """--max-optional-properties (PDSERVE_MAX_OPTIONAL_PROPERTIES) moves the bound."""

    async def main() -> None:
        async with router(redis_url, max_optional_properties=10) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            resp = await client.post(
                "/v1/completions", json={"prompt": "hi", "guided_json": optional_object(11)}
            )
            assert_refused(resp, "guided_json", None)
            resp = await client.post(
                "/v1/completions", json={"prompt": "hi", "guided_json": optional_object(10), "max_tokens": 2}
            )
            assert resp.status_code == 200, resp.text
            assert len(worker.requests()) == 1
            await worker.stop()

    run(main())


class Gate:
    """A worker script that holds every request until ``open``; Tokenize is answered at once."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def __call__(self, worker: FakeWorker, msg: InboxMessage) -> None:
        if isinstance(msg, Tokenize):
            usage = Usage(prompt_tokens=2, completion_tokens=0)
            delta = RequestDelta(
                request_id=msg.request_id, token_ids=[1, 2], text="", finish_reason="stop", usage=usage
            )
            await worker.publish(msg.router_id, delta)
        elif isinstance(msg, GenerateRequest):
            self.tasks.append(asyncio.ensure_future(self._later(worker, msg)))

    async def _later(self, worker: FakeWorker, msg: GenerateRequest) -> None:
        await self.opened.wait()
        await answer(worker, msg)


def test_admission_counts_choices(redis_url: str, redis_client: redis.Redis) -> None:
    """With --max-in-flight 2: n=3 can never run (400 naming n); n=2 waits while n=1 runs."""

    async def main() -> None:
        gate = Gate()
        async with router(redis_url, max_in_flight=2, max_queued=1) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), gate).start()
            resp = await client.post("/v1/completions", json={"prompt": "a", "n": 3})
            assert_refused(resp, "n", None)
            assert "--max-in-flight" in resp.json()["error"]["message"]
            resp = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
            assert_refused(resp, "prompt", None)
            first = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await worker.wait_for(lambda w: len(w.requests()) == 1)
            second = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "b", "n": 2}))
            await asyncio.sleep(0.3)
            assert len(worker.requests()) == 1  # two choices do not fit beside the one running
            full = await client.post("/v1/completions", json={"prompt": "c"})
            assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limit_exceeded"
            gate.opened.set()
            assert (await first).status_code == 200
            resp = await second
            assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
            assert len(worker.requests()) == 3
            assert client.app.state.router.admission.in_use == 0  # type: ignore[attr-defined]
            await worker.stop()

    run(main())


def test_tokenize_waits_in_admission(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        gate = Gate()
        async with router(redis_url, max_in_flight=1, max_queued=1) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), gate).start()
            first = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await worker.wait_for(lambda w: len(w.requests()) == 1)
            tok = asyncio.ensure_future(client.post("/tokenize", json={"prompt": "ab"}))
            await asyncio.sleep(0.3)
            assert not any(isinstance(m, Tokenize) for m in worker.received)  # waiting for the slot
            full = await client.post("/detokenize", json={"tokens": [1, 2]})
            assert full.status_code == 429, full.text
            gate.opened.set()
            assert (await first).status_code == 200
            resp = await tok
            assert resp.status_code == 200 and resp.json()["tokens"] == [1, 2], resp.text
            resp = await client.post("/detokenize", json={"tokens": [1, 2]})
            assert resp.status_code == 200, resp.text
            await worker.stop()

    run(main())


def test_admission_gives_back_what_a_waiter_that_gives_up_held() -> None:
    async def main() -> None:
        admission = Admission(limit=2, queue=2, wait_s=0.2)
        await admission.enter(2)
        with pytest.raises(RequestTimeoutError):
            await admission.enter(1)
        waiter = asyncio.ensure_future(admission.enter(2))
        small = asyncio.ensure_future(admission.enter(1))  # behind the large one: arrival order
        await asyncio.sleep(0.05)
        assert admission.waiting == 2
        with pytest.raises(OverloadedError):
            await admission.enter(1)
        waiter.cancel()
        await asyncio.sleep(0.05)
        assert admission.waiting == 1 and not small.done()
        admission.leave(2)
        await small
        assert (admission.in_use, admission.waiting) == (1, 0)
        with pytest.raises(InvalidRequestError):
            await admission.enter(3)
        admission.leave(1)
        assert admission.in_use == 0

    asyncio.run(main())
