"""End to end: real Redis, real worker processes, real routers, the official `openai` client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

import httpx
import jsonschema
import openai
import orjson
import pytest
import redis

from pdserve.engine.config import EngineConfig
from pdserve.localredis.embedded import free_port
from pdserve.stack import Stack, StackSpec

pytestmark = pytest.mark.timeout(240)

PROMPTS = [
    "Hi",
    "The router picks a prefill and a decode instance from the live set in Redis.",
    "Long prompts are prefilled in chunks so running decodes keep moving. " * 6,
]


def start_stack(tiny_model_dir, redis_url: str, engine: EngineConfig | None = None, **counts) -> Stack:
    """A stack of the tiny model on ``redis_url`` with the given counts (none of each by default),
    its workers' engines ``engine`` (1024 blocks, one thread by default); started and ready."""
    spec = StackSpec(
        model=tiny_model_dir,
        redis_url=redis_url,
        port=free_port(count=counts.get("routers", 1)),
        cluster=f"t{uuid.uuid4().hex[:8]}",
        ttl_s=3.0,
        engine=engine or EngineConfig(num_blocks=1024, max_model_len=1024, threads=1),
        ready_timeout_s=90,
        **{"routers": 1, "prefill": 0, "decode": 0, "mixed": 0, "batch_workers": 0, **counts},
    )
    stack = Stack(spec)
    stack.start()
    try:
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module")
def splitwise(tiny_model_dir, redis_url):
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1)
    yield stack
    assert stack.stop(grace_s=15) == []  # SIGTERM drains and exits


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, redis_url):
    stack = start_stack(tiny_model_dir, redis_url, mixed=1)
    yield stack
    assert stack.stop(grace_s=15) == []


@pytest.fixture(scope="module")
def splitwise_mooncake(tiny_model_dir, redis_url, mooncake_ready):
    """Prefill and decode that offer only mooncake: the KV crosses loopback TCP, not shared memory."""
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1, kv_transfer="mooncake")
    yield stack
    assert stack.stop(grace_s=15) == []


@pytest.fixture(params=["splitwise", "mixed"])
def stack(request) -> Stack:
    return request.getfixturevalue(request.param)


def client(stack: Stack, i: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.urls[i] + "/v1", api_key="none", max_retries=0, timeout=60)


def model_name(stack: Stack) -> str:
    return stack.spec.model.name


# ---- acceptance 2: the OpenAI client, chat and completions, stream and not ------------------------
def test_chat_non_stream(stack) -> None:
    c = client(stack)
    r = c.chat.completions.create(
        model=model_name(stack),
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens > 5  # the chat template was applied
    assert r.choices[0].message.content


def test_chat_stream_with_usage(stack) -> None:
    c = client(stack)
    chunks = list(
        c.chat.completions.create(
            model=model_name(stack),
            messages=[{"role": "user", "content": "Stream please"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10
    assert usage.total_tokens == usage.prompt_tokens + 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    full = c.chat.completions.create(
        model=model_name(stack),
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text == full.choices[0].message.content


def test_completions_stream_and_not(stack) -> None:
    c = client(stack)
    r = c.completions.create(
        model=model_name(stack),
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    streamed = list(
        c.completions.create(
            model=model_name(stack),
            prompt=PROMPTS[1],
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text


def test_stop_and_max_tokens_honoured(stack) -> None:
    c = client(stack)
    base = (
        c.completions.create(
            model=model_name(stack),
            prompt=PROMPTS[0],
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = base[8:11]
    r = c.completions.create(
        model=model_name(stack),
        prompt=PROMPTS[0],
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.usage.completion_tokens < 30


# ---- the OpenAI surface: models.retrieve, prompt forms, echo, logit_bias ----------------------------
def tokenizer(tiny_model_dir):
    from pdserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_model_dir)


def test_models_retrieve_and_usage_details(stack) -> None:
    c = client(stack)
    m = c.models.retrieve(model_name(stack))
    assert (m.id, m.object, m.owned_by) == (model_name(stack), "model", "pdserve")
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"
    r = c.completions.create(model=model_name(stack), prompt=PROMPTS[0], max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(
        c.chat.completions.create(
            model=model_name(stack),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_a_repeated_prompt_reuses_its_cached_prefix(stack) -> None:
    """The prefix cache through the router: a prompt sent again reports the tokens it reused (in
    splitwise the prefill instance's count, carried to the decode instance) and answers the same."""
    c = client(stack)
    prompt = f"{uuid.uuid4().hex} The prefix cache keeps the full blocks of earlier prompts. " * 6
    first, again = (
        c.completions.create(model=model_name(stack), prompt=prompt, max_tokens=8, temperature=0)
        for _ in "12"
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0  # all but the last
    assert again.choices[0].text == first.choices[0].text


def test_every_prompt_form_gives_the_same_choices(stack, tiny_model_dir) -> None:
    """A string, a list of strings, token ids and a list of token-id lists: one choice per prompt
    (n each, index = prompt * n + i), the same greedy text as one prompt per request; usage sums."""
    c, tok = client(stack), tokenizer(tiny_model_dir)
    kw = {"model": model_name(stack), "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    single = [c.completions.create(prompt=p, **kw) for p in PROMPTS[:2]]
    texts = [r.choices[0].text for r in single]
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    for prompt in (PROMPTS[:2], ids):
        r = c.completions.create(prompt=prompt, n=2, **kw)
        assert [(ch.index, ch.text) for ch in r.choices] == [
            (0, texts[0]),
            (1, texts[0]),
            (2, texts[1]),
            (3, texts[1]),
        ]
        assert (
            r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single) == len(ids[0]) + len(ids[1])
        )
        assert r.usage.completion_tokens == 4 * 6
    assert c.completions.create(prompt=ids[1], **kw).choices[0].text == texts[1]
    streamed = c.completions.create(prompt=ids, stream=True, **kw)
    got = {0: "", 1: ""}
    for chunk in streamed:
        got[chunk.choices[0].index] += chunk.choices[0].text
    assert got == {0: texts[0], 1: texts[1]}


def test_echo_puts_the_prompt_before_the_completion(stack, tiny_model_dir) -> None:
    c, tok = client(stack), tokenizer(tiny_model_dir)
    kw = {"model": model_name(stack), "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = c.completions.create(prompt=PROMPTS[1], **kw).choices[0].text
    r = c.completions.create(prompt=PROMPTS[1], echo=True, **kw)
    assert r.choices[0].text == PROMPTS[1] + plain and r.usage.completion_tokens == 5
    ids = tok.encode(PROMPTS[1])
    as_text = tok.decode(ids, skip_special_tokens=False)  # the worker's text of the token ids
    r = c.completions.create(prompt=[ids, ids[:3]], echo=True, **kw)
    assert r.choices[0].text == as_text + plain
    assert r.choices[1].text.startswith(tok.decode(ids[:3], skip_special_tokens=False))
    chunks = list(c.completions.create(prompt=ids, echo=True, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == as_text + plain
    assert chunks[0].choices[0].text.startswith(as_text)
    lp = c.completions.create(prompt=ids, echo=True, logprobs=1, **kw).choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tok.token_text(t) for t in ids]


def test_logit_bias_steers_greedy_output(stack, tiny_model_dir) -> None:
    """+100 on a token makes greedy output only that token (in splitwise the prefill samples the
    first one and the decode the rest: both apply it); -100 bans the token greedy would pick."""
    from pdserve.engine.models.model_config import ModelConfig

    c, tok = client(stack), tokenizer(tiny_model_dir)
    kw = {"model": model_name(stack), "max_tokens": 6, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    base = c.completions.create(prompt=PROMPTS[1], extra_body=extra, **kw).choices[0]
    forced = tok.encode(" the")[-1]
    r = c.completions.create(prompt=PROMPTS[1], logit_bias={str(forced): 100}, extra_body=extra, **kw)
    assert r.choices[0].token_ids == [forced] * 6
    banned = c.completions.create(
        prompt=PROMPTS[1], logit_bias={str(base.token_ids[0]): -100}, extra_body=extra, **kw
    ).choices[0]
    assert banned.token_ids[0] != base.token_ids[0]
    chat = c.chat.completions.create(
        messages=[{"role": "user", "content": "Hello!"}],
        logit_bias={str(forced): 100},
        extra_body=extra,
        **kw,
    )
    assert chat.choices[0].token_ids == [forced] * 6
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(
            prompt="x", logit_bias={str(ModelConfig.from_dir(tiny_model_dir).vocab_size): 1}, **kw
        )
    assert e.value.param == "logit_bias" and "vocabulary" in e.value.message


# ---- acceptance 3: splitwise == mixed == pdserve generate, token for token ------------------------
def test_greedy_tokens_identical_everywhere(splitwise, mixed, tiny_model_dir) -> None:
    def tokens(stack: Stack, prompt: str) -> list[int]:
        body = {
            "model": model_name(stack),
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(stack.urls[0] + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "--log-level",
        "WARNING",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "16",
        "--ignore-eos",
        "--json",
        "--num-blocks",
        "256",
    ]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT"}
    offline = [
        orjson.loads(line)["token_ids"]
        for line in subprocess.run(
            cmd, capture_output=True, text=True, check=True, env=env, timeout=120
        ).stdout.splitlines()
    ]
    for prompt, want in zip(PROMPTS, offline, strict=True):
        assert tokens(splitwise, prompt) == want
        assert tokens(mixed, prompt) == want


def test_prompt_logprobs_identical_splitwise_and_mixed(splitwise, mixed, tiny_model_dir) -> None:
    """lm-eval's loglikelihood request (a batch of token-id prompts, echo, logprobs 1, max_tokens 1:
    prefill ends it) and the same going on to decode, with vLLM's prompt_logprobs: the prefill
    instance scores the prompt in splitwise, the mixed one alone, the same bits (batch-invariant).
    Scoring a greedy continuation gives its tokens the logprobs they were generated with."""
    tok = tokenizer(tiny_model_dir)
    ids = tok.encode(PROMPTS[2])
    gen = {"model": model_name(mixed), "prompt": ids[:12], "max_tokens": 6, "temperature": 0}
    gen |= {"ignore_eos": True, "logprobs": 1, "return_token_ids": True}
    made = httpx.post(mixed.urls[0] + "/v1/completions", json=gen, timeout=60).json()["choices"][0]
    scored = [ids, ids[:12] + made["token_ids"]]
    for max_tokens in (1, 3):
        body = {"model": model_name(mixed), "prompt": scored, "temperature": 0, "max_tokens": max_tokens}
        body |= {"logprobs": 1, "seed": 1234, "echo": True, "prompt_logprobs": 2, "ignore_eos": True}
        resps = [httpx.post(s.urls[0] + "/v1/completions", json=body, timeout=60) for s in (splitwise, mixed)]
        assert [r.headers["x-pdserve-mode"] for r in resps] == ["splitwise", "mixed"]
        got = [r.json() for r in resps]
        assert got[0]["choices"] == got[1]["choices"]  # texts, legacy logprobs, prompt_logprobs: bit for bit
        for prompt, choice in zip(scored, got[0]["choices"], strict=True):
            lp = choice["logprobs"]
            assert (
                len(lp["token_logprobs"])
                == len(prompt) + max_tokens
                == len(choice["prompt_logprobs"]) + max_tokens
            )
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert choice["prompt_logprobs"][0] is None
            for t, entry, logprob in zip(prompt[1:], choice["prompt_logprobs"][1:], lp["token_logprobs"][1:]):
                assert entry[str(t)]["logprob"] == logprob and entry[str(t)]["rank"] >= 1
    tail = got[0]["choices"][1]["logprobs"]
    for i, logprob in enumerate(made["logprobs"]["token_logprobs"]):
        assert tail["token_logprobs"][12 + i] == pytest.approx(logprob, abs=1e-5)
        best = list(tail["top_logprobs"][12 + i])[:1]  # the body's prompt_logprobs (2) set how many
        assert best == list(made["logprobs"]["top_logprobs"][i])


def test_greedy_tokens_identical_over_mooncake(splitwise_mooncake, mixed, redis_url) -> None:
    from pdserve.scheduler import Keys

    stack, keys = splitwise_mooncake, Keys(splitwise_mooncake.spec.cluster)
    prefill_id = next(i for i in stack.instance_ids if i.startswith("prefill"))
    decode_id = next(i for i in stack.instance_ids if i.startswith("decode"))
    r = redis.Redis.from_url(redis_url)
    info = orjson.loads(r.get(keys.member("instance", decode_id)))
    assert info["transfer"]["protocols"] == ["mooncake"] and set(info["transfer"]["endpoint"]) == {"mooncake"}

    def last_added(instance_id: str) -> tuple[int, ...]:
        """The id of the last entry ever added to the inbox (entries are deleted once handled)."""
        key = keys.inbox(instance_id)
        last = r.xinfo_stream(key)["last-generated-id"] if r.exists(key) else b"0-0"
        return tuple(int(part) for part in last.split(b"-"))

    for prompt in PROMPTS:
        before = last_added(prefill_id), last_added(decode_id)
        body = {"model": model_name(stack), "prompt": prompt, "max_tokens": 16, "temperature": 0}
        body |= {"ignore_eos": True, "logprobs": 2}
        got = [
            httpx.post(s.urls[0] + "/v1/completions", json=body, timeout=60).json() for s in (stack, mixed)
        ]
        assert got[0]["choices"][0]["text"] == got[1]["choices"][0]["text"]
        assert got[0]["choices"][0]["logprobs"] == got[1]["choices"][0]["logprobs"]  # batch-invariant bits
        # the prefill instance took the request and the decode instance got its hand-off messages
        assert last_added(prefill_id) > before[0] and last_added(decode_id) > before[1]
    r.close()


def test_the_echo_engine_goes_through_the_whole_hand_off(tiny_model_dir, redis_url) -> None:
    """`--engine echo`: no model, the prompt's tokens cycled, over the same splitwise protocol."""
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1, engine_kind="echo")
    try:
        prompt = [11, 12, 13]
        body = {"model": model_name(stack), "prompt": prompt, "max_tokens": 7, "return_token_ids": True}
        r = httpx.post(stack.urls[0] + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["token_ids"] == [11, 12, 13, 11, 12, 13, 11]
        assert r["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 7,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert r["timing"]["kv_transfer_ms"] is not None  # handed off from P to D
    finally:
        assert stack.stop(grace_s=15) == []


def test_an_idle_instance_starts_a_request_at_once(stack) -> None:
    """A request prepared while the engine is idle is stepped at once: its queue time is the
    hand-over's, not the engine loop's idle poll (a prepared request used to wait up to 0.5 s for it)."""
    body = {"model": model_name(stack), "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0}
    queued = []
    for _ in range(5):
        r = httpx.post(stack.urls[0] + "/v1/completions", json=body, timeout=60).raise_for_status()
        queued.append(r.json()["timing"]["queue_ms"])
        time.sleep(0.6)  # the instance idles again (an idle engine loop polls every 0.5 s)
    assert statistics.median(queued) < 200, queued


def test_responses_carry_the_servers_time_to_first_token(stack) -> None:
    body = {"model": model_name(stack), "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    r = httpx.post(stack.urls[0] + "/v1/completions", json=body, timeout=60)
    timing = r.json()["timing"]
    assert 0 < timing["s_ttft_ms"] < 60_000
    assert float(r.headers["x-pdserve-s-ttft-ms"]) == pytest.approx(timing["s_ttft_ms"], abs=0.001)
    # the phases: the wait in the engine's queue, then the prefill (both inside the server's TTFT)
    assert 0 <= timing["queue_ms"] < timing["s_ttft_ms"] and 0 < timing["prefill_ms"] <= timing["s_ttft_ms"]
    assert float(r.headers["x-pdserve-queue-ms"]) == pytest.approx(timing["queue_ms"], abs=0.001)
    assert float(r.headers["x-pdserve-prefill-ms"]) == pytest.approx(timing["prefill_ms"], abs=0.001)
    assert ("x-pdserve-kv-transfer-ms" in r.headers) == (stack.spec.prefill > 0)
    mode = "splitwise" if stack.spec.prefill > 0 else "mixed"
    assert r.headers["x-pdserve-mode"] == mode and r.headers["x-pdserve-decode-instance"].startswith(
        ("decode", "mixed")
    )
    splitwise = stack.spec.prefill > 0
    assert (timing["kv_transfer_ms"] is not None) == splitwise  # only a hand-off has a KV write
    with httpx.stream(
        "POST", stack.urls[0] + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        chunks = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c.get("timing") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_pdserve_bench_prints_the_table_and_writes_json_and_png(splitwise, tmp_path) -> None:
    result, png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "bench",
        "--base-url",
        splitwise.urls[0],
        "--num-prompts",
        "12",
        "--input-len",
        "24",
        "--output-len",
        "6",
        "--max-concurrency",
        "4",
        "--ignore-eos",
        "--no-progress",
        "--save-result",
        str(result),
        "--plot",
        str(png),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    for line in (
        "Successful requests:                     12",
        "Failed requests:                         0",
        "Mean TTFT (ms):",
        "P99.99 S_TTFT (ms):",
        "Median TPOT (ms):",
        "P80 ITL (ms):",
        "P95 E2E (ms):",
        "Mean Decode:",
    ):
        assert line in out.stdout, out.stdout
    summary = orjson.loads(result.read_text())
    assert summary["successful_requests"] == 12 and summary["total_output_tokens"] == 12 * 6
    assert summary["metrics"]["s_ttft_ms"]["median"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chat = subprocess.run(
        [
            *cmd[:6],
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "4",
            "--no-progress",
            "--output-len",
            "4",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "Successful requests:                     4" in chat.stdout, chat.stdout + chat.stderr


# ---- acceptance 4: routers share nothing but Redis ---------------------------------------------------
def test_two_routers_and_one_dies(tiny_model_dir, redis_url) -> None:
    stack = start_stack(tiny_model_dir, redis_url, routers=2, mixed=1)
    try:
        c0, c1 = client(stack, 0), client(stack, 1)
        ask = {
            "model": model_name(stack),
            "prompt": "two routers",
            "max_tokens": 40,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        expected = c1.completions.create(**ask).choices[0].text
        stream = c1.completions.create(**ask, stream=True)
        first = next(iter(stream))
        stack.routers[0][1].kill()  # router 0 dies while router 1 streams
        stack.routers[0][1].wait()
        rest = "".join(ch.choices[0].text for ch in stream)
        assert first.choices[0].text + rest == expected
        assert c1.completions.create(**ask).choices[0].text == expected
        with pytest.raises(openai.APIConnectionError):
            c0.completions.create(**ask)
    finally:
        assert stack.stop(grace_s=15) == []  # every child still running drains and exits on SIGTERM


def test_the_same_request_id_on_two_routers_gives_two_independent_answers(tiny_model_dir, redis_url) -> None:
    """20 trials: client A to router 0 and client B to router 1 at once, both with the same
    x-request-id and different prompts: each always receives its own reference text (the router's
    own id routes tokens; the client's is only echoed)."""
    stack = start_stack(tiny_model_dir, redis_url, routers=2, prefill=1, decode=1)
    ask = {"model": model_name(stack), "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    prompts = ("the first client asks this", "and the second one something else entirely")
    try:
        url = [u + "/v1/completions" for u in stack.urls]
        reference = [
            httpx.post(url[0], json={**ask, "prompt": p, "stream": False}, timeout=60).json()["choices"][0][
                "text"
            ]
            for p in prompts
        ]
        assert reference[0] != reference[1]

        async def one(hc: httpx.AsyncClient, i: int, rid: str) -> tuple[str, str]:
            async with hc.stream(
                "POST", url[i], json={**ask, "prompt": prompts[i]}, headers={"x-request-id": rid}
            ) as resp:
                assert resp.status_code == 200
                texts = [
                    orjson.loads(line[6:])["choices"][0]["text"]
                    async for line in resp.aiter_lines()
                    if line.startswith("data: {")
                ]
                return resp.headers["x-request-id"], "".join(texts)

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as hc:
                for trial in range(20):
                    rid = f"shared-{trial}"
                    got = await asyncio.gather(one(hc, 0, rid), one(hc, 1, rid))
                    assert got == [(rid, reference[0]), (rid, reference[1])], trial

        asyncio.run(main())
    finally:
        assert stack.stop(grace_s=15) == []


def test_workers_drop_a_dead_routers_work_within_two_ttls(tiny_model_dir, redis_url) -> None:
    """SIGKILL a router with 16 long streams running: once its key has expired (one TTL) and stayed
    missing for one more TTL (one missing read is no proof: Redis may have lost it), the workers
    abort its requests (checked once a second) instead of generating them to the end."""
    stack = start_stack(tiny_model_dir, redis_url, routers=2, mixed=1)
    ask = {
        "model": model_name(stack),
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    ttl = stack.spec.ttl_s

    def running() -> int:
        live = httpx.get(stack.urls[1] + "/v1/instances", timeout=10).json()["instances"]
        return sum(i["load"]["running"] + i["load"]["waiting"] for i in live)

    try:
        started = threading.Event()

        def stream(i: int) -> None:
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream(
                    "POST",
                    stack.urls[0] + "/v1/completions",
                    json={**ask, "prompt": f"long {i}"},
                    timeout=120,
                ) as resp,
            ):
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        started.set()

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.5)
        stack.routers[0][1].kill()
        killed_at = time.monotonic()
        while running() > 0:
            assert time.monotonic() - killed_at < 30, "the dead router's requests kept running"
            time.sleep(0.1)
        dropped_after = time.monotonic() - killed_at
        # the key expires within ttl, is seen missing within a second and for ttl more (checked once a
        # second); heartbeats report load every ttl/3
        assert dropped_after < 2 * ttl + 2.0 + ttl / 3 + 0.5, dropped_after
    finally:
        stack.stop(grace_s=15)


# ---- acceptance 5: dead or silent workers -------------------------------------------------------------
def live_ids(redis_url: str, cluster: str) -> set[str]:
    r = redis.Redis.from_url(redis_url)
    try:
        return {k.decode().rsplit(":", 1)[1] for k in r.scan_iter(f"pdserve:{{{cluster}}}:instance:*")}
    finally:
        r.close()


def test_silent_worker_leaves_live_set_and_gets_no_work(tiny_model_dir, redis_url) -> None:
    stack = start_stack(tiny_model_dir, redis_url, mixed=2)
    try:
        (_, a), _ = stack.workers
        cluster = stack.spec.cluster
        ids = live_ids(redis_url, cluster)
        assert len(ids) == 2
        a.send_signal(signal.SIGSTOP)  # its heartbeat stops
        t0 = time.monotonic()
        while len(live_ids(redis_url, cluster)) == 2:
            assert time.monotonic() - t0 < 3 + 1.5, "the silent instance outlived its TTL"
            time.sleep(0.1)
        time.sleep(1.0)  # routers' live-set cache refresh
        c = client(stack)
        for _ in range(4):  # every request lands on the live instance and completes
            r = c.completions.create(
                model=model_name(stack), prompt="x", max_tokens=3, temperature=0, timeout=20
            )
            assert r.usage.completion_tokens >= 1
        silent = next(i for i in ids if i.startswith(stack.workers[0][0] + "-"))
        r = redis.Redis.from_url(redis_url)
        assert r.xlen(f"pdserve:{cluster}:inbox:{{{silent}}}") == 0  # nothing was sent its way
        r.close()
        a.send_signal(signal.SIGCONT)
    finally:
        assert stack.stop(grace_s=15) == []  # every child still running drains and exits on SIGTERM


def test_sigkill_worker_every_client_gets_an_answer(tiny_model_dir, redis_url) -> None:
    """Kill a prefill and a decode instance while requests are queued and running on them: requests
    with no token yet are retried on the surviving pair, streams that had tokens migrate to the
    surviving decode; every one completes. None hangs."""
    stack = start_stack(tiny_model_dir, redis_url, prefill=2, decode=2)
    ask = {
        "model": model_name(stack),
        "max_tokens": 100,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    try:

        async def plain(i: int, ac: openai.AsyncOpenAI) -> str:
            r = await ac.completions.create(prompt=f"request {i} " * (1 + i % 5), **ask)
            assert r.usage.completion_tokens == 100
            return "ok"

        started: list[int] = []

        async def streamed(i: int, ac: openai.AsyncOpenAI) -> str:
            try:
                stream = await ac.completions.create(prompt=f"stream {i} " * (1 + i % 3), stream=True, **ask)
                async for _ in stream:
                    if i not in started:
                        started.append(i)
            except openai.APIError as e:
                assert e.message
                return "error"
            return "ok"

        async def main() -> tuple[list[str], list[str]]:
            ac = openai.AsyncOpenAI(base_url=stack.urls[0] + "/v1", api_key="none", max_retries=0, timeout=90)
            plains = [asyncio.create_task(plain(i, ac)) for i in range(16)]
            streams = [asyncio.create_task(streamed(i, ac)) for i in range(8)]
            while len(started) < 6:  # streams are running on both decode instances
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient() as hc:  # kill the busiest decode and prefill instance
                live = (await hc.get(stack.urls[0] + "/v1/instances")).json()["instances"]
            for role in ("decode", "prefill"):
                assert any(i["role"] == role for i in live), [(i["id"], i["role"]) for i in live]
                busiest = max((i for i in live if i["role"] == role), key=lambda i: i["in_flight"])
                if role == "decode":  # requests are running on it (prefills may all be done already)
                    assert busiest["in_flight"] > 0
                victim = next(p for name, p in stack.workers if busiest["id"].startswith(name + "-"))
                victim.kill()
            t0 = time.monotonic()
            results = await asyncio.gather(asyncio.gather(*plains), asyncio.gather(*streams))
            assert time.monotonic() - t0 < 60  # none hangs
            await ac.close()
            return results

        plains, streams = asyncio.run(main())
        assert plains == ["ok"] * 16
        assert streams == ["ok"] * 8  # the streams on the killed decode migrated
    finally:
        assert stack.stop(grace_s=15) == []  # every child still running drains and exits on SIGTERM


def test_streams_migrate_when_their_decode_dies_and_match_undisturbed_ones(tiny_model_dir, redis_url) -> None:
    """32 greedy streams over 1 prefill + 2 decode; SIGKILL the busier decode once tokens flow: its
    streams move to the other decode, which recomputes prompt + delivered tokens and continues.
    Every stream completes, and every text (and token count) equals the undisturbed run's."""
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=2)
    n, max_tokens = 32, 48
    prompts = [f"migrating stream {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(n)]
    ask = {
        "model": model_name(stack),
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        sync = client(stack)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            reference = list(
                pool.map(lambda p: sync.completions.create(prompt=p, **ask).choices[0].text, prompts)
            )
        tokens_seen = [0] * n

        async def streamed(i: int, ac: openai.AsyncOpenAI) -> tuple[str, str | None]:
            text, finish = [], None
            stream = await ac.completions.create(prompt=prompts[i], stream=True, **ask)
            async for chunk in stream:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                tokens_seen[i] += 1
            return "".join(text), finish

        async def main() -> list[tuple[str, str | None]]:
            ac = openai.AsyncOpenAI(
                base_url=stack.urls[0] + "/v1", api_key="none", max_retries=0, timeout=120
            )
            # The client is made before the streams start and the router's in-flight counts are read
            # until the kill, so the kill follows the read by milliseconds: reading them once after the
            # tokens flowed (a new client's set-up, then the request) let a fast host finish every
            # stream in between, and nothing was left to kill.
            async with httpx.AsyncClient() as hc:
                tasks = [asyncio.create_task(streamed(i, ac)) for i in range(n)]
                while True:
                    live = (await hc.get(stack.urls[0] + "/v1/instances")).json()["instances"]
                    busiest = max((i for i in live if i["role"] == "decode"), key=lambda i: i["in_flight"])
                    if busiest["in_flight"] > 0 and sum(t >= 4 for t in tokens_seen) >= n // 4:
                        break  # tokens are reaching the clients and the busier decode holds streams
                    assert not all(t.done() for t in tasks), "every stream ended before the kill"
                    await asyncio.sleep(0.005)
                next(p for name, p in stack.workers if busiest["id"].startswith(name + "-")).kill()
            results = await asyncio.gather(*tasks)
            await ac.close()
            return results

        results = asyncio.run(main())
        assert [finish for _, finish in results] == ["length"] * n
        assert [text for text, _ in results] == reference
        assert httpx.get(stack.urls[0] + "/v1/instances").json()["migrations"] > 0
    finally:
        stack.stop(grace_s=15)


# ---- acceptance 6: 200 concurrent streams, bounded streams, no leftovers ------------------------------------
def test_200_concurrent_streams_leave_nothing_behind(splitwise, redis_url) -> None:
    async def one(i: int, ac: openai.AsyncOpenAI) -> tuple[int, int]:
        stream = await ac.chat.completions.create(
            model=model_name(splitwise),
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=8 + i % 8,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        n_content, usage = 0, None
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                n_content += 1
            usage = ch.usage or usage
        assert usage.completion_tokens == 8 + i % 8
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        return n_content, usage.completion_tokens

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        ac = openai.AsyncOpenAI(
            base_url=splitwise.urls[0] + "/v1",
            api_key="none",
            max_retries=0,
            timeout=180,
            http_client=httpx.AsyncClient(limits=limits, timeout=180),
        )
        async with ac:
            return await asyncio.gather(*(one(i, ac) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200
    r = redis.Redis.from_url(redis_url)
    cluster = splitwise.spec.cluster
    time.sleep(0.5)
    leftovers = []
    for key in r.scan_iter(f"pdserve:*{cluster}*"):
        kind = r.type(key).decode()
        if kind == "stream":
            assert r.xlen(key) <= 200, f"{key} holds {r.xlen(key)} entries"
            if b"outbox" in key or b"inbox" in key:
                assert r.xlen(key) == 0, f"{key} still holds {r.xlen(key)} entries"
        elif b":prefix:{" in key:  # an instance's prefix index: bounded by its cache, not by requests
            assert 0 < r.scard(key) <= 1024 and r.pttl(key) > 0
        elif (
            b":instance:" not in key
            and b":router:" not in key
            and b":tokenizer:{" not in key  # one per model
            and not key.endswith((b"instances", b"routers"))
        ):
            leftovers.append(key)
    assert not leftovers  # no per-request keys at all
    cli = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "pdserve"),
            "status",
            "--redis-url",
            redis_url,
            "--cluster",
            cluster,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    status = orjson.loads(cli.stdout)
    assert {i["role"] for i in status["instances"]} == {"prefill", "decode"} and len(status["routers"]) == 1


# ---- acceptance 7: bad requests next to good ones ------------------------------------------------------------
def test_bad_requests_do_not_disturb_requests_in_flight(splitwise) -> None:
    url = splitwise.urls[0]

    async def good(ac: httpx.AsyncClient) -> str:
        body = {
            "model": model_name(splitwise),
            "prompt": PROMPTS[1],
            "max_tokens": 20,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        async with ac.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += orjson.loads(line[6:])["choices"][0]["text"]
        return text

    bad_cases = [
        (b"{not json", 400, None),
        (orjson.dumps({"model": model_name(splitwise)}), 400, "messages"),
        (orjson.dumps({"model": model_name(splitwise), "messages": "hi"}), 400, "messages"),
        (
            orjson.dumps(
                {
                    "model": model_name(splitwise),
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": -3,
                }
            ),
            400,
            "max_tokens",
        ),
        (
            orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model",
        ),
        (b'{"model": "x", "messages": [], "pad": "' + b"a" * (9 * 2**20) + b'"}', 413, None),
    ]

    async def main():
        async with httpx.AsyncClient(timeout=60) as ac:
            reference = await good(ac)
            goods = [asyncio.create_task(good(ac)) for _ in range(4)]
            for body, status, param in bad_cases:
                r = await ac.post(
                    url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
                )
                assert r.status_code == status, (body[:60], r.text[:200])
                err = r.json()["error"]
                assert err["message"] and err["type"]
                if param:
                    assert err["param"] == param or param in err["message"]
            assert await asyncio.gather(*goods) == [reference] * 4

    asyncio.run(main())


def test_a_too_long_prompt_is_refused_as_offline(stack, tiny_model_dir) -> None:
    """The served error has the offline engine's kind and param: 400 context_length_exceeded."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.errors import RequestTooLongError
    from pdserve.router.api.errors import ERROR_MAP
    from pdserve.sampling_params import SamplingParams

    prompt = "word " * 1500  # > the stack's --max-model-len 1024
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=16, max_model_len=1024))
    with pytest.raises(RequestTooLongError) as offline:
        engine.validate(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=16))
    url, model = stack.urls[0], model_name(stack)
    r = httpx.post(
        url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16}, timeout=60
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == ERROR_MAP[RequestTooLongError].code == "context_length_exceeded"
    assert err["param"] == offline.value.param == "prompt"
    assert err["message"] == offline.value.message
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"


def test_input_limits_are_checked_at_the_router(stack, tiny_model_dir) -> None:
    """Token ids against the vocabulary the workers registered, and the stop limits (default flags):
    refused by the router with the field named; 1024 stop strings of 256 characters are served."""
    from pdserve.engine.models.model_config import ModelConfig

    url, model = stack.urls[0], model_name(stack)
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    instances = httpx.get(url + "/v1/instances", timeout=30).json()["instances"]
    assert [i["vocab_size"] for i in instances] == [vocab] * len(instances)

    def post(**body: object) -> httpx.Response:
        body = {
            "model": model,
            "prompt": [5, 6, 7],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            **body,
        }
        return httpx.post(url + "/v1/completions", json=body, timeout=60)

    for body, param, text in (
        ({"prompt": [5, vocab]}, "prompt", f"vocabulary of {vocab} tokens"),
        ({"stop_token_ids": [vocab + 7]}, "stop_token_ids", f"vocabulary of {vocab} tokens"),
        ({"stop": "x" * 100_000}, "stop", "at most 256 characters"),
        ({"stop": ["x"] * 1025}, "stop", "at most 1024 stop strings"),
    ):
        r = post(**body)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["type"]) == (param, "invalid_request_error")
        assert text in r.json()["error"]["message"]
    plain = post(prompt=[5, vocab - 1])
    assert plain.status_code == 200, plain.text
    rng = random.Random(3)
    stops = ["".join(rng.choices("qwertyuiop", k=256)) for _ in range(1024)]  # never generated
    stopped = post(prompt=[5, vocab - 1], stop=stops)
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


# ---- structured output ------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["model", "server", "cache"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "meta"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "server", "schema": SCHEMA, "strict": True},
}


def test_structured_output_through_the_openai_client(stack) -> None:
    """response_format on chat (the client's own parameter) and on completions (extra_body, as vLLM
    takes it), stream and not, seeded at temperature 1: the text validates, and a stream is its
    non-stream answer; guided_choice and guided_regex as extras."""
    c, model = client(stack), model_name(stack)
    messages = [{"role": "user", "content": "Describe a server as JSON."}]
    kw = {"model": model, "max_tokens": 256, "temperature": 1.0}
    for seed in (1, 2):
        r = c.chat.completions.create(messages=messages, response_format=JSON_SCHEMA_FORMAT, seed=seed, **kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        chunks = c.chat.completions.create(
            messages=messages, response_format=JSON_SCHEMA_FORMAT, seed=seed, stream=True, **kw
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    extra = {"response_format": JSON_SCHEMA_FORMAT}
    r = c.completions.create(prompt="A server: ", seed=3, extra_body=extra, **kw)
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    chunks = c.completions.create(prompt="A server: ", seed=3, extra_body=extra, stream=True, **kw)
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    json_object = {"response_format": {"type": "json_object"}}  # seed 9 closes one soon (most run on)
    r = c.completions.create(
        model=model, prompt="A server: ", seed=9, temperature=1.0, max_tokens=64, extra_body=json_object
    )
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].text)
    choices = ["prefill", "decode", "mixed"]
    r = c.completions.create(prompt="Role: ", n=3, seed=5, extra_body={"guided_choice": choices}, **kw)
    assert all(ch.text in choices and ch.finish_reason == "stop" for ch in r.choices)
    r = c.chat.completions.create(messages=messages, extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"}, **kw)
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", r.choices[0].message.content)


def test_structured_output_splitwise_equals_mixed(splitwise, mixed) -> None:
    """Prefill samples the first token under the grammar, decode goes on from the same grammar
    state: greedy tokens equal the mixed instance's, token for token."""

    def tokens(stack: Stack, prompt: str, constraint: dict) -> tuple[list[int], str]:
        body = {
            "model": model_name(stack),
            "prompt": prompt,
            "max_tokens": 256,
            "temperature": 0,
            "return_token_ids": True,
            **constraint,
        }
        r = httpx.post(stack.urls[0] + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-pdserve-mode"] == ("splitwise" if stack is splitwise else "mixed")
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        return choice["token_ids"], choice["text"]

    for prompt in PROMPTS:
        for constraint in (
            {"response_format": JSON_SCHEMA_FORMAT},
            {"guided_regex": "(yes|no): [a-z ]{4,12}"},
        ):
            got = tokens(splitwise, prompt, constraint)
            assert got == tokens(mixed, prompt, constraint)
            if "response_format" in constraint:
                jsonschema.validate(json.loads(got[1]), SCHEMA)


def test_unusable_structured_output_is_a_400_naming_the_field(stack) -> None:
    """A schema the workers cannot compile (router-valid) and a malformed one (refused by the router)."""
    c, model = client(stack), model_name(stack)
    messages = [{"role": "user", "content": "hi"}]
    for fmt, param in (
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}},
            "response_format",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}},
            "response_format.json_schema.schema",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model=model, messages=messages, response_format=fmt, stream=stream)
            assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=model, prompt="x", extra_body={"guided_regex": "[ab"})
    assert info.value.body["param"] == "guided_regex" and "regex" in info.value.body["message"]


def test_json_schema_validates_for_20_seeds_stream_and_non_stream(stack) -> None:
    """Acceptance: the official client, a nested schema (object, array, enum, required fields),
    20 seeds (two requests of ``n=10``: choice i samples with seed + i) at temperature 1, stream and
    non-stream: every choice validates, and each streamed choice is its non-stream text."""
    c = client(stack)
    ask = {
        "model": model_name(stack),
        "messages": [{"role": "user", "content": "Describe a server as JSON."}],
        "response_format": JSON_SCHEMA_FORMAT,
        "max_tokens": 256,
        "temperature": 1.0,
        "n": 10,
    }
    texts = []
    for seed in (1000, 1010):
        r = c.chat.completions.create(**ask, seed=seed)
        choices = sorted(r.choices, key=lambda ch: ch.index)
        assert [ch.index for ch in choices] == list(range(10))
        for choice in choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        streamed = [""] * 10
        for chunk in c.chat.completions.create(**ask, seed=seed, stream=True):
            for ch in chunk.choices:
                streamed[ch.index] += ch.delta.content or ""
        assert streamed == [ch.message.content for ch in choices]
        texts += streamed
    assert len(set(texts)) > 10  # twenty seeds, not one document twenty times


# ---- /tokenize and /detokenize --------------------------------------------------------------------
def test_tokenize_and_detokenize_agree_with_generation(stack) -> None:
    """vLLM's shapes, answered by an instance: a prompt's count is the usage a completion reports,
    a chat's (with tools) the usage its chat completion reports; detokenize gives the text back."""
    base, model = stack.urls[0], model_name(stack)
    prompt = "The router never loads a tokenizer."
    r = httpx.post(base + "/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["count"] == len(
        body["tokens"]
    )
    assert body["max_model_len"] == 1024
    c = client(stack)
    assert c.completions.create(model=model, prompt=prompt, max_tokens=1).usage.prompt_tokens == body["count"]
    assert (
        c.completions.create(model=model, prompt=body["tokens"], max_tokens=1).usage.prompt_tokens
        == body["count"]
    )
    r = httpx.post(base + "/detokenize", json={"model": model, "tokens": body["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": prompt}
    counts = []
    for extra in ({}, {"tools": TOOLS}):  # the model may be left out
        r = httpx.post(base + "/tokenize", json={"messages": ASK_WEATHER, **extra}, timeout=30)
        used = c.chat.completions.create(model=model, messages=ASK_WEATHER, max_tokens=1, **extra).usage
        assert r.status_code == 200 and r.json()["count"] == used.prompt_tokens, r.text
        counts.append(used.prompt_tokens)
    assert counts[0] < counts[1]  # the tools were rendered
    bare = {"messages": ASK_WEATHER, "add_generation_prompt": False}
    assert httpx.post(base + "/tokenize", json=bare, timeout=30).json()["count"] < counts[0]
    for path, fields, param in (
        ("/tokenize", {"prompt": "a", "messages": ASK_WEATHER}, "prompt"),
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "chat_template": "x"}, "chat_template"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": []}, "tokens"),
    ):
        r = httpx.post(base + path, json={"model": model, **fields}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(base + "/tokenize", json={"model": "nope", "prompt": "a"}, timeout=30)
    assert r.status_code == 404


# ---- tools -----------------------------------------------------------------------------------------
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_calls(chunks) -> tuple[dict[int, dict], set]:
    """The tool calls of a chat stream, assembled from their deltas; and the finish reasons."""
    calls: dict[int, dict] = {}
    finishes = set()
    for chunk in chunks:
        for ch in chunk.choices:
            finishes.add(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function.name if d.function else None)
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return calls, finishes - {None}


def test_a_named_tool_choice_returns_valid_arguments_stream_and_non_stream(stack) -> None:
    """Acceptance: tool_choice naming a function -> tool_calls whose arguments validate against its
    parameters (the grammar enforces them), stream and non-stream, several seeds."""
    c = client(stack)
    for name in ("get_weather", "get_time"):
        ask = {
            "model": model_name(stack),
            "messages": ASK_WEATHER,
            "tools": TOOLS,
            "max_tokens": 128,
            "tool_choice": {"type": "function", "function": {"name": name}},
            "temperature": 1.0,
        }
        for seed in (1, 2, 3):
            r = c.chat.completions.create(**ask, seed=seed)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.function.name == name and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[name])
            calls, finishes = streamed_calls(c.chat.completions.create(**ask, seed=seed, stream=True))
            assert finishes == {"tool_calls"} and list(calls) == [0]
            assert calls[0]["name"] == name and calls[0]["id"].startswith("call_")
            assert calls[0]["arguments"] == call.function.arguments


def test_required_tool_choice_calls_given_functions_with_valid_arguments(stack) -> None:
    c = client(stack)
    ask = {
        "model": model_name(stack),
        "messages": ASK_WEATHER,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 1.0,
        "parallel_tool_calls": False,
    }
    for seed in (4, 5):
        r = c.chat.completions.create(**ask, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
        calls, finishes = streamed_calls(c.chat.completions.create(**ask, seed=seed, stream=True))
        assert finishes == {"tool_calls"}
        assert [(v["name"], v["arguments"]) for v in calls.values()] == [
            (call.function.name, call.function.arguments)
        ]


def test_a_conversation_with_tool_calls_and_tool_results_is_rendered(stack) -> None:
    """An assistant message with tool_calls and the tool's answer go through the chat template
    (they lengthen the prompt); auto leaves the random model free, so its text is content."""
    c = client(stack)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    conversation = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    kw = {"model": model_name(stack), "max_tokens": 8, "temperature": 0}
    plain = c.chat.completions.create(messages=ASK_WEATHER, **kw)
    with_tools = c.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, **kw)
    answered = c.chat.completions.create(messages=conversation, tools=TOOLS, **kw)
    assert plain.usage.prompt_tokens < with_tools.usage.prompt_tokens < answered.usage.prompt_tokens
    assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError) as info:
        bad = {**call, "function": {"name": "get_weather", "arguments": "{not json"}}
        c.chat.completions.create(messages=[*ASK_WEATHER, {"role": "assistant", "tool_calls": [bad]}], **kw)
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_tool_calls_splitwise_equal_mixed(splitwise, mixed) -> None:
    """Greedy, a named function: the prefill instance samples the first token under the grammar and
    the decode instance goes on from there; the arguments equal the mixed instance's."""
    ask = {
        "messages": ASK_WEATHER,
        "tools": TOOLS,
        "max_tokens": 128,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    got = [
        client(s)
        .chat.completions.create(model=model_name(s), **ask)
        .choices[0]
        .message.tool_calls[0]
        .function
        for s in (splitwise, mixed)
    ]
    assert got[0].name == got[1].name == "get_weather" and got[0].arguments == got[1].arguments
    jsonschema.validate(json.loads(got[0].arguments), WEATHER)


# ---- restarts with the same instance id ----------------------------------------------------------------
def test_restart_with_same_id_serves_its_inbox_and_reclaims_its_segment(tiny_model_dir, redis_url) -> None:
    """Work queued for an instance while it was down is served when it comes back under the same id,
    and a decode instance killed without cleanup gets its shared-memory segment back on restart."""
    from multiprocessing import shared_memory

    from pdserve.scheduler import (
        GenerateRequest,
        Heartbeat,
        Keys,
        OutboxReader,
        RedisSettings,
        RouterInfo,
        RouterRegistry,
        send_to_inbox,
    )

    cluster, iid = f"t{uuid.uuid4().hex[:8]}", f"decode-{uuid.uuid4().hex[:6]}"
    stale = shared_memory.SharedMemory(name=f"pdserve-{iid}", create=True, size=4096)  # left by a "crash"
    stale.close()

    async def main() -> list[int]:
        r = RedisSettings.from_url(redis_url).connect()
        keys = Keys(cluster)
        beat = Heartbeat(
            RouterRegistry(r, keys), lambda: RouterInfo(id="r1", host="h", pid=1, port=1, started_at=0)
        )
        await beat.start()
        reader = OutboxReader(r, keys, "r1")
        await reader.start()
        queue = reader.subscribe("q1")
        msg = GenerateRequest(
            request_id="q1",
            router_id="r1",
            prompt="queued while down",
            deadline=time.time() + 60,
            sampling={"temperature": 0, "max_tokens": 5, "ignore_eos": True},
        )
        await send_to_inbox(r, keys, iid, msg)  # nobody is reading this inbox yet
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "worker",
                "--role",
                "decode",
                "--model",
                str(tiny_model_dir),
                "--redis-url",
                redis_url,
                "--cluster",
                cluster,
                "--instance-id",
                iid,
                "--num-blocks",
                "64",
            ]
        )
        try:
            tokens: list[int] = []
            while True:
                delta = await asyncio.wait_for(queue.get(), 60)
                tokens += delta.token_ids
                if delta.is_final:
                    assert delta.finish_reason == "length" and delta.error is None
                    return tokens
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
            await reader.stop()
            await beat.stop()
            await r.aclose()

    assert len(asyncio.run(main())) == 5


def test_a_decode_restarted_under_its_id_answers_with_the_prompts_kv(tiny_model_dir, redis_url) -> None:
    """A decode instance SIGKILLed and restarted (same id, so the same shm segment name): the next
    splitwise answer is the text the undisturbed pair gave, never one decoded from a cache that
    prefill wrote through its mapping of the dead instance's segment (shm only: its endpoint, the
    segment's name, is the same after the restart)."""
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1, kv_transfer="shm")
    url = stack.urls[0] + "/v1/completions"
    body = {"model": model_name(stack), "prompt": "the same prompt", "max_tokens": 12, "temperature": 0}

    def decode_pid() -> int | None:
        live = httpx.get(stack.urls[0] + "/v1/instances", timeout=5).json()["instances"]
        return next((i["pid"] for i in live if i["role"] == "decode"), None)

    try:
        before = httpx.post(url, json=body, timeout=60)
        assert before.status_code == 200 and before.headers["x-pdserve-mode"] == "splitwise", before.text
        name, proc = next((n, p) for n, p in stack.workers if n.startswith("decode"))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while decode_pid() in (None, proc.pid):  # the same id comes back in a new process
            stack.supervise()
            assert time.monotonic() < deadline, "the decode instance did not come back"
            time.sleep(0.2)
        after = httpx.post(url, json=body, timeout=60)
        assert after.status_code == 200 and after.headers["x-pdserve-mode"] == "splitwise", after.text
        assert stack.restarts[name] >= 1  # (a first try may exit: the old registration still lives)
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    finally:
        stack.stop(grace_s=15)


def test_up_restarts_a_crashed_worker_and_stops_in_order(tiny_model_dir, redis_url) -> None:
    """pdserve up supervises: a SIGKILLed worker comes back (same id) while the router keeps its
    place; at stop the routers go first, so a stream in flight still completes."""
    stack = start_stack(tiny_model_dir, redis_url, mixed=1)
    try:
        name, proc = stack.workers[0]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        body = {"model": model_name(stack), "prompt": "back again", "max_tokens": 4, "temperature": 0}
        while True:
            stack.supervise()
            r = httpx.post(stack.urls[0] + "/v1/completions", json=body, timeout=30)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, f"the worker did not come back: {r.text}"
            time.sleep(0.5)
        assert stack.restarts[name] >= 1 and stack.workers[0][1].poll() is None
        long = {**body, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", stack.urls[0] + "/v1/completions", json=long, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            stopper = concurrent.futures.ThreadPoolExecutor(1).submit(stack.stop, 30)
            rest = [x for x in [first, *lines] if x]
        assert rest[-1] == "data: [DONE]"
        last = orjson.loads(next(x for x in reversed(rest) if x.startswith("data: {"))[6:])
        assert last["choices"][0]["finish_reason"] == "length", last  # finished, not cut by the stop
        assert stopper.result(60) == []
    finally:
        stack.stop(grace_s=15)


def test_pdserve_up_restarts_a_killed_decode_and_stops_cleanly_on_ctrl_c(tiny_model_dir, tmp_path) -> None:
    """`pdserve up` with 2 decode instances: SIGKILL one; the 8 requests sent right after all
    succeed and it is serving again within 10 s. Ctrl-C with a stream in flight: the stream
    completes, up exits 0, and nothing logged an ERROR."""
    port = free_port()
    log = (tmp_path / "up.log").open("w+b")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(tiny_model_dir),
            "--prefill",
            "1",
            "--decode",
            "2",
            "--port",
            str(port),
            "--ttl",
            "3",
            "--num-blocks",
            "512",
            "--max-model-len",
            "1024",
            "--threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)},
    )
    url = f"http://127.0.0.1:{port}"
    body = {"model": tiny_model_dir.name, "prompt": "after the kill", "max_tokens": 8, "temperature": 0}

    def decodes() -> dict[str, int]:
        live = httpx.get(url + "/v1/instances", timeout=5).json()["instances"]
        return {i["id"]: i["pid"] for i in live if i["role"] == "decode"}

    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, log.seek(0) or log.read().decode()[-3000:]
            log.seek(0)
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):  # up supervises once it says so
                if b"Ctrl-C stops everything" in log.read() and len(decodes()) == 2:
                    break
            assert time.monotonic() < deadline, "pdserve up did not become ready"
            time.sleep(0.5)
        victim, pid = sorted(decodes().items())[0]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60).status_code, range(8)
                )
            )
        assert codes == [200] * 8
        while decodes().get(victim) in (None, pid):  # the same id comes back with a new process
            assert time.monotonic() - killed_at < 10, "the killed decode was not restarted within 10 s"
            time.sleep(0.2)
        long = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
        workers = [i["pid"] for i in httpx.get(url + "/v1/instances", timeout=5).json()["instances"]]
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            up.send_signal(signal.SIGINT)  # Ctrl-C
            time.sleep(0.3)
            up.send_signal(signal.SIGTERM)  # and a second signal while it stops (ignored: no orphans)
            rest = [x for x in [first, *lines] if x]
        assert rest[-1] == "data: [DONE]"
        last = orjson.loads(next(x for x in reversed(rest) if x.startswith("data: {"))[6:])
        assert last["choices"][0]["finish_reason"] == "length", last
        assert up.wait(60) == 0
        for pid in workers:  # every worker it started has exited
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        log.seek(0)
        out = log.read().decode()
        assert "restarting it" in out and "stopped." in out
        assert [line for line in out.splitlines() if " ERROR " in line or "Traceback" in line] == []
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(60)
