"""pdserve bench's arithmetic and table, on results it did not measure (the server runs are in
test_serving.py): percentiles, failures by kind, and no S_TTFT section for servers that do not say it."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson

from pdserve.bench import Prompt, Result, one_request, random_prompts, render, stats, summarize
from pdserve.localredis.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_percentiles_are_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    s = stats(values, (80, 99, 99.99))
    assert (s["mean"], s["median"], s["p80"], s["p99"], s["p99.99"]) == (50.5, 50.5, 80.0, 99.0, 100.0)


def test_failures_are_counted_by_kind_and_peers_get_no_s_ttft_row() -> None:
    ok = [
        Result(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4) for _ in range(3)
    ]
    bad = [Result(ok=False, error_kind="no_capacity", error="nothing to serve it") for _ in range(2)]
    summary = summarize(ok + bad, duration=2.0, percentiles=(99,))
    assert (summary["successful_requests"], summary["failed_requests"]) == (3, 2)
    assert summary["errors"] == {"no_capacity": 2} and summary["total_output_tokens"] == 15
    assert summary["output_throughput"] == 7.5
    assert abs(summary["metrics"]["decode_tok_s"]["mean"] - 10.0) < 1e-9  # 4 tokens in 0.4 s
    table = render(summary)
    assert "failed: no_capacity:" in table and "S_TTFT" not in table and "Mean TTFT (ms):" in table


def test_a_stream_gives_its_cached_tokens_and_token_ids() -> None:
    """usage.prompt_tokens_details.cached_tokens and the chunks' return_token_ids come back; a token
    whose text is not whole yet (an empty piece with its id) is the first token all the same."""
    chunks = [
        {"choices": [{"index": 0, "text": "", "token_ids": [7]}]},
        {"choices": [{"index": 0, "text": "ab", "token_ids": [8, 9]}]},
        {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 40,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 32},
            },
        },
    ]
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go() -> Result:
        async with httpx.AsyncClient(transport=transport) as client:
            return await one_request(
                client, "http://x/v1/completions", "m", Prompt({"prompt": [1, 2]}, 3), True
            )

    r = asyncio.run(go())
    assert r.ok and r.token_ids == [7, 8, 9] and r.cached_tokens == 32 and r.prompt_tokens == 40
    assert r.text == "ab" and len(r.itl) == 1 and r.output_tokens == 3


def test_random_prompts_respect_lengths() -> None:
    prompts = random_prompts(20, input_len=50, output_len=8, range_ratio=0.0, chat=True, rng=random.Random(1))
    assert all(
        len(p.body["messages"][0]["content"].split()) == 50 and p.body["max_tokens"] == 8 for p in prompts
    )


def test_against_a_server_without_timing_the_table_has_no_s_ttft(tmp_path) -> None:
    """Any OpenAI-compatible server: here the peers' mock engine (benchmarks/mock_openai_worker.py)."""
    port = free_port()
    mock = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "mock_openai_worker.py"),
            "--port",
            str(port),
            "--model",
            "mock",
        ]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "mock did not start"
                time.sleep(0.2)
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pdserve.cli",
                    "bench",
                    "--base-url",
                    url,
                    "--endpoint",
                    endpoint,
                    "--num-prompts",
                    "6",
                    "--output-len",
                    "5",
                    "--no-progress",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert out.returncode == 0, out.stderr
            assert "Successful requests:                     6" in out.stdout and "S_TTFT" not in out.stdout
            assert "Total generated tokens:                  30" in out.stdout  # the model: from /v1/models
    finally:
        mock.terminate()
        mock.wait(10)


def test_engine_bench_prefill_is_computed_not_found_in_the_prefix_cache(tiny_model_dir) -> None:
    """engine_bench's prefill figure is of prompts the engine computes: a benchmark that sent the
    same prompt again would time a prefix-cache hit (5-10x faster on SmolLM2) and call it prefill."""
    benchmarks = str(ROOT / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        import engine_bench
    finally:
        sys.path.remove(benchmarks)
    res = engine_bench.engine_worker(str(tiny_model_dir), steps=2, prefill_reps=2)
    assert res["prefill_cached_tokens"] == 0
    assert res["prefill_tok_s"] > 0 and res["decode_b32_tok_s"] > 0
