"""What each owner (a tenant: a digest of its API key, ``router.http.tenants``) holds in the Batch API,
kept per owner: its listing indexes, what it uses (files, their bytes, batches in flight) and the
quotas that bound it.

Every key of one owner has the owner as its hash tag (``Keys.owner_files`` and friends), so each
script here stays on one Redis Cluster slot, and a listing reads its owner's index only: its cost
does not grow with other owners' data (one index for everyone made every listing read past every
other owner's files and batches). A file's bytes are counted when the file is stored (uploads and
a batch's output files alike) and forgotten when it is deleted or expires: its expiry is kept
beside its size, and each read of the usage first forgets the files whose expiry passed. Forgetting
deletes only (HDEL, ZREM), so it works in a Redis at its ``maxmemory``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

from pdserve.errors import QuotaExceededError
from pdserve.scheduler.keys import ANONYMOUS_OWNER, Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import MemoryRoom, redis_errors

logger = logging.getLogger(__name__)

DEFAULT_QUOTA_FILES = 10000
"""Files one owner may hold (the most ``GET /v1/files`` lists at once)."""
DEFAULT_QUOTA_BATCHES = 100
"""Batches one owner may have in flight (not final)."""
AUTO_BYTES_SHARE = 4
"""With ``--quota-bytes auto``, one owner may hold a quarter of what Redis may hold for batch data."""
PAGE = 256
"""Ids read per round trip while a listing pages through an owner's index."""

# KEYS[1] an index zset; ARGV[1] the id to start after ('' from the start), ARGV[2] how many,
# ARGV[3] '1' newest first. The ids after ARGV[1] (none if it is not in the index).
_PAGE = """
local start = 0
local newest = ARGV[3] == '1'
if ARGV[1] ~= '' then
  local rank
  if newest then rank = redis.call('ZREVRANK', KEYS[1], ARGV[1]) else rank = redis.call('ZRANK', KEYS[1], ARGV[1]) end
  if not rank then return {} end
  start = rank + 1
end
local stop = start + tonumber(ARGV[2]) - 1
if newest then return redis.call('ZREVRANGE', KEYS[1], start, stop) end
return redis.call('ZRANGE', KEYS[1], start, stop)
"""

# KEYS[1] files index, KEYS[2] expiry zset, KEYS[3] sizes hash; ARGV[1] file id, ARGV[2] creation
# ms, ARGV[3] expiry (unix s), ARGV[4] size. 1 if counted now, 0 if it was already.
_ADD_FILE = """
if redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[4]) == 0 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""

# KEYS as _ADD_FILE's, KEYS[4] the active batches set; ARGV[1] unix s: files whose expiry is at or
# before it are forgotten first ('' none), ARGV[2..] more file ids to forget (deleted, or found
# gone). Returns {files, bytes, batches in flight} after that. Deletes only: works at maxmemory.
_USAGE = """
local gone = {}
if ARGV[1] ~= '' then gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 1000) end
for i = 2, #ARGV do gone[#gone + 1] = ARGV[i] end
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
local bytes = 0
for _, size in ipairs(redis.call('HVALS', KEYS[3])) do bytes = bytes + tonumber(size) end
return {redis.call('ZCARD', KEYS[1]), bytes, redis.call('SCARD', KEYS[4])}
"""

# KEYS[1] the owner's active batches set; ARGV[1] batch id, ARGV[2] the most in flight (0: no
# limit). -1 when the batch is added; else how many are in flight already.
_ADMIT_BATCH = """
local limit = tonumber(ARGV[2])
local n = redis.call('SCARD', KEYS[1])
if limit > 0 and n >= limit and redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return n end
redis.call('SADD', KEYS[1], ARGV[1])
return -1
"""


@dataclasses.dataclass(frozen=True)
class Quotas:
    """What one owner may hold (``--quota-files``, ``--quota-bytes``, ``--quota-batches``); 0: no
    limit. ``bytes`` None is ``auto``: a quarter of what Redis may hold for batch data (its
    ``maxmemory`` less the serving reserve) when the bytes are kept in Redis and it has a
    ``maxmemory``, else no limit."""

    files: int = DEFAULT_QUOTA_FILES
    bytes: int | None = None
    batches: int = DEFAULT_QUOTA_BATCHES

    def bytes_limit(self, room: MemoryRoom | None) -> int:
        """The bytes limit (0: none) given the memory room of the Redis holding the bytes (None:
        no ``maxmemory``, or the bytes are not in Redis)."""
        if self.bytes is not None:
            return self.bytes
        if room is None or room.maxmemory <= room.reserve:  # no room for batch data: the 507 says so
            return 0
        return max(1, (room.maxmemory - room.reserve) // AUTO_BYTES_SHARE)


@dataclasses.dataclass(frozen=True)
class OwnerUsage:
    """What one owner holds now."""

    owner: str
    files: int
    bytes: int
    batches: int
    """Batches in flight (not final; one whose end was not recorded yet still counts)."""


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def owner_name(owner: str) -> str:
    """An owner as keys and ``pdserve status`` name it (its digest; ``anonymous`` for "")."""
    return owner or ANONYMOUS_OWNER


class OwnerIndex:
    """The per-owner keys of the Batch API: listing indexes, usage and quota checks."""

    def __init__(self, redis: RedisClient, keys: Keys, quotas: Quotas | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.quotas = quotas or Quotas()
        self._page = redis.register_script(_PAGE)
        self._add_file = redis.register_script(_ADD_FILE)
        self._usage = redis.register_script(_USAGE)
        self._admit = redis.register_script(_ADMIT_BATCH)

    def _file_keys(self, owner: str) -> list[str]:
        k = self.keys
        return [k.owner_files(owner), k.owner_file_expiry(owner), k.owner_file_sizes(owner)]

    # ---- listings ----------------------------------------------------------------------------------
    async def page(self, index: str, after: str | None, count: int, newest_first: bool = True) -> list[str]:
        """Up to ``count`` ids of the index zset ``index`` after the id ``after`` (a listing's
        cursor; an unknown one: none), in creation order (newest first by default). One round trip,
        whatever else the index or other owners' indexes hold."""
        with redis_errors("listing"):
            raw = await self._page(keys=[index], args=[after or "", count, "1" if newest_first else "0"])
        return [i.decode() for i in cast(list[bytes], raw)]

    # ---- files ---------------------------------------------------------------------------------------
    async def add_file(self, owner: str, file_id: str, size: int, created_ms: float, expires_at: int) -> None:
        """Index a stored file and count its bytes (once, however often this is called)."""
        with redis_errors("counting a file"):
            await self.redis.sadd(self.keys.owners, owner_name(owner))
            await self._add_file(
                keys=self._file_keys(owner), args=[file_id, int(created_ms), int(expires_at), size]
            )

    async def file_expires(self, owner: str, file_id: str, expires_at: int) -> None:
        """A file's expiry moved (a batch holds it longer): it is counted until then."""
        with redis_errors("counting a file"):
            await self.redis.zadd(self.keys.owner_file_expiry(owner), {file_id: expires_at}, xx=True)

    async def usage(self, owner: str, forget: list[str] | tuple[str, ...] = ()) -> OwnerUsage:
        """``owner``'s usage, once the files whose expiry passed and ``forget`` (files deleted or
        found gone) are forgotten."""
        keys = [*self._file_keys(owner), self.keys.owner_active(owner)]
        with redis_errors("reading an owner's usage"):
            files, size, batches = await self._usage(keys=keys, args=[int(time.time()), *forget])
        return OwnerUsage(owner, int(files), int(size), int(batches))

    async def forget_files(self, owner: str, file_ids: list[str]) -> None:
        """Files deleted or found gone: no longer listed nor counted."""
        if file_ids:
            await self.usage(owner, file_ids)

    async def check_upload(self, owner: str, room: MemoryRoom | None) -> tuple[OwnerUsage, int]:
        """Before an upload: QuotaExceededError when ``owner`` holds its files quota, or its bytes
        quota; ``(usage, bytes limit)`` otherwise (0: no limit), for :meth:`check_bytes` per piece."""
        usage = await self.usage(owner)
        limit = self.quotas.bytes_limit(room)
        if self.quotas.files and usage.files >= self.quotas.files:
            raise QuotaExceededError(
                f"this API key holds {usage.files} files, its quota (--quota-files {self.quotas.files}); "
                "delete files (DELETE /v1/files/{id}) or wait for them to expire before uploading more",
                "file",
            )
        self.check_bytes(usage, limit, 0)
        return usage, limit

    def check_bytes(self, usage: OwnerUsage, limit: int, adding: int) -> None:
        """QuotaExceededError when ``usage`` plus ``adding`` bytes (an upload so far) is over ``limit``."""
        if limit and usage.bytes + adding > limit:
            what = f"with this upload's {_size(adding)} so far, past" if adding else "as much as"
            raise QuotaExceededError(
                f"this API key's files hold {_size(usage.bytes)} (uploads and batch outputs), {what} "
                f"its quota of {_size(limit)} (--quota-bytes); delete files (DELETE /v1/files/{{id}}) "
                "or wait for them to expire",
                "file",
            )

    # ---- batches -------------------------------------------------------------------------------------
    async def admit_batch(
        self, owner: str, batch_id: str, still_active: Callable[[list[str]], Awaitable[set[str]]]
    ) -> None:
        """Count ``batch_id`` in flight for ``owner``, or raise QuotaExceededError when it has its
        quota of batches in flight. Before refusing, batches that ended (their end not recorded
        here: a crash between the two writes) are dropped, as ``still_active`` tells."""
        keys, limit = [self.keys.owner_active(owner)], self.quotas.batches
        with redis_errors("counting a batch"):
            await self.redis.sadd(self.keys.owners, owner_name(owner))
            held = await self._admit(keys=keys, args=[batch_id, limit])
            if held != -1:
                members = [m.decode() for m in cast(set[bytes], await self.redis.smembers(keys[0]))]
                ended = set(members) - await still_active(members)
                if ended:
                    await self.redis.srem(keys[0], *ended)
                    held = await self._admit(keys=keys, args=[batch_id, limit])
        if held != -1:
            raise QuotaExceededError(
                f"this API key has {held} batches in flight, its quota (--quota-batches {limit}); wait "
                "for one to end, or cancel one (POST /v1/batches/{id}/cancel)",
                "input_file_id",
            )

    async def batch_ended(self, owner: str, batch_id: str) -> None:
        with redis_errors("counting a batch"):
            await self.redis.srem(self.keys.owner_active(owner), batch_id)

    async def owners(self) -> list[str]:
        """Every owner that has stored a file or made a batch ("" for the one without an API key)."""
        with redis_errors("listing owners"):
            raw = cast(set[bytes], await self.redis.smembers(self.keys.owners))
        return sorted("" if m == ANONYMOUS_OWNER.encode() else m.decode() for m in raw)
