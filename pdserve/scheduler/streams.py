"""Request and result streams: each instance's inbox, each router's outbox.

Every entry has one field, ``m``: an encoded message (see messages.py). Bounds, all documented in
docs/design.md's key table ("Redis key schema"):

- inbox: ``XADD MAXLEN ~ INBOX_MAXLEN`` on every send, and acked entries are deleted at once
  (XACK + XDEL), so it holds only unacked work; ``EXPIRE INBOX_TTL_S`` is refreshed by every send
  and by its live reader, so the inbox of an instance gone for good disappears.
- dead letters: ``MAXLEN ~ DEAD_LETTER_MAXLEN``, ``EXPIRE DEAD_LETTER_TTL_S``.
- outbox: ``XADD MAXLEN ~ OUTBOX_MAXLEN`` + ``EXPIRE OUTBOX_TTL_S`` on every publish, and the
  router's reader trims what it has read (``XTRIM MINID``), so it holds only unread events.

``~`` trimming removes whole stream nodes, so a stream may exceed its bound by up to one node
(``stream-node-max-entries``, 100 by default).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import orjson
from redis.exceptions import RedisError, ResponseError
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from pdserve.errors import (
    ControlPlaneError,
    ControlPlaneRestartedError,
    MessageError,
    PdserveError,
    RouterStoppingError,
)
from pdserve.scheduler.connection import (
    NO_WAIT,
    REDIS_OUTAGE_S,
    RedisClient,
    RedisObserver,
    RedisPipeline,
    ReplicaWait,
    ServerIdentity,
    connection_kwargs,
    redis_errors,
    require_bytes_responses,
    server_identity,
    server_role,
)
from pdserve.scheduler.keys import INBOX_GROUP, Keys, validate_id
from pdserve.scheduler.lean_redis import bulk, lean_connection, pack, pack_head
from pdserve.scheduler.messages import (
    ANY_ATTEMPT,
    InboxMessage,
    RequestDelta,
    StepOutput,
    decode_as,
    decode_message,
    encode,
)
from pdserve.scheduler.tasks import cancel_and_wait

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
        _check_block(self.redis, block_ms)
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
    """Publishes engine steps to routers' outboxes: one entry per step per router."""

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

    async def publish(self, router_id: str, step: StepOutput, pipeline: RedisPipeline | None = None) -> None:
        """XADD one step's deltas (MAXLEN ~ trimmed) to a router's outbox and refresh its TTL."""
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        _stage_publish(pipe, self.keys.outbox(router_id), step, self.maxlen, self.ttl_s)
        if pipeline is None:
            await self._execute(pipe, f"publishing to the outbox of router {router_id}")

    async def publish_many(
        self,
        instance_id: str,
        deltas_by_router: Mapping[str, Sequence[RequestDelta]],
        pipeline: RedisPipeline | None = None,
    ) -> None:
        """Publish one step of many routers' requests in one round trip (one entry per router)."""
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=False)
        for router_id, deltas in deltas_by_router.items():
            if deltas:
                step = StepOutput(instance_id=instance_id, items=list(deltas))
                await self.publish(router_id, step, pipeline=pipe)
        if pipeline is None and len(pipe):
            await self._execute(pipe, f"publishing a step to {len(deltas_by_router)} outboxes")

    async def _execute(self, pipe: RedisPipeline, what: str) -> None:
        waits = self.wait.stage(pipe)
        with redis_errors(what):
            results = await pipe.execute()
        if waits:
            self.wait.check(results[-1], what)


def _stage_publish(
    pipe: RedisPipeline, key: str, step: StepOutput, maxlen: int = OUTBOX_MAXLEN, ttl_s: int = OUTBOX_TTL_S
) -> None:
    pipe.xadd(key, {FIELD: encode(step)}, maxlen=maxlen, approximate=True)
    pipe.expire(key, ttl_s)


class DeltaQueue:
    """One request's deltas, in order, for one reader (its generation), stamped as the reader
    receives them from workers (not when the request consumes them): how recently the worker made
    progress, whatever the client's pace. A deque and one waiter: asyncio.Queue's bounds, join and
    many getters cost about ten Python calls per delta that one request never needs."""

    __slots__ = ("_items", "_waiter", "received")

    def __init__(self) -> None:
        self._items: collections.deque[RequestDelta] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.received: dict[int, tuple[float, bool]] = {}
        """attempt -> (time.monotonic() of the latest delta received for it, whether it was final)."""

    def put_nowait(self, delta: RequestDelta) -> None:
        self._items.append(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> RequestDelta:
        """The next delta; IndexError when there is none."""
        return self._items.popleft()

    async def get(self) -> RequestDelta:
        """The next delta, waiting for it (one getter at a time)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class OutboxReader:
    """The one task of a router process that reads its outbox and hands each delta to its request.

    Requests :meth:`subscribe` before their message is sent and read their :class:`DeltaQueue`
    until a final delta (``is_final``). Deltas of unknown requests are dropped (debug log). What
    has been read is trimmed in the same round trip as the next read, which takes everything there
    (up to ``count`` entries) on a dedicated lean connection (lean_redis.py; redis-py's pipeline on a
    Redis Cluster).

    Subscribers never hang on Redis: after ``fail_after_s`` without reaching it, every waiting
    request gets a final, retryable 503 error delta (and so do new ones until Redis is back); if
    Redis comes back with a new ``run_id`` (restarted: events may be lost), so does every request
    in flight. :meth:`stop` ends the remaining requests the same way.

    ``trust_failover`` (``--redis-wait-replicas`` on: every event and message counted as sent is on
    a replica): a new ``run_id`` whose server is a replica promoted from the primary this reader
    knew (:meth:`ServerIdentity.continues`) fails nothing. That server holds every event counted as
    sent, and an event whose publish was not counted is published again by its worker; the reader
    reads the outbox again from its start (an event read from the old primary but not replicated
    comes again, perhaps under a lower id when the hosts' clocks differ), so nothing is skipped, and
    what comes twice is dropped by its request (``RequestDelta.seq``).
    """

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        router_id: str,
        *,
        count: int = 512,
        block_ms: int = 1000,
        fail_after_s: float = REDIS_OUTAGE_S,
        max_backoff_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        observe: RedisObserver | None = None,
        trust_failover: bool = False,
    ) -> None:
        require_bytes_responses(redis)
        _check_block(redis, block_ms)
        self.trust_failover = trust_failover
        self.observe = observe  # op "outbox_read": errors only (reads block)
        self.redis = redis
        self.key = keys.outbox(router_id)
        self.router_id = router_id
        self.count = count
        self.block_ms = block_ms
        self.fail_after_s = fail_after_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.num_dispatched = 0
        self.num_dropped = 0
        self._queues: dict[str, DeltaQueue] = {}
        self._task: asyncio.Task[None] | None = None
        self._down_since: float | None = None
        self._outage_reported = False
        self._identity: ServerIdentity | None = None
        """The primary this reader reads (None: not known yet)."""
        self._identity_forbidden = False  # INFO is forbidden here: no restart detection
        self._reread = False
        """A failover was carried through: read the outbox again from its start, trimming nothing."""
        self.num_failovers = 0
        """Failovers to a promoted replica carried through without failing requests (``trust_failover``)."""
        self.changed_at = float("-inf")
        """``clock()`` when another server was last found answering (restarted or failed over): the
        instances' registrations may have expired meanwhile, so the live set is no evidence for one
        TTL after it (the router's watcher)."""
        self._lean = lean_connection(redis, f"the outbox reader of {router_id}")
        self._xread = pack_head(b"XREAD", b"COUNT", count, b"BLOCK", block_ms, b"STREAMS", self.key)
        """XREAD without its last argument, the id to read after."""
        self._xtrim = pack_head(b"XTRIM", self.key, b"MINID")
        """XTRIM without its last argument, the lowest id to keep."""

    @property
    def healthy(self) -> bool:
        """False while Redis has been unreachable for over ``fail_after_s``, or once the reader died."""
        return not self._outage_reported and self.alive

    @property
    def alive(self) -> bool:
        """False once the reading task ended without :meth:`stop` (a bug: it never returns)."""
        return self._task is None or not self._task.done()

    def subscribe(self, request_id: str) -> DeltaQueue:
        """A queue that receives the request's deltas in order. Raises ValueError if already taken."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight on router {self.router_id}")
        queue = DeltaQueue()
        if self._outage_reported:
            queue.put_nowait(self._outage_delta(request_id))
        else:
            self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        """Stop routing deltas to the request (idempotent); later deltas for it are dropped."""
        self._queues.pop(request_id, None)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"outbox-reader-{self.router_id}")
            self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The reader died: say so loudly, and fail every request now rather than at its deadline
        (new ones too: :meth:`subscribe` answers them with a 503)."""
        if task.cancelled():
            return
        logger.critical(
            "%s: the outbox reader stopped (%r); this router fails every request until restarted",
            self.key,
            task.exception(),
        )
        self._outage_reported = True
        self._fail_all(ControlPlaneError("the router's outbox reader stopped"))

    async def stop(self) -> None:
        """Stop reading; every request still subscribed gets a final retryable error."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._lean is not None:
            self._lean.close()
        self._fail_all(RouterStoppingError("the router is shutting down"))

    async def __aenter__(self) -> OutboxReader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def dispatch(self, data: bytes) -> None:
        """Decode one outbox entry and put each of its deltas into its request's queue."""
        step = decode_as(StepOutput, data)
        queues = self._queues
        now = time.monotonic()  # the clock of the router's stall check
        for delta in step.items:
            queue = queues.get(delta.request_id)
            if queue is None:
                self.num_dropped += 1
                logger.debug(
                    "dropping a delta of unknown request %s from %s", delta.request_id, step.instance_id
                )
                continue
            queue.put_nowait(delta)
            queue.received[delta.attempt] = (now, delta.is_final)
            self.num_dispatched += 1

    async def _run(self) -> None:
        last_id: bytes = b"0-0"
        read_up_to: bytes | None = None
        failures = 0
        while True:
            try:
                if failures or (self._identity is None and not self._identity_forbidden):
                    await self._check_restart()
                if self._reread:  # a failover: the new primary's ids need not follow the old one's
                    self._reread = False
                    last_id, read_up_to = b"0-0", None
                entries = await self._read(last_id, read_up_to)
                read_up_to = None
                self._recovered(failures)
                failures = 0
            except Exception as e:  # RedisError/OSError expected; anything else must not kill the reader
                failures += 1
                if not isinstance(e, (RedisError, OSError)):
                    logger.exception("%s: unexpected error in the outbox reader", self.key)
                if self.observe is not None:
                    self.observe("outbox_read", None, e)
                self._lost(e, failures)
                await asyncio.sleep(min(0.05 * 2**failures, self.max_backoff_s))
                continue
            for entry_id, data in entries:
                last_id = entry_id
                try:
                    if data is None:
                        raise MessageError(f"no {FIELD.decode()!r} field")
                    self.dispatch(data)
                except MessageError as e:
                    logger.error("%s: skipping unreadable entry %s: %s", self.key, entry_id.decode(), e)
            if entries:
                read_up_to = last_id

    async def _read(self, last_id: bytes, read_up_to: bytes | None) -> list[tuple[bytes, bytes | None]]:
        """Trim what was read (exact XTRIM MINID) and block for new entries, in one round trip:
        ``(entry id, its message)`` pairs."""
        if self._lean is None:
            pipe = self.redis.pipeline(transaction=False)
            if read_up_to is not None:
                pipe.xtrim(self.key, minid=_next_id(read_up_to), approximate=False)
            pipe.xread({self.key: last_id}, count=self.count, block=self.block_ms)
            reply = (await pipe.execute())[-1]
            return [(entry_id, fields.get(FIELD)) for entry_id, fields in reply[0][1]] if reply else []
        xread = self._xread + bulk(last_id)
        if read_up_to is None:
            (reply,) = await self._lean.call(xread, 1)
        else:
            trim = self._xtrim + bulk(_next_id(read_up_to))
            _, reply = await self._lean.call(trim + xread, 2)
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3: {stream: entries}
            (entries,) = reply.values()
        else:
            entries = reply[0][1]
        return [(entry_id, _field(fields)) for entry_id, fields in entries]

    async def confirm_primary(self) -> bool:
        """Whether Redis is still the primary this router has been reading: False when the server
        answering is a replica (a primary demoted by a failover answers reads with its new primary's
        older data, from which live instances may be missing), cannot be reached, or has a new
        ``run_id`` (every request in flight is then failed, as by the reader). The watcher asks
        before it takes instances missing from the live set for dead."""
        try:
            role = await server_role(self.redis, self.key)
        except ResponseError:
            role = "master"  # ROLE is forbidden here: the run_id check must do
        except (RedisError, OSError):
            return False
        if role != "master":
            logger.warning(
                "%s: Redis answers as a %s (a demoted primary?); its data is not trusted", self.key, role
            )
            return False
        try:
            return not await self._check_restart()
        except (RedisError, OSError):
            return False

    async def _check_restart(self) -> bool:
        """Whether the primary is another server than at the last check: restarted (a new
        ``run_id``; every request in flight then fails with ``control_plane_restarted``), or, with
        ``trust_failover``, a replica a failover promoted (nothing fails; the outbox is read again
        from its start). A server answering as a replica is not taken for the primary."""
        if self._identity_forbidden:
            return False
        try:
            now = await server_identity(self.redis, self.key)
        except ResponseError as e:
            logger.warning("%s: cannot read Redis's run_id (%s); restarts will not be detected", self.key, e)
            self._identity_forbidden = True
            return False
        before = self._identity
        if now.role != "master" and before is not None:
            return False  # a demoted primary: its data is its new primary's, not trusted here
        self._identity = now
        if before is None or now.run_id == before.run_id:
            return False
        self.changed_at = self.clock()
        if self.trust_failover and now.continues(before):
            self.num_failovers += 1
            self._reread = True
            logger.warning(
                "%s: Redis failed over to a replica of the primary read until now (run_id %s); "
                "%d requests in flight continue, the outbox is read again from its start",
                self.key,
                now.run_id,
                len(self._queues),
            )
            return True
        why = "restarted" if not now.continues(before) else "failed over without --redis-wait-replicas"
        logger.error("Redis %s (run_id changed); failing %d requests in flight", why, len(self._queues))
        self._fail_all(ControlPlaneRestartedError(f"Redis {why}; results in flight may be lost"))
        return True

    def _lost(self, error: BaseException, failures: int) -> None:
        now = self.clock()
        if self._down_since is None:
            self._down_since = now
        down_s = now - self._down_since
        logger.warning(
            "%s: read failed (%s), attempt %d, Redis down for %.1f s", self.key, error, failures, down_s
        )
        if down_s >= self.fail_after_s and not self._outage_reported:
            self._outage_reported = True
            self._fail_all(ControlPlaneError(f"lost contact with Redis for {down_s:.1f} s"))

    def _recovered(self, failures: int) -> None:
        if failures:
            logger.info("%s: Redis reachable again after %d failed reads", self.key, failures)
        self._down_since = None
        self._outage_reported = False

    def _outage_delta(self, request_id: str) -> RequestDelta:
        return RequestDelta.failure(
            request_id, ControlPlaneError("Redis is unreachable"), retryable=True, attempt=ANY_ATTEMPT
        )

    def _fail_all(self, error: PdserveError) -> None:
        queues, self._queues = self._queues, {}
        for request_id, queue in queues.items():
            queue.put_nowait(RequestDelta.failure(request_id, error, retryable=True, attempt=ANY_ATTEMPT))


def _check_block(redis: RedisClient, block_ms: int) -> None:
    """A blocking read must return before the socket timeout, or it fails and is retried blindly."""
    timeout = connection_kwargs(redis).get("socket_timeout")
    if timeout is not None and block_ms / 1000 >= timeout:
        raise ValueError(f"block_ms={block_ms} must stay below the client's socket timeout ({timeout} s)")


def _field(fields: list[bytes] | None) -> bytes | None:
    """The message of a raw stream entry (``[field, value, ...]``; None once deleted)."""
    if fields and fields[0] == FIELD:
        return fields[1]
    values = dict(zip(fields[::2], fields[1::2])) if fields else {}
    return values.get(FIELD)


def _next_id(entry_id: bytes) -> bytes:
    """The smallest stream id greater than ``entry_id`` (XTRIM MINID keeps ids >= its argument)."""
    ms, _, seq = entry_id.partition(b"-")
    return b"%s-%d" % (ms, int(seq or 0) + 1)
