"""pdserve on the real SmolLM2-135M-Instruct against a float64 numpy Llama forward written from the
Hugging Face architecture alone (not from pdserve's model code; benchmarks/reference_llama.py, which
the torch platform's tests and the GPU check use too), over the imported safetensors.

The reference: token embedding, per layer RMSNorm -> q/k/v projections -> rotary embedding in HF's
rotate-half layout (theta from config.json) -> grouped-query attention under a causal mask -> o
projection + residual, RMSNorm -> SwiGLU MLP + residual; final RMSNorm and the lm_head (the tied
embedding). It has no KV cache: one causal forward over the prompt followed by pdserve's greedy
tokens gives the logits of the first step and of every decode step at once, so the engine's decode
path (its paged cache) is checked against plain full attention. pdserve runs in float32: its logits must agree
within 1e-4 (max abs difference) at the first step and at each decode step, and its greedy tokens
must be the reference's argmax.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from reference_llama import ReferenceLlama

TOLERANCE = 1e-4
DECODE_STEPS = 4  # greedy tokens per prompt; each one's logits row is compared


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> ReferenceLlama:
    return ReferenceLlama(smollm2_dir)


PATHS = {
    "default": {},  # packed MKL GEMMs, numba attention kernels and the fused decode step where they run
    "layers": {"decode_step": "layers"},  # the same kernels, decode steps one operation at a time
    "plain": {"gemm": "paddle", "attention": "reference"},  # Paddle's matmul and attention only
}


@pytest.fixture(scope="module", params=list(PATHS))
def llm(smollm2_dir: Path, request: pytest.FixtureRequest) -> LLM:
    return LLM(str(smollm2_dir), kv_cache_gb=0.25, threads=1, keep_logits=True, **PATHS[request.param])


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    tok = Tokenizer.from_dir(smollm2_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    story = (
        "Once upon a time, in a small village at the foot of a mountain, there lived an old "
        "clockmaker who repaired every clock in the valley. One winter morning a stranger knocked "
        "on his door carrying a clock that ran backwards. The old man looked at it for a long time and said"
    )
    ids = [
        tok.encode("The quick brown fox jumps"),
        tok.encode(chat, add_special_tokens=False),
        tok.encode(story),
    ]
    assert [len(p) for p in ids] == sorted(len(p) for p in ids) and len(ids[0]) >= 5 and len(ids[2]) <= 60
    return ids


@pytest.fixture(scope="module")
def generations(llm: LLM, prompts: list[list[int]]):
    greedy = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    return llm.generate(prompts, greedy)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["plain-short", "chat", "plain-long"])
def test_logits_and_greedy_tokens_match_the_float64_reference(
    reference: ReferenceLlama, prompts: list[list[int]], generations, index: int
) -> None:
    prompt, gen = prompts[index], generations[index]
    assert len(gen.token_ids) == len(gen.logits) == DECODE_STEPS
    # position len(prompt) - 1 + step predicts generated token ``step``
    wanted = reference.logits(prompt + gen.token_ids[:-1], slice(len(prompt) - 1, None))
    diffs = []
    for step, (token, got, want) in enumerate(zip(gen.token_ids, gen.logits, wanted, strict=True)):
        assert got.shape == want.shape
        diffs.append(float(np.abs(got.astype(np.float64) - want).max()))
        assert token == int(np.argmax(want)), (
            f"step {step}: greedy token {token}, reference {np.argmax(want)}"
        )
    print(f"prompt of {len(prompt)} tokens: max abs logit diff per step {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) < TOLERANCE, f"max abs logit diff per step {diffs}"


def test_reference_is_sensitive_to_the_weights(reference: ReferenceLlama, prompts: list[list[int]]) -> None:
    """The comparison means something: a small change to one layer's weights moves the reference's
    logits far beyond the tolerance."""
    before = reference.logits(prompts[0], slice(-1, None))
    name = "model.layers.29.mlp.down_proj.weight"
    saved = reference.w[name]
    reference.w[name] = saved * 1.001
    try:
        after = reference.logits(prompts[0], slice(-1, None))
    finally:
        reference.w[name] = saved
    assert np.abs(after - before).max() > 100 * TOLERANCE
