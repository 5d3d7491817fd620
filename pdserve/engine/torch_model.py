"""Llama-family decoder in PyTorch on a packed token axis, attending through the paged cache.

The CPU engine's ``Model`` in torch, for a GPU (or torch's CPU device in tests): the same fused
weights (``qkv``, ``gate_up``; kept ``[out, in]`` as checkpoints store them, ``F.linear``), the same step input (ModelRunner with the
paged-kernel layout: decode groups and prefill chunks carry block tables and lengths), the same
rotate-half RoPE. Weights and cache are bfloat16 or float32; norms, RoPE, softmax and the logits
are computed in float32. Each token's K/V is scattered into the block-major cache by its slot,
then attention reads the cache through block tables (kernels/triton_attention.py); a first prefill
chunk attends to its own fresh K/V with PyTorch's fused causal attention (flash on a GPU), which
is the same arithmetic over the same values. Every operation of a decode step depends only on the
shapes of its inputs, so the step replays as a CUDA graph (cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.engine.kernels.triton_attention import PagedAttentionImpl
from pdserve.engine.model_config import ModelConfig
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
    """A step's inputs on the device: token ids, positions, K/V slots (int64 [N]), the groups, and the
    rows whose logits are wanted (None: every row)."""

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
        """The step's numpy arrays on the device (each a small copy; tables as int32)."""
        dev = self.device

        def put(a: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
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
                        put(g.tables, torch.int32),
                        put(g.lengths, torch.int32),
                        0,
                    )
                )
            else:
                first = int(step.positions[g.start])
                groups.append(
                    DeviceGroup(g.start, g.num_tokens, False, put(g.tables[0], torch.int32), None, first)
                )
        n = step.token_ids.shape[0]
        every = step.output_rows.shape[0] == n and np.array_equal(step.output_rows, np.arange(n))
        return DeviceStep(
            put(step.token_ids),
            put(step.positions),
            put(step.write_rows),  # TorchKVCache.write_rows: the slots
            groups,
            None if every else put(step.output_rows),
        )

    # ---- the forward ----------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return (xf * self.w[name]).to(self.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name], self.w.get(name + "_bias"))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in float32; x [N, heads, D], cos/sin [N, 1, D]."""
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def forward(self, cache: torch.Tensor, step: DeviceStep) -> torch.Tensor | None:
        """Run one packed step: writes the new tokens' K/V into ``cache`` ([blocks, 2, L, bs, kvh, D])
        and returns float32 logits of the output rows (None when no row samples)."""
        cfg = self.cfg
        n = step.token_ids.shape[0]
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bs = cache.shape[3]
        blocks, offsets = step.slots // bs, step.slots % bs
        cos, sin = self.cos[step.positions][:, None, :], self.sin[step.positions][:, None, :]
        x = F.embedding(step.token_ids, self.w["embed"])
        for layer in range(cfg.num_layers):
            h = self._norm(x, f"l{layer}.in_norm")
            q, k, v = self._linear(h, f"l{layer}.qkv").split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = self._rope(q.reshape(n, H, D), cos, sin)
            k = self._rope(k.reshape(n, KVH, D), cos, sin)
            v = v.reshape(n, KVH, D)
            cache[:, 0, layer][blocks, offsets] = k
            cache[:, 1, layer][blocks, offsets] = v
            attn = self._attend(q, k, v, cache, layer, step.groups)
            x = x + self._linear(attn.reshape(n, H * D), f"l{layer}.o")
            h = self._norm(x, f"l{layer}.post_norm")
            gate, up = self._linear(h, f"l{layer}.gate_up").chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, f"l{layer}.down")
        if step.output_rows is not None:
            if step.output_rows.numel() == 0:
                return None
            x = x.index_select(0, step.output_rows)
        return F.linear(self._norm(x, "norm"), self.lm_head).float()

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
        """Causal attention of a first prefill chunk over its own K/V (q [n, H, D], k/v [n, KVH, D])."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)
