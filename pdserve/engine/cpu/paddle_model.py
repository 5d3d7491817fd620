"""Llama-family decoder in eager Paddle on a packed token axis, attending through the paged cache.

One forward takes N tokens from many sequences at once: decodes (one token each, grouped by their
padded context length) and prefill chunks. Dense work (norms, QKV, MLP, lm_head) runs on all N rows
together; attention runs per group. Under ``MKL_CBWR=AUTO,STRICT`` GEMM rows are batch-invariant,
and each sequence's attention shape depends only on that sequence, so a sequence gets the same bits
alone or inside any batch. Attention never feeds a transposed view to matmul (Paddle's CPU matmul
copies a strided operand first, many times slower): decode uses a block-diagonal q against K/V
exactly as gathered. With the numba ``AttentionKernels`` (cpu/attention.py) RoPE and the K/V write
are one pass, decode groups skip the gather and read the cache in place through their block
tables, every prefill chunk runs causal tiles at absolute positions over the cache (a prompt row's
bits depend only on its position and the K/V before it, never on the chunking: exact across chunk
starts, which a prefix cache relies on; the reference path is close, not exact), and SwiGLU and
each residual add + RMSNorm (and the first and final norm) are one numba pass, and the whole layer
path runs on numpy arrays (MKL through ctypes; no Paddle tensor per operand), the weights shared
with Paddle's through DLPack. With a ``PackedMkl`` (cpu/gemm.py) the linear layers and lm_head
multiply against weights packed once for MKL, which replace the plain ones; under
``MKL_CBWR=AUTO,STRICT`` its rows are batch-invariant too. Otherwise RMSNorm and SwiGLU are fused
or composed per ``Kernels`` (docs/design.md, "CPU kernels").
With the kernels and linear weights packed or quantized, a step whose every token decodes runs as
one compiled call instead (cpu/fused_decode.py) with bitwise the same logits; with an
``Int8Gemm`` the linear layers and lm_head hold int8 rows per output channel (cpu/int8.py), and
the layers those bytes again in blocks of 8 channels, which a prefill's many rows multiply faster.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from pdserve.engine.block_manager import NULL_BLOCK
from pdserve.engine.cpu.attention import bind_causal_tiles
from pdserve.engine.cpu.compiled_attention import AttentionKernels
from pdserve.engine.cpu.fused_decode import FusedDecode, FusedWeights, no_int8
from pdserve.engine.cpu.gemm import PackedMatrix, PackedMkl
from pdserve.engine.cpu.host_cpu import Kernels
from pdserve.engine.cpu.int8 import Int8Gemm, Int8Matrix, quantize
from pdserve.engine.cpu.int8_tiles import LANES
from pdserve.engine.cpu.kv_cache import KVCache
from pdserve.engine.cpu.model_attention import ModelAttention
from pdserve.engine.cpu.paddle_setup import functional as F
from pdserve.engine.cpu.paddle_setup import incubate_functional as IF
from pdserve.engine.cpu.paddle_setup import paddle
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import release_pages
from pdserve.engine.step_input import StepInput


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


LINEARS = ("qkv", "o", "gate_up", "down")  # each layer's weights, l{i}.{name} ([in, out])


class Model(ModelAttention):
    """Functional forward over fused weights (see weights.load_weights for the names)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
        max_len: int,
        kernels: Kernels,
        attention_kernels: AttentionKernels | None = None,
        gemm: PackedMkl | None = None,
        fused: FusedDecode | None = None,
        int8: Int8Gemm | None = None,
    ) -> None:
        self.cfg = cfg
        self.kernels = attention_kernels  # None: every attention op in Paddle (the reference path)
        self.int8 = int8  # int8 weights (cpu/int8.py): the linear layers and lm_head quantized
        self.gemm = gemm if int8 is None else None  # None: Paddle's matmul on plain weights
        self.compiled_tiles = bind_causal_tiles(attention_kernels, gemm)  # with int8 weights too
        self.packed: dict[str, PackedMatrix] = {}
        self.quantized: dict[str, Int8Matrix] = {}
        self.w: dict[str, paddle.Tensor] = {}
        self.weight_bytes = 0  # float32 bytes of the weights taken (the checkpoint's parameters)
        # Each weight is held once: the packed copies replace the plain ones (dropped as each is
        # packed, while ``weights`` streams in); other weights become Paddle tensors over the very
        # same memory (DLPack, no copy). A tied embedding stays for the lookup beside its packed
        # lm_head; when it maps the checkpoint file, only the rows looked up stay resident. With int8
        # weights the quantized copies (int8, each layer's in one stack per linear) replace them.
        packable = {f"l{i}.{n}" for i in range(cfg.num_layers) for n in LINEARS}
        packable |= set() if cfg.tie_word_embeddings else {"lm_head"}
        self.stacks = self._int8_stacks() if int8 is not None else {}
        for name, array in weights.items() if isinstance(weights, Mapping) else weights:
            self.weight_bytes += array.nbytes
            if int8 is not None and name in packable:
                self.quantized[name] = self._quantize_into_stack(name, array)
                continue
            if self.gemm is not None and name in packable:
                self.packed[name] = self.gemm.pack(array)
                continue
            if name == "embed" and cfg.tie_word_embeddings and (self.gemm is not None or int8 is not None):
                if int8 is not None:
                    self.quantized["lm_head"] = quantize(array, transposed=True)
                else:
                    assert self.gemm is not None  # the condition above
                    self.packed["lm_head"] = self.gemm.pack(array, transposed=True)
                release_pages(array)  # packing read all of it; the lookup needs only its rows
            self.w[name] = paddle.from_dlpack(np.ascontiguousarray(array))
        self._norm = self._fused_norm if kernels.rms_norm == "fused" else self._composed_norm
        self._swiglu = F.swiglu if kernels.swiglu == "fused" else self._composed_swiglu
        # the kernel path's operands as numpy arrays over the very same memory: norms, biases, embedding
        self.w_np = {k: np.from_dlpack(self.w[k]) for k in self.w if k.endswith(("norm", "_bias"))}
        self.embed_np = np.from_dlpack(self.w["embed"])
        cos, sin = rope_tables(cfg, max_len)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        qcos, qsin = cos * scale, sin * scale  # the softmax scale folded into q's tables
        self.rope_np = (cos, sin, qcos, qsin)  # rope_write's operands
        self.cos, self.sin = paddle.from_dlpack(cos), paddle.from_dlpack(sin)  # the same memory
        self.qcos, self.qsin = paddle.from_dlpack(qcos), paddle.from_dlpack(qsin)
        kvh = cfg.num_kv_heads
        self.eye = paddle.eye(kvh).reshape([1, kvh, 1, kvh, 1])  # block-diagonal q selector
        self.sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        # The fused decode step (cpu/fused_decode.py) calls the same kernels and GEMMs.
        linears = self.gemm is not None or int8 is not None
        self.fused = fused if attention_kernels is not None and linears else None
        self.fused_weights = self._fused_weights() if self.fused is not None else None

    def _int8_stacks(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Empty int8 [L, out, in], scale [L, out] and blocks [L, out / 8, in / 2, 8, 2] stacks, one
        per linear (the fused step takes each linear's layers as one array; blocks: int8.pack_blocks,
        [L, 0, 0, 8, 2] where ``in`` is odd)."""
        cfg = self.cfg
        shapes = {
            "qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
            "o": (cfg.hidden_size, cfg.q_size),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size),
        }
        L = cfg.num_layers

        def blocks(n: int, k: int) -> tuple[int, ...]:
            return (L, -(-n // LANES), k // 2, LANES, 2) if k % 2 == 0 else (L, 0, 0, LANES, 2)

        return {
            name: (
                np.empty((L, n, k), np.int8),
                np.empty((L, n), np.float32),
                np.empty(blocks(n, k), np.int8),
            )
            for name, (n, k) in shapes.items()
        }

    def _quantize_into_stack(self, name: str, array: np.ndarray) -> Int8Matrix:
        if name == "lm_head":  # one row per sequence: the dot product's, no blocks
            return quantize(array)
        layer, linear = name.split(".")
        q, scale, blocks = self.stacks[linear]
        i = int(layer[1:])
        m = quantize(array, blocks=bool(blocks.shape[1]))
        if m.q.shape != q.shape[1:]:
            raise ValueError(f"weight {name}: shape {array.shape} does not match the model's config")
        q[i], scale[i] = m.q, m.scale
        if m.blocks is None:
            return Int8Matrix(q[i], scale[i])  # views of the stacks
        blocks[i] = m.blocks  # the bytes a prefill's products read (int8.pack_blocks)
        return Int8Matrix(q[i], scale[i], blocks[i])

    def _fused_weights(self) -> FusedWeights:
        cfg, L = self.cfg, self.cfg.num_layers
        norms = [self.w_np[f"l{i}.{n}"] for i in range(L) for n in ("in_norm", "post_norm")]
        biases = tuple(
            np.stack([np.from_dlpack(self.w[f"l{i}.{n}_bias"]) for i in range(L)])
            if f"l0.{n}_bias" in self.w
            else np.zeros((L, 0), np.float32)
            for n in LINEARS
        )
        common: dict[str, Any] = {
            "norms": np.stack([*norms, self.w_np["norm"]]),
            "eps": cfg.rms_norm_eps,
            "dims": np.array(
                [L, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size], np.int64
            ),
            "vocab": cfg.vocab_size,
            "biases": biases,
        }
        if self.int8 is not None:
            lm = self.quantized["lm_head"]
            return FusedWeights(
                packed=np.zeros((L, 4), np.int64),
                lm_head=0,
                quantized=tuple(self.stacks[n][0] for n in LINEARS),
                blocks=tuple(self.stacks[n][2] for n in LINEARS),
                scales=tuple(self.stacks[n][1] for n in LINEARS),
                lm_quantized=lm.q,
                lm_scale=lm.scale,
                scratch=self.int8.scratch,
                **common,
            )
        packed = [[self.packed[f"l{i}.{n}"].buffer.ctypes.data for n in LINEARS] for i in range(L)]
        return FusedWeights(
            packed=np.array(packed, np.int64),
            lm_head=self.packed["lm_head"].buffer.ctypes.data,
            **common,
            **no_int8(L),
        )

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

    def _linear_array(self, x: np.ndarray, name: str) -> np.ndarray:
        """``x @ W`` (+ bias) on numpy arrays: the kernel path's linear layers and lm_head."""
        packed, quantized = self.packed.get(name), self.quantized.get(name)
        if quantized is not None:
            assert self.int8 is not None  # weights are quantized only with the int8 kernels
            y = self.int8.matmul(x, quantized)
        elif packed is not None:
            assert self.gemm is not None  # weights are packed only with a gemm
            y = self.gemm.matmul(x, packed)
        else:
            y = np.from_dlpack(paddle.matmul(paddle.from_dlpack(x), self.w[name]))
        bias = self.w_np.get(name + "_bias")
        return y if bias is None else y + bias

    def _rope(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        half = self.cfg.head_dim // 2
        return x * cos + paddle.concat([-x[..., half:], x[..., :half]], axis=-1) * sin

    def _linear(self, x: paddle.Tensor, name: str) -> paddle.Tensor:
        """``x @ W`` (+ bias) on Paddle tensors: the reference path's linear layers and lm_head."""
        if name in self.packed or name in self.quantized:
            return paddle.from_dlpack(self._linear_array(np.from_dlpack(x), name))
        y = paddle.matmul(x, self.w[name])
        bias = self.w.get(name + "_bias")
        return y if bias is None else y + bias

    def forward(self, cache: KVCache, step: StepInput) -> np.ndarray | None:
        """Run one packed step; writes the new tokens' K/V into ``cache`` and returns logits [M, V]
        (None when no row needs logits, e.g. a step of non-final prefill chunks)."""
        if self.fused is not None and step.output_rows.size and all(g.is_decode for g in step.groups):
            return self._fused_forward(cache, step)
        if self.kernels is not None:
            return self._kernel_forward(cache, step, self.kernels)
        logits = self._reference_forward(cache, step)
        return None if logits is None else logits.numpy()

    def _kernel_forward(
        self, cache: KVCache, step: StepInput, kernels: AttentionKernels
    ) -> np.ndarray | None:
        """The layer path with the kernels, on numpy arrays: numba's kernels and MKL through ctypes
        with no Paddle tensor made around each operand (a 512-token prefill made ~46 per layer)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        state = self._prepare(cache, step)
        x = self.embed_np[step.token_ids]
        h = kernels.rms_norm(x, self.w_np["l0.in_norm"], eps)
        for layer in range(cfg.num_layers):
            o = self._kernel_attention(self._linear_array(h, f"l{layer}.qkv"), layer, cache, step, state)
            x, h = kernels.add_rms_norm(
                x, self._linear_array(o, f"l{layer}.o"), self.w_np[f"l{layer}.post_norm"], eps
            )
            mlp = self._linear_array(
                kernels.swiglu(self._linear_array(h, f"l{layer}.gate_up")), f"l{layer}.down"
            )
            if layer + 1 < cfg.num_layers:
                x, h = kernels.add_rms_norm(x, mlp, self.w_np[f"l{layer + 1}.in_norm"], eps)
            else:
                x = x + mlp
        if step.output_rows.size == 0:
            return None
        n = step.token_ids.shape[0]
        if step.output_rows.shape[0] != n or not np.array_equal(step.output_rows, np.arange(n)):
            x = x[step.output_rows]
        x = kernels.rms_norm(x, self.w_np["norm"], eps)
        if "lm_head" in self.packed or "lm_head" in self.quantized or not cfg.tie_word_embeddings:
            return self._linear_array(x, "lm_head")
        return paddle.matmul(paddle.from_dlpack(x), self.w["embed"], transpose_y=True).numpy()

    def _reference_forward(self, cache: KVCache, step: StepInput) -> paddle.Tensor | None:
        """The layer path in Paddle ops (no numba kernels): the reference and the fallback."""
        cfg = self.cfg
        ids = paddle.to_tensor(step.token_ids)
        x = F.embedding(ids, self.w["embed"])
        state = self._prepare(cache, step)
        h = self._norm(x, self.w["l0.in_norm"])
        for layer in range(cfg.num_layers):
            o = self._reference_attention(self._linear(h, f"l{layer}.qkv"), layer, cache, step, state)
            x = x + self._linear(o, f"l{layer}.o")
            h = self._norm(x, self.w[f"l{layer}.post_norm"])
            mlp = self._linear(self._swiglu(self._linear(h, f"l{layer}.gate_up")), f"l{layer}.down")
            x = x + mlp
            if layer + 1 < cfg.num_layers:
                h = self._norm(x, self.w[f"l{layer + 1}.in_norm"])
        if step.output_rows.size == 0:
            return None
        n = step.token_ids.shape[0]
        if step.output_rows.shape[0] != n or not np.array_equal(step.output_rows, np.arange(n)):
            x = paddle.index_select(x, paddle.to_tensor(step.output_rows))
        x = self._norm(x, self.w["norm"])
        if "lm_head" in self.packed or "lm_head" in self.quantized or not cfg.tie_word_embeddings:
            return self._linear(x, "lm_head")
        return paddle.matmul(x, self.w["embed"], transpose_y=True)

    def _fused_forward(self, cache: KVCache, step: StepInput) -> np.ndarray:
        """A step of decoding tokens in one compiled call: the layer path's very kernels and bits."""
        assert self.fused is not None and self.fused_weights is not None  # checked by forward
        # the kernel path's decode groups carry tables and lengths: the decodes, and in
        # batch-invariant mode the padding tokens; one table for all, NULL-padded to the widest
        groups = [
            (g.tables, g.lengths) for g in step.groups if g.tables is not None and g.lengths is not None
        ]
        assert len(groups) == len(step.groups)
        width = max(t.shape[1] for t, _ in groups)
        tables = np.concatenate(
            [np.pad(t, ((0, 0), (0, width - t.shape[1])), constant_values=NULL_BLOCK) for t, _ in groups]
        )
        lengths = np.concatenate([n for _, n in groups])
        return self.fused.run(
            self.fused_weights,
            np.from_dlpack(self.w["embed"]),
            self.rope_np,
            cache.kv_view().reshape(-1, self.cfg.head_dim),
            cache.block_size,
            (step.token_ids, step.positions, step.write_rows, tables, lengths, step.output_rows),
        )

    def _prepare(self, cache: KVCache, step: StepInput) -> dict:
        """Per-step tensors every layer's attention shares."""
        state: dict = {
            "gather": paddle.unbind(paddle.to_tensor(step.gather), 0) if step.gather is not None else None,
            "masks": [None if g.mask is None else paddle.to_tensor(g.mask) for g in step.groups],
        }
        if self.kernels is not None:
            state["kv"] = cache.kv_view()  # [blocks, 2, L, bs, KVH, D], zero-copy
            state["rows"] = state["kv"].reshape(-1, self.cfg.head_dim)  # zero-copy
        else:
            pos = paddle.to_tensor(step.positions)
            for name in ("cos", "sin", "qcos", "qsin"):
                state[name] = paddle.index_select(getattr(self, name), pos).unsqueeze(1)
            state["write_rows"] = paddle.unbind(paddle.to_tensor(step.write_rows), 0)
        return state

    def _reference_attention(
        self, qkv: paddle.Tensor, layer: int, cache: KVCache, step: StepInput, state: dict
    ) -> paddle.Tensor:
        """RoPE, the K/V write and attention in Paddle ops: the reference and fallback path."""
        H, KVH, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        n = qkv.shape[0]
        q, k, v = paddle.split(qkv, self.sizes, axis=-1)
        q = self._rope(q.reshape([n, H, D]), state["qcos"], state["qsin"])
        k = self._rope(k.reshape([n, KVH, D]), state["cos"], state["sin"])
        v = v.reshape([n, KVH, D])
        paddle.scatter_(
            cache.rows, state["write_rows"][layer], paddle.concat([k, v], 0).reshape([-1, D]), overwrite=True
        )
        kv_all = (
            None if state["gather"] is None else paddle.index_select(cache.chunks, state["gather"][layer])
        )
        outs, chunk = [], 0
        for g, mask in zip(step.groups, state["masks"]):
            qg = q[g.start : g.start + g.num_tokens]
            if g.num_chunks == 0:
                kg, vg = k[g.start : g.start + g.num_tokens], v[g.start : g.start + g.num_tokens]
                outs.append(self.dense_causal_attention(qg, kg, vg, mask))
            else:
                assert kv_all is not None  # a group with chunks means the step has a gather
                kv = kv_all[chunk : chunk + g.num_chunks]
                chunk += g.num_chunks
                outs.append(self.paged_attention(qg, kv, mask, g.num_seqs, g.is_decode))
        return outs[0] if len(outs) == 1 else paddle.concat(outs, 0)

    def _kernel_attention(
        self, qkv: np.ndarray, layer: int, cache: KVCache, step: StepInput, state: dict
    ) -> np.ndarray:
        """The same attention through the numba kernels (cpu/attention.py) on numpy arrays: RoPE
        and the K/V write in one pass, decode groups read the cache in place, prefill chunks run
        causal tiles over the cache (``prefill_attention``); a group without a table (the step's
        padding tokens) attends to its own tokens."""
        H, KVH, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        kernels, rows = self.kernels, state["rows"]
        assert kernels is not None  # this path is chosen only with the kernels
        q, k, v = kernels.rope_write(
            qkv, step.positions, self.rope_np, rows, step.write_rows[layer], (H, KVH, D)
        )
        out = np.empty((q.shape[0], H * D), np.float32)
        kv_all = (
            None if state["gather"] is None else paddle.index_select(cache.chunks, state["gather"][layer])
        )
        chunk = 0
        for g, mask in zip(step.groups, state["masks"]):
            span = slice(g.start, g.start + g.num_tokens)
            if g.tables is not None and not g.is_decode:
                assert g.lengths is not None  # set together with tables
                end = int(g.lengths[0])
                out[span] = self.prefill_attention(q[span], state["kv"], layer, g.tables[0], end)
            elif g.tables is not None:
                assert g.lengths is not None  # set together with tables
                shape = (self.cfg.num_layers, cache.block_size, KVH)
                out[span] = kernels.decode(rows, shape, layer, q[span], g.tables, g.lengths).reshape(
                    -1, H * D
                )
            elif g.num_chunks == 0:
                out[span] = self.tiled_causal_attention(q[span], k[span], v[span])
            else:
                assert kv_all is not None  # a group with chunks means the step has a gather
                kv = kv_all[chunk : chunk + g.num_chunks]
                chunk += g.num_chunks
                o = self.paged_attention(paddle.from_dlpack(q[span]), kv, mask, g.num_seqs, g.is_decode)
                out[span] = np.from_dlpack(o)
        return out
