"""A prefill instance's other requests while it writes 1 GiB of KV: their time to first token.

The echo engine (no model: its "prefill" fills stand-in bytes; here on the engine thread, as a
model's steps are, not on the event loop) with 1 MiB KV blocks of 16 tokens,
so one 16384-token prompt hands 1 GiB from a prefill to a decode instance over shared memory,
while 4 clients send 16-token prompts (1 MiB each) one after another and time their first token.
Two phases per round: the small requests alone, then with a big one every --big-every seconds.
Where the write ran inside the prefill's engine loop (or its inbox loop), every other request's
first token waited for it; run as a task of its own it waits for nothing.

``--tree DIR`` (repeatable) runs the stack from that checkout's ``pdserve`` (PYTHONPATH=DIR for
its processes), rounds alternating, so two versions are measured side by side in one run (e.g. a
``git worktree`` of an older commit). Prints a table, writes JSON.

    python benchmarks/handoff_stall_bench.py [--tree . --tree ../old] [--rounds 2] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness import fmt, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
BLOCK_BYTES = 1 << 20
BIG_TOKENS = 16384  # 1024 blocks of 16 tokens: 1 GiB
SMALL_TOKENS = 16
CLIENTS = 4
BOOT = (  # the echo engine with big blocks, its calls on the engine thread as a model's are
    "import dataclasses, sys; from pdserve.engine import echo; echo.EchoEngine.block_bytes_per_block = {bb}; "
    "facts = echo.EchoEngine.facts; "
    "echo.EchoEngine.facts = lambda self: dataclasses.replace(facts(self), calls_inline=False); "
    "from pdserve.cli import main; sys.exit(main(sys.argv[1:]))"
)


class Stack:
    """1 prefill + 1 decode (the echo engine, 1 MiB blocks) and a router, from one tree."""

    def __init__(self, tree: Path, redis_url: str, model: Path, checksum: bool) -> None:
        from pdserve.localredis.embedded import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cluster = f"stall-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "PYTHONPATH": str(tree), "PDSERVE_REDIS_URL": redis_url}
        env["PDSERVE_KV_CHECKSUM"] = "1" if checksum else "0"  # a tree without the flag ignores it
        common = ["--cluster", cluster, "--engine", "echo", "--model", str(model)]
        common += ["--num-blocks", "1100", "--max-model-len", "20000", "--log-level", "warning"]
        boot = [sys.executable, "-P", "-c", BOOT.format(bb=BLOCK_BYTES)]
        self.procs = [
            subprocess.Popen([*boot, "worker", "--role", role, *common], env=env)
            for role in ("decode", "prefill")
        ]
        router = ["router", "--port", str(self.port), "--cluster", cluster, "--first-token-timeout", "120"]
        router += ["--log-level", "warning"]
        self.procs.append(subprocess.Popen([sys.executable, "-P", "-m", "pdserve.cli", *router], env=env))
        self.model = model.name

    def wait_ready(self, timeout_s: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                live = httpx.get(self.url + "/v1/instances", timeout=2).json()["instances"]
                if len(live) == 2:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise SystemExit("the stack did not get ready")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


async def first_token(client, url: str, model: str, prompt: list[int]) -> tuple[float, dict]:
    """(TTFT, the response's ``timing``) of a streamed 2-token completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    timing: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
                timing = chunk.get("timing") or timing
    assert ttft is not None
    return ttft, timing


async def phase(stack: Stack, seconds: float, big_every: float | None, rng: random.Random) -> dict:
    """Small requests for ``seconds`` (with a big one every ``big_every`` s): their TTFTs, and the
    big ones' KV write times."""
    import httpx

    small: list[float] = []
    writes: list[float] = []
    end = time.monotonic() + seconds

    async with httpx.AsyncClient() as client:

        async def smalls() -> None:
            while time.monotonic() < end:
                prompt = [rng.randrange(10, 90) for _ in range(SMALL_TOKENS)]
                small.append((await first_token(client, stack.url, stack.model, prompt))[0])

        async def bigs() -> None:
            while big_every is not None and time.monotonic() < end:
                prompt = [rng.randrange(10, 90) for _ in range(BIG_TOKENS)]
                _, timing = await first_token(client, stack.url, stack.model, prompt)
                writes.append(timing.get("kv_transfer_ms") or 0.0)
                await asyncio.sleep(big_every)

        await asyncio.gather(*(smalls() for _ in range(CLIENTS)), bigs())
    q = statistics.quantiles(small, n=100) if len(small) > 1 else small * 99
    return {
        "small_requests": len(small),
        "small_ttft_p50_ms": statistics.median(small) * 1e3,
        "small_ttft_p99_ms": q[98] * 1e3,
        "small_ttft_max_ms": max(small) * 1e3,
        "big_requests": len(writes),
        "big_kv_write_ms": statistics.median(writes) if writes else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tree",
        type=Path,
        action="append",
        help="a checkout whose pdserve to run (repeatable; default: this one)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds per tree, alternating (default 2)")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each phase (default 8)")
    ap.add_argument(
        "--no-checksum",
        action="store_true",
        help="the workers' --no-kv-checksum (a tree without it has none)",
    )
    ap.add_argument("--big-every", type=float, default=1.0, help="pause between big requests, s (default 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "handoff_stall.json")
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [ROOT])]

    from pdserve.engine.models.model_init import init_model
    from pdserve.localredis.embedded import EmbeddedRedis

    rng = random.Random(0)
    results: dict[str, dict[str, list[dict]]] = {str(t): {"alone": [], "with_1gib_writes": []} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        init_model(model, preset="tiny")  # the echo engine only reads its tokenizer
        (Path(tmp) / "redis").mkdir()
        redis = EmbeddedRedis(workdir=Path(tmp) / "redis")
        redis.start()
        try:
            for r in range(args.rounds):
                for tree in trees if r % 2 == 0 else trees[::-1]:
                    stack = Stack(tree, redis.url, model, not args.no_checksum)
                    try:
                        stack.wait_ready()
                        asyncio.run(phase(stack, 2.0, None, rng))  # warm-up
                        for name, every in (("alone", None), ("with_1gib_writes", args.big_every)):
                            got = asyncio.run(phase(stack, args.seconds, every, rng))
                            results[str(tree)][name].append(got)
                            print(f"round {r + 1} {tree.name} {name}: {got}", flush=True)
                    finally:
                        stack.stop()
        finally:
            redis.stop()
    table = []
    summary: dict[str, dict[str, dict[str, float | None]]] = {}
    for tree, phases in results.items():
        for name, runs in phases.items():
            merged = {
                k: statistics.median([run[k] for run in runs if run[k] is not None] or [0.0])
                for k in ("small_ttft_p50_ms", "small_ttft_p99_ms", "small_ttft_max_ms", "big_kv_write_ms")
            } | {"small_requests": sum(run["small_requests"] for run in runs)}
            summary.setdefault(tree, {})[name] = merged
            write = f"{merged['big_kv_write_ms']:.0f}" if name != "alone" else "-"
            table.append(
                [
                    Path(tree).name,
                    name,
                    merged["small_requests"],
                    fmt(merged["small_ttft_p50_ms"]),
                    fmt(merged["small_ttft_p99_ms"]),
                    fmt(merged["small_ttft_max_ms"], ".0f"),
                    write,
                ]
            )
    print()
    print_table(
        ["tree", "phase", "small reqs", "TTFT p50 ms", "TTFT p99 ms", "max ms", "1 GiB write ms"], table
    )
    report = {
        "block_bytes": BLOCK_BYTES,
        "kv_checksum": not args.no_checksum,
        "big_tokens": BIG_TOKENS,
        "rounds": results,
        "summary": summary,
    }
    write_json(args.out, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
