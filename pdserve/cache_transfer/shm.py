"""POSIX shared memory for a decode instance's KV cache (same-host transfer: one copy, 5-7 GB/s).

The decode engine allocates its whole cache in a named segment; a prefill process on the same host
attaches to it and writes its blocks straight into the decode side's blocks.
"""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from pdserve.cache_transfer.base import KVTransport
from pdserve.cache_transfer.regions import Segment
from pdserve.errors import ConfigError, TransferError

log = logging.getLogger(__name__)


SHM_DIR = "/dev/shm"


def create_segment(name: str, nbytes: int, reclaim: bool = False) -> shared_memory.SharedMemory:
    """Create a zero-filled segment owned (and later unlinked) by the calling process, its pages
    committed now: a /dev/shm too small for it is a clear error here, never a SIGBUS later.

    ``reclaim``: a segment of that name left by a killed previous run (same instance id) is
    removed first; the caller has checked that no live instance uses the id.
    """
    try:
        segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    except FileExistsError:
        if not reclaim:
            raise TransferError(
                f"shared memory segment {name!r} already exists (another instance with this id?)"
            ) from None
        log.warning("removing shared memory segment %s left by a previous run of this instance", name)
        stale = attach_segment(name)
        stale.close()
        stale.unlink()
        segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    try:
        os.posix_fallocate(segment._fd, 0, nbytes)  # tmpfs reserves the pages, or says ENOSPC now
    except OSError as e:
        segment.close()
        segment.unlink()
        raise ConfigError(_too_small(nbytes, e)) from None
    return segment


def _too_small(nbytes: int, error: OSError) -> str:
    try:
        st = os.statvfs(SHM_DIR)
        room = (
            f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB"
        )
    except OSError:
        room = "its size unknown"
    return (
        f"{SHM_DIR} cannot hold this instance's {nbytes / 2**20:.0f} MiB KV cache ({room}; {error.strerror}): "
        "give the container more (docker run --shm-size, compose shm_size) or a smaller cache "
        "(--kv-cache-gb, --num-blocks)"
    )


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach to a peer's segment without adopting it: Python < 3.13 would unlink it at our exit."""
    try:
        if sys.version_info >= (3, 13):
            return shared_memory.SharedMemory(name=name, create=False, track=False)
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            return shared_memory.SharedMemory(name=name, create=False)
        finally:
            resource_tracker.register = register  # type: ignore[assignment]
    except FileNotFoundError:
        raise TransferError(f"shared memory segment {name!r} not found (decode instance gone?)") from None


class ShmWriter(KVTransport):
    """Writes KV byte ranges of a local cache into a peer's shared-memory cache."""

    protocol = "shm"

    def __init__(self, segment_name: str) -> None:
        self.segment_name = segment_name
        self._shm = attach_segment(segment_name)
        self._dst = np.ndarray((self._shm.size,), dtype=np.uint8, buffer=self._shm.buf)

    def write(self, src: np.ndarray, segments: list[Segment]) -> int:
        """Copy ``src[s:s+n] -> peer[d:d+n]`` for each segment; returns bytes moved."""
        total = 0
        for s, d, n in segments:
            if d + n > self._dst.size:
                raise TransferError(f"segment {d}+{n} exceeds peer cache of {self._dst.size} bytes")
            self._dst[d : d + n] = src[s : s + n]
            total += n
        return total

    def close(self) -> None:
        del self._dst
        self._shm.close()
