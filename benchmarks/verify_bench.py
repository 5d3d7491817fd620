"""What shadow verification costs: a splitwise stack's throughput with ``--verify-fraction`` F
against 0, stacks started in alternating rounds on the same prompts.

1 prefill + 1 decode of the real model; --requests completions (64-token prompts, --max-tokens
greedy tokens, --concurrency at a time). Two throughputs: the clients' (requests done over the time
the clients took) and the whole work's (the same requests over the time until the last replay had
its verdict too: replays run at low priority, so under a closed load they wait for the clients and
their cost shows there). Goal: the whole work's throughput costs at most F + 1 %.

    python benchmarks/verify_bench.py [--fraction 0.05] [--rounds 2] [--requests 120]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path

from harness import print_table, served_model, write_json

ROOT = Path(__file__).resolve().parent.parent


def verify_counts(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        s.labels["outcome"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "pdserve_verify"
        for s in f.samples
        if s.name == "pdserve_verify_total"
    }


def one_round(model: str, fraction: float, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    import httpx

    from pdserve.engine.config import EngineConfig
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec

    port = free_port()
    stack = Stack(
        StackSpec(
            model=model,
            port=port,
            prefill=1,
            decode=1,
            batch_workers=0,
            cluster=f"verify-{os.getpid()}-{port}",
            engine=EngineConfig(max_model_len=2048),
            router_options={"verify_fraction": fraction},
        )
    )
    stack.start()
    try:
        stack.wait_ready()
        url, name = stack.urls[0], served_model(stack)
        body = {"model": name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

        def ask(prompt: str) -> int:
            r = httpx.post(url + "/v1/completions", json=body | {"prompt": prompt}, timeout=600)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        ask(prompts[0])  # warm-up
        before = verify_counts(url)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(ask, prompts))
        clients_s = time.perf_counter() - t0
        settled, last_change = before, time.perf_counter()
        while fraction and time.perf_counter() - last_change < 3.0:  # no new verdict for 3 s: done
            time.sleep(0.25)
            now = verify_counts(url)
            if now != settled:
                settled, last_change = now, time.perf_counter()
        total_s = last_change - t0 if fraction else clients_s
        counts = {k: v - before.get(k, 0) for k, v in settled.items()}
        return {
            "fraction": fraction,
            "requests": len(prompts),
            "tokens": tokens,
            "clients_s": clients_s,
            "until_last_verdict_s": max(clients_s, total_s),
            "verify": counts,
        }
    finally:
        stack.stop(grace_s=20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--fraction", type=float, default=0.05, help="--verify-fraction to compare with 0 (default 0.05)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each, alternating (default 2)")
    ap.add_argument("--requests", type=int, default=120, help="requests per round (default 120)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests at once (default 8)")
    ap.add_argument("--model", default="smollm2-135m", help="the model served (default smollm2-135m)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "verify.json")
    args = ap.parse_args()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "ravens",
        "watch",
    ]
    prompts = [
        " ".join(words[(i + j) % len(words)] for j in range(48)) + f" ({i})" for i in range(args.requests)
    ]
    runs: dict[float, list[dict]] = {0.0: [], args.fraction: []}
    for r in range(args.rounds):
        for fraction in (0.0, args.fraction) if r % 2 == 0 else (args.fraction, 0.0):
            got = one_round(args.model, fraction, prompts, args.max_tokens, args.concurrency)
            runs[fraction].append(got)
            print(f"round {r + 1}, fraction {fraction}: {got}", flush=True)

    def rate(run: dict, key: str) -> float:
        return run["requests"] / run[key]

    base = {
        k: statistics.median(rate(x, k) for x in runs[0.0]) for k in ("clients_s", "until_last_verdict_s")
    }
    table, summary = [], {}
    for fraction, fraction_runs in runs.items():
        c = statistics.median(rate(x, "clients_s") for x in fraction_runs)
        w = statistics.median(rate(x, "until_last_verdict_s") for x in fraction_runs)
        verdicts: dict[str, float] = {}
        for x in fraction_runs:
            for k, v in x["verify"].items():
                verdicts[k] = verdicts.get(k, 0) + v
        summary[str(fraction)] = {
            "clients_req_s": c,
            "whole_req_s": w,
            "clients_vs_0": c / base["clients_s"],
            "whole_vs_0": w / base["until_last_verdict_s"],
            "verdicts": verdicts,
        }
        table.append(
            [
                fraction,
                f"{c:.2f}",
                f"{c / base['clients_s']:.3f}x",
                f"{w:.2f}",
                f"{w / base['until_last_verdict_s']:.3f}x",
                verdicts or "-",
            ]
        )
    print()
    print_table(["fraction", "clients req/s", "vs 0", "whole work req/s", "vs 0", "verdicts"], table)
    report = {
        "model": args.model,
        "settings": vars(args) | {"out": str(args.out)},
        "runs": {str(k): v for k, v in runs.items()},
        "summary": summary,
    }
    write_json(args.out, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
