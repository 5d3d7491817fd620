"""The fenced, chunked write of KV blocks from this instance's cache into a peer's, which both movers
of blocks between instances share: a prefill's hand-off into its decode instance
(prefill_handoff.py) and a holder's write of the blocks a peer fetches from it (fetch_server.py).

The write runs on a thread (``Transports.write``), in chunks of whole blocks
(:data:`WRITE_CHUNK_BYTES`). Before every chunk, and after the last, it checks that it was not
stopped (:class:`Stopped`), that the chunk can end by the deadline at the rate recent writes over
that transport moved, and that the cache the writer reaches is the incarnation that reserved the
blocks (``KVTransport.fence``); each block is digested (``cache_transfer.checksum``) just before the
chunk holding it goes out, so the digests are of what this instance read, whatever the transport
then did. The test hook ``kv_flip_in_transit`` (fault_hooks.py) flips one byte of one chunk here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from pdserve.cache_transfer import checksum
from pdserve.cache_transfer.base import KVTransport
from pdserve.cache_transfer.regions import Region
from pdserve.errors import TransferError
from pdserve.worker.handoff_context import Context

WRITE_CHUNK_BYTES = 64 << 20  # writes go in chunks of whole blocks, deadline and fence checked between


class Stopped(Exception):
    """The copy stopped before a chunk: its request was aborted (or the instance is stopping)."""


@dataclasses.dataclass
class BlockWrite:
    """One write: these blocks of this cache into a peer's, over one transport."""

    protocol: str
    peer_id: str
    peer_transfer: dict[str, Any]
    """The peer's registered ``TransferInfo`` (its endpoint by protocol, its incarnation)."""
    src_ids: list[int]
    dst: Callable[[int, int], list[Region]]
    """``dst(i, n)``: where the blocks ``src_ids[i:i + n]`` go in the peer's cache (byte regions)."""
    expected: str | None
    """The incarnation of the peer that reserved the blocks (None: not checked)."""
    deadline: float
    """Monotonic time after which no chunk starts (nor one that cannot end by it)."""
    stop: threading.Event
    """Set: the copy stops before its next chunk (:class:`Stopped`)."""


@dataclasses.dataclass(frozen=True)
class Written:
    moved: int  # bytes the transport reports written
    seconds: float
    digests: bytes  # one per block written, in order (empty with --no-kv-checksum)


async def write_blocks(ctx: Context, job: BlockWrite) -> Written:
    """Write ``job``'s blocks chunk by chunk, each only while not stopped, in time and fenced; the
    transport's rate for pacing (and the registration's ``rates``) learns from it."""
    engine, clock, transports, protocol = ctx.engine, ctx.clock, ctx.transports, job.protocol
    cache, block_bytes = engine.kv_view(), engine.facts.block_bytes
    per = max(1, WRITE_CHUNK_BYTES // max(1, block_bytes))
    chunks = [
        _Chunk(
            job.src_ids[i : i + per],
            engine.regions(job.src_ids[i : i + per]),
            job.dst(i, len(job.src_ids[i : i + per])),
        )
        for i in range(0, len(job.src_ids), per)
    ]
    in_time(clock.monotonic(), len(job.src_ids) * block_bytes, transports.rate(protocol), job.deadline)
    expected, stop, digest = job.expected, job.stop, ctx.kv_checksum
    flip = ctx.faults.fires(ctx.faults.kv_flip_in_transit) and chunks
    flip_at = (ctx.faults.rng.randrange(len(chunks)), ctx.faults.rng.random()) if flip else None
    digests: list[bytes] = []

    def copy(w: KVTransport, opened_for: str | None) -> int:
        """On the copy's thread: chunk by chunk, each only while not stopped, in time and fenced."""
        moved = 0
        for i, chunk in enumerate(chunks):
            if stop.is_set():
                raise Stopped
            in_time(
                clock.monotonic(), len(chunk.src_ids) * block_bytes, transports.rate(protocol), job.deadline
            )
            fenced(w, opened_for, expected)
            if digest:
                digests.append(checksum.block_digests(cache, chunk.src_ids, block_bytes))
            if flip_at is not None and flip_at[0] == i:
                moved += _write_flipped(w, cache, chunk, flip_at[1])
            else:
                moved += w.write_blocks(cache, chunk.src, chunk.dst)
        fenced(w, opened_for, expected)  # the peer restarted during the copy: it landed in a dead cache
        return moved

    t0 = clock.monotonic()
    moved = await transports.write(protocol, job.peer_id, job.peer_transfer, copy) if chunks else 0
    seconds = clock.monotonic() - t0
    transports.observe(protocol, moved, seconds)
    return Written(moved, seconds, b"".join(digests))


class _Chunk:
    """One chunk of a write: its source blocks, and their byte regions here and at the peer."""

    __slots__ = ("dst", "src", "src_ids")

    def __init__(self, src_ids: list[int], src: list[Region], dst: list[Region]) -> None:
        self.src_ids, self.src, self.dst = src_ids, src, dst


def _write_flipped(w: KVTransport, cache: Any, chunk: _Chunk, where: float) -> int:
    """The test hook ``kv_flip_in_transit``: write ``chunk`` with one of its bytes inverted (its
    digests were taken before), then put the byte back here."""
    size = sum(n for _, n in chunk.src)
    at, offset = int(where * size), 0
    for start, n in chunk.src:
        if at < offset + n:
            at = start + at - offset
            break
        offset += n
    cache[at] ^= 0xFF
    try:
        return w.write_blocks(cache, chunk.src, chunk.dst)
    finally:
        cache[at] ^= 0xFF


def in_time(now: float, nbytes: int, rate: float | None, deadline: float) -> None:
    """A TransferError unless a copy of ``nbytes`` starting ``now`` ends by ``deadline`` (at the
    ``rate`` recent writes moved at; unknown: only the deadline itself)."""
    if now > deadline:
        raise TransferError("the KV transfer deadline passed")
    if rate and now + nbytes / rate > deadline:
        raise TransferError(
            f"the KV transfer cannot end before its deadline ({nbytes / 2**20:.1f} MiB at "
            f"{rate / 2**20:.0f} MiB/s, {deadline - now:.2f} s left)"
        )


def fenced(w: KVTransport, opened_for: str | None, expected: str | None) -> None:
    """A TransferError unless the cache ``w`` reaches is the incarnation that reserved the blocks
    (``expected``; None: a peer that names none, not checked)."""
    if expected is None:
        return
    found = w.fence()
    if found is None:  # the protocol cannot read it where it writes: the endpoint's incarnation
        found = opened_for
    if found != expected:
        raise TransferError(
            f"the peer restarted: its cache is incarnation {found or 'unknown'}, "
            f"the blocks were reserved by {expected}"
        )
