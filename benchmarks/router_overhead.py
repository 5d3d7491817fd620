"""The router alone, side by side: SGLang's router, vLLM's router and pdserve's, in one invocation.

Each router runs in PD mode in front of workers that cost next to nothing: mock OpenAI engines
(benchmarks/mock_openai_worker.py) for the two peers, `pdserve worker --engine echo` for pdserve
(same protocol, Redis traffic and hand-off as with a model). The same workload goes through each:
--requests streaming chat requests of 16 output tokens, at each --concurrency, driven by
pdserve.bench from this process. Reported per system and concurrency: req/s, p50/p99 TTFT and
end-to-end latency, the router's CPU time per request (user+system of all its processes and
threads, from /proc) and, for pdserve, Redis's too, with the router's outbox reads (XREAD) and all
stream appends (XADD) per request from Redis's INFO commandstats; ratios are to the fastest peer.
The load generator's own CPU share is printed, to show it is not the bottleneck. Everything binds
to 127.0.0.1; the peers' wheels go into a virtual environment this script creates (--peers-venv);
it stops every process it started, by pid.

--workers model runs pdserve alone in front of one prefill and one decode instance of a real model
(--model, default smollm2-135m; one thread each): what the router costs when tokens come at a
model's pace.

    python benchmarks/router_overhead.py [--requests 2000] [--concurrency 32,8,1]
    python benchmarks/router_overhead.py --systems pdserve --workers model --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from harness import fmt, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
PEERS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user+system CPU of a process (all its threads) and of its live descendants."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def free_port() -> int:
    from pdserve.localredis.embedded import free_port as fp

    return fp()


class Procs:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def ensure_peers(venv: Path) -> Path:
    if not (venv / "bin" / "vllm-router").exists() or not (venv / "bin" / "smg").exists():
        print(f"installing {', '.join(PEERS)} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PEERS], check=True)
    return venv


def wait_serving(url: str, model: str, timeout_s: float = 90) -> None:
    """Until one chat request goes through end to end."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(url + "/v1/chat/completions", json=body, timeout=5).status_code == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"{url} did not serve within {timeout_s:.0f} s")


def start_mocks(procs: Procs, model: str, model_dir: Path) -> tuple[int, int, int]:
    p, boot, d = free_port(), free_port(), free_port()
    mock = [
        sys.executable,
        str(HERE / "mock_openai_worker.py"),
        "--model",
        model,
        "--model-path",
        str(model_dir),
    ]
    procs.start("mock-prefill", [*mock, "--port", str(p), "--role", "prefill", "--bootstrap-port", str(boot)])
    procs.start("mock-decode", [*mock, "--port", str(d), "--role", "decode"])
    return p, boot, d


@dataclasses.dataclass
class System:
    url: str
    router_pids: list[int]
    redis_pid: int | None = None  # pdserve's Redis (metered and counted); None for the peers
    redis_url: str | None = None


def start_system(
    name: str, procs: Procs, venv: Path, model: str, model_dir: Path, workers: str = "echo"
) -> System:
    """Start one system: its URL, the router pids to meter, and pdserve's Redis."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name in ("pdserve", "pdserve-nometrics"):
        from pdserve.localredis.embedded import EmbeddedRedis

        redis = EmbeddedRedis()
        redis.start()
        if redis.proc is None:  # start() returns only once its server answers
            raise RuntimeError("EmbeddedRedis.start() returned without a server process")
        procs.procs.append(redis.proc)
        cli = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING"]
        engine = ["--engine", "echo"] if workers == "echo" else ["--threads", "1"]
        for role in ("prefill", "decode"):
            procs.start(
                f"pdserve-{role}",
                [
                    *cli,
                    "worker",
                    *engine,
                    "--role",
                    role,
                    "--model",
                    str(model_dir),
                    "--redis-url",
                    redis.url,
                    "--kv-transfer",
                    "shm",
                ],
            )
        router = procs.start(
            "pdserve-router",
            [
                *cli,
                "router",
                "--port",
                str(port),
                "--redis-url",
                redis.url,
                *(["--no-metrics"] if name == "pdserve-nometrics" else []),
            ],
        )
        return System(url, [router.pid], redis.proc.pid, redis.url)
    p, boot, d = start_mocks(procs, model, model_dir)
    prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if name == "sglang":
        args = [
            str(venv / "bin" / "python"),
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            f"http://127.0.0.1:{p}",
            str(boot),
            "--decode",
            f"http://127.0.0.1:{d}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *prom,
        ]
    else:
        args = [
            str(venv / "bin" / "vllm-router"),
            "--vllm-pd-disaggregation",
            "--prefill",
            f"http://127.0.0.1:{p}",
            "--decode",
            f"http://127.0.0.1:{d}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *prom,
        ]
    router = procs.start(f"{name}-router", args, env={"HF_HUB_OFFLINE": "1"})
    return System(url, [router.pid])


def command_calls(redis_url: str | None) -> dict[str, int]:
    """Redis's calls per command so far (INFO commandstats); empty for a system without Redis."""
    if redis_url is None:
        return {}
    import redis

    with redis.Redis.from_url(redis_url) as r:
        stats = r.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def measure(system: System, model: str, n: int, concurrency: int) -> dict:
    """Warm up, then ``n`` streaming chats at ``concurrency``: latency, req/s, the CPU the router
    and pdserve's Redis spent per request, and pdserve's Redis commands per request."""
    from pdserve import bench

    url, router_pids = system.url, system.router_pids
    redis_pids = [system.redis_pid] if system.redis_pid is not None else []
    rng = __import__("random").Random(0)
    warm = bench.random_prompts(min(100, n), 32, 16, 0.0, True, rng)
    asyncio.run(bench.run(url, "/v1/chat/completions", model, warm, concurrency, float("inf"), True, 0))
    prompts = bench.random_prompts(n, 32, 16, 0.0, True, rng)
    cpu0 = [cpu_seconds(p) for p in router_pids]
    redis0 = sum(cpu_seconds(p) for p in redis_pids)
    calls0 = command_calls(system.redis_url)
    me0 = time.process_time()
    results, duration = asyncio.run(
        bench.run(url, "/v1/chat/completions", model, prompts, concurrency, float("inf"), True, 0)
    )
    me = time.process_time() - me0
    router_cpu = sum(cpu_seconds(p) for p in router_pids) - sum(cpu0)
    redis_cpu = sum(cpu_seconds(p) for p in redis_pids) - redis0 if redis_pids else None
    calls = command_calls(system.redis_url)
    s = bench.summarize(results, duration, (50, 99))
    ok = max(1, s["successful_requests"])
    m = s["metrics"]

    def per_request(command: str) -> float | None:
        return (calls[command] - calls0.get(command, 0)) / ok if command in calls else None

    return {
        "ok": s["successful_requests"],
        "failed": s["failed_requests"],
        "errors": s["errors"],
        "req_s": s["request_throughput"],
        "ttft_p50_ms": m["ttft_ms"]["p50"],
        "ttft_p99_ms": m["ttft_ms"]["p99"],
        "e2e_p50_ms": m["e2e_ms"]["p50"],
        "e2e_p99_ms": m["e2e_ms"]["p99"],
        "router_cpu_ms_per_req": router_cpu / ok * 1e3,
        "redis_cpu_ms_per_req": None if redis_cpu is None else redis_cpu / ok * 1e3,
        "outbox_reads_per_req": per_request("xread"),
        "xadds_per_req": per_request("xadd"),
        "loadgen_cpu_share": me / duration,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--requests", type=int, default=2000, help="measured requests per run (default %(default)s)"
    )
    ap.add_argument("--concurrency", default="32,8,1", help="comma-separated (default %(default)s)")
    ap.add_argument(
        "--systems",
        default="sglang,vllm,pdserve",
        help="which to run: sglang, vllm, pdserve, pdserve-nometrics (its router with --no-metrics) "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="run the systems this many times, alternating (default 1)"
    )
    ap.add_argument(
        "--workers",
        choices=("echo", "model"),
        default="echo",
        help="pdserve's workers: echo (no model, as cheap as the peers' mocks) or model (a real model, "
        "--model; pdserve only) (default %(default)s)",
    )
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="the model of --workers model: a preset or folder (default %(default)s)",
    )
    ap.add_argument("--peers-venv", type=Path, default=Path.home() / ".cache" / "pdserve" / "peers-venv")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router_overhead.json")
    args = ap.parse_args()
    from pdserve.engine.models.model_store import resolve_model

    systems = args.systems.split(",")
    if args.workers == "model" and {"sglang", "vllm"} & set(systems):
        ap.error("--workers model runs pdserve only (the peers' workers are mocks): --systems pdserve")
    # echo: the tiny preset, made once in the cache (no download); it only lends its tokenizer
    model_dir = resolve_model("tiny" if args.workers == "echo" else args.model).path
    model = model_dir.name
    venv = ensure_peers(args.peers_venv) if {"sglang", "vllm"} & set(systems) else args.peers_venv
    logs = args.out.parent / "router_overhead_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_, name in ((r, name) for r in range(args.rounds) for name in systems):
        procs = Procs(logs)
        try:
            system = start_system(name, procs, venv, model, model_dir, args.workers)
            wait_serving(system.url, model, 90 if args.workers == "echo" else 600)
            for c in (int(x) for x in args.concurrency.split(",")):
                print(f"{name}: {args.requests} requests at concurrency {c} ...", file=sys.stderr, flush=True)
                rows.append(
                    {
                        "system": name,
                        "workers": args.workers if name.startswith("pdserve") else "mock",
                        "round": round_,
                        "concurrency": c,
                        **measure(system, model, args.requests, c),
                    }
                )
        finally:
            procs.stop()
    print_rows(rows)
    print_metrics_cost(rows)
    write_json(args.out, {"cores": os.cpu_count(), "requests": args.requests, "rows": rows}, args)
    return 0


def print_rows(rows: list[dict]) -> None:
    table = []
    for r in rows:
        peers = [
            x
            for x in rows
            if x["concurrency"] == r["concurrency"]
            and x["round"] == r["round"]
            and not x["system"].startswith("pdserve")
        ]
        ratio = f"{r['req_s'] / max(x['req_s'] for x in peers):.2f}x" if peers else "-"
        best_cpu = min((x["router_cpu_ms_per_req"] for x in peers), default=None)
        vs_cpu = f"{r['router_cpu_ms_per_req'] / best_cpu:.2f}x" if best_cpu else "-"
        table.append(
            [
                r["system"],
                r["concurrency"],
                r["ok"],
                f"{r['req_s']:.1f}",
                f"{r['ttft_p50_ms']:.2f}",
                f"{r['ttft_p99_ms']:.2f}",
                f"{r['e2e_p50_ms']:.2f}",
                f"{r['e2e_p99_ms']:.2f}",
                f"{r['router_cpu_ms_per_req']:.2f}",
                fmt(r["redis_cpu_ms_per_req"], ".2f"),
                vs_cpu,
                fmt(r["outbox_reads_per_req"], ".2f"),
                fmt(r["xadds_per_req"], ".2f"),
                f"{r['loadgen_cpu_share']:.0%}",
                ratio,
            ]
        )
    print_table(
        [
            "system",
            "conc",
            "ok",
            "req/s",
            "TTFT p50",
            "p99",
            "E2E p50",
            "p99",
            "router CPU",
            "+Redis",
            "vs peer",
            "XREAD",
            "XADD",
            "loadgen",
            "req/s vs best peer",
        ],
        table,
        title=f"\n{os.cpu_count()} cores; streaming chat, 16 output tokens; CPU ms per request; "
        "XREAD (outbox reads) and XADD per request",
    )


def print_metrics_cost(rows: list[dict]) -> None:
    """pdserve's router CPU per request with metrics on vs off (the mean over rounds)."""
    for c in sorted({r["concurrency"] for r in rows}):
        on = [r["router_cpu_ms_per_req"] for r in rows if r["system"] == "pdserve" and r["concurrency"] == c]
        off = [
            r["router_cpu_ms_per_req"]
            for r in rows
            if r["system"] == "pdserve-nometrics" and r["concurrency"] == c
        ]
        if on and off:
            a, b = sum(on) / len(on), sum(off) / len(off)
            print(
                f"concurrency {c}: router CPU {a:.3f} ms/req with metrics, {b:.3f} without: "
                f"{(a / b - 1) * 100:+.1f} % ({len(on)} + {len(off)} runs, alternated)"
            )


if __name__ == "__main__":
    sys.exit(main())
