"""The block-major KV layout's arithmetic, shared by every platform's cache (no tensor library).

A cache is ``[num_blocks, 2, layers, block_size, kv_heads, head_dim]``: one block (all layers, K and
V) is one contiguous byte range, so a transfer is one descriptor per block whatever the device.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pdserve.engine.models.model_config import ModelConfig


def block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int = 4) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def cache_write_rows(slots: np.ndarray, layers: int, kv_heads: int, block_size: int) -> np.ndarray:
    """Rows (of the block-major cache seen as ``[-1, head_dim]``) for K then V of each token in
    ``slots`` and each kv head, per layer: int64 ``[layers, 2 * N * kv_heads]``."""
    b, o = slots // block_size, slots % block_size
    kv = np.arange(2)[None, :, None, None]
    layer = np.arange(layers)[:, None, None, None]
    head = np.arange(kv_heads)[None, None, None, :]
    rows = (
        ((b[None, None, :, None] * 2 + kv) * layers + layer) * block_size + o[None, None, :, None]
    ) * kv_heads
    return (rows + head).reshape(layers, -1).astype(np.int64, copy=False)


class RunnerCache(Protocol):
    """What ModelRunner needs of a cache: its block size and the step's write and gather indices."""

    block_size: int

    def write_rows(self, slots: np.ndarray) -> np.ndarray: ...

    def gather_chunks(self, block_table: np.ndarray) -> np.ndarray: ...
