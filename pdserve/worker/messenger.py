"""Everything an instance sends: step outputs to routers' outboxes, protocol messages to peers' inboxes.

A send that Redis fails is retried with backoff (50 ms doubling to 1 s) for up to one
registration TTL, so a Redis blip or restart loses no token: each step's sends complete, in order,
before the next step's. Past one TTL this instance's key has expired, so routers have moved or
failed its requests; the send is then logged and reported as ``False``, never raised into the
loops, and the instance keeps serving.
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
from pdserve.scheduler.connection import NO_WAIT, RedisClient, ReplicaWait

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
        self.outbox = Outbox(redis, keys, wait=wait)
        self.num_send_retries = 0

    async def _retrying(self, what: str, send: Callable[[], Awaitable[object]]) -> bool:
        give_up_at = time.monotonic() + self.give_up_after_s
        delay = RETRY_FIRST_S
        while True:
            try:
                await send()
            except ControlPlaneError as e:
                if time.monotonic() + delay > give_up_at:
                    log.error("could not %s for %g s, giving up: %s", what, self.give_up_after_s, e)
                    return False
                if delay == RETRY_FIRST_S:
                    log.warning("could not %s (%s); retrying until Redis answers", what, e)
                self.num_send_retries += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
            else:
                if delay != RETRY_FIRST_S:
                    log.info("sent after retrying: %s", what)
                return True

    async def publish(self, deltas_by_router: Mapping[str, Sequence[RequestDelta]]) -> bool:
        """One step's events, one outbox entry per router, in one round trip."""
        if not any(deltas_by_router.values()):
            return True
        return await self._retrying(
            f"publish a step to {len(deltas_by_router)} routers",
            lambda: self.outbox.publish_many(self.instance_id, deltas_by_router),
        )

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
        """A protocol message to a peer instance's inbox."""
        return await self._retrying(
            f"send {msg.type} {msg.request_id} to {instance_id}",
            lambda: send_to_inbox(self.redis, self.keys, instance_id, msg),
        )
