"""Decode attention that reads K/V in place through the block tables (docs/design.md "CPU kernels").

The reference path (``Model.paged_attention``) first gathers every sequence's whole context out of
the cache with ``index_select``, once per layer per step; at batch 32 on the tiny model that copy
was ~63 % of a decode step. This kernel walks each sequence's block table instead and touches only
the rows of its own tokens, so nothing is copied and nothing past a sequence's length is read.

It is compiled by numba for the CPU at hand: LLVM picks AVX2 or AVX-512 from the host's features
when the kernel is first compiled, which is the run-time CPU check (``cache=True`` keys its cache
files per CPU, so another machine recompiles rather than loads foreign code). One work item is one
sequence (all its heads), computed start to end by one thread over exactly that sequence's length:
a sequence's bits never depend on its neighbours, the batch size or the thread count, which keeps
batch-invariant mode bitwise. The softmax subtracts the row max and runs in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from pdserve.errors import ConfigError

# numba.prange once _compile has imported numba: importing this module (settings does, for
# ATTENTION_MODES) stays light, and a host without numba still imports it.
prange = range

log = logging.getLogger(__name__)

ATTENTION_MODES: tuple[str, ...] = ("auto", "kernel", "reference")

# reassoc + contract let LLVM vectorize the dot products over head_dim (a fixed order for a given
# head_dim, so still deterministic); no nnan/ninf: nothing may assume finite inputs away.
_FASTMATH = {"reassoc", "contract"}


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
                e = np.float32(math.exp(s[g, t] - m))
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


@dataclasses.dataclass(frozen=True)
class Attention:
    """Which decode attention the engine runs, and why (one log line)."""

    impl: str  # "kernel" | "reference"
    reason: str
    kernel: Any = dataclasses.field(default=None, repr=False, compare=False)


_dispatcher: Any = None  # numba's compiled function, made once per process


def _compile(threads: int) -> PagedDecodeKernel:
    global prange, _dispatcher
    import numba

    if _dispatcher is None:
        prange = numba.prange  # the kernel's parallel loop: resolved when numba compiles it
        _dispatcher = numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)(_decode_attention)
    kernel = PagedDecodeKernel(_dispatcher, threads)
    kernel.self_test()  # compiles now (or loads the per-CPU cache), not in the first request
    return kernel


class PagedDecodeKernel:
    """The compiled kernel plus its thread count (numba's thread count is per calling thread, so it
    is set on every call: the engine may step in a thread other than the one that built it)."""

    def __init__(self, fn: Any, threads: int) -> None:
        import numba

        self._fn = fn
        self._set_threads = numba.set_num_threads
        self.threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))

    def __call__(
        self,
        rows: np.ndarray,
        shape: tuple[int, int, int],
        layer: int,
        q: np.ndarray,
        tables: np.ndarray,
        lengths: np.ndarray,
    ) -> np.ndarray:
        """Attention ``[B, H, D]`` for ``q [B, H, D]``; ``shape`` is (layers, block_size, kv_heads).

        Arguments must be C-contiguous (float32 rows and q, int64 tables and lengths): another
        layout would make numba compile a second version in the middle of a step."""
        self._set_threads(self.threads)
        out = np.empty(q.shape, np.float32)
        self._fn(rows, shape[0], shape[1], shape[2], layer, q, tables, lengths, out)
        return out

    def self_test(self) -> None:
        """Compile on a toy cache and check against numpy: a kernel that runs but is wrong is refused."""
        rng = np.random.default_rng(0)
        layers, bs, kvh, D, H = 2, 4, 2, 8, 4
        cache = rng.standard_normal((3, 2, layers, bs, kvh, D), dtype=np.float32)
        q = rng.standard_normal((2, H, D), dtype=np.float32)
        tables = np.array([[2, 1], [1, 0]], np.int64)
        lengths = np.array([7, 2], np.int64)
        got = self(cache.reshape(-1, D), (layers, bs, kvh), 1, q, tables, lengths)
        for b in range(2):
            k = cache[tables[b], 0, 1].reshape(-1, kvh, D)[: lengths[b]]
            v = cache[tables[b], 1, 1].reshape(-1, kvh, D)[: lengths[b]]
            kk, vv = np.repeat(k, H // kvh, 1), np.repeat(v, H // kvh, 1)
            sc = np.einsum("hd,thd->ht", q[b].astype(np.float64), kk)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            want = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), vv)
            if not np.allclose(got[b], want, atol=1e-4):
                raise RuntimeError("the compiled kernel disagrees with numpy on a toy cache")


def select_attention(mode: str, threads: int) -> Attention:
    """``auto``: the kernel when numba imports and compiles, else the reference (never a crash);
    ``kernel``: the kernel or an error; ``reference``: the pure-Paddle gather path."""
    if mode not in ATTENTION_MODES:
        raise ConfigError(
            f"attention (--attention, PDSERVE_ATTENTION) must be one of {', '.join(ATTENTION_MODES)}, "
            f"got {mode!r}"
        )
    if mode == "reference":
        return Attention("reference", "reference path forced")
    try:
        kernel = _compile(threads)
    except Exception as e:  # ImportError, numba's TypingError/LoweringError, a failed self-test
        if mode == "kernel":
            raise ConfigError(f"attention=kernel: the numba decode kernel is unavailable: {e}") from e
        why = f"numba decode kernel unavailable ({type(e).__name__}: {e}); reference attention"
        log.warning("%s", why)
        return Attention("reference", why)
    import numba

    return Attention("kernel", f"numba {numba.__version__}, {kernel.threads} threads", kernel)
