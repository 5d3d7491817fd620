"""Engine throughput vs the bare reference model, side by side in one run.

For each preset (tiny, small = ERNIE-4.5-0.3B shape) this measures, in a fresh process each:
  * the pdserve engine: prefill tok/s of a 512-token prompt (one engine step: batching, sampling,
    detokenization included) and decode tok/s at batch 1, 8, 32 with 512 tokens of context;
  * the bare model of ../shared/reference/engine_scripts/bench_model.py on the same shapes.
Rounds alternate engine and bare runs; each figure is the best round. Prints a table, writes JSON.

    python benchmarks/engine_bench.py [--presets tiny,small] [--rounds 2] [--out benchmarks/results/engine.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BARE = ROOT.parent / "shared" / "reference" / "engine_scripts" / "bench_model.py"
BARE_CONFIG = {"tiny": "tiny", "small": "ernie03b"}
BATCHES = (1, 8, 32)
CTX = 512


def engine_worker(model_dir: str, steps: int, prefill_reps: int) -> dict:
    """Runs in a child process: measures one engine."""
    import numpy as np

    from pdserve import SamplingParams
    from pdserve.worker.engine import EngineConfig, LLMEngine

    maxb = max(BATCHES)
    blocks = maxb * (-(-(CTX + steps + 8) // 16)) + 64
    engine = LLMEngine(model_dir, EngineConfig(num_blocks=blocks, max_num_seqs=maxb, prefill_chunk_size=CTX))
    vocab = engine.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab, CTX).tolist()
    res: dict = {"threads": engine.threads}
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(prefill_reps + 1):  # the first one warms up
        engine.add_request(f"p{i}", prompt_token_ids=prompt, params=once)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    res["prefill_s"] = min(times[1:])
    res["prefill_tok_s"] = CTX / res["prefill_s"]
    forever = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for b in BATCHES:
        for i in range(b):  # fake a 512-token history through the KV hand-off API (bytes are irrelevant)
            rid = f"d{b}-{i}"
            engine.reserve(rid, CTX)
            engine.add_prefilled(rid, prompt, int(rng.integers(3, vocab)), forever)
        engine.step(), engine.step()  # warm-up
        ts = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            ts.append(time.perf_counter() - t)
        ms = 1000 * statistics.median(ts)
        res[f"decode_b{b}_ms"] = ms
        res[f"decode_b{b}_tok_s"] = b * 1000 / ms
        for i in range(b):
            engine.abort(f"d{b}-{i}")
        engine.step()
    return res


def run_engine(model_dir: Path, steps: int, prefill_reps: int) -> dict:
    here, args = str(Path(__file__).parent), f"{str(model_dir)!r}, {steps}, {prefill_reps}"
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); from engine_bench import engine_worker; "
        f"print('RESULT ' + json.dumps(engine_worker({args})))"
    )
    return _result(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False))


def run_bare(script: Path, config: str, steps: int, prefill_reps: int, workdir: Path, threads: int) -> dict:
    cmd = [
        sys.executable,
        str(script),
        config,
        "--threads",
        str(threads),
        "--steps",
        str(steps),
        "--prefill",
        str(CTX),
        "--prefill-reps",
        str(prefill_reps),
        "--ctx",
        str(CTX),
        "--batches",
        ",".join(map(str, BATCHES)),
    ]
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    return _result(subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=env, check=False))


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"benchmark child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def best(rounds: list[dict], key: str, lower_is_better: bool = False) -> float:
    values = [r[key] for r in rounds if key in r]
    return min(values) if lower_is_better else max(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--presets", default="tiny,small", help="comma-separated: tiny, small (default %(default)s)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="alternating engine/bare rounds (default %(default)s)"
    )
    ap.add_argument("--steps", type=int, default=10, help="measured decode steps per batch size")
    ap.add_argument("--prefill-reps", type=int, default=3, help="measured 512-token prefills")
    ap.add_argument("--bare-script", type=Path, default=DEFAULT_BARE, help="the reference bench_model.py")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine.json")
    ap.add_argument(
        "--models", type=Path, default=None, help="where presets are created (default: a temp dir)"
    )
    args = ap.parse_args()
    if not args.bare_script.is_file():
        ap.error(f"--bare-script {args.bare_script} not found")
    from pdserve.worker.model_init import init_model

    threads = int(os.environ.get("PDSERVE_THREADS", 0)) or os.cpu_count() or 1
    report: dict = {
        "machine": {"cpus": os.cpu_count(), "threads": threads, "mkl_cbwr": os.environ.get("MKL_CBWR")},
        "context": CTX,
        "presets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or Path(tmp)
        for preset in args.presets.split(","):
            model_dir = models / preset
            if not (model_dir / "config.json").is_file():
                print(f"[{preset}] creating model folder ...", file=sys.stderr, flush=True)
                init_model(model_dir, preset=preset)
            engine_rounds, bare_rounds = [], []
            for r in range(args.rounds):
                print(f"[{preset}] round {r + 1}/{args.rounds}: engine ...", file=sys.stderr, flush=True)
                engine_rounds.append(run_engine(model_dir, args.steps, args.prefill_reps))
                print(f"[{preset}] round {r + 1}/{args.rounds}: bare model ...", file=sys.stderr, flush=True)
                bare_rounds.append(
                    run_bare(
                        args.bare_script,
                        BARE_CONFIG[preset],
                        args.steps,
                        args.prefill_reps,
                        Path(tmp),
                        threads,
                    )
                )
            rows = {
                "prefill_tok_s": (best(engine_rounds, "prefill_tok_s"), best(bare_rounds, "prefill_tok_s"))
            }
            for b in BATCHES:
                key = f"decode_b{b}_tok_s"
                rows[key] = (best(engine_rounds, key), best(bare_rounds, key))
            report["presets"][preset] = {
                k: {"engine": e, "bare": b, "ratio": e / b} for k, (e, b) in rows.items()
            } | {"rounds": {"engine": engine_rounds, "bare": bare_rounds}}
    print(f"\n{'preset':<7} {'metric':<18} {'engine':>10} {'bare':>10} {'ratio':>7}")
    for preset, res in report["presets"].items():
        for key, v in res.items():
            if key != "rounds":
                print(f"{preset:<7} {key:<18} {v['engine']:>10.1f} {v['bare']:>10.1f} {v['ratio']:>7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
