"""The Triton kernels behind ``layer_ops`` (its docstring has the contracts): a module of their own
for the reason ``triton_paged_kernels`` is one (the interpreter runs a kernel with its module's
globals only; importing this imports Triton). Importing ``triton_paged_kernels`` first applies its
interpreter fix in this process too.

Each kernel's program handles one token row, so the number of rows is only the grid: no argument
changes with the batch, and Triton compiles each kernel once per model (``INTERPRETED`` as there).
Everything is computed in float32 and rounded to the tensors' dtype where the torch twin rounds, so
a row's result differs from the twin's only by the order of a sum (and FMA contraction on a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.engine.cuda.triton_paged_kernels import INTERPRETED

__all__ = ["INTERPRETED", "add_rms_norm", "rope_write_kv", "silu_mul"]


@triton.jit
def add_rms_norm(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    s_x,
    s_r,
    s_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    # grid (rows,): res += x (rounded to the stream's dtype, stored), out = rms_norm(res) * w
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * s_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * s_o + offs, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["layer"])
def rope_write_kv(
    qkv_ptr,
    pos_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    layer,
    s_row,
    s_pos,
    s_cb,
    s_ckv,
    s_cl,
    s_cs,
    s_ch,
    s_cd,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    QK_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # grid (rows,): one token's q and k heads (adjacent in its qkv row) rotated in place as one
    # tile, k and v written into the cache at its slot (block slot // BLOCK_SIZE, offset slot %
    # BLOCK_SIZE); each head in two halves, the rotation's pairs
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    imask = offs_i < D // 2
    # the tables repeat their first half (cos = cat(freqs, freqs).cos()): one half serves both
    cos = tl.load(cos_ptr + pos * s_pos + offs_i, mask=imask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * s_pos + offs_i, mask=imask, other=0.0)[None, :]
    row_ptr = qkv_ptr + row * s_row
    cache_row = cache_ptr + (slot // BLOCK_SIZE) * s_cb + layer * s_cl + (slot % BLOCK_SIZE) * s_cs
    offs_h = tl.arange(0, QK_PAD)
    mask = (offs_h < HEADS + KV_HEADS)[:, None] & imask[None, :]
    lo = row_ptr + offs_h[:, None] * D + offs_i[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0)
    x2 = tl.load(lo + D // 2, mask=mask, other=0.0)
    y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
    y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
    tl.store(lo, y1, mask=mask)
    tl.store(lo + D // 2, y2, mask=mask)
    k_mask = mask & (offs_h >= HEADS)[:, None]
    k_lo = cache_row + (offs_h - HEADS)[:, None] * s_ch + offs_i[None, :] * s_cd
    tl.store(k_lo, y1.to(cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_lo + (D // 2) * s_cd, y2.to(cache_ptr.dtype.element_ty), mask=k_mask)
    offs_v = tl.arange(0, KV_PAD)
    v_mask = (offs_v < KV_HEADS)[:, None] & imask[None, :]
    v_lo = row_ptr + (HEADS + KV_HEADS) * D + offs_v[:, None] * D + offs_i[None, :]
    c_lo = cache_row + s_ckv + offs_v[:, None] * s_ch + offs_i[None, :] * s_cd
    v1 = tl.load(v_lo, mask=v_mask, other=0.0)
    v2 = tl.load(v_lo + D // 2, mask=v_mask, other=0.0)
    tl.store(c_lo, v1.to(cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(c_lo + (D // 2) * s_cd, v2.to(cache_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def silu_mul(gu_ptr, out_ptr, s_gu, s_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    # grid (rows, column tiles): out = silu(gate) * up of a fused [gate | up] row; silu rounded to
    # the output's dtype before the product, as torch's ``F.silu(gate) * up`` rounds it
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < INTER
    g = tl.load(gu_ptr + row * s_gu + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_gu + INTER + col, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_o + col, (act * u).to(out_ptr.dtype.element_ty), mask=mask)
