"""The splitwise hand-off of one request, as two explicit state machines (docs/design.md, "Request
flow"): the prefill side (:class:`~pdserve.worker.prefill_handoff.PrefillHandoff`) and the decode
side (:class:`~pdserve.worker.decode_lease.DecodeLease`); here, the table of those in progress on
one instance, which routes each message and engine output to its machine.

A write is fenced: D names its incarnation and a lease id in every ``ReserveReply``; P writes only
while the cache its writer reaches is that incarnation's (``KVTransport.fence``, checked before
every chunk and after the last), its deadline allows the next chunk and the request was not
aborted, and names the lease in ``Prefilled``; D continues a request only on the lease it holds.
A lease ends when its writer is done: D frees its blocks when P says no write can still land (its
``Prefilled``, or an ``Abort`` with ``writer_done``), or at a backstop on D's own monotonic clock
(P's transfer budget plus ``decode_lease.LEASE_GRACE_S``), never by comparing wall clocks; a
router's abort only marks the lease aborted. So a block is never handed to another request while a
write into it can still land.

Each machine has one way to finish and one way to fail (``_fail``), which frees what it holds
(engine request or blocks, the peer's reservation) and tells whom it concerns.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.cache_transfer.base import NoLandingRoom
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import PdserveError, TransferError
from pdserve.scheduler import GenerateRequest, Prefilled, ReserveBlocks, ReserveReply
from pdserve.worker.decode_lease import DecodeLease, Landing
from pdserve.worker.engine_client import Prepared
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import Owner, engine_key
from pdserve.worker.prefill_handoff import PrefillHandoff

log = logging.getLogger(__name__)

RESERVE_RETRY_MS = 200  # a decode instance without free blocks asks to be asked again after this


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
    async def start_prefill(self, msg: GenerateRequest, prepared: Prepared, hold: str | None = None) -> None:
        """``hold``: the key of the prefix blocks a peer fetch held for the request."""
        handoff = PrefillHandoff(self.ctx, msg, prepared, on_final=self._settle)
        self.prefills[handoff.key] = handoff
        await handoff.start(hold)

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
        if lease is not None and lease.aborted:
            reply.error = f"the request was aborted on decode instance {self.ctx.instance_id}"
        elif lease is not None:  # a repeated ask: answer with what is reserved
            reply.ok, reply.block_ids, reply.num_cached_blocks = True, lease.blocks, lease.num_cached
            reply.lease, reply.incarnation = lease.lease_id, self.ctx.incarnation
            reply.staging_offset = lease.landing.offset if lease.landing is not None else None
        elif not accepting:
            reply.error = f"decode instance {self.ctx.instance_id} is draining"
        else:
            try:
                reserved = await self.ctx.engine.try_reserve(key, msg.prompt_token_ids, msg.sampling)
            except Exception as e:  # a foreign error too: prefill hears a refusal, not nothing
                reserved, reply.error = None, str(e) or type(e).__name__
            landing: Landing | None = None
            if reserved is not None:
                try:
                    landing = self._landing(msg, len(reserved[0]) - reserved[1])
                except NoLandingRoom as e:
                    await self.ctx.engine.cancel_reservation(key)
                    reserved, reply.error = None, f"decode instance {self.ctx.instance_id}: {e}"
            if reserved is None:
                reply.error = reply.error or (
                    f"decode instance {self.ctx.instance_id} has no {msg.num_tokens}-token room in its KV cache now"
                )
                reply.retry_after_ms = RESERVE_RETRY_MS
            else:
                blocks, cached = reserved
                reply.ok, reply.block_ids, reply.num_cached_blocks = True, blocks, cached
                self.leases[key] = DecodeLease(self.ctx, msg, blocks, cached, landing)
                reply.lease, reply.incarnation = self.leases[key].lease_id, self.ctx.incarnation
                reply.staging_offset = landing.offset if landing is not None else None
        await self.ctx.messenger.send(msg.reply_to, reply)

    def _landing(self, msg: ReserveBlocks, num_blocks: int) -> Landing | None:
        """Room for ``num_blocks`` written blocks in the staging of the transport they come by,
        where it stages them (a GPU cache over Mooncake); None where they land in place."""
        backend = self.ctx.transports.backends.get(msg.protocol or "")
        nbytes = num_blocks * self.ctx.engine.facts.block_bytes
        if backend is None or not nbytes:
            return None
        offset = backend.reserve_landing(nbytes)
        return None if offset is None else Landing(backend, offset, nbytes)

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
        else:  # its writer wrote another reservation: nothing lands in this one
            why = f"holds another reservation for it ({lease.lease_id}, not {msg.lease})"
            await lease.abort("prefilled for another reservation", writer_done=True)
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
    async def fail(self, key: str, error: PdserveError, writer_done: bool = False) -> bool:
        """End ``key``'s hand-off after an unexpected error: True when a prefill hand-off tells its
        router (a decode reservation is freed when ``writer_done``, else only marked aborted: its
        writer may still be writing)."""
        told = False
        handoff = self.prefills.get(key)
        if handoff is not None and not handoff.final:
            await handoff.fail(error)
            told = True
        if key in self.leases:
            await self.leases[key].abort(error.message, writer_done=writer_done)
        self._settle(key)
        return told

    async def abort(self, key: str, reason: str, writer_done: bool = False) -> None:
        """``writer_done``: the abort comes from the request's prefill instance (``Abort.writer_done``)."""
        if key in self.prefills:
            await self.prefills[key].abort(reason)
        if key in self.leases:
            await self.leases[key].abort(reason, writer_done=writer_done)
        self._settle(key)

    async def drop_routers(self, gone: set[str]) -> list[Owner]:
        """Requests of routers that are gone: free them, and tell their decode instances; the
        owners of the hand-offs dropped (the caller tells their routers)."""
        dropped = []
        for handoff in list(self.prefills.values()):
            if handoff.owner.router_id in gone and not handoff.final:
                await handoff.abort("router gone")
                dropped.append(handoff.owner)
        self._reap()
        return dropped

    async def tick(self) -> None:
        for handoff in list(self.prefills.values()):
            await handoff.tick()
        for lease in list(self.leases.values()):
            await lease.tick()
        self._reap()

    async def stop_all(self, reason: str) -> list[Owner]:
        """Shutdown: end every prefill hand-off (a running write stops before its next chunk, and
        is waited for), each decode instance told that no write can still land; the owners of
        those that were still handing off (the caller tells their routers)."""
        live = [h for h in self.prefills.values() if not h.final]
        await asyncio.gather(*(h.abort(reason) for h in live), return_exceptions=True)
        writes = [h.transfer for h in live if h.transfer is not None]
        await asyncio.gather(*writes, return_exceptions=True)
        self.prefills.clear()
        return [h.owner for h in live]
