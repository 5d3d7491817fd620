"""The prefix index: which full KV blocks each instance's prefix cache holds, in Redis for every router.

One set per instance, ``Keys.prefix_index(id)``, of the 16-byte chain hashes of :mod:`pdserve.block_hash`.
Its writer is that instance alone: it applies what its cache gained and lost (one pipeline per
batch of changes, SADD + SREM + PEXPIRE), replaces the whole set when it may have diverged (at
start, after a failed write, when the key vanished with a Redis restart), refreshes the expiry with
its heartbeat and deletes the set when it deregisters. The set's expiry is the registration's TTL,
so an instance that dies takes its entries with it within one TTL; routers read only the sets of
live instances anyway. Its size is bounded by the instance's KV blocks.

An instance has one set per tier (``TIERS``): ``pool``, its prefix cache, and ``host``, the host
tier below it (``--kv-host-bytes``; blocks the pool evicted, which the engine reads back instead of
recomputing), each written the same way from that tier's own record of what it gained and lost
(a block moving from the pool to the host tier leaves one set and joins the other in the same
write).

Below them, a disk tier (``--kv-disk-path``) is shared by the instances of a host that name the same
directory, so its set is one per disk tier, not per instance: ``Keys.prefix_disk(tier_id)``, the
tier id a digest of the host and the namespace directory (``engine.disk_tier.tier_id``; each
instance's registration names the one it reads, ``disk_tier.id``). Every instance sharing it writes
what it stored and removed (SADD/SREM, which commute with the others' writes of other blocks) and
renews the expiry, so the set lives while any of them does; it is replaced in full, from a
listing of the directory, when one of them starts or finds it gone. A clean stop leaves it (the
files stay too).

A router asks, for one request, how many leading blocks of the prompt each candidate holds: one
pipeline of one SMISMEMBER per candidate and tier (an instance's sets share its hash tag; the
instances spread over the shards of a Redis Cluster). The answer is a hint: an entry can be stale by one write, which
costs a cache miss, never a wrong answer (the engine looks blocks up by hash itself).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import redis_errors
from pdserve.scheduler.registry import DEFAULT_TTL_S

log = logging.getLogger(__name__)

TIERS = ("pool", "host")
"""Where an instance holds blocks: its prefix cache (the pool), the host tier below it."""

WRITE_CHUNK = 4096
"""Hashes per SADD/SREM command (a full replacement of a large cache goes in several)."""


class PrefixIndex:
    """Reads and writes the prefix index of one pdserve cluster."""

    def __init__(self, redis: RedisClient, keys: Keys, ttl_s: float = DEFAULT_TTL_S) -> None:
        """``ttl_s``: the writer's registration TTL (the set's expiry); readers need none."""
        self.redis = redis
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))

    # ---- the writer: one instance, its own set -------------------------------------------------------
    async def apply(self, instance_id: str, changes: Mapping[bytes, bool], tier: str = "pool") -> bool:
        """Add the hashes mapped to True and remove those mapped to False; renew the expiry.
        False when the set did not exist before (Redis lost it: replace it in full)."""
        return await self._apply(self.keys.prefix_index(instance_id, tier), changes)

    async def replace(self, instance_id: str, hashes: Sequence[bytes], tier: str = "pool") -> None:
        """Make the set exactly ``hashes``: written under a scratch key on the same slot, then
        RENAMEd over the set, so no router sees it half-written (no MULTI: see the registry)."""
        key = self.keys.prefix_index(instance_id, tier)
        await self._replace(key, self.keys.prefix_index_scratch(instance_id, tier), hashes)

    async def refresh(self, instance_id: str, tier: str = "pool") -> bool:
        """Renew the set's expiry; False when it does not exist (empty, or lost with Redis)."""
        return await self._refresh(self.keys.prefix_index(instance_id, tier))

    async def remove(self, instance_id: str) -> None:
        """Delete the instance's sets, every tier's (not a disk tier's: others share it)."""
        with redis_errors("removing the prefix index"):
            await self.redis.delete(*(self.keys.prefix_index(instance_id, t) for t in TIERS))

    # ---- the writers of a disk tier's set: each instance sharing it ------------------------------------
    async def apply_disk(self, tier_id: str, changes: Mapping[bytes, bool]) -> bool:
        """:meth:`apply` on the disk tier's set (what this instance stored and removed)."""
        return await self._apply(self.keys.prefix_disk(tier_id), changes)

    async def replace_disk(self, tier_id: str, hashes: Sequence[bytes], writer: str) -> None:
        """:meth:`replace` on the disk tier's set (from a listing of its directory)."""
        await self._replace(
            self.keys.prefix_disk(tier_id), self.keys.prefix_disk_scratch(tier_id, writer), hashes
        )

    async def refresh_disk(self, tier_id: str) -> bool:
        """:meth:`refresh` on the disk tier's set."""
        return await self._refresh(self.keys.prefix_disk(tier_id))

    async def _apply(self, key: str, changes: Mapping[bytes, bool]) -> bool:
        added = [h for h, held in changes.items() if held]
        removed = [h for h, held in changes.items() if not held]
        with redis_errors("publishing the prefix index"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.exists(key)
            for i in range(0, len(added), WRITE_CHUNK):
                pipe.sadd(key, *added[i : i + WRITE_CHUNK])
            for i in range(0, len(removed), WRITE_CHUNK):
                pipe.srem(key, *removed[i : i + WRITE_CHUNK])
            pipe.pexpire(key, self.ttl_ms)
            results = await pipe.execute()
        return bool(results[0]) or not changes

    async def _replace(self, key: str, scratch: str, hashes: Sequence[bytes]) -> None:
        with redis_errors("publishing the prefix index"):
            if not hashes:
                await self.redis.delete(key)
                return
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(scratch)
            for i in range(0, len(hashes), WRITE_CHUNK):
                pipe.sadd(scratch, *hashes[i : i + WRITE_CHUNK])
                pipe.pexpire(scratch, self.ttl_ms)  # a writer that dies here leaves nothing for long
            await pipe.execute()
            await self.redis.rename(scratch, key)  # keeps the scratch key's expiry

    async def _refresh(self, key: str) -> bool:
        with redis_errors("refreshing the prefix index"):
            return bool(await self.redis.pexpire(key, self.ttl_ms))

    # ---- the readers: routers, status ----------------------------------------------------------------
    async def cached_blocks(self, instance_ids: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        """For each instance, how many leading blocks of ``hashes`` its cache holds (one round trip)."""
        if not instance_ids or not hashes:
            return dict.fromkeys(instance_ids, 0)
        with redis_errors("reading the prefix index"):
            pipe = self.redis.pipeline(transaction=False)
            for instance_id in instance_ids:
                pipe.smismember(self.keys.prefix_index(instance_id), list(hashes))
            answers = await pipe.execute()
        return {i: _leading(held) for i, held in zip(instance_ids, answers)}

    async def held_blocks(
        self,
        instance_ids: Sequence[str],
        hashes: Sequence[bytes],
        tiered: Sequence[str] = (),
        disks: Mapping[str, str] | None = None,
    ) -> dict[str, tuple[int, int, int]]:
        """For each instance, the leading blocks of ``hashes`` held in its pool; in its pool or host
        tier (the instances in ``tiered``); and in those or its disk tier (``disks``: instance id ->
        disk tier id), each block in any of them. One round trip: one SMISMEMBER per instance and
        tier, one per distinct disk tier."""
        if not instance_ids or not hashes:
            return dict.fromkeys(instance_ids, (0, 0, 0))
        disks = {i: t for i, t in (disks or {}).items() if i in set(instance_ids)}
        with_tier = [i for i in instance_ids if i in set(tiered)]
        disk_ids = sorted(set(disks.values()))
        with redis_errors("reading the prefix index"):
            pipe = self.redis.pipeline(transaction=False)
            for instance_id in instance_ids:
                pipe.smismember(self.keys.prefix_index(instance_id), list(hashes))
            for instance_id in with_tier:
                pipe.smismember(self.keys.prefix_index(instance_id, "host"), list(hashes))
            for tier_id in disk_ids:
                pipe.smismember(self.keys.prefix_disk(tier_id), list(hashes))
            answers = await pipe.execute()
        n, m = len(instance_ids), len(with_tier)
        pools = dict(zip(instance_ids, answers))
        hosts = dict(zip(with_tier, answers[n : n + m]))
        on_disk = dict(zip(disk_ids, answers[n + m :]))
        out = {}
        for i in instance_ids:
            pool = pool_or_host = pools[i]
            if (host := hosts.get(i)) is not None:
                pool_or_host = [bool(p) or bool(h) for p, h in zip(pool, host)]
            anywhere = pool_or_host
            if (disk := on_disk.get(disks.get(i, ""))) is not None:
                anywhere = [bool(p) or bool(d) for p, d in zip(pool_or_host, disk)]
            out[i] = (_leading(pool), _leading(pool_or_host), _leading(anywhere))
        return out

    async def sizes(self, instance_ids: Sequence[str], tier: str = "pool") -> dict[str, int]:
        """Blocks each instance has in one tier's set (``pdserve status``)."""
        if not instance_ids:
            return {}
        with redis_errors("reading the prefix index"):
            pipe = self.redis.pipeline(transaction=False)
            for instance_id in instance_ids:
                pipe.scard(self.keys.prefix_index(instance_id, tier))
            return dict(zip(instance_ids, await pipe.execute()))


def _leading(held: Sequence[int | bool]) -> int:
    """How many of the first entries are true (a cached prefix ends at the first miss)."""
    n = 0
    for h in held:
        if not h:
            break
        n += 1
    return n
