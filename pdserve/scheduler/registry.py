"""Who is alive: TTL registration keys plus a sorted-set index, for instances and routers alike.

A member is alive exactly while its key exists: Redis's TTL decides, not clocks compared across
hosts. The index (id -> expiry in unix ms, by the writer's clock) only lists candidates for one
MGET; ids whose key is gone are pruned from it, atomically and only if their score is past.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

from pdserve.errors import ControlPlaneError, MessageError
from pdserve.scheduler.keys import Keys, Kind
from pdserve.scheduler.messages import decode_as, encode
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import RedisObserver, redis_errors, require_bytes_responses
from pdserve.scheduler.registration import InstanceInfo, RouterInfo
from pdserve.scheduler.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 6.0
"""Registration TTL; heartbeats renew it every ttl/3, so two lost beats in a row are tolerated."""

InfoT = TypeVar("InfoT", InstanceInfo, RouterInfo)

# KEYS[1] = registration key, KEYS[2] = index zset (one slot: the cluster's hash tag);
# ARGV[1] = value, ARGV[2] = TTL (ms), ARGV[3] = expiry (unix ms), ARGV[4] = id.
# A script rather than MULTI: as atomic, one round trip, and native on Redis Cluster (whose asyncio
# client in redis-py runs a MULTI pipeline through a thread and an event loop per queued command).
_REGISTER_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
"""
_DEREGISTER_LUA = """
redis.call('DEL', KEYS[1])
return redis.call('ZREM', KEYS[2], ARGV[1])
"""

# KEYS[1] = index zset; ARGV[1] = now (unix ms); ARGV[2..] = ids whose registration key was missing.
# Removes each id only if its score (expiry) is still in the past, so an id that re-registered
# between our MGET and this call keeps its index entry. Returns the number removed.
_PRUNE_LUA = """
local n = 0
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) <= tonumber(ARGV[1]) then
    n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return n
"""


class Registry(Generic[InfoT]):
    """Registrations of one kind (``instance`` or ``router``) in one cluster."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        kind: Kind,
        model: type[InfoT],
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        require_bytes_responses(redis)
        self.redis = redis
        self.keys = keys
        self.kind = kind
        self.model: type[InfoT] = model
        self.ttl_s = ttl_s
        self.clock = clock
        self._prune = redis.register_script(_PRUNE_LUA)
        self._register = redis.register_script(_REGISTER_LUA)
        self._deregister = redis.register_script(_DEREGISTER_LUA)
        self._unreadable: set[str] = set()

    async def register(self, info: InfoT) -> None:
        """Write the registration (SET PX ttl) and its index score (ZADD), atomically in one round trip."""
        key = self.keys.member(self.kind, info.id)
        expiry_ms = int((self.clock() + self.ttl_s) * 1000)
        with redis_errors(f"registering {self.kind} {info.id}"):
            await self._register(
                keys=[key, self.keys.index(self.kind)],
                args=[encode(info), int(self.ttl_s * 1000), expiry_ms, info.id],
                client=self.redis,
            )

    heartbeat = register  # a heartbeat is a re-registration carrying the current load

    async def deregister(self, member_id: str) -> None:
        """Remove the registration and its index entry (a clean shutdown; no TTL wait)."""
        key = self.keys.member(self.kind, member_id)
        with redis_errors(f"deregistering {self.kind} {member_id}"):
            await self._deregister(
                keys=[key, self.keys.index(self.kind)], args=[member_id], client=self.redis
            )

    async def get(self, member_id: str) -> InfoT | None:
        """The current registration of one member, or None if it is not alive."""
        with redis_errors(f"reading {self.kind} {member_id}"):
            raw = await self.redis.get(self.keys.member(self.kind, member_id))
        return None if raw is None else self._parse(member_id, raw)

    async def alive(self, member_ids: Iterable[str]) -> set[str]:
        """Which of ``member_ids`` are registered now (one pipelined round trip of EXISTS)."""
        ids = list(dict.fromkeys(member_ids))
        if not ids:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for member_id in ids:
            pipe.exists(self.keys.member(self.kind, member_id))
        with redis_errors(f"checking {self.kind} liveness"):
            found = await pipe.execute()
        return {member_id for member_id, n in zip(ids, found, strict=True) if n}

    async def live(self, now: float | None = None) -> list[InfoT]:
        """Every live member, sorted by id: ZRANGE of the index, then ONE MGET of the keys.

        Ids whose key is gone are skipped and pruned from the index when their score is older
        than ``now`` (default: the clock). Values that cannot be read (e.g. a newer schema) are
        skipped with one warning per id.
        """
        index = self.keys.index(self.kind)
        with redis_errors(f"listing live {self.kind}s"):
            members = cast(list[bytes], await self.redis.zrange(index, 0, -1))  # bytes responses
            ids = [raw.decode() for raw in members]
            if not ids:
                return []
            values = await self.redis.mget([self.keys.member(self.kind, i) for i in ids])
            gone: list[str] = [i for i, value in zip(ids, values, strict=True) if value is None]
            if gone:
                now_ms = int((self.clock() if now is None else now) * 1000)
                pruned = await self._prune(keys=[index], args=[now_ms, *gone], client=self.redis)
                logger.debug("pruned %d of %d gone %s ids from the index", pruned, len(gone), self.kind)
        infos = (self._parse(i, value) for i, value in zip(ids, values, strict=True) if value is not None)
        return [info for info in infos if info is not None]

    def _parse(self, member_id: str, raw: bytes | str) -> InfoT | None:
        try:
            info = decode_as(self.model, raw)
        except MessageError as e:
            if member_id not in self._unreadable:
                self._unreadable.add(member_id)
                logger.warning("ignoring %s %s: unreadable registration: %s", self.kind, member_id, e)
            return None
        self._unreadable.discard(member_id)
        return info


class InstanceRegistry(Registry[InstanceInfo]):
    """Inference instances (``pdserve:{<cluster>}:instance:<id>`` + ``…:instances``)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(redis, keys, "instance", InstanceInfo, ttl_s, clock)


class RouterRegistry(Registry[RouterInfo]):
    """Routers (``pdserve:{<cluster>}:router:<id>`` + ``…:routers``); workers drop work of gone ones."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(redis, keys, "router", RouterInfo, ttl_s, clock)


class LiveSetCache(Generic[InfoT]):
    """The live set served from memory, refreshed from Redis at most every ``max_age_s``.

    A value is never older than ``max_age_s`` plus one refresh's duration (its age counts from
    the refresh's start). Concurrent callers share one refresh; a caller cancelled while waiting
    does not cancel it for the others. Redis errors propagate as ControlPlaneError.
    """

    def __init__(
        self,
        registry: Registry[InfoT],
        max_age_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        observe: RedisObserver | None = None,
    ) -> None:
        self.registry: Registry[InfoT] = registry
        self.max_age_s = max_age_s
        self.clock = clock
        self.observe = observe  # op "live_set"
        self._value: list[InfoT] | None = None
        self._fetched_at = float("-inf")
        self._refresh: asyncio.Future[list[InfoT]] | None = None

    @property
    def age_s(self) -> float:
        """Seconds since the cached value's refresh started (``inf`` before the first)."""
        return self.clock() - self._fetched_at

    @property
    def cached(self) -> list[InfoT] | None:
        """The last value read, however old (None before the first read); never reads Redis."""
        return self._value

    async def get(self) -> list[InfoT]:
        """The live set, at most ``max_age_s`` (+ one refresh) old."""
        if self._value is not None and self.age_s < self.max_age_s:
            return self._value
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._fetch())
            self._refresh.add_done_callback(_retrieve)  # no "exception never retrieved" if all left
        return await asyncio.shield(self._refresh)

    def invalidate(self) -> None:
        """Make the next :meth:`get` read Redis (e.g. after a pick failed because a peer vanished)."""
        self._fetched_at = float("-inf")

    async def _fetch(self) -> list[InfoT]:
        started, t0 = self.clock(), time.perf_counter()
        try:
            value = await self.registry.live()
            self._value, self._fetched_at = value, started
            if self.observe is not None:
                self.observe("live_set", time.perf_counter() - t0, None)
            return value
        except Exception as e:
            if self.observe is not None:
                self.observe("live_set", None, e)
            raise
        finally:
            self._refresh = None


class Heartbeat(Generic[InfoT]):
    """Keeps one registration alive: renews it every ttl/3 from ``info()``, deregisters on stop.

    Redis errors are logged and retried with backoff up to one interval (never fatal): the key then
    expires on its own and the next successful beat re-creates it. Use as ``async with Heartbeat(...)``.
    """

    def __init__(
        self,
        registry: Registry[InfoT],
        info: Callable[[], InfoT],
        interval_s: float | None = None,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.registry: Registry[InfoT] = registry
        self.info: Callable[[], InfoT] = info
        self.interval_s = registry.ttl_s / 3 if interval_s is None else interval_s
        self.max_backoff_s = max_backoff_s
        self.last_ok: float | None = None
        """``time.monotonic()`` of the last successful beat."""
        self._task: asyncio.Task[None] | None = None
        self._member_id: str | None = None

    async def start(self) -> None:
        """Register once now (raising ControlPlaneError if that fails), then renew in a task."""
        await self._beat()
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self._member_id}")

    async def stop(self, deregister: bool = True) -> None:
        """Stop renewing; remove the registration now unless ``deregister`` is False."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if deregister and self._member_id is not None:
            try:
                await self.registry.deregister(self._member_id)
            except ControlPlaneError as e:
                logger.warning("could not deregister %s (its key expires by TTL): %s", self._member_id, e)

    async def __aenter__(self) -> Heartbeat[InfoT]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _beat(self) -> None:
        info = self.info()
        self._member_id = info.id
        await self.registry.heartbeat(info)
        self.last_ok = time.monotonic()

    async def _run(self) -> None:
        failures = 0
        while True:
            wait = self.interval_s if failures == 0 else self._backoff(failures)
            due = time.monotonic() + wait
            await asyncio.sleep(wait)
            woke, previous = time.monotonic(), self.last_ok
            try:
                await self._beat()
                if failures:
                    logger.info("heartbeat of %s recovered after %d failures", self._member_id, failures)
                elif previous is not None:
                    self._check_gap(previous, woke - due, time.monotonic() - woke)
                failures = 0
            except ControlPlaneError as e:
                failures += 1
                logger.warning(
                    "heartbeat of %s failed (%s); retry %d in %.1f s",
                    self._member_id,
                    e,
                    failures,
                    self._backoff(failures),
                )
            except Exception:  # a bug in info(): log it, keep beating
                failures += 1
                logger.exception("heartbeat of %s could not build its registration", self._member_id)

    def _check_gap(self, previous: float, late_s: float, write_s: float) -> None:
        """Say so when two beats were more than two intervals apart: the key may have expired
        between them, and routers then took this member for dead. Which of the two held it: the
        event loop (the beat woke ``late_s`` after it was due) or Redis (the write took ``write_s``)."""
        gap = time.monotonic() - previous
        if gap > 2 * self.interval_s:
            logger.warning(
                "heartbeat of %s came %.1f s after the last one (TTL %.1f s): woke %.1f s late "
                "(the event loop was busy), the write took %.1f s",
                self._member_id,
                gap,
                self.registry.ttl_s,
                late_s,
                write_s,
            )

    def _backoff(self, failures: int) -> float:
        """Never longer than a healthy beat's interval: a key lost with a restarted or failed-over
        Redis is back within one interval of Redis answering again (workers wait one TTL of
        missing-ness before they take a router for dead)."""
        return min(0.1 * 2 ** (failures - 1), self.max_backoff_s, self.interval_s)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
