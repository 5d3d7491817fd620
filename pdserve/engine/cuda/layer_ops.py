"""The torch model's element-wise work, fused: three Triton kernels and their torch twins.

A decoder layer written op by op launches ~40 small kernels (RMSNorm alone is eight: cast, square,
mean, add, rsqrt, two products, cast); a decode step replays them all, and at small batches they
cost more than the GEMMs. Fused, a layer is the four GEMMs, attention and three kernels:

- ``add_rms_norm(x, residual, weight, eps)``: ``residual += x`` in place (rounded to the stream's
  dtype), then returns ``rms_norm(residual) * weight`` in that dtype (float32 inside). ``residual``
  None: the norm of ``x`` alone (the first layer's input).
- ``rope_write_kv(qkv, positions, slots, cos, sin, cache, layer, heads, kv_heads)``: rotate-half
  RoPE of the q and k heads of each fused ``qkv`` row ``[q | k | v]``, in place, and k and v written
  into the block-major cache at the row's slot (block ``slot // block_size``, offset ``slot %
  block_size``). ``cos``/``sin`` are the model's ``[max_len, head_dim]`` float32 tables.
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of a fused ``[gate | up]`` row.

The twins are the model's former op-by-op arithmetic, kept exactly (the CPU device's tokens and
logits are what they were); they run on torch's CPU device and wherever Triton cannot. The kernels
are checked against them under Triton's interpreter (tests/engine/cuda/test_layer_ops.py).
``select_layer_ops`` pairs them with the paged attention: the kernels where the Triton attention
was chosen (it checked that Triton runs on the device), the twins elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_SILU_BLOCK = 1024  # columns per silu_mul program


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _kernels() -> Any:
    """The kernel module, imported on first use (importing it imports Triton)."""
    from pdserve.engine.cuda import triton_layer_kernels

    return triton_layer_kernels


# ----------------------------------------------------------------------------------------------
# torch twins


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if residual is not None:
        x = residual.add_(x)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32; x [N, heads, D], cos/sin [N, 1, D]; returns x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def torch_rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    heads: int,
    kv_heads: int,
) -> None:
    n, dim = qkv.shape[0], cache.shape[-1]
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim : (heads + 2 * kv_heads) * dim].view(n, kv_heads, dim)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    q.copy_(rope_rotate(q, c, s))
    k.copy_(rope_rotate(k, c, s))
    bs = cache.shape[3]
    blocks, offsets = slots // bs, slots % bs
    cache[:, 0, layer][blocks, offsets] = k.to(cache.dtype)
    cache[:, 1, layer][blocks, offsets] = v.to(cache.dtype)


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------
# Triton


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    n, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm needs rows with unit column stride")
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = _next_pow2(hidden)
    res = residual if residual is not None else x
    _kernels().add_rms_norm[(n,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_warps(block),
    )
    return out


def triton_rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    heads: int,
    kv_heads: int,
) -> None:
    n = qkv.shape[0]
    dim, block_size = cache.shape[-1], cache.shape[3]
    if dim % 2 or qkv.stride(1) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope_write_kv needs an even head_dim, unit column strides and like tables")
    if qkv.shape[1] < (heads + 2 * kv_heads) * dim:
        raise ValueError(f"qkv rows of {qkv.shape[1]} hold fewer than {heads + 2 * kv_heads} heads of {dim}")
    if n == 0:
        return
    _kernels().rope_write_kv[(n,)](
        qkv,
        positions,
        slots,
        cos,
        sin,
        cache,
        layer,
        qkv.stride(0),
        cos.stride(0),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        cache.stride(4),
        cache.stride(5),
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=dim,
        QK_PAD=_next_pow2(heads + kv_heads),
        KV_PAD=_next_pow2(kv_heads),
        HALF_PAD=_next_pow2(dim // 2),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


def triton_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n, width = gate_up.shape
    inter = width // 2
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs [gate | up] rows of even width with unit column stride")
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block = min(_SILU_BLOCK, _next_pow2(inter))
    grid = (n, -(-inter // block))
    _kernels().silu_mul[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4
    )
    return out


# ----------------------------------------------------------------------------------------------
# choice


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """The fused element-wise operations the torch model runs: the Triton kernels or the twins."""

    impl: str  # "triton" | "torch"
    add_rms_norm: Callable[..., torch.Tensor] = dataclasses.field(repr=False)
    rope_write_kv: Callable[..., None] = dataclasses.field(repr=False)
    silu_mul: Callable[..., torch.Tensor] = dataclasses.field(repr=False)


TORCH_LAYER_OPS = LayerOps("torch", torch_add_rms_norm, torch_rope_write_kv, torch_silu_mul)
TRITON_LAYER_OPS = LayerOps("triton", triton_add_rms_norm, triton_rope_write_kv, triton_silu_mul)


def select_layer_ops(attention_impl: str) -> LayerOps:
    """The kernels where the paged attention is Triton's (Triton runs on the device), else the twins."""
    return TRITON_LAYER_OPS if attention_impl == "triton" else TORCH_LAYER_OPS
