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

A router asks, for one request, how many leading blocks of the prompt each candidate holds: one
pipeline of one SMISMEMBER per candidate and tier (an instance's sets share its hash tag; the
instances spread over the shards of a Redis Cluster). The answer is a hint: an entry can be stale by one write, which
costs a cache miss, never a wrong answer (the engine looks blocks up by hash itself).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pdserve.scheduler.connection import redis_errors
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_settings import RedisClient
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
        key = self.keys.prefix_index(instance_id, tier)
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

    async def replace(self, instance_id: str, hashes: Sequence[bytes], tier: str = "pool") -> None:
        """Make the set exactly ``hashes``: written under a scratch key on the same slot, then
        RENAMEd over the set, so no router sees it half-written (no MULTI: see the registry)."""
        key = self.keys.prefix_index(instance_id, tier)
        with redis_errors("publishing the prefix index"):
            if not hashes:
                await self.redis.delete(key)
                return
            scratch = self.keys.prefix_index_scratch(instance_id, tier)
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(scratch)
            for i in range(0, len(hashes), WRITE_CHUNK):
                pipe.sadd(scratch, *hashes[i : i + WRITE_CHUNK])
                pipe.pexpire(scratch, self.ttl_ms)  # a writer that dies here leaves nothing for long
            await pipe.execute()
            await self.redis.rename(scratch, key)  # keeps the scratch key's expiry

    async def refresh(self, instance_id: str, tier: str = "pool") -> bool:
        """Renew the set's expiry; False when it does not exist (empty, or lost with Redis)."""
        with redis_errors("refreshing the prefix index"):
            return bool(await self.redis.pexpire(self.keys.prefix_index(instance_id, tier), self.ttl_ms))

    async def remove(self, instance_id: str) -> None:
        """Delete the instance's sets, every tier's."""
        with redis_errors("removing the prefix index"):
            await self.redis.delete(*(self.keys.prefix_index(instance_id, t) for t in TIERS))

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

    async def tiered_blocks(
        self, instance_ids: Sequence[str], hashes: Sequence[bytes], tiered: Sequence[str] = ()
    ) -> dict[str, tuple[int, int]]:
        """For each instance, how many leading blocks of ``hashes`` its pool holds, and how many it
        holds in its pool or (for the instances in ``tiered``, which have one) its host tier, each
        block in either (one round trip)."""
        if not instance_ids or not hashes:
            return dict.fromkeys(instance_ids, (0, 0))
        with_tier = [i for i in instance_ids if i in set(tiered)]
        with redis_errors("reading the prefix index"):
            pipe = self.redis.pipeline(transaction=False)
            for instance_id in instance_ids:
                pipe.smismember(self.keys.prefix_index(instance_id), list(hashes))
            for instance_id in with_tier:
                pipe.smismember(self.keys.prefix_index(instance_id, "host"), list(hashes))
            answers = await pipe.execute()
        pools = dict(zip(instance_ids, answers))
        hosts = dict(zip(with_tier, answers[len(instance_ids) :]))
        out = {}
        for i in instance_ids:
            pool = pools[i]
            host = hosts.get(i)
            either = pool if host is None else [bool(p) or bool(h) for p, h in zip(pool, host)]
            out[i] = (_leading(pool), _leading(either))
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
