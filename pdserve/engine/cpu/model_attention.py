"""The Paddle model's attention maths, as ``Model`` methods (it inherits :class:`ModelAttention`):
causal tiles of a prefill chunk at absolute positions over the cache (the kernel path: MKL's sgemm
per tile, numba's causal softmax; a row's bits depend only on its position, never on the
chunking), and the reference path's dense causal attention of a first chunk and block-diagonal
attention through gathered cache chunks (pure Paddle). Apart from ``paddle_model.py`` because it is
the one part of the forward whose shapes and exactness argument stand alone (docs/design.md, "CPU
kernels").
"""

from __future__ import annotations

import numpy as np

from pdserve.engine.cpu.compiled_attention import AttentionKernels
from pdserve.engine.cpu.paddle_setup import functional as F
from pdserve.engine.cpu.paddle_setup import paddle
from pdserve.engine.models.model_config import ModelConfig

# query tokens per causal tile: 64 does 10 % fewer multiply-adds than 128 on a 512-token chunk (a
# tile's masked part is smaller); measured per layer (SmolLM2, one compiled call, 2 threads) 128: 3.5
# ms, 64: 2.7, 32: 2.6 (more, smaller GEMM calls)
CAUSAL_TILE = 64


class ModelAttention:
    """``Model``'s attention methods; the attributes are the model's (set by its ``__init__``)."""

    cfg: ModelConfig
    kernels: AttentionKernels | None  # None: every attention op in Paddle (the reference path)
    compiled_tiles: bool  # the tiles in one compiled call (MKL's sgemm from numba); else Paddle's matmul
    eye: paddle.Tensor  # block-diagonal q selector

    def tiled_causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """A whole sequence of n tokens from position 0, its K/V at hand: q [n,H,D] (pre-scaled),
        k/v [n,KVH,D] -> [n, H*D]; the same tiles (and bits) as ``prefill_attention``."""
        n = k.shape[0]
        width = -(-n // CAUSAL_TILE) * CAUSAL_TILE
        kt, vt = _padded(k, width), _padded(v, width)
        return self.causal_tiles(q, kt, vt, 0)

    def prefill_attention(
        self, q: np.ndarray, kv: np.ndarray, layer: int, table: np.ndarray, end: int
    ) -> np.ndarray:
        """A prefill chunk, positions ``[end - n, end)``, with the kernels: q [n,H,D] (pre-scaled),
        its K/V and every earlier position's read from ``kv`` (the cache as ``[blocks, 2, L, bs,
        KVH, D]``, this chunk's rows already written) through the block ``table`` -> [n, H*D]."""
        bs, KVH, D = kv.shape[3:]
        blocks = table[: -(-end // bs)]
        width = max(-(-end // CAUSAL_TILE) * CAUSAL_TILE, len(blocks) * bs)
        kt, vt = np.empty((2, width, KVH, D), np.float32)
        for which, into in ((0, kt), (1, vt)):  # the padding zeroed
            # indexed on the whole cache: np.take on the strided view kv[:, which, layer] first
            # copied that view whole, every block of the pool (2.7 ms a call for 2000 blocks, 0.03 here)
            into[: len(blocks) * bs].reshape(len(blocks), bs, KVH, D)[...] = kv[blocks, which, layer]
            into[end:] = 0.0
        return self.causal_tiles(q, kt, vt, end - q.shape[0])

    def causal_tiles(self, q: np.ndarray, kt: np.ndarray, vt: np.ndarray, start: int) -> np.ndarray:
        """Causal attention of queries q [n,H,D] (pre-scaled) at positions ``[start, start + n)``
        against kt/vt [W, KVH, D]: K/V of positions 0.. (zero past the chunk's end, and W at least
        the end rounded up to a multiple of ``CAUSAL_TILE``) -> [n, H*D].

        Tiles sit at absolute positions: tile i is queries ``[i T, (i+1) T)`` (T = ``CAUSAL_TILE``)
        against keys ``[0, (i+1) T)``, always those shapes — the tile's rows outside the chunk are
        zero queries whose results are dropped, keys past the chunk's end are zero — so a row's bits
        depend only on its position and the K/V of positions up to it, never on where the chunk
        starts or ends (MKL may round a GEMM's rows differently in other shapes, see padded_rows in
        model_runner.py; columns past a row's position get probability exactly 0, adding nothing).
        With MKL at hand, one compiled call runs every (kv head, tile) task, each on one thread
        with MKL's sgemm called from numba (``_causal_tiles``); else, per task, Paddle's matmul and
        the causal softmax in numba.
        """
        assert self.kernels is not None  # called on the kernel path only
        T = CAUSAL_TILE
        n, H, D = q.shape
        KVH = kt.shape[1]
        G = H // KVH
        end = start + n
        first, last = start // T, (end - 1) // T  # the tiles this chunk touches
        base = first * T
        qt = np.empty((KVH, (last + 1) * T - base, G, D), np.float32)
        qt[:, start - base : end - base] = q.reshape(n, KVH, G, D).transpose(1, 0, 2, 3)
        qt[:, : start - base], qt[:, end - base :] = 0.0, 0.0  # the tiles' rows outside the chunk
        if self.compiled_tiles:
            return self.kernels.causal_tiles(qt, kt, vt, (start, end), T).reshape(n, H * D)
        out = np.empty((n, KVH, G, D), np.float32)
        for h in range(KVH):
            for i in range(first, last + 1):
                t0, t1 = i * T, (i + 1) * T
                k, v = (paddle.from_dlpack(np.ascontiguousarray(x[:t1, h])) for x in (kt, vt))
                s = paddle.matmul(
                    paddle.from_dlpack(qt[h, t0 - base : t1 - base].reshape(-1, D)), k, transpose_y=True
                )
                scores = np.from_dlpack(s)
                self.kernels.causal_softmax(scores, t0, G)
                o = np.from_dlpack(paddle.matmul(paddle.from_dlpack(scores), v)).reshape(T, G, D)
                a, b = max(t0, start), min(t1, end)
                out[a - start : b - start, h] = o[a - t0 : b - t0]
        return out.reshape(n, H * D)

    def dense_causal_attention(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor
    ) -> paddle.Tensor:
        """A sequence's first chunk: attend to its own new tokens. q [n,H,D] (pre-scaled), k/v [n,KVH,D]."""
        n = q.shape[0]
        KVH, D = self.cfg.num_kv_heads, self.cfg.head_dim
        G = self.cfg.num_heads // KVH
        qt = q.reshape([n, KVH, G, D]).transpose([1, 2, 0, 3]).reshape([KVH, G * n, D])
        kt, vt = k.transpose([1, 0, 2]), v.transpose([1, 0, 2])
        s = paddle.matmul(qt, kt, transpose_y=True).reshape([KVH, G, n, n]) + mask
        p = F.softmax(s, axis=-1).reshape([KVH, G * n, n])
        return paddle.matmul(p, vt).reshape([KVH, G, n, D]).transpose([2, 0, 1, 3]).reshape([n, KVH * G * D])

    def paged_attention(
        self, q: paddle.Tensor, kv: paddle.Tensor, mask: paddle.Tensor, num_seqs: int, is_decode: bool
    ) -> paddle.Tensor:
        """Attend through gathered cache chunks without transposing K/V.

        q [N,H,D] pre-scaled; kv [2*B*nblk, bs, KVH, D] as gathered. Decode: N == B, one query per
        sequence. Prefill chunk: B == 1, N queries of one sequence. q is spread block-diagonally
        over the KVH*D axis so each head only sees its own kv head.
        """
        n = q.shape[0]
        H, KVH, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        G = H // KVH
        kv = kv.reshape([2, num_seqs, -1, KVH * D])
        kb, vb = kv[0], kv[1]  # [B, T, KVH*D]
        qbd = (q.reshape([n, KVH, G, 1, D]) * self.eye).reshape([n, H, KVH * D])
        if not is_decode:
            kb, vb = kb[0], vb[0]  # [T, KVH*D]: one sequence, many queries
        s = paddle.matmul(qbd, kb, transpose_y=True) + mask  # [N, H, T]
        p = F.softmax(s, axis=-1)
        o = paddle.matmul(p, vb).reshape([n, KVH, G, KVH, D])
        return (o * self.eye).sum(3).reshape([n, H * D])


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` ([n, ...]) followed by zero rows up to ``rows`` rows (zeroing only the padding)."""
    out = np.empty((rows, *x.shape[1:]), np.float32)
    out[: len(x)], out[len(x) :] = x, 0.0
    return out
