"""Greedy tokens and raw logits are bitwise identical: one engine, a batch, and prefill -> KV bytes ->
decode in another process with different block ids (MKL_CBWR=AUTO,STRICT, set in conftest).

Every test runs in both kernel paths: ``auto`` (the fused ops this CPU runs) and ``composed`` (the
plain ops every CPU runs), so a CI machine of either kind covers the code the other kind runs.
Decode attention is the default one, the in-place kernel where numba compiles (the reference path's
invariance is tested in tests/engine/cpu/test_attention_kernels.py)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.disaggregate import generate_disaggregated
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine

PROMPTS = [
    "Hi",
    "The router picks a prefill and a decode instance from the live set in Redis.",
    "Long prompts are prefilled in chunks so running decodes keep moving. " * 12,  # > 1 chunk of 128
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, GREEDY.replace(prompt_logprobs=3)]  # the long prompt's logprobs too (chunked)


@pytest.fixture(scope="module", params=["auto", "composed"])
def config(request) -> EngineConfig:
    return EngineConfig(num_blocks=256, prefill_chunk_size=128, keep_logits=True, kernels=request.param)


def test_strict_mkl_mode_is_on() -> None:
    assert os.environ.get("MKL_CBWR") == "AUTO,STRICT"


@pytest.fixture(scope="module")
def alone(tiny_model_dir, config: EngineConfig):
    """Each prompt on its own in a fresh engine: the reference."""
    llm = LLM(tiny_model_dir, **vars(config))
    return [llm.generate(p, params)[0] for p, params in zip(PROMPTS, PARAMS)]


def assert_same(ref, got) -> None:
    for a, b in zip(ref, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.prompt_logprobs == a.prompt_logprobs  # None, or the same floats
        assert len(b.logits) == len(a.logits) == GREEDY.max_tokens
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert np.array_equal(la, lb), f"max abs diff {np.abs(la - lb).max()}"


def test_prompts_differ_in_length(alone, config: EngineConfig) -> None:
    lengths = [len(g.prompt_token_ids) for g in alone]
    assert len(set(lengths)) == 3 and max(lengths) > config.prefill_chunk_size
    assert len(alone[2].prompt_logprobs) == lengths[2]  # the long one is scored


def test_batched_equals_alone(tiny_model_dir, alone, config: EngineConfig) -> None:
    """The same sequences inside one batch, next to sequences of other lengths that started earlier."""
    engine = LLMEngine(tiny_model_dir, config)
    assert engine.executor.kernels.swiglu == (
        "composed" if config.kernels == "composed" else "fused"
    )  # the path asked for
    for i, text in enumerate(["a b c d e f g " * n for n in (1, 5, 9, 20, 40)]):
        engine.add_request(f"other-{i}", text, GREEDY)
    engine.step(), engine.step()  # the others are decoding when ours join
    got = {f"p{i}": Generation(f"p{i}", []) for i in range(len(PROMPTS))}
    for rid, text, params in zip(got, PROMPTS, PARAMS):
        engine.add_request(rid, text, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in got:
                got[out.request_id].add(out)
    assert_same(alone, list(got.values()))


@pytest.mark.parametrize("transfer", ["shm", "bytes"])
def test_prefill_decode_processes_equal_alone(
    tiny_model_dir, alone, config: EngineConfig, transfer: str
) -> None:
    decode = LLMEngine(tiny_model_dir, dataclasses.replace(config, num_blocks=300, shared_kv=True))
    try:
        taken = decode.reserve("shift-block-ids", 37 * config.block_size)  # D hands out different ids than P
        got = generate_disaggregated(
            tiny_model_dir, PROMPTS, PARAMS, config, transfer=transfer, decode_engine=decode
        )
        assert len(taken) == 37
        assert_same(alone, got)
    finally:
        decode.close()
