"""How the engine calls the compiled attention kernels (``attention.py`` holds their sources and
compiles them): :class:`AttentionKernels` allocates each call's outputs, sets numba's thread count
on the calling thread, runs a kernel's serial variant up to ``SERIAL_ITEMS`` work items and its
parallel one above, and refuses a build that disagrees with numpy on a toy input (``self_test``).
The fused decode step (``fused_decode.py``) calls the same compiled functions and threshold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# At most this many work items (tokens, or decoding sequences) run on the calling thread alone: a
# parallel region's start and join (TBB's, here) cost more than a few rows of a norm, and a decode
# step makes ~6 such calls per layer (SmolLM2 at batch 1: ~4 ms of a ~21 ms step). Below the 8
# rows of every batch-invariant step (model_runner.padded_rows), so that mode stays on one
# variant; the serial and parallel variants compute each row with the same code.
SERIAL_ITEMS = 4


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

    def causal_tiles(
        self, qt: np.ndarray, kt: np.ndarray, vt: np.ndarray, span: tuple[int, int], tile: int
    ) -> np.ndarray:
        """The causal tiles of a prefill chunk at positions ``span = (start, end)`` -> ``[end - start,
        KVH, G, D]`` (see ``attention._causal_tiles``; there once ``bind_causal_tiles`` ran)."""
        self._set_threads(self.threads)
        KVH, _, G, D = qt.shape
        out = np.empty((span[1] - span[0], KVH, G, D), np.float32)
        self._fns["causal_tiles"](qt, kt, vt, out, span[0], tile, self.threads)
        return out

    def tiles_self_test(self) -> None:
        """The causal tiles of a toy chunk (positions 5..40 over 16-token tiles, 4 query heads on 2
        kv heads) against float64 numpy: refused where they disagree."""
        rng = np.random.default_rng(0)
        start, end, tile, H, KVH, D = 5, 40, 16, 4, 2, 8
        q = rng.standard_normal((end - start, H, D), dtype=np.float32)
        kt, vt = np.zeros((48, KVH, D), np.float32), np.zeros((48, KVH, D), np.float32)
        kt[:end], vt[:end] = rng.standard_normal((2, end, KVH, D), dtype=np.float32)
        qt = np.zeros((KVH, 48, H // KVH, D), np.float32)
        qt[:, start:end] = q.reshape(end - start, KVH, H // KVH, D).transpose(1, 0, 2, 3)
        got = self.causal_tiles(qt, kt, vt, (start, end), tile).reshape(end - start, H, D)
        k, v = np.repeat(kt[:end], H // KVH, 1), np.repeat(vt[:end], H // KVH, 1)
        scores = np.einsum("thd,khd->htk", q.astype(np.float64), k)
        scores[:, np.arange(end - start)[:, None] + start < np.arange(end)[None, :]] = -np.inf
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("htk,khd->thd", p / p.sum(-1, keepdims=True), v)
        if not np.allclose(got, want, atol=1e-5):
            raise RuntimeError("the compiled causal tiles disagree with numpy")

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
