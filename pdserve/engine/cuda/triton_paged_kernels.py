"""The Triton kernels behind ``triton_attention`` (its docstring has the cache layout and the
contract); a module of their own because Triton's interpreter runs a kernel with its module's
globals only (no closures), and because importing it imports Triton: ``triton_attention`` does
that on first use.

Triton reads TRITON_INTERPRET when it decorates a kernel, so ``INTERPRETED`` records which kind
this process got: compiled (CUDA) or interpreted (numpy, on CPU tensors; tests).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def _fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter holds a scalar as a 1-element array and turns it into a loop bound
    with ``int(array)``, which numpy 2.4 refuses (triton-lang/triton#9171, fixed upstream by taking
    the element): the same fix, applied to the interpreter's tensor patcher once per process."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "pdserve_fixed", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.pdserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _fix_interpreter_bf16_rounding() -> None:
    """Triton's interpreter turns float32 into bfloat16 by dropping the low 16 bits (its cast passes
    no rounding mode); a GPU rounds to nearest even, as torch does. The interpreter's cast gets
    the GPU's rounding, so a kernel checked against its torch twin rounds where the twin rounds."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or getattr(original, "pdserve_fixed", False):
        return

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded.reshape(src.data.shape), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl.pdserve_fixed = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl  # type: ignore[union-attr]


if INTERPRETED:
    _fix_interpreter_scalars()
    _fix_interpreter_bf16_rounding()


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    # DOT_F32: the interpreter, whose tl.dot multiplies bf16's raw bits (it has no bf16 arithmetic;
    # triton-lang/triton#11584), gets float32 copies: the exact products the GPU's bf16 MMA makes
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    # s: scores already in log2 units with masked entries at -inf. m_safe keeps a row that has
    # seen no key yet (m = -inf) from computing -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, DOT_F32)
    return acc, m_new, l_i


@triton.jit
def _load_kv(
    cache_ptr,
    table_row,
    tok,
    valid,
    head_off,
    offs_d,
    s_cb,
    s_ckv,
    s_cs,
    s_cd,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    # K as [D, T] (ready for q @ k) and V as [T, D] of tokens ``tok``, gathered by block table
    if MASKED:
        blk = tl.load(table_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        blk = tl.load(table_row + tok // BLOCK_SIZE).to(tl.int64)
    row = cache_ptr + blk * s_cb + (tok % BLOCK_SIZE) * s_cs + head_off
    k_ptrs = row[None, :] + offs_d[:, None] * s_cd
    v_ptrs = row[:, None] + s_ckv + offs_d[None, :] * s_cd
    if MASKED:
        k = tl.load(k_ptrs, mask=valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


# Every argument that changes with the batch or the table width is left unspecialised (Triton would
# otherwise compile a variant for a value of 1 or a multiple of 16): the decode kernel compiles twice
# per model, split and unsplit, whatever the width, and the merge once (all at warm-up:
# triton_attention.warm_up_paged_attention).
@triton.jit(do_not_specialize=["layer", "split_tokens", "num_splits", "s_tb"])
def decode(
    q_ptr,
    cache_ptr,
    tables_ptr,
    lengths_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    layer,
    qk_scale,
    split_tokens,
    num_splits,
    s_qb,
    s_qh,
    s_qd,
    s_cb,
    s_ckv,
    s_cl,
    s_cs,
    s_ch,
    s_cd,
    s_tb,
    s_ob,
    s_oh,
    s_od,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # grid (B, kv heads, num_splits): the GROUP query heads of one kv head, tokens
    # [split * split_tokens, min(+split_tokens, length)) of one sequence
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, TILE)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    q = tl.load(
        q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=gmask[:, None], other=0.0
    )
    q = q.to(cache_ptr.dtype.element_ty)
    seq_len = tl.load(lengths_ptr + b)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, seq_len)
    table_row = tables_ptr + b * s_tb
    head_off = layer * s_cl + kvh * s_ch
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for t0 in range(lo, hi, TILE):
        tok = t0 + offs_t
        valid = tok < hi
        k, v = _load_kv(
            cache_ptr, table_row, tok, valid, head_off, offs_d, s_cb, s_ckv, s_cs, s_cd, BLOCK_SIZE, True
        )
        s = _dot(q, k, DOT_PREC, DOT_F32) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC, DOT_F32)
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        # partials, contiguous [B, H, num_splits(, D)]; an empty split stores (-inf, 0, 0)
        part = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=gmask)
        tl.store(l_ptr + part, l_i, mask=gmask)
        tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    num_splits,
    s_ob,
    s_oh,
    s_od,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
):
    # grid (B, H): rescale each split's partial sums to the global max and add them up; SPLITS_PAD
    # is the most splits there can be, the rest masked (no memory read)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D)
    smask = offs_s < num_splits
    part = (b * tl.num_programs(1) + h) * num_splits + offs_s
    m = tl.load(m_ptr + part, mask=smask, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty split: weight 0
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_s * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d * s_od, out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["layer", "start", "n"])
def prefill(
    q_ptr,
    cache_ptr,
    table_ptr,
    out_ptr,
    layer,
    start,
    n,
    qk_scale,
    s_qn,
    s_qh,
    s_qd,
    s_cb,
    s_ckv,
    s_cl,
    s_cs,
    s_ch,
    s_cd,
    s_on,
    s_oh,
    s_od,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # grid (query tiles, H): BLOCK_M queries of one head against keys 0..their positions
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    mmask = offs_m < n
    q = tl.load(
        q_ptr + offs_m[:, None] * s_qn + h * s_qh + offs_d[None, :] * s_qd, mask=mmask[:, None], other=0.0
    )
    q = q.to(cache_ptr.dtype.element_ty)
    q_pos = start + offs_m
    head_off = layer * s_cl + (h // GROUP) * s_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # keys before this tile's first query are visible to all its queries: no mask at all
    first_q = start + pid_m * BLOCK_M
    full_end = (first_q // BLOCK_N) * BLOCK_N
    for t0 in range(0, full_end, BLOCK_N):
        tok = t0 + offs_n
        k, v = _load_kv(  # no mask: ``valid`` (tok) is unused
            cache_ptr, table_ptr, tok, tok, head_off, offs_d, s_cb, s_ckv, s_cs, s_cd, BLOCK_SIZE, False
        )
        s = _dot(q, k, DOT_PREC, DOT_F32) * qk_scale
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC, DOT_F32)
    # the diagonal: causal mask, and nothing past the chunk's last position is read
    hi = tl.minimum(first_q + BLOCK_M, start + n)
    for t0 in range(full_end, hi, BLOCK_N):
        tok = t0 + offs_n
        valid = tok < hi
        k, v = _load_kv(
            cache_ptr, table_ptr, tok, valid, head_off, offs_d, s_cb, s_ckv, s_cs, s_cd, BLOCK_SIZE, True
        )
        s = _dot(q, k, DOT_PREC, DOT_F32) * qk_scale
        s = tl.where(valid[None, :] & (tok[None, :] <= q_pos[:, None]), s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PREC, DOT_F32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + offs_m[:, None] * s_on + h * s_oh + offs_d[None, :] * s_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])
