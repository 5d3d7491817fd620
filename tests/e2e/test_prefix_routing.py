"""Prefix routing end to end: real workers publish their caches to the prefix index, any router sends a
chat's next turn where its prefix is cached, decode keeps what it holds and prefill writes only the
missing blocks, the answer is the uncached answer bit for bit, and a dead instance leaves the index."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest
import redis

from pdserve.scheduler import Keys
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.registration import InstanceInfo, RatesInfo
from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a careful assistant who answers in full sentences. " * 12


def index_size(redis_url: str, cluster: str, instance_id: str) -> int:
    with redis.Redis.from_url(redis_url) as r:
        return r.scard(Keys(cluster).prefix_index(instance_id))


def registration(redis_url: str, cluster: str, instance_id: str) -> InstanceInfo:
    with redis.Redis.from_url(redis_url) as r:
        return decode_as(InstanceInfo, r.get(Keys(cluster).instance(instance_id)))


def measured(rates: RatesInfo | None) -> bool:
    """Whether an instance's registration carries a measured prefill rate and shm transfer rate."""
    if rates is None or rates.prefill_s_per_token is None:
        return False
    return rates.prefill_s_per_token > 0 and rates.transfer_s_per_block.get("shm", 0) > 0


def open_requests(redis_url: str, cluster: str, instance_id: str) -> int:
    """Running + waiting requests as the instance's last heartbeat told every router."""
    info = registration(redis_url, cluster, instance_id)
    return info.load.running + info.load.waiting


def wait_indexed(redis_url: str, cluster: str, *instance_ids: str) -> None:
    """Until the instances published their cached blocks and a heartbeat reported them idle: a
    router that did not serve the last turn sees a finished request as load until then, and one
    request's load outweighs the transfer a cached prefix saves on D."""
    deadline = time.monotonic() + 5
    while not all(
        index_size(redis_url, cluster, i) and not open_requests(redis_url, cluster, i) for i in instance_ids
    ):
        assert time.monotonic() < deadline, "the instances did not publish their cached blocks"
        time.sleep(0.05)


def metric(stack, instance_id: str, name: str) -> float:
    port = next(p for n, p in stack.metrics_ports.items() if instance_id.startswith(n + "-"))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert found, f"{name} not exported"
    return float(found.group(1))


def chat(stack, router: int, messages: list[dict], **extra):
    """A greedy chat turn through router ``router``: the response and how it was routed."""
    raw = client(stack, router).chat.completions.with_raw_response.create(
        model=model_name(stack),
        messages=messages,
        max_tokens=40,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, **extra},
    )
    return raw.parse(), raw.headers


def logprobs(response) -> list[tuple]:
    return [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
        for t in response.choices[0].logprobs.content
    ]


def test_turns_follow_their_prefix_move_only_missing_blocks_and_outlive_their_prefill(
    tiny_model_dir, redis_url
) -> None:
    """Turn 2 goes, through the other router, to the pair that served turn 1 (P reuses the prompt,
    D keeps its blocks and receives only the rest). Then that prefill instance is killed: its index
    entries are gone within one TTL, and turn 3 is served by the other prefill instance, cold, while
    the decode instance still holds the conversation (a hit on D only). Every turn is the uncached
    answer bit for bit (the same turn with a fresh cache_salt matches nothing cached)."""
    stack = start_stack(tiny_model_dir, redis_url, prefill=2, decode=2, routers=2, metrics=True)
    cluster, ttl, block_size = stack.spec.cluster, stack.spec.ttl_s, stack.spec.engine.block_size

    def uncached_equals(messages: list[dict], response) -> None:
        fresh, _ = chat(stack, 1, messages, cache_salt=uuid.uuid4().hex)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert fresh.choices[0].message.content == response.choices[0].message.content
        assert logprobs(fresh) == logprobs(response)

    try:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three rivers."}]
        first, h1 = chat(stack, 0, turn1)
        assert h1["x-pdserve-mode"] == "splitwise"
        p, d = h1["x-pdserve-prefill-instance"], h1["x-pdserve-decode-instance"]
        wait_indexed(redis_url, cluster, p, d)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And three mountains?"},
        ]
        not_sent = metric(stack, p, "pdserve_worker_kv_blocks_not_sent_total")
        received = metric(stack, d, "pdserve_worker_kv_received_bytes_total")
        block_bytes = received / -(-first.usage.prompt_tokens // block_size)  # turn 1 moved every block
        second, h2 = chat(stack, 1, turn2)  # the other router knows the caches from Redis alone
        assert (h2["x-pdserve-prefill-instance"], h2["x-pdserve-decode-instance"]) == (p, d)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= (first.usage.prompt_tokens // block_size) * block_size  # P reused turn 1's prompt
        held = metric(stack, p, "pdserve_worker_kv_blocks_not_sent_total") - not_sent
        assert held >= first.usage.prompt_tokens // block_size  # D kept turn 1's prompt blocks
        moved = metric(stack, d, "pdserve_worker_kv_received_bytes_total") - received
        assert moved == (-(-second.usage.prompt_tokens // block_size) - held) * block_bytes
        uncached_equals(turn2, second)

        wait_indexed(redis_url, cluster, p, d)
        # what P measured of its prefills and its hand-offs, which the routers' costs now use
        deadline = time.monotonic() + 10  # they reach the registration with P's next heartbeat
        while not measured(rates := registration(redis_url, cluster, p).rates):
            assert time.monotonic() < deadline, f"P's registration does not carry its measured rates: {rates}"
            time.sleep(0.1)
        next(proc for name, proc in stack.workers if p.startswith(name + "-")).kill()
        t0 = time.monotonic()
        while index_size(redis_url, cluster, p):
            assert time.monotonic() - t0 < ttl + 0.5, "the dead instance's index outlived its TTL"
            time.sleep(0.05)
        turn3 = [
            *turn2,
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "Which is highest?"},
        ]
        other = next(i for i in stack.instance_ids if i.startswith("prefill-") and i != p)
        not_sent = metric(stack, other, "pdserve_worker_kv_blocks_not_sent_total")
        third, h3 = chat(stack, 0, turn3)
        assert (h3["x-pdserve-prefill-instance"], h3["x-pdserve-decode-instance"]) == (other, d)
        assert third.usage.prompt_tokens_details.cached_tokens == 0  # a cold prefill instance
        held = metric(stack, other, "pdserve_worker_kv_blocks_not_sent_total") - not_sent
        assert held >= second.usage.prompt_tokens // block_size  # ... and D held turn 2's prompt
        uncached_equals(turn3, third)
    finally:
        stack.stop(grace_s=15)
