"""Peer fetch, the holder's side (docs/design.md, "Peer fetch"): a peer asks this instance for
prefix blocks it holds (``FetchBlocks``); this instance is then the writer, as a prefill instance is
in a hand-off: it pins the leading run of the asked blocks it has (its pool's, then its tiers' read
back into the pool, as many as its pool has room for: ``PrefixPins.pin_blocks``), writes them into
the blocks the fetcher reserved through the same fenced, chunked copy (kv_copy.py: fenced to the
fetcher's incarnation, started only while its budget allows, each block digested as it goes out),
answers ``FetchedBlocks`` with how many it wrote and their digests, or with the error, and then
lets the pins go (the release waits for its engine's step: the answer does not). That answer is its
last word on the fetch: no write of it lands after it. A pin that its engine thread gets to only
after the budget (a long step) pins and reads back nothing. Each fetch runs as a task of its own (taking
one of the instance's write slots), never in the inbox or engine loop.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading

from pdserve.cache_transfer import checksum
from pdserve.cache_transfer.regions import Region
from pdserve.engine.tiers.host_tier import TierNamespace
from pdserve.errors import PdserveError, TransferError
from pdserve.scheduler import FetchBlocks, FetchedBlocks, FetchInfo
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.handoff_context import Context
from pdserve.worker.kv_copy import BlockWrite, Stopped, write_blocks

log = logging.getLogger(__name__)

HASH_BYTES = 16  # a block's chain hash (pdserve.block_hash)


def namespace(engine: EngineClient) -> str:
    """What this engine's KV bytes depend on besides the tokens (``TierNamespace``: weights, their
    precision, KV dtype, layout, block size and bytes), as hex: fetcher and holder must agree."""
    f = engine.facts
    ns = TierNamespace(f.weights_digest or "", f.weights, f.dtype, f.layout, f.block_size, f.block_bytes)
    return ns.digest().hex()


class FetchServer:
    """The fetches this instance serves now, each a task of its own."""

    def __init__(self, ctx: Context, info: FetchInfo) -> None:
        self.ctx = ctx
        self.info = info  # its ``served`` counter is this side's
        self._tasks: dict[asyncio.Task[None], threading.Event] = {}

    def serve(self, msg: FetchBlocks) -> None:
        """Start serving ``msg`` (the inbox loop goes on)."""
        stop = threading.Event()
        task = asyncio.get_running_loop().create_task(self._serve(msg, stop), name=f"fetch-{msg.request_id}")
        self._tasks[task] = stop
        task.add_done_callback(lambda t: self._tasks.pop(t, None))

    async def _serve(self, msg: FetchBlocks, stop: threading.Event) -> None:
        ctx = self.ctx
        deadline = ctx.clock.monotonic() + msg.budget_s
        answer = FetchedBlocks(request_id=msg.request_id, lease=msg.lease)
        key = f"serve:{msg.request_id}:{msg.lease}"
        pinning = False
        try:
            try:
                hashes = self._hashes(msg)
                pinning = True
                src = await ctx.engine.pin_blocks(key, hashes, lambda: ctx.clock.monotonic() > deadline)
                if not src and ctx.clock.monotonic() > deadline:
                    raise TransferError(
                        f"{ctx.instance_id}'s engine was busy past the fetch's {msg.budget_s:.2f} s budget"
                    )
                written, digests = await self._write(msg, src, deadline, stop)
                answer.num_blocks = written
                if written and ctx.kv_checksum:
                    answer.kv_digests = checksum.encode(digests)
                    answer.kv_digest_algo = checksum.algo_for(ctx.engine.kv_view())
            except Stopped:
                answer.error = f"{ctx.instance_id} is stopping"
            except PdserveError as e:
                log.warning("serving fetch %s to %s failed: %s", msg.request_id, msg.reply_to, e)
                answer.error = e.message
            except Exception as e:  # a foreign error too: the fetcher must hear that no write will land
                log.exception("serving fetch %s to %s failed", msg.request_id, msg.reply_to)
                answer.error = f"{ctx.instance_id} failed the fetch ({type(e).__name__})"
            self.info.served += answer.num_blocks
            if ctx.metrics is not None and answer.num_blocks:
                ctx.metrics.on_peer_fetch_served(answer.num_blocks)
            await ctx.messenger.send(msg.reply_to, answer)
        finally:
            # after the answer: the writes are over, and the fetcher does not wait for this engine's
            # next step (the release, like the pin, runs between steps)
            if pinning:
                await ctx.engine.release_held(key)

    def _hashes(self, msg: FetchBlocks) -> list[bytes]:
        """The asked hashes, once the ask is one this instance can serve."""
        ctx = self.ctx
        if msg.namespace != namespace(ctx.engine):
            raise TransferError(f"{ctx.instance_id} holds another model's or cache's KV (namespace differs)")
        raw = base64.b64decode(msg.block_hashes)
        hashes = [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
        if len(raw) % HASH_BYTES or len(hashes) != len(msg.block_ids):
            raise TransferError(
                f"fetch {msg.request_id} names {len(hashes)} hashes for {len(msg.block_ids)} blocks"
            )
        return hashes

    async def _write(
        self, msg: FetchBlocks, src: list[int], deadline: float, stop: threading.Event
    ) -> tuple[int, bytes]:
        """Write the pinned blocks ``src``: how many were written, and their digests."""
        ctx = self.ctx
        if not src:
            return 0, b""
        dst_ids = msg.block_ids[: len(src)]
        job = BlockWrite(
            msg.protocol,
            msg.fetcher.id,
            msg.fetcher.transfer,
            src,
            lambda i, n: self._dst(msg, dst_ids, i, n),
            msg.incarnation,
            deadline,
            stop,
        )
        try:
            async with ctx.transfer_slots:
                done = await write_blocks(ctx, job)
        except (Stopped, asyncio.CancelledError):
            raise
        except Exception:
            ctx.transports.drop(msg.fetcher.id)  # reopened for the next write
            raise
        log.debug("fetch %s: %d blocks -> %s", msg.request_id, len(src), msg.fetcher.id)
        return len(src), done.digests

    def _dst(self, msg: FetchBlocks, dst_ids: list[int], i: int, n: int) -> list[Region]:
        """Where blocks ``i:i + n`` go: the fetcher's blocks, or one after another from its
        ``staging_offset`` (a staged cache)."""
        if msg.staging_offset is None:
            return self.ctx.engine.regions(dst_ids[i : i + n])
        block_bytes = self.ctx.engine.facts.block_bytes
        return [(msg.staging_offset + i * block_bytes, n * block_bytes)]

    async def stop_all(self) -> None:
        """Every write stops before its next chunk; each fetcher is told; waited for."""
        for stop in self._tasks.values():
            stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
