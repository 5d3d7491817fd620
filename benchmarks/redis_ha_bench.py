"""The control plane on one Redis, on Sentinel (with and without --redis-wait-replicas), and on a
3-primary Redis Cluster, side by side in one invocation.

The same stack each time: --routers routers and --instances prefill + --instances decode workers
with the echo engine (no model: every request costs the control plane what a real one does, and
next to nothing else), all on 127.0.0.1. The same workload goes through each configuration:
--requests streaming chats of 16 output tokens at --concurrency, spread over the routers, driven
by pdserve.bench from this process. Reported: req/s, TTFT p50/p99, and the CPU the routers and the
Redis processes spent per request (user+system from /proc). Prints a table and writes JSON.

    python benchmarks/redis_ha_bench.py [--requests 2000] [--concurrency 64] [--configs single,cluster]

``--failover ROUNDS`` measures something else instead: streams failed per Sentinel failover. A
primary, 2 replicas, 3 Sentinels, a router and a prefill/decode pair of the model (a real one: its
streams last long enough), all with --redis-wait-replicas 1; each round streams --streams
completions of --failover-tokens tokens, SIGKILLs the primary once every stream is decoding, and
counts the streams that end with an error (and the attempts the router retried or migrated), then
restarts the old primary as a replica. Writes results/redis_failover.json.

    python benchmarks/redis_ha_bench.py --failover 3 [--streams 16] [--failover-tokens 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import print_table, served_model, write_json  # noqa: E402
from router_overhead import cpu_seconds  # noqa: E402  (a sibling script)

import pdserve  # noqa: E402
from pdserve import bench  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.localredis.embedded import EmbeddedRedis, free_port  # noqa: E402
from pdserve.localredis.embedded_ha import EmbeddedCluster, EmbeddedSentinel  # noqa: E402
from pdserve.stack import Stack, StackSpec  # noqa: E402

CONFIGS = ("single", "sentinel", "sentinel-wait1", "cluster")


def start_redis(config: str) -> tuple[Any, str, Callable[[], list[int]]]:
    """The Redis of one configuration: (server, URL, the pids to meter)."""
    if config == "single":
        single = EmbeddedRedis()
        single.start()
        return single, single.url, lambda: [single.proc.pid] if single.proc else []
    if config.startswith("sentinel"):
        sentinel = EmbeddedSentinel(replicas=2 if config == "sentinel-wait1" else 1)
        sentinel.start()
        return sentinel, sentinel.url, lambda: [p.pid for _, _, p in sentinel.processes() if p is not None]
    cluster = EmbeddedCluster(primaries=3)
    cluster.start()
    return cluster, cluster.url, lambda: [p.pid for _, _, p in cluster.processes() if p is not None]


def run_config(config: str, args: argparse.Namespace, model: str) -> dict[str, Any]:
    server, url, redis_pids = start_redis(config)
    spec = StackSpec(
        batch_workers=0,
        model=model,
        redis_url=url,
        engine_kind="echo",
        routers=args.routers,
        prefill=args.instances,
        decode=args.instances,
        port=free_port(count=args.routers),
        cluster=f"bench{os.getpid()}",
        redis_wait_replicas=1 if config == "sentinel-wait1" else 0,
        engine=EngineConfig(num_blocks=4096, threads=1),
        ready_timeout_s=120,
    )
    stack = Stack(spec)
    try:
        stack.start()
        stack.wait_ready()
        router_pids = [p.pid for _, p in stack.routers]
        served = served_model(stack)
        rng = __import__("random").Random(0)

        async def drive(n: int) -> tuple[list[bench.Result], float]:
            """``n`` chats, an equal share through each router at once."""
            prompts = bench.random_prompts(n, 32, 16, 0.0, True, rng)
            share = -(-n // len(stack.urls))
            per_router = args.concurrency // len(stack.urls) or 1
            t0 = time.perf_counter()
            runs = await asyncio.gather(
                *(
                    bench.run(
                        u,
                        "/v1/chat/completions",
                        served,
                        prompts[i * share : (i + 1) * share],
                        per_router,
                        float("inf"),
                        True,
                        0,
                    )
                    for i, u in enumerate(stack.urls)
                )
            )
            return [r for results, _ in runs for r in results], time.perf_counter() - t0

        asyncio.run(drive(min(200, args.requests)))  # warm-up
        cpu0 = sum(cpu_seconds(p) for p in router_pids)
        redis0 = sum(cpu_seconds(p) for p in redis_pids())
        results, duration = asyncio.run(drive(args.requests))
        router_cpu = sum(cpu_seconds(p) for p in router_pids) - cpu0
        redis_cpu = sum(cpu_seconds(p) for p in redis_pids()) - redis0
    finally:
        stack.stop(grace_s=15)
        server.close()
    s = bench.summarize(results, duration, (50, 99))
    ok = max(1, s["successful_requests"])
    return {
        "config": config,
        "ok": s["successful_requests"],
        "failed": s["failed_requests"],
        "errors": s["errors"],
        "req_s": s["request_throughput"],
        "ttft_p50_ms": s["metrics"]["ttft_ms"]["p50"],
        "ttft_p99_ms": s["metrics"]["ttft_ms"]["p99"],
        "router_cpu_ms_per_req": router_cpu / ok * 1e3,
        "redis_cpu_ms_per_req": redis_cpu / ok * 1e3,
    }


def counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


async def one_stream(hc: httpx.AsyncClient, url: str, body: dict[str, Any], seen: list[int], i: int) -> str:
    """'finished', or 'error: <code>' (a refusal, an error event, or a stream cut short)."""
    async with hc.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return f"error: HTTP {resp.status_code}"
        last = None
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                last = orjson.loads(line[6:])
                if "error" in last:
                    return f"error: {last['error']['code']}"
                seen[i] += 1
    if last is None or last["choices"][0].get("finish_reason") is None:
        return "error: cut short"
    return "finished"


def run_failover(args: argparse.Namespace) -> dict[str, Any]:
    """``args.failover`` rounds of: streams in flight, the primary SIGKILLed, streams counted."""
    sentinel = EmbeddedSentinel(replicas=2)  # WAIT 1 needs a replica left after the promotion
    sentinel.start()
    spec = StackSpec(
        batch_workers=0,
        model=args.model,
        redis_url=sentinel.url,
        prefill=1,
        decode=1,
        port=free_port(),
        cluster=f"failover{os.getpid()}",
        redis_wait_replicas=1,
        redis_wait_timeout_ms=2000,
        engine=EngineConfig(threads=1),
        ready_timeout_s=180,
    )
    stack = Stack(spec)
    rounds: list[dict[str, Any]] = []
    try:
        stack.start()
        stack.wait_ready()
        url = stack.urls[0] + "/v1/completions"
        body = {
            "model": served_model(stack),
            "max_tokens": args.failover_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

        async def one_round(r: int) -> dict[str, Any]:
            seen = [0] * args.streams
            async with httpx.AsyncClient(timeout=600) as hc:
                before = httpx.get(stack.urls[0] + "/metrics", timeout=10).text
                tasks = [
                    asyncio.create_task(
                        one_stream(hc, url, {**body, "prompt": f"round {r} stream {i} " * 2}, seen, i)
                    )
                    for i in range(args.streams)
                ]
                while min(seen) < 3 and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.01)
                killed_at = time.monotonic()
                old = await asyncio.to_thread(sentinel.kill_primary)
                in_flight = sum(not t.done() for t in tasks)
                outcomes = await asyncio.gather(*tasks)
                done_s = time.monotonic() - killed_at
                after = httpx.get(stack.urls[0] + "/metrics", timeout=10).text
            await asyncio.to_thread(sentinel.wait_for_failover, old.port, 60)
            await asyncio.to_thread(sentinel.wait_replicas_in_sync, 60)
            await asyncio.to_thread(sentinel.restart, old)
            errors = sorted({o for o in outcomes if o != "finished"})
            return {
                "in_flight_at_kill": in_flight,
                "failed": sum(o != "finished" for o in outcomes),
                "errors": errors,
                "retried": counter(after, "pdserve_retries_total") - counter(before, "pdserve_retries_total"),
                "migrated": counter(after, "pdserve_migrations_total")
                - counter(before, "pdserve_migrations_total"),
                "all_done_after_kill_s": round(done_s, 1),
            }

        for r in range(args.failover):
            print(f"failover round {r + 1}/{args.failover} ...", file=sys.stderr, flush=True)
            rounds.append(asyncio.run(one_round(r)))
            print(f"  {rounds[-1]}", file=sys.stderr, flush=True)
    finally:
        stack.stop(grace_s=15)
        sentinel.close()
    return {
        "pdserve": str(Path(pdserve.__file__).parent),
        "streams": args.streams,
        "tokens": args.failover_tokens,
        "rounds": rounds,
        "failed_per_failover": sum(r["failed"] for r in rounds) / max(1, len(rounds)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--requests", type=int, default=2000, help="measured requests per configuration (default %(default)s)"
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="requests in flight, over all routers (default %(default)s)",
    )
    ap.add_argument("--routers", type=int, default=2, help="routers (default %(default)s)")
    ap.add_argument(
        "--instances",
        type=int,
        default=2,
        help="prefill and as many decode echo workers (default %(default)s)",
    )
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)} (default all)"
    )
    ap.add_argument(
        "--model", default="tiny", help="whose tokenizer the echo workers use (default %(default)s)"
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default results/redis_ha.json)")
    ap.add_argument(
        "--failover",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="measure streams failed per Sentinel failover instead, over this many failovers",
    )
    ap.add_argument(
        "--streams", type=int, default=16, help="--failover: streams per round (default %(default)s)"
    )
    ap.add_argument(
        "--failover-tokens", type=int, default=300, help="--failover: tokens per stream (default %(default)s)"
    )
    args = ap.parse_args()
    if args.failover:
        result = run_failover(args)
        print_table(
            ["round", "in flight", "failed", "retried", "migrated", "done after kill s", "errors"],
            [
                [
                    i + 1,
                    r["in_flight_at_kill"],
                    r["failed"],
                    f"{r['retried']:.0f}",
                    f"{r['migrated']:.0f}",
                    f"{r['all_done_after_kill_s']:.1f}",
                    ", ".join(r["errors"]),
                ]
                for i, r in enumerate(result["rounds"])
            ],
            title=f"\n{os.cpu_count()} cores; pdserve from {result['pdserve']}",
        )
        print(f"streams failed per failover: {result['failed_per_failover']:.1f} of {args.streams}")
        write_json(
            args.out or HERE / "results" / "redis_failover.json", {"cores": os.cpu_count(), **result}, args
        )
        return 0
    args.out = args.out or HERE / "results" / "redis_ha.json"
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: unknown {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    rows = []
    for config in configs:
        print(
            f"{config}: {args.requests} requests at concurrency {args.concurrency} ...",
            file=sys.stderr,
            flush=True,
        )
        rows.append(run_config(config, args, args.model))
    print_table(
        ["config", "ok", "failed", "req/s", "TTFT p50 ms", "p99", "router CPU ms/req", "Redis CPU ms/req"],
        [
            [
                r["config"],
                r["ok"],
                r["failed"],
                f"{r['req_s']:.1f}",
                f"{r['ttft_p50_ms']:.1f}",
                f"{r['ttft_p99_ms']:.1f}",
                f"{r['router_cpu_ms_per_req']:.2f}",
                f"{r['redis_cpu_ms_per_req']:.2f}",
            ]
            for r in rows
        ],
        title=f"\n{os.cpu_count()} cores; {args.routers} routers, {args.instances}P + {args.instances}D echo workers; "
        "streaming chat, 16 output tokens",
    )
    write_json(args.out, {"cores": os.cpu_count(), "rows": rows}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
