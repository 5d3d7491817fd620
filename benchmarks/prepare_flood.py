"""Does preparing other requests hold a running stream's decode steps?

One mixed instance behind one router (``pdserve up`` as child processes). A steady client streams
long completions one at a time (``ignore_eos``) and its inter-token latency (ITL) is measured twice:
alone, then beside a flood sent at a fixed rate of the costliest inputs to *prepare* that the
router lets through, alternating:

* ``schema``: the JSON schema within the router's ``--max-grammar-bytes`` (64 KiB) that is slowest
  to compile: an object of ~5,400 optional properties (``{}`` each, ``additionalProperties:
  false``); llguidance's work grows with the square of the optional properties (seconds at 64 KiB,
  where a schema of 40 ``anyOf`` objects with patterns takes tens of milliseconds). Each request's
  property names are new, so the worker's grammar cache never answers. Short prompt, 4 tokens.
  llguidance then gives up at the object's first token, so by default the router refuses this
  shape at once (``--max-optional-properties``, 500); ``--max-optional-properties 100000`` lets it
  through to the worker, whose preparation threads compile it (at ``--prepare-nice``).
* ``prompt``: the longest prompt the router forwards (``--max-prompt-chars-per-token`` 32 x the
  model length in characters): the worker tokenizes all of it, then refuses it (it cannot fit).

Requests whose preparation is cheap to run but slow to prepare isolate preparation: the flood adds
little decode work (a fitting prompt of the model length would add seconds of prefill to every
step it shares, which is not what this measures). Prints one table (the steady stream's ITL p50/p99
alone and with the flood, their ratio; the flood's latency by kind) and writes JSON.

    python benchmarks/prepare_flood.py [--model smollm2-135m] [--seconds 60] [--flood-every 4]
        [--max-optional-properties N] [--prepare-nice N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness import fmt, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
GRAMMAR_BYTES = 64 * 1024  # the router's and the worker's --max-grammar-bytes default
CHARS_PER_TOKEN = 32  # their --max-prompt-chars-per-token default
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]


def slow_schema(tag: str, limit: int = GRAMMAR_BYTES) -> dict[str, Any]:
    """The slowest-compiling schema found within ``limit`` bytes: as many optional properties as fit."""

    def make(n: int) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {f"{tag}{i}": {} for i in range(n)},
            "additionalProperties": False,
        }

    lo, hi = 1, limit
    while lo < hi:  # the most properties that fit
        mid = (lo + hi + 1) // 2
        if len(json.dumps(make(mid), separators=(",", ":")).encode()) <= limit - 64:
            lo = mid
        else:
            hi = mid - 1
    return make(lo)


def long_prompt(chars: int, rng: random.Random) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


async def steady(client: httpx.AsyncClient, url: str, model: str, stop_at: float, max_tokens: int) -> dict:
    """One stream at a time until ``stop_at``: the gaps between its tokens (first tokens apart)."""
    from pdserve import bench

    gaps: list[float] = []
    errors = 0
    prompt = bench.Prompt(
        {"prompt": "Tell me a long story about a lighthouse.", "max_tokens": max_tokens}, max_tokens
    )
    while time.monotonic() < stop_at:
        r = await bench.one_request(client, url, model, prompt, ignore_eos=True)
        if r.ok:
            gaps += r.itl
        else:
            errors += 1
    return {
        "tokens": len(gaps),
        "errors": errors,
        "itl_p50_ms": pct(gaps, 50) * 1000,
        "itl_p99_ms": pct(gaps, 99) * 1000,
        "itl_max_ms": max(gaps, default=float("nan")) * 1000,
    }


async def flood_one(
    client: httpx.AsyncClient, url: str, model: str, kind: str, n: int, rng, max_len: int
) -> dict:
    if kind == "schema":
        body = {
            "model": model,
            "prompt": "Answer with one JSON object:",
            "max_tokens": 4,
            "temperature": 0,
            "guided_json": slow_schema(f"r{n}x"),
        }
    else:
        body = {"model": model, "prompt": long_prompt(CHARS_PER_TOKEN * max_len, rng), "max_tokens": 1}
    t0 = time.perf_counter()
    try:
        r = await client.post(url, json=body)
        status = r.status_code
        error = {} if status == 200 else (r.json().get("error") or {})
        code, message = (
            str(error.get("code") or ("" if status == 200 else status)),
            str(error.get("message") or ""),
        )
    except httpx.HTTPError as e:
        status, code, message = 0, type(e).__name__, str(e)
    latency = time.perf_counter() - t0
    return {"kind": kind, "latency_s": latency, "status": status, "code": code, "message": message[:300]}


async def phase(
    base: str, model: str, seconds: float, flood_every: float | None, max_tokens: int, max_len: int
):
    url = base + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        stop_at = time.monotonic() + seconds
        stream = asyncio.create_task(steady(client, url, model, stop_at, max_tokens))
        sent: list[asyncio.Task] = []
        if flood_every:
            rng = random.Random(0)
            n = 0
            while time.monotonic() < stop_at:
                kind = ("schema", "prompt")[n % 2]
                sent.append(asyncio.create_task(flood_one(client, url, model, kind, n, rng, max_len)))
                n += 1
                await asyncio.sleep(flood_every)
        result = await stream
        flood = list(await asyncio.gather(*sent))
    return result, flood


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m", help="model (default %(default)s; tiny for a quick run)"
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each phase (default %(default)s)")
    ap.add_argument(
        "--flood-every", type=float, default=4.0, help="seconds between flood requests (default %(default)s)"
    )
    ap.add_argument("--max-tokens", type=int, default=256, help="the steady stream's tokens per request")
    ap.add_argument("--max-model-len", type=int, default=None, help="the worker's (default: the model's)")
    ap.add_argument(
        "--max-optional-properties",
        type=int,
        default=None,
        help="the router's and the worker's (default: theirs, 500: the flood's schemas are refused; "
        "100000: compiled)",
    )
    ap.add_argument(
        "--prepare-nice", type=int, default=None, help="the worker's (default: its own, 10; 0: none)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prepare_flood.json")
    args = ap.parse_args()

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.model_store import resolve_model
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec

    resolved = resolve_model(args.model)
    engine = EngineConfig(max_model_len=args.max_model_len) if args.max_model_len else EngineConfig()
    router_options: dict[str, Any] = {}
    worker_options: dict[str, Any] = {}
    if args.max_optional_properties is not None:
        router_options["max_optional_properties"] = args.max_optional_properties
        worker_options["max_optional_properties"] = args.max_optional_properties
    if args.prepare_nice is not None:
        worker_options["prepare_nice"] = args.prepare_nice
    spec = StackSpec(
        batch_workers=0,
        model=str(resolved.path),
        redis_url=None,
        port=free_port(),
        prefill=0,
        decode=0,
        mixed=1,
        engine=engine,
        router_options=router_options,
        worker_options=worker_options,
    )
    stack = Stack(spec)
    try:
        stack.start()
        stack.wait_ready()
        base = stack.urls[0]
        models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
        model = models[0]["id"]
        max_len = args.max_model_len or int(models[0].get("max_model_len") or 8192)
        print(f"{model}: warming up ...", file=sys.stderr, flush=True)
        asyncio.run(phase(base, model, 5, None, 32, max_len))
        print(f"steady stream alone, {args.seconds:.0f} s ...", file=sys.stderr, flush=True)
        alone, _ = asyncio.run(phase(base, model, args.seconds, None, args.max_tokens, max_len))
        print(
            f"beside a flood (one every {args.flood_every:g} s), {args.seconds:.0f} s ...",
            file=sys.stderr,
            flush=True,
        )
        flooded, flood = asyncio.run(
            phase(base, model, args.seconds, args.flood_every, args.max_tokens, max_len)
        )
    finally:
        stack.stop()
    kinds = {}
    for kind in ("schema", "prompt"):
        rows = [f for f in flood if f["kind"] == kind]
        lat = [f["latency_s"] for f in rows]
        kinds[kind] = {
            "sent": len(rows),
            "ok": sum(f["status"] == 200 for f in rows),
            "codes": sorted({f["code"] for f in rows if f["code"]}),
            "messages": sorted({f["message"] for f in rows if f["message"]})[:3],
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_max_s": max(lat, default=None),
        }
    report = {
        "machine": {"cpus": os.cpu_count()},
        "model": args.model,
        "layout": "1 mixed",
        "options": {"router": router_options, "worker": worker_options},
        "max_model_len": max_len,
        "flood": {
            "every_s": args.flood_every,
            "schema_bytes": len(json.dumps(slow_schema("r0x"), separators=(",", ":")).encode()),
            "schema_properties": len(slow_schema("r0x")["properties"]),
            "prompt_chars": CHARS_PER_TOKEN * max_len,
        },
        "seconds": args.seconds,
        "alone": alone,
        "with_flood": flooded,
        "itl_p99_ratio": flooded["itl_p99_ms"] / alone["itl_p99_ms"],
        "flood_by_kind": kinds,
    }
    print_report(report)
    write_json(args.out, report, args)
    return 0


def print_report(r: dict) -> None:
    f = r["flood"]
    print_table(
        ["steady stream", "tokens", "ITL p50 ms", "ITL p99 ms", "ITL max ms"],
        [
            [
                name,
                r[name]["tokens"],
                fmt(r[name]["itl_p50_ms"]),
                fmt(r[name]["itl_p99_ms"]),
                fmt(r[name]["itl_max_ms"]),
            ]
            for name in ("alone", "with_flood")
        ],
        title=f"\n{r['model']}, {r['layout']}, {r['machine']['cpus']} cores, {r['seconds']:.0f} s a phase; flood: one "
        f"every {f['every_s']:g} s, alternating a {f['schema_bytes']} B schema ({f['schema_properties']} optional "
        f"properties) and a {f['prompt_chars']}-char prompt; options {r.get('options')}",
    )
    print(f"ITL p99 ratio {r['itl_p99_ratio']:.2f}x")
    print_table(
        ["flood", "sent", "ok", "p50 s", "max s", "codes"],
        [
            [
                kind,
                k["sent"],
                k["ok"],
                fmt(k["latency_p50_s"], ".2f"),
                fmt(k["latency_max_s"], ".2f"),
                ",".join(k["codes"]),
            ]
            for kind, k in r["flood_by_kind"].items()
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
