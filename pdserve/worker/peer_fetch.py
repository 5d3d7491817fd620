"""Peer fetch, the fetcher's side (docs/design.md, "Peer fetch"): before this instance computes a
prompt, it takes the prefix blocks a peer holds (the router's ``GenerateRequest.fetch``) instead of
computing them, with the fencing, lease and checksums of a splitwise hand-off::

    reserve (own prefix held, fresh blocks for the rest) ── FetchBlocks ──> the holder writes them
    FetchedBlocks ──> land, check the digests ──> adopt them into the prefix cache ──> admit the request

The holder is the writer (fetch_server.py), into blocks this instance reserved: fenced to this
incarnation, digested as it reads them. This side waits at most the fetch's budget for the answer;
whatever goes wrong (a refusal, no answer in time, blocks that differ from the writer's digests, a
peer that no longer holds them) is a miss: the request is admitted without them and computes them,
so a fetch never changes a token, only when it comes. The reserved blocks stay leased until the
holder says no write of the fetch can land (its ``FetchedBlocks``, of any kind) or the lease's
backstop passes (the budget on this instance's monotonic clock plus ``LEASE_GRACE_S``), as a decode
instance's lease does: a block is never handed to another request while a write into it can land.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
import uuid

from pdserve.cache_transfer import checksum
from pdserve.cache_transfer.base import NoLandingRoom
from pdserve.engine.rates import RateMeter
from pdserve.scheduler import FetchBlocks, FetchedBlocks, FetchHint, FetchInfo, GenerateRequest, PeerInfo
from pdserve.worker.decode_lease import LEASE_GRACE_S, Landing
from pdserve.worker.engine_client import Prepared
from pdserve.worker.fetch_server import FetchServer, namespace
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import engine_key

log = logging.getLogger(__name__)

FETCH_BUDGET_S = 2.0
"""The longest a fetch may take before the request computes its blocks instead (and at most half
the time the request has left): on a CPU a prefix worth fetching takes seconds to compute."""
FETCH_BUDGET_MIN_S = 0.5
"""The shortest budget a fetch gets (messages through Redis, a loaded host's event loops)."""
FETCH_BUDGET_SLACK = 2.0
"""A fetch's budget is this many times what the router expected it to take (``FetchHint.expect_s``)."""
REPLY_GRACE_S = 0.5
"""How long past its budget the fetcher waits for the holder's answer (the message's delay), at
most half the budget."""


def fetch_budget(expect_s: float | None, recompute_s: float | None, left_s: float) -> float:
    """How long a fetch may take before its request computes the blocks instead: what the router
    expected (``expect_s``, the holder's step in progress included) with slack, at most what
    computing them here takes (``recompute_s``, by this engine's measured prefill rate: waiting
    longer cannot pay off), never below ``FETCH_BUDGET_MIN_S``, and at most ``FETCH_BUDGET_S`` and
    half the time the request has left (``left_s``). Unknown terms are left out. A fetch that times
    out therefore costs its request at most this plus the reply grace (half of it) over computing
    at once."""
    target = min(
        FETCH_BUDGET_SLACK * expect_s if expect_s is not None else FETCH_BUDGET_S,
        recompute_s if recompute_s is not None else FETCH_BUDGET_S,
    )
    return min(FETCH_BUDGET_S, max(0.0, left_s / 2), max(FETCH_BUDGET_MIN_S, target))


def reply_grace(budget: float) -> float:
    """How long past ``budget`` the fetcher waits for the holder's answer."""
    return min(REPLY_GRACE_S, budget / 2)


@dataclasses.dataclass
class FetchLease:
    """Blocks reserved for one fetch, held until the holder's answer or the backstop."""

    key: str
    lease_id: str
    holder: str
    num_blocks: int
    backstop_at: float
    landing: Landing | None = None
    answer: asyncio.Future[FetchedBlocks] | None = None
    """Set while the request waits for the answer; None once it stopped waiting."""


class PeerFetch:
    """This instance's fetches in progress (as fetcher) and the fetches it serves (as holder)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.info = FetchInfo()
        """Its counters (the registration's ``fetch``): as fetcher and as holder."""
        self.rate = RateMeter()
        """Seconds per block of its recent fetches, from asking to checked (``rates.fetch_s_per_block``)."""
        self.leases: dict[str, FetchLease] = {}
        self.server = FetchServer(ctx, self.info)

    async def handle(self, msg: FetchBlocks | FetchedBlocks) -> None:
        if isinstance(msg, FetchBlocks):
            self.server.serve(msg)
        else:
            await self.on_fetched(msg)

    @property
    def touched(self) -> bool:
        """Something was fetched or served since the start (the registration shows the counters)."""
        return bool(self.info.fetches or self.info.served)

    # ---- the fetcher ---------------------------------------------------------------------------------
    async def before_admit(self, msg: GenerateRequest, prepared: Prepared) -> str | None:
        """Fetch the prefix ``msg.fetch`` names, if it is worth it here: the key of the blocks held
        for the request (its own prefix and what arrived, checked), which the engine gives it at
        admission; None when nothing is held. Never raises for a fetch that fails: a miss."""
        hint, ctx = msg.fetch, self.ctx
        if hint is None or hint.peer.id == ctx.instance_id or not ctx.engine.facts.prefix_caching:
            return None
        key = f"{engine_key(msg.request_id, msg.attempt)}#fetch"
        try:
            hashes, blocks = await ctx.engine.reserve_fetch(
                key, prepared.prompt_ids, prepared.params, hint.blocks
            )
        except Exception:
            log.exception("%s: could not reserve blocks to fetch into", key)
            return None
        if hashes:
            rate = ctx.engine.load.prefill_s_per_token  # this engine's, for the recompute it replaces
            recompute = len(hashes) * ctx.engine.facts.block_size * rate if rate else None
            budget = fetch_budget(hint.expect_s, recompute, msg.deadline - ctx.clock.time())
            try:
                await self._fetch(key, hint, hashes, blocks, budget)
            except Exception as e:  # the ask not sent (Redis): its lease waits for the backstop
                self._missed(len(hashes), "refused", f"the fetch failed ({type(e).__name__}: {e})")
        return key

    async def _fetch(
        self, key: str, hint: FetchHint, hashes: list[bytes], blocks: list[int], budget: float
    ) -> None:
        ctx, started = self.ctx, time.perf_counter()  # the rate's own timer; the lease's is ctx.clock
        self.info.fetches += 1
        endpoint = self._endpoint(hint.protocol)
        try:
            landing = self._landing(hint.protocol, len(blocks)) if endpoint is not None else None
        except NoLandingRoom:
            endpoint = None
        if endpoint is None:
            await ctx.engine.cancel_fetch(key)
            return self._missed(len(hashes), "refused", f"no {hint.protocol} endpoint or landing room here")
        backstop = ctx.clock.monotonic() + budget + LEASE_GRACE_S
        lease = FetchLease(key, uuid.uuid4().hex[:12], hint.peer.id, len(blocks), backstop)
        lease.landing = landing
        lease.answer = asyncio.get_running_loop().create_future()
        self.leases[key] = lease
        ask = FetchBlocks(
            request_id=key,
            reply_to=ctx.instance_id,
            fetcher=PeerInfo(
                id=ctx.instance_id, host="", transfer={"endpoint": endpoint, "incarnation": ctx.incarnation}
            ),
            protocol=hint.protocol,
            block_hashes=base64.b64encode(b"".join(hashes)).decode(),
            block_ids=blocks,
            lease=lease.lease_id,
            incarnation=ctx.incarnation,
            budget_s=budget,
            namespace=namespace(ctx.engine),
            staging_offset=lease.landing.offset if lease.landing is not None else None,
        )
        try:
            await ctx.messenger.send(hint.peer.id, ask)
            answer = await asyncio.wait_for(asyncio.shield(lease.answer), budget + reply_grace(budget))
        except TimeoutError:
            lease.answer = None  # the blocks stay leased until the holder answers, or the backstop
            return self._missed(len(hashes), "timeout", f"{hint.peer.id} did not answer in {budget:.1f} s")
        except BaseException:
            lease.answer = None  # cancelled (shutdown), or the ask could not be sent: the lease waits
            raise
        del self.leases[key]
        await self._take(lease, answer, hashes, blocks, started)

    async def _take(
        self, lease: FetchLease, answer: FetchedBlocks, hashes: list[bytes], blocks: list[int], started: float
    ) -> None:
        """The holder answered: land and check what it wrote, adopt it (or free it all)."""
        ctx, key = self.ctx, lease.key
        n = max(0, min(answer.num_blocks, lease.num_blocks))
        try:
            if answer.error is not None or not n:
                raise _Miss("refused", answer.error or f"{lease.holder} holds none of the blocks now")
            written = blocks[:n]
            if lease.landing is not None:
                await asyncio.to_thread(
                    lease.landing.backend.land, ctx.engine.regions(written), lease.landing.offset
                )
            await self._check(answer, written, lease.holder)
        except _Miss as miss:
            await ctx.engine.cancel_fetch(key)
            self._release_landing(lease)
            return self._missed(len(hashes), miss.outcome, miss.why)
        self._release_landing(lease)
        adopted = await ctx.engine.adopt_fetched(key, n)
        self.info.hits += adopted
        self.info.misses += len(hashes) - adopted
        self.rate.add(time.perf_counter() - started, adopted)
        if ctx.metrics is not None:
            ctx.metrics.on_peer_fetch("ok", fetched=adopted, missed=len(hashes) - adopted)
        log.debug("%s: %d of %d blocks fetched from %s", key, adopted, len(hashes), lease.holder)

    async def _check(self, answer: FetchedBlocks, written: list[int], holder: str) -> None:
        """A _Miss unless the written blocks here match the writer's digests (when both sides
        check: ``--kv-checksum``)."""
        ctx = self.ctx
        if not ctx.kv_checksum or answer.kv_digests is None or answer.kv_digest_algo not in checksum.ALGOS:
            return
        expected = checksum.decode(answer.kv_digests, len(written))
        view, block_bytes = ctx.engine.kv_view(), ctx.engine.facts.block_bytes
        found = await asyncio.to_thread(
            checksum.block_digests, view, written, block_bytes, answer.kv_digest_algo
        )
        bad = checksum.first_mismatch(expected, found)
        if bad is not None:
            self.info.mismatches += 1
            log.error(
                "KV checksum mismatch: fetch %s from %s into %s: block %d of the %d written differs from "
                "what its writer read; not using it (the request computes them)",
                answer.request_id,
                holder,
                ctx.instance_id,
                bad,
                len(written),
            )
            raise _Miss("mismatch", f"block {bad} of {len(written)} differs from the writer's digest")

    def _missed(self, num_blocks: int, outcome: str, why: str) -> None:
        """A fetch that brought nothing: its blocks are computed."""
        self.info.misses += num_blocks
        self.info.failed += 1
        if self.ctx.metrics is not None:
            self.ctx.metrics.on_peer_fetch(outcome, fetched=0, missed=num_blocks)
        log.info("peer fetch missed (%s): %s; computing %d blocks", outcome, why, num_blocks)

    def _endpoint(self, protocol: str) -> dict[str, object] | None:
        """Where a peer writes into this cache (its backends' endpoints), None without ``protocol``'s."""
        endpoints = {p: e for p, b in self.ctx.transports.backends.items() if (e := b.endpoint()) is not None}
        return endpoints if protocol in endpoints else None

    def _landing(self, protocol: str, num_blocks: int) -> Landing | None:
        """Room in the staging of a transport that stages this cache (None: the blocks land in
        place; ``NoLandingRoom``: none now)."""
        backend = self.ctx.transports.backends.get(protocol)
        nbytes = num_blocks * self.ctx.engine.facts.block_bytes
        if backend is None or not nbytes:
            return None
        offset = backend.reserve_landing(nbytes)
        return None if offset is None else Landing(backend, offset, nbytes)

    @staticmethod
    def _release_landing(lease: FetchLease) -> None:
        landing, lease.landing = lease.landing, None
        if landing is not None:
            landing.backend.release_landing(landing.offset, landing.nbytes)

    async def on_fetched(self, msg: FetchedBlocks) -> None:
        """The holder's answer: to the request waiting for it, or (it stopped waiting) the lease's
        end: no write of the fetch can land any more, its blocks are freed."""
        lease = self.leases.get(msg.request_id)
        if lease is None or lease.lease_id != msg.lease:
            log.debug(
                "ignoring an answer to fetch %s: not waiting for it (lease %s)", msg.request_id, msg.lease
            )
            return
        if lease.answer is not None and not lease.answer.done():
            lease.answer.set_result(msg)
            return
        await self._free(lease, "its holder answered after the request stopped waiting")

    async def _free(self, lease: FetchLease, why: str) -> None:
        self.leases.pop(lease.key, None)
        await self.ctx.engine.cancel_fetch(lease.key)
        self._release_landing(lease)
        log.debug("fetch %s's blocks freed: %s", lease.key, why)

    async def tick(self) -> None:
        """Free the leases no request waits for whose backstop passed (their holder never answered)."""
        now = self.ctx.clock.monotonic()
        for lease in list(self.leases.values()):
            if lease.answer is None and now > lease.backstop_at:
                log.warning(
                    "fetch %s from %s reached its backstop without an answer; freeing its blocks",
                    lease.key,
                    lease.holder,
                )
                await self._free(lease, "backstop")

    async def stop_all(self) -> None:
        """Shutdown: the writes this instance runs for peers stop before their next chunk (each peer
        told), and are waited for."""
        await self.server.stop_all()


class _Miss(Exception):
    def __init__(self, outcome: str, why: str) -> None:
        super().__init__(why)
        self.outcome, self.why = outcome, why
