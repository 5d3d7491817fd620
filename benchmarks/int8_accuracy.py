"""How far int8 weights move SmolLM2-135M-Instruct from float32, next to llama.cpp's Q8_0.

pdserve in float32 generates ``--tokens`` greedy tokens for each prompt (four chat questions and a
story opening). Along each of those sequences (teacher forcing: every variant sees the same tokens)
it reports, per variant:
  * the max abs difference of the first generated token's logits from pdserve float32's;
  * top-1 agreement: how many of the float32 greedy tokens are also the variant's argmax;
  * free-running: how many prompts the variant continues with the same tokens all the way.
Variants: pdserve ``--weights int8``; with ``--llamacpp-python`` (benchmarks/llamacpp_env.sh),
llama.cpp on the same model's F32 and Q8_0 GGUF (benchmarks/llamacpp_score.py), so Q8_0 is measured
against the same float32 reference. Prints a table, writes JSON.

    python benchmarks/int8_accuracy.py [--tokens 32] [--llamacpp-python .llamacpp/bin/python]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from engine_bench import run_llamacpp_script
from harness import print_table, write_json

if TYPE_CHECKING:
    from pdserve.engine.llm import Generation

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers.",
)
STORY = "Once upon a time, in a small village at the foot of a mountain, there lived an old clockmaker who"


def llamacpp_scores(python: Path, gguf: Path, sequences: list[list[int]], starts: list[int]) -> dict:
    request = json.dumps({"sequences": sequences, "starts": starts})
    return run_llamacpp_script([str(python), str(HERE / "llamacpp_score.py"), str(gguf)], request)


def prompt_argmax(scored: Generation, start: int) -> list[int]:
    """The top-1 token id at each prompt position from ``start`` on, of a run with prompt_logprobs=1."""
    if scored.prompt_logprobs is None:
        raise RuntimeError(f"{scored.request_id}: no prompt logprobs, though asked for")
    best = []
    for lp in scored.prompt_logprobs[start:]:
        if not lp.top_logprobs:
            raise RuntimeError(f"{scored.request_id}: a prompt position without its top logprob")
        best.append(lp.top_logprobs[0][0])
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default %(default)s)")
    ap.add_argument("--llamacpp-python", type=Path, default=None, metavar="PYTHON")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int8_accuracy.json")
    args = ap.parse_args()
    from pdserve import LLM, SamplingParams
    from pdserve.engine.models.model_store import DEFAULT_MODEL, resolve_model

    model = resolve_model(DEFAULT_MODEL).path
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    f32 = LLM(str(model), kv_cache_gb=0.25, keep_logits=True)
    tok = f32.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ] + [tok.encode(STORY)]
    reference = f32.generate(prompts, greedy)
    del f32
    sequences = [p + g.token_ids for p, g in zip(prompts, reference)]
    starts = [len(p) for p in prompts]
    variants: dict[str, dict] = {}

    int8 = LLM(str(model), kv_cache_gb=0.25, keep_logits=True, weights="int8")
    free = int8.generate(prompts, greedy)
    scored = int8.generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    variants["pdserve int8"] = {
        "argmax": [prompt_argmax(s, start) for s, start in zip(scored, starts)],
        "first": [g.logits[0] for g in free],
        "same_continuation": sum(a.token_ids == b.token_ids for a, b in zip(free, reference)),
    }
    del int8
    if args.llamacpp_python is not None:
        for gguf in sorted((args.llamacpp_python.parent.parent / "models").glob("*.gguf")):
            got = llamacpp_scores(args.llamacpp_python, gguf, sequences, starts)["sequences"]
            variants[f"llama.cpp {gguf.stem}"] = {
                "argmax": [s["argmax"] for s in got],
                "first": [np.asarray(s["first"], np.float32) for s in got],
            }
    total = sum(len(g.token_ids) for g in reference)
    report: dict = {"model": DEFAULT_MODEL, "prompts": len(prompts), "tokens": total, "variants": {}}
    rows = []
    for name, v in variants.items():
        diff = max(float(np.abs(np.asarray(f) - g.logits[0]).max()) for f, g in zip(v["first"], reference))
        agree = sum(int(a == t) for arg, g in zip(v["argmax"], reference) for a, t in zip(arg, g.token_ids))
        same = v.get("same_continuation")
        report["variants"][name] = {
            "max_abs_logit_diff": diff,
            "top1_agreement": agree,
            "same_greedy_run": same,
        }
        same_text = f"{same}/{len(prompts)}" if same is not None else "-"
        rows.append([name, f"{diff:.3f}", f"{agree}/{total}", same_text])
    print_table(
        ["variant", "max abs d logit (first)", "top-1 agreement", "same greedy run"],
        rows,
        title=f"\nSmolLM2-135M-Instruct, {len(prompts)} prompts x {args.tokens} greedy tokens of pdserve float32",
    )
    write_json(args.out, report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
