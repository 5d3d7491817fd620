"""Attention kernels that work on the paged cache in place (docs/design.md "CPU kernels").

The reference path (``Model.paged_attention``) first gathers every sequence's whole context out of
the cache with ``index_select``, once per layer per step; at batch 32 on the tiny model that copy
was ~63 % of a decode step. The decode kernel walks each sequence's block table instead and touches
only the rows of its own tokens, so nothing is copied and nothing past a sequence's length is read.
Two more kernels take the rest of a layer's attention ops off Paddle's per-op path (a 512-token
prefill spent ~55 % of its time there): ``rope_write`` applies RoPE to q and k and writes k and v
into their cache rows in one pass over the QKV projection, and ``causal_softmax`` normalises a tile
of a first prefill chunk's scores in place, skipping what the causal mask would hide. ``swiglu``
and ``add_rms_norm`` (the residual add and the next norm) do the same for the MLP's elementwise ops;
the softmaxes and SwiGLU take their exp from ``_exp32``, arithmetic LLVM vectorizes (libm's expf
is a call it cannot).

They are compiled by numba for the CPU at hand: LLVM picks AVX2 or AVX-512 from the host's features
when a kernel is first compiled, which is the run-time CPU check (``cache=True`` keys its cache
files per CPU, so another machine recompiles rather than loads foreign code). Every kernel's work
items are tokens or sequences computed start to end by one thread: a sequence's bits never depend
on its neighbours, the batch size or the thread count, which keeps batch-invariant mode bitwise.
Softmaxes subtract the row max and run in float32. ``rope_write`` is compiled without fastmath, so
its products and sums round exactly as Paddle's elementwise ops do: bitwise the reference's RoPE.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import types
from typing import Any

import numpy as np

from pdserve.engine.config import ATTENTION_MODES
from pdserve.engine.cpu.compiled_attention import AttentionKernels
from pdserve.engine.cpu.gemm import PackedMkl, numba_mkl
from pdserve.engine.kernel_choice import check_mode, load_or_fall_back

# numba.prange once _compile has imported numba: importing this module stays light, and a host
# without numba still imports it.
prange = range

log = logging.getLogger(__name__)


# The kernels' exp: numba-compiled _exp32 once _compile has run (math.exp until then, so the module
# imports without numba). libm's expf is a call LLVM cannot vectorize; _exp32 is plain arithmetic.
_exp: Any = math.exp
_as_float: Any = None
_softmax_prefix: Any = None  # set by _compile: a causal softmax row
# MKL's routines the causal tiles call (gemm.numba_mkl), bound by bind_causal_tiles
_sgemm: Any = None
_mkl_threads_local: Any = None
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values (mkl_cblas.h)

# reassoc + contract let LLVM vectorize the dot products over head_dim (a fixed order for a given
# head_dim, so still deterministic); no nnan/ninf: nothing may assume finite inputs away.
_FASTMATH = {"reassoc", "contract"}


def _exp32(x: float) -> float:  # pragma: no cover - compiled by numba
    """exp(x) in float32 from arithmetic alone, so loops over it vectorize (AVX2 or AVX-512).

    Cephes' expf: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness), a degree-7
    polynomial for e^r, times 2^n built from its exponent bits (``_as_float`` reinterprets an
    int32). Within 1e-7 relative of float64 exp over [-87, 88]; x is clamped to that range (e^-87
    ~ 1.6e-38 is 0 next to a softmax's max term of 1; e^88 ~ 1.7e38 stays finite).
    """
    # typeshed types min/max of numpy scalars as a union; numba compiles this to float32 selects
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))  # type: ignore[assignment]
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _as_float((np.int32(n) + np.int32(127)) << np.int32(23))


def _make_as_float() -> Any:
    """int32 -> float32 bit reinterpretation as an LLVM bitcast (numba has no scalar view)."""
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def as_float(typingctx: Any, bits: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], context.get_value_type(types.float32))  # LLVM float

        return types.float32(types.int32), codegen

    return as_float


def _add_rms_norm(
    x: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float, x_out: np.ndarray, h_out: np.ndarray
) -> None:  # pragma: no cover - compiled by numba
    """The residual add and the next RMSNorm in one pass: x_out = x + delta (rounded as Paddle's add),
    h_out = x_out * rsqrt(mean(x_out^2) + eps) * w, row by row ``[N, hidden]``."""
    n, hidden = x.shape
    for t in prange(n):
        total = np.float32(0.0)
        for j in range(hidden):
            v = x[t, j] + delta[t, j]
            x_out[t, j] = v
            total += v * v
        r = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(hidden) + np.float32(eps)))
        for j in range(hidden):
            h_out[t, j] = x_out[t, j] * r * w[j]


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:  # pragma: no cover
    """out = x * rsqrt(mean(x^2) + eps) * w row by row, as ``_add_rms_norm`` normalises its sum (the
    model's first and final norm on the kernel path)."""
    n, hidden = x.shape
    for t in prange(n):
        total = np.float32(0.0)
        for j in range(hidden):
            total += x[t, j] * x[t, j]
        r = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(hidden) + np.float32(eps)))
        for j in range(hidden):
            out[t, j] = x[t, j] * r * w[j]


def _swiglu(gate_up: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled by numba
    """out = silu(gate) * up for gate_up ``[N, 2I]`` (gate first, as the fused weight) -> ``[N, I]``."""
    n, inter = out.shape
    for t in prange(n):
        for j in range(inter):
            g = gate_up[t, j]
            out[t, j] = g / (np.float32(1.0) + _exp(-g)) * gate_up[t, inter + j]


def _decode_attention(
    rows: np.ndarray,
    layers: int,
    block_size: int,
    kv_heads: int,
    layer: int,
    q: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled by numba; the Python body is its definition
    """out[b, h] = softmax(q[b, h] . K[b]^T) V[b] for each sequence b, reading K/V rows in place.

    rows: the cache as ``[num_blocks * 2 * L * bs * KVH, D]`` float32 (block-major, see kv_cache);
    q: ``[B, H, D]`` float32, pre-scaled; tables: int64 ``[B, nblk]``; lengths: int64 ``[B]``
    (tokens of context, >= 1); out: ``[B, H, D]`` float32.

    One work item is one sequence with all its kv heads: a token's rows for every kv head are
    adjacent, so each block's layer slice is read front to back (measured ~4x faster than one item
    per (sequence, kv head), which strides over the other heads' rows).
    """
    B, H, D = q.shape
    G = H // kv_heads
    per_block = 2 * layers * block_size * kv_heads  # rows of one block
    v_offset = layers * block_size * kv_heads  # rows from a block's K half to its V half
    layer_offset = layer * block_size * kv_heads
    for b in prange(B):
        n = lengths[b]
        qb = q[b].copy()  # [H, D], contiguous
        s = np.empty((H, n), np.float32)
        for t in range(n):
            r0 = tables[b, t // block_size] * per_block + layer_offset + (t % block_size) * kv_heads
            for h in range(kv_heads):
                k = rows[r0 + h]
                for g in range(h * G, (h + 1) * G):
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += qb[g, d] * k[d]
                    s[g, t] = acc
        for g in range(H):  # softmax in float32, minus the row max
            m = s[g, 0]
            for t in range(1, n):
                m = max(m, s[g, t])
            total = np.float32(0.0)
            for t in range(n):
                e = _exp(s[g, t] - m)
                s[g, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(n):
                s[g, t] *= inv
        acc_v = np.zeros((H, D), np.float32)
        for t in range(n):
            r0 = (
                tables[b, t // block_size] * per_block + v_offset + layer_offset + (t % block_size) * kv_heads
            )
            for h in range(kv_heads):
                v = rows[r0 + h]
                for g in range(h * G, (h + 1) * G):
                    p = s[g, t]
                    for d in range(D):
                        acc_v[g, d] += p * v[d]
        out[b] = acc_v


def _rope_write(
    qkv: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    qcos: np.ndarray,
    qsin: np.ndarray,
    rows: np.ndarray,
    write_rows: np.ndarray,
    q_out: np.ndarray,
    k_out: np.ndarray,
    v_out: np.ndarray,
) -> None:  # pragma: no cover - compiled by numba
    """Rotate-half RoPE of q (with the pre-scaled ``qcos``/``qsin``) and k, then K/V into the cache.

    qkv: ``[N, (H + 2 KVH) D]`` float32, one token per row; positions: int64 ``[N]``; cos/sin:
    ``[max_len, D]``; rows: the cache as ``[-1, D]``; write_rows: int64 ``[2 N KVH]``, K rows of
    (token, kv head) then V rows (KVCache.write_rows of one layer); q_out ``[N, H, D]``, k_out and
    v_out ``[N, KVH, D]`` receive q, k and v. Each product and sum rounds once, in the reference's
    order (x cos + rot(x) sin), so the result is bitwise that of ``Model._rope``.
    """
    n, H, D = q_out.shape
    KVH = k_out.shape[1]
    half = D // 2
    for t in prange(n):
        p = positions[t]
        for h in range(H):
            base = h * D
            for d in range(half):
                x1, x2 = qkv[t, base + d], qkv[t, base + half + d]
                q_out[t, h, d] = x1 * qcos[p, d] + (-x2) * qsin[p, d]
                q_out[t, h, half + d] = x2 * qcos[p, half + d] + x1 * qsin[p, half + d]
        for h in range(KVH):
            kb, vb = (H + h) * D, (H + KVH + h) * D
            for d in range(half):
                x1, x2 = qkv[t, kb + d], qkv[t, kb + half + d]
                k_out[t, h, d] = x1 * cos[p, d] + (-x2) * sin[p, d]
                k_out[t, h, half + d] = x2 * cos[p, half + d] + x1 * sin[p, half + d]
            for d in range(D):
                v_out[t, h, d] = qkv[t, vb + d]
    # Serially, in token order: padding tokens of a step share slots of the null block, and the
    # last writer must win the same way every time.
    for t in range(n):
        for h in range(KVH):
            rows[write_rows[t * KVH + h]] = k_out[t, h]
            rows[write_rows[(n + t) * KVH + h]] = v_out[t, h]


def _softmax_prefix32(row: np.ndarray, last: int) -> None:  # pragma: no cover - compiled by numba
    """In place: ``row[:last + 1]`` becomes its softmax (float32, minus its max), the rest 0."""
    m = row[0]
    for j in range(1, last + 1):
        m = max(m, row[j])
    total = np.float32(0.0)
    for j in range(last + 1):
        e = _exp(row[j] - m)
        row[j] = e
        total += e
    inv = np.float32(1.0) / total
    for j in range(last + 1):
        row[j] *= inv
    for j in range(last + 1, row.shape[0]):
        row[j] = np.float32(0.0)


def _causal_softmax(scores: np.ndarray, first: int, group: int) -> None:  # pragma: no cover - numba
    """In place: row r of ``scores [R, T]`` belongs to query token ``first + r // group`` (``group``
    query heads share a kv head), which sees keys ``0 .. first + r // group``; those columns become
    their softmax (float32, minus the row max) and the rest 0."""
    for r in prange(scores.shape[0]):
        _softmax_prefix(scores[r], first + r // group)


def _causal_tiles(
    qt: np.ndarray,
    kt: np.ndarray,
    vt: np.ndarray,
    out: np.ndarray,
    start: int,
    tile: int,
    threads: int,
) -> None:  # pragma: no cover - compiled by numba
    """A prefill chunk's causal tiles in one call (``ModelAttention.causal_tiles`` says what a tile
    is): queries ``qt [KVH, rows, G, D]`` (row 0 at position ``start // tile * tile``, zero outside
    the chunk), keys and values ``kt``/``vt [W, KVH, D]`` from position 0 (zero past the chunk),
    into ``out [n, KVH, G, D]`` for positions ``[start, start + n)``.

    A task is one (kv head, tile): its scores against keys ``[0, tile end)`` through MKL's sgemm on
    this thread alone (MKL_Set_Num_Threads_Local), the causal softmax in place, the weighted sum of
    V through sgemm (K and V read in place: row stride KVH * D). Each worker takes whole tasks,
    largest first, dealt in snake order so the workers' shares even out; one task's bits never
    depend on which worker or how many run it."""
    KVH, _, G, D = qt.shape
    end = start + out.shape[0]
    first, last = start // tile, (end - 1) // tile
    rows, width = tile * G, (last + 1) * tile
    tasks = KVH * (last - first + 1)
    workers = min(threads, tasks)  # numba's thread count, set by the caller
    for w in prange(workers):
        scores_buffer = np.empty(rows * width, np.float32)
        o = np.empty((rows, D), np.float32)
        previous = _mkl_threads_local(1)
        for task in range(tasks):
            lap, seat = task // workers, task % workers
            if (seat if lap % 2 == 0 else workers - 1 - seat) != w:
                continue
            h, i = task % KVH, last - task // KVH
            t0, t1 = i * tile, (i + 1) * tile
            s = scores_buffer[: rows * t1].reshape(rows, t1)
            one, zero, kvs = np.float32(1.0), np.float32(0.0), KVH * D
            q, k, v = qt[h, t0 - first * tile :].ctypes.data, kt[0, h:].ctypes.data, vt[0, h:].ctypes.data
            _sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, rows, t1, D, one, q, D, k, kvs, zero, s.ctypes.data, t1)
            for r in range(rows):
                _softmax_prefix(s[r], t0 + r // G)
            _sgemm(
                _ROW_MAJOR,
                _NO_TRANS,
                _NO_TRANS,
                rows,
                D,
                t1,
                one,
                s.ctypes.data,
                t1,
                v,
                kvs,
                zero,
                o.ctypes.data,
                D,
            )
            for pos in range(max(t0, start), min(t1, end)):
                out[pos - start, h] = o[(pos - t0) * G : (pos - t0 + 1) * G]
        _mkl_threads_local(previous)


@dataclasses.dataclass(frozen=True)
class Attention:
    """Which decode attention the engine runs, and why (one log line)."""

    impl: str  # "kernel" | "reference"
    reason: str
    kernel: Any = dataclasses.field(default=None, repr=False, compare=False)


_compiled: dict[str, Any] | None = None  # numba's compiled functions, made once per process


def _renamed(fn: Any, suffix: str) -> Any:
    """``fn`` under another name, for a second build with other options. numba's cache names an
    entry by the function's module, qualified name and signature, not by the options it was built
    with: the serial and the parallel build of one function shared an entry, so whichever compiled
    first was loaded for both (every "parallel" kernel ran on one thread, and unvectorized: SwiGLU
    of a 512-token prefill's layer took 3.2 ms where its parallel build takes 0.3)."""
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__
    )
    copy.__qualname__ = fn.__qualname__ + suffix
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    return copy


def _compile(threads: int) -> AttentionKernels:
    global prange, _exp, _as_float, _softmax_prefix, _compiled
    import numba

    first, t0 = _compiled is None, time.monotonic()
    if _compiled is None:  # the first start on a CPU compiles for about a minute: say so, or it looks hung
        log.info("compiling the attention kernels for this CPU (first start: ~1 min; cached after) ...")
        prange = numba.prange  # the kernels' parallel loops: resolved when numba compiles them
        _as_float = _make_as_float()
        _exp = numba.njit(inline="always", cache=True)(_exp32)
        _softmax_prefix = numba.njit(inline="always", cache=True, fastmath=_FASTMATH)(_softmax_prefix32)
        fast = numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
        exact = numba.njit(parallel=True, cache=True, nogil=True)  # rounds like Paddle's elementwise ops

        def serial(fn: Any, **options: Any) -> Any:  # on the calling thread only; cached apart (_renamed)
            return numba.njit(cache=True, nogil=True, **options)(_renamed(fn, "_serial"))

        _compiled = {
            "decode": fast(_decode_attention),
            "causal_softmax": fast(_causal_softmax),
            "rope_write": exact(_rope_write),
            "swiglu": fast(_swiglu),
            "add_rms_norm": fast(_add_rms_norm),
            "rms_norm": fast(_rms_norm),
            # the same functions on the calling thread only (prange is range without parallel=True)
            "decode_serial": serial(_decode_attention, fastmath=_FASTMATH),
            "rope_write_serial": serial(_rope_write),
            "swiglu_serial": serial(_swiglu, fastmath=_FASTMATH),
            "add_rms_norm_serial": serial(_add_rms_norm, fastmath=_FASTMATH),
            "rms_norm_serial": serial(_rms_norm, fastmath=_FASTMATH),
        }
    kernels = AttentionKernels(_compiled, threads)
    kernels.self_test()  # compiles now (or loads the per-CPU cache), not in the first request
    if first:
        log.info("attention kernels ready in %.1f s", time.monotonic() - t0)
    return kernels


def bind_causal_tiles(kernels: AttentionKernels | None, mkl: PackedMkl | None) -> bool:
    """Whether prefill chunks run their causal tiles in one compiled call (``_causal_tiles`` added
    to the kernels, calling ``mkl``'s sgemm by symbol: ``gemm.numba_mkl``; compiled once per process,
    self-tested against numpy). Not without the kernels or MKL, nor where that build fails or
    disagrees (logged): then the same tiles run from Python with Paddle's matmul."""
    global _sgemm, _mkl_threads_local
    if kernels is None or mkl is None:
        return False
    if "causal_tiles" in kernels.compiled:
        return True
    try:
        import numba

        functions = numba_mkl(mkl)
        _sgemm, _mkl_threads_local = functions["cblas_sgemm"], functions["MKL_Set_Num_Threads_Local"]
        kernels.compiled["causal_tiles"] = numba.njit(
            parallel=True, cache=True, fastmath=_FASTMATH, nogil=True
        )(_causal_tiles)
        kernels.tiles_self_test()
    except Exception as e:  # numba's TypingError/LoweringError, a symbol LLVM cannot find, a failed self-test
        kernels.compiled.pop("causal_tiles", None)
        log.warning(
            "causal tiles from Python with Paddle's matmul: the compiled ones are unavailable (%s)", e
        )
        return False
    return True


def select_attention(mode: str, threads: int) -> Attention:
    """``auto``: the kernel when numba imports and compiles, else the reference (never a crash);
    ``kernel``: the kernel or an error; ``reference``: the pure-Paddle gather path."""
    check_mode("attention", mode, ATTENTION_MODES)
    if mode == "reference":
        return Attention("reference", "reference path forced")
    kernels, why = load_or_fall_back(
        "attention",
        mode,
        lambda: _compile(threads),
        (Exception,),  # ImportError, numba's TypingError/LoweringError, a failed self-test
        "the numba kernels are unavailable",
        "reference attention",
    )
    if kernels is None:
        return Attention("reference", why)
    import numba

    return Attention("kernel", f"numba {numba.__version__}, {kernels.threads} threads", kernels)
