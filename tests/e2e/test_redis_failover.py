"""A Sentinel failover with --redis-wait-replicas fails no stream: the primary is SIGKILLed while
every stream is decoding, a replica is promoted, and the routers and workers carry on on the new
primary. Every stream completes with its undisturbed text, and nothing was retried or migrated (the
router may not: no retry, no migration), so they continued where they were: no gap, no duplicate."""

from __future__ import annotations

import asyncio
import re

import httpx
import orjson
import pytest

from pdserve.localredis.embedded_ha import EmbeddedSentinel
from tests.e2e.test_serving import model_name, start_stack

pytestmark = pytest.mark.timeout(420)

STREAMS = 6
MAX_TOKENS = 320


def counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set) in ``metrics``."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def test_a_sentinel_failover_with_replica_waits_fails_no_stream(tiny_model_dir) -> None:
    sentinel = EmbeddedSentinel(replicas=2)  # WAIT 1 needs a replica left after the promotion
    sentinel.start()
    stack = start_stack(
        tiny_model_dir,
        sentinel.url,
        prefill=1,
        decode=1,
        redis_wait_replicas=1,
        redis_wait_timeout_ms=2000,  # a loaded CI host: replicas may ack late
        router_options={"retry_attempts": 0, "max_migrations": 0},  # carry on, or fail
    )
    url = stack.urls[0] + "/v1/completions"
    body = {"model": model_name(stack), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    prompts = [f"failover {i} " * (2 + i) for i in range(STREAMS)]
    try:
        reference = []
        for p in prompts:
            r = httpx.post(url, json={**body, "prompt": p}, timeout=120)
            assert r.status_code == 200, r.text
            reference.append(r.json()["choices"][0]["text"])

        async def stream(hc: httpx.AsyncClient, i: int, seen: list[int]) -> str:
            """The stream's text, or 'error: <code>' for a refused request or an error event."""
            text = []
            async with hc.stream("POST", url, json={**body, "prompt": prompts[i], "stream": True}) as resp:
                if resp.status_code != 200:
                    return f"error: {resp.status_code} {(await resp.aread())[:200]!r}"
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = orjson.loads(line[6:])
                        if "error" in chunk:
                            return f"error: {chunk['error']['code']} after {seen[i]} events"
                        text.append(chunk["choices"][0]["text"])
                        seen[i] += 1
            return "".join(text)

        async def main() -> tuple[list[str], int]:
            seen = [0] * STREAMS
            async with httpx.AsyncClient(timeout=300) as hc:
                tasks = [asyncio.create_task(stream(hc, i, seen)) for i in range(STREAMS)]
                while min(seen) < 3:  # every stream is decoding
                    assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                    await asyncio.sleep(0.01)
                old = await asyncio.to_thread(sentinel.kill_primary)
                in_flight = sum(not t.done() for t in tasks)
                texts = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            new = await asyncio.to_thread(sentinel.wait_for_failover, old.port, 60)
            assert new.port != old.port
            return texts, in_flight

        texts, in_flight = asyncio.run(main())
        assert in_flight >= STREAMS // 2, f"only {in_flight} streams were in flight at the kill"
        failed = [(i, t[:80]) for i, (t, want) in enumerate(zip(texts, reference)) if t != want]
        assert failed == [], f"{len(failed)} of {STREAMS} streams failed or differ: {failed}"
        metrics = httpx.get(stack.urls[0] + "/metrics", timeout=10).text
        assert re.search(r"^pdserve_migrations_total ", metrics, re.M), metrics[:500]
        assert counter(metrics, "pdserve_retries_total") == 0
        assert counter(metrics, "pdserve_migrations_total") == 0
        assert [p.poll() for _, p in stack.workers + stack.routers] == [None] * 3
        print(f"{in_flight} streams in flight at the kill: all completed, equal to their references")
    finally:
        stack.stop(grace_s=15)
        sentinel.close()
