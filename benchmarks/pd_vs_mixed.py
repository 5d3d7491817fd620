"""The seed's comparison on the tiny model: 1 prefill + 1 decode instance against 2 mixed instances,
behind the same router, under a prefill-heavy and a decode-heavy workload, measured with pdserve bench.

Prefill-heavy: prompts of ~1000 tokens, 2 output tokens (like the seed's run). Decode-heavy: ~100
tokens in, 128 out. Prompts are token ids of exact length (built from the model's tokenizer).
Prints one table (throughput, TTFT, S_TTFT and decode-speed percentiles), writes JSON.

    python benchmarks/pd_vs_mixed.py [--num-prompts 40] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

from harness import Layout, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"prefill-heavy": (1000, 2), "decode-heavy": (100, 128)}
LAYOUTS: dict[str, Layout] = {"1P+1D": {"prefill": 1, "decode": 1}, "2 mixed": {"mixed": 2}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=40, help="requests per workload (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pd_vs_mixed.json")
    args = ap.parse_args()

    from pdserve import bench
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.model_store import resolve_model
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec
    from pdserve.tokenizer import Tokenizer

    model_dir = resolve_model("tiny").path  # the tiny preset, made once in the cache (no download)
    tokenizer = Tokenizer.from_dir(model_dir)
    threads = max(1, (os.cpu_count() or 2) // 2)
    rows = []
    for layout, counts in LAYOUTS.items():
        spec = StackSpec(
            batch_workers=0,
            model=str(model_dir),
            redis_url=None,
            port=free_port(),
            **counts,
            engine=EngineConfig(max_model_len=2048, num_blocks=2048, threads=threads),
        )
        stack = Stack(spec)
        try:
            stack.start()
            stack.wait_ready()
            for workload, (n_in, n_out) in WORKLOADS.items():
                rng = random.Random(0)
                prompts = bench.random_prompts(args.num_prompts, n_in, n_out, 0.0, False, rng, tokenizer)
                print(f"{layout}, {workload}: {len(prompts)} requests ...", file=sys.stderr, flush=True)
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
                s = bench.summarize(results, duration, (50, 99))
                rows.append({"layout": layout, "workload": workload, **s})
        finally:
            stack.stop()
    print_rows(rows)
    write_json(args.out, rows, args)
    return 0


def print_rows(rows: list[dict]) -> None:
    table = []
    for r in sorted(rows, key=lambda r: (r["workload"], r["layout"])):
        m = r["metrics"]

        def get(key: str, stat: str, m=m) -> str:
            return f"{m[key][stat]:.1f}" if key in m else "-"

        table.append(
            [
                r["workload"],
                r["layout"],
                r["successful_requests"],
                f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}",
                get("ttft_ms", "p50"),
                get("ttft_ms", "p99"),
                get("s_ttft_ms", "p50"),
                get("s_ttft_ms", "p99"),
                get("decode_tok_s", "p50"),
            ]
        )
    print_table(
        [
            "workload",
            "layout",
            "ok",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "p99",
            "S_TTFT p50",
            "p99",
            "decode tok/s p50",
        ],
        table,
        title=f"\ntiny model, {os.cpu_count()} cores; ms unless noted",
    )


if __name__ == "__main__":
    sys.exit(main())
