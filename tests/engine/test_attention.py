"""Paged attention (through the block-major cache, bucketed block tables, null-block padding)
against a dense numpy reference, over mixed lengths, batch sizes and block boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.batcher import blocks_for
from pdserve.engine.block_manager import NULL_BLOCK
from pdserve.engine.cpu.host_cpu import Kernels
from pdserve.engine.cpu.kv_cache import KVCache
from pdserve.engine.cpu.paddle_model import Model
from pdserve.engine.cpu.paddle_setup import paddle
from pdserve.engine.model_runner import decode_bucket
from pdserve.engine.models.model_config import ModelConfig

TOL = 1e-4
CFG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=1024,
)
BS = 16


def dense_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
    """Plain GQA softmax attention in float64: q [n,H,D] (already scaled), k/v [T,KVH,D]; query i sees
    keys 0..q_pos[i]."""
    H, KVH = q.shape[1], k.shape[1]
    kk = np.repeat(k, H // KVH, axis=1).astype(np.float64)
    vv = np.repeat(v, H // KVH, axis=1).astype(np.float64)
    s = np.einsum("nhd,thd->nht", q.astype(np.float64), kk)
    s = np.where(np.arange(k.shape[0])[None, None, :] > q_pos[:, None, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nht,thd->nhd", p, vv).reshape(q.shape[0], -1)


@pytest.fixture(scope="module")
def model() -> Model:
    rng = np.random.default_rng(0)
    w = {"embed": rng.standard_normal((64, 64), dtype=np.float32)}
    return Model(CFG, w, max_len=1024, kernels=Kernels("composed", "composed", "attention only"))


def fill_sequence(cache: KVCache, rng: np.random.Generator, length: int, free: list[int]):
    """Random K/V for ``length`` tokens written into scattered blocks; returns (block table, k, v) of layer 0."""
    table = [free.pop(int(rng.integers(len(free)))) for _ in range(blocks_for(length, BS))]
    arr = cache.tensor.numpy()
    k = rng.standard_normal((length, CFG.num_kv_heads, CFG.head_dim), dtype=np.float32)
    v = rng.standard_normal((length, CFG.num_kv_heads, CFG.head_dim), dtype=np.float32)
    for t in range(length):
        arr[table[t // BS], 0, 0, t % BS] = k[t]
        arr[table[t // BS], 1, 0, t % BS] = v[t]
    paddle.assign(paddle.to_tensor(arr), cache.tensor)
    return table, k, v


@pytest.mark.parametrize("lengths", [[1], [16], [17], [15, 16, 17, 33], [5, 48, 130, 31, 64, 7, 200, 129]])
def test_decode_attention_matches_dense(model: Model, lengths: list[int]) -> None:
    rng = np.random.default_rng(len(lengths) * 1000 + sum(lengths))
    cache = KVCache(CFG, 128, BS)
    free = list(range(1, 128))
    seqs = [fill_sequence(cache, rng, n, free) for n in lengths]
    nblk = decode_bucket(max(blocks_for(n, BS) for n in lengths))
    table = np.full((len(lengths), nblk), NULL_BLOCK, np.int64)
    for i, (t, _, _) in enumerate(seqs):
        table[i, : len(t)] = t
    kv = paddle.index_select(cache.chunks, paddle.to_tensor(cache.gather_chunks(table)[0]))
    lens = np.asarray(lengths)
    mask = np.where(np.arange(nblk * BS)[None, :] < lens[:, None], 0.0, -np.inf).astype(np.float32)[
        :, None, :
    ]
    q = rng.standard_normal((len(lengths), CFG.num_heads, CFG.head_dim), dtype=np.float32)
    got = model.paged_attention(paddle.to_tensor(q), kv, paddle.to_tensor(mask), len(lengths), True).numpy()
    for i, (_, k, v) in enumerate(seqs):
        want = dense_reference(q[i : i + 1], k, v, np.array([lengths[i] - 1]))
        assert np.abs(got[i] - want[0]).max() <= TOL


@pytest.mark.parametrize(("start", "end"), [(16, 20), (512, 700), (100, 101), (31, 64)])
def test_prefill_chunk_attention_matches_dense(model: Model, start: int, end: int) -> None:
    rng = np.random.default_rng(start + end)
    cache = KVCache(CFG, 128, BS)
    table, k, v = fill_sequence(cache, rng, end, list(range(1, 128)))
    nblk = blocks_for(end, BS)
    kv = paddle.index_select(cache.chunks, paddle.to_tensor(cache.gather_chunks(np.asarray([table]))[0]))
    pos = np.arange(start, end)
    mask = np.where(np.arange(nblk * BS)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)[
        :, None, :
    ]
    q = rng.standard_normal((end - start, CFG.num_heads, CFG.head_dim), dtype=np.float32)
    got = model.paged_attention(paddle.to_tensor(q), kv, paddle.to_tensor(mask), 1, False).numpy()
    assert np.abs(got - dense_reference(q, k, v, pos)).max() <= TOL


@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_first_chunk_attention_matches_dense(model: Model, n: int) -> None:
    rng = np.random.default_rng(n)
    q = rng.standard_normal((n, CFG.num_heads, CFG.head_dim), dtype=np.float32)
    k = rng.standard_normal((n, CFG.num_kv_heads, CFG.head_dim), dtype=np.float32)
    v = rng.standard_normal((n, CFG.num_kv_heads, CFG.head_dim), dtype=np.float32)
    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    got = model.dense_causal_attention(*map(paddle.to_tensor, (q, k, v, mask))).numpy()
    assert np.abs(got - dense_reference(q, k, v, np.arange(n))).max() <= TOL


def test_decode_bucket_pads_at_most_one_eighth() -> None:
    for n in range(1, 2000):
        b = decode_bucket(n)
        assert n <= b <= max(n, 8) * 1.125 + 1e-9


def test_whole_model_paged_decode_matches_dense_recompute(tiny_model_dir) -> None:
    """Logits of incremental decoding through the paged cache vs one dense prefill of the same tokens."""
    from pdserve import LLM, SamplingParams

    llm = LLM(tiny_model_dir, num_blocks=64, keep_logits=True)
    prompt = llm.tokenizer.encode("Paged attention must equal dense attention, block after block.")
    gen = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    tokens = prompt + gen.token_ids
    for cut in (len(prompt) + 1, len(prompt) + 17, len(tokens) - 1):  # crossing block boundaries
        dense = llm.generate([tokens[:cut]], SamplingParams(temperature=0, max_tokens=1))[0]
        assert np.abs(dense.logits[0] - gen.logits[cut - len(prompt)]).max() <= TOL
