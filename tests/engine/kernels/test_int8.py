"""Int8 weights (engine/kernels/int8.py): quantization, both product paths against float64, the
engine's bitwise batch invariance with them, and their distance from float32 on the real model."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.kernels.gemm import bundled_mkl
from pdserve.engine.kernels.int8 import GEMV_ROWS, Int8Gemm, compile_int8, quantize, select_weights
from pdserve.errors import ConfigError


@pytest.fixture(scope="module")
def int8() -> Int8Gemm:
    return compile_int8(2, bundled_mkl())


def test_quantization_is_within_half_a_step_per_output_channel() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48), dtype=np.float32) * np.linspace(0.01, 10, 48, dtype=np.float32)
    m = quantize(w)
    assert m.q.dtype == np.int8 and m.q.shape == (48, 64) and m.scale.shape == (48,)
    assert np.array_equal(m.scale, np.abs(w).max(axis=0) / np.float32(127))  # per output column
    step = np.abs(m.dequantize() - w) / m.scale[None, :]
    assert step.max() <= 0.5 + 1e-5
    assert np.abs(m.q).max() == 127  # each channel's peak uses the whole range
    tied = quantize(np.ascontiguousarray(w.T), transposed=True)  # an embedding used as the lm_head
    assert np.array_equal(tied.q, m.q) and np.array_equal(tied.scale, m.scale)
    zero = quantize(np.zeros((4, 3), np.float32))  # an all-zero channel: scale 1, no NaN
    assert np.array_equal(zero.dequantize(), np.zeros((4, 3), np.float32))


@pytest.mark.parametrize("m", [1, 2, GEMV_ROWS, GEMV_ROWS + 1, 8, 33])
@pytest.mark.parametrize("k,n", [(64, 48), (576, 960), (37, 1000)])
def test_products_match_float64_of_the_dequantized_weight(int8: Int8Gemm, m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * k + n)
    w = quantize(rng.standard_normal((k, n), dtype=np.float32))
    x = rng.standard_normal((m, k), dtype=np.float32)
    want = x.astype(np.float64) @ w.dequantize().astype(np.float64)
    got = int8.matmul(x, w)
    assert got.shape == (m, n) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5 * np.sqrt(k) * np.abs(want).max()


def test_the_mkl_path_tiles_the_output_channels(int8: Int8Gemm) -> None:
    """A scratch of a few channels' rows: many tiles, each written at its columns, the same numbers."""
    rng = np.random.default_rng(3)
    w = quantize(rng.standard_normal((50, 70), dtype=np.float32))
    x = rng.standard_normal((GEMV_ROWS + 3, 50), dtype=np.float32)
    small = Int8Gemm(int8.fn, 2, scratch=50 * 6)  # 6 channels per tile: 12 tiles, the last of 4
    assert np.array_equal(small.matmul(x, w), int8.matmul(x, w))
    with pytest.raises(ValueError, match="x has 49 columns, the int8 matrix 50 rows"):
        int8.matmul(x[:, :49], w)


def test_weights_mode() -> None:
    assert select_weights("f32", 1) is None
    assert isinstance(select_weights("int8", 1), Int8Gemm)
    with pytest.raises(ConfigError, match=r"--weights, PDSERVE_WEIGHTS\) must be one of f32, int8"):
        select_weights("int4", 1)


PROMPTS = ["Hi", "The router picks a prefill and a decode instance from the live set in Redis. " * 3]


def test_int8_is_batch_invariant_and_its_fused_step_is_bitwise_its_layer_path(tiny_model_dir) -> None:
    """MKL_CBWR=AUTO,STRICT (conftest): every int8 product of a batch-invariant step has >= 8 rows
    and takes the MKL path, whose rows are invariant; the fused step calls the same kernel."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    common = {"num_blocks": 64, "keep_logits": True, "weights": "int8", "batch_invariant": True}
    fused = LLM(tiny_model_dir, decode_step="fused", **common)
    assert fused.engine.executor.model.quantized and not fused.engine.executor.model.packed
    alone = [fused.generate(p, greedy)[0] for p in PROMPTS]
    batched = fused.generate(PROMPTS, greedy)
    layers = LLM(tiny_model_dir, decode_step="layers", **common).generate(PROMPTS, greedy)
    for a, b, c in zip(alone, batched, layers, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        for la, lb, lc in zip(a.logits, b.logits, c.logits, strict=True):
            assert np.array_equal(la, lb) and np.array_equal(la, lc)
    f32 = LLM(tiny_model_dir, num_blocks=64, keep_logits=True).generate(PROMPTS[:1], greedy)[0]
    assert not np.array_equal(f32.logits[0], alone[0].logits[0])  # the int8 weights were used


def test_int8_stays_close_to_float32_on_the_real_model(smollm2_dir) -> None:
    """SmolLM2 on two prompts: float32's greedy continuation scored by int8 (teacher forcing)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    f32 = LLM(str(smollm2_dir), kv_cache_gb=0.1, keep_logits=True)
    tok = f32.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [tok.encode(chat, add_special_tokens=False), tok.encode("The quick brown fox jumps over the")]
    reference = f32.generate(prompts, greedy)
    int8 = LLM(str(smollm2_dir), kv_cache_gb=0.1, keep_logits=True, weights="int8")
    first = int8.generate(prompts, greedy.replace(max_tokens=1))
    scored = int8.generate(
        [p + g.token_ids for p, g in zip(prompts, reference)], SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    agree = total = 0
    for p, g, f, s in zip(prompts, reference, first, scored):
        diff = np.abs(f.logits[0] - g.logits[0])
        assert 1e-3 < diff.max() < 3.0  # moved, but little (measured: 0.9-1.6 over five prompts)
        argmax = [lp.top_logprobs[0][0] for lp in s.prompt_logprobs[len(p) :]]
        agree += sum(a == t for a, t in zip(argmax, g.token_ids))
        total += len(g.token_ids)
    assert agree >= 0.9 * total, f"int8 agrees with float32 on {agree} of {total} greedy tokens"
