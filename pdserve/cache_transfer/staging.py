"""Host staging for a transport that moves host memory (Mooncake) over a cache in GPU memory.

A GPU instance that offers such a transport keeps a host mirror of its cache: an anonymous mapping
of the cache's size with the same byte layout, resident only where blocks pass through it (the
kernel's zero pages until written, and handed back with ``MADV_DONTNEED`` once a hand-off is done).
The transport registers the mirror instead of the cache. A prefill copies its blocks device → mirror
before the write (:meth:`HostStaging.out`); the bytes land in the decode instance's mirror at the
blocks' own offsets, and the decode copies them mirror → device when ``prefilled`` arrives
(:meth:`HostStaging.into_device`), before the request continues there. The two copies use torch,
imported only here; the mirror's layout equals the cache's, so block regions need no translation.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import numpy as np

from pdserve.cache_transfer.regions import Region

_PAGE = mmap.PAGESIZE


class HostStaging:
    """A host mirror of one device cache (``device_view``: a flat uint8 torch tensor)."""

    def __init__(self, device_view: Any) -> None:
        import torch

        self.device_view = device_view
        self.nbytes = int(device_view.numel())
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mirror = np.frombuffer(self._map, np.uint8, self.nbytes)  # what the transport registers
        self._host = torch.from_numpy(self.mirror)

    def out(self, ranges: list[Region]) -> None:
        """Copy these byte ranges of the device cache into the mirror (before they are sent)."""
        for start, n in ranges:
            self._host[start : start + n].copy_(self.device_view[start : start + n])
        self._sync()

    def into_device(self, ranges: list[Region]) -> None:
        """Copy these byte ranges of the mirror into the device cache (after they were received),
        then give their pages back."""
        for start, n in ranges:
            self.device_view[start : start + n].copy_(self._host[start : start + n])
        self._sync()
        self.release(ranges)

    def release(self, ranges: list[Region]) -> None:
        """Drop the mirror's pages that lie wholly inside these ranges (zero again, not resident);
        a page shared with a neighbouring block is kept (another hand-off may be using it)."""
        for start, n in ranges:
            first = -(-start // _PAGE) * _PAGE
            end = (start + n) // _PAGE * _PAGE
            if end > first:
                self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def _sync(self) -> None:
        if self.device_view.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device_view.device)

    def close(self) -> None:
        """Unmap the mirror (after the transport unregistered it); a view still held elsewhere keeps
        the mapping until it goes."""
        del self._host, self.mirror
        with contextlib.suppress(BufferError):
            self._map.close()
