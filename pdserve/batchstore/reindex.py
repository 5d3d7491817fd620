"""Files and batches made before each owner had its own indexes were listed in one index of
everyone's (``Keys.files``, ``Keys.batches``). A router starting moves what those list into each
owner's index, counting the files in their owner's usage, once: it claims an old index by renaming
it (one router wins the rename), works through it a page at a time, and deletes it. A router that
dies meanwhile leaves the claimed index for the next one to finish (counting a file twice is
harmless: :meth:`OwnerIndex.add_file` counts a file once)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import cast

import orjson
from redis.exceptions import ResponseError

from pdserve.batchstore.batches import FINAL_STATUSES
from pdserve.batchstore.file_object import DEFAULT_FILE_TTL_S
from pdserve.batchstore.owners import PAGE, OwnerIndex, owner_name
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import redis_errors

logger = logging.getLogger(__name__)


async def reindex(redis: RedisClient, keys: Keys) -> int:
    """Move the old shared indexes' entries into their owners' indexes; how many were moved."""
    owners = OwnerIndex(redis, keys)
    moved = 0
    for legacy, kind in ((keys.files, "file"), (keys.batches, "batch")):
        claimed = f"{legacy}:reindexing"  # the same slot: the registry's hash tag
        with redis_errors("claiming an old index"):
            with contextlib.suppress(ResponseError):  # no such key: none (left), or another router's
                await redis.renamenx(legacy, claimed)  # a claim left unfinished goes first
            if not await redis.exists(claimed):
                continue
        while True:
            with redis_errors("moving an old index"):
                page = cast(
                    list[tuple[bytes, float]], await redis.zrange(claimed, 0, PAGE - 1, withscores=True)
                )
                if not page:
                    await redis.delete(claimed)
                    break
                pipe = redis.pipeline(transaction=False)
                for raw_id, _ in page:
                    pipe.get(keys.file(raw_id.decode()) if kind == "file" else keys.batch(raw_id.decode()))
                values = await pipe.execute()
            for (raw_id, created_ms), raw in zip(page, values):
                if raw is not None:
                    await _move(owners, kind, raw_id.decode(), created_ms, orjson.loads(raw))
                    moved += 1
            with redis_errors("moving an old index"):
                await redis.zrem(claimed, *(raw_id for raw_id, _ in page))
    if moved:
        logger.info("moved %d files and batches into their owners' indexes", moved)
    return moved


async def _move(owners: OwnerIndex, kind: str, item_id: str, created_ms: float, item: dict) -> None:
    owner = str(item.get("owner") or "")
    if kind == "file":
        expires_at = int(item.get("expires_at") or time.time() + DEFAULT_FILE_TTL_S)
        await owners.add_file(owner, item_id, int(item.get("bytes") or 0), created_ms, expires_at)
        return
    keys = owners.keys
    with redis_errors("moving an old index"):
        pipe = owners.redis.pipeline(transaction=False)
        pipe.sadd(keys.owners, owner_name(owner))
        pipe.zadd(keys.owner_batches(owner), {item_id: created_ms})
        if item.get("status") not in FINAL_STATUSES:
            pipe.sadd(keys.owner_active(owner), item_id)
        await pipe.execute()
