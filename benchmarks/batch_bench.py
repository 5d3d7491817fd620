"""Online TTFT with and without a running Batch API batch on the same stack, side by side in one
run, and the batch's throughput alone.

One stack on the tiny model (real engine): 1 prefill + 1 decode instance (``--mixed``: one mixed
instance), one router, one batch worker (``pdserve batch-worker``), an embedded Redis. Online load:
--clients closed-loop clients sending streaming chat requests (--prompt-words random words ±33 %:
about 37-64 tokens; --max-tokens out; greedy, ignore_eos; no two prompts alike), timed to the first
content chunk. After a warm-up, phases alternate --rounds times: A (no batch) and B (a --batch-lines batch of lines like the online
requests, uploaded and created at the start of the phase; the measurement starts once it is
``in_progress`` and has finished a line, and lasts --phase-s). A B phase counts only if the batch
stayed ``in_progress`` and its ``request_counts.completed`` rose during the measurement (polled every
second; "stall s" is the longest stretch without a finished line); the table says when it did not. After each B phase the batch is cancelled and the stack waited idle, so phases
do not overlap. Last, a --throughput-lines batch runs alone (no online load), from its creation to
``completed``: lines/s and generated tokens/s (``usage.completion_tokens`` of its output lines).

Reported per phase: online requests, TTFT p50/p99, B/A ratios over the pooled rounds, batch lines
done during the measurement, and (to explain a difference) each worker's mean engine step time and
batch size and each process's CPU use. Prints a table, writes JSON.

    .venv/bin/python benchmarks/batch_bench.py [--rounds 2] [--phase-s 40] [--quick] [--max-load 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from batch_clients import (  # noqa: E402
    ENDPOINT,
    Timed,
    cancel_batch,
    create_batch,
    get_batch,
    online,
    wait_batch,
    wait_idle,
)
from batch_report import pooled, print_table, summary_line, ttft  # noqa: E402
from harness import Layout, write_json  # noqa: E402
from router_overhead import TICK, cpu_seconds  # noqa: E402  (a sibling script)

from pdserve import bench  # noqa: E402
from pdserve.batch.settings import BatchWorkerSettings  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.localredis.embedded import free_port  # noqa: E402
from pdserve.stack import Stack, StackSpec  # noqa: E402

SETTLE_S = 2.0  # online load runs this long before a phase's measurement starts
WORKER_SERIES = re.compile(
    r"^pdserve_worker_(step_seconds|batch_size)_(sum|count)\{[^}]*role=\"(\w+)\"[^}]*\} (\S+)$", re.M
)


# ---- the workload ------------------------------------------------------------------------------
def prompts(n: int, args: argparse.Namespace, rng: random.Random) -> list[bench.Prompt]:
    """``n`` chat prompts of --prompt-words random words ±33 % (27-53 words: about 37-64 tokens with
    the chat template; every prompt differs, so none hits the prefix cache) and --max-tokens out."""
    out = bench.random_prompts(n, args.prompt_words, args.max_tokens, 1 / 3, True, rng)
    for p in out:
        p.body["max_tokens"] = p.output_len = args.max_tokens
    return out


def batch_file(model: str, items: list[bench.Prompt]) -> bytes:
    """The JSONL input file of a batch: one chat line per prompt, as the online requests (no stream)."""
    lines = []
    for i, p in enumerate(items):
        body = {
            "model": model,
            **p.body,
            "max_tokens": p.output_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(
            orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": ENDPOINT, "body": body})
        )
    return b"\n".join(lines) + b"\n"


# ---- what the processes did ----------------------------------------------------------------------
def host_cpu() -> tuple[float, float]:
    """This host's busy and stolen CPU seconds so far, all cores (from /proc/stat)."""
    with contextlib.suppress(OSError, ValueError):
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        user, nice, system, _, _, irq, softirq, steal = ticks
        return (user + nice + system + irq + softirq) / TICK, steal / TICK
    return 0.0, 0.0


def snapshot(stack: Stack) -> dict[str, Any]:
    """CPU seconds of every process of the stack and of this one (the online clients) so far, the
    host's, and each worker's step and batch-size histogram sums."""
    cpu = {name: cpu_seconds(p.pid) for name, p in stack.workers + stack.routers + stack.batch_workers}
    if stack.redis is not None and stack.redis.proc is not None:
        cpu["redis"] = cpu_seconds(stack.redis.proc.pid)
    cpu["clients"] = time.process_time()
    cpu["host"], cpu["host-steal"] = host_cpu()
    engine: dict[str, float] = {}
    for name, port in stack.metrics_ports.items():
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            for series, part, _, value in WORKER_SERIES.findall(text):
                engine[f"{name}/{series}_{part}"] = float(value)
    return {"t": time.perf_counter(), "cpu": cpu, "engine": engine}


def activity(before: dict, after: dict, workers: list[str]) -> dict[str, Any]:
    """Per worker: mean step ms and batch size between two snapshots; per process: CPU in cores."""
    wall = after["t"] - before["t"]
    out: dict[str, Any] = {"cpu_cores": {}, "engine": {}}
    for name, seconds in after["cpu"].items():
        out["cpu_cores"][name] = (seconds - before["cpu"].get(name, 0.0)) / wall
    cores = out["cpu_cores"]
    ours = sum(c for name, c in cores.items() if not name.startswith("host"))
    cores["others"] = max(0.0, cores["host"] - ours)  # processes not of this benchmark
    for name in workers:

        def delta(key: str, name: str = name) -> float:
            return after["engine"].get(f"{name}/{key}", 0.0) - before["engine"].get(f"{name}/{key}", 0.0)

        steps = delta("step_seconds_count")
        out["engine"][name] = {
            "steps_per_s": steps / wall,
            "step_ms": delta("step_seconds_sum") / steps * 1e3 if steps else None,
            "batch_size": delta("batch_size_sum") / max(1.0, delta("batch_size_count")),
            "busy": delta("step_seconds_sum") / wall,
        }
    return out


# ---- phases ----------------------------------------------------------------------------------------
async def phase(
    stack: Stack, args: argparse.Namespace, kind: str, make: Any, batch_lines: bytes | None
) -> dict[str, Any]:
    """One phase: online load, plus (B) a batch created at its start and cancelled at its end."""
    assert stack.model is not None
    model = stack.model.name
    limits = httpx.Limits(max_connections=args.clients + 4)
    timeout = httpx.Timeout(300, connect=10)
    async with httpx.AsyncClient(base_url=stack.urls[0], timeout=timeout, limits=limits) as client:
        records: list[Timed] = []
        stop_at = [float("inf")]
        batch: dict | None = None
        samples: list[tuple[float, str, int]] = []
        if batch_lines is not None:
            batch = await create_batch(client, batch_lines)
        clients = [
            asyncio.create_task(online(client, model, make, stop_at, records)) for _ in range(args.clients)
        ]
        try:
            if batch is not None:  # the measurement starts once the batch runs
                batch = await wait_batch(
                    client,
                    batch["id"],
                    lambda b: (
                        b["status"] != "validating"
                        and (b["status"] != "in_progress" or b["request_counts"]["completed"] > 0)
                    ),
                    120,
                )
                if batch["status"] in ("failed", "expired", "cancelling", "cancelled"):
                    raise RuntimeError(
                        f"batch {batch['id']} is {batch['status']}, not in_progress: {batch.get('errors')}"
                    )
            await asyncio.sleep(SETTLE_S)
            before = await asyncio.to_thread(snapshot, stack)
            start = time.perf_counter()
            end = start + args.phase_s
            while (now := time.perf_counter()) < end:
                if batch is not None:
                    b = await get_batch(client, batch["id"])
                    samples.append((now - start, b["status"], b["request_counts"]["completed"]))
                await asyncio.sleep(min(1.0, max(0.0, end - time.perf_counter())))
            if batch is not None:
                b = await get_batch(client, batch["id"])
                samples.append((time.perf_counter() - start, b["status"], b["request_counts"]["completed"]))
            after = await asyncio.to_thread(snapshot, stack)
            stop_at[0] = end
            await asyncio.gather(*clients)
        finally:
            stop_at[0] = 0.0
            for task in clients:
                task.cancel()
            if batch is not None:
                batch = await cancel_batch(client, batch["id"])
            await wait_idle(client)
    measured = [r for r in records if start <= r.t0 < end]
    ok = [r for r in measured if r.ok]

    def timing(key: str) -> dict[str, float]:
        return ttft([v for r in ok if (v := r.timing.get(key)) is not None])

    row: dict[str, Any] = {
        "phase": kind,
        "requests": len(measured),
        "failed": len(measured) - len(ok),
        "errors": dict(collections.Counter(r.error for r in measured if not r.ok)),
        "ttft_ms": sorted(r.ttft_ms for r in ok if r.ttft_ms is not None),
        # the prefill instance's side of it: s_ttft = its queue + prefill; the rest is the router,
        # the hand-off, the decode instance's first step and the way back
        **{f"{key}_ms": timing(f"{key}_ms") for key in ("s_ttft", "queue", "prefill", "kv_transfer")},
        "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
        "output_tokens_mean": sum(r.output_tokens for r in ok) / max(1, len(ok)),
        **activity(before, after, [name for name, _ in stack.workers]),
    }
    if batch is not None:  # (the warm-up's small batch may end before its measurement: not reported)
        row |= batch_check(samples, args.phase_s)
        row["batch_id"] = batch["id"]
        row["batch_final"] = {"status": batch["status"], **batch["request_counts"]}
    return row


def batch_check(samples: list[tuple[float, str, int]], window_s: float) -> dict[str, Any]:
    """Whether the batch ran throughout the measurement: ``in_progress`` at every poll and its
    completed count rising; the longest stretch without a finished line says whether it stalled."""
    statuses = {status for _, status, _ in samples}
    done = samples[-1][2] - samples[0][2]
    stall, last_t, last_n = 0.0, samples[0][0], samples[0][2]
    for t, _, n in samples[1:]:
        if n > last_n:
            last_t, last_n = t, n
        stall = max(stall, t - last_t)
    reasons = []
    if statuses != {"in_progress"}:
        reasons.append(f"status {'/'.join(sorted(statuses))}")
    if done <= 0:
        reasons.append("no line finished")
    elif stall > window_s / 2:
        reasons.append(f"no line finished for {stall:.0f} s")
    return {
        "batch_lines_done": done,
        "batch_lines_per_s": done / window_s,
        "batch_longest_stall_s": stall,
        "batch_samples": samples,
        "valid": not reasons,
        "void_reason": "; ".join(reasons),
    }


async def throughput(stack: Stack, args: argparse.Namespace, content: bytes, lines: int) -> dict[str, Any]:
    """A batch alone: from POST /v1/batches to ``completed``; tokens from its output file."""
    async with httpx.AsyncClient(base_url=stack.urls[0], timeout=httpx.Timeout(300, connect=10)) as client:
        before = await asyncio.to_thread(snapshot, stack)
        t0 = time.perf_counter()
        batch = await create_batch(client, content)
        running = await wait_batch(client, batch["id"], lambda b: b["status"] != "validating", 120)
        t_running = time.perf_counter()
        final = ("completed", "failed", "expired", "cancelled")
        batch = await wait_batch(
            client, batch["id"], lambda b: b["status"] in final, args.throughput_timeout_s
        )
        t_done = time.perf_counter()
        after = await asyncio.to_thread(snapshot, stack)
        # A small batch may finish before the first poll sees it in_progress: only its end counts.
        if running["status"] in ("failed", "expired", "cancelled") or batch["status"] != "completed":
            raise RuntimeError(f"batch {batch['id']} ended {batch['status']}: {batch.get('errors')}")
        r = await client.get(f"/v1/files/{batch['output_file_id']}/content")
        r.raise_for_status()
    outputs = [orjson.loads(line) for line in r.content.splitlines() if line.strip()]
    tokens = sum((o["response"]["body"].get("usage") or {}).get("completion_tokens", 0) for o in outputs)
    counts = batch["request_counts"]
    duration = t_done - t0
    return {
        "lines": lines,
        "completed": counts["completed"],
        "failed": counts["failed"],
        "output_lines": len(outputs),
        "completion_tokens": tokens,
        "duration_s": duration,
        "validating_s": t_running - t0,
        "lines_per_s": counts["completed"] / duration,
        "tokens_per_s": tokens / duration,
        **activity(before, after, [name for name, _ in stack.workers]),
    }


# ---- the run ---------------------------------------------------------------------------------------


async def run(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    assert stack.model is not None
    model = stack.model.name
    rng = random.Random(1)

    def make() -> bench.Prompt:
        return prompts(1, args, rng)[0]

    print(
        f"warm-up: {args.warmup_s:.0f} s of online load and a 32-line batch ...", file=sys.stderr, flush=True
    )
    warm = await phase(
        stack,
        argparse.Namespace(**{**vars(args), "phase_s": args.warmup_s}),
        "warm-up",
        make,
        batch_file(model, prompts(32, args, random.Random(2))),
    )
    rows = []
    for i in range(args.rounds):
        for kind in ("A", "B"):
            lines = (
                batch_file(model, prompts(args.batch_lines, args, random.Random(100 + i)))
                if kind == "B"
                else None
            )
            what = f"with a {args.batch_lines}-line batch" if lines else "no batch"
            print(
                f"round {i + 1}/{args.rounds}, phase {kind} ({what}): {args.phase_s:.0f} s ...",
                file=sys.stderr,
                flush=True,
            )
            row = await phase(stack, args, kind, make, lines)
            row["round"] = i + 1
            rows.append(row)
            print(f"  {summary_line(row)}", file=sys.stderr, flush=True)
    n = args.throughput_lines
    print(f"batch alone: {n} lines, no online load ...", file=sys.stderr, flush=True)
    alone = await throughput(stack, args, batch_file(model, prompts(n, args, random.Random(999))), n)
    a, b = pooled(rows, "A"), pooled(rows, "B")
    return {
        "warmup": {k: v for k, v in warm.items() if k not in ("ttft_ms", "batch_samples")},
        "phases": rows,
        "pooled": {
            "A": a,
            "B": b,
            "ratio_p50": b["p50"] / a["p50"],
            "ratio_p99": b["p99"] / a["p99"],
            "all_b_valid": all(r["valid"] for r in rows if r["phase"] == "B"),
        },
        "batch_alone": alone,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="A and B phases each (default %(default)s)")
    ap.add_argument(
        "--phase-s", type=float, default=40.0, help="measured seconds per phase (default %(default)s)"
    )
    ap.add_argument("--warmup-s", type=float, default=10.0, help="warm-up seconds (default %(default)s)")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop online clients (default %(default)s)")
    ap.add_argument(
        "--prompt-words",
        type=int,
        default=40,
        help="mean prompt words, ±33 %%: ~37-64 tokens with the chat template (default %(default)s)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="output tokens of every request and line (default %(default)s)",
    )
    ap.add_argument(
        "--batch-lines", type=int, default=1000, help="lines of each B phase's batch (default %(default)s)"
    )
    ap.add_argument(
        "--throughput-lines",
        type=int,
        default=None,
        help="lines of the batch run alone (default: --batch-lines; --quick: 200)",
    )
    ap.add_argument(
        "--throughput-timeout-s",
        type=float,
        default=900.0,
        help="the batch alone fails past this (default %(default)s)",
    )
    default = BatchWorkerSettings(name="bench")
    ap.add_argument(
        "--max-load",
        type=float,
        default=None,
        help=f"the batch worker's --max-load (default its own: {default.max_load})",
    )
    ap.add_argument(
        "--batch-concurrency",
        type=int,
        default=None,
        help=f"the batch worker's --concurrency (default its own: {default.concurrency})",
    )
    ap.add_argument("--mixed", action="store_true", help="one mixed instance instead of 1 prefill + 1 decode")
    ap.add_argument(
        "--threads", type=int, default=None, help="Paddle threads per worker (default: cores / workers)"
    )
    ap.add_argument("--model", default="tiny", help="a --model source (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="1 round of 15 s phases, a 200-line batch alone")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "batch_bench.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.phase_s, args.warmup_s = 1, 15.0, 5.0
        args.throughput_lines = args.throughput_lines or 200
    args.throughput_lines = args.throughput_lines or args.batch_lines
    # the batch worker reads its flags' defaults from PDSERVE_* (Stack passes it no --max-load)
    if args.max_load is not None:
        os.environ["PDSERVE_MAX_LOAD"] = str(args.max_load)
    if args.batch_concurrency is not None:
        os.environ["PDSERVE_CONCURRENCY"] = str(args.batch_concurrency)
    args.max_load = float(os.environ.get("PDSERVE_MAX_LOAD") or default.max_load)
    args.batch_concurrency = int(os.environ.get("PDSERVE_CONCURRENCY") or default.concurrency)

    counts: Layout = {"mixed": 1, "prefill": 0, "decode": 0} if args.mixed else {"prefill": 1, "decode": 1}
    layout = "1 mixed" if args.mixed else "1P+1D"
    spec = StackSpec(
        model=args.model,
        port=free_port(),
        batch_workers=1,
        metrics=True,
        **counts,
        engine=EngineConfig(max_model_len=2048, num_blocks=4096, threads=args.threads),
        ready_timeout_s=300,
    )
    t0 = time.perf_counter()
    stack = Stack(spec)
    try:
        stack.start()
        stack.wait_ready()
        assert stack.model is not None
        result = asyncio.run(run(stack, args))
    finally:
        stack.stop(grace_s=15)
    result |= {
        "layout": layout,
        "cores": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
    }
    print_table(result, args, layout)
    write_json(args.out, result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
