"""Served throughput with pdserve's CPU kernels against the pure-Paddle path, side by side in one
run: the same 1 prefill + 1 decode stack behind one router, measured with pdserve bench, the
workers started with ``--attention reference --gemm paddle`` (every op in Paddle, as before the
kernels existed) and with ``--attention kernel --gemm packed`` (the numba attention kernels and
MKL's packed GEMM, the default where they load) in alternating rounds (the machine's noise then
falls on both).

Default workload: the small preset (ERNIE-4.5-0.3B shape, random weights), 32 streamed completions
of 256 prompt tokens and 64 output tokens, 16 in flight. Prints one table (median over rounds:
throughput, TTFT, decode speed per request, and the kernels' ratio to Paddle's), writes JSON.

    python benchmarks/served_kernels.py [--preset small] [--rounds 2] [--models DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TypedDict

from harness import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent


class Paths(TypedDict):
    """A variant's EngineConfig settings: ``EngineConfig(..., **paths)``."""

    attention: str
    gemm: str


VARIANTS: dict[str, Paths] = {  # name: the workers' engine settings
    "paddle": {"attention": "reference", "gemm": "paddle"},
    "kernels": {"attention": "kernel", "gemm": "packed"},
}
METRICS = (  # (label, summary key or metric, statistic)
    ("out tok/s", "output_throughput", None),
    ("req/s", "request_throughput", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p99 ms", "ttft_ms", "p99"),
    ("decode tok/s p50", "decode_tok_s", "p50"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
)


def value(summary: dict, key: str, stat: str | None) -> float:
    return summary[key] if stat is None else summary["metrics"][key][stat]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="model preset: tiny, small (default %(default)s)")
    ap.add_argument("--models", type=Path, default=None, help="folder of preset models (made if missing)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per run (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (default %(default)s)")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens (default %(default)s)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "served_kernels.json")
    args = ap.parse_args()

    from pdserve import bench
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.model_init import init_model
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec
    from pdserve.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (args.models or Path(tmp)) / args.preset
        if not (model_dir / "config.json").is_file():
            print(f"creating the {args.preset} model in {model_dir} ...", file=sys.stderr, flush=True)
            init_model(model_dir, preset=args.preset)
        tokenizer = Tokenizer.from_dir(model_dir)
        max_len = args.input_len + args.output_len + 16
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for variant in list(VARIANTS) if r % 2 == 0 else reversed(VARIANTS):
                paths = VARIANTS[variant]
                engine = EngineConfig(max_model_len=max_len, max_num_seqs=args.concurrency, **paths)
                spec = StackSpec(
                    batch_workers=0, model=model_dir, redis_url=None, port=free_port(), engine=engine
                )
                stack = Stack(spec)
                try:
                    print(
                        f"round {r + 1}/{args.rounds} [{variant}]: starting 1P+1D ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    stack.start()
                    stack.wait_ready()
                    rng = random.Random(0)  # the same prompts for every run
                    prompts = bench.random_prompts(
                        args.num_prompts, args.input_len, args.output_len, 0.0, False, rng, tokenizer
                    )
                    t = time.perf_counter()
                    results, duration = asyncio.run(
                        bench.run(
                            stack.urls[0],
                            "/v1/completions",
                            model_dir.name,
                            prompts,
                            args.concurrency,
                            float("inf"),
                            True,
                            0,
                        )
                    )
                    summary = bench.summarize(results, duration, (50, 99))
                    print(
                        f"  {summary['successful_requests']}/{len(prompts)} ok, "
                        f"{summary['output_throughput']:.1f} out tok/s, {time.perf_counter() - t:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    runs[variant].append(summary)
                finally:
                    stack.stop()
    report = {
        "machine": {"cpus": os.cpu_count()},
        "preset": args.preset,
        "layout": "1P+1D",
        "variants": VARIANTS,
        "workload": {k: getattr(args, k) for k in ("num_prompts", "concurrency", "input_len", "output_len")},
        "statistic": "median over rounds",
        "runs": runs,
    }
    print_report(report)
    write_json(args.out, report, args)
    failed = sum(s["failed_requests"] for v in runs.values() for s in v)
    return 1 if failed else 0


def print_report(report: dict) -> None:
    w = report["workload"]
    rows = []
    for label, key, stat in METRICS:
        base, ker = (statistics.median(value(s, key, stat) for s in report["runs"][v]) for v in VARIANTS)
        rows.append([label, f"{base:.1f}", f"{ker:.1f}", f"{ker / base:.2f}"])
    print_table(
        ["metric", "paddle", "kernels", "ratio"],
        rows,
        title=f"\n{report['preset']} model, {report['layout']}, {os.cpu_count()} cores; {w['num_prompts']} requests of "
        f"{w['input_len']} -> {w['output_len']} tokens, {w['concurrency']} in flight; {report['statistic']}",
    )


if __name__ == "__main__":
    sys.exit(main())
