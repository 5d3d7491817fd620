"""The decode side of the splitwise hand-off of one request (overview in splitwise.py): blocks
reserved for a prefill that has not arrived yet, held as a lease::

    RESERVED ──prefilled, digests match──> DECODING (an ordinary request of this instance from then on)
    RESERVED ──router's abort──> ABORTED (blocks still held: the prefill may be writing into them)
    RESERVED, ABORTED ──writer done (prefilled of any kind, abort from the prefill), backstop──> FAILED
    RESERVED ──prefilled whose blocks differ from the writer's digests──> FAILED (router told, retryable)

Blocks are freed only when no write into them can still land: the prefill side says so, or the
backstop passes. The backstop is this instance's monotonic clock from the moment it read the
reservation, plus the transfer budget the prefill side sent as a duration, plus
:data:`LEASE_GRACE_S`: no wall clocks are compared across hosts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import uuid

from pdserve.cache_transfer import checksum
from pdserve.cache_transfer.base import TransportBackend
from pdserve.errors import EngineError, KVChecksumError, PdserveError, TransferError
from pdserve.scheduler import Prefilled, ReserveBlocks
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import Owner, engine_key

log = logging.getLogger(__name__)

LEASE_GRACE_S = 5.0
"""How long past the prefill side's transfer budget a lease is held when its writer has not said it
is done: the prefill starts no chunk past its deadline, so this covers one chunk's copy (a few
milliseconds over shared memory) and the message's delay. A dead prefill's lease is freed then."""


@dataclasses.dataclass(frozen=True)
class Landing:
    """Where a staged transport has the written blocks land first (``TransportBackend.reserve_landing``):
    held with the lease, given back when the blocks have landed or the lease is freed."""

    backend: TransportBackend
    offset: int
    nbytes: int


class DecodeState(enum.Enum):
    RESERVED = "reserved"
    ABORTED = "aborted"  # the request is over, its writer may not be: the blocks wait for it
    DECODING = "decoding"
    FAILED = "failed"


_FINAL = {DecodeState.DECODING, DecodeState.FAILED}


class DecodeLease:
    def __init__(
        self,
        ctx: Context,
        msg: ReserveBlocks,
        blocks: list[int],
        num_cached: int = 0,
        landing: Landing | None = None,
    ) -> None:
        self.ctx = ctx
        self.landing = landing
        self.msg = msg
        self.key = engine_key(msg.request_id, msg.attempt)
        self.blocks = blocks
        self.num_cached = num_cached  # leading blocks from this instance's prefix cache: not written
        self.lease_id = uuid.uuid4().hex[:12]  # new for every reservation: Prefilled must name it
        budget = msg.transfer_budget_s
        if budget is None:  # an older prefill: its deadline, on this host's wall clock
            budget = msg.deadlines.transfer - ctx.clock.time()
        self.backstop_at = ctx.clock.monotonic() + max(0.0, budget) + LEASE_GRACE_S
        self.state = DecodeState.RESERVED

    @property
    def final(self) -> bool:
        return self.state in _FINAL

    @property
    def aborted(self) -> bool:
        return self.state is DecodeState.ABORTED

    async def on_prefilled(self, msg: Prefilled) -> Owner | None:
        """Take the prefilled request over (the owner to serve it for), or free its blocks."""
        if self.state is DecodeState.ABORTED:  # its writer is done now
            await self._free("aborted before its prefill arrived")
            return None
        if self.state is not DecodeState.RESERVED:
            return None
        if msg.error is not None:
            await self._free(f"the prefill failed: {msg.error.message}")
            return None
        self.state = DecodeState.DECODING  # before any await: the lease's timer must not free it now
        written = self.blocks[self.num_cached :]
        if self.ctx.metrics is not None:
            self.ctx.metrics.kv_received.inc(len(written) * self.ctx.engine.facts.block_bytes)
        owner = Owner(self.msg.router_id, msg.request_id, msg.attempt)
        try:  # the engine rebuilds the request's state (a grammar's included) from the first token
            backend = self.ctx.transports.backends.get(msg.protocol or "")
            if backend is not None and written:
                at = self.landing.offset if self.landing is not None else None
                await asyncio.to_thread(backend.land, self.ctx.engine.regions(written), at)
            self._release_landing()  # landed (or never used): its writer is done
            if written:
                await self._check(msg, written)
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
            await self._free(e.message)
            await self.ctx.messenger.fail(owner, e, retryable=isinstance(e, TransferError))
            return None
        return owner

    async def _check(self, msg: Prefilled, written: list[int]) -> None:
        """Before anything decodes from the written blocks or caches them: their digests here
        against the writer's (a KVChecksumError naming the first bad block when they differ)."""
        ctx = self.ctx
        outcome = "unchecked"
        try:
            if not ctx.kv_checksum or msg.kv_digests is None or msg.kv_digest_algo not in checksum.ALGOS:
                return
            expected = checksum.decode(msg.kv_digests, len(written))
            view, block_bytes = ctx.engine.kv_view(), ctx.engine.facts.block_bytes
            found = await asyncio.to_thread(
                checksum.block_digests, view, written, block_bytes, msg.kv_digest_algo
            )
            ctx.integrity.kv_checked += 1
            bad = checksum.first_mismatch(expected, found)
            if bad is None:
                outcome = "ok"
                self._corrupt_after_check(written)
                return
            outcome = "mismatch"
            ctx.integrity.kv_mismatches += 1
            writer = self.msg.reply_to
            log.error(
                "KV checksum mismatch: request %s attempt %d, written by %s into %s over %s: block %d "
                "of the %d written (block %d here) differs from what its writer read; not decoding it",
                msg.request_id,
                msg.attempt,
                writer,
                ctx.instance_id,
                msg.protocol or "?",
                bad,
                len(written),
                written[bad],
            )
            raise KVChecksumError(
                f"the KV cache that {ctx.instance_id} received from {writer} differs from what was "
                f"written (block {bad} of {len(written)}); nothing was decoded from it"
            )
        finally:
            if ctx.metrics is not None:
                ctx.metrics.on_kv_check(outcome)

    def _corrupt_after_check(self, written: list[int]) -> None:
        """The test hook ``kv_corrupt_after_check``: one checked block takes another's bytes (the
        null block's, when only one was written), as an engine bug past the checksum would."""
        faults = self.ctx.faults
        if not faults.fires(faults.kv_corrupt_after_check):
            return
        i = faults.rng.randrange(len(written))
        other = written[(i + 1) % len(written)] if len(written) > 1 else 0
        view, n = self.ctx.engine.kv_view(), self.ctx.engine.facts.block_bytes
        view[written[i] * n : (written[i] + 1) * n] = view[other * n : (other + 1) * n]
        log.warning("TEST FAULT: block %d of %s overwritten after its check", written[i], self.key)

    async def tick(self) -> None:
        held = self.state in (DecodeState.RESERVED, DecodeState.ABORTED)
        if held and self.ctx.clock.monotonic() > self.backstop_at:
            log.warning(
                "reservation %s (%s) reached its backstop without word from its writer %s; freeing its blocks",
                self.key,
                self.state.value,
                self.msg.reply_to,
            )
            await self._free("backstop")

    async def abort(self, reason: str, writer_done: bool = False) -> None:
        """``writer_done``: the prefill side says no write can still land (else: a router's abort,
        which keeps the blocks until it does, or until the backstop)."""
        if self.state is DecodeState.RESERVED and not writer_done:
            self.state = DecodeState.ABORTED
            log.debug("reservation %s aborted (%s); its blocks wait for the writer", self.key, reason)
        elif self.state in (DecodeState.RESERVED, DecodeState.ABORTED):
            await self._free(reason)

    async def _free(self, reason: str) -> None:
        self.state = DecodeState.FAILED
        await self.ctx.engine.cancel_reservation(self.key)
        self._release_landing()
        log.debug("reservation %s freed: %s", self.key, reason)

    def _release_landing(self) -> None:
        landing, self.landing = self.landing, None
        if landing is not None:
            landing.backend.release_landing(landing.offset, landing.nbytes)
