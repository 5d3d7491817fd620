"""The splitwise hand-off of one request, as two explicit state machines (docs/design.md, "Request flow").

Prefill side (:class:`PrefillHandoff`): ask the decode instance to reserve blocks while the prompt
is computed; once both the decode side's blocks and the first token are here, write the prompt's
KV straight into those blocks, publish the first token, tell decode "prefilled"::

    RESERVING ──reserve ok──> BLOCKS_READY ──first token──┐
        │                                                 ├─> TRANSFERRING ──> DONE
        └──first token──> FIRST_TOKEN_READY ──reserve ok──┘         │
    any live state ──refused / deadline / abort / router gone / transfer error──> FAILED
    RESERVING, BLOCKS_READY ──finished on its first token (EOS, max_tokens=1)──> DONE

Decode side (:class:`DecodeLease`): blocks reserved for a prefill that has not arrived yet::

    RESERVED ──prefilled──> DECODING (an ordinary request of this instance from then on)
    RESERVED ──prefill failed / abort / deadline passed──> FAILED

Each machine has one way to finish and one way to fail (``_fail``), which frees what it holds
(engine request or blocks, the peer's reservation) and tells whom it concerns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
from collections.abc import Collection, Iterator
from typing import Any

from pdserve.cache_transfer.base import KVTransport, TransportBackend
from pdserve.cache_transfer.transports import close_backends, open_writer
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import EngineError, PdserveError, RequestTimeoutError, TransferError, UnavailableError
from pdserve.scheduler import (
    Abort,
    ErrorInfo,
    GenerateRequest,
    Prefilled,
    ReserveBlocks,
    ReserveReply,
    Timing,
)
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient, Prepared
from pdserve.worker.messenger import Messenger, Owner, engine_key, to_delta
from pdserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

RESERVE_RETRY_MS = 200  # a decode instance without free blocks asks to be asked again after this
FIRST_SEQ = 0  # prefill publishes the attempt's first delta; decode numbers its own from FIRST_SEQ + 1


class PrefillState(enum.Enum):
    RESERVING = "reserving"  # blocks asked for (or to be asked again); the prompt is computing
    BLOCKS_READY = "blocks_ready"  # decode's blocks are reserved; the first token is not out yet
    FIRST_TOKEN_READY = "first_token_ready"  # prompt KV and first token are here; decode's blocks are not
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class DecodeState(enum.Enum):
    RESERVED = "reserved"
    DECODING = "decoding"
    FAILED = "failed"


_FINAL = {PrefillState.DONE, PrefillState.FAILED, DecodeState.DECODING, DecodeState.FAILED}


@dataclasses.dataclass
class Context:
    """What both sides of every hand-off on this instance share."""

    instance_id: str
    engine: EngineClient
    messenger: Messenger
    clock: Clock
    transports: Transports
    metrics: WorkerMetrics | None = None


class Transports:
    """This instance's open KV transport backends (by protocol), and one writer per decode peer
    through them, dropped after a failure (the next hand-off reopens it).

    A writer is keyed by the peer's id, endpoint and incarnation (new at every start): a peer
    restarted under the same id, whose shm segment has the same name, is never written through the
    old mapping; nor is one whose endpoint no longer leads to the cache the writer opened
    (``KVTransport.current``), when a router's view of the registration is behind. Writers of peers
    that left the live set are closed (:meth:`prune`), so a dead peer's segment is not kept mapped.
    A writer dropped while a write holds it (:meth:`writer`) is closed when that write is done.
    """

    def __init__(self, backends: dict[str, TransportBackend] | None = None) -> None:
        self._open: dict[str, _Writer] = {}
        self.backends: dict[str, TransportBackend] = backends if backends is not None else {}

    def get(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> KVTransport:
        """``transfer`` is the peer's registered TransferInfo."""
        key = (protocol, transfer.get("endpoint"), transfer.get("incarnation"))
        cached = self._open.get(peer_id)
        if cached is not None and cached.key == key and cached.transport.current():
            return cached.transport
        self.drop(peer_id)
        transport = open_writer(self.backends, protocol, key[1])
        self._open[peer_id] = _Writer(key, transport)
        return transport

    @contextlib.contextmanager
    def writer(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> Iterator[KVTransport]:
        """:meth:`get`, held open until the block ends even if it is dropped meanwhile."""
        self.get(protocol, peer_id, transfer)
        held = self._open[peer_id]
        held.users += 1
        try:
            yield held.transport
        finally:
            held.users -= 1
            if held.dropped and not held.users:
                held.transport.close()

    def drop(self, peer_id: str) -> None:
        cached = self._open.pop(peer_id, None)
        if cached is not None:
            cached.dropped = True
            if not cached.users:
                cached.transport.close()

    @property
    def peers(self) -> list[str]:
        """The ids of the peers this instance holds a writer to."""
        return list(self._open)

    def prune(self, departed: Collection[str] = ()) -> list[str]:
        """Close the writers of the ``departed`` peers and those no longer ``current``; their ids."""
        gone = [p for p, w in self._open.items() if p in departed or not w.transport.current()]
        for peer_id in gone:
            log.info("closing the KV writer to %s: the peer is gone or restarted", peer_id)
            self.drop(peer_id)
        return gone

    def close(self) -> None:
        """Close every writer; the backends stay open (:meth:`close_backends`)."""
        for peer_id in list(self._open):
            self.drop(peer_id)

    def close_backends(self) -> None:
        """Close the backends' local sides, before the cache's memory goes."""
        close_backends(self.backends)
        self.backends.clear()


@dataclasses.dataclass
class _Writer:
    """One peer's open writer: what it was opened for, and how many writes hold it now."""

    key: tuple[str, Any, str | None]  # protocol, the peer's endpoint, its incarnation
    transport: KVTransport
    users: int = 0
    dropped: bool = False


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
        if self.state not in (PrefillState.RESERVING, PrefillState.FIRST_TOKEN_READY):
            return  # a repeated answer, or one that comes after the end
        if reply.ok:
            self.dst_blocks, self.num_cached_dst = reply.block_ids, reply.num_cached_blocks
            if self.state is PrefillState.FIRST_TOKEN_READY:
                await self._transfer()
            else:
                self.state = PrefillState.BLOCKS_READY
        elif reply.retry_after_ms is not None and self.ctx.clock.time() < self.info.deadlines.reserve:
            self.retry_at = self.ctx.clock.monotonic() + reply.retry_after_ms / 1000
        else:
            await self._fail(UnavailableError(reply.error or "the decode instance refused"))

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
        if self.ctx.clock.time() > self.info.deadlines.transfer:
            raise TransferError("the KV transfer deadline passed")
        engine = self.ctx.engine
        src = await engine.prefilled_blocks(self.key)
        if len(src) != len(dst_blocks):
            raise TransferError(f"decode reserved {len(dst_blocks)} blocks for {len(src)}")
        skip = self.num_cached_dst  # decode holds these already: only the missing blocks move
        if not 0 <= skip <= len(src):
            raise TransferError(f"decode says it holds {skip} of {len(src)} blocks")
        cache, src_regions = engine.kv_view(), engine.regions(src[skip:])
        dst_regions = engine.regions(dst_blocks[skip:])
        t0 = self.ctx.clock.monotonic()
        moved = 0
        if src_regions:
            with self.ctx.transports.writer(
                self.info.protocol, self.decode_id, self.info.decode.transfer
            ) as w:
                moved = await asyncio.to_thread(w.write_blocks, cache, src_regions, dst_regions)
        seconds = self.ctx.clock.monotonic() - t0
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
        )
        await self.ctx.messenger.send(self.decode_id, msg)

    async def _tell_decode_abort(self, reason: str) -> None:
        abort = Abort(request_id=self.msg.request_id, reason=reason, attempt=self.msg.attempt)
        await self.ctx.messenger.send(self.decode_id, abort)


class DecodeLease:
    def __init__(self, ctx: Context, msg: ReserveBlocks, blocks: list[int], num_cached: int = 0) -> None:
        self.ctx = ctx
        self.msg = msg
        self.key = engine_key(msg.request_id, msg.attempt)
        self.blocks = blocks
        self.num_cached = num_cached  # leading blocks from this instance's prefix cache: not written
        self.expires_at = msg.deadlines.transfer
        self.state = DecodeState.RESERVED

    @property
    def final(self) -> bool:
        return self.state in _FINAL

    async def on_prefilled(self, msg: Prefilled) -> Owner | None:
        """Take the prefilled request over (the owner to serve it for), or free its blocks."""
        if self.state is not DecodeState.RESERVED:
            return None
        if msg.error is not None:
            await self._fail(f"the prefill failed: {msg.error.message}")
            return None
        self.state = DecodeState.DECODING  # before any await: the lease's timer must not free it now
        if self.ctx.metrics is not None:
            written = len(self.blocks) - self.num_cached
            self.ctx.metrics.kv_received.inc(written * self.ctx.engine.facts.block_bytes)
        owner = Owner(self.msg.router_id, msg.request_id, msg.attempt)
        try:  # the engine rebuilds the request's state (a grammar's included) from the first token
            backend = self.ctx.transports.backends.get(msg.protocol or "")
            if backend is not None and len(self.blocks) > self.num_cached:
                regions = self.ctx.engine.regions(self.blocks[self.num_cached :])
                await asyncio.to_thread(backend.land, regions)
            params = self.msg.sampling
            await self.ctx.engine.add_prefilled(
                self.key,
                list(msg.prompt_token_ids),
                msg.first_token,
                params,
                msg.num_cached_tokens,
                background=bool(self.msg.background),
            )
        except Exception as foreign:
            e = foreign if isinstance(foreign, PdserveError) else EngineError(type(foreign).__name__)
            log.warning("%s: could not continue the prefilled request: %s", self.key, e.message)
            await self._fail(e.message)
            await self.ctx.messenger.fail(owner, e)
            return None
        return owner

    async def tick(self) -> None:
        if self.state is DecodeState.RESERVED and self.ctx.clock.time() > self.expires_at:
            log.warning("reservation %s expired without a prefill; freeing its blocks", self.key)
            await self._fail("expired")

    async def abort(self, reason: str) -> None:
        if self.state is DecodeState.RESERVED:
            await self._fail(reason)

    async def _fail(self, reason: str) -> None:
        self.state = DecodeState.FAILED
        await self.ctx.engine.cancel_reservation(self.key)
        log.debug("reservation %s freed: %s", self.key, reason)


class Splitwise:
    """The hand-offs in progress on one instance, by engine key; finished ones leave the tables."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.prefills: dict[str, PrefillHandoff] = {}
        self.leases: dict[str, DecodeLease] = {}

    def __len__(self) -> int:
        return len(self.prefills) + len(self.leases)

    def keys(self) -> set[str]:
        return {*self.prefills, *self.leases}

    def router_ids(self) -> set[str]:
        return {h.owner.router_id for h in self.prefills.values()}

    def _reap(self) -> None:
        """Drop every finished machine (after a sweep over all of them: timers, routers gone)."""
        self.prefills = {k: h for k, h in self.prefills.items() if not h.final}
        self.leases = {k: lease for k, lease in self.leases.items() if not lease.final}

    def _settle(self, key: str) -> None:
        """Drop the machines of ``key`` if they finished (after an event for that request only)."""
        if key in self.prefills and self.prefills[key].final:
            del self.prefills[key]
        if key in self.leases and self.leases[key].final:
            del self.leases[key]

    # ---- prefill side --------------------------------------------------------------------------------
    async def start_prefill(self, msg: GenerateRequest, prepared: Prepared) -> None:
        handoff = PrefillHandoff(self.ctx, msg, prepared)
        self.prefills[handoff.key] = handoff
        await handoff.start()

    async def on_reserve_reply(self, msg: ReserveReply) -> None:
        handoff = self.prefills.get(engine_key(msg.request_id, msg.attempt))
        if handoff is not None:
            await handoff.on_reserve_reply(msg)
            self._settle(handoff.key)

    async def on_output(self, out: RequestOutput) -> bool:
        """Route an engine output to its hand-off; False when it is not one of ours."""
        handoff = self.prefills.get(out.request_id)
        if handoff is None:
            return False
        await handoff.on_output(out)
        self._settle(handoff.key)
        return True

    # ---- decode side ---------------------------------------------------------------------------------
    async def on_reserve(self, msg: ReserveBlocks, accepting: bool) -> None:
        key = engine_key(msg.request_id, msg.attempt)
        reply = ReserveReply(request_id=msg.request_id, ok=False, attempt=msg.attempt)
        lease = self.leases.get(key)
        if lease is not None:  # a repeated ask: answer with what is reserved
            reply.ok, reply.block_ids, reply.num_cached_blocks = True, lease.blocks, lease.num_cached
        elif not accepting:
            reply.error = f"decode instance {self.ctx.instance_id} is draining"
        else:
            try:
                reserved = await self.ctx.engine.try_reserve(key, msg.prompt_token_ids, msg.sampling)
            except Exception as e:  # a foreign error too: prefill hears a refusal, not nothing
                reserved, reply.error = None, str(e) or type(e).__name__
            if reserved is None:
                reply.error = reply.error or (
                    f"decode instance {self.ctx.instance_id} has no {msg.num_tokens}-token room in its KV cache now"
                )
                reply.retry_after_ms = RESERVE_RETRY_MS
            else:
                blocks, cached = reserved
                reply.ok, reply.block_ids, reply.num_cached_blocks = True, blocks, cached
                self.leases[key] = DecodeLease(self.ctx, msg, blocks, cached)
        await self.ctx.messenger.send(msg.reply_to, reply)

    async def on_prefilled(self, msg: Prefilled) -> Owner | None:
        lease = self.leases.get(engine_key(msg.request_id, msg.attempt))
        if lease is None:
            log.warning(
                "prefilled %s/%d arrived without a reservation (expired?)", msg.request_id, msg.attempt
            )
            return None
        owner = await lease.on_prefilled(msg)
        self._settle(lease.key)
        return owner

    # ---- both ------------------------------------------------------------------------------------
    async def fail(self, key: str, error: PdserveError) -> bool:
        """End ``key``'s hand-off after an unexpected error: True when a prefill hand-off told its
        router (a decode reservation is only freed)."""
        told = False
        handoff = self.prefills.get(key)
        if handoff is not None and not handoff.final:
            await handoff._fail(error)
            told = True
        if key in self.leases:
            await self.leases[key].abort(error.message)
        self._settle(key)
        return told

    async def abort(self, key: str, reason: str) -> None:
        if key in self.prefills:
            await self.prefills[key].abort(reason)
        if key in self.leases:
            await self.leases[key].abort(reason)
        self._settle(key)

    async def drop_routers(self, gone: set[str]) -> list[Owner]:
        """Requests of routers that are gone: free them, and tell their decode instances; the
        owners of the hand-offs dropped (the caller tells their routers)."""
        dropped = []
        for handoff in list(self.prefills.values()):
            if handoff.owner.router_id in gone and not handoff.final:
                await handoff.abort("router gone", tell_decode=True)
                dropped.append(handoff.owner)
        self._reap()
        return dropped

    async def tick(self) -> None:
        for handoff in list(self.prefills.values()):
            await handoff.tick()
        for lease in list(self.leases.values()):
            await lease.tick()
        self._reap()

    def take_all(self) -> list[Owner]:
        """Empty the prefill table (shutdown): the owners whose requests were still handing off."""
        owners = [h.owner for h in self.prefills.values() if not h.final]
        self.prefills.clear()
        return owners
