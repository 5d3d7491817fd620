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
that reserved the blocks and the deadline allows the next chunk.
"""

from __future__ import annotations

import enum
import logging

from pdserve.cache_transfer.base import KVTransport
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


class PrefillHandoff:
    def __init__(self, ctx: Context, msg: GenerateRequest, prepared: Prepared) -> None:
        assert msg.disaggregate_info is not None
        self.ctx = ctx
        self.msg = msg
        self.info = msg.disaggregate_info
        self.key = engine_key(msg.request_id, msg.attempt)
        self.owner = Owner(msg.router_id, msg.request_id, msg.attempt)
        self.prepared = prepared
        self.state = PrefillState.RESERVING
        self.dst_blocks: list[int] | None = None
        self.num_cached_dst = 0  # leading dst blocks decode's prefix cache holds: not written
        self.lease: str | None = None  # decode's id of the reservation (ReserveReply.lease)
        self.dst_incarnation: str | None = None  # the decode incarnation that reserved dst_blocks
        self.first: RequestOutput | None = None
        self.retry_at: float | None = None  # monotonic time to ask for blocks again
        self.received_at = ctx.clock.monotonic()
        self.timing: Timing | None = None  # set when the first token is sampled; completed by the write
        self._abort_reason: str | None = None  # an abort that came while transferring

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
                await self._transfer()
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

    async def on_output(self, out: RequestOutput) -> None:
        """The engine's output for this request: the first token (prefilled) or its end."""
        if self.state not in (PrefillState.RESERVING, PrefillState.BLOCKS_READY):
            return
        if out.prefilled:
            self.first = out
            self.timing = Timing(s_ttft_s=self.ctx.clock.monotonic() - self.received_at, queue_s=out.queue_s)
            if self.state is PrefillState.BLOCKS_READY:
                await self._transfer()
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

    async def abort(self, reason: str, tell_decode: bool = False) -> None:
        """The router aborted the request, or is gone (then decode hears it from us)."""
        if self.final:
            return
        if self.state is PrefillState.TRANSFERRING:
            self._abort_reason = reason  # the transfer reads these blocks: free them when it returns
            return
        self.state = PrefillState.FAILED
        await self.ctx.engine.abort(self.key, reason)
        if tell_decode:
            await self._tell_decode_abort(reason)

    # ---- the transfer ------------------------------------------------------------------------------
    async def _transfer(self) -> None:
        assert self.dst_blocks is not None and self.first is not None
        self.state = PrefillState.TRANSFERRING
        try:
            await self._write_kv(self.dst_blocks)
        except Exception as e:  # a foreign error too: the machine must not stay TRANSFERRING
            if isinstance(e, PdserveError):
                log.warning("KV hand-off of %s to %s failed: %s", self.key, self.decode_id, e)
            else:
                log.exception("KV hand-off of %s to %s failed", self.key, self.decode_id)
                e = TransferError(type(e).__name__)
            self.ctx.transports.drop(self.decode_id)
            return await self._fail(TransferError(f"KV transfer to {self.decode_id} failed: {e}"))
        if self._abort_reason is not None:
            self.state = PrefillState.FAILED
            await self.ctx.engine.release_prefilled(self.key)
            return await self._tell_decode_abort(self._abort_reason)
        self.state = PrefillState.DONE
        first = to_delta(self.first, self.owner, FIRST_SEQ)
        first.timing = self.timing
        first.prompt_text = self.prepared.prompt_text
        await self.ctx.messenger.deliver(self.owner, first)
        await self._tell_decode()
        await self.ctx.engine.release_prefilled(self.key)

    async def _write_kv(self, dst_blocks: list[int]) -> None:
        clock, deadline, protocol = self.ctx.clock, self.info.deadlines.transfer, self.info.protocol
        transports = self.ctx.transports
        if clock.time() > deadline:
            raise TransferError("the KV transfer deadline passed")
        engine = self.ctx.engine
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
            (
                engine.regions(src_ids[i : i + per]),
                engine.regions(dst_ids[i : i + per]),
                len(src_ids[i : i + per]),
            )
            for i in range(0, len(src_ids), per)
        ]
        _in_time(clock.time(), len(src_ids) * block_bytes, transports.rate(protocol), deadline)
        expected = self.dst_incarnation

        def copy(w: KVTransport, opened_for: str | None) -> int:
            """On the copy's thread: chunk by chunk, each only while in time and fenced."""
            moved = 0
            for src_regions, dst_regions, n in chunks:
                _in_time(clock.time(), n * block_bytes, transports.rate(protocol), deadline)
                _fenced(w, opened_for, expected)
                moved += w.write_blocks(cache, src_regions, dst_regions)
            _fenced(w, opened_for, expected)  # D restarted during the copy: it landed in a dead cache
            return moved

        t0 = clock.monotonic()
        moved = 0
        if chunks:
            moved = await transports.write(protocol, self.decode_id, self.info.decode.transfer, copy)
        seconds = clock.monotonic() - t0
        transports.observe(protocol, moved, seconds)
        if self.timing is not None:
            self.timing.kv_transfer_s = seconds
        if self.ctx.metrics is not None:
            self.ctx.metrics.on_kv_sent(self.info.protocol, moved, seconds, blocks_not_sent=skip)
        log.debug("%s: %d KV bytes -> %s (%d blocks held there)", self.key, moved, self.decode_id, skip)

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
        await self.ctx.messenger.send(self.decode_id, msg)

    async def _tell_decode_abort(self, reason: str) -> None:
        abort = Abort(request_id=self.msg.request_id, reason=reason, attempt=self.msg.attempt)
        await self.ctx.messenger.send(self.decode_id, abort)


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
