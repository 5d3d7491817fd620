"""The paged KV cache: ONE preallocated block-major tensor per engine.

Layout ``[num_blocks, 2, layers, block_size, kv_heads, head_dim]``: one block (all layers, K and V)
is one contiguous byte range, so a transfer is one descriptor per block and one memory
registration covers the whole cache. Block 0 is a permanent all-zero "null" block used to pad
gather indices; it is never handed out.
"""

from __future__ import annotations

import ctypes
import logging
import uuid

import numpy as np

from pdserve.cache_transfer import shm as shm_transport
from pdserve.cache_transfer.regions import Region, block_regions
from pdserve.engine.cpu.paddle_setup import paddle
from pdserve.engine.kv_layout import block_bytes, cache_write_rows
from pdserve.engine.memory import page_zeros
from pdserve.engine.models.model_config import ModelConfig

log = logging.getLogger(__name__)


class KVCache:
    """Owns the cache tensor and the index math that maps (block, K/V, layer, slot, head) to rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        shared: bool = False,
        shm_name: str | None = None,
    ) -> None:
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        L, kvh, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        shape = [num_blocks, 2, L, block_size, kvh, D]
        self.block_bytes = block_bytes(cfg, block_size)
        self.nbytes = num_blocks * self.block_bytes
        self.shm = None
        if shared:
            name = shm_name or f"pdserve-kv-{uuid.uuid4().hex[:12]}"
            self.shm_name: str | None = name
            # a named segment belongs to one instance id: a restart after a crash takes it back
            self.shm = shm_transport.create_segment(name, self.nbytes, reclaim=shm_name is not None)
            array = np.ndarray(shape, dtype=np.float32, buffer=self.shm.buf)
            self.tensor = paddle.utils.dlpack.from_dlpack(array)  # zero-copy view of the segment
            self._array = array
        else:
            self.shm_name = None
            # zero pages of its own mapping: resident as blocks are written, like a fresh shm segment
            self._array = page_zeros(tuple(shape))
            self.tensor = paddle.utils.dlpack.from_dlpack(self._array)
        # Views sharing storage with self.tensor.
        self.rows = self.tensor.reshape([-1, D])  # one row = one head_dim vector (scatter target)
        self.chunks = self.tensor.reshape([-1, block_size, kvh, D])  # one chunk = (block, kv, layer)
        log.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB%s",
            num_blocks,
            block_size,
            self.nbytes / 2**20,
            f" in shm {self.shm_name}" if shared else "",
        )

    # ---- index math (numpy, once per step) ------------------------------------------------
    def write_rows(self, slots: np.ndarray) -> np.ndarray:
        """Rows of ``self.rows`` for K then V of each token and kv head: int64 ``[L, 2*N*kvh]``."""
        return cache_write_rows(slots, self.cfg.num_layers, self.cfg.num_kv_heads, self.block_size)

    def gather_chunks(self, block_table: np.ndarray) -> np.ndarray:
        """Chunk ids to gather K then V blocks of each sequence: int64 ``[L, 2*B*nblk]``.

        ``block_table`` is ``[B, nblk]``; the gathered tensor reshapes to ``[2, B, nblk*bs, kvh*D]``.
        """
        L = self.cfg.num_layers
        kv = np.arange(2)[None, :, None, None]
        layer = np.arange(L)[:, None, None, None]
        ids = (block_table[None, None] * 2 + kv) * L + layer
        return ids.reshape(L, -1).astype(np.int64, copy=False)

    # ---- bytes ------------------------------------------------------------------------------
    def regions(self, block_ids: list[int]) -> list[Region]:
        return block_regions(block_ids, self.block_bytes)

    def raw_view(self) -> np.ndarray:
        """Zero-copy uint8 view of the whole cache."""
        buf = (ctypes.c_uint8 * self.nbytes).from_address(self.tensor.data_ptr())
        return np.ctypeslib.as_array(buf)

    def kv_view(self) -> np.ndarray:
        """Zero-copy float32 view ``[num_blocks, 2, layers, block_size, kv_heads, head_dim]``: what the
        in-place decode kernel reads (taken per step, so it always follows the tensor's storage)."""
        cfg = self.cfg
        shape = (self.num_blocks, 2, cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        return self.raw_view().view(np.float32).reshape(shape)

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The blocks' bytes concatenated in block-table order."""
        raw = self.raw_view()
        return b"".join(raw[off : off + n].tobytes() for off, n in self.regions(block_ids))

    def write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None:
        """Inverse of read_blocks on (possibly different) local block ids."""
        src = np.frombuffer(data, dtype=np.uint8)
        expected = len(block_ids) * self.block_bytes
        if src.size != expected:
            raise ValueError(
                f"KV payload has {src.size} bytes, expected {expected} for {len(block_ids)} blocks"
            )
        raw, pos = self.raw_view(), 0
        for off, n in self.regions(block_ids):
            raw[off : off + n] = src[pos : pos + n]
            pos += n

    def close(self) -> None:
        if self.shm is not None:
            del self.rows, self.chunks, self.tensor, self._array
            self.shm.close()  # the owner's close removes the segment
            self.shm = None
