"""Int8 weights (engine/cpu/int8.py): quantization, the integer product against numpy at every
row count (exactly against its integer model, within the stated bound against float64), the
engine's bitwise batch invariance with it, and its distance from float32 on the real model."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.cpu.int8 import (
    BLOCK_BYTES,
    BROADCAST_ROWS,
    ROWS,
    Int8Gemm,
    Int8Matrix,
    activation_limit,
    compile_int8,
    pack_blocks,
    quantize,
    select_weights,
)
from pdserve.errors import ConfigError

ROW_COUNTS = [1, 2, 3, ROWS, ROWS + 1, 8, 13, 32, 64, 100, 129]


@pytest.fixture(scope="module")
def int8() -> Int8Gemm:
    return compile_int8(2)


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


def integer_model(x: np.ndarray, w: Int8Matrix) -> np.ndarray:
    """What the kernel computes, in numpy: x's rows quantized to int16, exact int64 sums, scaled."""
    limit = activation_limit(w.k)
    amax = np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    xq = np.rint(x.astype(np.float64) * (limit / np.where(amax > 0, amax, 1.0)))
    assert np.abs(xq).max(initial=0) <= limit
    exact = xq.astype(np.int64) @ w.q.T.astype(np.int64)
    assert np.abs(exact).max(initial=0) < 2**31  # the int32 sums cannot have wrapped
    return (exact * (amax / limit) * w.scale.astype(np.float64)).astype(np.float32)


def test_activation_limit_keeps_every_sum_in_int32() -> None:
    for k in (1, 16, 576, 1536, 8192, 14336, 10**6):
        limit = activation_limit(k)
        assert 1 <= limit <= 32767 and 127 * limit * k <= 2**31 - 1
    assert activation_limit(576) == 29356 and activation_limit(1536) == 11008


def test_blocks_hold_eight_channels_pair_by_pair() -> None:
    q = np.arange(-60, 60, dtype=np.int8).reshape(10, 12)  # 10 channels: a second, partial block
    blocks = pack_blocks(q)
    assert blocks is not None and blocks.shape == (2, 6, 8, 2) and blocks.flags.c_contiguous
    for j in range(16):
        for i in range(12):
            assert blocks[j // 8, i // 2, j % 8, i % 2] == (q[j, i] if j < 10 else 0)
    assert pack_blocks(q[:, :11]) is None  # an odd k: no blocks, the dot product serves every row count
    assert quantize(np.ones((11, 4), np.float32), blocks=True).blocks is None


@pytest.mark.parametrize("m", ROW_COUNTS)
@pytest.mark.parametrize("k,n", [(64, 48), (576, 960), (37, 1001), (1536, 576), (90, 13)])
@pytest.mark.parametrize("blocks", [False, True], ids=["rows", "blocks"])
def test_products_match_numpy_at_every_row_count(
    int8: Int8Gemm, m: int, k: int, n: int, blocks: bool
) -> None:
    """Bitwise-close to the integer model; within the stated bound of float64 x @ dequantized W:
    per output, the activations' half step (max|x[r]| / (2 limit)) times sum_i |W[i, j]|, plus
    float32's rounding of the result. With blocks, from BROADCAST_ROWS rows on the broadcast product
    runs: bitwise the dot product."""
    rng = np.random.default_rng(m * k + n)
    w = quantize(rng.standard_normal((k, n), dtype=np.float32), blocks=blocks)
    x = rng.standard_normal((m, k), dtype=np.float32) * rng.uniform(0.01, 100, (m, 1)).astype(np.float32)
    got = int8.matmul(x, w)
    if w.blocks is not None:
        dot = np.empty_like(got)
        int8.fn(x, w.q, w.scale, int8.scratch, dot)
        assert np.array_equal(got, dot)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, integer_model(x, w), rtol=1e-6, atol=0)
    w64 = w.dequantize().astype(np.float64)
    want = x.astype(np.float64) @ w64
    half_step = np.abs(x).max(axis=1, keepdims=True) / (2 * activation_limit(k))
    bound = half_step * np.abs(w64).sum(axis=0) * 1.001 + np.abs(want) * 2.0**-23
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() <= 1e-4 * np.sqrt(k) * np.abs(want).max()  # and in relative terms


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(int8: Int8Gemm) -> None:
    """Integer sums are exact: a row alone and the same row inside any batch, tiled differently
    (row tiles of 4, blocks of rows, a last odd channel, the dot or the broadcast product), give the
    same bits."""
    rng = np.random.default_rng(7)
    k = 1536
    w = quantize(rng.standard_normal((k, 1001), dtype=np.float32), blocks=True)
    x = rng.standard_normal((300, k), dtype=np.float32)
    assert BLOCK_BYTES // (2 * k) < 300  # more than one block of rows
    assert min(ROW_COUNTS) < BROADCAST_ROWS < max(ROW_COUNTS)  # the dot and the broadcast products
    alone = np.concatenate([int8.matmul(x[r : r + 1], w) for r in range(0, 300, 37)])
    for m in (*ROW_COUNTS, 300):
        got = int8.matmul(x[:m], w)
        for i, r in enumerate(range(0, m, 37)):
            assert np.array_equal(got[r], alone[i]), (m, r)
    int8.threads = 1  # and whatever the thread count
    try:
        assert np.array_equal(int8.matmul(x, w), got)
    finally:
        int8.threads = 2


def test_zero_nonfinite_rows_and_a_small_scratch(int8: Int8Gemm) -> None:
    rng = np.random.default_rng(3)
    w = quantize(rng.standard_normal((50, 70), dtype=np.float32))
    x = rng.standard_normal((7, 50), dtype=np.float32)
    x[1] = 0.0
    x[4, 3] = np.nan
    x[5, 0] = np.inf
    got = int8.matmul(x, w)
    assert np.array_equal(got[1], np.zeros(70, np.float32))
    assert np.isnan(got[4]).all() and np.isnan(got[5]).all()
    fine = [0, 2, 3, 6]
    assert np.array_equal(got[fine], int8.matmul(x[fine], w))
    out = np.empty((7, 70), np.float32)
    int8.fn(x, w.q, w.scale, np.empty(8, np.int16), out)  # too small for 7 x 50: the kernel allocates
    assert np.array_equal(out, got, equal_nan=True)
    with pytest.raises(ValueError, match="x has 49 columns, the int8 matrix 50 rows"):
        int8.matmul(x[:, :49], w)
    wb = quantize(rng.standard_normal((50, 70), dtype=np.float32), blocks=True)  # and the broadcast product's
    xb = np.repeat(x, 3, axis=0)  # 21 rows
    got = int8.matmul(xb, wb)
    assert np.array_equal(got[3], np.zeros(70, np.float32))
    assert np.isnan(got[12:18]).all() and np.array_equal(got[0], int8.matmul(xb[:1], wb)[0])


def test_weights_mode() -> None:
    assert select_weights("f32", 1) is None
    assert isinstance(select_weights("int8", 1), Int8Gemm)
    with pytest.raises(ConfigError, match=r"--weights, PDSERVE_WEIGHTS\) must be one of f32, int8"):
        select_weights("int4", 1)


PROMPTS = ["Hi", "The router picks a prefill and a decode instance from the live set in Redis. " * 3]


def test_int8_is_batch_invariant_and_its_fused_step_is_bitwise_its_layer_path(tiny_model_dir) -> None:
    """The int8 product's rows are exact integer sums, invariant at any row count; the fused step
    calls the same kernel."""
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


def test_a_step_of_many_sequences_takes_the_broadcast_product_bitwise(tiny_model_dir) -> None:
    """From BROADCAST_ROWS decoding sequences on, the fused step multiplies by the packed blocks
    (fused_decode._any_linear): the same bits as the layer path, and as each sequence alone."""
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [f"Request {i} asks the router for a pair." for i in range(BROADCAST_ROWS + 2)]
    common = {
        "num_blocks": 128,
        "max_num_seqs": 32,
        "keep_logits": True,
        "weights": "int8",
        "batch_invariant": True,
    }
    fused = LLM(tiny_model_dir, decode_step="fused", **common)
    stacks = fused.engine.executor.model.stacks
    assert all(blocks.shape[1] for _, _, blocks in stacks.values())  # the tiny model's k are even
    batched = fused.generate(prompts, greedy)
    layers = LLM(tiny_model_dir, decode_step="layers", **common).generate(prompts, greedy)
    alone = [fused.generate(p, greedy)[0] for p in prompts[:2]]
    for i, (a, b) in enumerate(zip(batched, layers, strict=True)):
        assert a.token_ids == b.token_ids
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
        if i < len(alone):
            assert all(np.array_equal(x, y) for x, y in zip(a.logits, alone[i].logits, strict=True))
