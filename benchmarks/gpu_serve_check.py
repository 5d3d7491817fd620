"""The served check on one GPU: ``pdserve up --device cuda`` as a user starts it, twice on one card.

1. A seeded model folder (default: the SmolLM2-135M shape; config and tokenizer only, the weights
   generated at load).
2. A mixed stack (1 mixed instance) and a splitwise stack (1 prefill + 1 decode instance sharing the
   GPU, the KV handed over by whatever ``--kv-transfer`` offers on a GPU: cuda_ipc), each started as
   ``python -m pdserve.cli up --device cuda ...`` with its embedded Redis, ready once /v1/models
   names the model and /v1/instances lists every instance.
3. The same greedy completions (temperature 0, ignore_eos), sent one at a time, on each: splitwise
   must give mixed's text exactly (same kernels, same batch shapes; the KV moves bit for bit).
4. ``pdserve bench`` through the splitwise stack's router.
5. Each stack stopped with SIGINT (pdserve up stops its children in order), killed if it hangs.

Every step is time-bounded; a failed step is recorded and the next runs; the JSON (which names the
card) is rewritten as each step ends, so a run killed at any point keeps what had passed, and the
exit status is 1 if anything failed.

    python benchmarks/gpu_serve_check.py --out gpu-out/gpu_serve.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import write_json

HERE = Path(__file__).resolve().parent
ALIASES = ("smollm2-135m", "smollm2-shape", "smollm2")
PROMPTS = [
    "The quick brown fox jumps over the lazy dog and",
    "Once upon a time, in a small village at the foot of a mountain, there lived an old clockmaker",
    "def fibonacci(n):",
    "The capital of France is",
    "In 1969 the first people walked on the moon; the mission was called",
    "List three colors: red,",
    "A long time ago in a galaxy far, far away, a young farmer looked at the two suns and wondered "
    "whether the stories his uncle told about the old wars were true, and whether he would ever",
    "Numbers: 1, 2, 3, 4,",
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        default="smollm2-135m",
        help="model preset, written seeded (default %(default)s: the SmolLM2-135M shape)",
    )
    ap.add_argument(
        "--models",
        type=Path,
        default=Path(tempfile.gettempdir()) / "pdserve-gpu-models",
        help="where the seeded model folder is written (reused when present) (default %(default)s)",
    )
    ap.add_argument("--out", type=Path, default=Path("gpu-out") / "gpu_serve.json", help="JSON result")
    ap.add_argument("--log", type=Path, default=None, help="the stacks' output (default: --out with .log)")
    ap.add_argument(
        "--max-tokens", type=int, default=32, help="greedy tokens per compared prompt (default 32)"
    )
    ap.add_argument("--kv-transfer", default=None, help="the splitwise stack's --kv-transfer (default: up's)")
    ap.add_argument(
        "--up-args",
        default="",
        help="more flags for both `pdserve up` runs, e.g. '--max-model-len 2048 --cuda-graphs'",
    )
    ap.add_argument("--bench-prompts", type=int, default=64, help="pdserve bench --num-prompts (default 64)")
    ap.add_argument("--bench-concurrency", type=int, default=16, help="pdserve bench --max-concurrency")
    ap.add_argument(
        "--bench-input-len", type=int, default=256, help="pdserve bench --input-len (default 256)"
    )
    ap.add_argument(
        "--bench-output-len", type=int, default=64, help="pdserve bench --output-len (default 64)"
    )
    ap.add_argument("--ready-timeout-s", type=float, default=120, help="per stack start (default 120)")
    ap.add_argument("--bench-timeout-s", type=float, default=90, help="pdserve bench's limit (default 90)")
    ap.add_argument("--device", default="cuda", help="the stacks' --device (default cuda)")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=600,
        help="the whole check's budget: each step gets at most what is left (default %(default)s)",
    )
    return ap.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seeded_model(preset: str, models: Path) -> Path:
    from pdserve.engine.models.model_init import PRESETS, init_model

    names = ALIASES if preset in ALIASES else (preset,)
    name = next((n for n in names if n in PRESETS), None)
    if name is None:
        raise SystemExit(f"no model preset {preset!r} (model_init.PRESETS has {', '.join(PRESETS)})")
    path = models / name
    if not (path / "config.json").is_file():
        init_model(path, preset=name, overwrite=True, seeded=True)
    return path


class Stack:
    """One ``pdserve up`` child (its own session: its workers and Redis are its children)."""

    def __init__(self, name: str, argv: list[str], log: Any) -> None:
        from pdserve.localredis.embedded import dies_with_parent

        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(self.port), *argv]
        log.write(f"\n===== {name}: {' '.join(cmd)} =====\n")
        log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # its own session (Ctrl-C reaches us; we stop it); SIGTERM if this process dies, even by SIGKILL
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=dies_with_parent(),
        )

    def wait_ready(self, instances: int, timeout_s: float) -> dict:
        """Until /v1/models names a model and /v1/instances lists ``instances`` of them."""
        import httpx

        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with code {self.proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                models = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
                live = httpx.get(self.url + "/v1/instances", timeout=2).json()["instances"]
                if models and len(live) >= instances:
                    return {"model": models[0]["id"], "ready_s": time.monotonic() - t0, "instances": live}
            time.sleep(0.5)
        raise TimeoutError(f"not ready after {timeout_s:.0f} s")

    def stop(self, grace_s: float = 60) -> str:
        """SIGINT (pdserve up's orderly stop), then SIGKILL to the whole session if it hangs."""
        if self.proc.poll() is not None:
            return f"already exited ({self.proc.returncode})"
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(grace_s)
            return f"stopped ({self.proc.returncode})"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return f"killed after {grace_s:.0f} s"


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return {"text": choice["text"], "finish_reason": choice.get("finish_reason"), "usage": data.get("usage")}


class Steps:
    """Each step's outcome by name, and the time left before ``--deadline-s``."""

    def __init__(self, deadline_s: float, out: Path, card: str) -> None:
        self.results: dict[str, dict] = {}
        self.deadline = time.monotonic() + deadline_s
        self.interrupted = False
        self.out, self.card = out, card
        self.write()

    def write(self, complete: bool = False) -> list[str]:
        """The JSON as it stands (a temporary file renamed: never half written); the failed steps."""
        bad = [name for name, r in self.results.items() if r["status"] != "ok"]
        doc = {"card": self.card, "complete": complete, "ok": complete and not bad, "failed": bad}
        write_json(self.out, {**doc, "steps": self.results}, quiet=True)
        return bad

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Any) -> Any:
        """``fn()`` recorded under ``name`` (a dict it returns is merged in; its ``status`` wins)."""
        t0 = time.monotonic()
        print(f"[{name}] ... ({self.left():.0f} s left)", file=sys.stderr, flush=True)
        value = None
        if self.interrupted or self.left() < 10:
            why = "interrupted" if self.interrupted else "out of --deadline-s"
            self.results[name] = {"status": "error", "error": f"not run: {why}"}
        else:
            try:
                value = fn()
                self.results[name] = {"status": "ok"}
                if isinstance(value, dict):
                    self.results[name].update(value)
            except Exception as e:
                self.results[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        r = self.results[name]
        r["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[{name}] {r['status']} ({r['seconds']} s) {r.get('error', '')}", file=sys.stderr, flush=True)
        self.write()
        return value


def main() -> int:
    args = parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.log or args.out.with_suffix(".log")
    steps = Steps(args.deadline_s, args.out, card_name(args.device))
    print(f"gpu_serve_check on {steps.card}", file=sys.stderr, flush=True)

    def on_term(signum: int, frame: Any) -> None:  # an outer `timeout`: stop the stacks, then write
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    texts: dict[str, list[str]] = {}
    model = steps.run("model", lambda: {"path": str(seeded_model(args.preset, args.models))})
    layouts = {
        "mixed": (["--mixed", "1", "--prefill", "0", "--decode", "0"], 1),
        "splitwise": (
            ["--prefill", "1", "--decode", "1"]
            + (["--kv-transfer", args.kv_transfer] if args.kv_transfer else []),
            2,
        ),
    }
    with open(log_path, "w") as log:
        for layout, (counts, n_instances) in layouts.items():
            if model is None:
                break
            path = model["path"]
            argv = [
                "--model",
                path,
                "--device",
                args.device,
                "--batch-workers",
                "0",
                *counts,
                *args.up_args.split(),
            ]
            stack = Stack(layout, argv, log)
            try:
                ready = steps.run(
                    f"{layout}/start",
                    lambda s=stack, n=n_instances: s.wait_ready(
                        n, min(args.ready_timeout_s, steps.left() - 20)
                    ),
                )
                if ready is not None:
                    steps.results[f"{layout}/start"]["instances"] = [
                        {k: i.get(k) for k in ("id", "role", "transfer", "kv")}
                        for i in ready.pop("instances")
                    ]
                    steps.run(
                        f"{layout}/greedy",
                        lambda url=stack.url, m=ready["model"], layout=layout: greedy(
                            url, m, layout, texts, args
                        ),
                    )
                    if layout == "splitwise":
                        steps.run(
                            "splitwise/bench",
                            lambda url=stack.url, path=path: run_bench(url, path, args, steps.left() - 15),
                        )
            except KeyboardInterrupt:
                steps.interrupted = True
                steps.results["interrupted"] = {
                    "status": "error",
                    "error": "SIGTERM or SIGINT: stopped early",
                }
            finally:
                grace = 3.0 if steps.interrupted else max(5.0, min(45.0, steps.left() - 5))
                result = stack.stop(grace)
                steps.results[f"{layout}/stop"] = {
                    "status": "error" if result.startswith("killed") else "ok",
                    "result": result,
                }
                steps.write()

    steps.run("splitwise_equals_mixed", lambda: compare(texts))
    bad = steps.write(complete=True)
    print(json.dumps({name: r["status"] for name, r in steps.results.items()}, indent=1))
    bench = steps.results.get("splitwise/bench", {})
    if bench.get("status") == "ok":
        print(
            f"pdserve bench (splitwise, {steps.card}): {bench.get('successful_requests')} ok, "
            f"{bench.get('output_throughput') or 0:.0f} out tok/s, TTFT p50 {bench.get('ttft_p50_ms') or 0:.1f} ms"
        )
    print(f"wrote {args.out} (log {log_path})")
    return 1 if bad else 0


def card_name(device: str) -> str:
    """The GPU the stacks ran on (nvidia-smi's name), or the CPU of a dry run."""
    if device != "cuda":
        return "cpu (dry run)"
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0]
    return "unknown (nvidia-smi did not answer)"


def greedy(url: str, model: str, layout: str, texts: dict[str, list[str]], args: argparse.Namespace) -> dict:
    """The fixed prompts one at a time (the same batch shapes on both stacks), greedy, ignore_eos."""
    outs = [complete(url, model, p, args.max_tokens) for p in PROMPTS]
    texts[layout] = [o["text"] for o in outs]
    short = [o for o in outs if (o["usage"] or {}).get("completion_tokens") != args.max_tokens]
    return {"status": "fail" if short else "ok", "outputs": outs}


def compare(texts: dict[str, list[str]]) -> dict:
    if "mixed" not in texts or "splitwise" not in texts:
        raise RuntimeError("a stack gave no greedy outputs to compare")
    same = [a == b for a, b in zip(texts["mixed"], texts["splitwise"])]
    first = next((i for i, s in enumerate(same) if not s), None)
    diff = None
    if first is not None:
        diff = {
            "prompt": PROMPTS[first],
            "mixed": texts["mixed"][first],
            "splitwise": texts["splitwise"][first],
        }
    return {
        "status": "ok" if all(same) else "fail",
        "equal": f"{sum(same)}/{len(same)}",
        "first_difference": diff,
    }


def run_bench(url: str, model_dir: str, args: argparse.Namespace, limit_s: float) -> dict:
    """``pdserve bench`` as a user runs it, through the router; its saved summary."""
    saved = args.out.with_name(args.out.stem + "_bench.json")
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "bench",
        "--base-url",
        url,
        "--tokenizer",
        model_dir,
        "--num-prompts",
        str(args.bench_prompts),
        "--max-concurrency",
        str(args.bench_concurrency),
        "--input-len",
        str(args.bench_input_len),
        "--output-len",
        str(args.bench_output_len),
        "--ignore-eos",
        "--no-progress",
        "--save-result",
        str(saved),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=max(5.0, min(args.bench_timeout_s, limit_s))
    )
    print(done.stdout[-4000:], file=sys.stderr, flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve bench exited {done.returncode}: {done.stderr[-1500:]}")
    summary = json.loads(saved.read_text())
    out: dict[str, Any] = {
        k: summary.get(k)
        for k in ("successful_requests", "failed_requests", "output_throughput", "request_throughput")
    }
    with contextlib.suppress(KeyError, TypeError):
        out["ttft_p50_ms"] = summary["metrics"]["ttft_ms"]["median"]
        out["tpot_p50_ms"] = summary["metrics"]["tpot_ms"]["median"]
    out["saved"] = str(saved)
    failed = summary.get("failed_requests") or 0
    out["status"] = (
        "ok" if failed == 0 and summary.get("successful_requests") == args.bench_prompts else "fail"
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
