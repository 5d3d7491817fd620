"""The torch platform's paged KV cache: one block-major tensor on the engine's device.

The layout is the CPU engine's (kv_layout.py), in the platform's dtype: one block, all layers, K and
V, is one contiguous byte range, so a hand-off moves whole blocks with one gather/scatter whatever
the device. On torch's CPU device a decode instance's cache lies in its shared-memory segment, as
the CPU engine's does, so the same-host ``shm`` transport writes into it; on a GPU peers reach it
through CUDA IPC (cache_transfer/cuda_ipc.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np
import torch

from pdserve.cache_transfer import shm as shm_transport
from pdserve.cache_transfer.regions import Region, block_regions
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.models.model_config import ModelConfig

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TorchKVCache:
    """Owns the cache tensor ``[num_blocks, 2, layers, block_size, kv_heads, head_dim]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: str,
        shared: bool = False,
        shm_name: str | None = None,
    ) -> None:
        self.cfg, self.num_blocks, self.block_size, self.device = cfg, num_blocks, block_size, device
        self.dtype = dtype
        shape = (num_blocks, 2, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.block_bytes = block_bytes(cfg, block_size, TORCH_DTYPES[dtype].itemsize)
        self.nbytes = num_blocks * self.block_bytes
        self.shm = None
        self.shm_name: str | None = None
        if shared and device.type == "cpu":
            self.shm_name = shm_name or f"pdserve-kv-{uuid.uuid4().hex[:12]}"
            # a named segment belongs to one instance id: a restart after a crash takes it back
            self.shm = shm_transport.create_segment(self.shm_name, self.nbytes, reclaim=shm_name is not None)
            flat = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=self.nbytes)
            self.tensor = flat.view(TORCH_DTYPES[dtype]).view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=device)
        log.info(
            "KV cache: %d blocks x %d tokens, %s on %s, %.1f MiB%s",
            num_blocks,
            block_size,
            dtype,
            device,
            self.nbytes / 2**20,
            f" in shm {self.shm_name}" if self.shm is not None else "",
        )

    # ---- index math (what ModelRunner asks of a cache) ------------------------------------------
    def write_rows(self, slots: np.ndarray) -> np.ndarray:
        """The model scatters each token's K/V by its slot (block * block_size + offset): the slots."""
        return slots

    def gather_chunks(self, block_table: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the torch platform reads the cache through block tables (paged_kernel)")

    # ---- bytes ------------------------------------------------------------------------------------
    def regions(self, block_ids: list[int]) -> list[Region]:
        return block_regions(block_ids, self.block_bytes)

    def flat(self) -> torch.Tensor:
        """The whole cache as a flat uint8 tensor on its device (zero-copy)."""
        return self.tensor.view(-1).view(torch.uint8)

    def raw_view(self) -> Any:
        """Zero-copy bytes of the whole cache: a numpy uint8 array on the CPU, a flat uint8 CUDA tensor
        on a GPU (what the KV transports read and write)."""
        flat = self.flat()
        return flat.numpy() if self.device.type == "cpu" else flat

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The blocks' bytes concatenated in block-table order (one device-to-host copy)."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        rows = self.flat().view(self.num_blocks, self.block_bytes).index_select(0, index)
        return rows.cpu().numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None:
        """Inverse of read_blocks on (possibly different) local block ids."""
        expected = len(block_ids) * self.block_bytes
        if len(data) != expected:
            raise ValueError(
                f"KV payload has {len(data)} bytes, expected {expected} for {len(block_ids)} blocks"
            )
        if not block_ids:
            return
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(block_ids), self.block_bytes)
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        self.flat().view(self.num_blocks, self.block_bytes).index_copy_(0, index, src.to(self.device))

    def close(self) -> None:
        if self.shm is not None:
            del self.tensor
            self.shm.close()  # the owner's close removes the segment
            self.shm = None
