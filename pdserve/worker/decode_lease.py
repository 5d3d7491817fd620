"""The decode side of the splitwise hand-off of one request (overview in splitwise.py): blocks
reserved for a prefill that has not arrived yet, held as a lease::

    RESERVED ──prefilled──> DECODING (an ordinary request of this instance from then on)
    RESERVED ──prefill failed / abort / deadline + grace passed──> FAILED
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid

from pdserve.errors import EngineError, PdserveError
from pdserve.scheduler import Prefilled, ReserveBlocks
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import Owner, engine_key

log = logging.getLogger(__name__)

LEASE_GRACE_S = 5.0
"""How long after ``deadlines.transfer`` (on its own clock) D still holds an unused lease: P starts
no chunk past the deadline on its clock, so this covers the clocks' skew and one chunk's copy."""


class DecodeState(enum.Enum):
    RESERVED = "reserved"
    DECODING = "decoding"
    FAILED = "failed"


_FINAL = {DecodeState.DECODING, DecodeState.FAILED}


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
