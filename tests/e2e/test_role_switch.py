"""Roles change under load: 16 streams run on 1 prefill + 2 decode instances (started
``--switchable``) while one decode instance becomes a prefill instance (``pdserve role``, as a user
types it) and new requests keep coming, then the first prefill instance becomes a decode instance.
No request fails, is retried or migrates; every stream's text equals its undisturbed run's; new
work follows each new role at once; the registrations say the roles they took."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(300)

N, MAX_TOKENS = 16, 48
PROMPTS = [f"switching stream {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(N)]
LATE = [f"a request after the switch {i}: " + "jumps over " * (1 + i % 3) for i in range(8)]
ASK = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


def pdserve_role(stack, instance_id: str, role: str) -> str:
    pdserve = Path(sys.executable).parent / "pdserve"
    cmd = [str(pdserve), "role", instance_id, role, "--reason", "test", "--cluster", stack.spec.cluster]
    env = {"PDSERVE_REDIS_URL": stack.redis_url, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def live(stack) -> dict[str, dict]:
    return {i["id"]: i for i in httpx.get(stack.urls[0] + "/v1/instances").json()["instances"]}


def test_roles_switch_under_load_and_no_request_fails_or_moves(tiny_model_dir, redis_url) -> None:
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=2, worker_options={"switchable": True})
    try:
        sync = client(stack)
        model = model_name(stack)
        reference = [
            sync.completions.create(model=model, prompt=p, **ASK).choices[0].text for p in PROMPTS + LATE
        ]
        ids = live(stack)
        (first_prefill,) = [i for i, v in ids.items() if v["role"] == "prefill"]
        decodes = sorted(i for i, v in ids.items() if v["role"] == "decode")
        tokens_seen = [0] * N

        async def streamed(i: int, ac: openai.AsyncOpenAI) -> tuple[str, str | None]:
            text, finish = [], None
            stream = await ac.completions.create(model=model, prompt=PROMPTS[i], stream=True, **ASK)
            async for chunk in stream:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                tokens_seen[i] += 1
            return "".join(text), finish

        async def late(i: int, hc: httpx.AsyncClient) -> tuple[str, str]:
            body = {
                "model": model,
                "prompt": LATE[i],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await hc.post(stack.urls[0] + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.headers.get("x-pdserve-prefill-instance", "")

        async def main() -> tuple[list[tuple[str, str | None]], list[tuple[str, str]]]:
            ac = openai.AsyncOpenAI(
                base_url=stack.urls[0] + "/v1", api_key="none", max_retries=0, timeout=120
            )
            async with httpx.AsyncClient() as hc:
                streams = [asyncio.create_task(streamed(i, ac)) for i in range(N)]
                while sum(t >= 4 for t in tokens_seen) < N // 2:  # tokens flow on both decodes
                    assert not all(s.done() for s in streams), "every stream ended before the switch"
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(pdserve_role, stack, decodes[0], "prefill")
                deadline = time.monotonic() + 5
                while (
                    live(stack)[decodes[0]]["role"] != "prefill"
                ):  # the router's live set, 0.5 s old at most
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                later = [asyncio.create_task(late(i, hc)) for i in range(len(LATE))]
                await asyncio.to_thread(pdserve_role, stack, first_prefill, "decode")
                results = await asyncio.gather(*streams)
                after = await asyncio.gather(*later)
            await ac.close()
            return results, after

        results, after = asyncio.run(main())
        assert [finish for _, finish in results] == ["length"] * N
        assert [text for text, _ in results] == reference[:N]
        assert [text for text, _ in after] == reference[N:]
        assert decodes[0] in {prefill for _, prefill in after}  # new prefill work went to the new role
        counts = httpx.get(stack.urls[0] + "/v1/instances").json()
        assert (counts["retries"], counts["migrations"]) == (0, 0)
        roles = live(stack)
        assert (roles[decodes[0]]["role"], roles[first_prefill]["role"]) == ("prefill", "decode")
        assert sync.completions.create(model=model, prompt=PROMPTS[0], **ASK).choices[0].text == reference[0]
    finally:
        assert stack.stop(grace_s=20) == []
