"""Decode attention A/B: the reference gather path against the in-place kernel, in ONE process.

Both engines (``attention="reference"`` and ``attention="kernel"``) load the same preset; rounds
alternate which one runs first, and each figure is the median over rounds (the machine is noisy:
comparing within one process and one time window is what keeps the ratio honest). Per round and
engine: prefill tok/s of a 512-token prompt (best of 2 after a warm-up; prefill takes the Paddle
path either way), then decode tok/s at batch 1, 8, 32 with 512 tokens of context (median step of
``--steps``; the history is faked through the KV hand-off API, its bytes are irrelevant).

    python benchmarks/attention_bench.py [--presets tiny,small] [--rounds 5] [--steps 10] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import RESULTS, print_table, write_json
from step_timing import median_step_ms

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.model_init import init_model

CTX = 512
BATCHES = (1, 8, 32)
MODES = ("reference", "kernel")


def measure(engine: LLMEngine, steps: int, tag: str, out: dict[str, list[float]]) -> None:
    rng = np.random.default_rng(0)
    vocab = engine.tokenizer.vocab_size
    prompt = rng.integers(3, vocab, CTX).tolist()
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(3):  # the first one warms up
        engine.add_request(f"{tag}-p{i}", prompt_token_ids=prompt, params=once)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    out.setdefault("prefill 512", []).append(CTX / min(times[1:]))
    forever = SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True)
    for b in BATCHES:
        ids = [f"{tag}-d{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.reserve(rid, CTX)
            engine.add_prefilled(rid, prompt, int(rng.integers(3, vocab)), forever)
        engine.step(), engine.step()  # warm-up
        out.setdefault(f"decode B={b}", []).append(b * 1000 / median_step_ms(lambda _: engine.step(), steps))
        for rid in ids:
            engine.abort(rid)
        engine.step()


def run_preset(preset: str, rounds: int, steps: int, models: Path) -> dict:
    model_dir = models / preset
    if not model_dir.exists():
        init_model(model_dir, preset=preset)
    blocks = max(BATCHES) * (-(-(CTX + steps + 8) // 16)) + 64
    engines = {
        m: LLMEngine(
            model_dir,
            EngineConfig(num_blocks=blocks, max_num_seqs=max(BATCHES), prefill_chunk_size=CTX, attention=m),
        )
        for m in MODES
    }
    results: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    for r in range(rounds):
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            measure(engines[m], steps, f"r{r}", results[m])
    threads = engines["kernel"].threads
    for engine in engines.values():
        engine.close()
    figures = {  # every round measured both paths on every key: no list is empty
        key: {
            "reference": statistics.median(results["reference"][key]),
            "kernel": statistics.median(results["kernel"][key]),
        }
        for key in results["kernel"]
    }
    print_table(
        ["metric", "reference", "kernel", "kernel/ref"],
        [
            [key, f"{f['reference']:.1f}", f"{f['kernel']:.1f}", f"{f['kernel'] / f['reference']:.2f}x"]
            for key, f in figures.items()
        ],
        title=f"\n{preset}: tok/s, median of {rounds} rounds, {threads} threads",
    )
    return {"threads": threads, "rounds": rounds, "tok_s": figures}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--presets", default="tiny,small", help="comma-separated: tiny, small (default %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="measured decode steps per batch size")
    p.add_argument("--models", type=Path, help="where presets are created (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "attention_bench.json")
    args = p.parse_args()
    models = args.models or Path(tempfile.mkdtemp(prefix="pdserve-attention-bench-"))
    presets = {
        p.strip(): run_preset(p.strip(), args.rounds, args.steps, models) for p in args.presets.split(",")
    }
    write_json(args.out, {"statistic": "median over rounds", "presets": presets}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
