"""bfloat16 against float32 greedy on the torch platform: the share of positions where bf16's argmax
is f32's token, teacher-forced (bf16 reads f32's greedy tokens as its prompt, so one early near-tie
does not make every later position a miss), with how close f32's calls were (the gap between its
two best logprobs, in nats) and how varied its tokens (random weights in a deep shape collapse to
one token repeated, which agrees trivially and measures nothing).

Runs where torch runs: torch's CPU device by default (no GPU needed; what docs/design.md section 8
quotes), ``--device cuda`` on a GPU. The random presets are made under ``--models`` (``tiny`` and
``small`` as the tests write them, the shaped ones seeded); ``smollm2-135m`` is the real
SmolLM2-135M-Instruct checkpoint from pdserve's model cache (``resolve_model``: fetched and
imported once), read from a chat prompt so that its tokens are varied text.

    .venv/bin/python benchmarks/bf16_agreement.py                       # tiny, small, smollm2-shape, smollm2-135m
    .venv/bin/python benchmarks/bf16_agreement.py --presets tiny --tokens 64 --out /tmp/a.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import write_json

PRESETS = ("tiny", "small", "smollm2-shape", "smollm2-135m")
FIRST_ID = 3  # prompt tokens from here up (0..2 are the presets' special tokens)
TEXT_PROMPT = (
    "Write a long, detailed essay on the history of the printing press in Europe: its inventors, "
    "how it spread from city to city, and what it changed in science, religion and politics."
)


def real_checkpoint(preset: str) -> bool:
    from pdserve.engine.models.model_store import FETCHED_PRESETS

    return preset in FETCHED_PRESETS


def model_folder(preset: str, models: Path) -> Path:
    """A made preset under ``models`` (seeded weights for the shaped ones), or the real checkpoint
    from pdserve's model cache (fetched and imported there the first time)."""
    from pdserve.engine.models.model_init import init_model
    from pdserve.engine.models.model_store import SEEDED_PRESETS, resolve_model

    if real_checkpoint(preset):
        return resolve_model(preset).path
    path = models / preset
    if not (path / "config.json").is_file():
        init_model(path, preset=preset, overwrite=True, seeded=preset in SEEDED_PRESETS)
    return path


def new_engine(folder: Path, dtype: str, device: str, max_len: int) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.cuda.torch_executor import TorchPlatform
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device="cpu" if device == "cpu" else "cuda",
        dtype=dtype,
        max_model_len=max_len,
        max_num_seqs=4,
        prefix_caching=False,
        **({"kv_cache_gb": 0.25} if device == "cpu" else {"gpu_memory_utilization": 0.45}),  # type: ignore[arg-type]
    )
    return LLMEngine(folder, config, platform=TorchPlatform(device))


def run_one(engine: Any, prompt: list[int], params: Any) -> dict:
    engine.add_request("r", prompt_token_ids=prompt, params=params)
    out: dict = {"tokens": [], "prompt_logprobs": None}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out["tokens"] += o.token_ids
            out["prompt_logprobs"] = o.prompt_logprobs or out["prompt_logprobs"]
    return out


def agreement(preset: str, models: Path, device: str, tokens: int, seed: int) -> dict:
    """f32 greedy for ``tokens`` tokens from a prompt (24 random tokens, or a chat message for a
    trained model); f32 and bf16 each then read prompt + those tokens (prompt logprobs: the rank of f32's token at every position, and f32's own
    top-2 gap); and bf16 free-running, for where it first departs."""
    from pdserve.sampling_params import SamplingParams

    folder = model_folder(preset, models)
    t0 = time.perf_counter()
    max_len = tokens + 128
    f32 = new_engine(folder, "float32", device, max_len)
    vocab = f32.sampler.vocab_limit
    if real_checkpoint(preset):  # a trained model: a chat prompt, so its 512 tokens are varied text
        prompt = f32.prompt_ids(messages=[{"role": "user", "content": TEXT_PROMPT}])
    else:  # random weights: random tokens (the GPU check's prompts)
        prompt = np.random.default_rng(seed).integers(FIRST_ID, vocab, 24).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ref = run_one(f32, prompt, greedy)["tokens"]
    forced = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    f32_forced = run_one(f32, prompt + ref[:-1], forced)
    f32.close()
    bf16 = new_engine(folder, "bfloat16", device, max_len)
    bf16_forced = run_one(bf16, prompt + ref[:-1], forced)
    own = run_one(bf16, prompt, greedy)["tokens"]
    bf16.close()

    def ranks(out: dict) -> list[int]:
        lps = out["prompt_logprobs"][len(prompt) :]  # position len(prompt) + i scores f32 token i
        return [lp.rank for lp in lps]

    f32_hits = [r == 1 for r in ranks(f32_forced)] + [f32_forced["tokens"][0] == ref[-1]]
    hits = [r == 1 for r in ranks(bf16_forced)] + [bf16_forced["tokens"][0] == ref[-1]]
    gaps = [
        lp.top_logprobs[0][1] - lp.top_logprobs[1][1]
        for lp in f32_forced["prompt_logprobs"][len(prompt) :]
        if lp.top_logprobs and len(lp.top_logprobs) > 1
    ]
    misses = [i for i, h in enumerate(hits) if not h]
    first_diff = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), None)
    return {
        "preset": preset,
        "device": device,
        "tokens": len(hits),
        "agreement": sum(hits) / len(hits),
        "f32_self_agreement": sum(f32_hits) / len(f32_hits),  # prefill vs decode kernels, same dtype
        "misses": len(misses),
        "miss_positions": misses[:40],
        "f32_top2_gap_median_nats": statistics.median(gaps) if gaps else None,
        "f32_top2_gap_at_misses_median_nats": statistics.median(gaps[i] for i in misses if i < len(gaps))
        if [i for i in misses if i < len(gaps)]
        else None,
        "share_of_gaps_below_0.1_nats": sum(g < 0.1 for g in gaps) / len(gaps) if gaps else None,
        "free_running_first_divergence": first_diff,  # bf16's own greedy run (its decode steps)
        "f32_top2_gap_at_divergence_nats": gaps[first_diff] if first_diff is not None else None,
        "distinct_f32_tokens": len(set(ref)),
        # below 0.1: a collapsed model repeating a token, whose agreement measures nothing
        "f32_token_changes": sum(a != b for a, b in itertools.pairwise(ref)) / len(ref),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="cpu (torch's CPU device) or cuda:N")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--models", type=Path, default=None, help="where presets are made (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models = a.models or Path(tmp)
        for preset in [p.strip() for p in a.presets.split(",") if p.strip()]:
            r = agreement(preset, models, a.device, a.tokens, a.seed)
            print(json.dumps(r), flush=True)
            results.append(r)
    if a.out:
        write_json(a.out, {"results": results}, a)
    for r in results:
        gap = r["f32_top2_gap_median_nats"]
        print(
            f"{r['preset']:>14}: bf16 argmax = f32 token at {r['agreement']:.2%} of {r['tokens']} positions "
            f"(f32 changes token at {r['f32_token_changes']:.0%} of them; median top-2 gap "
            f"{'-' if gap is None else f'{gap:.3f}'} nats; free-running bf16 departs at "
            f"{r['free_running_first_divergence']})",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
