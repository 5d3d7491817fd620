"""Int8 weights: per-output-channel symmetric quantization and the GEMMs that read them
(docs/design.md "CPU kernels", ``--weights int8``).

A weight ``W`` ([in, out] as ``x @ W``) is kept as ``q`` ([out, in] int8, each output channel's row
contiguous) and ``scale`` ([out] float32): ``W[:, j] ~= q[j] * scale[j]`` with ``scale[j] =
max|W[:, j]| / 127`` and ``q`` rounded to nearest. A quarter of float32's bytes, which is what
decode at small batches waits on (it reads every weight once per step).

The products dequantize inside the kernel: up to ``GEMV_ROWS`` rows, each output channel's int8 row
is read once and dotted with every row of ``x`` (the weights are read as int8); above, a tile of
output channels at a time is widened to float32 into a small scratch (cache-resident) and MKL's
``cblas_sgemm`` multiplies it (compute-bound sizes, where MKL's blocking beats a dot loop). Both are compiled by numba for this CPU
(``cache=True`` keys the cache per CPU), called from Python on the layer path and from the fused
decode step; ``cblas_sgemm`` is Paddle's MKL, resolved by symbol like the packed GEMM.

Batch invariance: a row's bits depend on which of the two kernels ran, i.e. on the row count; in
batch-invariant mode every step has at least 8 rows (model_runner.padded_rows), above
``GEMV_ROWS``, so every product takes the MKL path, whose rows are invariant under
``MKL_CBWR=AUTO,STRICT``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.kernels.choice import check_mode
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHT_TYPES: tuple[str, ...] = ("f32", "int8")
# Rows up to which the dot-product kernel runs (above: widen + MKL). Below model_runner's minimum
# padded step of 8 rows, so batch-invariant mode always takes the MKL path.
GEMV_ROWS = 4
SCRATCH = 1 << 20  # float32 elements (4 MiB) the MKL path widens into, a tile of channels at a time

prange = range  # numba.prange once _compile has imported numba (as in kernels/attention.py)
_sgemm: Any = None  # cblas_sgemm, an LLVM external symbol once _compile has run
_FASTMATH = {"reassoc", "contract"}  # vectorized dot products in a fixed order (deterministic)


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


def _int8_matmul(
    x: np.ndarray, q: np.ndarray, scale: np.ndarray, scratch: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled by numba
    """out = x @ (q * scale)^T: x [m, k] float32, q [n, k] int8, scale [n], out [m, n]; scratch:
    float32 [>= k], where the MKL path widens as many output channels at a time as fit."""
    m, k = x.shape
    n = q.shape[0]
    if m <= GEMV_ROWS:
        for j in prange(n):
            s = scale[j]
            for r in range(m):
                acc = np.float32(0.0)
                for i in range(k):
                    acc += np.float32(q[j, i]) * x[r, i]
                out[r, j] = acc * s
        return
    tile = scratch.shape[0] // k
    for j0 in range(0, n, tile):
        rows = min(tile, n - j0)
        wide = scratch[: rows * k].reshape(rows, k)
        for j in prange(rows):
            s = scale[j0 + j]
            for i in range(k):
                wide[j, i] = np.float32(q[j0 + j, i]) * s
        # x [m, k] times wide^T [k, rows] into out[:, j0 : j0 + rows] (row stride n): CblasRowMajor
        # 101, NoTrans 111, Trans 112
        _sgemm(101, 111, 112, m, rows, k, np.float32(1.0), x.ctypes.data, k, wide.ctypes.data, k,
               np.float32(0.0), out.ctypes.data + 4 * j0, n)  # fmt: skip


_compiled: Any = None  # the compiled _int8_matmul, made once per process


class Int8Gemm:
    """The compiled int8 product, its numba thread count and the MKL path's scratch (one per engine:
    the engine steps in one thread at a time)."""

    def __init__(self, fn: Any, threads: int, scratch: int = SCRATCH) -> None:
        import numba

        self.fn = fn
        self._set_threads = numba.set_num_threads
        self.threads = threads
        self.scratch = np.empty(scratch, np.float32)

    def matmul(self, x: np.ndarray, w: Int8Matrix) -> np.ndarray:
        """``x @ W`` for ``x`` [m, k] float32 (made C-contiguous if it is not) into a new [m, n] array."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[1] != w.k:
            raise ValueError(f"x has {x.shape[1]} columns, the int8 matrix {w.k} rows")
        if self.scratch.shape[0] < w.k:
            self.scratch = np.empty(w.k, np.float32)
        out = np.empty((x.shape[0], w.n), np.float32)
        if x.shape[0]:
            self._set_threads(self.threads)
            self.fn(x, w.q, w.scale, self.scratch, out)
        return out

    def self_test(self) -> None:
        """Refuse kernels that disagree with numpy: both paths, the MKL one over several tiles."""
        rng = np.random.default_rng(0)
        w = rng.standard_normal((40, 24), dtype=np.float32)
        m8 = quantize(w)
        if np.abs(m8.dequantize() - w).max() > np.abs(w).max() / 254 * 1.0001:
            raise RuntimeError("int8 quantization is off by more than half a step")
        tiny = Int8Gemm(self.fn, self.threads, scratch=40 * 5)  # tiles of 5 channels: 5 tiles
        for m in (1, GEMV_ROWS, GEMV_ROWS + 1, 13):
            x = rng.standard_normal((m, 40), dtype=np.float32)
            want = x.astype(np.float64) @ m8.dequantize().astype(np.float64)
            for gemm in (self, tiny):
                if not np.allclose(gemm.matmul(x, m8), want, rtol=1e-4, atol=1e-4):
                    raise RuntimeError(f"the compiled int8 GEMM disagrees with numpy at {m} rows")


def select_weights(mode: str, threads: int) -> Int8Gemm | None:
    """``f32``: None (float32 weights); ``int8``: the compiled int8 product over Paddle's MKL, or a
    ``ConfigError`` saying why it cannot run here."""
    check_mode("weights", mode, WEIGHT_TYPES)
    if mode == "f32":
        return None
    from pdserve.engine.kernels.gemm import bundled_mkl

    try:
        return compile_int8(threads, bundled_mkl())
    except Exception as e:  # ImportError, numba's errors, a symbol LLVM cannot find, a failed self-test
        raise ConfigError(f"weights=int8: the int8 kernels are unavailable: {type(e).__name__}: {e}") from e


def compile_int8(threads: int, mkl_path: Path) -> Int8Gemm:
    """Compile (or load from numba's cache) the int8 product, calling ``cblas_sgemm`` of the MKL at
    ``mkl_path``, and test it."""
    global prange, _sgemm, _compiled
    import llvmlite.binding
    import numba
    from numba import types

    if _compiled is None:
        t0 = time.monotonic()
        prange = numba.prange
        llvmlite.binding.load_library_permanently(str(mkl_path))
        i32, f32, ptr = types.int32, types.float32, types.intp
        _sgemm = types.ExternalFunction(
            "cblas_sgemm", types.void(i32, i32, i32, i32, i32, i32, f32, ptr, i32, ptr, i32, f32, ptr, i32)
        )
        _compiled = numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)(_int8_matmul)
        Int8Gemm(_compiled, threads).self_test()
        log.info("int8 GEMM compiled in %.1f s", time.monotonic() - t0)
    return Int8Gemm(_compiled, threads)
