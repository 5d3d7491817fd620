"""Llama-family decoder in eager Paddle on a packed token axis, attending through the paged cache.

One forward takes N tokens from many sequences at once: decodes (one token each, grouped by their
padded context length) and prefill chunks. Dense work (norms, QKV, MLP, lm_head) runs on all N rows
together; attention runs per group. Under ``MKL_CBWR=AUTO,STRICT`` GEMM rows are batch-invariant,
and each sequence's attention shape depends only on that sequence, so a sequence gets the same bits
alone or inside any batch. Attention never feeds a transposed view to matmul (Paddle's CPU matmul
copies a strided operand first, many times slower): decode uses a block-diagonal q against K/V
exactly as gathered. With ``decode_kernel`` (paged_kernel.py) decode groups skip the gather and
read the cache in place through their block tables. RMSNorm and SwiGLU are fused or composed per ``Kernels`` (docs/design.md,
"CPU kernels").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pdserve.worker.cpu import Kernels
from pdserve.worker.kv_cache import KVCache
from pdserve.worker.model_config import ModelConfig
from pdserve.worker.paddle_setup import functional as F
from pdserve.worker.paddle_setup import incubate_functional as IF
from pdserve.worker.paddle_setup import paddle
from pdserve.worker.paged_kernel import PagedDecodeKernel


@dataclasses.dataclass
class AttentionGroup:
    """Tokens ``[start, start + num_tokens)`` of the packed batch that attend together.

    Decode group: ``num_seqs`` sequences with one token each, K/V from ``num_chunks`` gathered chunks,
    or, with the in-place kernel, read through ``tables``/``lengths`` (``num_chunks == 0``, no mask).
    Prefill chunk: one sequence; ``num_chunks == 0`` means its first chunk (attend to own tokens only).
    """

    start: int
    num_tokens: int
    num_seqs: int
    num_chunks: int  # rows of the step's combined gather this group owns (2 * seqs * blocks)
    mask: np.ndarray | None  # additive float32: decode [B, 1, T]; fresh prefill [n, n]; chunk [n, 1, T]
    is_decode: bool
    tables: np.ndarray | None = None  # in-place kernel: int64 [B, nblk] block tables
    lengths: np.ndarray | None = None  # in-place kernel: int64 [B] context lengths


@dataclasses.dataclass
class StepInput:
    token_ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [N]
    write_rows: np.ndarray  # int64 [L, 2*N*kvh]
    gather: np.ndarray | None  # int64 [L, total chunks] for all groups, in group order
    groups: list[AttentionGroup]
    output_rows: np.ndarray  # int64 [M]: rows whose logits are needed


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


class Model:
    """Functional forward over fused weights (see weights.load_weights for the names)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, np.ndarray],
        max_len: int,
        kernels: Kernels,
        decode_kernel: PagedDecodeKernel | None = None,
    ) -> None:
        self.cfg = cfg
        self.decode_kernel = decode_kernel  # runs the decode groups that carry block tables
        self._norm = self._fused_norm if kernels.rms_norm == "fused" else self._composed_norm
        self._swiglu = F.swiglu if kernels.swiglu == "fused" else self._composed_swiglu
        self.w = {k: paddle.to_tensor(v) for k, v in weights.items()}
        cos, sin = rope_tables(cfg, max_len)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        self.cos, self.sin = paddle.to_tensor(cos), paddle.to_tensor(sin)
        # The softmax scale is folded into q's tables: saves a pass over every score matrix.
        self.qcos, self.qsin = paddle.to_tensor(cos * scale), paddle.to_tensor(sin * scale)
        kvh = cfg.num_kv_heads
        self.eye = paddle.eye(kvh).reshape([1, kvh, 1, kvh, 1])  # block-diagonal q selector
        self.sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]

    def _fused_norm(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        return IF.fused_rms_norm(x, w, None, self.cfg.rms_norm_eps, 1)[0]

    def _composed_norm(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        # square, not pow: pow(2) is 7x slower on CPU. Row-wise, so still batch-invariant.
        ms = paddle.mean(paddle.square(x), axis=-1, keepdim=True)
        return x * paddle.rsqrt(ms + self.cfg.rms_norm_eps) * w

    @staticmethod
    def _composed_swiglu(gate_up: paddle.Tensor) -> paddle.Tensor:
        gate, up = paddle.chunk(gate_up, 2, axis=-1)
        return F.silu(gate) * up

    def _rope(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        half = self.cfg.head_dim // 2
        return x * cos + paddle.concat([-x[..., half:], x[..., :half]], axis=-1) * sin

    def _linear(self, x: paddle.Tensor, name: str) -> paddle.Tensor:
        y = paddle.matmul(x, self.w[name])
        bias = self.w.get(name + "_bias")
        return y if bias is None else y + bias

    def forward(self, cache: KVCache, step: StepInput) -> paddle.Tensor | None:
        """Run one packed step; writes the new tokens' K/V into ``cache`` and returns logits [M, V]
        (None when no row needs logits, e.g. a step of non-final prefill chunks)."""
        cfg = self.cfg
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ids = paddle.to_tensor(step.token_ids)
        pos = paddle.to_tensor(step.positions)
        n = ids.shape[0]
        x = F.embedding(ids, self.w["embed"])
        cos = paddle.index_select(self.cos, pos).unsqueeze(1)
        sin = paddle.index_select(self.sin, pos).unsqueeze(1)
        qcos = paddle.index_select(self.qcos, pos).unsqueeze(1)
        qsin = paddle.index_select(self.qsin, pos).unsqueeze(1)
        write_rows = paddle.unbind(paddle.to_tensor(step.write_rows), 0)
        gather = paddle.unbind(paddle.to_tensor(step.gather), 0) if step.gather is not None else None
        masks = [None if g.mask is None else paddle.to_tensor(g.mask) for g in step.groups]
        rows = None
        if any(g.tables is not None for g in step.groups):
            rows = cache.kv_view().reshape(-1, D)  # zero-copy; the kernel reads it in place
            shape = (cfg.num_layers, cache.block_size, KVH)
        for layer in range(cfg.num_layers):
            h = self._norm(x, self.w[f"l{layer}.in_norm"])
            q, k, v = paddle.split(self._linear(h, f"l{layer}.qkv"), self.sizes, axis=-1)
            q = self._rope(q.reshape([n, H, D]), qcos, qsin)
            k = self._rope(k.reshape([n, KVH, D]), cos, sin)
            v = v.reshape([n, KVH, D])
            paddle.scatter_(
                cache.rows, write_rows[layer], paddle.concat([k, v], 0).reshape([-1, D]), overwrite=True
            )
            kv_all = paddle.index_select(cache.chunks, gather[layer]) if gather is not None else None
            outs, chunk = [], 0
            for g, mask in zip(step.groups, masks):
                qg = q[g.start : g.start + g.num_tokens]
                if g.tables is not None:  # after scatter_ returned: this layer's new K/V are in place
                    o = self.decode_kernel(rows, shape, layer, qg.numpy(), g.tables, g.lengths)
                    outs.append(paddle.to_tensor(o.reshape(g.num_tokens, H * D)))
                elif g.num_chunks == 0:
                    kg, vg = k[g.start : g.start + g.num_tokens], v[g.start : g.start + g.num_tokens]
                    outs.append(self.dense_causal_attention(qg, kg, vg, mask))
                else:
                    kv = kv_all[chunk : chunk + g.num_chunks]
                    chunk += g.num_chunks
                    outs.append(self.paged_attention(qg, kv, mask, g.num_seqs, g.is_decode))
            o = outs[0] if len(outs) == 1 else paddle.concat(outs, 0)
            x = x + self._linear(o, f"l{layer}.o")
            h = self._norm(x, self.w[f"l{layer}.post_norm"])
            x = x + self._linear(self._swiglu(self._linear(h, f"l{layer}.gate_up")), f"l{layer}.down")
        if step.output_rows.size == 0:
            return None
        if step.output_rows.shape[0] != n or not np.array_equal(step.output_rows, np.arange(n)):
            x = paddle.index_select(x, paddle.to_tensor(step.output_rows))
        x = self._norm(x, self.w["norm"])
        if cfg.tie_word_embeddings:
            return paddle.matmul(x, self.w["embed"], transpose_y=True)
        return paddle.matmul(x, self.w["lm_head"])

    def dense_causal_attention(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor
    ) -> paddle.Tensor:
        """A sequence's first chunk: attend to its own new tokens. q [n,H,D] (pre-scaled), k/v [n,KVH,D]."""
        n = q.shape[0]
        KVH, D = self.cfg.num_kv_heads, self.cfg.head_dim
        G = self.cfg.num_heads // KVH
        qt = q.reshape([n, KVH, G, D]).transpose([1, 2, 0, 3]).reshape([KVH, G * n, D])
        kt, vt = k.transpose([1, 0, 2]), v.transpose([1, 0, 2])
        s = paddle.matmul(qt, kt, transpose_y=True).reshape([KVH, G, n, n]) + mask
        p = F.softmax(s, axis=-1).reshape([KVH, G * n, n])
        return paddle.matmul(p, vt).reshape([KVH, G, n, D]).transpose([2, 0, 1, 3]).reshape([n, KVH * G * D])

    def paged_attention(
        self, q: paddle.Tensor, kv: paddle.Tensor, mask: paddle.Tensor, num_seqs: int, is_decode: bool
    ) -> paddle.Tensor:
        """Attend through gathered cache chunks without transposing K/V.

        q [N,H,D] pre-scaled; kv [2*B*nblk, bs, KVH, D] as gathered. Decode: N == B, one query per
        sequence. Prefill chunk: B == 1, N queries of one sequence. q is spread block-diagonally
        over the KVH*D axis so each head only sees its own kv head.
        """
        n = q.shape[0]
        H, KVH, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        G = H // KVH
        kv = kv.reshape([2, num_seqs, -1, KVH * D])
        kb, vb = kv[0], kv[1]  # [B, T, KVH*D]
        qbd = (q.reshape([n, KVH, G, 1, D]) * self.eye).reshape([n, H, KVH * D])
        if not is_decode:
            kb, vb = kb[0], vb[0]  # [T, KVH*D]: one sequence, many queries
        s = paddle.matmul(qbd, kb, transpose_y=True) + mask  # [N, H, T]
        p = F.softmax(s, axis=-1)
        o = paddle.matmul(p, vb).reshape([n, KVH, G, KVH, D])
        return (o * self.eye).sum(3).reshape([n, H * D])
