"""A whole decode step of the model in one compiled call (docs/design.md "CPU kernels").

On the layer-by-layer path a decode step runs ~10 operations per layer from Python, each crossing
between Paddle and numpy (DLPack) and dispatching a kernel: on SmolLM2-135M's 30 thin layers that
Python took about as long as the GEMMs at batch 1. Here one numba function walks every layer: the
GEMMs call MKL's ``cblas_sgemm_compute`` on the same packed weights (by symbol, through LLVM, the
library loaded into the process once), and every other step calls the very kernel the layer path
calls (kernels/attention.py). Same calls on the same operands in the same order: the logits are
bitwise the layer path's, so batch-invariant mode and every exactness test hold unchanged.

It runs the steps whose every token decodes (the runner gives a batch-invariant step's padding
tokens a decode group too); a step with a prefill chunk takes the layer path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from pdserve.engine.kernels.attention import AttentionKernels
from pdserve.engine.kernels.choice import check_mode, load_or_fall_back
from pdserve.engine.kernels.gemm import PackedMatrix, PackedMkl

log = logging.getLogger(__name__)

DECODE_MODES: tuple[str, ...] = ("auto", "fused", "layers")

# The kernels the fused step calls, bound by ``_compile`` before numba compiles it (numba resolves
# globals when it compiles; importing this module needs no numba).
_rms_norm: Any = None
_add_rms_norm: Any = None
_rope_write: Any = None
_decode: Any = None
_swiglu: Any = None
_sgemm: Any = None  # cblas_sgemm_compute, an LLVM external symbol
_gemm: Any = None  # _packed_gemm compiled


def _packed_gemm(x: np.ndarray, packed: int, bias: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """out = x @ B (+ bias) for B packed by MKL at address ``packed``: PackedMkl.matmul's very call,
    then the bias added as Paddle adds it (one rounding)."""
    m, k = x.shape
    n = out.shape[1]
    _sgemm(101, 111, 151, m, n, k, x.ctypes.data, k, packed, n, np.float32(0.0), out.ctypes.data, n)
    if bias.shape[0]:
        for t in range(m):
            for j in range(n):
                out[t, j] = out[t, j] + bias[j]


def _decode_model(
    ids: np.ndarray,
    positions: np.ndarray,
    embed: np.ndarray,
    norms: np.ndarray,
    eps: float,
    packed: np.ndarray,
    bias_qkv: np.ndarray,
    bias_o: np.ndarray,
    bias_gate_up: np.ndarray,
    bias_down: np.ndarray,
    lm_head: int,
    cos: np.ndarray,
    sin: np.ndarray,
    qcos: np.ndarray,
    qsin: np.ndarray,
    rows: np.ndarray,
    block_size: int,
    write_rows: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    output_rows: np.ndarray,
    dims: np.ndarray,
    logits: np.ndarray,
) -> None:  # pragma: no cover - compiled by numba; Model.forward's layer loop is its definition
    """Model.forward for a step of decoding tokens, into ``logits`` [len(output_rows), vocab].

    norms: [2 L + 1, hidden] (layer l's input norm at 2l, its post-attention norm at 2l + 1, the
    final norm last); packed: int64 [L, 4] addresses of the packed qkv, o, gate_up and down weights;
    bias_*: [L, n] or [L, 0]; rows: the cache as ``[-1, head_dim]``; dims: int64 (layers, heads,
    kv_heads, head_dim, intermediate).
    """
    layers, H, KVH, D, inter = dims[0], dims[1], dims[2], dims[3], dims[4]
    n, hidden = ids.shape[0], embed.shape[1]
    no_bias = norms[0][:0]
    x = np.empty((n, hidden), np.float32)
    for t in range(n):
        x[t] = embed[ids[t]]
    h = np.empty((n, hidden), np.float32)
    _rms_norm(x, norms[0], eps, h)
    qkv = np.empty((n, (H + 2 * KVH) * D), np.float32)
    q, att = np.empty((n, H, D), np.float32), np.empty((n, H, D), np.float32)
    k, v = np.empty((n, KVH, D), np.float32), np.empty((n, KVH, D), np.float32)
    o, mlp = np.empty((n, hidden), np.float32), np.empty((n, hidden), np.float32)
    gate_up, act = np.empty((n, 2 * inter), np.float32), np.empty((n, inter), np.float32)
    for layer in range(layers):
        _gemm(h, packed[layer, 0], bias_qkv[layer], qkv)
        _rope_write(qkv, positions, cos, sin, qcos, qsin, rows, write_rows[layer], q, k, v)
        _decode(rows, layers, block_size, KVH, layer, q, tables, lengths, att)
        _gemm(att.reshape(n, H * D), packed[layer, 1], bias_o[layer], o)
        x_next = np.empty((n, hidden), np.float32)
        _add_rms_norm(x, o, norms[2 * layer + 1], eps, x_next, h)
        x = x_next
        _gemm(h, packed[layer, 2], bias_gate_up[layer], gate_up)
        _swiglu(gate_up, act)
        _gemm(act, packed[layer, 3], bias_down[layer], mlp)
        x_next = np.empty((n, hidden), np.float32)
        if layer + 1 < layers:
            _add_rms_norm(x, mlp, norms[2 * layer + 2], eps, x_next, h)
        else:
            for t in range(n):
                for j in range(hidden):
                    x_next[t, j] = x[t, j] + mlp[t, j]
        x = x_next
    m = output_rows.shape[0]
    picked = np.empty((m, hidden), np.float32)
    for r in range(m):
        picked[r] = x[output_rows[r]]
    normed = np.empty((m, hidden), np.float32)
    _rms_norm(picked, norms[2 * layers], eps, normed)
    _gemm(normed, lm_head, no_bias, logits)


@dataclasses.dataclass(frozen=True)
class FusedWeights:
    """What the fused step reads of one model besides its embedding and the cache: its norms and
    biases stacked, and the addresses of its packed weights (owned by the Model, alive as long)."""

    norms: np.ndarray  # float32 [2 L + 1, hidden]
    packed: np.ndarray  # int64 [L, 4]
    biases: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # qkv, o, gate_up, down: [L, n|0]
    lm_head: PackedMatrix
    eps: float
    dims: np.ndarray  # int64 (layers, heads, kv_heads, head_dim, intermediate)


class FusedDecode:
    """The compiled fused step and its numba thread count (set on every call, as AttentionKernels)."""

    def __init__(self, fn: Any, threads: int) -> None:
        import numba

        self._fn = fn
        self._set_threads = numba.set_num_threads
        self.threads = threads

    def run(
        self,
        weights: FusedWeights,
        embed: np.ndarray,
        rope: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        rows: np.ndarray,
        block_size: int,
        step: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """Logits [len(output_rows), vocab] of a decode step over the cache ``rows`` ([-1, head_dim],
        blocks of ``block_size`` tokens): ``step`` is (token ids, positions,
        write rows [L, 2 N KVH], block tables [N, nblk], lengths [N], output rows), all int64."""
        ids, positions, write_rows, tables, lengths, output_rows = step
        logits = np.empty((output_rows.shape[0], weights.lm_head.n), np.float32)
        self._set_threads(self.threads)
        self._fn(
            ids,
            positions,
            embed,
            weights.norms,
            weights.eps,
            weights.packed,
            *weights.biases,
            weights.lm_head.buffer.ctypes.data,
            *rope,
            rows,
            block_size,
            write_rows,
            tables,
            lengths,
            output_rows,
            weights.dims,
            logits,
        )
        return logits


@dataclasses.dataclass(frozen=True)
class Decode:
    """How a decode step runs, and why (one log line)."""

    impl: str  # "fused" | "layers"
    reason: str
    fused: FusedDecode | None = dataclasses.field(default=None, repr=False, compare=False)


_compiled: Any = None  # the compiled fused step, made once per process


def _compile(kernels: AttentionKernels, mkl: PackedMkl) -> FusedDecode:
    global _rms_norm, _add_rms_norm, _rope_write, _decode, _swiglu, _sgemm, _gemm, _compiled
    import llvmlite.binding
    import numba
    from numba import types

    if _compiled is None:
        t0 = time.monotonic()
        llvmlite.binding.load_library_permanently(str(mkl.path))  # cblas_* resolvable by LLVM
        i32, ptr = types.int32, types.intp  # pointers passed as integers (the same register)
        _sgemm = types.ExternalFunction(
            "cblas_sgemm_compute",
            types.void(i32, i32, i32, i32, i32, i32, ptr, i32, ptr, i32, types.float32, ptr, i32),
        )
        fns = kernels.compiled
        _rms_norm, _add_rms_norm = fns["rms_norm"], fns["add_rms_norm"]
        _rope_write, _decode, _swiglu = fns["rope_write"], fns["decode"], fns["swiglu"]
        _gemm = numba.njit(cache=True, nogil=True)(_packed_gemm)
        _compiled = numba.njit(cache=True, nogil=True)(_decode_model)
        fused = FusedDecode(_compiled, kernels.threads)
        _self_test(fused, kernels, mkl)
        log.info("fused decode step compiled in %.1f s", time.monotonic() - t0)
    return FusedDecode(_compiled, kernels.threads)


def _self_test(fused: FusedDecode, kernels: AttentionKernels, mkl: PackedMkl) -> None:
    """Compile on a toy two-layer model and check it against the same step composed from the same
    kernels from Python: a fused step that runs but disagrees is refused."""
    rng = np.random.default_rng(0)
    L, bs, H, KVH, D, inter, hidden, vocab, n = 2, 4, 4, 2, 8, 12, 16, 11, 3
    w = {
        name: rng.standard_normal(shape, dtype=np.float32) * 0.3
        for name, shape in (
            ("qkv", (hidden, (H + 2 * KVH) * D)),
            ("o", (H * D, hidden)),
            ("gate_up", (hidden, 2 * inter)),
            ("down", (inter, hidden)),
        )
    }
    packed = {name: mkl.pack(a) for name, a in w.items()}  # both layers share the weights
    embed = rng.standard_normal((vocab, hidden), dtype=np.float32)
    lm_head = mkl.pack(embed, transposed=True)
    norms = 1 + 0.1 * rng.standard_normal((2 * L + 1, hidden), dtype=np.float32)
    none = np.zeros((L, 0), np.float32)
    biases = (none, none, none, none)
    address = [packed[name].buffer.ctypes.data for name in ("qkv", "o", "gate_up", "down")]
    weights = FusedWeights(
        norms,
        np.array([address] * L, np.int64),
        biases,
        lm_head,
        1e-5,
        np.array([L, H, KVH, D, inter], np.int64),
    )
    angle = np.arange(8)[:, None] * (0.5 ** np.arange(D // 2))[None, :]
    cos = np.cos(np.concatenate([angle, angle], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([angle, angle], 1)).astype(np.float32)
    rope = (cos, sin, cos, sin)
    cache = rng.standard_normal((4 * 2 * L * bs * KVH, D), dtype=np.float32)
    ids, positions = np.array([1, 5, 7], np.int64), np.array([2, 5, 0], np.int64)
    tables = np.array([[1, 0], [2, 3], [3, 0]], np.int64)
    lengths = positions + 1
    slot = tables[np.arange(n), positions // bs] * bs + positions % bs
    # KVCache.write_rows' layout: for each layer, K rows of every (token, kv head), then V rows
    kv, of_layer, head = np.arange(2)[None, :, None, None], np.arange(L)[:, None, None, None], np.arange(KVH)
    block, offset = (slot // bs)[None, None, :, None], (slot % bs)[None, None, :, None]
    write_rows = ((((block * 2 + kv) * L + of_layer) * bs + offset) * KVH + head).reshape(L, -1)
    out_rows = np.array([2, 0], np.int64)
    want_cache = cache.copy()
    got = fused.run(weights, embed, rope, cache, bs, (ids, positions, write_rows, tables, lengths, out_rows))
    # The same step composed from Python, op by op (what Model.forward does on the layer path).
    x = embed[ids]
    h = kernels.rms_norm(x, norms[0], 1e-5)
    for layer in range(L):
        q, _, _ = kernels.rope_write(
            mkl.matmul(h, packed["qkv"]), positions, rope, want_cache, write_rows[layer], (H, KVH, D)
        )
        att = kernels.decode(want_cache, (L, bs, KVH), layer, q, tables, lengths).reshape(n, H * D)
        x, h = kernels.add_rms_norm(x, mkl.matmul(att, packed["o"]), norms[2 * layer + 1], 1e-5)
        mlp = mkl.matmul(kernels.swiglu(mkl.matmul(h, packed["gate_up"])), packed["down"])
        if layer + 1 < L:
            x, h = kernels.add_rms_norm(x, mlp, norms[2 * layer + 2], 1e-5)
        else:
            x = x + mlp
    want = mkl.matmul(kernels.rms_norm(x[out_rows], norms[2 * L], 1e-5), lm_head)
    if not (np.array_equal(got, want) and np.array_equal(cache, want_cache)):
        raise RuntimeError("the compiled fused decode step disagrees with the layer path on a toy model")


def select_decode(mode: str, kernels: AttentionKernels | None, mkl: PackedMkl | None) -> Decode:
    """``auto``: the fused step where the numba kernels and MKL's packed GEMM both run (it calls
    them), else the layer path (never a crash); ``fused``: fused or an error; ``layers``: the
    layer-by-layer path."""
    check_mode("decode_step", mode, DECODE_MODES)
    if mode == "layers":
        return Decode("layers", "layer-by-layer decode forced")
    if kernels is None or mkl is None:
        missing = " and ".join(
            what
            for what, have in (("the numba kernels", kernels), ("MKL's packed GEMM", mkl))
            if have is None
        )
        why = f"the fused decode step calls {missing}, not in use; layer-by-layer decode"
        if mode == "fused":
            from pdserve.errors import ConfigError

            raise ConfigError(f"decode_step=fused: {why}")
        return Decode("layers", why)
    fused, why = load_or_fall_back(
        "decode_step",
        mode,
        lambda: _compile(kernels, mkl),
        (Exception,),  # numba's TypingError/LoweringError, a symbol LLVM cannot find, a failed self-test
        "the fused decode step is unavailable",
        "layer-by-layer decode",
    )
    if fused is None:
        return Decode("layers", why)
    return Decode("fused", "one compiled call per decode step (numba + MKL's packed GEMM)", fused)
