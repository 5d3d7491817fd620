"""GEMMs against weights packed once, through MKL's packed API (docs/design.md "CPU kernels").

Paddle's matmul calls MKL's ``cblas_sgemm``, which copies the weight operand into MKL's panel
layout on every call. At decode sizes (1 to 64 rows against a 1024 x 6144 weight) that copy costs
as much as the arithmetic: ERNIE-0.3B's GEMMs (four per layer and the tied lm_head) took 377 ms per
batch-32 step through Paddle and 188 ms against weights packed once by ``cblas_sgemm_pack`` and
multiplied by ``cblas_sgemm_compute`` (196 -> 70 ms at batch 8, 74 -> 49 ms at batch 1; a 512-row
prefill's GEMMs ~8 % slower). The packed API is in the MKL that Paddle's CPU wheel bundles
(``paddle/libs/libmklml_intel.so``); pdserve calls it through ctypes on that same library, so its
threads, ``MKL_DEBUG_CPU_TYPE`` and ``MKL_CBWR`` are the ones Paddle set, and ctypes releases the
GIL for the call. Under ``MKL_CBWR=AUTO,STRICT`` a row's bits do not depend on how many rows are
multiplied with it (tested), so batch-invariant mode holds.

A packed matrix is opaque (MKL's layout for this CPU and thread count). Its buffer reserves
``cblas_sgemm_pack_get_size`` bytes (2-5x the weight's size at SmolLM2's shapes) of which MKL writes
a prefix about the weight's own size; a page-backed buffer keeps the rest from becoming resident.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.config import GEMM_MODES
from pdserve.engine.kernel_choice import check_mode, load_or_fall_back
from pdserve.engine.memory import page_empty

log = logging.getLogger(__name__)


# CBLAS enum values (mkl_cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count MKL lays a packed matrix out for. It matters: packed for 1 row, a 32-row product is
# ~2x slower; 64 to 256 measured alike from 1 to 512 rows, and at 512 rows as fast as Paddle's matmul.
PACK_ROWS = 128
_int, _ptr, _float = ctypes.c_int, ctypes.c_void_p, ctypes.c_float  # MKL_INT is 32-bit (LP64 build)


@dataclasses.dataclass(frozen=True)
class PackedMatrix:
    """The B operand of ``x @ B`` ([k, n]) in MKL's packed layout (``buffer``, 64-byte aligned)."""

    k: int
    n: int
    buffer: np.ndarray = dataclasses.field(repr=False)


class PackedMkl:
    """``cblas_sgemm_pack`` and ``cblas_sgemm_compute`` of one loaded MKL."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._size = lib.cblas_sgemm_pack_get_size
        self._size.restype, self._size.argtypes = ctypes.c_size_t, [_int] * 4
        self._pack = lib.cblas_sgemm_pack
        self._pack.restype = None
        self._pack.argtypes = [_int] * 6 + [_float, _ptr, _int, _ptr]
        self._compute = lib.cblas_sgemm_compute
        self._compute.restype = None
        self._compute.argtypes = [_int] * 6 + [_ptr, _int, _ptr, _int, _float, _ptr, _int]
        self._sgemm = lib.cblas_sgemm
        self._sgemm.restype = None
        self._sgemm.argtypes = [_int] * 6 + [_float, _ptr, _int, _ptr, _int, _float, _ptr, _int]

    def pack(self, w: np.ndarray, transposed: bool = False) -> PackedMatrix:
        """Pack ``w`` ([k, n], float32) as the B of ``x @ B``; ``transposed``: ``w`` is [n, k] and B is
        its transpose (a tied embedding used as the lm_head)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        n, k = w.shape if transposed else w.shape[::-1]
        size = self._size(_B_MATRIX, PACK_ROWS, n, k)
        # Page-backed: get_size reserves 2-5x what MKL writes (SmolLM2: 1.98 GB for 0.54 GB of
        # weights); untouched pages of a fresh mapping never become resident, where malloc's heap
        # may hand out recycled, resident ones. Page-aligned, so 64-byte aligned as MKL prefers.
        buffer = page_empty(size, np.uint8)
        trans = _TRANS if transposed else _NO_TRANS
        self._pack(
            _ROW_MAJOR, _B_MATRIX, trans, PACK_ROWS, n, k, 1.0, w.ctypes.data, w.shape[1], buffer.ctypes.data
        )
        return PackedMatrix(k, n, buffer)

    def matmul(self, x: np.ndarray, b: PackedMatrix) -> np.ndarray:
        """``x @ B`` for ``x`` [m, k] float32 (made C-contiguous if it is not) into a new [m, n] array."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        if k != b.k:
            raise ValueError(f"x has {k} columns, the packed matrix {b.k} rows")
        out = np.empty((m, b.n), np.float32)
        if m:
            self._compute(
                _ROW_MAJOR,
                _NO_TRANS,
                _PACKED,
                m,
                b.n,
                k,
                x.ctypes.data,
                k,
                b.buffer.ctypes.data,
                b.n,
                0.0,
                out.ctypes.data,
                b.n,
            )
        return out

    def sgemm(self, a: np.ndarray, b: np.ndarray, trans_b: bool = False) -> np.ndarray:
        """``a @ b`` (``a @ b.T`` with ``trans_b``) of C-contiguous float32 arrays through plain
        ``cblas_sgemm``, the routine the prefill attention's tiles call from numba (``numba_mkl``;
        their operands change every call, so packing would not pay): here for the self-test."""
        m, k = a.shape
        n = b.shape[0] if trans_b else b.shape[1]
        if (b.shape[1] if trans_b else b.shape[0]) != k:
            raise ValueError(f"a has {k} columns, b's other side {b.shape}")
        if not (a.flags.c_contiguous and b.flags.c_contiguous):
            raise ValueError("sgemm takes C-contiguous operands")
        out = np.empty((m, n), np.float32)
        if m and n:
            trans = _TRANS if trans_b else _NO_TRANS
            ldb = b.shape[1]
            self._sgemm(
                _ROW_MAJOR,
                _NO_TRANS,
                trans,
                m,
                n,
                k,
                1.0,
                a.ctypes.data,
                k,
                b.ctypes.data,
                ldb,
                0.0,
                out.ctypes.data,
                n,
            )
        return out

    def self_test(self) -> None:
        """Refuse an MKL whose GEMMs disagree with numpy (packed in both layouts, 1 and 13 rows;
        plain, with b as it is and transposed)."""
        rng = np.random.default_rng(0)
        w = rng.standard_normal((40, 24), dtype=np.float32)
        for packed in (self.pack(w), self.pack(np.ascontiguousarray(w.T), transposed=True)):
            for m in (1, 13):
                x = rng.standard_normal((m, 40), dtype=np.float32)
                want = x.astype(np.float64) @ w.astype(np.float64)
                if not np.allclose(self.matmul(x, packed), want, rtol=1e-5, atol=1e-4):
                    raise RuntimeError("MKL's packed GEMM disagrees with numpy")
        x = rng.standard_normal((13, 40), dtype=np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64)
        plain = self.sgemm(x, w), self.sgemm(x, np.ascontiguousarray(w.T), trans_b=True)
        if not all(np.allclose(got, want, rtol=1e-5, atol=1e-4) for got in plain):
            raise RuntimeError("MKL's sgemm disagrees with numpy")


def numba_mkl(mkl: PackedMkl) -> dict[str, Any]:
    """MKL's routines that compiled kernels call, as numba external functions (pointers passed as
    integers): LLVM resolves them by symbol in ``mkl``'s library, loaded into its symbol table here
    (once per process), so a compiled kernel names no address and numba's cache stays valid. The
    fused decode step calls ``cblas_sgemm_compute`` on the packed weights, the causal tiles
    ``cblas_sgemm`` on one thread each (``MKL_Set_Num_Threads_Local``)."""
    import llvmlite.binding
    from numba import types

    llvmlite.binding.load_library_permanently(str(mkl.path))
    i32, f32, ptr = types.int32, types.float32, types.intp
    return {
        "cblas_sgemm_compute": types.ExternalFunction(
            "cblas_sgemm_compute", types.void(i32, i32, i32, i32, i32, i32, ptr, i32, ptr, i32, f32, ptr, i32)
        ),
        "cblas_sgemm": types.ExternalFunction(
            "cblas_sgemm", types.void(*[i32] * 6, f32, ptr, i32, ptr, i32, f32, ptr, i32)
        ),
        "MKL_Set_Num_Threads_Local": types.ExternalFunction("MKL_Set_Num_Threads_Local", i32(i32)),
    }


@dataclasses.dataclass(frozen=True)
class Gemm:
    """Which GEMM the model's linear layers and lm_head run, and why (one log line)."""

    impl: str  # "packed" | "paddle"
    reason: str
    mkl: PackedMkl | None = dataclasses.field(default=None, repr=False, compare=False)


def bundled_mkl() -> Path:
    """The MKL of Paddle's CPU wheel (the library Paddle's own matmul calls)."""
    from pdserve.engine.cpu.paddle_setup import paddle  # here: importing this module loads no Paddle

    return Path(paddle.__file__).parent / "libs" / "libmklml_intel.so"


def load_packed_mkl(path: Path | None = None) -> PackedMkl:
    path = path or bundled_mkl()
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (a Paddle build without MKL)")
    mkl = PackedMkl(ctypes.CDLL(str(path)), path)  # AttributeError: an MKL without the packed API
    mkl.self_test()
    return mkl


def select_gemm(mode: str, library: Path | None = None) -> Gemm:
    """``auto``: packed weights where Paddle's MKL (or ``library``) has the packed API, else Paddle's
    matmul (never a crash); ``packed``: packed or an error; ``paddle``: Paddle's matmul on plain
    weights."""
    check_mode("gemm", mode, GEMM_MODES)
    if mode == "paddle":
        return Gemm("paddle", "Paddle's matmul forced")
    mkl, why = load_or_fall_back(
        "gemm",
        mode,
        lambda: load_packed_mkl(library),
        (OSError, AttributeError, RuntimeError),
        "MKL's packed GEMM is unavailable",
        "Paddle's matmul",
    )
    if mkl is None:
        return Gemm("paddle", why)
    return Gemm("packed", f"weights packed once for MKL's cblas_sgemm_compute ({mkl.path.name})", mkl)
