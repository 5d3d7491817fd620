"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, static input buffers.

A decode step launches some ten kernels a layer; at small batches launching them costs more than
running them. A captured graph replays the whole step as one launch. Each bucket's graph reads its
inputs (token ids, positions, slots, lengths, block tables as wide as the longest context) from its
views of one static device buffer, which a step fills with one non-blocking copy from a contiguous
(pinned) host buffer before the replay (replay_staging.py); rows past the step's batch pad the
bucket with a token of length 1 in the null block (its K/V lands there, its logits are dropped).
Graphs are captured largest first into one memory pool, so the smaller ones reuse the largest's
memory. Prefill stays eager (its shapes vary with every chunk and its kernels are large). Uncaptured
(on torch's CPU device, in tests) a bucket runs the same padded step eagerly, so the staging is
checked where no GPU is.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pdserve.engine.block_manager import NULL_BLOCK
from pdserve.engine.cuda.replay_staging import ReplayStaging
from pdserve.engine.cuda.torch_model import DeviceGroup, DeviceStep, TorchModel

log = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (which is last)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` decodes, or None when ``n`` is above them all."""
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    """The captured decode graphs of one model and cache, and the buffers they read."""

    def __init__(
        self, model: TorchModel, cache: torch.Tensor, max_num_seqs: int, max_blocks_per_seq: int
    ) -> None:
        self.model, self.cache = model, cache
        self.buckets = graph_buckets(max_num_seqs)
        self.block_size = cache.shape[3]
        if cache.shape[0] * self.block_size >= 2**31:
            raise ValueError("the staged slots are int32: the cache has too many blocks for them")
        self.staging = ReplayStaging(
            self.buckets, max_blocks_per_seq, cache.device, NULL_BLOCK, self.block_size
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the first graph's memory pool handle, shared by the others

    def _step(self, b: int) -> DeviceStep:
        v = self.staging.views[b]
        group = DeviceGroup(0, b, True, v.tables, v.lengths, 0)
        return DeviceStep(v.token_ids, v.positions, v.slots, [group], None)

    def _stage_padding(self, b: int) -> None:
        """Bucket ``b``'s buffers all padding rows: warm-up and capture write only the null block."""
        none = np.zeros(0, np.int64)
        self.staging.stage(b, none, none, none, np.zeros((0, 1), np.int64), none)

    def capture(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                self._stage_padding(b)
                step = self._step(b)
                self.model.forward(self.cache, step)  # warm-up: kernels compiled, autotuned, loaded
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.model.forward(self.cache, step)
                assert out is not None
                self.pool = graph.pool()
                self.graphs[b], self.outputs[b] = graph, out
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        torch.cuda.synchronize(self.cache.device)
        log.info(
            "captured %d decode CUDA graphs (batch %s) in %.1f s",
            len(self.graphs),
            ", ".join(map(str, self.buckets)),
            time.perf_counter() - t0,
        )

    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        lengths: np.ndarray,
    ) -> torch.Tensor | None:
        """Replay the bucket for this decode step; its logits rows (a view of the graph's output,
        valid until the next replay), or None when the step is larger than every bucket."""
        n = token_ids.shape[0]
        b = bucket_for(n, self.buckets)
        if b is None or tables.shape[1] > self.staging.width:
            return None
        self.staging.stage(b, token_ids, positions, slots, tables, lengths)
        graph = self.graphs.get(b)
        if graph is None:  # not captured (torch's CPU device, in tests): the same step, eagerly
            out = self.model.forward(self.cache, self._step(b))
            assert out is not None
            return out[:n]
        graph.replay()
        return self.outputs[b][:n]
