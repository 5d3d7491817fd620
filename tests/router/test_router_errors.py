"""Every failure reaches the client as an OpenAI error body with a deliberate status, type and param."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
import redis
from router_support import FakeWorker, answer, instance, redis_conn, router, run, served_router, silent

import pdserve
import pdserve.router.http.app  # imports every router module that may add classes to the tree
import pdserve.scheduler
from pdserve.errors import (
    ConfigError,
    ControlPlaneError,
    EngineError,
    InstanceLostError,
    InvalidRequestError,
    MessageError,
    PdserveError,
    RequestTimeoutError,
    RequestTooLongError,
    TransferError,
    class_of_kind,
    error_classes,
)
from pdserve.router.api.errors import (
    ERROR_MAP,
    AuthenticationError,
    BodyTooLargeError,
    ModelNotFoundError,
    NoCapacityError,
    UpstreamError,
    error_event,
    error_status,
)
from pdserve.scheduler import ErrorInfo


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_class_of_the_tree_is_mapped_deliberately() -> None:
    """Workers' exceptions never cross into the router as Python exceptions (they arrive as
    ErrorInfo), so the tree the router can meet is pdserve.errors + scheduler + router."""
    missing = {cls.__qualname__ for cls in {PdserveError, *_subclasses(PdserveError)} if cls not in ERROR_MAP}
    assert not missing, f"add these to pdserve.router.api.errors.ERROR_MAP: {sorted(missing)}"


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "param"),
    [
        (
            InvalidRequestError("max_tokens must be >= 1", "max_tokens"),
            400,
            "invalid_request_error",
            None,
            "max_tokens",
        ),
        (
            RequestTooLongError("prompt too long", "prompt"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
            "prompt",
        ),
        (ModelNotFoundError("gpt-9"), 404, "invalid_request_error", "model_not_found", "model"),
        (BodyTooLargeError(1024), 413, "invalid_request_error", "request_too_large", None),
        (AuthenticationError(), 401, "invalid_request_error", "invalid_api_key", None),
        (NoCapacityError("nothing"), 503, "service_unavailable", "no_capacity", None),
        (ControlPlaneError("redis down"), 503, "service_unavailable", "control_plane_unavailable", None),
        (TransferError("rdma"), 503, "service_unavailable", "kv_transfer_failed", None),
        (RequestTimeoutError("late"), 504, "timeout", "timeout", None),
        (EngineError("boom"), 500, "server_error", "engine_error", None),
        (ConfigError("bad"), 500, "server_error", "configuration_error", None),
        (MessageError("garbled"), 502, "bad_gateway", "invalid_message", None),
        (PdserveError("?"), 500, "server_error", "internal_error", None),
    ],
)
def test_error_status(exc: Exception, status: int, type_: str, code: str | None, param: str | None) -> None:
    got_status, body, headers = error_status(exc)
    assert got_status == status
    assert body == {
        "error": {"message": body["error"]["message"], "type": type_, "param": param, "code": code}
    }
    assert body["error"]["message"]
    assert ("retry-after" in headers) == (status == 503)


def test_worker_errors_map_by_kind_like_local_ones() -> None:
    long = RequestTooLongError("prompt + max_tokens too long", "prompt")
    assert error_status(UpstreamError(ErrorInfo.of(long))) == error_status(long)
    status, body, _ = error_status(
        UpstreamError(ErrorInfo(kind="context_length_exceeded", message="long", param="prompt"))
    )
    assert status == 400 and body["error"] == {
        "message": "long",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    status, _, headers = error_status(UpstreamError(ErrorInfo(kind="unavailable", message="busy")))
    assert status == 503 and headers == {"retry-after": "1"}
    assert error_status(UpstreamError(ErrorInfo(kind="weird", message="?")))[0] == 500  # a newer peer's kind


def test_every_kind_any_producer_can_send_is_mapped() -> None:
    """Producers send ``ErrorInfo.of(exc)``, so the kinds on the wire are the tree's classes' kinds:
    each class has its own deliberate entry, and no two classes share a kind."""
    classes = error_classes()
    assert {c.__module__ for c in classes} >= {"pdserve.errors", "pdserve.router.api.errors"}
    unmapped = [c.__name__ for c in classes if c not in ERROR_MAP]
    assert not unmapped, f"no entry in router.api.errors.ERROR_MAP for {unmapped}"
    kinds = [c.kind for c in classes]
    assert len(kinds) == len(set(kinds)), kinds
    for c in classes:
        assert class_of_kind(c.kind) is c


def test_no_producer_builds_an_error_info_by_hand() -> None:
    """ErrorInfo is made in one place (ErrorInfo.of); literal codes or kinds elsewhere would drift."""
    package = Path(pdserve.__file__).parent
    for path in package.rglob("*.py"):
        text = path.read_text()
        hits = [n for n in re.findall(r"ErrorInfo\((?!\))", text)]
        if path.name != "outbox_messages.py":
            assert not hits, f"{path} builds ErrorInfo(...) directly; use ErrorInfo.of(exc)"


def test_foreign_exceptions_are_500_without_their_text() -> None:
    status, body, _ = error_status(KeyError("secret internals"))
    assert status == 500 and "secret" not in body["error"]["message"]


def test_error_event_is_one_sse_event() -> None:
    event = error_event(ErrorInfo.of(InstanceLostError("instance d0 stopped responding")))
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert b'"status":503' in event and b"instance d0 stopped responding" in event


# -- over HTTP -------------------------------------------------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "text"),
    [
        ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
        ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages", "messages is required"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", "messages"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "non-empty"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages[0].role", "required"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": 5}]}',
            400,
            "messages[0].content",
            "a string or a list",
        ),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens", "integer"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens", "integer"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens", ">= 1"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 2.5}', 400, "temperature", "<= 2.0"),
        ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature", "number"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p", "top_p"),
        ("/v1/completions", b'{"prompt": "x", "stop": 3}', 400, "stop", "a string or a list of strings"),
        ("/v1/completions", b'{"prompt": 3}', 400, "prompt", "list of token ids"),
        ("/v1/completions", b'{"prompt": [5, 18446744073709551616]}', 400, "prompt", "token ids must be in"),
        ("/v1/completions", b'{"prompt": [5, -1]}', 400, "prompt", "token ids must be in"),
        (
            "/v1/completions",
            b'{"prompt": "x", "stop": "' + b"s" * 257 + b'"}',
            400,
            "stop",
            "at most 256 characters",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "stop": ["a", "' + b"s" * 100_000 + b'"]}',
            400,
            "stop",
            "at most 256 characters, got 100000",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "stop": ["s"' + b', "s"' * 1024 + b"]}",
            400,
            "stop",
            "at most 1024 stop strings are allowed, got 1025",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "stop_token_ids": [' + b"1," * 256 + b"1]}",
            400,
            "stop_token_ids",
            "at most 256",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "stop_token_ids": [4294967296]}',
            400,
            "stop_token_ids",
            "<= 2147483647",
        ),
        (
            "/v1/completions",
            b'{"prompt": ["a", [1]]}',
            400,
            "prompt",
            "a list of strings, a list of token ids",
        ),
        ("/v1/completions", b'{"prompt": [[1], []]}', 400, "prompt", "must not be empty"),
        (
            "/v1/completions",
            b'{"prompt": ["a", "b", "c", "d", "e"], "n": 13}',
            400,
            "prompt",
            "at most 64 choices (prompts x n), got 5 prompts x n = 13",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "best_of": 2}',
            400,
            "best_of",
            "best_of must equal n (1), got 2",
        ),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias", "<= 100"),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"a": 1}}', 400, "logit_bias", "token ids"),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": true}}', 400, "logit_bias.1", "number"),
        (
            "/v1/completions",
            b'{"prompt": "x", "frobnicate": 1}',
            400,
            "frobnicate",
            "unknown field frobnicate",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "stream_options": {"x": 1}}',
            400,
            "stream_options.x",
            "unknown field",
        ),
        ("/v1/completions", b'{"prompt": "x", "n": 100}', 400, "n", "between 1 and 16"),
        ("/v1/completions", b'{"prompt": "x", "logprobs": 30}', 400, "logprobs", "<= 20"),
        (
            "/v1/completions",
            b'{"prompt": "x", "echo": true, "logprobs": 21}',
            400,
            "logprobs",
            "logprobs must be <= 20",
        ),
        (
            "/v1/completions",
            b'{"prompt": "x", "prompt_logprobs": 21}',
            400,
            "prompt_logprobs",
            "prompt_logprobs must be <= 20",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1}',
            400,
            "prompt_logprobs",
            "prompt_logprobs must be >= 0",
        ),
        ("/v1/completions", b'{"prompt": "x", "prompt_logprobs": true}', 400, "prompt_logprobs", "integer"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", "must be >= 1"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt", "prompt is required"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
            400,
            "max_completion_tokens",
            "max_completion_tokens must be >= 1",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
            400,
            "top_logprobs",
            "requires logprobs",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
            400,
            "top_logprobs",
            "top_logprobs must be <= 20",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "min_tokens": 5, "max_tokens": 2}',
            400,
            "min_tokens",
            "must not exceed",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            "messages[0].content",
            "text only",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
            b'{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}',
            400,
            "messages[0].content",
            "the model takes text only",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "colour": 1}]}]}',
            400,
            "messages[0].content[0].colour",
            "unknown field",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
            400,
            "messages[0].content[0].text",
            "needs its text",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x", "mood": "?"}]}',
            400,
            "messages[0].mood",
            "unknown field",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "assistant", "content": null, "function_call": '
            b'{"name": "f", "arguments": "{}"}}]}',
            400,
            "messages[0].function_call",
            "use tool_calls",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "guided_grammar": "root ::= x"}',
            400,
            "guided_grammar",
            "takes no grammars",
        ),
    ],
)
def test_invalid_bodies(
    redis_url: str,
    redis_client: redis.Redis,
    path: str,
    body: bytes,
    status: int,
    param: str | None,
    text: str,
) -> None:
    async def main() -> httpx.Response:
        async with router(redis_url) as client:
            return await client.post(path, content=body, headers={"x-request-id": "req-1"})

    resp = run(main())
    assert resp.status_code == status, resp.text
    assert resp.headers["x-request-id"] == "req-1"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert text in error["message"]


def test_stop_limits_are_the_router_settings(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(
            redis_url, max_stop_strings=2, max_stop_string_len=4, max_stop_token_ids=1
        ) as client:
            for body, param, text in (
                ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop", "at most 2 stop strings"),
                ({"prompt": "x", "stop": "abcde"}, "stop", "at most 4 characters, got 5"),
                ({"prompt": "x", "stop_token_ids": [1, 2]}, "stop_token_ids", "at most 1 stop_token_ids"),
            ):
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 400, resp.text
                assert resp.json()["error"]["param"] == param and text in resp.json()["error"]["message"]
            # within the limits the request gets past validation (to routing: nothing is registered)
            ok = {"prompt": "x", "stop": ["a", "abcd"], "stop_token_ids": [1]}
            assert (await client.post("/v1/completions", json=ok)).status_code == 503

    run(main())


def test_routing_errors(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            # nothing registered: 503 with Retry-After
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["type"] == "service_unavailable"
            assert "no inference instance" in resp.json()["error"]["message"]
            async with redis_conn(redis_url) as r:
                workers = [
                    await FakeWorker(r, info, silent).start()
                    for info in (
                        instance("p0", "prefill"),
                        instance("q0", "decode", model="other", draining=True),
                    )
                ]
                await asyncio.sleep(0.1)  # the live set is cached for 50 ms in tests
                # unknown model: 404 model_not_found
                resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
                assert resp.status_code == 404
                assert resp.json()["error"] == {
                    "message": "The model `gpt-9` does not exist or is not served by any live instance.",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
                # only a prefill instance: 503 saying so
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert (
                    resp.status_code == 503
                    and "no decode or mixed instance" in resp.json()["error"]["message"]
                )
                # every instance draining: 503
                resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
                assert resp.status_code == 503 and "draining" in resp.json()["error"]["message"]
                # several models and none named: 400 param model
                resp = await client.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
                for w in workers:
                    await w.stop()

    run(main())


def test_request_ids(redis_url: str, redis_client: redis.Redis) -> None:
    """The client's x-request-id is checked and echoed, never used to route: the same id twice at
    once gets two independent answers."""

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), answer).start()
            bad = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "x" * 200})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"
            same = {"x-request-id": "same"}
            first, second = await asyncio.gather(
                client.post("/v1/chat/completions", json=CHAT, headers=same),
                client.post("/v1/chat/completions", json=CHAT, headers=same),
            )
            assert first.status_code == second.status_code == 200, (first.text, second.text)
            assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same"
            routed = {m.request_id for m in worker.requests()}
            assert len(routed) == 2 and "same" not in routed  # two router-owned ids
            assert {first.json()["id"], second.json()["id"]} == {f"chatcmpl-{i}" for i in routed}
            await worker.stop()

    run(main())


def test_http_errors_in_openai_shape(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            resp = await client.get("/v1/nothing-here")
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
            resp = await client.get("/v1/chat/completions")
            assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"
            assert "x-request-id" in resp.headers

    run(main())


def test_oversized_bodies_are_413(redis_url: str, redis_client: redis.Redis) -> None:
    limit = 4096
    big = b'{"prompt": "' + b"x" * (2 * limit) + b'"}'

    async def chunks():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async def main() -> None:
        async with router(redis_url, max_body_bytes=limit) as client:
            resp = await client.post("/v1/completions", content=big)  # Content-Length says so
            assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
            resp = await client.post("/v1/completions", content=chunks())  # chunked: counted while reading
            assert resp.status_code == 413
        async with served_router(redis_url, max_body_bytes=limit) as client:  # a real server, real chunks
            resp = await client.post("/v1/completions", content=chunks())
            assert resp.request.headers["transfer-encoding"] == "chunked"
            assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"
            ok = await client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": -1}')
            assert ok.status_code == 400  # a small body still reaches validation

    run(main())
