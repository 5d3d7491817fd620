"""Int8 weights: per-output-channel symmetric quantization and the GEMM that reads them
(docs/design.md "CPU kernels", ``--weights int8``).

A weight ``W`` ([in, out] as ``x @ W``) is kept as ``q`` ([out, in] int8, each output channel's row
contiguous) and ``scale`` ([out] float32): ``W[:, j] ~= q[j] * scale[j]`` with ``scale[j] =
max|W[:, j]| / 127`` and ``q`` rounded to nearest. A decode step reads a quarter of float32's
bytes, which is what decode at small batches waits on (it reads every weight once per step).

The product runs in integers, at every row count: each row of ``x`` is quantized to int16 with a
scale of its own (``x[r] ~= xq[r] * sx[r]``, ``sx[r] = max|x[r]| / limit(k)``, rounded to
nearest), the dot products of int16 activations and int8 weights are summed exactly in int32, and
``out[r, j] = acc * sx[r] * scale[j]`` (in float64, rounded once to float32). ``limit(k) =
min(32767, (2**31 - 1) // (127 k))`` keeps every sum inside int32 (k = 576: 29,356 levels, about 15
bits; k = 1536: 11,008; the activations lose far less than the weights' 8 bits).

Two products compute it, on two layouts of the same bytes, with register tiles written in LLVM IR
(cpu/int8_tiles.py: int16 x int8 products summed in pairs into int32 lanes, the shape of x86's
``pmaddwd``). The **dot product** (every row count; the fused decode step calls it) reads ``q``'s
rows: a tile of ``ROWS`` rows x ``COLS`` channels (a single row: ``WIDE`` channels) reads each
channel's row once, which is what a bandwidth-bound decode needs; channels are split into groups of
about ``GROUP_BYTES`` weight bytes (L2-resident while the row tiles pass) and rows into blocks of
about ``BLOCK_BYTES`` of activations, one (block, group) per work item of numba's threads; up to
``SERIAL_ROWS`` rows, x is quantized on the calling thread. The **broadcast product** (from
``BROADCAST_ROWS`` rows on, for the layers' matrices, which also hold ``blocks``: ``q`` packed in
blocks of 8 channels, :func:`pack_blocks`) broadcasts each row's pair of activations against a
block's 8 channels, so no output pays a reduction: it is the one that wins where the product is
compute-bound (a prefill). The blocks cost a second int8 copy of the layers (int8 weights take half
of float32's bytes, not a quarter). Measured on a Zen 3 (AVX2), 512 rows at SmolLM2's shapes, the
best of 12 runs: one thread, broadcast 1.25-1.4x MKL's packed float32 GEMM, dot 1.0-1.1x; two
threads on MKL's OpenMP team (cpu/paddle_setup.share_openmp; the four shapes in turn, medians of
40), broadcast 207-222 GFLOP/s-equivalent against MKL's 176-185; at 1 row the dot product reads a
quarter of float32's bytes (1.6-2.5x MKL).

Batch invariance: integer sums are exact, so a row's bits depend only on the row and the weights,
never on how many rows share the product, which of the two products ran, how they are tiled or
which threads ran them (the self-test checks both products' bits equal); no
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
from pdserve.engine.cpu.int8_tiles import LANES, STEP, broadcast_tile, dot_tile
from pdserve.engine.kernel_choice import check_mode
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

ROWS, COLS = 4, 2  # the dot tile: 8 int32 vector accumulators, 2 weight vectors, 1 of x
WIDE = 4  # channels of a single row's dot tile (a decode of one sequence)
GROUP_BYTES = 1 << 17  # int8 weight bytes per channel group (stays in L2 while the row tiles pass)
BLOCK_BYTES = 1 << 17  # int16 activation bytes of a block of rows (L2-resident while the groups pass)
SERIAL_ROWS = 8  # up to this many rows, x is quantized on the calling thread
GROUPS = 16  # channel groups come in multiples of 16: equal shares for 1, 2, 4, 8 or 16 threads
SCRATCH = 1 << 20  # int16 elements (2 MiB) of quantized activations: a 512-row chunk at k <= 2048
BROADCAST_ROWS = 16  # from this many rows on, a matrix with packed blocks takes the broadcast tiles
B_ROWS, B_COLS = 4, 2  # the broadcast tile: 4 rows x 2 blocks of 8 channels (8 accumulators)
B_GROUP = 16  # 8-channel blocks per channel group of the broadcast product (L1/L2-resident)

prange = range  # numba.prange once compile_int8 has imported numba (as in cpu/attention.py)
_tile1: Any = None  # the 1- to ROWS-row dot tiles (int8_tiles.dot_tile), bound by compile_int8
_tile2: Any = None
_tile3: Any = None
_tile4: Any = None
_wide1: Any = None  # the single-row dot tile of WIDE channels
_b11: Any = None  # the broadcast tiles, rows x blocks (int8_tiles.broadcast_tile)
_b12: Any = None
_b21: Any = None
_b22: Any = None
_b31: Any = None
_b32: Any = None
_b41: Any = None
_b42: Any = None
_quantize: Any = None  # _quantize_row compiled
_rows: Any = None  # _quantize_rows compiled
_limit: Any = None  # activation_limit compiled
_group: Any = None  # _product_group compiled
_bgroup: Any = None  # _blocks_group compiled


def activation_limit(k: int) -> int:
    """The largest |int16| an activation is quantized to for a dot product over ``k`` terms: 127 *
    limit * k stays within int32."""
    return max(1, min(32767, (2**31 - 1) // (127 * max(k, 1))))


@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """``W`` of ``x @ W`` as int8 rows per output channel and their scales."""

    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # float32 [out]
    blocks: np.ndarray | None = None  # the same int8 packed for many rows (pack_blocks), or None

    @property
    def k(self) -> int:
        return int(self.q.shape[1])

    @property
    def n(self) -> int:
        return int(self.q.shape[0])

    def dequantize(self) -> np.ndarray:
        """The float32 ``W`` ([in, out]) these bytes stand for."""
        return (self.q.astype(np.float32) * self.scale[:, None]).T


def quantize(w: np.ndarray, transposed: bool = False, blocks: bool = False) -> Int8Matrix:
    """Quantize ``w`` ([in, out]; ``transposed``: ``w`` is [out, in], e.g. a tied embedding used as
    the lm_head) per output channel; ``blocks``: also packed for many rows (:func:`pack_blocks`)."""
    rows = np.asarray(w if transposed else w.T, dtype=np.float32)  # [out, in]
    peak = np.abs(rows).max(axis=1)
    scale = np.where(peak > 0, peak / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.ascontiguousarray(np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8))
    return Int8Matrix(q, scale, pack_blocks(q) if blocks else None)


def pack_blocks(q: np.ndarray) -> np.ndarray | None:
    """``q`` ([n, k] int8) as the broadcast tiles read it: [ceil(n / 8), k / 2, 8, 2], block ``b``
    holding channels 8b..8b+7 pair by pair of k (channels past n are zero); None when k is odd."""
    n, k = q.shape
    if k % 2:
        return None
    nb = -(-n // LANES)
    padded = np.zeros((nb * LANES, k), np.int8)
    padded[:n] = q
    return np.ascontiguousarray(padded.reshape(nb, LANES, k // 2, 2).transpose(0, 2, 1, 3))


def _quantize_row(
    x: np.ndarray, r: int, limit: int, xq: np.ndarray, sx: np.ndarray
) -> None:  # pragma: no cover
    """xq[r] = rint(x[r] * limit / max|x[r]|) (int16), sx[r] = max|x[r]| / limit, in float64 (no
    fused multiply-add: every element rounds alike, vectorized or not). A row holding a NaN or an
    infinity gets sx = NaN, so its outputs are NaN as float32's would be. The peak is found on the
    row's bits (a finite float32's magnitude orders as its bits without the sign do; a NaN's or an
    infinity's are the largest): integer maxima vectorize, float ones (NaN-aware) do not."""
    k = x.shape[1]
    bits = x[r].view(np.int32)
    peak = np.int32(0)
    for i in range(k):
        peak = max(peak, bits[i] & np.int32(0x7FFFFFFF))
    amax = np.array([peak], np.int32).view(np.float32)[0]
    if peak >= np.int32(0x7F800000):  # an infinity or a NaN
        sx[r] = np.nan
        for i in range(k):
            xq[r, i] = 0
    elif peak == 0:
        sx[r] = 0.0
        for i in range(k):
            xq[r, i] = 0
    else:
        inv = np.float64(limit) / np.float64(amax)
        sx[r] = np.float64(amax) / np.float64(limit)
        for i in range(k):
            xq[r, i] = np.int16(np.rint(np.float64(x[r, i]) * inv))


def _quantize_rows(x: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """Both products' activations: x's rows quantized (_quantize_row) into ``scratch`` where it
    holds them (else a fresh array), and their scales."""
    m, k = x.shape
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
    return xq, sx


def _int8_matmul(
    x: np.ndarray, q: np.ndarray, scale: np.ndarray, scratch: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled by numba
    """out = x @ (q * scale)^T: x [m, k] float32, q [n, k] int8 (rows contiguous), scale [n], out
    [m, n] float32; scratch: int16, where x's quantized rows go when it holds m * k (else a fresh
    array)."""
    m, k = x.shape
    n = q.shape[0]
    xq, sx = _rows(x, scratch)
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


def _blocks_matmul(
    x: np.ndarray, blocks: np.ndarray, scale: np.ndarray, scratch: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled by numba
    """out = x @ W as _int8_matmul computes it, from W's packed blocks (pack_blocks): the same
    quantized rows, the same exact integer sums and the same scaling, so the same bits."""
    m, k = x.shape
    xq, sx = _rows(x, scratch)
    nb = blocks.shape[0]
    groups = -(-nb // B_GROUP)
    per = -(-nb // groups)  # blocks per channel group, the groups as even as they come
    groups = -(-nb // per)
    row_blocks = -(-(2 * m * k) // BLOCK_BYTES)  # rows whose int16 activations stay in L2
    rows = -(-m // row_blocks)
    rows = -(-rows // B_ROWS) * B_ROWS
    row_blocks = -(-m // rows)
    for item in prange(row_blocks * groups):
        b0 = item // groups * rows
        g = item % groups
        _bgroup(xq, blocks, scale, sx, out, g * per, min(nb, (g + 1) * per), b0, min(m, b0 + rows))


def _blocks_group(
    xq: np.ndarray,
    blocks: np.ndarray,
    scale: np.ndarray,
    sx: np.ndarray,
    out: np.ndarray,
    c0: int,
    c1: int,
    b0: int,
    b1: int,
) -> None:  # pragma: no cover - compiled by numba
    """out[b0:b1, channels of blocks c0:c1] of _blocks_matmul: B_COLS blocks' weights (L1-resident)
    against every B_ROWS-row tile of the rows in turn."""
    k = xq.shape[1]
    n = out.shape[1]
    pairs = k // 2
    ws = blocks.strides[0]
    width = B_COLS * LANES
    acc = np.empty(B_ROWS * width, np.int32)
    accs = acc.ctypes.data
    for cb in range(c0, c1, B_COLS):
        cols = min(B_COLS, c1 - cb)
        wa = blocks.ctypes.data + cb * ws
        j0 = cb * LANES
        j1 = min(n, j0 + cols * LANES)
        for r0 in range(b0, b1, B_ROWS):
            rows = min(B_ROWS, b1 - r0)
            xa = xq.ctypes.data + 2 * r0 * k
            if cols == 2:
                if rows == 4:
                    _b42(xa, k, wa, ws, pairs, accs)
                elif rows == 3:
                    _b32(xa, k, wa, ws, pairs, accs)
                elif rows == 2:
                    _b22(xa, k, wa, ws, pairs, accs)
                else:
                    _b12(xa, k, wa, ws, pairs, accs)
            elif rows == 4:
                _b41(xa, k, wa, ws, pairs, accs)
            elif rows == 3:
                _b31(xa, k, wa, ws, pairs, accs)
            elif rows == 2:
                _b21(xa, k, wa, ws, pairs, accs)
            else:
                _b11(xa, k, wa, ws, pairs, accs)
            for a in range(rows):
                r = r0 + a
                s = sx[r]
                for j in range(j0, j1):
                    out[r, j] = np.float32(np.float64(acc[a * width + j - j0]) * s * np.float64(scale[j]))


_compiled: Any = None  # the compiled _int8_matmul, made once per process
_compiled_blocks: Any = None  # the compiled _blocks_matmul


class Int8Gemm:
    """The compiled int8 product, its numba thread count and the quantized activations' scratch (one
    per engine: the engine steps in one thread at a time)."""

    def __init__(self, fn: Any, threads: int, scratch: int = SCRATCH, blocks_fn: Any = None) -> None:
        import numba

        self.fn = fn  # the dot tiles' product, on [n, k] rows (the fused decode step calls it too)
        self.blocks_fn = blocks_fn  # the broadcast tiles' product, on packed blocks (None: not used)
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
            if w.blocks is not None and self.blocks_fn is not None and x.shape[0] >= BROADCAST_ROWS:
                self.blocks_fn(x, w.blocks, w.scale, self.scratch, out)
            else:
                self.fn(x, w.q, w.scale, self.scratch, out)
        return out

    def self_test(self) -> None:
        """Refuse kernels that disagree with numpy: every dot tile (1 to ROWS rows, a single row's
        WIDE channels, a last odd channel, k with and without a scalar rest), several channel groups,
        a scratch too small, the integer sums exact against int64, a row's bits independent of the
        rows beside it, and the broadcast product's bits the dot product's (every broadcast tile, a
        last partial block, several groups and row blocks)."""
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
        if self.blocks_fn is not None:
            for k, n in ((40, 24), (48, 7), (1000, 300), (90, 2100)):
                m8 = quantize(rng.standard_normal((k, n), dtype=np.float32), blocks=True)
                assert m8.blocks is not None  # k is even
                for m in (1, 2, 3, B_ROWS, B_ROWS + 3, 150):
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    x[m // 2] *= 100
                    dot = np.empty((m, n), np.float32)
                    self.fn(x, m8.q, m8.scale, self.scratch, dot)
                    got = np.empty((m, n), np.float32)
                    self.blocks_fn(x, m8.blocks, m8.scale, np.empty(0, np.int16), got)
                    if not np.array_equal(got, dot):
                        raise RuntimeError(
                            f"the broadcast int8 product differs from the dot product ({m} x {k} x {n})"
                        )
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
    global prange, _tile1, _tile2, _tile3, _tile4, _wide1, _quantize, _rows, _limit, _group, _compiled
    global _b11, _b12, _b21, _b22, _b31, _b32, _b41, _b42, _bgroup, _compiled_blocks
    import numba

    if _compiled is None:
        t0 = time.monotonic()
        prange = numba.prange
        _tile1, _tile2, _tile3, _tile4 = (dot_tile(r, COLS, COLS) for r in range(1, ROWS + 1))
        _wide1 = dot_tile(1, WIDE, COLS)
        width = B_COLS * LANES
        _b11, _b12, _b21, _b22, _b31, _b32, _b41, _b42 = (
            broadcast_tile(r, c, width) for r in range(1, B_ROWS + 1) for c in range(1, B_COLS + 1)
        )
        _limit = numba.njit(cache=True)(activation_limit)
        _group = numba.njit(cache=True, nogil=True)(_product_group)
        _bgroup = numba.njit(cache=True, nogil=True)(_blocks_group)
        _quantize = numba.njit(cache=True, nogil=True)(_quantize_row)
        _rows = numba.njit(parallel=True, cache=True, nogil=True)(_quantize_rows)
        _compiled = numba.njit(parallel=True, cache=True, nogil=True)(_int8_matmul)
        _compiled_blocks = numba.njit(parallel=True, cache=True, nogil=True)(_blocks_matmul)
        Int8Gemm(_compiled, threads, blocks_fn=_compiled_blocks).self_test()
        log.info("int8 GEMM compiled in %.1f s", time.monotonic() - t0)
    return Int8Gemm(_compiled, threads, blocks_fn=_compiled_blocks)
