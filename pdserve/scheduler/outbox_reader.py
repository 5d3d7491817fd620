"""A router's side of its outbox: the one task that reads it and hands each delta to the
:class:`DeltaQueue` of its request, and that fails the requests in flight when Redis is lost,
restarted or failed over without their results. What workers write there, and the stream's
bounds, are streams.py's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from redis.exceptions import ConnectionError, ReadOnlyError, RedisError, ResponseError

from pdserve.errors import (
    ControlPlaneError,
    ControlPlaneRestartedError,
    MessageError,
    PdserveError,
    RouterStoppingError,
)
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.lean_redis import bulk, lean_connection, pack, pack_head
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.outbox_messages import ANY_ATTEMPT, RequestDelta, StepOutput
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import (
    REDIS_OUTAGE_S,
    RedisObserver,
    ServerIdentity,
    identity_from_info,
    info_fields,
    require_block_below_timeout,
    require_bytes_responses,
    server_identity,
    server_role,
)
from pdserve.scheduler.streams import FIELD
from pdserve.scheduler.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

_INFO = pack(b"INFO", b"server") + pack(b"INFO", b"replication")
"""The first round trip on each new lean connection: which server it reached (ServerIdentity)."""

_GATE = """local id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
if id == ARGV[1] and ARGV[2] ~= '' then
  local trimmed = redis.pcall('XTRIM', KEYS[1], 'MINID', ARGV[2])
  if type(trimmed) == 'table' and trimmed.err then
    if string.find(trimmed.err, 'READONLY', 1, true) then
      return redis.error_reply('READONLY the server is a replica now')
    end
    return trimmed
  end
end
return id"""
"""Each outbox read through redis-py's pipelines (Sentinel, Cluster), whose retries may reconnect to
another server unseen: the server's ``run_id``, and the trim of what was read (``XTRIM MINID
ARGV[2]``) only when it is ``ARGV[1]``, the server the reader identified. READONLY (a demoted
primary) is passed on as such, for redis-py's Sentinel connections to go and find the new one."""


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
    Redis Cluster or through Sentinel).

    Subscribers never hang on Redis: after ``fail_after_s`` without reaching it, every waiting
    request gets a final, retryable 503 error delta (and so do new ones until Redis is back); if
    Redis comes back with a new ``run_id`` (restarted: events may be lost), so does every request
    in flight. :meth:`stop` ends the remaining requests the same way. However short the restart,
    it is seen: the reader never reads or trims on a server it has not identified (:meth:`_identify`),
    and after another server it reads the outbox again from its start, trimming nothing before.

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
        require_block_below_timeout(redis, block_ms)
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
        self._identified_on: int | None = None
        """The lean connection's generation whose server is ``_identity`` (reads go on it only)."""
        self._gated = True
        """Pipeline reads carry ``_GATE`` (False: EVAL refused here, a trim goes out unchecked)."""
        self._reread = False
        """Another server answers now: read the outbox again from its start, trimming nothing."""
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
                lean = self._lean
                if lean is None or lean.connected != self._identified_on:  # steady state: no call
                    await self._identify(failed=failures > 0)
                if self._reread:  # another server: its ids need not follow the old one's
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

    async def _identify(self, failed: bool) -> None:
        """Know the server the next read reaches before anything is read or trimmed there: the
        client's retries reconnect within seconds, to a restarted or failed-over server too. The
        lean connection's reads go only on the connection identified, and each new one is asked
        who it is first (one round trip per connection, none per read). redis-py's pipelines may
        reconnect inside a read, so those carry ``_GATE`` (:meth:`_read_pipeline`) and the server
        is read again after a failed read (the gate's mismatch included)."""
        if self._identity_forbidden:
            return
        lean = self._lean
        if lean is None:
            if failed or self._identity is None:
                await self._check_restart()
            return
        generation = await lean.connect()
        if generation == self._identified_on:
            return
        server, replication = await lean.execute(_INFO, 2, raise_on_error=False, generation=generation)
        if isinstance(server, ResponseError):
            self._forbidden(server)
            return
        history = {} if isinstance(replication, ResponseError) else info_fields(replication)
        now = identity_from_info(info_fields(server), history)
        if now.role != "master" and self._identity is not None:
            lean.close()  # a demoted primary serves its new primary's older data
            raise ConnectionError(f"Redis answers as a {now.role} (a demoted primary?)")
        await self._check_restart(now)
        self._identified_on = generation

    async def _read(self, last_id: bytes, read_up_to: bytes | None) -> list[tuple[bytes, bytes | None]]:
        """Trim what was read (exact XTRIM MINID) and block for new entries, in one round trip:
        ``(entry id, its message)`` pairs."""
        if self._lean is None:
            return await self._read_pipeline(last_id, read_up_to)
        xread = self._xread + bulk(last_id)
        on = self._identified_on
        if read_up_to is None:
            (reply,) = await self._lean.execute(xread, 1, generation=on)
        else:
            trim = self._xtrim + bulk(_next_id(read_up_to))
            _, reply = await self._lean.execute(trim + xread, 2, generation=on)
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3: {stream: entries}
            (entries,) = reply.values()
        else:
            entries = reply[0][1]
        return [(entry_id, _field(fields)) for entry_id, fields in entries]

    async def _read_pipeline(
        self, last_id: bytes, read_up_to: bytes | None
    ) -> list[tuple[bytes, bytes | None]]:
        """:meth:`_read` through redis-py (a Redis Cluster, Sentinel): the trim goes in ``_GATE``,
        and a read that reached another server than the one identified raises ConnectionError
        (nothing trimmed there; what it read is read again once the server is known)."""
        pipe = self.redis.pipeline(transaction=False)
        identity = self._identity if self._gated and not self._identity_forbidden else None
        if identity is not None:
            minid = _next_id(read_up_to) if read_up_to is not None else b""
            pipe.execute_command("EVAL", _GATE, 1, self.key, identity.run_id, minid)
        elif read_up_to is not None:
            pipe.xtrim(self.key, minid=_next_id(read_up_to), approximate=False)
        pipe.xread({self.key: last_id}, count=self.count, block=self.block_ms)
        replies = await pipe.execute(raise_on_error=False)
        if identity is not None:
            answered = replies[0]
            if isinstance(answered, ResponseError) and not isinstance(answered, ReadOnlyError):
                self._gated = False
                logger.warning(
                    "%s: cannot check Redis's run_id with each read (%s); a restart hidden by the "
                    "client's retries will not be detected",
                    self.key,
                    answered,
                )
            elif not isinstance(answered, Exception) and answered != identity.run_id.encode():
                raise ConnectionError(f"another Redis server answers (run_id {answered!r})")
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        reply = replies[-1]
        return [(entry_id, fields.get(FIELD)) for entry_id, fields in reply[0][1]] if reply else []

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

    async def _check_restart(self, now: ServerIdentity | None = None) -> bool:
        """Whether the primary (``now``, else read through the client) is another server than at
        the last check: restarted (a new ``run_id``; every request in flight then fails with
        ``control_plane_restarted``), or, with ``trust_failover``, a replica a failover promoted
        (nothing fails). Either way the outbox is read again from its start (the new server's ids
        need not follow the old one's). A server answering as a replica is not taken for the primary."""
        if self._identity_forbidden:
            return False
        if now is None:
            try:
                now = await server_identity(self.redis, self.key)
            except ResponseError as e:
                self._forbidden(e)
                return False
        before = self._identity
        if now.role != "master" and before is not None:
            return False  # a demoted primary: its data is its new primary's, not trusted here
        self._identity = now
        if before is None or now.run_id == before.run_id:
            return False
        self.changed_at = self.clock()
        self._reread = True
        if self.trust_failover and now.continues(before):
            self.num_failovers += 1
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

    def _forbidden(self, error: ResponseError) -> None:
        logger.warning("%s: cannot read Redis's run_id (%s); restarts will not be detected", self.key, error)
        self._identity_forbidden = True

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
