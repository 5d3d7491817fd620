"""Prefix caching and prefix routing on the real model: multi-turn chats that share a system prompt.

C conversations (default 16) run at once, each T turns (default 4) one after the other: a ~1000-token
system prompt shared by all (``--system-prompts K``: K different ones), ~50-token user turns,
32-token answers (greedy, ignore_eos); turn t of
conversation c goes to router (c + t) % 2, as a load balancer in front of two routers would send it.
Every configuration is a fresh stack of 2 prefill + 2 decode instances and 2 routers on SmolLM2-135M,
run in this one process one after the other on the same workload:

- ``off``: prefix caching off in the engines (and least-load routing);
- ``least_load``: caching on, routers blind to it;
- ``prefix``: caching on, ``prefix_cache`` routing with the shared index in Redis (the default);
- ``prefix/own-state``: ``prefix_cache`` routing, each router with its own record instead
  (``--prefix-index local``);
- ``prefix/local-prefill``: the default plus ``--local-prefill-tokens 128``.

Reported per configuration: TTFT p50/p99 (client side, first content chunk), prompt tokens the
engines computed and their hit rate (cached over prompt tokens, from usage) against the ideal
(an infinite cache shared by all: the full blocks of each prompt that an earlier prompt had),
KV bytes moved per request and what would have moved if every block had (the blocks decode held
were counted, not sent), requests a decode instance prefilled itself, and req/s. Prints a table,
writes JSON.

    .venv/bin/python benchmarks/prefix_bench.py [--conversations 16] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from harness import print_table as harness_table
from harness import write_json

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "river",
    "mountain",
    "answer",
    "careful",
    "policy",
    "router",
    "cache",
    "block",
    "token",
    "prefill",
    "decode",
    "instance",
    "model",
    "request",
    "stream",
    "system",
    "user",
    "assistant",
    "history",
    "weather",
    "city",
    "north",
    "south",
    "light",
    "water",
    "stone",
    "forest",
    "engine",
    "paper",
    "window",
    "garden",
    "simple",
    "clear",
    "short",
    "long",
    "quiet",
    "bright",
    "early",
    "late",
    "small",
    "large",
    "green",
]
CONFIGS: dict[str, tuple[bool, dict[str, Any]]] = {
    "off": (False, {"prefill_policy": "least_load", "decode_policy": "least_load"}),
    "least_load": (True, {"prefill_policy": "least_load", "decode_policy": "least_load"}),
    "prefix": (True, {}),
    "prefix/own-state": (True, {"prefix_index": "local"}),
    "prefix/local-prefill": (True, {"local_prefill_tokens": 128}),
}


@dataclasses.dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    mode: str
    messages: list[dict[str, str]]
    answer: str


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(tokenizer: Any, target: int, seed: int = 0) -> str:
    rng, text = random.Random(seed), ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < target:
        text += words(rng, 20).capitalize() + ". "
    return text


async def chat(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int
) -> tuple:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, text, usage = time.perf_counter(), None, "", None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        mode = r.headers.get("x-pdserve-mode", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += piece
    assert ttft is not None and usage is not None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return text, ttft, usage["prompt_tokens"], cached, mode


async def conversations(
    urls: list[str], model: str, systems: list[str], args: argparse.Namespace
) -> list[Turn]:
    async def one(c: int, client: httpx.AsyncClient) -> list[Turn]:
        rng = random.Random(1000 + c)
        messages = [{"role": "system", "content": systems[c % len(systems)]}]
        out = []
        for t in range(args.turns):
            messages.append({"role": "user", "content": words(rng, args.user_words) + "?"})
            sent = list(messages)
            text, ttft, n, cached, mode = await chat(
                client, urls[(c + t) % len(urls)], model, sent, args.answer_tokens
            )
            out.append(Turn(c, t, ttft, n, cached, mode, sent, text))
            messages.append({"role": "assistant", "content": text})
        return out

    limits = httpx.Limits(max_connections=args.conversations * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), limits=limits) as client:
        done = await asyncio.gather(*(one(c, client) for c in range(args.conversations)))
    return [turn for turns in done for turn in turns]


def scrape(stack: Any) -> dict[str, float]:
    """Every worker's counters, summed by name."""
    totals: dict[str, float] = {}
    for port in stack.metrics_ports.values():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for name, value in re.findall(r"^(pdserve_worker_\w+_total)\{[^}]*\} (\S+)$", text, re.M):
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def ideal_hit_tokens(turns: list[Turn], tokenizer: Any, block_size: int) -> int:
    """Prompt tokens an infinite cache shared by every instance would have held, in arrival order:
    a prompt's full blocks that some earlier prompt and its answer had (its last token is always
    computed). The answers count: outside batch-invariant mode (this benchmark) the blocks decoding
    fills are cached too."""
    seen: set[bytes] = set()
    from pdserve.block_hash import chain_hashes

    hits = 0
    for turn in sorted(turns, key=lambda t: (t.turn, t.conversation)):
        ids = tokenizer.prompt_ids(messages=turn.messages)
        hashes = chain_hashes(ids[: len(ids) - 1], block_size)
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hits += n * block_size
        seen.update(chain_hashes(ids + tokenizer.encode(turn.answer, add_special_tokens=False), block_size))
    return hits


def run_config(
    name: str, caching: bool, router: dict, args: argparse.Namespace, model: Any, systems: list[str]
) -> dict:
    from pdserve.bench import stats
    from pdserve.engine.config import EngineConfig
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec
    from pdserve.tokenizer import Tokenizer

    for attempt in (1, 2, 3):  # a free port taken meanwhile by another process fails a start
        spec = StackSpec(
            batch_workers=0,
            model=args.model,
            port=free_port(count=2),
            routers=2,
            prefill=2,
            decode=2,
            metrics=True,
            engine=EngineConfig(max_model_len=4096, kv_cache_gb=args.kv_cache_gb, prefix_caching=caching),
            router_options=router,
            ready_timeout_s=600,
        )
        stack = Stack(spec)
        try:
            stack.start()
            stack.wait_ready()
            break
        except RuntimeError as e:
            stack.stop()
            if attempt == 3:
                raise
            print(f"{name}: the stack did not start ({e}); again", file=sys.stderr, flush=True)
    try:
        print(
            f"{name}: {args.conversations} conversations x {args.turns} turns ...",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        assert stack.model is not None
        turns = asyncio.run(conversations(stack.urls, stack.model.name, systems, args))
        duration = time.perf_counter() - t0
        totals = scrape(stack)
    finally:
        stack.stop()
    tokenizer = Tokenizer.from_dir(model.path)
    block_size = spec.engine.block_size
    block_bytes = _block_bytes(model.path, block_size)
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    sent = totals.get("pdserve_worker_kv_sent_bytes_total", 0.0)
    held = totals.get("pdserve_worker_kv_blocks_not_sent_total", 0.0)
    ttft = stats([t.ttft_s * 1e3 for t in turns], (50, 99))
    return {
        "config": name,
        "requests": len(turns),
        "ttft_p50_ms": ttft["p50"],
        "ttft_p99_ms": ttft["p99"],
        "prompt_tokens": prompt,
        "prefill_tokens_computed": totals.get("pdserve_worker_prompt_tokens_total", prompt - cached),
        "hit_rate": cached / prompt,
        "ideal_hit_rate": ideal_hit_tokens(turns, tokenizer, block_size) / prompt,
        "kv_mb_per_request": sent / len(turns) / 1e6,
        "kv_mb_per_request_all_blocks": (sent + held * block_bytes) / len(turns) / 1e6,
        "local_prefills": sum(t.mode == "local" for t in turns),
        "req_s": len(turns) / duration,
        "duration_s": duration,
    }


def _block_bytes(model_dir: Path, block_size: int) -> int:
    from pdserve.engine.kv_layout import block_bytes
    from pdserve.engine.models.model_config import ModelConfig

    return block_bytes(ModelConfig.from_dir(model_dir), block_size)


def print_table(rows: list[dict]) -> None:
    head = (
        "config",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "prefill tok",
        "hit rate",
        "ideal",
        "KV MB/req",
        "KV MB/req all",
        "local",
        "req/s",
    )
    table = [
        (
            r["config"],
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            f"{r['prefill_tokens_computed']:.0f}",
            f"{r['hit_rate']:.3f}",
            f"{r['ideal_hit_rate']:.3f}",
            f"{r['kv_mb_per_request']:.2f}",
            f"{r['kv_mb_per_request_all_blocks']:.2f}",
            str(r["local_prefills"]),
            f"{r['req_s']:.2f}",
        )
        for r in rows
    ]
    harness_table(head, table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--conversations", type=int, default=16, help="conversations at once (default %(default)s)"
    )
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (default %(default)s)")
    ap.add_argument(
        "--system-tokens", type=int, default=1000, help="system prompt length (default %(default)s)"
    )
    ap.add_argument(
        "--system-prompts",
        type=int,
        default=1,
        help="distinct system prompts; conversation c takes number c mod this (default %(default)s: one shared)",
    )
    ap.add_argument(
        "--user-words", type=int, default=40, help="words per user turn, ~50 tokens (default %(default)s)"
    )
    ap.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer (default %(default)s)")
    ap.add_argument(
        "--kv-cache-gb", type=float, default=0.5, help="each worker's KV cache (default %(default)s)"
    )
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"which to run, comma-separated (default: all: {', '.join(CONFIGS)})",
    )
    ap.add_argument("--model", default="smollm2-135m", help="a --model source (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_bench.json")
    args = ap.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")

    from pdserve.engine.models.model_store import resolve_model
    from pdserve.tokenizer import Tokenizer

    model = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(model.path)
    systems = [system_prompt(tokenizer, args.system_tokens, seed) for seed in range(args.system_prompts)]
    rows = []
    for name in names:
        caching, router = CONFIGS[name]
        rows.append(run_config(name, caching, router, args, model, systems))
    print_table(rows)
    write_json(args.out, {"rows": rows}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
