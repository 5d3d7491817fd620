"""The router's prompt ids (pdserve/router/routing/prompt_ids.py) from the tokenizer a worker publishes in a
real Redis: the same ids as the engine's, on SmolLM2-135M and on the tiny model."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from redis_support import outbox_deltas, sync_client
from router_support import FakeWorker, answer, instance, redis_conn, router, run

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.routing.policies import PolicyRequest
from pdserve.router.routing.prompt_ids import PromptTokenizer
from pdserve.scheduler import (
    GenerateRequest,
    InboxMessage,
    Keys,
    RedisSettings,
    Tokenize,
    send_to_inbox,
)
from pdserve.tokenizer import (
    Tokenizer,
    pack_tokenizer_files,
    read_tokenizer_files,
    unpack_tokenizer_files,
)
from pdserve.worker.presence import TOKENIZER_TTL_S
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings
from tests.worker.test_worker_service import ROUTER, router_registered, started

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Answer with one word, naïvely 😀."},
]
TEXT = "The quick brown fox, 42 times. 中文也可以"
CASES: dict[str, dict[str, Any]] = {
    "text": {"text": TEXT},
    "text_without_special_tokens": {"text": TEXT, "add_special_tokens": False},
    "token_ids": {"token_ids": [5, 17, 3, 99, 1]},
    "chat": {"messages": CHAT},
    "chat_without_generation_prompt": {"messages": CHAT, "add_generation_prompt": False},
    "chat_with_special_tokens": {"messages": CHAT, "add_special_tokens": True},
    "chat_with_tools": {"messages": CHAT[1:2], "tools": TOOLS},
}


@pytest.fixture(scope="module")
def models(
    tiny_model_dir: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """SmolLM2, the tiny model, and the tiny model with ``add_bos_token`` (add_special_tokens matters)."""
    bos = tmp_path_factory.mktemp("models") / "tiny-bos"
    shutil.copytree(tiny_model_dir, bos)
    cfg = json.loads((bos / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token="<|endoftext|>")
    (bos / "tokenizer_config.json").write_text(json.dumps(cfg))
    return {"smollm2": smollm2_dir, "tiny": tiny_model_dir, "tiny_bos": bos}


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> dict[str, LLMEngine]:
    return {name: LLMEngine(path, EngineConfig(num_blocks=64)) for name, path in models.items()}


@pytest.fixture
def cluster(redis_url: str):
    name = f"pid{uuid.uuid4().hex[:6]}"
    yield name
    client = sync_client(redis_url)
    for key in client.scan_iter(f"pdserve:*{name}*"):
        client.delete(key)
    client.close()


def worker_settings(
    redis_url: str, cluster: str, model_dir: Path, engine_kind: str = "model"
) -> WorkerSettings:
    return WorkerSettings(
        model_dir=model_dir,
        role="mixed",
        redis_url=redis_url,
        cluster=cluster,
        ttl_s=3.0,
        engine_kind=engine_kind,
        instance_id=f"mixed-{uuid.uuid4().hex[:6]}",
        engine=EngineConfig(num_blocks=64),
    )


async def publish(redis_url: str, cluster: str, model_dir: Path) -> str:
    """Publish ``model_dir``'s tokenizer as a worker does at start; its digest."""
    service = WorkerService(worker_settings(redis_url, cluster, model_dir))
    try:
        await service._publish_tokenizer()
    finally:
        await service.redis.aclose()
    assert service.tokenizer_digest is not None
    return service.tokenizer_digest


def with_router(redis_url: str, cluster: str, fn: Callable[[PromptTokenizer], Any], **options: Any) -> Any:
    async def main() -> Any:
        redis = RedisSettings.from_url(redis_url).connect()
        try:
            return await fn(PromptTokenizer(redis, Keys(cluster), **options))
        finally:
            await redis.aclose()

    return asyncio.run(main())


def reference_ids(tok: Tokenizer, case: dict[str, Any]) -> list[int]:
    """The engine's rule written out step by step (independently of ``Tokenizer.prompt_ids``)."""
    if "token_ids" in case:
        return list(case["token_ids"])
    special = case.get("add_special_tokens")
    if "messages" in case:
        text = tok.apply_chat_template(
            case["messages"],
            add_generation_prompt=case.get("add_generation_prompt", True),
            tools=case.get("tools"),
        )
        return tok.encode(text, add_special_tokens=special is True)
    return tok.encode(case["text"], add_special_tokens=special is not False)


# ------------------------------------------------------------------------------------------------ tokenizer files


@pytest.mark.parametrize("model", ["smollm2", "tiny", "tiny_bos"])
def test_from_files_builds_what_from_dir_builds(models: dict[str, Path], model: str) -> None:
    path = models[model]
    files = read_tokenizer_files(path)
    assert set(files) == {p.name for p in path.iterdir()} & {
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    blob, digest = pack_tokenizer_files(files)
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert pack_tokenizer_files(dict(reversed(files.items()))) == (blob, digest)  # order-free
    assert unpack_tokenizer_files(blob) == files
    a, b = Tokenizer.from_dir(path), Tokenizer.from_files(unpack_tokenizer_files(blob))
    for field in (
        "chat_template",
        "bos_token",
        "eos_token",
        "pad_token",
        "add_bos_token",
        "bos_token_id",
        "eos_token_ids",
        "pad_token_id",
        "generation_defaults",
        "vocab_size",
        "all_special_ids",
    ):
        assert getattr(a, field) == getattr(b, field), field
    assert a.raw.to_str() == b.raw.to_str()
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert b.eos_token_ids == (eos if isinstance(eos, list) else [eos])  # generation_config.json's
    for case in CASES.values():
        assert a.prompt_ids(
            case.get("text"),
            case.get("messages"),
            case.get("token_ids"),
            case.get("tools"),
            add_special_tokens=case.get("add_special_tokens"),
            add_generation_prompt=case.get("add_generation_prompt", True),
        ) == reference_ids(b, case)


def test_a_standalone_chat_template_travels_in_the_blob(model_copy: Path) -> None:
    """A template saved as chat_template.jinja (newer transformers) is published and used."""
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    (model_copy / "chat_template.jinja").write_text(
        "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    )
    del cfg["chat_template"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    files = unpack_tokenizer_files(pack_tokenizer_files(read_tokenizer_files(model_copy))[0])
    assert "chat_template.jinja" in files
    tok = Tokenizer.from_files(files)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"


# ------------------------------------------------------------------------------------------------ router ids


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", ["smollm2", "tiny", "tiny_bos"])
def test_router_ids_are_the_engines_ids(
    redis_url: str,
    cluster: str,
    models: dict[str, Path],
    engines: dict[str, LLMEngine],
    model: str,
    case: str,
) -> None:
    spec = CASES[case]
    digest = asyncio.run(publish(redis_url, cluster, models[model]))
    request = PolicyRequest(
        model,
        text=spec.get("text"),
        token_ids=spec.get("token_ids"),
        messages=spec.get("messages"),
        tools=spec.get("tools"),
        add_special_tokens=spec.get("add_special_tokens"),
        add_generation_prompt=spec.get("add_generation_prompt", True),
    )
    ids = with_router(redis_url, cluster, lambda router: router.token_ids(digest, request))
    engine = engines[model]
    expected = engine.prompt_ids(
        spec.get("text"),
        spec.get("messages"),
        spec.get("token_ids"),
        spec.get("tools"),
        add_special_tokens=spec.get("add_special_tokens"),
        add_generation_prompt=spec.get("add_generation_prompt", True),
    )
    assert ids == expected == reference_ids(engine.tokenizer, spec)
    assert ids


def test_the_options_change_the_ids(models: dict[str, Path]) -> None:
    """The cases above are not all alike: each option changes the ids where the model lets it."""
    tok = Tokenizer.from_dir(models["tiny_bos"])
    ids = {name: tuple(reference_ids(tok, case)) for name, case in CASES.items()}
    assert len(set(ids.values())) == len(ids), ids


def test_a_long_prompt_is_tokenized_on_a_thread_at_a_lower_priority(
    redis_url: str, cluster: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prompt is tokenized inline; a long one on a preparation thread of the router's,
    --prepare-nice (10) nicer than the router's own threads (0: as nice as they are)."""
    import os
    import threading

    digest = asyncio.run(publish(redis_url, cluster, models["smollm2"]))
    seen: list[tuple[str, int]] = []
    prompt_ids = Tokenizer.prompt_ids

    def spy(self: Tokenizer, *args: Any, **kwargs: Any) -> list[int]:
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen.append((threading.current_thread().name, niceness))
        return prompt_ids(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "prompt_ids", spy)
    tok = Tokenizer.from_dir(models["smollm2"])
    chat = [{"role": "user", "content": "x " * 3000}]

    async def ids(router: PromptTokenizer) -> tuple[list[int] | None, list[int] | None]:
        await router.tokenizer(digest)  # fetched (the build runs on a thread)
        seen.clear()
        short = await router.token_ids(digest, PolicyRequest("m", text="short"))
        long = await router.token_ids(digest, PolicyRequest("m", messages=chat))
        return short, long

    base = os.getpriority(os.PRIO_PROCESS, 0)
    short, long = with_router(redis_url, cluster, ids)
    assert short == tok.encode("short") and long == prompt_ids(tok, messages=chat)
    assert seen[0] == (threading.main_thread().name, base)
    assert seen[1][0].startswith("prompt-ids") and seen[1][1] == min(19, base + 10), seen
    seen.clear()
    with_router(redis_url, cluster, ids, nice=0)
    assert seen[1][0].startswith("prompt-ids") and seen[1][1] == base, seen


def test_the_router_places_a_chat_with_what_the_worker_tokenizes_it_with(
    redis_url: str, redis_client: redis_sync.Redis
) -> None:
    """The policies' request carries the chat's tools and the worker's defaults for a generate."""
    seen: list[tuple[GenerateRequest, PolicyRequest]] = []

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            generations = client.app.state.router.dispatcher.generations  # type: ignore[attr-defined]

            async def record(worker: FakeWorker, msg: InboxMessage) -> None:
                if isinstance(msg, GenerateRequest):
                    seen.append((msg, generations[msg.request_id].policy_request))
                await answer(worker, msg)

            worker = await FakeWorker(r, instance("m0"), record).start()
            try:
                body = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 2}
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
            finally:
                await worker.stop()

    run(main())
    [(msg, request)] = seen
    assert msg.tools and request.tools == msg.tools
    assert request.messages == msg.messages
    assert (request.text, request.token_ids) == (None, None)
    assert (request.add_special_tokens, request.add_generation_prompt, request.cache_salt) == (
        None,
        True,
        None,
    )


# ------------------------------------------------------------------------------------------------ fetching


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_missing_tokenizer_gives_none_then_ids_once_published(
    redis_url: str, cluster: str, tiny_model_dir: Path
) -> None:
    _, digest = pack_tokenizer_files(read_tokenizer_files(tiny_model_dir))
    request = PolicyRequest("tiny", text=TEXT)
    clock = FakeClock()

    async def main(router: PromptTokenizer) -> None:
        assert await router.token_ids(digest, request) is None  # not published: one GET
        assert await router.token_ids(digest, request) is None  # within retry_after_s: no GET
        assert router.fetches == 1
        assert await publish(redis_url, cluster, tiny_model_dir) == digest
        assert await router.token_ids(digest, request) is None  # still waiting to retry
        clock.now += 5.0
        assert await router.token_ids(digest, request) == Tokenizer.from_dir(tiny_model_dir).encode(TEXT)
        assert router.fetches == 2
        await router.redis.delete(router.keys.tokenizer(digest))
        assert await router.token_ids(digest, request) is not None  # kept: no GET per request
        assert router.fetches == 2

    with_router(redis_url, cluster, main, clock=clock, retry_after_s=5.0)


def test_concurrent_first_requests_share_one_fetch(redis_url: str, cluster: str, smollm2_dir: Path) -> None:
    digest = asyncio.run(publish(redis_url, cluster, smollm2_dir))
    requests = [
        PolicyRequest("m", messages=[{"role": "user", "content": f"question {i}"}]) for i in range(20)
    ]

    async def main(router: PromptTokenizer) -> list[list[int] | None]:
        got = await asyncio.gather(*(router.token_ids(digest, r) for r in requests))
        assert router.fetches == 1
        return got

    got = with_router(redis_url, cluster, main)
    tok = Tokenizer.from_dir(smollm2_dir)
    assert got == [tok.prompt_ids(messages=r.messages) for r in requests]


def test_the_cache_keeps_only_the_latest_tokenizers(
    redis_url: str, cluster: str, tiny_model_dir: Path, smollm2_dir: Path
) -> None:
    async def main(router: PromptTokenizer) -> None:
        tiny = await publish(redis_url, cluster, tiny_model_dir)
        smol = await publish(redis_url, cluster, smollm2_dir)
        request = PolicyRequest("m", text=TEXT)
        for digest in (tiny, tiny, smol, smol, tiny):
            assert await router.token_ids(digest, request)
        assert router.fetches == 3  # tiny, smol, tiny again (dropped when smol came)

    with_router(redis_url, cluster, main, max_tokenizers=1)


def test_what_cannot_be_tokenized_gives_none(redis_url: str, cluster: str, tiny_model_dir: Path) -> None:
    client = sync_client(redis_url)
    blob, digest = pack_tokenizer_files(read_tokenizer_files(tiny_model_dir))
    forged = "0" * 32
    client.set(Keys(cluster).tokenizer(forged), blob)  # a value that is not its digest's
    client.close()

    async def main(router: PromptTokenizer) -> None:
        await publish(redis_url, cluster, tiny_model_dir)
        bad_role = PolicyRequest("tiny", messages=[{"role": "function", "content": "x"}])
        assert await router.token_ids(digest, bad_role) is None  # the template raises
        assert await router.token_ids(None, PolicyRequest("tiny", text="hi")) is None  # no digest
        assert await router.token_ids(digest, PolicyRequest("tiny")) is None  # no prompt
        assert await router.token_ids(forged, PolicyRequest("tiny", text="hi")) is None
        assert await router.token_ids(None, PolicyRequest("tiny", token_ids=[3, 4])) == [3, 4]
        assert await router.token_ids(digest, PolicyRequest("tiny", text="hi"))

    with_router(redis_url, cluster, main)


# ------------------------------------------------------------------------------------------------ the worker


async def worker_tokenize(redis, keys: Keys, instance_id: str, messages: list[dict[str, Any]]) -> list[int]:
    """The worker's own ids for a chat (``POST /tokenize``'s message), from the router's outbox."""
    request_id = uuid.uuid4().hex
    msg = Tokenize(request_id=request_id, router_id=ROUTER, deadline=time.time() + 30, messages=messages)
    await send_to_inbox(redis, keys, instance_id, msg)
    async for delta in outbox_deltas(redis, keys.outbox(ROUTER), request_id):
        assert delta.error is None, delta.error
        return delta.token_ids
    raise AssertionError("the worker did not answer the tokenize")


def test_a_started_worker_registers_the_digest_of_its_published_tokenizer(
    redis_url: str, cluster: str, tiny_model_dir: Path
) -> None:
    """A worker with a model publishes its tokenizer before registering; the router's ids for a chat
    are the worker's. The echo engine (its ids are not its tokenizer's) publishes none."""

    async def main() -> None:
        redis, keys = await router_registered(redis_url, cluster)
        service = WorkerService(worker_settings(redis_url, cluster, tiny_model_dir))
        task = await started(service)
        try:
            info = await service.registry.get(service.id)
            assert info is not None and info.tokenizer is not None
            key = keys.tokenizer(info.tokenizer)
            assert TOKENIZER_TTL_S - 60 < await redis.ttl(key) <= TOKENIZER_TTL_S
            router = PromptTokenizer(redis, keys)
            request = PolicyRequest("tiny", messages=CHAT)
            assert await router.token_ids(info.tokenizer, request) == await worker_tokenize(
                redis, keys, service.id, CHAT
            )
            await redis.delete(key)  # lost (Redis restarted): the next renewal publishes it again
            await service._renew_tokenizer()
            assert await redis.exists(key)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        echo = WorkerService(worker_settings(redis_url, cluster, tiny_model_dir, engine_kind="echo"))
        task = await started(echo)
        try:
            info = await echo.registry.get(echo.id)
            assert info is not None and info.tokenizer is None
        finally:
            echo.begin_drain()
            await asyncio.wait_for(task, 30)
            await redis.aclose()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ speed
