"""The prefill side of the splitwise hand-off of one request, as an explicit state machine
(overview in splitwise.py). Ask the decode instance to reserve blocks while the prompt is computed;
once both the decode side's blocks and the first token are here, write the prompt's KV straight
into those blocks, publish the first token, tell decode "prefilled"::

    RESERVING ──reserve ok──> BLOCKS_READY ──first token──┐
        │                                                 ├─> TRANSFERRING ──> DONE
        └──first token──> FIRST_TOKEN_READY ──reserve ok──┘         │
    any live state ──refused / deadline / abort / router gone / transfer error──> FAILED
    RESERVING, BLOCKS_READY ──finished on its first token (EOS, max_tokens=1)──> DONE

The write is fenced: chunk by chunk, only while the cache the writer reaches is the incarnation
that reserved the blocks, the deadline allows the next chunk and the request was not aborted. It
runs as a task of its own (at most ``handoff_context.MAX_TRANSFERS`` at once), never inside the
engine loop or the inbox loop, so a long write holds up no other request's prefill. Each block is
digested as its chunk goes out (``cache_transfer.checksum``); the digests travel in ``Prefilled``
and the decode side checks its blocks against them. Whatever ends a hand-off, the decode side is
told when no write of it can still land (``Prefilled``, or an ``Abort`` with ``writer_done``): only
then does it free the blocks it reserved.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any

from pdserve.cache_transfer import checksum
from pdserve.cache_transfer.base import KVTransport
from pdserve.cache_transfer.regions import Region
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import PdserveError, RequestTimeoutError, TransferError, UnavailableError
from pdserve.scheduler import (
    Abort,
    ErrorInfo,
    GenerateRequest,
    Prefilled,
    ReserveBlocks,
    ReserveReply,
    Timing,
)
from pdserve.worker.engine_client import Prepared
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import Owner, engine_key, to_delta

log = logging.getLogger(__name__)

WRITE_CHUNK_BYTES = 64 << 20  # P writes in chunks of whole blocks, checking deadline and fence between
FIRST_SEQ = 0  # prefill publishes the attempt's first delta; decode numbers its own from FIRST_SEQ + 1


class PrefillState(enum.Enum):
    RESERVING = "reserving"  # blocks asked for (or to be asked again); the prompt is computing
    BLOCKS_READY = "blocks_ready"  # decode's blocks are reserved; the first token is not out yet
    FIRST_TOKEN_READY = "first_token_ready"  # prompt KV and first token are here; decode's blocks are not
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


_FINAL = {PrefillState.DONE, PrefillState.FAILED}


class _Stopped(Exception):
    """The copy stopped before a chunk: its request was aborted (or the instance is stopping)."""


class PrefillHandoff:
    def __init__(
        self,
        ctx: Context,
        msg: GenerateRequest,
        prepared: Prepared,
        on_final: Callable[[str], None] | None = None,
    ) -> None:
        """``on_final(key)``: called when a write that ran as a task of its own has ended the hand-off."""
        assert msg.disaggregate_info is not None
        self.ctx = ctx
        self.on_final = on_final
        self.msg = msg
        self.info = msg.disaggregate_info
        self.key = engine_key(msg.request_id, msg.attempt)
        self.owner = Owner(msg.router_id, msg.request_id, msg.attempt)
        self.prepared = prepared
        self.state = PrefillState.RESERVING
        self.dst_blocks: list[int] | None = None
        self.num_cached_dst = 0  # leading dst blocks decode's prefix cache holds: not written
        self.lease: str | None = None  # decode's id of the reservation (ReserveReply.lease)
        self.staging_offset: int | None = None  # where decode has the blocks land first (a staged cache)
        self.dst_incarnation: str | None = None  # the decode incarnation that reserved dst_blocks
        self.first: RequestOutput | None = None
        self.retry_at: float | None = None  # monotonic time to ask for blocks again
        self.received_at = ctx.clock.monotonic()
        self.timing: Timing | None = None  # set when the first token is sampled; completed by the write
        # The router's transfer deadline, on this instance's monotonic clock from here on: a wall
        # clock that steps cannot move it, and the decode side gets it as a duration.
        self.transfer_by = ctx.clock.monotonic() + (self.info.deadlines.transfer - ctx.clock.time())
        self.transfer: asyncio.Task[None] | None = None  # the write, while it runs
        self._stop = threading.Event()  # the write stops before its next chunk
        self._interrupt: tuple[str, PdserveError | None] | None = None
        """What ended the hand-off while its write ran (the reason, and an error for its router):
        acted on once the write has stopped."""
        self.digests = b""  # of the blocks written, in order

    @property
    def decode_id(self) -> str:
        return self.info.decode.id

    @property
    def final(self) -> bool:
        return self.state in _FINAL

    async def start(self) -> None:
        await self._ask_reserve()
        await self.ctx.engine.add(self.key, self.prepared, prefill_only=True)

    async def _ask_reserve(self) -> None:
        m = self.msg
        self.retry_at = None
        reserve = ReserveBlocks(
            request_id=m.request_id,
            router_id=m.router_id,
            num_tokens=len(self.prepared.prompt_ids),
            reply_to=self.ctx.instance_id,
            deadline=m.deadline,
            deadlines=self.info.deadlines,
            sampling=self.prepared.params,
            prompt_token_ids=self.prepared.prompt_ids,
            attempt=m.attempt,
            background=True if self.prepared.background else None,
            transfer_budget_s=max(0.0, self.transfer_by - self.ctx.clock.monotonic()),
            protocol=self.info.protocol,
        )
        await self.ctx.messenger.send(self.decode_id, reserve)

    # ---- events ------------------------------------------------------------------------------------
    async def on_reserve_reply(self, reply: ReserveReply) -> None:
        if self.state is PrefillState.BLOCKS_READY and self._restarted(reply):
            # D restarted under its id and re-read our ask: its new blocks, not the dead run's
            log.info("%s: %s restarted; writing into its new reservation", self.key, self.decode_id)
            self._take(reply)
            return
        if self.state not in (PrefillState.RESERVING, PrefillState.FIRST_TOKEN_READY):
            return  # a repeated answer, or one that comes after the end
        if reply.ok:
            self._take(reply)
            if self.state is PrefillState.FIRST_TOKEN_READY:
                self._transfer()
            else:
                self.state = PrefillState.BLOCKS_READY
        elif reply.retry_after_ms is not None and self.ctx.clock.time() < self.info.deadlines.reserve:
            self.retry_at = self.ctx.clock.monotonic() + reply.retry_after_ms / 1000
        else:
            await self._fail(UnavailableError(reply.error or "the decode instance refused"))

    def _restarted(self, reply: ReserveReply) -> bool:
        """An ok reply from another incarnation of D than the one whose blocks we hold."""
        return bool(reply.ok and reply.incarnation and self.dst_incarnation) and (
            reply.incarnation != self.dst_incarnation
        )

    def _take(self, reply: ReserveReply) -> None:
        self.dst_blocks, self.num_cached_dst = reply.block_ids, reply.num_cached_blocks
        self.lease, self.dst_incarnation = reply.lease, reply.incarnation
        self.staging_offset = reply.staging_offset

    async def on_output(self, out: RequestOutput) -> None:
        """The engine's output for this request: the first token (prefilled) or its end."""
        if self.state not in (PrefillState.RESERVING, PrefillState.BLOCKS_READY):
            return
        if out.prefilled:
            self.first = out
            self.timing = Timing(s_ttft_s=self.ctx.clock.monotonic() - self.received_at, queue_s=out.queue_s)
            if self.state is PrefillState.BLOCKS_READY:
                self._transfer()
            else:
                self.state = PrefillState.FIRST_TOKEN_READY
        elif out.finished:  # finished on its first token (EOS, stop, max_tokens=1), or the engine failed it
            self.state = PrefillState.DONE
            delta = to_delta(out, self.owner, FIRST_SEQ)
            if out.token_ids:
                delta.timing = Timing(
                    s_ttft_s=self.ctx.clock.monotonic() - self.received_at, queue_s=out.queue_s
                )
                delta.prompt_text = self.prepared.prompt_text
            await self.ctx.messenger.deliver(self.owner, delta)
            await self._tell_decode_abort("finished on prefill")

    async def tick(self) -> None:
        """Timers: ask for blocks again after a refusal; give up at the reserve deadline."""
        if self.state not in (PrefillState.RESERVING, PrefillState.FIRST_TOKEN_READY):
            return
        past_deadline = self.ctx.clock.time() >= self.info.deadlines.reserve
        if self.retry_at is not None and self.ctx.clock.monotonic() >= self.retry_at:
            if past_deadline:
                await self._fail(
                    UnavailableError("no decode instance could reserve KV blocks before the deadline")
                )
            else:
                await self._ask_reserve()
        elif self.retry_at is None and past_deadline:
            await self._fail(RequestTimeoutError("the decode instance did not answer in time"))

    async def abort(self, reason: str) -> None:
        """The router aborted the request, or is gone, or the instance is stopping: free what is
        held and tell the decode side that no write will land (it frees its lease then). A write
        that is running stops before its next chunk; that is done once it has."""
        if self.final:
            return
        if self.state is PrefillState.TRANSFERRING:
            self.interrupt(reason)
            return
        self.state = PrefillState.FAILED
        await self.ctx.engine.abort(self.key, reason)
        await self._tell_decode_abort(reason)

    def interrupt(self, reason: str, error: PdserveError | None = None) -> None:
        """Stop the running write before its next chunk; when it has stopped, the hand-off fails
        (its router told ``error``, if one is given)."""
        if self._interrupt is None:
            self._interrupt = (reason, error)
        self._stop.set()

    async def fail(self, error: PdserveError) -> None:
        """End the hand-off after an unexpected error (its router told, retryable)."""
        if self.state is PrefillState.TRANSFERRING:
            self.interrupt(error.message, error)
        elif not self.final:
            await self._fail(error)

    # ---- the transfer ------------------------------------------------------------------------------
    def _transfer(self) -> None:
        """Start the write as a task of its own: the engine loop and the inbox loop go on."""
        assert self.dst_blocks is not None and self.first is not None
        self.state = PrefillState.TRANSFERRING
        self.transfer = asyncio.get_running_loop().create_task(self._run_transfer(), name=f"kv-{self.key}")

    async def _run_transfer(self) -> None:
        try:
            await self._transfer_and_end()
        except Exception as e:  # the hand-off must end whatever happens: never left TRANSFERRING
            log.exception("ending the KV hand-off of %s failed", self.key)
            if not self.final:
                try:
                    await self._fail(TransferError(f"the KV hand-off failed ({type(e).__name__})"))
                except Exception:
                    log.exception("could not fail the KV hand-off of %s", self.key)
                    self.state = PrefillState.FAILED
        finally:
            self.transfer = None
            if self.on_final is not None:
                self.on_final(self.key)

    async def _transfer_and_end(self) -> None:
        assert self.dst_blocks is not None and self.first is not None
        error: PdserveError | None = None
        try:
            async with self.ctx.transfer_slots:
                await self._write_kv(self.dst_blocks)
        except _Stopped:
            pass
        except Exception as e:  # a foreign error too: the machine must not stay TRANSFERRING
            if isinstance(e, PdserveError):
                log.warning("KV hand-off of %s to %s failed: %s", self.key, self.decode_id, e)
            else:
                log.exception("KV hand-off of %s to %s failed", self.key, self.decode_id)
                e = TransferError(type(e).__name__)
            self.ctx.transports.drop(self.decode_id)
            error = TransferError(f"KV transfer to {self.decode_id} failed: {e}")
        # the copy has stopped: no byte of it can land any more
        if self._interrupt is not None:
            reason, told = self._interrupt
            self.state = PrefillState.FAILED
            await self.ctx.engine.release_prefilled(self.key)
            await self._tell_decode_abort(reason)
            if told is not None:
                await self.ctx.messenger.fail(self.owner, told, retryable=True)
            return
        if error is not None:
            return await self._fail(error)
        self.state = PrefillState.DONE
        first = to_delta(self.first, self.owner, FIRST_SEQ)
        first.timing = self.timing
        first.prompt_text = self.prepared.prompt_text
        await self.ctx.messenger.deliver(self.owner, first)
        await self._tell_decode()
        await self.ctx.engine.release_prefilled(self.key)

    async def _write_kv(self, dst_blocks: list[int]) -> None:
        ctx, protocol = self.ctx, self.info.protocol
        clock, transfer_by, transports = ctx.clock, self.transfer_by, ctx.transports
        if self._stop.is_set():
            raise _Stopped
        if clock.monotonic() > transfer_by:
            raise TransferError("the KV transfer deadline passed")
        engine = ctx.engine
        src = await engine.prefilled_blocks(self.key)
        if len(src) != len(dst_blocks):
            raise TransferError(f"decode reserved {len(dst_blocks)} blocks for {len(src)}")
        skip = self.num_cached_dst  # decode holds these already: only the missing blocks move
        if not 0 <= skip <= len(src):
            raise TransferError(f"decode says it holds {skip} of {len(src)} blocks")
        cache, src_ids, dst_ids = engine.kv_view(), src[skip:], dst_blocks[skip:]
        block_bytes = engine.facts.block_bytes
        per = max(1, WRITE_CHUNK_BYTES // max(1, block_bytes))
        chunks = [
            _Chunk(
                src_ids[i : i + per],
                engine.regions(src_ids[i : i + per]),
                self._dst(dst_ids, i, per, block_bytes),
            )
            for i in range(0, len(src_ids), per)
        ]
        _in_time(clock.monotonic(), len(src_ids) * block_bytes, transports.rate(protocol), transfer_by)
        expected, stop, digest = self.dst_incarnation, self._stop, ctx.kv_checksum
        flip = ctx.faults.fires(ctx.faults.kv_flip_in_transit) and chunks
        flip_at = (ctx.faults.rng.randrange(len(chunks)), ctx.faults.rng.random()) if flip else None
        digests: list[bytes] = []

        def copy(w: KVTransport, opened_for: str | None) -> int:
            """On the copy's thread: chunk by chunk, each only while not stopped, in time and fenced."""
            moved = 0
            for i, chunk in enumerate(chunks):
                if stop.is_set():
                    raise _Stopped
                _in_time(
                    clock.monotonic(),
                    len(chunk.src_ids) * block_bytes,
                    transports.rate(protocol),
                    transfer_by,
                )
                _fenced(w, opened_for, expected)
                if digest:
                    digests.append(checksum.block_digests(cache, chunk.src_ids, block_bytes))
                if flip_at is not None and flip_at[0] == i:
                    moved += _write_flipped(w, cache, chunk, flip_at[1])
                else:
                    moved += w.write_blocks(cache, chunk.src, chunk.dst)
            _fenced(w, opened_for, expected)  # D restarted during the copy: it landed in a dead cache
            return moved

        t0 = clock.monotonic()
        moved = 0
        if chunks:
            moved = await transports.write(protocol, self.decode_id, self.info.decode.transfer, copy)
        seconds = clock.monotonic() - t0
        self.digests = b"".join(digests)
        transports.observe(protocol, moved, seconds)
        if self.timing is not None:
            self.timing.kv_transfer_s = seconds
        if ctx.metrics is not None:
            ctx.metrics.on_kv_sent(protocol, moved, seconds, blocks_not_sent=skip)
        log.debug("%s: %d KV bytes -> %s (%d blocks held there)", self.key, moved, self.decode_id, skip)

    def _dst(self, dst_ids: list[int], i: int, per: int, block_bytes: int) -> list[Region]:
        """Where the blocks ``i:i + per`` of the write go: the decode instance's blocks, or,
        where it stages them, one after another from its ``staging_offset``."""
        if self.staging_offset is None:
            return self.ctx.engine.regions(dst_ids[i : i + per])
        n = len(dst_ids[i : i + per])
        return [(self.staging_offset + i * block_bytes, n * block_bytes)]

    # ---- the one way to fail -------------------------------------------------------------------------
    async def _fail(self, error: PdserveError) -> None:
        """Free the engine's request or blocks, free decode's reservation, fail the request (retryable)."""
        transferring = self.state is PrefillState.TRANSFERRING
        self.state = PrefillState.FAILED
        await self.ctx.engine.abort(self.key, "failed")
        if transferring:
            await self._tell_decode(error)
        else:
            await self._tell_decode_abort(error.message)
        await self.ctx.messenger.fail(self.owner, error, retryable=True)

    async def _tell_decode(self, error: PdserveError | None = None) -> None:
        first = self.first
        msg = Prefilled(
            request_id=self.msg.request_id,
            first_token=first.token_ids[0] if first and first.token_ids else 0,
            prompt_token_ids=self.prepared.prompt_ids,
            attempt=self.msg.attempt,
            error=ErrorInfo.of(error) if error else None,
            next_seq=FIRST_SEQ + 1,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            protocol=self.info.protocol,
            lease=self.lease,
            router_id=self.msg.router_id,
        )
        if error is None and self.ctx.kv_checksum:
            msg.kv_digests = checksum.encode(self.digests)
            msg.kv_digest_algo = checksum.algo_for(self.ctx.engine.kv_view())
        await self.ctx.messenger.send(self.decode_id, msg)

    async def _tell_decode_abort(self, reason: str) -> None:
        """This instance, the writer, will write nothing more for the request: the decode side may
        free its lease now (a router's abort only marks it aborted there)."""
        abort = Abort(
            request_id=self.msg.request_id, reason=reason, attempt=self.msg.attempt, writer_done=True
        )
        await self.ctx.messenger.send(self.decode_id, abort)


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


def _in_time(now: float, nbytes: int, rate: float | None, deadline: float) -> None:
    """A TransferError unless a copy of ``nbytes`` starting ``now`` ends by ``deadline`` (at the
    ``rate`` recent writes moved at; unknown: only the deadline itself)."""
    if now > deadline:
        raise TransferError("the KV transfer deadline passed")
    if rate and now + nbytes / rate > deadline:
        raise TransferError(
            f"the KV transfer cannot end before its deadline ({nbytes / 2**20:.1f} MiB at "
            f"{rate / 2**20:.0f} MiB/s, {deadline - now:.2f} s left)"
        )


def _fenced(w: KVTransport, opened_for: str | None, expected: str | None) -> None:
    """A TransferError unless the cache ``w`` reaches is the incarnation that reserved the blocks
    (``expected``; None: a decode instance that names none, not checked)."""
    if expected is None:
        return
    found = w.fence()
    if found is None:  # the protocol cannot read it where it writes: the endpoint's incarnation
        found = opened_for
    if found != expected:
        raise TransferError(
            f"the decode instance restarted: its cache is incarnation {found or 'unknown'}, "
            f"the blocks were reserved by {expected}"
        )
