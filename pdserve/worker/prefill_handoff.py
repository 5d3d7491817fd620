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
that reserved the blocks, the deadline allows the next chunk and the request was not aborted
(kv_copy.py, which a peer fetch's writes share). It runs as a task of its own (at most ``handoff_context.MAX_TRANSFERS`` at once), never inside the
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

from pdserve.cache_transfer import checksum
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
from pdserve.worker.kv_copy import BlockWrite, Stopped, write_blocks
from pdserve.worker.messenger import Owner, engine_key, to_delta

log = logging.getLogger(__name__)

FIRST_SEQ = 0  # prefill publishes the attempt's first delta; decode numbers its own from FIRST_SEQ + 1


class PrefillState(enum.Enum):
    RESERVING = "reserving"  # blocks asked for (or to be asked again); the prompt is computing
    BLOCKS_READY = "blocks_ready"  # decode's blocks are reserved; the first token is not out yet
    FIRST_TOKEN_READY = "first_token_ready"  # prompt KV and first token are here; decode's blocks are not
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


_FINAL = {PrefillState.DONE, PrefillState.FAILED}


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

    async def start(self, hold: str | None = None) -> None:
        """Ask for blocks and queue the prefill (``hold``: its prefix blocks a peer fetch held)."""
        try:
            await self._ask_reserve()
        except BaseException:
            if hold is not None:
                await self.ctx.engine.release_held(hold)
            raise
        await self.ctx.engine.add(self.key, self.prepared, prefill_only=True, hold=hold)

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
        except Stopped:
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
        if self._stop.is_set():
            raise Stopped
        if ctx.clock.monotonic() > self.transfer_by:
            raise TransferError("the KV transfer deadline passed")
        src = await ctx.engine.prefilled_blocks(self.key)
        if len(src) != len(dst_blocks):
            raise TransferError(f"decode reserved {len(dst_blocks)} blocks for {len(src)}")
        skip = self.num_cached_dst  # decode holds these already: only the missing blocks move
        if not 0 <= skip <= len(src):
            raise TransferError(f"decode says it holds {skip} of {len(src)} blocks")
        dst_ids = dst_blocks[skip:]
        job = BlockWrite(
            protocol,
            self.decode_id,
            self.info.decode.transfer,
            src[skip:],
            lambda i, n: self._dst(dst_ids, i, n),
            self.dst_incarnation,
            self.transfer_by,
            self._stop,
        )
        done = await write_blocks(ctx, job)
        self.digests = done.digests
        if self.timing is not None:
            self.timing.kv_transfer_s = done.seconds
        if ctx.metrics is not None:
            ctx.metrics.on_kv_sent(protocol, done.moved, done.seconds, blocks_not_sent=skip)
        log.debug("%s: %d KV bytes -> %s (%d blocks held there)", self.key, done.moved, self.decode_id, skip)

    def _dst(self, dst_ids: list[int], i: int, n: int) -> list[Region]:
        """Where the blocks ``i:i + n`` of the write go: the decode instance's blocks, or, where it
        stages them, one after another from its ``staging_offset``."""
        if self.staging_offset is None:
            return self.ctx.engine.regions(dst_ids[i : i + n])
        block_bytes = self.ctx.engine.facts.block_bytes
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
