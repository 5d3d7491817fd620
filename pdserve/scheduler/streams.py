"""Request and result streams: each instance's inbox, each router's outbox.

Every entry has one field, ``m``: an encoded message (see messages.py). Bounds, all documented in
docs/design.md's key table ("Redis key schema"):

- inbox: ``XADD MAXLEN ~ INBOX_MAXLEN`` on every send, and acked entries are deleted at once
  (XACK + XDEL), so it holds only unacked work; ``EXPIRE INBOX_TTL_S`` is refreshed by every send
  and by its live reader, so the inbox of an instance gone for good disappears.
- dead letters: ``MAXLEN ~ DEAD_LETTER_MAXLEN``, ``EXPIRE DEAD_LETTER_TTL_S``.
- outbox: ``XADD MAXLEN ~ OUTBOX_MAXLEN`` + ``EXPIRE OUTBOX_TTL_S`` on every publish, and the
  router's reader (outbox_reader.py) trims what it has read (``XTRIM MINID``), so it holds only
  unread events.

``~`` trimming removes whole stream nodes, so a stream may exceed its bound by up to one node
(``stream-node-max-entries``, 100 by default).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import orjson
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from pdserve.errors import MessageError, PdserveError
from pdserve.scheduler.inbox_messages import InboxMessage
from pdserve.scheduler.keys import INBOX_GROUP, Keys, validate_id
from pdserve.scheduler.lean_redis import bulk, lean_connection, pack, pack_head
from pdserve.scheduler.messages import decode_message, encode
from pdserve.scheduler.outbox_messages import ANY_ATTEMPT, RequestDelta, StepOutput
from pdserve.scheduler.redis_client import NO_WAIT, RedisClient, RedisPipeline, ReplicaWait
from pdserve.scheduler.redis_server import redis_errors, require_block_below_timeout, require_bytes_responses

logger = logging.getLogger(__name__)

FIELD = b"m"
"""The one field of every stream entry: the encoded message."""

INBOX_MAXLEN = 10_000
"""Approximate cap of one inbox; far above any sane admission queue, so trimming means a dead reader."""
INBOX_TTL_S = 600
"""An inbox nobody sends to and nobody reads expires after this long."""
OUTBOX_MAXLEN = 10_000
"""Approximate cap of one outbox; reached only while its router is not reading."""
OUTBOX_TTL_S = 600
"""An outbox nobody publishes to expires after this long (its router is gone)."""
DEAD_LETTER_MAXLEN = 1_000
DEAD_LETTER_TTL_S = 86_400
MAX_DELIVERIES = 3
"""Default of ``--max-deliveries``: how often an inbox entry is handed over to be handled before one
whose handling never finished (the worker crashed or was killed each time) is dead-lettered."""

Entry = tuple[bytes, InboxMessage]
"""A stream entry id and its decoded message; ack the id once the message is taken over."""


async def send_to_inbox(
    redis: RedisClient,
    keys: Keys,
    instance_id: str,
    msg: InboxMessage,
    pipeline: RedisPipeline | None = None,
    maxlen: int = INBOX_MAXLEN,
    ttl_s: int = INBOX_TTL_S,
    data: bytes | None = None,
) -> bytes | None:
    """XADD ``msg`` to an instance's inbox (MAXLEN ~ trimmed) and refresh the inbox's TTL.

    ``data``: ``msg`` already encoded. Returns the entry id, or None when the commands were only
    queued on ``pipeline``.
    """
    key = keys.inbox(instance_id)
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=False)
    pipe.xadd(key, {FIELD: encode(msg) if data is None else data}, maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)
    if pipeline is not None:
        return None
    with redis_errors(f"sending {msg.type} {msg.request_id} to instance {instance_id}"):
        entry_id, _ = await pipe.execute()
    return entry_id


def pack_inbox_send(key: str, data: bytes, maxlen: int = INBOX_MAXLEN, ttl_s: int = INBOX_TTL_S) -> bytes:
    """:func:`send_to_inbox`'s two commands, packed for a lean connection (XADD's reply is first)."""
    head, tail = _inbox_frame(key, maxlen, ttl_s)
    return head + bulk(data) + tail


@functools.lru_cache(maxsize=1024)
def _inbox_frame(key: str, maxlen: int, ttl_s: int) -> tuple[bytes, bytes]:
    """What surrounds the message in :func:`pack_inbox_send`, packed once per inbox."""
    return pack_head(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", FIELD), pack(b"EXPIRE", key, ttl_s)


class Inbox:
    """One instance's inbox, read through consumer group ``engine`` as consumer ``consumer``.

    Ack an entry as soon as the engine has taken the message over: entries still pending are
    exactly those a crash would lose, and they are re-read by a restart under the same consumer
    name (``--instance-id``); the inbox of an id that never comes back expires with its TTL.
    Entries that cannot be decoded go to the dead-letter stream (and, when they name a request and a router, that router gets
    an error event), so a bad message is never re-delivered forever. So does an entry already
    delivered ``max_deliveries`` times (Redis counts each delivery): one whose handling crashed the
    worker at every restart. A restart re-reads its pending entries one at a time, each acked before
    the next is read, so only the entry that crashes it counts up, not the batch around it.
    """

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        instance_id: str,
        consumer: str | None = None,
        *,
        ttl_s: int = INBOX_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_deliveries: int = MAX_DELIVERIES,
    ) -> None:
        require_bytes_responses(redis)
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        self.max_deliveries = max_deliveries
        self.redis = redis
        self.keys = keys
        self.instance_id = instance_id
        self.key = keys.inbox(instance_id)
        self.consumer = validate_id(consumer or instance_id, "consumer name")
        self.ttl_s = ttl_s
        self.clock = clock
        self._pending_cursor: bytes | None = b"0-0"  # None once our own backlog has been re-read
        self._touched_at = float("-inf")

    async def ensure_group(self) -> None:
        """Create the stream and its consumer group if missing (from id 0: nothing already queued is lost)."""
        with redis_errors(f"creating the consumer group of {self.key}"):
            try:
                await self.redis.xgroup_create(self.key, INBOX_GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            await self.redis.expire(self.key, self.ttl_s)
        self._touched_at = self.clock()

    async def read(self, count: int = 64, block_ms: int = 1000) -> list[Entry]:
        """Up to ``count`` messages: first this consumer's own pending ones (left by a previous run
        under the same name), then new ones, waiting up to ``block_ms`` (0: do not wait).
        """
        require_block_below_timeout(self.redis, block_ms)
        await self._touch()
        if self._pending_cursor is not None:
            # one at a time (the caller acks it before reading on): see the class's docstring
            entries = await self._xreadgroup(self._pending_cursor, 1, None)
            if entries:
                self._pending_cursor = entries[-1][0]
                return await self._accept(entries, await self._deliveries(entries[0][0]))
            self._pending_cursor = None
        return await self._accept(await self._xreadgroup(">", count, block_ms or None))

    async def ack(self, entry_ids: Iterable[bytes | str], pipeline: RedisPipeline | None = None) -> None:
        """XACK and XDEL the entries (one round trip), so handled work does not accumulate. No MULTI:
        an entry acked but not yet deleted (a crash between) is only trimmed later."""
        ids = list(entry_ids)
        if not ids:
            return
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        pipe.xack(self.key, INBOX_GROUP, *ids)
        pipe.xdel(self.key, *ids)
        if pipeline is None:
            with redis_errors(f"acknowledging {len(ids)} entries of {self.key}"):
                await pipe.execute()

    async def pending(self) -> int:
        """Entries delivered to some consumer of the group but not acked yet."""
        with redis_errors(f"counting pending entries of {self.key}"):
            try:
                summary = await self.redis.xpending(self.key, INBOX_GROUP)
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    return 0
                raise
        return int(summary["pending"])

    async def _xreadgroup(self, start: bytes | str, count: int, block_ms: int | None) -> list[Any]:
        streams: dict[KeyT, StreamIdT] = {self.key: start}
        with redis_errors(f"reading {self.key}"):
            try:
                reply = await self.redis.xreadgroup(
                    INBOX_GROUP, self.consumer, streams, count=count, block=block_ms
                )
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                logger.warning(
                    "%s: stream or group missing (expired or Redis restarted); re-creating", self.key
                )
                await self.ensure_group()
                reply = await self.redis.xreadgroup(
                    INBOX_GROUP, self.consumer, streams, count=count, block=block_ms
                )
        # redis-py's default (legacy, RESP2-shaped) replies: a list of [stream, entries] pairs
        return cast(list[Any], reply)[0][1] if reply else []

    async def _deliveries(self, entry_id: bytes) -> int:
        """How often Redis has delivered the pending entry ``entry_id`` (this read included)."""
        with redis_errors(f"reading the delivery count of {self.key} {entry_id!r}"):
            rows = await self.redis.xpending_range(
                self.key, INBOX_GROUP, min=entry_id, max=entry_id, count=1, consumername=self.consumer
            )
        deliveries = int(rows[0]["times_delivered"]) if rows else 1
        logger.info(
            "%s: re-reading pending entry %s of consumer %s (delivery %d; at most %d)",
            self.key,
            entry_id.decode(),
            self.consumer,
            deliveries,
            self.max_deliveries,
        )
        return deliveries

    async def _touch(self) -> None:
        """Refresh the inbox TTL every ttl/10 while this reader lives (an idle inbox must not expire)."""
        if self.clock() - self._touched_at < self.ttl_s / 10:
            return
        with redis_errors(f"refreshing the TTL of {self.key}"):
            await self.redis.expire(self.key, self.ttl_s)
        self._touched_at = self.clock()

    async def _accept(self, entries: list[tuple[Any, Any]], deliveries: int = 1) -> list[Entry]:
        """The decodable entries; the rest (and, after ``max_deliveries``, every one) dead-lettered."""
        good: list[Entry] = []
        discard: list[bytes] = []
        bad: list[tuple[bytes, bytes, PdserveError]] = []
        for entry_id, fields in entries:
            data = fields.get(FIELD) if fields else None
            if data is None:  # deleted (trimmed) while pending: nothing left to do
                discard.append(entry_id)
                continue
            if deliveries > self.max_deliveries:
                bad.append((entry_id, data, self._undeliverable(deliveries)))
                continue
            try:
                msg = decode_message(data)
                if not isinstance(msg, InboxMessage):
                    raise MessageError(f"a {msg.type!r} message does not belong in an inbox")
            except MessageError as e:
                bad.append((entry_id, data, e))
                continue
            good.append((entry_id, msg))
        if discard or bad:
            await self._dead_letter(discard, bad)
        return good

    def _undeliverable(self, deliveries: int) -> PdserveError:
        return PdserveError(
            f"instance {self.instance_id} never finished handling this request's message: delivered "
            f"{deliveries - 1} times, the instance crashed or was killed each time (--max-deliveries "
            f"{self.max_deliveries}); moved to {self.keys.dead_letters(self.instance_id)}"
        )

    async def _dead_letter(self, discard: list[bytes], bad: list[tuple[bytes, bytes, PdserveError]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        dead_key = self.keys.dead_letters(self.instance_id)
        for entry_id, data, error in bad:
            logger.error("%s: dead-lettering entry %s: %s", self.key, entry_id.decode(), error)
            fields: dict[FieldT, EncodableT] = {FIELD: data, b"error": str(error), b"entry": entry_id}
            pipe.xadd(dead_key, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
            pipe.expire(dead_key, DEAD_LETTER_TTL_S)
            self._stage_rejection(pipe, data, error)
        await self.ack([*discard, *(b[0] for b in bad)], pipeline=pipe)
        with redis_errors(f"dead-lettering entries of {self.key}"):
            await pipe.execute()

    def _stage_rejection(self, pipe: RedisPipeline, data: bytes, error: PdserveError) -> None:
        """Tell the request's router, when the bad message names one, so its client is not left waiting."""
        try:
            raw = orjson.loads(data)
            request_id, router_id = raw["request_id"], raw["router_id"]
            key = self.keys.outbox(router_id)
        except Exception:
            return
        if not isinstance(request_id, str):
            return
        attempt = raw.get("attempt", 0)
        if not isinstance(attempt, int):
            attempt = ANY_ATTEMPT
        delta = RequestDelta.failure(request_id, error, attempt=attempt)
        _stage_publish(pipe, key, StepOutput(instance_id=self.instance_id, items=[delta]))


class Outbox:
    """Publishes engine steps to routers' outboxes: one entry per step per router. On a single Redis
    server a publish goes out pre-packed on a dedicated lean connection (:mod:`lean_redis`, as the
    router's outbox read and inbox sends do): the publish is the worker's one round trip per step,
    and redis-py's pipeline machinery cost it more CPU than the round trip itself."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        maxlen: int = OUTBOX_MAXLEN,
        ttl_s: int = OUTBOX_TTL_S,
        wait: ReplicaWait = NO_WAIT,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.wait = wait
        self._lean = lean_connection(redis, "the outbox publisher")
        """Publishes without a caller's pipeline go out on this (None: redis-py's pipeline)."""

    async def publish(self, router_id: str, step: StepOutput, pipeline: RedisPipeline | None = None) -> None:
        """XADD one step's deltas (MAXLEN ~ trimmed) to a router's outbox and refresh its TTL."""
        if pipeline is None:
            await self._send({router_id: step}, f"publishing to the outbox of router {router_id}")
            return
        _stage_publish(pipeline, self.keys.outbox(router_id), step, self.maxlen, self.ttl_s)

    async def publish_many(
        self,
        instance_id: str,
        deltas_by_router: Mapping[str, Sequence[RequestDelta]],
        pipeline: RedisPipeline | None = None,
    ) -> None:
        """Publish one step of many routers' requests in one round trip (one entry per router)."""
        steps = {
            router_id: StepOutput(instance_id=instance_id, items=list(deltas))
            for router_id, deltas in deltas_by_router.items()
            if deltas
        }
        if pipeline is not None:
            for router_id, step in steps.items():
                _stage_publish(pipeline, self.keys.outbox(router_id), step, self.maxlen, self.ttl_s)
        elif steps:
            await self._send(steps, f"publishing a step to {len(steps)} outboxes")

    async def _send(self, steps: Mapping[str, StepOutput], what: str) -> None:
        """Every step's XADD + EXPIRE (then WAIT, with ``--redis-wait-replicas``) in one round trip;
        the first error reply is raised, as a ControlPlaneError."""
        if self._lean is None:
            pipe = self.redis.pipeline(transaction=False)
            for router_id, step in steps.items():
                _stage_publish(pipe, self.keys.outbox(router_id), step, self.maxlen, self.ttl_s)
            await self._execute(pipe, what)
            return
        commands = [
            pack_outbox_publish(self.keys.outbox(router_id), encode(step), self.maxlen, self.ttl_s)
            for router_id, step in steps.items()
        ]
        waits = bool(self.wait.replicas)
        if waits:
            commands.append(pack(b"WAIT", self.wait.replicas, self.wait.timeout_ms))
        with redis_errors(what):
            results = await self._lean.call(b"".join(commands), 2 * len(steps) + waits)
        if waits:
            self.wait.check(results[-1], what)

    async def _execute(self, pipe: RedisPipeline, what: str) -> None:
        waits = self.wait.stage(pipe)
        with redis_errors(what):
            results = await pipe.execute()
        if waits:
            self.wait.check(results[-1], what)

    def close(self) -> None:
        """Close the dedicated connection (the client's own pool is its owner's to close)."""
        if self._lean is not None:
            self._lean.close()


def pack_outbox_publish(
    key: str, data: bytes, maxlen: int = OUTBOX_MAXLEN, ttl_s: int = OUTBOX_TTL_S
) -> bytes:
    """:func:`_stage_publish`'s two commands, packed for a lean connection (XADD's reply is first)."""
    head, tail = _publish_frame(key, maxlen, ttl_s)
    return head + bulk(data) + tail


@functools.lru_cache(maxsize=1024)
def _publish_frame(key: str, maxlen: int, ttl_s: int) -> tuple[bytes, bytes]:
    """What surrounds the step in :func:`pack_outbox_publish`, packed once per outbox."""
    return pack_head(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", FIELD), pack(b"EXPIRE", key, ttl_s)


def _stage_publish(
    pipe: RedisPipeline, key: str, step: StepOutput, maxlen: int = OUTBOX_MAXLEN, ttl_s: int = OUTBOX_TTL_S
) -> None:
    pipe.xadd(key, {FIELD: encode(step)}, maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)
