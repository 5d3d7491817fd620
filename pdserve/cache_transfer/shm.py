"""POSIX shared memory for a decode instance's KV cache (same-host transfer: one copy, 5-7 GB/s).

The decode engine allocates its whole cache in a named segment; a prefill process on the same host
attaches to it and writes its blocks straight into the decode side's blocks. Segments are named
``pdserve-*``; the owner holds a lock on its segment until it exits, so a sweeper can tell (and
remove) the segments of owners that died without cleaning up (SIGKILL, OOM kill).

After the cache, a segment holds its fence (:data:`FENCE_BYTES`): the owner's incarnation, written
when its transport opens (:func:`write_fence`). A writer reads it from its own mapping before every
chunk it copies (``ShmWriter.fence``): a restart under the same id makes a new segment of the same
name, and a writer that attached by name to it finds another incarnation there than the one that
reserved the blocks it was about to write.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from pdserve.cache_transfer.base import CPU, KVTransport, LocalCache, TransportBackend
from pdserve.cache_transfer.regions import Segment
from pdserve.errors import ConfigError, TransferError

log = logging.getLogger(__name__)


SHM_DIR = "/dev/shm"
PROTOCOL = "shm"
PREFIX = "pdserve-"  # every segment pdserve creates; the sweeper looks at no other name
_CREATE_TRIES = 5
FENCE_BYTES = 64  # after the cache: magic, length, the owner's incarnation (ASCII)
_FENCE_MAGIC = b"pdsvfnc1"


class OwnedSegment:
    """A segment this process created: it holds an exclusive ``flock`` on it for as long as it lives.

    The kernel drops the lock when the process dies however it dies (SIGKILL, OOM), so "nobody
    holds the lock" is exactly "the owner is dead" for :func:`sweep_dead_segments`, whatever PID
    namespace owner and sweeper run in, as long as they share /dev/shm. Peers that attach
    (:func:`attach_segment`) never lock. ``close`` removes the name while the lock still proves it
    is ours, so a late close can never remove a newer owner's segment of the same name.
    """

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name, self.size, self._fd = name, size, fd
        self._mmap = mmap.mmap(fd, size + FENCE_BYTES)  # MAP_SHARED; its dup of fd shares our lock
        self._whole = memoryview(self._mmap)
        self.buf = self._whole[:size]  # the cache; the fence follows it

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def close(self) -> None:
        """Unlink the segment, then unmap it (every view of ``buf`` must be gone by now)."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.buf.release()
        self._whole.release()
        self._mmap.close()
        os.close(self._fd)  # the lock goes with the last descriptor
        self._fd = -1


def create_segment(name: str, nbytes: int, reclaim: bool = False) -> OwnedSegment:
    """Create a zero-filled segment owned (and later removed) by the calling process, locked before
    anything else happens to it, its pages committed now: a /dev/shm too small for it is a clear
    error here, never a SIGBUS later.

    Between our create and our lock a sweeper may find the file unlocked and remove it; we notice
    (once locked, the name no longer leads to our file) and create it again. So no grace period
    by age is needed, and the sweeper may remove anything it can lock.

    ``reclaim``: a segment of that name left by a dead previous run (same instance id) is removed
    first; one whose owner is still alive is refused.

    The file is :data:`FENCE_BYTES` longer than ``nbytes``: the fence follows the cache (zero, so
    naming no incarnation, until :func:`write_fence`).
    """
    path = os.path.join(SHM_DIR, name)
    for _ in range(_CREATE_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            if not reclaim:
                raise TransferError(
                    f"shared memory segment {name!r} already exists (another instance with this id?)"
                ) from None
            if _remove_if_dead(path) is not None:
                log.warning("removed shared memory segment %s left by a previous run of this instance", name)
            elif os.path.lexists(path):
                raise TransferError(
                    f"shared memory segment {name!r} is held by a live process (another instance with this id?)"
                ) from None
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a sweeper holds it: microseconds
        if _names(path, fd):
            break
        os.close(fd)  # a sweeper removed it before we locked it: make a new one
    else:
        raise TransferError(f"could not create shared memory segment {name!r}: it kept vanishing")
    try:
        try:
            os.posix_fallocate(
                fd, 0, nbytes + FENCE_BYTES
            )  # tmpfs reserves the pages (and sets the size), or says ENOSPC now
        except OSError as e:
            raise ConfigError(_too_small(nbytes, e)) from None
        return OwnedSegment(name, fd, nbytes)
    except BaseException:
        os.unlink(path)  # still ours: we hold the lock
        os.close(fd)
        raise


def sweep_dead_segments(prefix: str = PREFIX) -> list[str]:
    """Remove every segment in /dev/shm named ``prefix*`` whose owner is dead; their names.

    A worker runs it before it creates its segment and ``pdserve up`` when it starts and when a
    decode child dies, so a killed instance's cache does not hold /dev/shm's memory for good.
    A segment made by a pdserve without the ownership lock would look dead: every process that
    shares this /dev/shm must run a pdserve that locks.
    """
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError as e:
        log.warning("cannot list %s to sweep dead segments: %s", SHM_DIR, e)
        return []
    removed = []
    for name in names:
        size = _remove_if_dead(os.path.join(SHM_DIR, name))
        if size is not None:
            log.warning("removed shared memory segment %s (%.1f MiB): its owner is gone", name, size / 2**20)
            removed.append(name)
    return removed


def _remove_if_dead(path: str) -> int | None:
    """Unlink ``path`` when nobody holds its lock: its size; None when kept or already gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # another user's, a symlink: not ours to judge
        log.debug("not sweeping %s: %s", path, e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its owner is alive
        if not _names(path, fd):
            return None  # removed (and perhaps made again) while we waited for it
        try:
            os.unlink(path)  # nobody can make a new one here while this one still has the name
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cannot remove dead shared memory segment %s: %s", path, e)
            return None
        return st.st_size
    finally:
        os.close(fd)


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still leads to the file open as ``fd``."""
    try:
        a = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return _identity(a) == _identity(os.fstat(fd))


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


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


def write_fence(name: str, incarnation: str) -> None:
    """Write the owner's incarnation into the fence of its segment ``name`` (the owner's transport
    does, at start, before its registration advertises the segment)."""
    data = incarnation.encode("ascii")
    if len(data) > FENCE_BYTES - len(_FENCE_MAGIC) - 1:
        raise TransferError(f"incarnation {incarnation!r} does not fit a segment's fence")
    fence = _FENCE_MAGIC + bytes([len(data)]) + data
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < FENCE_BYTES:
            raise TransferError(f"shared memory segment {name!r} has no room for a fence")
        os.pwrite(fd, fence.ljust(FENCE_BYTES, b"\0"), size - FENCE_BYTES)
    finally:
        os.close(fd)


def read_fence(fence: bytes | memoryview) -> str:
    """The incarnation a segment's fence names; "" when it names none (not written yet)."""
    raw = bytes(fence)
    if not raw.startswith(_FENCE_MAGIC):
        return ""
    n = raw[len(_FENCE_MAGIC)]
    return raw[len(_FENCE_MAGIC) + 1 : len(_FENCE_MAGIC) + 1 + n].decode("ascii", "replace")


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach to a peer's segment without adopting it: Python < 3.13 would unlink it at our exit."""
    try:
        if sys.version_info >= (3, 13):
            return shared_memory.SharedMemory(name=name, create=False, track=False)
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name=name, create=False)
        finally:
            resource_tracker.register = register
    except FileNotFoundError:
        raise TransferError(f"shared memory segment {name!r} not found (decode instance gone?)") from None


class ShmWriter(KVTransport):
    """Writes KV byte ranges of a local cache into a peer's shared-memory cache."""

    protocol = PROTOCOL

    def __init__(self, segment_name: str) -> None:
        self.segment_name = segment_name
        self._shm = attach_segment(segment_name)
        fd = self._shm._fd  # type: ignore[attr-defined]  # POSIX SharedMemory keeps it open
        self._file = _identity(os.fstat(fd))  # the segment we mapped, not just its name
        size = self._shm.size - FENCE_BYTES
        if size < 0:
            self._shm.close()
            raise TransferError(f"shared memory segment {segment_name!r} is too small to be a KV cache")
        self._dst = np.ndarray((size,), dtype=np.uint8, buffer=self._shm.buf)
        self._fence = np.ndarray((FENCE_BYTES,), dtype=np.uint8, buffer=self._shm.buf, offset=size)

    def fence(self) -> str:
        """The incarnation the mapped segment's owner wrote into its fence ("" before it did):
        read from this writer's own mapping, so it is the cache the next copy reaches."""
        return read_fence(self._fence.tobytes())

    def current(self) -> bool:
        """Whether the segment's name still leads to the segment we mapped: a decode instance
        restarted under its id removed the old one (``create_segment(reclaim=True)``) and made a
        new one of the same name; writing into the old mapping would reach nobody."""
        try:
            return _identity(os.stat(os.path.join(SHM_DIR, self.segment_name))) == self._file
        except OSError:
            return False

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
        del self._dst, self._fence
        self._shm.close()


class ShmBackend(TransportBackend):
    """Same host, one copy: a decode instance's cache already lives in a segment (the engine creates
    it, ``engine/cpu/kv_cache.py``); its name is the endpoint, and peers attach to it and copy."""

    protocol = PROTOCOL

    def __init__(self) -> None:
        self.segment: str | None = None

    @classmethod
    def unsuited(cls, device: str) -> str | None:
        if device == CPU:
            return None
        return (
            f"the shm transport copies KV caches in host memory, and this instance's is on {device} "
            "(between GPUs of one host use --kv-transfer cuda_ipc)"
        )

    def open(self, local: LocalCache) -> None:
        self.check_device(local)
        self.segment = local.shm_name  # None for a cache outside shared memory (a prefill's)
        if self.segment is not None and local.shared and local.incarnation:
            write_fence(self.segment, local.incarnation)  # before any peer can learn the name

    def endpoint(self) -> str | None:
        return self.segment

    def writer(self, peer: Any) -> ShmWriter:
        return ShmWriter(str(peer))

    def close(self) -> None:
        self.segment = None  # the segment itself goes with the engine's cache
