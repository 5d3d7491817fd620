"""A whole decode step of the model in one compiled call (docs/design.md "CPU kernels").

On the layer-by-layer path a decode step runs ~10 operations per layer from Python, each crossing
between Paddle and numpy (DLPack) and dispatching a kernel: on SmolLM2-135M's 30 thin layers that
Python took about as long as the GEMMs at batch 1. Here one numba function walks every layer: the
GEMMs call MKL's ``cblas_sgemm_compute`` on the same packed weights (by symbol, through LLVM, the
library loaded into the process once) or, with int8 weights, the int8 product (cpu/int8.py),
and every other step calls the very kernel the layer path calls (cpu/attention.py). Same calls on the same operands in the same order: the logits are
bitwise the layer path's, so batch-invariant mode and every exactness test hold unchanged.

It runs the steps whose every token decodes (the runner gives a batch-invariant step's padding
tokens a decode group too); a step with a prefill chunk takes the layer path.

numba's cache keeps the callees' code inside this function's entry and checks only this file's
stamp: a change to a kernel it calls must come with a change here, or a cached step keeps the old
kernels (as it kept serial builds of the parallel ones before ``attention._renamed``). Last such
change: the int8 product's activation quantization (its peak found on the row's bits, one
function for both products).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from pdserve.engine.config import DECODE_MODES
from pdserve.engine.cpu.compiled_attention import SERIAL_ITEMS, AttentionKernels
from pdserve.engine.cpu.gemm import PackedMkl, numba_mkl
from pdserve.engine.cpu.int8 import BROADCAST_ROWS, Int8Gemm, Int8Matrix, compile_int8, quantize
from pdserve.engine.cpu.int8_tiles import LANES
from pdserve.engine.kernel_choice import check_mode, load_or_fall_back
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)


# The kernels the fused step calls, bound by ``_compile`` before numba compiles it (numba resolves
# globals when it compiles; importing this module needs no numba).
_rms_norm: Any = None
_add_rms_norm: Any = None
_rope_write: Any = None
_decode: Any = None
_swiglu: Any = None
_rms_norm_serial: Any = None  # the same kernels on the calling thread (up to SERIAL_ITEMS rows)
_add_rms_norm_serial: Any = None
_rope_write_serial: Any = None
_decode_serial: Any = None
_swiglu_serial: Any = None
_int8: Any = None
_int8_blocks: Any = None  # the int8 broadcast product (from int8.BROADCAST_ROWS rows on)
_sgemm: Any = None  # cblas_sgemm_compute, an LLVM external symbol
_linear: Any = None  # _any_linear compiled


def _any_linear(
    x: np.ndarray,
    layer: int,
    which: int,
    packed: np.ndarray,
    quantized: tuple[np.ndarray, ...],
    blocks: tuple[np.ndarray, ...],
    scales: tuple[np.ndarray, ...],
    bias: np.ndarray,
    scratch: np.ndarray,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled by numba
    """out = x @ W (+ bias) for linear ``which`` (0 qkv, 1 o, 2 gate_up, 3 down) of ``layer``: the
    int8 product (cpu/int8.py: the broadcast one on the packed blocks from BROADCAST_ROWS rows on,
    as Int8Gemm.matmul picks) where the model holds int8 weights, else MKL's packed GEMM at the
    address ``packed[layer, which]`` (PackedMkl.matmul's very call); the bias added as Paddle adds
    it (one rounding)."""
    m, k = x.shape
    n = out.shape[1]
    q = quantized[which]
    b = blocks[which]
    if q.shape[1] and b.shape[1] and m >= BROADCAST_ROWS:
        _int8_blocks(x, b[layer], scales[which][layer], scratch, out)
    elif q.shape[1]:
        _int8(x, q[layer], scales[which][layer], scratch, out)
    else:
        _sgemm(101, 111, 151, m, n, k, x.ctypes.data, k, packed[layer, which], n, np.float32(0.0),
               out.ctypes.data, n)  # fmt: skip
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
    quantized: tuple[np.ndarray, ...],
    blocks: tuple[np.ndarray, ...],
    scales: tuple[np.ndarray, ...],
    scratch: np.ndarray,
    bias_qkv: np.ndarray,
    bias_o: np.ndarray,
    bias_gate_up: np.ndarray,
    bias_down: np.ndarray,
    lm_head: int,
    lm_quantized: np.ndarray,
    lm_scale: np.ndarray,
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
    final norm last); packed: int64 [L, 4] addresses of the packed qkv, o, gate_up and down weights
    (float32 weights), or quantized/scales: four int8 [L, n, k] and float32 [L, n] stacks (int8
    weights; [L, 0, 0] and [L, 0] otherwise) and blocks the same bytes packed ([L, n / 8, k / 2, 8,
    2], or [L, 0, 0, 8, 2]), scratch the int8 product's; lm_head: the packed
    lm_head's address, or lm_quantized/lm_scale: its int8 form ([0, 0] and [0] otherwise);
    bias_*: [L, n] or [L, 0]; rows: the cache as ``[-1, head_dim]``; dims: int64 (layers, heads,
    kv_heads, head_dim, intermediate).
    """
    layers, H, KVH, D, inter = dims[0], dims[1], dims[2], dims[3], dims[4]
    n, hidden = ids.shape[0], embed.shape[1]
    serial = n <= SERIAL_ITEMS  # AttentionKernels' choice: the layer path's very variants
    x = np.empty((n, hidden), np.float32)
    for t in range(n):
        x[t] = embed[ids[t]]
    h = np.empty((n, hidden), np.float32)
    if serial:
        _rms_norm_serial(x, norms[0], eps, h)
    else:
        _rms_norm(x, norms[0], eps, h)
    qkv = np.empty((n, (H + 2 * KVH) * D), np.float32)
    q, att = np.empty((n, H, D), np.float32), np.empty((n, H, D), np.float32)
    k, v = np.empty((n, KVH, D), np.float32), np.empty((n, KVH, D), np.float32)
    o, mlp = np.empty((n, hidden), np.float32), np.empty((n, hidden), np.float32)
    gate_up, act = np.empty((n, 2 * inter), np.float32), np.empty((n, inter), np.float32)
    for layer in range(layers):
        _linear(h, layer, 0, packed, quantized, blocks, scales, bias_qkv[layer], scratch, qkv)
        if serial:
            _rope_write_serial(qkv, positions, cos, sin, qcos, qsin, rows, write_rows[layer], q, k, v)
            _decode_serial(rows, layers, block_size, KVH, layer, q, tables, lengths, att)
        else:
            _rope_write(qkv, positions, cos, sin, qcos, qsin, rows, write_rows[layer], q, k, v)
            _decode(rows, layers, block_size, KVH, layer, q, tables, lengths, att)
        _linear(att.reshape(n, H * D), layer, 1, packed, quantized, blocks, scales, bias_o[layer], scratch, o)
        x_next = np.empty((n, hidden), np.float32)
        if serial:
            _add_rms_norm_serial(x, o, norms[2 * layer + 1], eps, x_next, h)
        else:
            _add_rms_norm(x, o, norms[2 * layer + 1], eps, x_next, h)
        x = x_next
        _linear(h, layer, 2, packed, quantized, blocks, scales, bias_gate_up[layer], scratch, gate_up)
        if serial:
            _swiglu_serial(gate_up, act)
        else:
            _swiglu(gate_up, act)
        _linear(act, layer, 3, packed, quantized, blocks, scales, bias_down[layer], scratch, mlp)
        x_next = np.empty((n, hidden), np.float32)
        if layer + 1 == layers:
            for t in range(n):
                for j in range(hidden):
                    x_next[t, j] = x[t, j] + mlp[t, j]
        elif serial:
            _add_rms_norm_serial(x, mlp, norms[2 * layer + 2], eps, x_next, h)
        else:
            _add_rms_norm(x, mlp, norms[2 * layer + 2], eps, x_next, h)
        x = x_next
    m = output_rows.shape[0]
    picked = np.empty((m, hidden), np.float32)
    for r in range(m):
        picked[r] = x[output_rows[r]]
    normed = np.empty((m, hidden), np.float32)
    if m <= SERIAL_ITEMS:
        _rms_norm_serial(picked, norms[2 * layers], eps, normed)
    else:
        _rms_norm(picked, norms[2 * layers], eps, normed)
    if lm_quantized.shape[0]:
        _int8(normed, lm_quantized, lm_scale, scratch, logits)
    else:
        vocab = logits.shape[1]
        _sgemm(101, 111, 151, m, vocab, hidden, normed.ctypes.data, hidden, lm_head, vocab, np.float32(0.0),
               logits.ctypes.data, vocab)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FusedWeights:
    """What the fused step reads of one model besides its embedding and the cache: its norms and
    biases stacked, and its linear weights either as the addresses of MKL-packed float32 buffers
    (owned by the Model, alive as long) or as int8 stacks (cpu/int8.py)."""

    norms: np.ndarray  # float32 [2 L + 1, hidden]
    eps: float
    dims: np.ndarray  # int64 (layers, heads, kv_heads, head_dim, intermediate)
    vocab: int
    biases: tuple[np.ndarray, ...]  # qkv, o, gate_up, down: float32 [L, n] or [L, 0]
    packed: np.ndarray  # int64 [L, 4] addresses; zeros with int8 weights
    lm_head: int  # the packed lm_head's address; 0 with int8 weights
    quantized: tuple[np.ndarray, ...]  # qkv, o, gate_up, down: int8 [L, n, k], or [L, 0, 0] each
    blocks: tuple[np.ndarray, ...]  # the same bytes packed: int8 [L, n / 8, k / 2, 8, 2], or [L, 0, 0, 8, 2]
    scales: tuple[np.ndarray, ...]  # float32 [L, n], or [L, 0] each
    lm_quantized: np.ndarray  # int8 [vocab, hidden], or [0, 0]
    lm_scale: np.ndarray  # float32 [vocab], or [0]
    scratch: np.ndarray  # int16: the int8 product's quantized activations (Int8Gemm.scratch)


def no_int8(layers: int) -> dict[str, Any]:
    """FusedWeights' int8 fields for a model of float32 weights."""
    return {
        "quantized": tuple(np.zeros((layers, 0, 0), np.int8) for _ in range(4)),
        "blocks": tuple(np.zeros((layers, 0, 0, LANES, 2), np.int8) for _ in range(4)),
        "scales": tuple(np.zeros((layers, 0), np.float32) for _ in range(4)),
        "lm_quantized": np.zeros((0, 0), np.int8),
        "lm_scale": np.zeros(0, np.float32),
        "scratch": np.zeros(1, np.int16),
    }


def _blocks_of(m: Int8Matrix) -> np.ndarray:
    """The self-test's toy matrices have blocks (their k are even)."""
    if m.blocks is None:
        raise ValueError("an int8 matrix without blocks (its k is odd)")
    return m.blocks


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
        logits = np.empty((output_rows.shape[0], weights.vocab), np.float32)
        self._set_threads(self.threads)
        self._fn(
            ids,
            positions,
            embed,
            weights.norms,
            weights.eps,
            weights.packed,
            weights.quantized,
            weights.blocks,
            weights.scales,
            weights.scratch,
            *weights.biases,
            weights.lm_head,
            weights.lm_quantized,
            weights.lm_scale,
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


def _compile(kernels: AttentionKernels, mkl: PackedMkl, int8: Int8Gemm) -> FusedDecode:
    global _rms_norm, _add_rms_norm, _rope_write, _decode, _swiglu, _int8, _int8_blocks, _sgemm, _linear
    global _compiled
    global _rms_norm_serial, _add_rms_norm_serial, _rope_write_serial, _decode_serial, _swiglu_serial
    import numba

    if _compiled is None:
        t0 = time.monotonic()
        _sgemm = numba_mkl(mkl)["cblas_sgemm_compute"]
        fns = kernels.compiled
        _rms_norm, _add_rms_norm = fns["rms_norm"], fns["add_rms_norm"]
        _rope_write, _decode, _swiglu = fns["rope_write"], fns["decode"], fns["swiglu"]
        _rms_norm_serial, _add_rms_norm_serial = fns["rms_norm_serial"], fns["add_rms_norm_serial"]
        _rope_write_serial, _decode_serial = fns["rope_write_serial"], fns["decode_serial"]
        _swiglu_serial = fns["swiglu_serial"]
        _int8, _int8_blocks = int8.fn, int8.blocks_fn
        _linear = numba.njit(cache=True, nogil=True)(_any_linear)
        _compiled = numba.njit(cache=True, nogil=True)(_decode_model)
        for quantized in (False, True):
            _self_test(FusedDecode(_compiled, kernels.threads), kernels, mkl, int8 if quantized else None)
        log.info("fused decode step compiled in %.1f s", time.monotonic() - t0)
    return FusedDecode(_compiled, kernels.threads)


def _self_test(fused: FusedDecode, kernels: AttentionKernels, mkl: PackedMkl, int8: Int8Gemm | None) -> None:
    """Compile on a toy two-layer model (float32 weights packed, or int8 ones) and check it against
    the same step composed from the same kernels from Python: a fused step that runs but disagrees
    is refused."""
    from pdserve.engine.kv_layout import cache_write_rows

    rng = np.random.default_rng(0)
    L, bs, H, KVH, D, inter, hidden, vocab, n = 2, 4, 4, 2, 8, 12, 16, 11, 3
    names = ("qkv", "o", "gate_up", "down")
    shapes = ((hidden, (H + 2 * KVH) * D), (H * D, hidden), (hidden, 2 * inter), (inter, hidden))
    w = {name: rng.standard_normal(shape, dtype=np.float32) * 0.3 for name, shape in zip(names, shapes)}
    embed = rng.standard_normal((vocab, hidden), dtype=np.float32)
    norms = 1 + 0.1 * rng.standard_normal((2 * L + 1, hidden), dtype=np.float32)
    none = np.zeros((L, 0), np.float32)
    common: dict[str, Any] = {"norms": norms, "eps": 1e-5, "dims": np.array([L, H, KVH, D, inter], np.int64)}
    common |= {"vocab": vocab, "biases": (none,) * 4}
    matmul: dict[str, Any]
    if int8 is None:  # both layers share the weights
        packed = {name: mkl.pack(a) for name, a in w.items()}
        lm_packed = mkl.pack(embed, transposed=True)
        address = [packed[name].buffer.ctypes.data for name in names]
        weights = FusedWeights(
            packed=np.array([address] * L, np.int64), lm_head=lm_packed.buffer.ctypes.data, **common,
            **no_int8(L),
        )  # fmt: skip
        matmul = {name: lambda x, m=packed[name]: mkl.matmul(x, m) for name in names}
        matmul["lm_head"] = lambda x: mkl.matmul(x, lm_packed)
    else:
        q = {name: quantize(a, blocks=True) for name, a in w.items()}
        lm_q = quantize(embed, transposed=True)
        weights = FusedWeights(
            packed=np.zeros((L, 4), np.int64), lm_head=0, **common,
            quantized=tuple(np.stack([q[name].q] * L) for name in names),
            blocks=tuple(np.stack([_blocks_of(q[name])] * L) for name in names),
            scales=tuple(np.stack([q[name].scale] * L) for name in names),
            lm_quantized=lm_q.q, lm_scale=lm_q.scale, scratch=int8.scratch,
        )  # fmt: skip
        matmul = {name: lambda x, m=q[name]: int8.matmul(x, m) for name in names}
        matmul["lm_head"] = lambda x: int8.matmul(x, lm_q)
    angle = np.arange(8)[:, None] * (0.5 ** np.arange(D // 2))[None, :]
    cos = np.cos(np.concatenate([angle, angle], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([angle, angle], 1)).astype(np.float32)
    rope = (cos, sin, cos, sin)
    cache = rng.standard_normal((4 * 2 * L * bs * KVH, D), dtype=np.float32)
    ids, positions = np.array([1, 5, 7], np.int64), np.array([2, 5, 0], np.int64)
    tables = np.array([[1, 0], [2, 3], [3, 0]], np.int64)
    lengths = positions + 1
    slot = tables[np.arange(n), positions // bs] * bs + positions % bs
    write_rows = cache_write_rows(slot, L, KVH, bs)
    out_rows = np.array([2, 0], np.int64)
    want_cache = cache.copy()
    got = fused.run(weights, embed, rope, cache, bs, (ids, positions, write_rows, tables, lengths, out_rows))
    # The same step composed from Python, op by op (what Model.forward does on the layer path).
    x = embed[ids]
    h = kernels.rms_norm(x, norms[0], 1e-5)
    for layer in range(L):
        q_rot, _, _ = kernels.rope_write(
            matmul["qkv"](h), positions, rope, want_cache, write_rows[layer], (H, KVH, D)
        )
        att = kernels.decode(want_cache, (L, bs, KVH), layer, q_rot, tables, lengths).reshape(n, H * D)
        x, h = kernels.add_rms_norm(x, matmul["o"](att), norms[2 * layer + 1], 1e-5)
        mlp = matmul["down"](kernels.swiglu(matmul["gate_up"](h)))
        if layer + 1 < L:
            x, h = kernels.add_rms_norm(x, mlp, norms[2 * layer + 2], 1e-5)
        else:
            x = x + mlp
    want = matmul["lm_head"](kernels.rms_norm(x[out_rows], norms[2 * L], 1e-5))
    if not (np.array_equal(got, want) and np.array_equal(cache, want_cache)):
        kind = "int8" if int8 is not None else "float32"
        raise RuntimeError(
            f"the compiled fused decode step disagrees with the layer path on a toy {kind} model"
        )


def select_decode(
    mode: str, kernels: AttentionKernels | None, mkl: PackedMkl | None, int8: Int8Gemm | None = None
) -> Decode:
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
            raise ConfigError(f"decode_step=fused: {why}")
        return Decode("layers", why)
    fused, why = load_or_fall_back(
        "decode_step",
        mode,
        lambda: _compile(kernels, mkl, int8 or compile_int8(kernels.threads)),
        (Exception,),  # numba's TypingError/LoweringError, a symbol LLVM cannot find, a failed self-test
        "the fused decode step is unavailable",
        "layer-by-layer decode",
    )
    if fused is None:
        return Decode("layers", why)
    gemms = "the int8 product" if int8 is not None else "MKL's packed GEMM"
    return Decode("fused", f"one compiled call per decode step (numba kernels + {gemms})", fused)
