"""Memory the engine asks the OS for directly: big arrays in mappings of their own, and the process's
resident size (reported at start-up)."""

from __future__ import annotations

import math
import mmap
import os
import sys

import numpy as np

_MAP_PRIVATE_ANON = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def page_empty(shape: int | tuple[int, ...], dtype: type | np.dtype = np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array in its own private anonymous memory mapping.

    Page-aligned (so 64-byte aligned, as MKL prefers), resident only as far as it is written, and
    unmapped, so back to the OS, as soon as the array is freed. A weight-sized ``np.empty`` comes
    from malloc, whose heap keeps a freed block (a temporary of the same size) and hands its pages,
    already resident, to the next allocation: loading SmolLM2 left ~0.45 GB of such heap behind.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = math.prod(shape)
    nbytes = count * np.dtype(dtype).itemsize
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no private anonymous mmap; malloc, aligned
        raw = np.empty(nbytes + 64, np.uint8)
        start = -raw.ctypes.data % 64
        return raw[start : start + nbytes].view(dtype).reshape(shape)
    if nbytes == 0:
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=_MAP_PRIVATE_ANON)
    return np.frombuffer(buf, dtype, count).reshape(shape)


def page_zeros(shape: int | tuple[int, ...], dtype: type | np.dtype = np.float32) -> np.ndarray:
    """A zero-filled :func:`page_empty`: the kernel's anonymous pages read as zeros and become
    resident only when written (the KV cache, whose blocks fill as requests come)."""
    array = page_empty(shape, dtype)
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        array.fill(0)
    return array


def resident_bytes() -> int:
    """This process's resident set size (Linux: /proc/self/statm; elsewhere the peak, getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        try:
            import resource
        except ImportError:  # Windows
            return 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
