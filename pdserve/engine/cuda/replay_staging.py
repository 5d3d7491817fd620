"""A replayed decode step's inputs in one contiguous host buffer, sent to the device in one copy.

A captured graph reads token ids, positions, K/V slots, lengths and block tables from fixed device
addresses. Filling them one by one from numpy would copy from pageable memory (a staging copy
each, and a stream sync for a blocking one); here every bucket has one int32 layout, the five
fields one after another, each starting on a 128-byte boundary (Triton specialises a pointer
argument on 16-byte alignment: an unaligned field would compile another kernel variant). The step
is written into a host buffer (pinned on CUDA) in its bucket's layout and its used prefix crosses in
one non-blocking copy; a CUDA event recorded after the copy keeps the next step from overwriting the
buffer before the copy has read it. The buckets' layouts share the device buffer (one graph
replays at a time); each graph was captured reading its own bucket's views.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

FIELD_ALIGN = 32  # int32 entries: 128 bytes
FIELDS = ("token_ids", "positions", "slots", "lengths", "tables")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def bucket_layout(rows: int, width: int) -> tuple[dict[str, int], int]:
    """Each field's offset (int32 entries) in the layout of a bucket of ``rows`` rows with tables
    ``width`` blocks wide, and the entries the layout spans."""
    offsets: dict[str, int] = {}
    at = 0
    for name, size in zip(FIELDS, (rows, rows, rows, rows, rows * width)):
        offsets[name] = at
        at += _round_up(size, FIELD_ALIGN)
    return offsets, at


@dataclasses.dataclass(frozen=True)
class StagedInputs:
    """One bucket's views of a buffer: int32 ``[rows]`` fields and ``tables`` ``[rows, width]``."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def of(cls, buffer: torch.Tensor, rows: int, width: int) -> StagedInputs:
        offsets, _ = bucket_layout(rows, width)
        fields = {name: buffer[offsets[name] : offsets[name] + rows] for name in FIELDS[:4]}
        start = offsets["tables"]
        tables = buffer[start : start + rows * width].view(rows, width)
        return cls(tables=tables, **fields)


class ReplayStaging:
    """The host and device buffers of a set of graph buckets (rows) with tables ``width`` wide."""

    def __init__(
        self, buckets: list[int], width: int, device: torch.device, null_block: int, block_size: int
    ) -> None:
        self.width, self.null_block, self.null_slot = width, null_block, null_block * block_size
        size = max(bucket_layout(b, width)[1] for b in buckets)
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self.views = {b: StagedInputs.of(self.device_buffer, b, width) for b in buckets}
        self._host_views = {b: StagedInputs.of(self.host, b, width) for b in buckets}
        self._ends = {b: bucket_layout(b, width)[1] for b in buckets}
        self._copied = torch.cuda.Event() if cuda else None

    def stage(
        self,
        rows: int,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        lengths: np.ndarray,
    ) -> StagedInputs:
        """Write a step of ``n <= rows`` decodes (tables at most ``width`` wide) into bucket
        ``rows``'s layout and copy it to the device; rows ``n..rows-1`` pad it (token 0 at position
        0, length 1, written into and reading the null block) and table entries past a row's own are
        the null block. Returns the bucket's device views."""
        n, used = token_ids.shape[0], tables.shape[1]
        if n > rows or used > self.width:
            raise ValueError(f"a step of {n} x {used} blocks does not fit bucket {rows} x {self.width}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the buffer (it has, unless the GPU lags)
        host = self._host_views[rows]
        ids, pos, slot, length = (
            t.numpy() for t in (host.token_ids, host.positions, host.slots, host.lengths)
        )
        table = host.tables.numpy()
        ids[:n], pos[:n], slot[:n], length[:n] = token_ids, positions, slots, lengths
        ids[n:], pos[n:], slot[n:], length[n:] = 0, 0, self.null_slot, 1
        table[:n, :used] = tables
        table[:n, used:] = self.null_block
        table[n:] = self.null_block
        end = self._ends[rows]
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views[rows]
