"""Host staging for a transport that moves host memory (Mooncake) over a cache in GPU memory.

A GPU instance that offers such a transport holds a bounded buffer of host memory, pinned where a
GPU is present (page-locked: fast device copies, and what an RDMA NIC may keep registered), which
the transport registers once at start and never hands back to the kernel: registered memory that
is released (``MADV_DONTNEED``) gets new pages on its next touch while the NIC still reaches the
old ones, so an RDMA write would land where nobody reads it. It is used two ways:

* a decode instance's is its **landing pool**: each reservation that a peer writes into over this
  transport takes an extent of it (:meth:`HostStaging.reserve`, block-sized pieces, first fit), the
  peer writes the blocks there one after another, and ``land`` copies them into the device blocks
  when ``prefilled`` arrives (:meth:`HostStaging.into_device`); the extent is released with its
  lease, so it is never reused while a write into it can still land. A full pool refuses the
  reservation for now (the prefill asks again), as a full cache does.
* a prefill instance's is its **bounce buffer**: a write copies its blocks device -> buffer (in
  pieces of at most the buffer's size) and sends from there (:meth:`HostStaging.out`).

Either way it holds what is in flight, not a mirror of the whole cache. The copies use torch,
imported only here.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from pdserve.cache_transfer.base import NoLandingRoom
from pdserve.cache_transfer.regions import Region


class HostStaging:
    """``nbytes`` of host memory beside one device cache (``device_view``: a flat uint8 tensor)."""

    def __init__(self, device_view: Any, nbytes: int, unit: int = 1) -> None:
        """``unit``: extents are whole multiples of it (a block's bytes), so a freed extent fits a
        later one of the same blocks."""
        import torch

        self.device_view = device_view
        self.unit = max(1, unit)
        self.nbytes = nbytes // self.unit * self.unit
        if self.nbytes < self.unit:
            raise ValueError(f"a host staging of {nbytes} bytes holds no {self.unit}-byte block")
        pinned = device_view.device.type == "cuda"  # page-locked where a GPU copies from it
        self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.buffer: np.ndarray = self._host.numpy()  # what the transport registers: never released
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, length), by offset
        self.bounce = threading.Lock()  # a prefill's writes take the whole buffer, one at a time

    # ---- the landing pool (decode) ---------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        """The offset of a free extent of ``nbytes`` (rounded up to whole units), now reserved;
        StagingFull when none is free."""
        need = -(-nbytes // self.unit) * self.unit
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    return start
        raise NoLandingRoom(f"no {need}-byte extent free in the {self.nbytes}-byte host staging")

    def release(self, offset: int, nbytes: int) -> None:
        """Give an extent back (when no write into it can land any more)."""
        length = -(-nbytes // self.unit) * self.unit
        with self._lock:
            self._free.append((offset, length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((start, n))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def into_device(self, offset: int, ranges: list[Region]) -> None:
        """Copy the bytes a peer wrote at ``offset`` (one block after another) into these byte
        ranges of the device cache, in order."""
        at = offset
        for start, n in ranges:
            self.device_view[start : start + n].copy_(self._host[at : at + n])
            at += n
        self._sync()

    # ---- the bounce buffer (prefill) ---------------------------------------------------------------
    def out(self, ranges: list[Region], at: int = 0) -> None:
        """Copy these byte ranges of the device cache into the buffer from ``at`` on, one after
        another (before they are sent from there)."""
        for start, n in ranges:
            self._host[at : at + n].copy_(self.device_view[start : start + n])
            at += n
        self._sync()

    def _sync(self) -> None:
        if self.device_view.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device_view.device)

    def close(self) -> None:
        """Drop the buffer (after the transport unregistered it)."""
        del self._host, self.buffer
