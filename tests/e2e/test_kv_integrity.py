"""KV integrity through a whole stack. A prefill instance whose every hand-off carries one byte
flipped in transit (the test hook ``kv_flip_in_transit``) still answers every request with the
text an undisturbed stack gives: the decode instance catches each corrupted hand-off by its
digests, decodes nothing from it, and the router moves the request on (it recomputes prompt + the
prefill's first token), while ``pdserve status`` and the metrics count what was caught. A block
corrupted after its check (``kv_corrupt_after_check``) is caught by shadow verification
(``--verify-fraction``), which finds nothing in undisturbed traffic."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.status_read import collect
from pdserve.status_table import render
from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"integrity check {i}: " + "a stream of words " * (1 + i % 5) for i in range(12)]
ASK = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


def texts(stack) -> list[str]:
    c = client(stack)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(
            pool.map(
                lambda p: c.completions.create(model=model_name(stack), prompt=p, **ASK).choices[0].text,
                PROMPTS,
            )
        )


def test_a_hand_off_corrupted_in_transit_is_retried_to_the_undisturbed_text(
    tiny_model_dir, redis_url, monkeypatch
) -> None:
    clean = start_stack(tiny_model_dir, redis_url, mixed=1)
    try:
        reference = texts(clean)
    finally:
        clean.stop(grace_s=15)
    monkeypatch.setenv("PDSERVE_TEST_FAULTS", "kv_flip_in_transit=1,seed=11")
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1)
    try:
        assert texts(stack) == reference
        instances = httpx.get(stack.urls[0] + "/v1/instances").json()
        assert instances["migrations"] == len(PROMPTS)  # each caught hand-off moved on once
        deadline = time.monotonic() + 10
        while True:  # the registration says it with the instance's next heartbeat (every TTL/3)
            status = asyncio.run(collect(redis_url, stack.spec.cluster))
            (decode,) = [i for i in status["instances"] if i["role"] == "decode"]
            if decode["kv_mismatches"] == len(PROMPTS) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert decode["kv_mismatches"] == len(PROMPTS) and decode["kv_checked"] == len(PROMPTS)
        assert f"KV checksum mismatches: {len(PROMPTS)} ({decode['id']}: {len(PROMPTS)})" in render(status)
    finally:
        stack.stop(grace_s=15)


def verify_counts(stack) -> dict[str, float]:
    """The router's ``pdserve_verify_total`` by outcome."""
    text = httpx.get(stack.urls[0] + "/metrics").text
    return {
        s.labels["outcome"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "pdserve_verify"
        for s in f.samples
        if s.name == "pdserve_verify_total"
    }


def replays_done(stack, at_least: int, timeout_s: float = 60) -> dict[str, float]:
    """The counts once ``at_least`` replays have a verdict (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = verify_counts(stack)
        if counts.get("match", 0) + counts.get("mismatch", 0) >= at_least or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_shadow_verification_catches_a_block_corrupted_after_its_check(
    tiny_model_dir, redis_url, monkeypatch
) -> None:
    """The decode instance overwrites one received block after its checksum passed (the test hook
    ``kv_corrupt_after_check``, an engine bug the digests cannot see): with --verify-fraction 0.2
    the router reports a mismatch within 50 requests, says where, and pdserve status shows it."""
    monkeypatch.setenv("PDSERVE_TEST_FAULTS", "kv_corrupt_after_check=1,seed=5")
    stack = start_stack(
        tiny_model_dir, redis_url, prefill=1, decode=1, router_options={"verify_fraction": 0.2}
    )
    try:
        c = client(stack)
        for i in range(50):
            c.completions.create(
                model=model_name(stack), prompt=f"verify me {i}: " + "words " * (i % 7), **ASK
            )
        counts = replays_done(stack, at_least=1)
        assert counts.get("mismatch", 0) >= 1, counts
        deadline = time.monotonic() + 10
        while "shadow verification" not in (
            text := render(asyncio.run(collect(redis_url, stack.spec.cluster)))
        ):
            assert time.monotonic() < deadline, text  # the router's next heartbeat carries it
            time.sleep(0.2)
        assert "mismatch(es)" in text and "last mismatch: request " in text and "replayed" in text
    finally:
        stack.stop(grace_s=15)


@pytest.mark.slow
def test_shadow_verification_finds_nothing_in_500_undisturbed_requests(tiny_model_dir, redis_url) -> None:
    """Batch-invariant mode (the tests' MKL_CBWR=AUTO,STRICT), greedy and seeded and unseeded random
    sampling, 8 at a time: 0 mismatches, every sampled request that got a verdict matched bitwise."""
    stack = start_stack(
        tiny_model_dir, redis_url, prefill=1, decode=1, router_options={"verify_fraction": 0.2}
    )
    try:
        c = client(stack)

        def ask(i: int) -> None:
            sampling = {"temperature": 0} if i % 3 == 0 else {"temperature": 0.8, "top_p": 0.9}
            if i % 3 == 1:
                sampling["seed"] = i
            c.completions.create(
                model=model_name(stack),
                prompt=f"request {i}: " + "some text " * (i % 9),
                max_tokens=8,
                **sampling,
            )

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, range(500)))
        counts = replays_done(stack, at_least=60)
        assert counts.get("mismatch", 0) == 0, counts
        assert counts.get("match", 0) >= 60, counts  # about 100 sampled: most got a verdict
    finally:
        stack.stop(grace_s=15)
