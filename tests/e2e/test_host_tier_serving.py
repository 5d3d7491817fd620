"""The host tier end to end (real workers, routers and Redis): a prompt whose prefix the pool evicted
is served from the host tier with the tokens and logprobs of its cold miss, bit for bit, in a mixed
stack and through a splitwise (P/D) stack; the registrations count the read-backs."""

from __future__ import annotations

import random
import time

import pytest
import redis

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.models.model_config import ModelConfig
from pdserve.scheduler import Keys
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.registration import InstanceInfo
from pdserve.stack import Stack
from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(300)

BS = 16


def start(tiny_model_dir, redis_url: str, **counts) -> Stack:
    """A stack whose workers have a 40-block pool and a host tier of 64 blocks."""
    host = 64 * block_bytes(ModelConfig.from_dir(tiny_model_dir), BS)
    engine = EngineConfig(num_blocks=40, max_model_len=1024, threads=1, max_num_seqs=2, kv_host_bytes=host)
    return start_stack(tiny_model_dir, redis_url, engine=engine, **counts)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


def complete(stack: Stack, prompt: list[int]) -> tuple[list[str], list[float], int]:
    """Greedy tokens and their logprobs, and the cached tokens the usage reports."""
    r = client(stack).completions.create(
        model=model_name(stack), prompt=prompt, max_tokens=6, temperature=0, logprobs=1
    )
    lp = r.choices[0].logprobs
    return lp.tokens, lp.token_logprobs, r.usage.prompt_tokens_details.cached_tokens


def tiers(redis_url: str, cluster: str) -> dict[str, InstanceInfo]:
    keys = Keys(cluster)
    with redis.Redis.from_url(redis_url) as r:
        return {
            i.decode(): decode_as(InstanceInfo, r.get(keys.instance(i.decode())))
            for i in r.zrange(keys.instances, 0, -1)
        }


def served_from_the_tier(stack: Stack, redis_url: str) -> None:
    prompt = ids(1, 10 * BS) + ids(2, 7)
    cold = complete(stack, prompt)
    assert cold[2] == 0
    for i in range(4):  # 4 x 11 blocks through a 39-block pool: the prompt's blocks are evicted
        complete(stack, ids(100 + i, 10 * BS + 3))
    warm = complete(stack, prompt)
    assert warm[:2] == cold[:2]  # the same tokens and logprobs, bit for bit
    assert warm[2] == 10 * BS  # every full block came back: from the pool or the tier
    deadline = time.monotonic() + 5
    while not any(i.tier and i.tier.hits for i in tiers(redis_url, stack.spec.cluster).values()):
        assert time.monotonic() < deadline, tiers(redis_url, stack.spec.cluster)
        time.sleep(0.2)
    for info in tiers(redis_url, stack.spec.cluster).values():
        assert info.tier is not None and info.tier.corrupt == 0


def test_a_mixed_instance_serves_an_evicted_prefix_from_its_host_tier(tiny_model_dir, redis_url) -> None:
    stack = start(tiny_model_dir, redis_url, mixed=1)
    try:
        served_from_the_tier(stack, redis_url)
    finally:
        assert stack.stop(grace_s=15) == []


def test_a_prefill_instance_serves_an_evicted_prefix_from_its_host_tier(tiny_model_dir, redis_url) -> None:
    stack = start(tiny_model_dir, redis_url, prefill=1, decode=1)
    try:
        served_from_the_tier(stack, redis_url)
    finally:
        assert stack.stop(grace_s=15) == []
