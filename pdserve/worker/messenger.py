"""Everything an instance sends: step outputs to routers' outboxes, protocol messages to peers' inboxes.

A Redis failure while sending is logged and reported as ``False``, never raised into the loops:
the request it concerned then ends at its router's deadline, and the instance keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis

from pdserve.errors import ControlPlaneError, EngineError, PdserveError
from pdserve.scheduler import (
    ErrorInfo,
    InboxMessage,
    Keys,
    Outbox,
    RequestDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
    send_to_inbox,
)
from pdserve.worker.outputs import RequestOutput
from pdserve.worker.outputs import TokenLogprob as EngineLogprob

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who gets the outputs of one engine request."""

    router_id: str
    request_id: str
    attempt: int


def engine_key(request_id: str, attempt: int) -> str:
    """Engine-side id: a retried request (new attempt) never collides with its old attempt."""
    return f"{request_id}/{attempt}"


def to_delta(out: RequestOutput, owner: Owner) -> RequestDelta:
    """One engine output as the wire event its router reads."""
    delta = RequestDelta(
        request_id=owner.request_id, token_ids=out.token_ids, text=out.text, attempt=owner.attempt
    )
    if out.logprobs is not None:
        delta.logprobs = [_logprob(lp) for lp in out.logprobs]
    if out.finished:
        delta.finish_reason = out.finish_reason
        delta.usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens)
        if out.error:
            delta.error = ErrorInfo.of(EngineError(out.error))
    return delta


def _logprob(lp: EngineLogprob) -> TokenLogprob:
    pairs = zip(lp.top_logprobs or [], lp.top_tokens or [])
    top = [TopLogprob(token_id=t, token=text, logprob=v) for (t, v), text in pairs]
    return TokenLogprob(token_id=lp.token_id, token=lp.token, logprob=lp.logprob, top=top)


class Messenger:
    def __init__(self, redis: aioredis.Redis, keys: Keys, instance_id: str) -> None:
        self.redis = redis
        self.keys = keys
        self.instance_id = instance_id
        self.outbox = Outbox(redis, keys)

    async def publish(self, deltas_by_router: Mapping[str, Sequence[RequestDelta]]) -> bool:
        """One step's events, one outbox entry per router, in one round trip."""
        if not any(deltas_by_router.values()):
            return True
        try:
            await self.outbox.publish_many(self.instance_id, deltas_by_router)
        except ControlPlaneError as e:
            log.error("could not publish a step to %d routers: %s", len(deltas_by_router), e)
            return False
        return True

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
        try:
            await send_to_inbox(self.redis, self.keys, instance_id, msg)
        except ControlPlaneError as e:
            log.error("could not send %s %s to %s: %s", msg.type, msg.request_id, instance_id, e)
            return False
        return True
