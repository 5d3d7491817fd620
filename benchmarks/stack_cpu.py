"""Where a served token's CPU goes: CPU-ms per generated token of each process of a `pdserve up` stack.

Starts `pdserve up --mixed 1 --prefill 0 --decode 0 --batch-workers 0` (one mixed instance, its
embedded Redis, one router), streams --requests chat completions (greedy, `ignore_eos`, fixed
output length) at --concurrency from this process, and reads every process's and thread's CPU
time (nanoseconds on a CPU, /proc/<pid>/task/<tid>/schedstat) before and after the load. Reported per
generated token (the usage chunks' `completion_tokens`):

  * worker: engine     the worker's threads other than its main one: the engine's thread (every
                       engine step and its detokenization) and the OpenMP/numba threads of
                       `--threads` > 1; what an offline engine step costs, plus request preparation
                       (tokenization, on its own pool);
  * worker: asyncio    the worker's main thread: its event loop (inbox reads, the engine client's
                       hand-offs, the outbox publishes, heartbeat);
  * redis              the embedded redis-server;
  * router             every thread of the router (outbox read, relay, SSE encoding, HTTP);
  * served overhead    everything but the engine: asyncio + redis + router, the served path's
                       added CPU-ms per token;
and tokens/s, with this process's own CPU (the load generator) to show it is not the bottleneck.

--tree NAME=PATH (repeatable) runs the stack from another checkout (e.g. a `git worktree` of the
commit before a change; its `pdserve` comes first on PYTHONPATH), the trees in alternating order
over --rounds, so a before/after comparison shares the host's load; medians over rounds.

    python benchmarks/stack_cpu.py [--requests 32] [--concurrency 8] [--output-len 64]
        [--model smollm2-135m] [--threads 1] [--rounds 2] [--tree before=/tmp/x --tree after=.]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from harness import medians as round_medians
from harness import print_table, write_json

from pdserve import bench

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("worker: engine", "worker: asyncio", "redis", "router")
OVERHEAD = ("worker: asyncio", "redis", "router")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of ``pid``: the scheduler's nanoseconds on a CPU
    (``schedstat``), not ``stat``'s clock ticks (10 ms: too coarse for Redis's share)."""
    out: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for tid in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (tid / "children").read_text().split()]
    return out


def part_of(pid: int) -> str | None:
    """Which process of the stack ``pid`` is, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in argv]
    if "redis-server" in words[0]:  # it rewrites its title: "<path>/redis-server <host:port>"
        return "redis"
    if "pdserve.cli" in words:
        i = words.index("pdserve.cli")
        return words[i + 1] if i + 1 < len(words) else None
    return None


def snapshot(up_pid: int) -> dict[str, float]:
    """CPU seconds so far of each part of the stack (threads of the worker split main / others)."""
    out = dict.fromkeys((*PARTS, "up"), 0.0)
    out["up"] = sum(thread_cpu(up_pid).values())
    for pid in children(up_pid):
        part = part_of(pid)
        threads = thread_cpu(pid)
        if part == "worker":
            out["worker: asyncio"] += threads.pop(pid, 0.0)
            out["worker: engine"] += sum(threads.values())
        elif part in ("redis", "router"):
            out[part] += sum(threads.values())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """`pdserve up` from one checkout, in a session of its own (stopped by its process group)."""

    def __init__(self, tree: Path, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-P", "-m", "pdserve.cli", "up", "--mixed", "1", "--prefill", "0"]
        argv += ["--decode", "0", "--batch-workers", "0", "--port", str(self.port)]
        argv += ["--model", args.model, "--threads", str(args.threads), *args.up_arg]
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited ({self.proc.returncode}); see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                r = httpx.get(self.url + "/v1/models", timeout=2)
                if r.status_code == 200 and r.json()["data"]:
                    return str(r.json()["data"][0]["id"])
            time.sleep(1)
        raise TimeoutError(f"pdserve up not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=90)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def load(
    url: str, model: str, args: argparse.Namespace, n: int, seed: int
) -> tuple[list[bench.Result], float]:
    prompts = bench.random_prompts(n, args.input_len, args.output_len, 0.0, True, random.Random(seed))
    return asyncio.run(
        bench.run(url, "/v1/chat/completions", model, prompts, args.concurrency, float("inf"), True, seed)
    )


def measure(tree: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One stack from ``tree``: warmed up, then --requests measured; CPU-ms per token per part."""
    stack = Stack(tree, args, ROOT / "benchmarks" / "results" / "stack_cpu_up.log")
    try:
        model = stack.wait_ready()
        load(stack.url, model, args, args.concurrency, seed + 1000)  # warm-up: every path compiled
        time.sleep(1.0)
        before, me0, t0 = snapshot(stack.proc.pid), time.process_time(), time.perf_counter()
        results, _ = load(stack.url, model, args, args.requests, seed)
        wall = time.perf_counter() - t0
        after, me1 = snapshot(stack.proc.pid), time.process_time()
    finally:
        stack.stop()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error_kind}: {failed[0].error}")
    tokens = sum(r.output_tokens for r in results)
    row = {part: (after[part] - before[part]) * 1e3 / tokens for part in (*PARTS, "up")}
    row["served overhead"] = sum(row[p] for p in OVERHEAD)
    row["client"] = (me1 - me0) * 1e3 / tokens
    row["tok/s"] = tokens / wall
    row["tokens"] = tokens
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="measured requests per round (default 32)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--input-len", type=int, default=32, help="prompt words (default 32)")
    ap.add_argument("--output-len", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--model", default="smollm2-135m", help="what the worker serves (default smollm2-135m)")
    ap.add_argument("--threads", type=int, default=1, help="the worker's engine threads (default 1)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; trees alternate their order (default 2)")
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a checkout to run the stack from (repeatable; default: this one, as 'this')",
    )
    ap.add_argument("--up-arg", action="append", default=[], help="one more argument for `pdserve up`")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stack_cpu.json")
    args = ap.parse_args()
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("this", str(ROOT))]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            row = measure(Path(path), args, seed=r)
            rows[name].append(row)
            print(
                f"round {r + 1} {name}: {row['tok/s']:.1f} tok/s, overhead {row['served overhead']:.3f} ms/tok",
                file=sys.stderr,
                flush=True,
            )
    medians = {name: round_medians(got) for name, got in rows.items()}
    cols = (*PARTS, "served overhead", "up", "client", "tok/s")
    print_table(
        ["", *medians],
        [[col, *(f"{m[col]:.3f}" for m in medians.values())] for col in cols],
        title=f"\nCPU-ms per generated token ({args.requests} requests x {args.output_len} tokens, "
        f"concurrency {args.concurrency}, {args.model}, --threads {args.threads}; medians of {args.rounds}):",
    )
    report = {
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "median": medians,
        "rounds": rows,
    }
    write_json(args.out, report, args)
    print(f"load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
