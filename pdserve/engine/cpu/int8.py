"""Int8 weights: per-output-channel symmetric quantization and the GEMM that reads them
(docs/design.md "CPU kernels", ``--weights int8``).

A weight ``W`` ([in, out] as ``x @ W``) is kept as ``q`` ([out, in] int8, each output channel's row
contiguous) and ``scale`` ([out] float32): ``W[:, j] ~= q[j] * scale[j]`` with ``scale[j] =
max|W[:, j]| / 127`` and ``q`` rounded to nearest. A quarter of float32's bytes, which is what
decode at small batches waits on (it reads every weight once per step).

The product runs in integers, at every row count: each row of ``x`` is quantized to int16 with a
scale of its own (``x[r] ~= xq[r] * sx[r]``, ``sx[r] = max|x[r]| / limit(k)``, rounded to
nearest), the dot products of int16 activations and int8 weights are summed exactly in int32, and
``out[r, j] = acc * sx[r] * scale[j]`` (in float64, rounded once to float32). ``limit(k) =
min(32767, (2**31 - 1) // (127 k))`` keeps every sum inside int32 (k = 576: 29,356 levels, about 15
bits; k = 1536: 11,008; the activations lose far less than the weights' 8 bits). A register tile of
``ROWS`` rows x ``COLS`` channels is written in LLVM IR (``_tile_intrinsic``): 16 products per
vector step, int16 x int16 summed in pairs into int32 lanes -- the shape x86's ``pmaddwd`` (AVX2:
16 products per instruction, FMA does 8) and VNNI's ``vpdpwssd`` take, so LLVM selects them where
the CPU has them; the IR names no instruction, so any CPU LLVM targets compiles it and no feature
check is needed (the self-test checks the result). Each channel's int8 row is read once per tile of
``ROWS`` rows; channels are split into groups of about ``GROUP_BYTES`` weight bytes (L2-resident
while the row tiles pass) and rows into blocks of about ``BLOCK_BYTES`` of activations, one (block,
group) per work item of numba's threads. Up to ``SERIAL_ROWS`` rows, x is quantized on the calling
thread (one parallel region per product). Measured on a Zen 3 (AVX2) core, one thread: 1.1-1.3x
MKL's packed float32 GEMM from 8 to 512 rows at SmolLM2's shapes, 1.6-2.5x at 1 row (a quarter of
the bytes).

Batch invariance: integer sums are exact, so a row's bits depend only on the row and the weights,
never on how many rows share the product, how they are tiled or which threads ran them; no
``MKL_CBWR`` is needed (model_runner.padded_rows still pads batch-invariant steps, for the
attention kernels' and float32 GEMMs' sake).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from pdserve.engine.config import WEIGHT_TYPES
from pdserve.engine.kernel_choice import check_mode
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

ROWS, COLS = 4, 2  # the register tile: 8 int32 vector accumulators, 2 weight vectors, 1 of x
WIDE = 4  # channels of a single row's tile (a decode of one sequence)
PREFETCH = 2  # tiles ahead that a tile prefetches the weights of
STEP = 16  # int16 products per vector step of a tile (the rest of k: a scalar loop)
GROUP_BYTES = 1 << 17  # int8 weight bytes per channel group (stays in L2 while the row tiles pass)
BLOCK_BYTES = 1 << 17  # int16 activation bytes of a block of rows (L2-resident while the groups pass)
SERIAL_ROWS = 8  # up to this many rows, x is quantized on the calling thread
GROUPS = 16  # channel groups come in multiples of 16: equal shares for 1, 2, 4, 8 or 16 threads
SCRATCH = 1 << 20  # int16 elements (2 MiB) of quantized activations: a 512-row chunk at k <= 2048

prange = range  # numba.prange once compile_int8 has imported numba (as in cpu/attention.py)
_tile1: Any = None  # the 1- to ROWS-row register tiles (_tile_intrinsic), bound by compile_int8
_tile2: Any = None
_tile3: Any = None
_tile4: Any = None
_wide1: Any = None  # the single-row tile of WIDE channels
_quantize: Any = None  # _quantize_row compiled
_limit: Any = None  # activation_limit compiled
_group: Any = None  # _product_group compiled


def activation_limit(k: int) -> int:
    """The largest |int16| an activation is quantized to for a dot product over ``k`` terms: 127 *
    limit * k stays within int32."""
    return max(1, min(32767, (2**31 - 1) // (127 * max(k, 1))))


@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """``W`` of ``x @ W`` as int8 rows per output channel and their scales."""

    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # float32 [out]

    @property
    def k(self) -> int:
        return int(self.q.shape[1])

    @property
    def n(self) -> int:
        return int(self.q.shape[0])

    def dequantize(self) -> np.ndarray:
        """The float32 ``W`` ([in, out]) these bytes stand for."""
        return (self.q.astype(np.float32) * self.scale[:, None]).T


def quantize(w: np.ndarray, transposed: bool = False) -> Int8Matrix:
    """Quantize ``w`` ([in, out]; ``transposed``: ``w`` is [out, in], e.g. a tied embedding used as
    the lm_head) per output channel."""
    rows = np.asarray(w if transposed else w.T, dtype=np.float32)  # [out, in]
    peak = np.abs(rows).max(axis=1)
    scale = np.where(peak > 0, peak / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
    return Int8Matrix(np.ascontiguousarray(q), scale)


def _quantize_row(
    x: np.ndarray, r: int, limit: int, xq: np.ndarray, sx: np.ndarray
) -> None:  # pragma: no cover
    """xq[r] = rint(x[r] * limit / max|x[r]|) (int16), sx[r] = max|x[r]| / limit, in float64 (no
    fused multiply-add: every element rounds alike, vectorized or not). A row holding a NaN or an
    infinity gets sx = NaN, so its outputs are NaN as float32's would be."""
    k = x.shape[1]
    amax = np.float32(0.0)
    poison = np.float32(0.0)
    for i in range(k):
        amax = max(amax, abs(x[r, i]))
        poison += x[r, i] * np.float32(0.0)  # NaN where any element is NaN or infinite
    if poison != 0.0 or amax != amax:
        sx[r] = np.nan
        for i in range(k):
            xq[r, i] = 0
    elif amax == 0.0:
        sx[r] = 0.0
        for i in range(k):
            xq[r, i] = 0
    else:
        inv = np.float64(limit) / np.float64(amax)
        sx[r] = np.float64(amax) / np.float64(limit)
        for i in range(k):
            xq[r, i] = np.int16(np.rint(np.float64(x[r, i]) * inv))


def _int8_matmul(
    x: np.ndarray, q: np.ndarray, scale: np.ndarray, scratch: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled by numba
    """out = x @ (q * scale)^T: x [m, k] float32, q [n, k] int8 (rows contiguous), scale [n], out
    [m, n] float32; scratch: int16, where x's quantized rows go when it holds m * k (else a fresh
    array)."""
    m, k = x.shape
    n = q.shape[0]
    fits = scratch.shape[0] >= m * k
    xq = scratch[: m * k].reshape((m, k)) if fits else np.empty((m, k), np.int16)
    sx = np.empty(m, np.float64)
    limit = _limit(k)
    if m <= SERIAL_ROWS:  # a parallel region's start costs more than quantizing a few rows
        for r in range(m):
            _quantize(x, r, limit, xq, sx)
    else:
        for r in prange(m):
            _quantize(x, r, limit, xq, sx)
    groups = -(-max(n * k // GROUP_BYTES, 1) // GROUPS) * GROUPS
    per = -(-n // groups)
    width = -(-per // COLS) * COLS  # channels per group, a multiple of COLS
    groups = -(-n // width)
    block = max(ROWS, BLOCK_BYTES // (2 * k) // ROWS * ROWS)  # rows whose int16 activations stay in L2
    blocks = -(-m // block)
    for item in prange(blocks * groups):
        b0 = item // groups * block
        g = item % groups
        _group(xq, q, scale, sx, out, g * width, min(n, (g + 1) * width), b0, min(m, b0 + block))


def _product_group(
    xq: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    sx: np.ndarray,
    out: np.ndarray,
    j0: int,
    j1: int,
    b0: int,
    b1: int,
) -> None:  # pragma: no cover - compiled by numba
    """out[b0:b1, j0:j1] of _int8_matmul: each tile of ROWS rows against every channel pair (a single
    row against WIDE channels at a time: fewer calls and reductions per weight byte)."""
    k = xq.shape[1]
    steps = k // STEP
    whole = steps * STEP
    wstride = q.strides[0]
    pairs = j0 + (j1 - j0) // COLS * COLS
    acc = np.empty(max(ROWS * COLS, WIDE), np.int32)
    accs, weights = acc.ctypes.data, q.ctypes.data
    for r0 in range(b0, b1, ROWS):
        rows = min(ROWS, b1 - r0)
        xa = xq.ctypes.data + 2 * r0 * k
        j = j0
        while j < j1:
            wa = weights + j * wstride
            cols, start = COLS, whole
            if rows == 1 and j + WIDE <= pairs:
                _wide1(xa, k, wa, wstride, steps, accs)
                cols = WIDE
            elif j < pairs:
                if rows == 4:
                    _tile4(xa, k, wa, wstride, steps, accs)
                elif rows == 3:
                    _tile3(xa, k, wa, wstride, steps, accs)
                elif rows == 2:
                    _tile2(xa, k, wa, wstride, steps, accs)
                else:
                    _tile1(xa, k, wa, wstride, steps, accs)
            else:  # a last odd channel: all of k in the scalar loop
                cols, start = 1, 0
                for a in range(rows):
                    acc[a * COLS] = 0
            for a in range(rows):
                r = r0 + a
                for c in range(cols):
                    total = np.int64(acc[a * COLS + c])
                    for i in range(start, k):
                        total += np.int64(xq[r, i]) * np.int64(q[j + c, i])
                    out[r, j + c] = np.float32(np.float64(total) * sx[r] * np.float64(scale[j + c]))
            j += cols


def _tile_intrinsic(rows: int, cols: int) -> Any:  # pragma: no cover - runs inside numba's compiler
    """A numba intrinsic ``tile(x, xs, w, ws, steps, out)`` (addresses and strides as integers):
    ``out[a * COLS + b] = sum(x[a, i] * w[b, i] for i < 16 steps)`` in int32 for ``rows`` rows of
    int16 ``x`` (row stride ``xs`` elements) and ``cols`` channels of int8 ``w`` (row stride ``ws``
    bytes). Written in LLVM IR: per step one <16 x i16> load per row, one <16 x i8> per channel
    (sign-extended), and per pair the products summed in adjacent pairs into <8 x i32> accumulators
    (LLVM's pmaddwd pattern); the accumulators are reduced at the end."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile(typingctx: Any, x: Any, xs: Any, w: Any, ws: Any, steps: Any, out: Any) -> Any:
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            x, xs, w, ws, steps, out = args
            i64, i32, i16, i8 = ir.IntType(64), ir.IntType(32), ir.IntType(16), ir.IntType(8)
            v16i16, v16i8, v16i32 = (
                ir.VectorType(i16, STEP),
                ir.VectorType(i8, STEP),
                ir.VectorType(i32, STEP),
            )
            v8i32 = ir.VectorType(i32, STEP // 2)
            even = ir.Constant(v8i32, [2 * t for t in range(STEP // 2)])
            odd = ir.Constant(v8i32, [2 * t + 1 for t in range(STEP // 2)])
            zero = ir.Constant(v8i32, None)
            entry = builder.basic_block
            loop = builder.append_basic_block("i8tile.loop")
            done = builder.append_basic_block("i8tile.done")
            builder.cbranch(builder.icmp_signed(">", steps, ir.Constant(i64, 0)), loop, done)
            builder.position_at_end(loop)
            i = builder.phi(i64)
            accs = [builder.phi(v8i32) for _ in range(rows * cols)]
            # The weights of the tile PREFETCH tiles ahead, cols * 16 bytes per step (a group's channel
            # rows are contiguous): the tile reads its channels side by side, streams too short for
            # the hardware prefetcher to follow (a single row read ~40 % slower from DRAM without).
            ahead = builder.add(
                builder.add(w, builder.mul(ir.Constant(i64, PREFETCH * cols), ws)),
                builder.mul(i, ir.Constant(i64, STEP * cols)),
            )
            i8p = ir.IntType(8).as_pointer()
            name = "llvm.prefetch.p0"
            prefetch = builder.module.globals.get(name) or ir.Function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name
            )
            builder.call(
                prefetch,
                [builder.inttoptr(ahead, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)],
            )
            wide = []
            for c in range(cols):
                at = builder.add(
                    w,
                    builder.add(builder.mul(ir.Constant(i64, c), ws), builder.mul(i, ir.Constant(i64, STEP))),
                )
                v = builder.load(builder.inttoptr(at, v16i8.as_pointer()), align=1)
                wide.append(builder.sext(builder.sext(v, v16i16), v16i32))
            new = []
            for r in range(rows):
                at = builder.add(
                    x,
                    builder.add(
                        builder.mul(ir.Constant(i64, 2 * r), xs), builder.mul(i, ir.Constant(i64, 2 * STEP))
                    ),
                )
                xv = builder.sext(builder.load(builder.inttoptr(at, v16i16.as_pointer()), align=2), v16i32)
                for c in range(cols):
                    p = builder.mul(xv, wide[c])
                    pair = builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))
                    new.append(builder.add(accs[r * cols + c], pair))
            nxt = builder.add(i, ir.Constant(i64, 1))
            builder.cbranch(builder.icmp_signed("<", nxt, steps), loop, done)
            i.add_incoming(ir.Constant(i64, 0), entry)
            i.add_incoming(nxt, loop)
            for a, v in zip(accs, new, strict=True):
                a.add_incoming(zero, entry)
                a.add_incoming(v, loop)
            builder.position_at_end(done)
            name = "llvm.vector.reduce.add.v8i32"
            reduce = builder.module.globals.get(name) or ir.Function(
                builder.module, ir.FunctionType(i32, [v8i32]), name
            )
            finals = []
            for v in new:
                f = builder.phi(v8i32)
                f.add_incoming(zero, entry)
                f.add_incoming(v, loop)
                finals.append(f)
            for r in range(rows):
                for c in range(cols):
                    at = builder.add(out, ir.Constant(i64, 4 * (r * COLS + c)))
                    builder.store(
                        builder.call(reduce, [finals[r * cols + c]]),
                        builder.inttoptr(at, i32.as_pointer()),
                        align=4,
                    )
            return context.get_dummy_value()

        return sig, codegen

    return tile


_compiled: Any = None  # the compiled _int8_matmul, made once per process


class Int8Gemm:
    """The compiled int8 product, its numba thread count and the quantized activations' scratch (one
    per engine: the engine steps in one thread at a time)."""

    def __init__(self, fn: Any, threads: int, scratch: int = SCRATCH) -> None:
        import numba

        self.fn = fn
        self._set_threads = numba.set_num_threads
        self.threads = threads
        self.scratch = np.empty(scratch, np.int16)

    def matmul(self, x: np.ndarray, w: Int8Matrix) -> np.ndarray:
        """``x @ W`` for ``x`` [m, k] float32 (made C-contiguous if it is not) into a new [m, n] array."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[1] != w.k:
            raise ValueError(f"x has {x.shape[1]} columns, the int8 matrix {w.k} rows")
        if w.q.strides[1] != 1:
            raise ValueError("the int8 matrix's rows must be contiguous")
        out = np.empty((x.shape[0], w.n), np.float32)
        if x.shape[0]:
            if self.scratch.shape[0] < x.size:  # the layer path's prefill chunks: grown once
                self.scratch = np.empty(x.size, np.int16)
            self._set_threads(self.threads)
            self.fn(x, w.q, w.scale, self.scratch, out)
        return out

    def self_test(self) -> None:
        """Refuse kernels that disagree with numpy: every register tile (1 to ROWS rows, a single row's
        WIDE channels, a last odd channel, k with and without a scalar rest), several channel groups, a scratch too small, the
        integer sums exact against int64, and a row's bits independent of the rows beside it."""
        rng = np.random.default_rng(0)
        w = rng.standard_normal((40, 24), dtype=np.float32)
        m8 = quantize(w)
        if np.abs(m8.dequantize() - w).max() > np.abs(w).max() / 254 * 1.0001:
            raise RuntimeError("int8 quantization is off by more than half a step")
        for k, n in ((40, 24), (48, 7), (3000, 45)):  # 3000 x 45: 12 groups of 4 channels (WIDE), 1 odd
            m8 = quantize(rng.standard_normal((k, n), dtype=np.float32))
            x = rng.standard_normal((13, k), dtype=np.float32)
            x[5] *= 100  # rows of other magnitudes
            x[6] = 0.0
            alone = [self.matmul(x[r : r + 1], m8) for r in range(len(x))]
            for m in (1, 2, 3, ROWS, ROWS + 1, 13):
                got = self.matmul(x[:m], m8)
                if not all(np.array_equal(got[r], alone[r][0]) for r in range(m)):
                    raise RuntimeError(f"the int8 GEMM's rows depend on the batch ({m} rows, k={k})")
                limit = activation_limit(k)
                amax = np.abs(x[:m]).max(axis=1, keepdims=True)
                xq = np.rint(x[:m].astype(np.float64) * (limit / np.where(amax > 0, amax, 1)))
                exact = xq.astype(np.int64) @ m8.q.T.astype(np.int64)  # the sums, in int64
                sx = amax.astype(np.float64) / limit
                want = (exact * sx * m8.scale.astype(np.float64)).astype(np.float32)
                if not np.allclose(got, want, rtol=1e-6, atol=1e-30):
                    raise RuntimeError(f"the compiled int8 GEMM disagrees with numpy at {m} rows, k={k}")
        tiny = Int8Gemm(self.fn, self.threads, scratch=8)  # too small: the kernel allocates
        tiny.scratch = np.empty(8, np.int16)
        x = rng.standard_normal((5, 40), dtype=np.float32)
        m8 = quantize(rng.standard_normal((40, 24), dtype=np.float32))
        self._set_threads(self.threads)
        out = np.empty((5, 24), np.float32)
        self.fn(x, m8.q, m8.scale, tiny.scratch, out)
        if not np.array_equal(out, self.matmul(x, m8)):
            raise RuntimeError("the int8 GEMM differs when it allocates its own activations")


def select_weights(mode: str, threads: int) -> Int8Gemm | None:
    """``f32``: None (float32 weights); ``int8``: the compiled int8 product, or a ``ConfigError``
    saying why it cannot run here."""
    check_mode("weights", mode, WEIGHT_TYPES)
    if mode == "f32":
        return None
    try:
        return compile_int8(threads)
    except Exception as e:  # ImportError, numba's errors, a failed self-test
        raise ConfigError(f"weights=int8: the int8 kernels are unavailable: {type(e).__name__}: {e}") from e


def compile_int8(threads: int) -> Int8Gemm:
    """Compile (or load from numba's cache) the int8 product and test it."""
    global prange, _tile1, _tile2, _tile3, _tile4, _wide1, _quantize, _limit, _group, _compiled
    import numba

    if _compiled is None:
        t0 = time.monotonic()
        prange = numba.prange
        _tile1, _tile2, _tile3, _tile4 = (_tile_intrinsic(r, COLS) for r in range(1, ROWS + 1))
        _wide1 = _tile_intrinsic(1, WIDE)
        _limit = numba.njit(cache=True)(activation_limit)
        _group = numba.njit(cache=True, nogil=True)(_product_group)
        _quantize = numba.njit(cache=True, nogil=True)(_quantize_row)
        _compiled = numba.njit(parallel=True, cache=True, nogil=True)(_int8_matmul)
        Int8Gemm(_compiled, threads).self_test()
        log.info("int8 GEMM compiled in %.1f s", time.monotonic() - t0)
    return Int8Gemm(_compiled, threads)
