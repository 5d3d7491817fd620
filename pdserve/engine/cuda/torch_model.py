"""Llama-family decoder in PyTorch on a packed token axis, attending through the paged cache.

The CPU engine's ``Model`` in torch, for a GPU (or torch's CPU device in tests): the same fused
weights (``qkv``, ``gate_up``; kept ``[out, in]`` as checkpoints store them, ``F.linear``), the same step input (ModelRunner with the
paged-kernel layout: decode groups and prefill chunks carry block tables and lengths), the same
rotate-half RoPE. Weights and cache are bfloat16 or float32; norms, RoPE, softmax and the logits
are computed in float32. A layer is its four GEMMs, attention and three fused element-wise
operations (cuda/layer_ops.py: residual add + RMSNorm, RoPE + the K/V write into the block-major
cache by slot, SiLU x up; Triton kernels where the Triton attention runs, their torch twins
elsewhere); attention reads the cache through block tables (cuda/triton_attention.py); a first
prefill chunk attends to its own fresh K/V with PyTorch's fused causal attention, given 4-D
``[1, H, n, D]`` inputs with ``enable_gqa`` so that a GPU takes its flash kernel (3-D inputs fall
back to the math path). Every operation of a decode step depends only on the shapes of its inputs,
so the step replays as a CUDA graph (cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.engine.block_manager import NULL_BLOCK
from pdserve.engine.cuda.layer_ops import select_layer_ops
from pdserve.engine.cuda.triton_attention import PagedAttentionImpl, warm_up_paged_attention
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.step_input import StepInput


@dataclasses.dataclass
class DeviceGroup:
    """One attention group of a step, its tables already on the device."""

    start: int
    count: int
    is_decode: bool
    tables: torch.Tensor  # int32 [B, nblk] (decode) or [nblk] (a prefill chunk)
    lengths: torch.Tensor | None  # int32 [B] (decode)
    first_position: int  # a prefill chunk's start (0: a first chunk)


@dataclasses.dataclass
class DeviceStep:
    """A step's inputs on the device: token ids, positions, K/V slots (int32 [N]: one layout for the
    eager path and the graphs' staging, so the kernels compile once), the groups, and the rows whose
    logits are wanted (None: every row)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    groups: list[DeviceGroup]
    output_rows: torch.Tensor | None


class TorchModel:
    """Functional forward over fused weights on one device (names as weights.iter_weights yields
    them, untransposed: ``[out, in]``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Iterable[tuple[str, np.ndarray]],
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        attention: PagedAttentionImpl,
    ) -> None:
        self.cfg, self.device, self.dtype, self.attention = cfg, device, dtype, attention
        self.ops = select_layer_ops(attention.impl)
        self.w: dict[str, torch.Tensor] = {}
        for name, array in weights:
            host = torch.from_numpy(np.ascontiguousarray(array))
            # norms stay float32 (they scale a float32 normalisation); the rest in the model's dtype
            kind = torch.float32 if name.endswith("norm") else dtype
            self.w[name] = host.to(device=device, dtype=kind, non_blocking=False)
            del host
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.w.values())
        self.lm_head = self.w["lm_head"] if "lm_head" in self.w else self.w["embed"]  # [vocab, hidden]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=torch.float32)
        self.sin = emb.sin().to(device=device, dtype=torch.float32)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    # ---- host → device --------------------------------------------------------------------------
    def to_device(self, step: StepInput) -> DeviceStep:
        """The step's numpy arrays on the device (each a small copy; int32 but the output rows)."""
        dev = self.device

        def put(a: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype, non_blocking=True)

        groups = []
        for g in step.groups:
            assert g.tables is not None and g.lengths is not None  # ModelRunner(paged_kernel=True)
            if g.is_decode:
                groups.append(
                    DeviceGroup(
                        g.start,
                        g.num_tokens,
                        True,
                        put(g.tables),
                        put(g.lengths),
                        0,
                    )
                )
            else:
                first = int(step.positions[g.start])
                groups.append(DeviceGroup(g.start, g.num_tokens, False, put(g.tables[0]), None, first))
        n = step.token_ids.shape[0]
        every = step.output_rows.shape[0] == n and np.array_equal(step.output_rows, np.arange(n))
        return DeviceStep(
            put(step.token_ids),
            put(step.positions),
            put(step.write_rows),  # TorchKVCache.write_rows: the slots
            groups,
            None if every else put(step.output_rows, torch.long),
        )

    # ---- the forward ----------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name], self.w.get(name + "_bias"))

    def forward(self, cache: torch.Tensor, step: DeviceStep) -> torch.Tensor | None:
        """Run one packed step: writes the new tokens' K/V into ``cache`` ([blocks, 2, L, bs, kvh, D])
        and returns float32 logits of the output rows (None when no row samples). The residual
        stream is added to in place; each norm takes the previous sublayer's output with it."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        n = step.token_ids.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        residual = F.embedding(step.token_ids, self.w["embed"])
        out: torch.Tensor | None = None  # the last sublayer's output, not yet added to the residual
        for layer in range(cfg.num_layers):
            h = ops.add_rms_norm(
                out if out is not None else residual,
                residual if out is not None else None,
                self.w[f"l{layer}.in_norm"],
                eps,
            )
            qkv = self._linear(h, f"l{layer}.qkv")
            ops.rope_write_kv(qkv, step.positions, step.slots, self.cos, self.sin, cache, layer, H, KVH)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            attn = self._attend(
                q.view(n, H, D), k.view(n, KVH, D), v.view(n, KVH, D), cache, layer, step.groups
            )
            h = ops.add_rms_norm(
                self._linear(attn.reshape(n, H * D), f"l{layer}.o"),
                residual,
                self.w[f"l{layer}.post_norm"],
                eps,
            )
            out = self._linear(ops.silu_mul(self._linear(h, f"l{layer}.gate_up")), f"l{layer}.down")
        assert out is not None
        if step.output_rows is not None:
            if step.output_rows.numel() == 0:
                return None
            out, residual = out.index_select(0, step.output_rows), residual.index_select(0, step.output_rows)
        return F.linear(ops.add_rms_norm(out, residual, self.w["norm"], eps), self.lm_head).float()

    def warm_up(self, cache: torch.Tensor) -> None:
        """Launch every Triton kernel variant a serving step can (Triton compiles each on its first
        launch, ~1 s), so that none compiles on the engine thread while serving: one decode step of
        a token in the null block (the layer kernels), then each paged-attention variant."""
        if self.attention.impl != "triton":
            return
        bs, dev = cache.shape[3], self.device
        one = torch.zeros(1, dtype=torch.int32, device=dev)
        slot = torch.full((1,), NULL_BLOCK * bs, dtype=torch.int32, device=dev)
        group = DeviceGroup(
            0,
            1,
            True,
            torch.full((1, 1), NULL_BLOCK, dtype=torch.int32, device=dev),
            torch.ones(1, dtype=torch.int32, device=dev),
            0,
        )
        self.forward(cache, DeviceStep(one, one, slot, [group], None))
        rows = 128  # at least the largest prefill query tile
        qkv = torch.zeros((rows, self.cfg.q_size + 2 * self.cfg.kv_size), dtype=self.dtype, device=dev)
        q = qkv[:, : self.cfg.q_size].view(rows, self.cfg.num_heads, self.cfg.head_dim)
        warm_up_paged_attention(q, cache, self.scale)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        groups: list[DeviceGroup],
    ) -> torch.Tensor:
        if len(groups) == 1 and groups[0].is_decode:  # a decode step: no copy into a packed output
            g = groups[0]
            assert g.lengths is not None
            return self.attention.decode(q, cache, layer, g.tables, g.lengths, self.scale)
        out = torch.empty_like(q)
        for g in groups:
            rows = slice(g.start, g.start + g.count)
            if g.is_decode:
                assert g.lengths is not None
                out[rows] = self.attention.decode(q[rows], cache, layer, g.tables, g.lengths, self.scale)
            elif g.first_position == 0:  # a first chunk: its own K/V, causal, PyTorch's fused kernel
                out[rows] = self._causal(q[rows], k[rows], v[rows])
            else:
                out[rows] = self.attention.prefill(
                    q[rows], cache, layer, g.tables, g.first_position, self.scale
                )
        return out

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a first prefill chunk over its own K/V (q [n, H, D], k/v [n, KVH, D]):
        4-D ``[1, heads, n, D]`` views (unit last stride) with ``enable_gqa`` and no mask, what a
        GPU's flash kernel takes; 3-D inputs or repeated K/V heads would send it to the math path."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=self.scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
