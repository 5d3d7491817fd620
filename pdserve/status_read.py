"""``pdserve status``, reading: the live set, the routers, the stream depths, the batches and the
planner's last decision, read from Redis into one plain dict (what ``--json`` prints, and what the
table and the ``--watch`` view draw)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.batchstore.batches import BatchObject, BatchStore
from pdserve.batchstore.owners import owner_name
from pdserve.errors import NotFoundError
from pdserve.scheduler import (
    InstanceInfo,
    InstanceRegistry,
    Keys,
    PrefixIndex,
    RedisSettings,
    RouterRegistry,
    wait_for_redis,
)
from pdserve.scheduler.keys import INBOX_GROUP
from pdserve.status_roles import last_plan, role_history

RECENT_BATCHES = 5
"""How many final batches the status shows (the newest), besides every active one."""


async def collect(redis_url: str, cluster: str) -> dict[str, Any]:
    redis = RedisSettings.from_url(redis_url).connect()
    queue = batch_queue(redis_url, cluster)
    try:
        await wait_for_redis(redis, timeout_s=5)
        return await read(redis, cluster, queue)
    finally:
        await redis.aclose()
        if queue is not None:
            queue.connection.close()


def batch_queue(redis_url: str, cluster: str) -> BatchQueue | None:
    """The rq queue of batch jobs, whose depth the status shows; None on a Redis Cluster, where rq
    (so the Batch API) does not run."""
    settings = RedisSettings.from_url(redis_url)
    if settings.mode == "cluster":
        return None
    return BatchQueue(settings.connect_sync(), Keys(cluster))


async def read(redis: Any, cluster: str, queue: BatchQueue | None = None) -> dict[str, Any]:
    """The status from one connected client (``collect`` without the connection); the batch queue's
    depth is None without ``queue``."""
    keys = Keys(cluster)
    instances = await InstanceRegistry(redis, keys).live()
    routers = await RouterRegistry(redis, keys).live()
    pipe = redis.pipeline(transaction=False)
    for i in instances:
        pipe.xlen(keys.inbox(i.id))
        pipe.pttl(keys.instance(i.id))
        pipe.xlen(keys.dead_letters(i.id))
    for r in routers:
        pipe.xlen(keys.outbox(r.id))
    replies = await pipe.execute()
    indexed = await PrefixIndex(redis, keys).sizes([i.id for i in instances])
    pending = []
    for i in instances:
        try:
            pending.append(int((await redis.xpending(keys.inbox(i.id), INBOX_GROUP))["pending"]))
        except Exception:
            pending.append(0)
    now = time.time()
    out_instances = []
    for n, i in enumerate(instances):
        out_instances.append(
            {
                "id": i.id,
                "role": i.role,
                "model": i.model,
                "weights": i.kv.weights or "f32",
                "weights_digest": i.kv.weights_digest,
                "tokenizer": i.tokenizer,
                "device": i.kv.device,
                "device_name": i.kv.device_name,
                "dtype": i.kv.dtype,
                "memory_bytes": i.kv.memory_bytes,
                "host": i.host,
                "pid": i.pid,
                "running": i.load.running,
                "waiting": i.load.waiting,
                "handing_off": i.load.handing_off,
                "waiting_prefill_tokens": i.load.waiting_prefill_tokens,
                "free_blocks": i.kv.free_blocks,
                "num_blocks": i.kv.num_blocks,
                "prefix_index_blocks": indexed.get(i.id, 0) if i.kv.prefix_caching else None,
                "draining": i.draining,
                "age_s": round(now - i.started_at, 1),
                "ttl_ms": replies[3 * n + 1],
                "inbox_len": replies[3 * n],
                "inbox_pending": pending[n],
                "inbox_dead": replies[3 * n + 2],
                "kv_checked": i.integrity.kv_checked if i.integrity else 0,
                "kv_mismatches": i.integrity.kv_mismatches if i.integrity else 0,
                "tier": i.tier.model_dump() if i.tier else None,
                "disk_tier": i.disk_tier.model_dump() if i.disk_tier else None,
                "pool": i.pool.model_dump() if i.pool else None,
                "rates": i.rates.model_dump() if i.rates else None,
                "cpu": i.cpu.model_dump() if i.cpu else None,
                "fetch": i.fetch.model_dump() if i.fetch else None,
                "role_history": role_history(i),
            }
        )
    base = 3 * len(instances)
    out_routers = [
        {
            "id": r.id,
            "host": r.host,
            "port": r.port,
            "pid": r.pid,
            "age_s": round(now - r.started_at, 1),
            "outbox_len": replies[base + n],
            "verify": r.verify.model_dump() if r.verify else None,
        }
        for n, r in enumerate(routers)
    ]
    return {
        "cluster": cluster,
        "instances": out_instances,
        "routers": out_routers,
        "plan": await last_plan(redis, keys),
        "batches": await read_batches(redis, keys, queue),
    }


async def read_batches(redis: Any, keys: Keys, queue: BatchQueue | None) -> dict[str, Any]:
    """Every active batch and the newest final ones, newest first, and what each owner (API key
    digest) holds: files, their bytes, batches in flight."""
    store = BatchStore(redis, keys)
    active_ids = set(await store.active())
    active: list[BatchObject] = []
    recent: list[BatchObject] = []
    for batch_id in sorted(active_ids):
        try:
            active.append(await store.get(batch_id))
        except NotFoundError:  # gone between the two reads
            continue
    usage = []
    for owner in await store.owners.owners():  # each owner's newest final batches, then the newest of all
        usage.append(await store.owners.usage(owner))
        found, after = 0, None
        while found < RECENT_BATCHES:
            page, more = await store.list_batches(after, 50, owner)
            finals = [b for b in page if b.final and b.id not in active_ids][: RECENT_BATCHES - found]
            recent += finals
            found += len(finals)
            if not more:
                break
            after = page[-1].id
    recent = sorted(recent, key=lambda b: b.created_at, reverse=True)[:RECENT_BATCHES]  # stable: index order
    active.sort(key=lambda b: b.created_at, reverse=True)
    depth = None if queue is None else await asyncio.to_thread(queue.depth)
    return {
        "queue_depth": depth,
        "active": [_batch(b) for b in active if not b.final],
        "recent": [_batch(b) for b in recent],
        "usage": [
            {"owner": owner_name(u.owner), "files": u.files, "bytes": u.bytes, "batches": u.batches}
            for u in usage
        ],
    }


def _batch(b: BatchObject) -> dict[str, Any]:
    counts = b.request_counts
    return {
        "id": b.id,
        "status": b.status,
        "endpoint": b.endpoint,
        "request_counts": {"completed": counts.completed, "failed": counts.failed, "total": counts.total},
        "created_at": b.created_at,
    }


async def registration(redis_url: str, cluster: str, instance_id: str) -> InstanceInfo | None:
    """One instance's live registration (a health check reads this one key, not the whole cluster)."""
    redis = RedisSettings.from_url(redis_url).connect()
    try:
        await wait_for_redis(redis, timeout_s=5)
        return await InstanceRegistry(redis, Keys(cluster)).get(instance_id)
    finally:
        await redis.aclose()
