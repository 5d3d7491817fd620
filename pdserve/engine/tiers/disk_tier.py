"""The disk tier: KV blocks that left the tiers above it (the host tier, else the pool) are written
to files in a directory the instances of one host share, LRU by file time, bounded in bytes.

One directory per namespace (:class:`TierNamespace` digest, hex) under ``--kv-disk-path``; one file
per block, named by its chain hash (hex, which carries the tenant's salt), so the instances of a
host that serve the same model write each block once and each reads what any of them wrote. A file
is a fixed header (:data:`HEADER`: magic, format version, the namespace digest, the chain hash,
the XXH3 digest of the payload, the payload's length) and the block's bytes; it is written under a
temporary name in the same directory and renamed over its name (``os.replace``), so a reader sees
a whole file or none. A read checks every header field and the digest: any mismatch or a short
file is a miss (counted as corrupt, the file removed), never bytes in the pool.

Writes go through one background thread with a bounded queue: the engine's thread only copies the
block, which it does for the host tier too, and a block whose file this tier knows is only touched
(:meth:`DiskTier.refresh`: no copy, no queue slot). An eviction comes in a burst (an admission
allocates its prompt's blocks at once: hundreds of evictions in one call), so a full queue makes the
engine's thread wait for the writer (it writes into the page cache) rather than drop the
block; only a writer that frees no slot in ``put_timeout_s`` (a stuck disk) has the
write dropped (counted), and the writes after it until the queue has room again. Reads
are synchronous in the step that admits the prompt (a few hundred microseconds a block from the
page cache, far below recomputing it; an asynchronous read would need the batcher to hold an
admission across steps). The files are the truth: a plan asks the file system about a block this
engine has not seen, so a block another instance wrote counts, and a read of one it removed is a
miss (``FileNotFoundError``).

The byte bound is kept by the writer: before a write that would exceed it, or when another process
changed the directory since its last listing (the directory's mtime moved) or that listing is
older than ``rescan_s``, it lists the directory (names and ``stat``, no payload) and removes the
files with the oldest modification time (a read touches its file). With several writers the bound
can be passed by what two of them write at the same moment, until the next write.

What the tier gained and lost (its writes, its evictions, corrupt files it removed, and what a
listing found changed) is recorded (:meth:`DiskTier.take_changes`, each checked against the files
when taken) for the prefix index's one set per disk tier. A worker restarted on the same directory lists it at start and holds what it
finds (:meth:`DiskTier.hashes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdserve.cache_transfer.checksum import HOST_ALGO, block_digests
from pdserve.engine.outputs import TierLoad
from pdserve.engine.tiers.host_tier import TierNamespace

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16s8sQ")
"""magic, format version, reserved (0), namespace digest, chain hash, XXH3-64 of the payload,
payload length: 56 bytes, little-endian."""
SUFFIX = ".kv"
STALE_TMP_S = 60.0  # a temporary file this old was left by a writer that died: removed at a listing


def tier_id(host: str, directory: str) -> str:
    """The disk tier's identity in the prefix index: the host and the namespace directory's real
    path (which names the namespace digest), hashed; equal for every instance that shares it."""
    return hashlib.blake2b(f"{host}|{directory}".encode(), digest_size=16).hexdigest()


@dataclasses.dataclass
class DiskStats:
    """Counters since the engine started (the registration's ``disk_tier``, ``pdserve status``)."""

    stores: int = 0  # files this engine wrote
    hits: int = 0  # blocks read back into the pool, header and checksum verified
    misses: int = 0  # admitted prompts' full blocks the tiers above did not hold and this one did not
    corrupt: int = 0  # files that failed a check at a read-back (removed; the block recomputed)
    evictions: int = 0  # files this engine removed to stay within the byte bound
    dropped: int = 0  # writes dropped because the writer's queue stayed full (a stuck disk)


class DiskTier:
    """Block files in ``root/<namespace digest hex>/``, at most ``capacity_bytes`` of files."""

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        namespace: TierNamespace,
        *,
        background: bool = True,
        queue_blocks: int = 64,
        put_timeout_s: float = 0.5,
        rescan_s: float = 1.0,
        fsync: bool = False,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.file_bytes = HEADER.size + namespace.block_bytes
        self.max_files = capacity_bytes // self.file_bytes
        self._ns = namespace.digest()
        self.dir = Path(root) / self._ns.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(os.path.realpath(self.dir))
        self.rescan_s = rescan_s
        self.put_timeout_s = put_timeout_s
        self._stalled = False  # a put timed out: drop, not wait, until the queue has room again
        self.fsync = fsync
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the engine's thread and the writer's share what follows
        self._known: dict[bytes, float] = {}  # chain hash -> file mtime, as of the last listing/write
        self._changes: dict[bytes, bool] | None = None
        self.on_change: Callable[[], None] | None = None  # told after the writer changed the files
        self._scanned_at = 0.0
        self._dir_mtime = 0  # the directory's mtime as of this process's last listing or change
        self._scan()  # what a previous run (or another instance) left: held from the start
        self._queue: queue.Queue[tuple[bytes, bytes, bytes | None] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(queue_blocks)
            self._thread = threading.Thread(target=self._drain, name="kv-disk-writer", daemon=True)
            self._thread.start()

    # ---- names and files ------------------------------------------------------------------------
    def path(self, block_hash: bytes) -> Path:
        """The block's file: its chain hash, hex, in the namespace's directory."""
        return self.dir / (block_hash.hex() + SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        """Known here (written or listed; a read finds out if another process removed it since),
        else a file another instance wrote: one ``stat``, which a plan's run pays at most once, at
        its end (a plan runs for every waiting prompt at every load snapshot)."""
        return block_hash in self._known or self.path(block_hash).exists()

    @property
    def num_blocks(self) -> int:
        return len(self._known)

    @property
    def used_bytes(self) -> int:
        return len(self._known) * self.file_bytes

    def encode(self, block_hash: bytes, data: bytes, digest: bytes | None = None) -> bytes:
        """A file's bytes: the header, then the payload (``digest``: its XXH3, when known)."""
        if digest is None:
            digest = block_digests(np.frombuffer(data, dtype=np.uint8), [0], len(data), HOST_ALGO)
        return HEADER.pack(MAGIC, VERSION, 0, self._ns, block_hash, digest, len(data)) + data

    def decode(self, block_hash: bytes, raw: bytes) -> bytes | None:
        """The payload of a file's bytes, or None when any check fails."""
        if len(raw) != self.file_bytes:
            return None
        magic, version, _, ns, h, digest, length = HEADER.unpack_from(raw)
        if (magic, version, ns, h, length) != (MAGIC, VERSION, self._ns, block_hash, self.block_bytes):
            return None
        payload = raw[HEADER.size :]
        found = block_digests(np.frombuffer(payload, dtype=np.uint8), [0], length, HOST_ALGO)
        return payload if found == digest else None

    # ---- writes: the engine's thread queues, the writer writes ---------------------------------------
    def refresh(self, block_hash: bytes) -> bool:
        """A block this tier knows and whose file is there is made the most recently used (its
        file touched): True, and there is nothing to write. False: it must be :meth:`put`."""
        if self.max_files == 0 or block_hash not in self._known or not _touch(self.path(block_hash)):
            return False
        with self._lock:
            self._known[block_hash] = time.time()
        return True

    def put(self, block_hash: bytes, data: bytes, digest: bytes | None = None) -> None:
        """Store one block (a copy of its bytes; ``digest``: the XXH3 the host tier took when it
        stored them, so bytes that changed in host memory fail at the read-back): only touched when
        its file is there (:meth:`refresh`), else queued for the writer thread, waiting for a slot
        when the queue is full; dropped (counted) when no slot frees in ``put_timeout_s`` (and,
        after that, while the queue stays full); written at once without a writer thread."""
        if self.max_files == 0:
            return
        if len(data) != self.block_bytes:
            raise ValueError(f"a disk-tier block has {self.block_bytes} bytes, got {len(data)}")
        if self.refresh(block_hash):
            return
        if self._queue is None:
            self._write(block_hash, data, digest)
            return
        try:
            if self._stalled:
                self._queue.put_nowait((block_hash, data, digest))
            else:
                self._queue.put((block_hash, data, digest), timeout=self.put_timeout_s)
            self._stalled = False
        except queue.Full:
            self._stalled = True
            with self._lock:
                self.stats.dropped += 1

    def flush(self) -> None:
        """Wait until every queued write is done (tests; a clean stop)."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._queue = None

    def _drain(self) -> None:
        assert self._queue is not None
        q = self._queue
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                self._write(*item)
                if self.on_change is not None and q.empty():  # once a burst is written
                    self.on_change()
            except Exception:
                log.exception("disk tier: a block was not written")
            finally:
                q.task_done()

    def _write(self, block_hash: bytes, data: bytes, digest: bytes | None = None) -> None:
        path = self.path(block_hash)
        if _touch(path):  # already there (this or another instance wrote it): now the most recent
            with self._lock:
                self._known[block_hash] = time.time()
            return
        self._make_room()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(self.encode(block_hash, data, digest))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self._dir_mtime = os.stat(self.dir).st_mtime_ns  # this write's change: not another's
        with self._lock:
            self._known[block_hash] = time.time()
            self.stats.stores += 1
            self._record(block_hash, True)

    def _dir_changed(self) -> bool:
        """Another process created or removed a file since this one's last listing or write (the
        directory's mtime moved; its clock's granularity may hide one: ``rescan_s`` catches it)."""
        return os.stat(self.dir).st_mtime_ns != self._dir_mtime

    def _make_room(self) -> None:
        """Remove the least recently used files until one more fits (a listing first when the view
        of the directory is stale, another process changed it, or it says it is full)."""
        stale = time.monotonic() - self._scanned_at > self.rescan_s
        if stale or self._dir_changed() or len(self._known) + 1 > self.max_files:
            self._scan()
        while True:
            with self._lock:
                if len(self._known) + 1 <= self.max_files or not self._known:
                    return
                oldest = min(self._known, key=self._known.__getitem__)
                del self._known[oldest]
                self.stats.evictions += 1
                self._record(oldest, False)
            with contextlib.suppress(FileNotFoundError):  # another instance removed it first
                os.remove(self.path(oldest))
            self._dir_mtime = os.stat(self.dir).st_mtime_ns

    def _scan(self) -> None:
        """List the directory (names and times; no payload read): the tier holds what it finds."""
        found: dict[bytes, float] = {}
        now = time.time()
        self._dir_mtime = os.stat(self.dir).st_mtime_ns  # before listing: a change during it rescans
        with os.scandir(self.dir) as entries:
            for entry in entries:
                try:
                    if entry.name.endswith(".tmp"):
                        if now - entry.stat().st_mtime > STALE_TMP_S:
                            os.remove(entry.path)
                        continue
                    if not entry.name.endswith(SUFFIX):
                        continue
                    h = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    found[h] = entry.stat().st_mtime
                except (FileNotFoundError, ValueError):
                    continue
        with self._lock:
            for h in self._known.keys() - found.keys():
                self._record(h, False)
            for h in found.keys() - self._known.keys():
                self._record(h, True)
            self._known = found
        self._scanned_at = time.monotonic()

    # ---- reads: the engine's thread, in the step that admits ------------------------------------------
    def run(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` have a file (nothing read, nothing counted)."""
        n = 0
        for h in hashes:
            if h not in self:
                break
            n += 1
        return n

    def read_one(self, block_hash: bytes) -> bytes | None:
        """One block's payload, checked; None when its file is gone or fails a check (removed and
        counted). A good file is touched: the most recently used."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read(self.file_bytes + 1)
        except FileNotFoundError:
            with self._lock:
                if self._known.pop(block_hash, None) is not None:
                    self._record(block_hash, False)
            return None
        payload = self.decode(block_hash, raw)
        with self._lock:
            if payload is None:
                self.stats.corrupt += 1
                self._known.pop(block_hash, None)
                self._record(block_hash, False)
            else:
                self.stats.hits += 1
                self._known[block_hash] = time.time()
        if payload is None:
            log.warning("disk tier: %s failed its check; removed (the block is recomputed)", path.name)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        else:
            _touch(path)
        return payload

    def read(self, hashes: list[bytes]) -> list[bytes]:
        """The payloads of the leading run of ``hashes`` whose files are there and pass the checks."""
        out = []
        for h in hashes:
            data = self.read_one(h)
            if data is None:
                break
            out.append(data)
        return out

    def snapshot(self) -> TierLoad:
        with self._lock:
            return TierLoad(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self.used_bytes,
                blocks=self.num_blocks,
                **dataclasses.asdict(self.stats),
            )

    # ---- what the prefix index is told -----------------------------------------------------------
    def _record(self, block_hash: bytes, held: bool) -> None:
        """Under the lock."""
        if self._changes is not None:
            self._changes[block_hash] = held

    def take_changes(self) -> dict[bytes, bool]:
        """Block hashes gained (True) and lost (False) since the last call; the first starts the
        record. Each is what the file system says now, not when it was recorded: the instances
        sharing the directory publish their changes at their own pace, and a later publication of
        an older change must not claim a file another one has removed since."""
        with self._lock:
            changes, self._changes = self._changes or {}, {}
        return {h: self.path(h).exists() for h in changes}

    def hashes(self) -> list[bytes]:
        """Every block hash the tier holds as of its last listing and its own writes since."""
        with self._lock:
            return list(self._known)

    def take_hashes(self) -> list[bytes]:
        """What a listing of the directory finds now, for a full replacement of the index's set
        (which the instances sharing the tier write together: it must be the directory's, not one
        writer's view); each is recorded again, so the next :meth:`take_changes` checks it once
        more (a file removed between the listing and the replacement then leaves the set)."""
        self._scan()
        with self._lock:
            hashes = list(self._known)
            self._changes = dict.fromkeys(hashes, True)
        return hashes


def _touch(path: Path) -> bool:
    """Set the file's times to now (the LRU order); False when it does not exist."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False
