"""The clients benchmarks/batch_bench.py drives: the Batch API's (upload, create, poll, cancel a
batch; wait for the instances to go idle) and the closed-loop online streaming client, timed to its
first content chunk (with the server's ``timing`` field)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from typing import Any

import httpx
import orjson

from pdserve import bench

ENDPOINT = "/v1/chat/completions"


async def create_batch(client: httpx.AsyncClient, content: bytes) -> dict:
    r = await client.post(
        "/v1/files", files={"file": ("batch.jsonl", content, "application/jsonl")}, data={"purpose": "batch"}
    )
    r.raise_for_status()
    body = {"input_file_id": r.json()["id"], "endpoint": ENDPOINT, "completion_window": "24h"}
    r = await client.post("/v1/batches", json=body)
    r.raise_for_status()
    return r.json()


async def get_batch(client: httpx.AsyncClient, batch_id: str) -> dict:
    r = await client.get(f"/v1/batches/{batch_id}")
    r.raise_for_status()
    return r.json()


async def wait_batch(
    client: httpx.AsyncClient, batch_id: str, done: Any, timeout_s: float, every_s: float = 0.25
) -> dict:
    """Poll the batch until ``done(batch)``; raises after ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while True:
        batch = await get_batch(client, batch_id)
        if done(batch):
            return batch
        if time.perf_counter() > deadline:
            counts = batch["request_counts"]
            raise TimeoutError(f"batch {batch_id} still {batch['status']} ({counts}) after {timeout_s:.0f} s")
        await asyncio.sleep(every_s)


async def cancel_batch(client: httpx.AsyncClient, batch_id: str) -> dict:
    """Cancel and wait until ``cancelled`` (or it ended otherwise meanwhile)."""
    r = await client.post(f"/v1/batches/{batch_id}/cancel")
    if r.status_code != 200 and "cannot cancel" not in r.text:
        r.raise_for_status()
    final = ("cancelled", "completed", "failed", "expired")
    return await wait_batch(client, batch_id, lambda b: b["status"] in final, 120)


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 30) -> None:
    """Until every instance reports nothing running or waiting (what a cancelled batch had in flight)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        loads = [i["load"] for i in (await client.get("/v1/instances")).json()["instances"]]
        if all(load["running"] == 0 and load["waiting"] == 0 for load in loads):
            return
        await asyncio.sleep(0.25)
    print(
        f"warning: instances still busy {timeout_s:.0f} s after the batch ended", file=sys.stderr, flush=True
    )


@dataclasses.dataclass
class Timed:
    """One online request: client-side TTFT (to the first content chunk) and the server's ``timing``
    (pdserve's extra field: the first token's instance-side time, its engine queue, prefill, KV write)."""

    t0: float
    ttft_ms: float | None = None
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    timing: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.ttft_ms is not None and not self.error


async def request(client: httpx.AsyncClient, model: str, prompt: bench.Prompt) -> Timed:
    body = {
        "model": model,
        **prompt.body,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    out = Timed(t0)
    try:
        async with client.stream("POST", ENDPOINT, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("code") or "error")
                    return out
                out.timing = chunk.get("timing") or out.timing
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if out.ttft_ms is None and any(
                    (c.get("delta") or {}).get("content") for c in chunk["choices"]
                ):
                    out.ttft_ms = (time.perf_counter() - t0) * 1e3
    except httpx.HTTPError as e:
        out.error = type(e).__name__
    if out.ttft_ms is None and not out.error:
        out.error = "no token"
    return out


async def online(client: httpx.AsyncClient, model: str, make: Any, stop_at: list[float], out: list) -> None:
    """One closed-loop client: a request after the other until ``stop_at[0]`` (which may move).
    Every prompt is new (``make()``): a repeated one would hit the prefix cache, which the batch's
    lines evict, and B would pay for what A got free."""
    while time.perf_counter() < stop_at[0]:
        out.append(await request(client, model, make()))
