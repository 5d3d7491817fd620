"""``pdserve bench``: a load generator for any OpenAI-compatible server, and the seed's result table.

Every request streams (``stream_options.include_usage``), so the client sees when each token
arrives: TTFT, ITL, TPOT, end-to-end latency and decode speed (tokens/s per request after the first
token). ``S_TTFT`` is the server's own time to the first token (pdserve reports it in its
``timing`` field; other servers do not, and the table leaves it out). Failed requests are counted
and summarised by error kind, never dropped.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

DEFAULT_PERCENTILES = (80, 95, 99, 99.9, 99.95, 99.99)
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "be",
    "by",
    "at",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
]


@dataclasses.dataclass
class Prompt:
    body: dict[str, Any]  # prompt or messages, max_tokens
    output_len: int


@dataclasses.dataclass
class Result:
    ok: bool
    error_kind: str = ""
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    s_ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    text: str = ""  # what the stream carried (a conversation sends it back as the next turn's history)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 where the server says nothing)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the chunks' own (``return_token_ids``)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def decode_speed(self) -> float | None:
        """Tokens per second after the first one (the seed's 'decode speed')."""
        return (
            (self.output_tokens - 1) / (self.e2e - self.ttft)
            if self.output_tokens > 1 and self.e2e > self.ttft
            else None
        )


def random_prompts(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    chat: bool,
    rng: random.Random,
    tokenizer: Any = None,
) -> list[Prompt]:
    """``n`` prompts of about ``input_len`` tokens (exactly, as token ids, with a local tokenizer)."""
    out = []
    for _ in range(n):
        lo, hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
        n_in, n_out = (
            rng.randint(lo, hi),
            max(1, rng.randint(int(output_len * (1 - range_ratio)) or 1, output_len)),
        )
        if tokenizer is not None:
            ids = [rng.randrange(100, tokenizer.vocab_size) for _ in range(n_in)]
            text = tokenizer.decode(ids)
            prompt: Any = text if chat else ids
        else:
            prompt = text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": prompt}
        out.append(Prompt({**body, "max_tokens": n_out}, n_out))
    return out


def jsonl_prompts(path: Path, n: int, output_len: int, chat: bool) -> list[Prompt]:
    """Lines of ``{"messages": [...], "max_tokens"?: int}``, cycled up to ``n``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"--dataset jsonl: {path} holds no lines")
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        if "messages" not in row:
            raise ValueError(f"--dataset jsonl: line {i % len(rows) + 1} of {path} has no 'messages'")
        n_out = int(row.get("max_tokens", output_len))
        body = (
            {"messages": row["messages"]}
            if chat
            else {"prompt": "\n".join(m["content"] for m in row["messages"])}
        )
        out.append(Prompt({**body, "max_tokens": n_out}, n_out))
    return out


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, ignore_eos: bool
) -> Result:
    body = {
        "model": model,
        **prompt.body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    last = None
    result = Result(ok=False)
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                data = orjson.loads(await r.aread() or b"{}")
                err = data.get("error") or {}
                return Result(
                    ok=False, error_kind=str(err.get("code") or r.status_code), error=str(err.get("message"))
                )
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    return Result(
                        ok=False, error_kind=str(err.get("code") or "error"), error=str(err.get("message"))
                    )
                if chunk.get("timing", {}).get("s_ttft_ms") is not None:
                    result.s_ttft = chunk["timing"]["s_ttft_ms"] / 1000
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
                for c in chunk.get("choices", []):
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    ids = c.get("token_ids") or []
                    result.token_ids += ids
                    if piece or ids:  # a token whose text is not whole yet still arrived
                        result.text += piece or ""
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - t0
                        else:
                            result.itl.append(now - last)
                        last = now
                        tokens += 1
    except httpx.HTTPError as e:
        return Result(ok=False, error_kind=type(e).__name__, error=str(e))
    result.e2e = time.perf_counter() - t0
    result.output_tokens = result.output_tokens or tokens
    result.ok = last is not None
    if not result.ok:
        result.error_kind, result.error = "empty", "the stream carried no token"
    return result


async def run(
    base_url: str,
    endpoint: str,
    model: str,
    prompts: list[Prompt],
    concurrency: int,
    rate: float,
    ignore_eos: bool,
    seed: int,
    progress: Any = None,
) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:

        async def guarded(p: Prompt) -> Result:
            async with sem:
                r = await one_request(client, base_url + endpoint, model, p, ignore_eos)
            if progress is not None:
                progress.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(guarded(p)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[Result], duration: float, percentiles: tuple[float, ...]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = collections.Counter(r.error_kind for r in results if not r.ok)
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    series = {
        "decode_tok_s": [r.decode_speed for r in ok if r.decode_speed is not None],
        "ttft_ms": [r.ttft * 1e3 for r in ok],
        "s_ttft_ms": [r.s_ttft * 1e3 for r in ok if r.s_ttft is not None],
        "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl_ms": [x * 1e3 for r in ok for x in r.itl],
        "e2e_ms": [r.e2e * 1e3 for r in ok],
    }
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": dict(errors),
        "error_examples": {k: next(r.error for r in results if r.error_kind == k) for k in errors},
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "metrics": {k: stats(v, percentiles) for k, v in series.items() if v},
    }


def stats(values: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ordered = sorted(values)
    out = {"mean": statistics.fmean(ordered), "median": statistics.median(ordered)}
    for p in percentiles:
        rank = math.ceil(p / 100 * len(ordered))  # nearest rank
        out[f"p{p:g}"] = ordered[min(len(ordered), max(1, rank)) - 1]
    return out


TITLES = {
    "decode_tok_s": ("Decode speed (tok/s)", "Decode"),
    "ttft_ms": ("Time to First Token", "TTFT (ms)"),
    "s_ttft_ms": ("Server Time to First Token", "S_TTFT (ms)"),
    "tpot_ms": ("Time per Output Token (excl. 1st)", "TPOT (ms)"),
    "itl_ms": ("Inter-token Latency", "ITL (ms)"),
    "e2e_ms": ("End-to-end Latency", "E2E (ms)"),
}


def render(summary: dict[str, Any]) -> str:
    row = "{:<40} {:<10}".format
    lines = ["{:=^51}".format(" Serving Benchmark Result ")]
    lines += [
        row("Successful requests:", summary["successful_requests"]),
        row("Failed requests:", summary["failed_requests"]),
        row("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Request throughput (req/s):", f"{summary['request_throughput']:.3f}"),
        row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        row("Total Token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    for kind, count in summary["errors"].items():
        lines.append(row(f"  failed: {kind}:", f"{count}  ({summary['error_examples'][kind][:60]})"))
    for key, (title, name) in TITLES.items():
        m = summary["metrics"].get(key)
        if m is None:
            continue
        lines.append(f"{title:-^51}")
        for stat, value in m.items():
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            lines.append(row(f"{label} {name}:", f"{value:.2f}"))
    lines.append("=" * 51)
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    """Latency distributions (TTFT, ITL, E2E, decode speed) as one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pdserve[bench]'") from None
    ok = [r for r in results if r.ok]
    panels = [
        ("TTFT (ms)", [r.ttft * 1e3 for r in ok]),
        ("ITL (ms)", [x * 1e3 for r in ok for x in r.itl]),
        ("E2E latency (ms)", [r.e2e * 1e3 for r in ok]),
        ("decode speed (tok/s)", [r.decode_speed for r in ok if r.decode_speed is not None]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, values) in zip(axes.flat, panels):
        ax.hist(values or [0], bins=40)
        ax.set_title(title)
        ax.set_ylabel("requests" if "ITL" not in title else "tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
