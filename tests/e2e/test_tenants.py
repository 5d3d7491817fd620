"""Tenants end to end, on a stack of the tiny model with API keys and a batch worker: a key's
prompts are cached for that key only (another key's ``cached_tokens`` is 0 for the same prompt, so
it learns nothing of what was asked before), ``--shared-prefix-cache`` shares them, a batch's lines
run with its owner's salt, and another key gets 404 for a batch and its output."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from pdserve.router import RouterSettings, create_app
from pdserve.stack import Stack
from tests.e2e.test_serving import model_name, start_stack

pytestmark = pytest.mark.timeout(300)

A, B = "tenant-a-" + uuid.uuid4().hex, "tenant-b-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, redis_url) -> Iterator[Stack]:
    stack = start_stack(
        tiny_model_dir, redis_url, mixed=1, batch_workers=1, router_options={"api_key": f"{A},{B}"}
    )
    yield stack
    assert stack.stop(grace_s=15) == []


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.urls[0] + "/v1", api_key=key, max_retries=0, timeout=60)


def prompt() -> str:
    """A prompt no test sent before (a fresh first block), several KV blocks long."""
    return f"{uuid.uuid4().hex}: the quarterly figures of our secret project, in full detail. " * 6


def cached(client: openai.OpenAI, text: str, model: str) -> int:
    usage = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0).usage
    assert usage is not None and usage.prompt_tokens >= 64
    details = usage.prompt_tokens_details
    return details.cached_tokens or 0 if details is not None else 0


def test_a_keys_cached_prompt_is_not_anothers(keyed) -> None:
    model, a, b = model_name(keyed), sdk(keyed, A), sdk(keyed, B)
    text = prompt()
    assert cached(a, text, model) == 0
    assert cached(b, text, model) == 0, "key B found key A's prompt in the cache"
    assert cached(a, text, model) > 0, "key A's own prompt is cached for it"
    assert cached(b, text, model) > 0, "key B's own (second) prompt is cached for it"


def test_shared_prefix_cache_shares_it(keyed, redis_url) -> None:
    """A router of the same cluster with --shared-prefix-cache: key B finds key A's prompt."""
    settings = RouterSettings(
        redis_url=redis_url, cluster=keyed.spec.cluster, api_key=f"{A},{B}", shared_prefix_cache=True
    )
    app = create_app(settings)
    model, text = model_name(keyed), prompt()

    async def main() -> list[int]:
        found = []
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://r", timeout=60) as c:
                for key in (A, B):
                    body = {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0}
                    resp = await c.post(
                        "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                    assert resp.status_code == 200, resp.text
                    found.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        return found

    first, second = asyncio.run(main())
    assert first == 0 and second > 0


def test_a_batch_is_its_keys_and_runs_with_its_salt(keyed) -> None:
    model, a, b = model_name(keyed), sdk(keyed, A), sdk(keyed, B)
    text = prompt()
    line = {
        "custom_id": "one",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0},
    }
    upload = a.files.create(file=("in.jsonl", io.BytesIO(orjson.dumps(line) + b"\n")), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        b.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    batch = a.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = a.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(batch.output_file_id)
    assert batch.id not in [x.id for x in b.batches.list().data]
    [out] = [orjson.loads(x) for x in a.files.content(batch.output_file_id).content.splitlines()]
    assert out["custom_id"] == "one" and out["response"]["status_code"] == 200
    # the line ran as key A: its prompt is cached for A, not for B
    assert cached(b, text, model) == 0, "key B found key A's batch line in the cache"
    assert cached(a, text, model) > 0
