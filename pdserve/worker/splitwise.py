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
    RESERVED ──prefill failed / abort / deadline + grace passed──> FAILED

A write is fenced: D names its incarnation and a lease id in every ``ReserveReply``; P writes only
while the cache its writer reaches is that incarnation's (``KVTransport.fence``, checked before
every chunk and after the last) and its deadline allows the next chunk, and names the lease in
``Prefilled``; D continues a request only on the lease it holds, and frees an unused lease only
:data:`LEASE_GRACE_S` after its deadline (clock skew, and a chunk in flight at the deadline).

Each machine has one way to finish and one way to fail (``_fail``), which frees what it holds
(engine request or blocks, the peer's reservation) and tells whom it concerns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import threading
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

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
LEASE_GRACE_S = 5.0
"""How long after ``deadlines.transfer`` (on its own clock) D still holds an unused lease: P starts
no chunk past the deadline on its clock, so this covers the clocks' skew and one chunk's copy."""
WRITE_CHUNK_BYTES = 64 << 20  # P writes in chunks of whole blocks, checking deadline and fence between
WRITERS_IDLE_S = 10.0  # how long closing the backends waits for copies still running on their threads
T = TypeVar("T")
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
    incarnation: str | None = None  # this start's (TransferInfo.incarnation): named in every reserve reply


class Transports:
    """This instance's open KV transport backends (by protocol), and one writer per decode peer
    through them, dropped after a failure (the next hand-off reopens it).

    A writer is keyed by the peer's id, endpoint and incarnation (new at every start): a peer
    restarted under the same id, whose shm segment has the same name, is never written through the
    old mapping; nor is one whose endpoint no longer leads to the cache the writer opened
    (``KVTransport.current``), when a router's view of the registration is behind. Writers of peers
    that left the live set are closed (:meth:`prune`), so a dead peer's segment is not kept mapped.
    A writer dropped while a write holds it (:meth:`write`, :meth:`writer`) is closed when that
    write is done: by the copy's thread when it returns, even if the coroutine that awaited it was
    cancelled (shutdown), and :meth:`close_backends` waits for running copies first.
    """

    def __init__(self, backends: dict[str, TransportBackend] | None = None) -> None:
        self._open: dict[str, _Writer] = {}
        self.backends: dict[str, TransportBackend] = backends if backends is not None else {}
        self._idle = threading.Condition()  # guards users/dropped; notified when a copy ends
        self._copies = 0  # copies running on their threads
        self._rates: dict[str, float] = {}  # protocol -> bytes/s its recent writes moved at

    def rate(self, protocol: str) -> float | None:
        """Bytes per second writes over ``protocol`` moved lately (None before the first)."""
        return self._rates.get(protocol)

    def observe(self, protocol: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        seen, known = nbytes / seconds, self._rates.get(protocol)
        self._rates[protocol] = seen if known is None else (known + seen) / 2

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
        held = self._hold(protocol, peer_id, transfer)
        try:
            yield held.transport
        finally:
            self._release(held)

    async def write(
        self,
        protocol: str,
        peer_id: str,
        transfer: dict[str, Any],
        copy: Callable[[KVTransport, str | None], T],
    ) -> T:
        """``copy(writer, incarnation it was opened for)`` on a thread, the writer held until the
        copy returns: a cancelled caller (shutdown) stops waiting, the copy does not, and the writer
        closes only after it (:meth:`close_backends` waits for it too)."""
        held = self._hold(protocol, peer_id, transfer)
        with self._idle:
            self._copies += 1

        def run() -> T:
            try:
                return copy(held.transport, held.key[2])
            finally:
                self._release(held, copy_ended=True)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, not logged
            raise

    def _hold(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> _Writer:
        self.get(protocol, peer_id, transfer)
        held = self._open[peer_id]
        with self._idle:
            held.users += 1
        return held

    def _release(self, held: _Writer, copy_ended: bool = False) -> None:
        with self._idle:
            held.users -= 1
            close = held.dropped and not held.users
            if copy_ended:
                self._copies -= 1
            self._idle.notify_all()
        if close:
            held.transport.close()

    def drop(self, peer_id: str) -> None:
        cached = self._open.pop(peer_id, None)
        if cached is not None:
            with self._idle:
                cached.dropped = True
                close = not cached.users
            if close:
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

    def close_backends(self, wait_s: float = WRITERS_IDLE_S) -> None:
        """Close the backends' local sides, before the cache's memory goes: first wait (up to
        ``wait_s``) for copies still running on their threads, which read this cache."""
        with self._idle:
            if not self._idle.wait_for(lambda: not self._copies, timeout=wait_s):
                log.warning("closing the KV transports while %d copies still run", self._copies)
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


class DecodeLease:
    def __init__(self, ctx: Context, msg: ReserveBlocks, blocks: list[int], num_cached: int = 0) -> None:
        self.ctx = ctx
        self.msg = msg
        self.key = engine_key(msg.request_id, msg.attempt)
        self.blocks = blocks
        self.num_cached = num_cached  # leading blocks from this instance's prefix cache: not written
        self.lease_id = uuid.uuid4().hex[:12]  # new for every reservation: Prefilled must name it
        self.expires_at = msg.deadlines.transfer + LEASE_GRACE_S  # a write started in time may land
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
            reply.lease, reply.incarnation = lease.lease_id, self.ctx.incarnation
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
                reply.lease, reply.incarnation = self.leases[key].lease_id, self.ctx.incarnation
        await self.ctx.messenger.send(msg.reply_to, reply)

    async def on_prefilled(self, msg: Prefilled) -> Owner | None:
        """Continue the request on the lease the message names; refuse one this instance does not
        hold (its blocks are not the ones written: a restart, or an expired lease) and tell the
        request's router, so it retries rather than waits."""
        key = engine_key(msg.request_id, msg.attempt)
        lease = self.leases.get(key)
        if lease is not None and (msg.error is not None or msg.lease in (None, lease.lease_id)):
            owner = await lease.on_prefilled(msg)
            self._settle(lease.key)
            return owner
        if lease is None:
            why = "holds no reservation for it (restarted, or the lease expired)"
        else:
            why = f"holds another reservation for it ({lease.lease_id}, not {msg.lease})"
            await lease.abort("prefilled for another reservation")
            self._settle(key)
        if msg.error is not None:
            return None  # the prefill failed and told its router
        log.warning("refusing prefilled %s: this instance %s", key, why)
        if msg.router_id is not None:
            error = TransferError(f"decode instance {self.ctx.instance_id} {why}")
            await self.ctx.messenger.fail(
                Owner(msg.router_id, msg.request_id, msg.attempt), error, retryable=True
            )
        return None

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
