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

from pdserve.engine.choice import check_mode, load_or_fall_back
from pdserve.engine.config import ATTENTION_MODES

# numba.prange once _compile has imported numba: importing this module stays light, and a host
# without numba still imports it.
prange = range

log = logging.getLogger(__name__)


# The kernels' exp: numba-compiled _exp32 once _compile has run (math.exp until then, so the module
# imports without numba). libm's expf is a call LLVM cannot vectorize; _exp32 is plain arithmetic.
_exp: Any = math.exp
_as_float: Any = None

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


def _causal_softmax(scores: np.ndarray, first: int, group: int) -> None:  # pragma: no cover - numba
    """In place: row r of ``scores [R, T]`` belongs to query token ``first + r // group`` (``group``
    query heads share a kv head), which sees keys ``0 .. first + r // group``; those columns become
    their softmax (float32, minus the row max) and the rest 0."""
    R, T = scores.shape
    for r in prange(R):
        last = first + r // group
        m = scores[r, 0]
        for j in range(1, last + 1):
            m = max(m, scores[r, j])
        total = np.float32(0.0)
        for j in range(last + 1):
            e = _exp(scores[r, j] - m)
            scores[r, j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(last + 1):
            scores[r, j] *= inv
        for j in range(last + 1, T):
            scores[r, j] = np.float32(0.0)


@dataclasses.dataclass(frozen=True)
class Attention:
    """Which decode attention the engine runs, and why (one log line)."""

    impl: str  # "kernel" | "reference"
    reason: str
    kernel: Any = dataclasses.field(default=None, repr=False, compare=False)


_compiled: dict[str, Any] | None = None  # numba's compiled functions, made once per process
# At most this many work items (tokens, or decoding sequences) run on the calling thread alone: a
# parallel region's start and join (TBB's, here) cost more than a few rows of a norm, and a decode
# step makes ~6 such calls per layer (SmolLM2 at batch 1: ~4 ms of a ~21 ms step). Below the 8
# rows of every batch-invariant step (model_runner.padded_rows), so that mode stays on one
# variant; the serial and parallel variants compute each row with the same code.
SERIAL_ITEMS = 4


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
    global prange, _exp, _as_float, _compiled
    import numba

    first, t0 = _compiled is None, time.monotonic()
    if _compiled is None:  # the first start on a CPU compiles for about a minute: say so, or it looks hung
        log.info("compiling the attention kernels for this CPU (first start: ~1 min; cached after) ...")
        prange = numba.prange  # the kernels' parallel loops: resolved when numba compiles them
        _as_float = _make_as_float()
        _exp = numba.njit(inline="always", cache=True)(_exp32)
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


class AttentionKernels:
    """The compiled kernels plus their thread count (numba's thread count is per calling thread, so
    it is set on every call: the engine may step in a thread other than the one that built it).

    Arguments must be C-contiguous (float32 arrays, int64 indices): another layout would make numba
    compile a second version in the middle of a step."""

    def __init__(self, fns: dict[str, Any], threads: int) -> None:
        import numba

        self._fns = fns
        self._set_threads = numba.set_num_threads
        # numba.config sets NUMBA_NUM_THREADS through globals(), which its types cannot show
        self.threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
        self.serial_items = SERIAL_ITEMS

    def _fn(self, name: str, items: int) -> Any:
        """Kernel ``name`` for ``items`` work items: its serial variant up to SERIAL_ITEMS."""
        return self._fns[name + "_serial" if items <= self.serial_items else name]

    def decode(
        self,
        rows: np.ndarray,
        shape: tuple[int, int, int],
        layer: int,
        q: np.ndarray,
        tables: np.ndarray,
        lengths: np.ndarray,
    ) -> np.ndarray:
        """Attention ``[B, H, D]`` for ``q [B, H, D]``; ``shape`` is (layers, block_size, kv_heads)."""
        self._set_threads(self.threads)
        out = np.empty(q.shape, np.float32)
        self._fn("decode", q.shape[0])(rows, shape[0], shape[1], shape[2], layer, q, tables, lengths, out)
        return out

    def rope_write(
        self,
        qkv: np.ndarray,
        positions: np.ndarray,
        tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        rows: np.ndarray,
        write_rows: np.ndarray,
        heads: tuple[int, int, int],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q, k, v) as ``[N, H, D]``, ``[N, KVH, D]`` x 2 after RoPE, with k and v written to their
        cache rows; ``tables`` = (cos, sin, qcos, qsin), ``heads`` = (H, KVH, D)."""
        self._set_threads(self.threads)
        n = qkv.shape[0]
        H, KVH, D = heads
        q = np.empty((n, H, D), np.float32)
        k, v = np.empty((n, KVH, D), np.float32), np.empty((n, KVH, D), np.float32)
        self._fn("rope_write", n)(qkv, positions, *tables, rows, write_rows, q, k, v)
        return q, k, v

    def swiglu(self, gate_up: np.ndarray) -> np.ndarray:
        """silu(gate) * up of ``[N, 2I]`` -> ``[N, I]``."""
        self._set_threads(self.threads)
        out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        self._fn("swiglu", gate_up.shape[0])(gate_up, out)
        return out

    def add_rms_norm(
        self, x: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(x + delta, RMSNorm(x + delta) * w) of ``[N, hidden]`` rows."""
        self._set_threads(self.threads)
        x_out, h_out = np.empty_like(x), np.empty_like(x)
        self._fn("add_rms_norm", x.shape[0])(x, delta, w, eps, x_out, h_out)
        return x_out, h_out

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm(x) * w of ``[N, hidden]`` rows."""
        self._set_threads(self.threads)
        out = np.empty_like(x)
        self._fn("rms_norm", x.shape[0])(x, w, eps, out)
        return out

    @property
    def compiled(self) -> dict[str, Any]:
        """The compiled functions by name (the fused decode step calls them)."""
        return self._fns

    def causal_softmax(self, scores: np.ndarray, first: int, group: int) -> None:
        """In place, see ``_causal_softmax``."""
        self._set_threads(self.threads)
        self._fns["causal_softmax"](scores, first, group)

    def self_test(self) -> None:
        """Compile on a toy cache and check against numpy, both variants: a kernel that runs but is
        wrong is refused."""
        try:
            for self.serial_items in (SERIAL_ITEMS, 0):  # the serial variants, then the parallel ones
                self._self_test()
        finally:
            self.serial_items = SERIAL_ITEMS

    def _self_test(self) -> None:
        rng = np.random.default_rng(0)
        layers, bs, kvh, D, H = 2, 4, 2, 8, 4
        cache = rng.standard_normal((3, 2, layers, bs, kvh, D), dtype=np.float32)
        q = rng.standard_normal((2, H, D), dtype=np.float32)
        tables = np.array([[2, 1], [1, 0]], np.int64)
        lengths = np.array([7, 2], np.int64)
        got = self.decode(cache.reshape(-1, D), (layers, bs, kvh), 1, q, tables, lengths)
        for b in range(2):
            k = cache[tables[b], 0, 1].reshape(-1, kvh, D)[: lengths[b]]
            v = cache[tables[b], 1, 1].reshape(-1, kvh, D)[: lengths[b]]
            kk, vv = np.repeat(k, H // kvh, 1), np.repeat(v, H // kvh, 1)
            sc = np.einsum("hd,thd->ht", q[b].astype(np.float64), kk)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            want = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), vv)
            if not np.allclose(got[b], want, atol=1e-4):
                raise RuntimeError("the compiled decode kernel disagrees with numpy on a toy cache")
        # rope_write: positions 0 and 3 of a 2-token step, rows 5.. of the cache
        half, n = D // 2, 2
        qkv = rng.standard_normal((n, (H + 2 * kvh) * D), dtype=np.float32)
        pos = np.array([0, 3], np.int64)
        angle = np.arange(4)[:, None] * (0.5 ** np.arange(half))[None, :]
        cos = np.cos(np.concatenate([angle, angle], 1)).astype(np.float32)
        sin = np.sin(np.concatenate([angle, angle], 1)).astype(np.float32)
        rows = np.zeros((16, D), np.float32)
        write = np.arange(5, 5 + 2 * n * kvh, dtype=np.int64)
        q_got, k_got, v_got = self.rope_write(qkv, pos, (cos, sin, cos, sin), rows, write, (H, kvh, D))
        x = qkv.reshape(n, H + 2 * kvh, D)
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        want = x * cos[pos][:, None] + rot * sin[pos][:, None]
        ok = np.array_equal(q_got, want[:, :H]) and np.array_equal(k_got, want[:, H : H + kvh])
        ok = ok and np.array_equal(v_got, x[:, H + kvh :])
        ok = ok and np.array_equal(rows[5 : 5 + 2 * n * kvh], np.concatenate([k_got, v_got]).reshape(-1, D))
        if not ok:
            raise RuntimeError("the compiled rope_write kernel disagrees with numpy")
        # causal_softmax: 2 query tokens (from token 1 on) x 2 heads against 3 keys
        scores = rng.standard_normal((4, 3), dtype=np.float32)
        want = np.zeros_like(scores)
        for r in range(4):
            e = np.exp(scores[r, : 2 + r // 2] - scores[r, : 2 + r // 2].max())
            want[r, : 2 + r // 2] = e / e.sum()
        self.causal_softmax(scores, 1, 2)
        if not np.allclose(scores, want, atol=1e-6):
            raise RuntimeError("the compiled causal_softmax kernel disagrees with numpy")
        x, delta, w = (rng.standard_normal((3, 8), dtype=np.float32) for _ in range(3))
        x_got, h_got = self.add_rms_norm(x, delta, w[0], 1e-5)
        s = (x + delta).astype(np.float64)
        want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * w[0]
        if not (np.array_equal(x_got, x + delta) and np.allclose(h_got, want, rtol=1e-5, atol=1e-6)):
            raise RuntimeError("the compiled add_rms_norm kernel disagrees with numpy")
        if not np.allclose(
            self.rms_norm(x, w[0], 1e-5),
            x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w[0],
            rtol=1e-5,
            atol=1e-6,
        ):
            raise RuntimeError("the compiled rms_norm kernel disagrees with numpy")
        gate_up = np.linspace(-100, 100, 2 * 3 * 5, dtype=np.float32).reshape(3, 10)
        g, u = gate_up[:, :5].astype(np.float64), gate_up[:, 5:]
        if not np.allclose(self.swiglu(gate_up), g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-6):
            raise RuntimeError("the compiled swiglu kernel disagrees with numpy")


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
