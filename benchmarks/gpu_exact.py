"""The exactness cells of benchmarks/gpu_bench.py, one job per preset: float32 on the GPU (TF32 off)
against the float64 numpy reference (reference_llama.py), and bfloat16 greedy against float32 greedy
(for smollm2-135m on the real checkpoint where this machine's model cache holds it).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
from gpu_cells import (
    AGREEMENT_FLOOR,
    EXACT_TOLERANCE,
    FIRST_ID,
    Opts,
    Recorder,
    Skip,
    free_memory,
    log,
    model_dir,
    new_engine,
    run_engine,
    torch_setup,
)

AGREE_TEXT = (
    "Write a long, detailed essay on the history of the printing press in Europe: its inventors, "
    "how it spread from city to city, and what it changed in science, religion and politics."
)


def real_checkpoint(want: str) -> Path | None:
    """The real SmolLM2-135M-Instruct where pdserve's model cache on this machine holds its import
    (PDSERVE_CACHE_DIR; never fetched here): the agreement is measured on it, since seeded random
    weights in its shape collapse to one repeated token (benchmarks/bf16_agreement.py)."""
    from pdserve.engine.models.model_store import FETCHED_PRESETS, models_dir

    if want != "smollm2-135m":
        return None
    found = sorted(models_dir().glob(f"{want}-{FETCHED_PRESETS[want].member_sha256[:12]}-v*/config.json"))
    return found[-1].parent if found else None


def job_exact(rec: Recorder, o: Opts, preset: str | None) -> None:
    """One preset's two cells (a job each, so that one preset's hang or crash costs no other's)."""
    want = preset or o.exact_presets[0]
    big = want.startswith("llama3-8b")
    state: dict[str, Any] = {}
    slow = 4 if o.quick else 1
    rec.cell("f32_logits", (120 if big else 50) * slow, lambda: exact_logits(o, want, state))
    rec.cell("bf16_agreement", (80 if big else 50) * slow, lambda: exact_agreement(o, want, state))
    state.clear()
    free_memory(o)


def _exact_engine(o: Opts, folder: Path, dtype: str, **extra: Any) -> Any:
    return new_engine(
        o,
        folder,
        dtype=dtype,
        max_num_seqs=8,
        max_model_len=o.agree_tokens + 160,
        prefix_caching=False,
        **({"gpu_memory_utilization": 0.45} if o.device == "cuda" else {"kv_cache_gb": 0.25}),
        **extra,
    )


def exact_logits(o: Opts, want: str, state: dict) -> dict:
    """float32 engine logits (prompt's last position and each decode step) vs the float64 reference;
    also the f32 greedy tokens the agreement cell compares bf16 with."""
    from reference_llama import ReferenceLlama, relative_error

    from pdserve.sampling_params import SamplingParams

    torch_setup(o)
    real = real_checkpoint(want)
    folder = real or model_dir(o, want)
    state["folder"], state["real"] = folder, real is not None
    steps = 6
    engine = _exact_engine(o, folder, "float32", keep_logits=True)
    try:
        vocab = engine.tokenizer.vocab_size
        rng = np.random.default_rng(11)
        prompts = [rng.integers(FIRST_ID, vocab, n).tolist() for n in (5, 37, 100)]
        greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        got = run_engine(engine, {f"x{i}": (p, greedy) for i, p in enumerate(prompts)})
        agree_prompt = rng.integers(FIRST_ID, vocab, 24).tolist()
        if state["real"]:  # a trained model loops on random tokens: a chat prompt gives varied text
            agree_prompt = engine.prompt_ids(messages=[{"role": "user", "content": AGREE_TEXT}])
        long = SamplingParams(max_tokens=o.agree_tokens, temperature=0, ignore_eos=True)
        state["prompt"] = agree_prompt
        state["f32_tokens"] = run_engine(engine, {"long": (agree_prompt, long)})["long"]["token_ids"]
        state["vocab_limit"] = int(getattr(getattr(engine, "sampler", None), "vocab_limit", vocab))
    finally:
        engine.close()
        del engine
        free_memory(o)
    ref = ReferenceLlama(folder)
    errs, argmax_ok, rows = [], 0, 0
    limit = state["vocab_limit"]
    for i, p in enumerate(prompts):
        g = got[f"x{i}"]
        if len(g["logits"]) != steps:
            raise RuntimeError(f"{len(g['logits'])} logits rows kept for {steps} steps (keep_logits)")
        want_rows = ref.logits(p + g["token_ids"][:-1], slice(len(p) - 1, None))
        for step, (row, wrow, tok) in enumerate(zip(g["logits"], want_rows, g["token_ids"])):
            errs.append(relative_error(row, wrow))
            argmax_ok += int(tok == int(np.argmax(wrow[:limit])))
            rows += 1
            log.info("%s prompt %d step %d: rel err %.2e", want, i, step, errs[-1])
    del ref
    rel = max(errs)
    return {
        "status": "ok" if rel <= EXACT_TOLERANCE and argmax_ok == rows else "fail",
        "rel_err": rel,
        "rel_err_per_row": errs,
        "greedy_matches_reference": f"{argmax_ok}/{rows}",
        "limit": EXACT_TOLERANCE,
        "prompt_lens": [len(p) for p in prompts],
        "steps": steps,
    }


def exact_agreement(o: Opts, want: str, state: dict) -> dict:
    """bf16 against the f32 greedy tokens of :func:`exact_logits`: teacher-forced (bf16 reads f32's
    tokens as its prompt; its argmax at each position, from the prompt logprobs' ranks) and free
    running (where bf16's own greedy tokens first depart)."""
    from pdserve.sampling_params import SamplingParams

    if "f32_tokens" not in state:
        raise RuntimeError("the f32 cell did not produce its greedy tokens")
    prompt, ref_tokens = state["prompt"], state["f32_tokens"]
    n = len(ref_tokens)
    engine = _exact_engine(o, state["folder"], "bfloat16")
    try:
        forced = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
        free = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        r = run_engine(engine, {"forced": (prompt + ref_tokens[:-1], forced), "free": (prompt, free)})
    finally:
        engine.close()
        del engine
        free_memory(o)
    lps = r["forced"]["prompt_logprobs"]
    # prompt position len(prompt) + i carries the logprob (and rank) of f32 token i given what precedes
    ranks = [lp.rank for lp in lps[len(prompt) :]] if lps else []
    if len(ranks) != n - 1 or any(rank is None for rank in ranks):
        raise RuntimeError(f"prompt logprobs: {len(ranks)} ranks for {n - 1} positions")
    hits = [rank == 1 for rank in ranks] + [r["forced"]["token_ids"][0] == ref_tokens[-1]]
    agreement = sum(hits) / n
    own = r["free"]["token_ids"]
    first_diff = next((i for i, (a, b) in enumerate(zip(own, ref_tokens)) if a != b), None)
    distinct = len(set(ref_tokens))
    changes = sum(a != b for a, b in itertools.pairwise(ref_tokens)) / n
    if changes < 0.1:  # random weights in a deep shape collapse to a repeated token: nothing measured
        raise Skip(f"f32 greedy changes token at {changes:.0%} of {n} positions: a collapsed model")
    return {
        "status": "ok" if agreement >= AGREEMENT_FLOOR else "fail",
        "agreement": agreement,
        "model": "checkpoint" if state.get("real") else "seeded random weights",
        "distinct_f32_tokens": distinct,
        "f32_token_changes": changes,
        "tokens": n,
        "mismatch_positions": [i for i, h in enumerate(hits) if not h][:50],
        "free_running_first_divergence": first_diff,
        "free_running_positional_match": sum(a == b for a, b in zip(own, ref_tokens)) / n,
        "limit": AGREEMENT_FLOOR,
    }
