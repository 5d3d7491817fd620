"""Everything an instance sends: step outputs to routers' outboxes, protocol messages to peers' inboxes.

Outbox events go through one ordered buffer: the engine loop posts a step (:meth:`Messenger.post`) and
steps on while it is sent; the steps posted while a publish is on the wire go out together in the
next one, merged into ONE entry per router. A fast engine (sub-millisecond steps) then writes, and
every router reads and relays, a few large entries per request instead of one per token; a slow one
(a model's steps take milliseconds) sends every step alone, as soon as it is done. Every other
event (:meth:`Messenger.publish`) joins the same buffer and waits until it is sent, so events leave
in the order they were made, and a hand-off to a peer follows the tokens it comes after.

A send that Redis fails is retried with backoff (50 ms doubling to 1 s) for up to one
registration TTL, and at least as long as routers wait for an unreachable Redis
(``redis_server.outage_limit_s``: 5 s, plus a Sentinel's failover time with replica waits), so a
Redis blip, restart or Sentinel failover loses no token: the buffer is sent in order once Redis
answers, and while it is failing the engine loop waits for it (no unbounded backlog). Past that
this instance's key has expired, or routers have failed its requests; the send is then logged and
reported as ``False``, never raised into the loops, and the instance keeps serving. With
``--redis-wait-replicas`` a message to a peer waits for the replicas too, as a publish does: a
failover loses none that counted as sent.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.errors import ControlPlaneError, EngineError, PdserveError
from pdserve.scheduler import (
    ErrorInfo,
    InboxMessage,
    Keys,
    LogprobInfo,
    Outbox,
    RequestDelta,
    TopLogprob,
    Usage,
    send_to_inbox,
)
from pdserve.scheduler.redis_client import NO_WAIT, RedisClient, ReplicaWait
from pdserve.scheduler.redis_server import redis_errors

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who gets the outputs of one engine request."""

    router_id: str
    request_id: str
    attempt: int


def engine_key(request_id: str, attempt: int) -> str:
    """Engine-side id: a retried request (new attempt) never collides with its old attempt."""
    return f"{request_id}/{attempt}"


def to_delta(out: RequestOutput, owner: Owner, seq: int) -> RequestDelta:
    """One engine output as the wire event its router reads; ``seq``: its number in the attempt."""
    delta = RequestDelta(
        request_id=owner.request_id, token_ids=out.token_ids, text=out.text, attempt=owner.attempt, seq=seq
    )
    if out.logprobs is not None:
        delta.logprobs = [_logprob(lp) for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        delta.prompt_logprobs = [_logprob(lp) for lp in out.prompt_logprobs]
    if out.finished:
        delta.finish_reason = out.finish_reason
        delta.usage = Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
        )
        if out.error:
            delta.error = ErrorInfo.of(EngineError(out.error))
    return delta


def merge_deltas(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    """One delta of two consecutive ones of a request (what the router would make of the pair):
    tokens, text and logprobs joined; the first's timing, echo and prompt logprobs; the second's end."""
    first.token_ids = first.token_ids + then.token_ids
    first.text += then.text
    if then.logprobs is not None:
        first.logprobs = (first.logprobs or []) + then.logprobs
    first.finish_reason, first.usage, first.error = then.finish_reason, then.usage, then.error
    return first


def _logprob(lp: TokenLogprob) -> LogprobInfo:
    pairs = zip(lp.top_logprobs or [], lp.top_tokens or [])
    top = [TopLogprob(token_id=t, token=text, logprob=v) for (t, v), text in pairs]
    return LogprobInfo(token_id=lp.token_id, token=lp.token, logprob=lp.logprob, top=top, rank=lp.rank)


class Messenger:
    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        instance_id: str,
        give_up_after_s: float = 6.0,
        wait: ReplicaWait = NO_WAIT,
    ) -> None:
        """``give_up_after_s``: how long a failing send is retried (the registration TTL); ``wait``:
        how many replicas must hold a publish before it counts as sent."""
        self.redis = redis
        self.keys = keys
        self.instance_id = instance_id
        self.give_up_after_s = give_up_after_s
        self.wait = wait
        self.outbox = Outbox(redis, keys, wait=wait)
        self.num_send_retries = 0
        self.num_publishes = 0
        self._pending: dict[str, list[RequestDelta]] = {}
        self._pending_sent: asyncio.Future[bool] | None = None
        """Resolves when the events in ``_pending`` are sent."""
        self._in_flight: asyncio.Future[bool] | None = None
        """Resolves when the batch on the wire is sent."""
        self._flusher: asyncio.Task[None] | None = None
        self._failing = False
        self._num_given_up = 0  # batches of the buffer given up (or lost to a bug)
        self._flushed_given_up = 0  # ... as the last flush() saw them

    @property
    def backlogged(self) -> bool:
        """Publishing is failing (being retried): a caller should wait for its events to be sent."""
        return self._failing

    async def _retrying(
        self, what: str, send: Callable[[], Awaitable[object]], publishing: bool = False
    ) -> bool:
        """``send`` until it succeeds (True) or ``give_up_after_s`` passed (False); ``publishing``:
        the outbox buffer's own round trip, which :attr:`backlogged` reports on."""
        give_up_at = time.monotonic() + self.give_up_after_s
        delay = RETRY_FIRST_S
        while True:
            try:
                await send()
            except ControlPlaneError as e:
                if time.monotonic() + delay > give_up_at:
                    log.error("could not %s for %g s, giving up: %s", what, self.give_up_after_s, e)
                    if publishing:
                        self._failing = False
                    return False
                if delay == RETRY_FIRST_S:
                    log.warning("could not %s (%s); retrying until Redis answers", what, e)
                if publishing:
                    self._failing = True
                self.num_send_retries += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
            else:
                if publishing:
                    self._failing = False
                if delay != RETRY_FIRST_S:
                    log.info("sent after retrying: %s", what)
                return True

    def post(self, deltas_by_router: Mapping[str, Sequence[RequestDelta]]) -> asyncio.Future[bool]:
        """Queue one step's events for the next publish (merged with whatever else is queued by
        then) without waiting; the future says whether they were sent."""
        loop = asyncio.get_running_loop()
        if self._pending_sent is None:
            self._pending_sent = loop.create_future()
        sent = self._pending_sent
        for router_id, deltas in deltas_by_router.items():
            if deltas:
                self._pending.setdefault(router_id, []).extend(deltas)
        if not self._pending:  # nothing new: done once what is on the wire is
            self._pending_sent = None
            if self._in_flight is not None:
                return self._in_flight
            sent.set_result(True)
        elif self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush(), name=f"publish-{self.instance_id}")
        return sent

    async def publish(self, deltas_by_router: Mapping[str, Sequence[RequestDelta]]) -> bool:
        """Events, one outbox entry per router, sent after everything posted before them."""
        return await asyncio.shield(self.post(deltas_by_router))

    async def flush(self) -> bool:
        """Until everything posted so far is sent (False: some of it, since the last flush, was
        given up)."""
        ok = await self.publish({})
        ok &= self._num_given_up == self._flushed_given_up
        self._flushed_given_up = self._num_given_up
        return ok

    async def _flush(self) -> None:
        """Send the buffer, one round trip at a time, until it stays empty."""
        while self._pending:
            batch, sent = self._pending, self._pending_sent
            assert sent is not None
            self._pending, self._pending_sent, self._in_flight = {}, None, sent
            ok = False
            try:
                ok = await self._retrying(
                    f"publish to {len(batch)} routers",
                    lambda batch=batch: self.outbox.publish_many(self.instance_id, batch),  # type: ignore[misc]
                    publishing=True,
                )
            except asyncio.CancelledError:  # the loop is closing: nobody will send what is left
                for future in (sent, self._pending_sent):
                    if future is not None and not future.done():
                        future.set_result(False)
                raise
            except Exception:  # a bug (a message that cannot be encoded): these events are lost
                log.exception("publishing %d routers' events failed", len(batch))
            finally:
                self._in_flight = None
            self.num_publishes += 1
            self._num_given_up += not ok
            if not sent.done():
                sent.set_result(ok)

    def close(self) -> None:
        """Close the outbox's dedicated connection (after the last :meth:`flush`)."""
        self.outbox.close()

    async def deliver(self, owner: Owner, *deltas: RequestDelta) -> bool:
        return await self.publish({owner.router_id: list(deltas)})

    async def fail(self, owner: Owner, error: PdserveError, retryable: bool = False) -> bool:
        """The final event of a request that failed here."""
        delta = RequestDelta.failure(owner.request_id, error, retryable=retryable, attempt=owner.attempt)
        return await self.deliver(owner, delta)

    async def fail_many(self, owners: Sequence[tuple[Owner, bool]], error: PdserveError) -> bool:
        """Many final events (``(owner, retryable)``), one round trip."""
        by_router: dict[str, list[RequestDelta]] = collections.defaultdict(list)
        for owner, retryable in owners:
            by_router[owner.router_id].append(
                RequestDelta.failure(owner.request_id, error, retryable=retryable, attempt=owner.attempt)
            )
        return await self.publish(by_router)

    async def send(self, instance_id: str, msg: InboxMessage) -> bool:
        """A protocol message to a peer instance's inbox (then WAIT, with ``--redis-wait-replicas``:
        one that was not replicated is sent again, and the peer drops what comes twice)."""
        what = f"send {msg.type} {msg.request_id} to {instance_id}"

        async def once() -> None:
            pipe = self.redis.pipeline(transaction=False)
            await send_to_inbox(self.redis, self.keys, instance_id, msg, pipeline=pipe)
            waits = self.wait.stage(pipe)
            with redis_errors(what):
                results = await pipe.execute()
            if waits:
                self.wait.check(results[-1], what)

        return await self._retrying(what, once)
