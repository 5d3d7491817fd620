"""Peer fetch end to end (real workers, routers and Redis, the tiny model): the router picks an
instance that lacks a prompt's prefix and has it fetch the blocks from the instance holding them
(its metrics say ``source="peer"``); the answer is the cold miss's tokens and logprobs, bit for bit,
in a mixed stack and through splitwise (a prefill instance fetching what its decode instance
holds). With a byte flipped in every transfer (the test hook) the fetch is a counted miss, computed,
with the same tokens."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families as parse

from pdserve.engine.config import EngineConfig
from pdserve.scheduler import Keys
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.registration import InstanceInfo
from pdserve.stack import Stack
from tests.e2e.test_host_tier_serving import BS, ids
from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(300)

ENGINE = EngineConfig(num_blocks=64, max_model_len=1024, threads=1, max_num_seqs=4)
PROMPT = ids(21, 10 * BS) + ids(22, 7)


def complete(stack: Stack, prompt: list[int]) -> tuple[list[str], list[float], int, dict[str, str]]:
    """Greedy tokens, their logprobs, the cached tokens the usage reports, and the headers saying
    where it ran."""
    raw = client(stack).completions.with_raw_response.create(
        model=model_name(stack), prompt=prompt, max_tokens=6, temperature=0, logprobs=1
    )
    r = raw.parse()
    lp = r.choices[0].logprobs
    return lp.tokens, lp.token_logprobs, r.usage.prompt_tokens_details.cached_tokens, dict(raw.headers)


def peer_picks(stack: Stack) -> float:
    """The router's picks that counted on a fetch from a peer (``pdserve_route_picks_total``)."""
    text = httpx.get(stack.urls[0] + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in parse(text)
        for s in f.samples
        if s.name == "pdserve_route_picks_total" and s.labels.get("source") == "peer"
    )


def live(redis_url: str, stack: Stack) -> dict[str, InstanceInfo]:
    """The registered instances by id (one whose key just expired left out)."""
    keys = Keys(stack.spec.cluster)
    with redis.Redis.from_url(redis_url) as r:
        ids = [i.decode() for i in r.zrange(keys.instances, 0, -1)]
        values = r.mget([keys.instance(i) for i in ids]) if ids else []
    return {i: decode_as(InstanceInfo, v) for i, v in zip(ids, values) if v is not None}


def routers_view(stack: Stack) -> set[str]:
    """The instances the router routes to now (its cached live set, ``/v1/instances``)."""
    return {i["id"] for i in httpx.get(stack.urls[0] + "/v1/instances", timeout=10).json()["instances"]}


def registration(redis_url: str, stack: Stack, instance_id: str, ready) -> InstanceInfo:
    """``instance_id``'s registration once ``ready(info)`` (its heartbeat carries its counters)."""
    deadline = time.monotonic() + 10
    while True:
        info = live(redis_url, stack).get(instance_id)
        if info is not None and ready(info):
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.2)


@pytest.mark.parametrize("flipped", [False, True], ids=["clean", "flipped"])
def test_a_mixed_instance_fetches_a_busy_peers_prefix(
    tiny_model_dir, redis_url, monkeypatch, flipped
) -> None:
    """Two mixed instances (``--switchable``: their caches shared, their transports open). The one
    that served the prompt is busy with a long stream of it when the prompt comes again: an open
    request there costs more (``--prefix-load-tokens``) than fetching its blocks into the idle one,
    which the router picks with the fetch."""
    if flipped:
        monkeypatch.setenv("PDSERVE_TEST_FAULTS", "kv_flip_in_transit=1,seed=3")
    stack = start_stack(
        tiny_model_dir,
        redis_url,
        engine=ENGINE,
        mixed=2,
        worker_options={"switchable": True},
        router_options={"prefix_load_tokens": 10000.0},
    )
    try:
        cold = complete(stack, PROMPT)
        assert cold[2] == 0
        holder = cold[3]["x-pdserve-decode-instance"]
        stream = client(stack).completions.create(
            model=model_name(stack),
            prompt=PROMPT,
            max_tokens=600,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)  # the stream runs on the holder (its cache hit made it the cheapest)
        assert peer_picks(stack) == 0
        warm = complete(stack, PROMPT)  # the holder is busy: the other instance, fetching
        for _ in chunks:
            pass
        fetcher = warm[3]["x-pdserve-decode-instance"]
        assert fetcher != holder and peer_picks(stack) == 1
        assert warm[:2] == cold[:2]  # the same tokens and logprobs, bit for bit
        got = registration(redis_url, stack, fetcher, lambda i: i.fetch is not None).fetch
        assert got is not None and got.fetches == 1
        if flipped:  # caught, never used: computed
            assert warm[2] == 0 and (got.hits, got.failed, got.mismatches) == (0, 1, 1)
        else:
            assert warm[2] == 10 * BS and (got.hits, got.misses, got.failed) == (10, 0, 0)
            served = registration(redis_url, stack, holder, lambda i: i.fetch is not None).fetch
            assert served is not None and served.served == 10
    finally:
        assert stack.stop(grace_s=15) == []


def test_a_prefill_instance_fetches_what_its_decode_instance_holds(tiny_model_dir, redis_url) -> None:
    """Splitwise with two prefill instances and one decode instance (``--switchable``). The prompt's
    prefill instance leaves; the other one, whose cache never saw the prompt, fetches its prefix
    from the decode instance (which imported it) instead of computing it, and hands back only the
    block the decode instance lacks: the tokens of the cold miss, bit for bit."""
    stack = start_stack(
        tiny_model_dir, redis_url, engine=ENGINE, prefill=2, decode=1, worker_options={"switchable": True}
    )
    try:
        cold = complete(stack, PROMPT)
        assert cold[2] == 0 and cold[3]["x-pdserve-mode"] == "splitwise"
        first = cold[3]["x-pdserve-prefill-instance"]
        (name,) = [n for n, i in stack.instance_of.items() if i == first]
        stack.retire_worker(name)
        deadline = time.monotonic() + 30
        while first in live(redis_url, stack) or first in routers_view(
            stack
        ):  # the router's live set lags Redis's
            assert time.monotonic() < deadline
            time.sleep(0.2)
        warm = complete(stack, PROMPT)
        fetcher = warm[3]["x-pdserve-prefill-instance"]
        assert fetcher != first and warm[3]["x-pdserve-mode"] == "splitwise" and peer_picks(stack) == 1
        assert warm[:2] == cold[:2]  # the same tokens and logprobs, bit for bit
        assert warm[2] == 10 * BS  # the prefill instance's usage: the fetched prefix
        got = registration(redis_url, stack, fetcher, lambda i: i.fetch is not None).fetch
        assert got is not None and (got.fetches, got.hits, got.failed) == (1, 10, 0)
        decode = warm[3]["x-pdserve-decode-instance"]
        assert registration(redis_url, stack, decode, lambda i: i.fetch is not None).fetch.served == 10
    finally:
        assert stack.stop(grace_s=15) == []
