"""The KV transport interface: move a prefill instance's blocks into a decode instance's blocks.

A transport is chosen per prefill/decode pair (``disaggregate_info.protocol``); both sides walk
their block lists in block-table order (see regions.py). ``shm`` is the same-host backend; a
cross-host backend (Mooncake TCP/RDMA) implements the same method. ``connect.open_transport``
picks the backend; this module knows none of them.
"""

from __future__ import annotations

import abc

import numpy as np

from pdserve.cache_transfer.regions import Region, pair_regions


class KVTransport(abc.ABC):
    """Writes local cache bytes into one peer's cache."""

    protocol: str

    @abc.abstractmethod
    def write(self, src: np.ndarray, segments: list[tuple[int, int, int]]) -> int:
        """Copy ``src[s:s+n]`` to the peer at ``d`` for each ``(s, d, n)``; returns bytes moved."""

    def write_blocks(self, src: np.ndarray, src_regions: list[Region], dst_regions: list[Region]) -> int:
        return self.write(src, pair_regions(src_regions, dst_regions))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or mappings to the peer."""
