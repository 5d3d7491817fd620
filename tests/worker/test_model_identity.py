"""Model identity in pairing: two workers serving one name over two checkpoints
(a rolling upgrade) are never made a prefill/decode pair; two over the same checkpoint are. Real
engines on the tiny model, registered in a real Redis; the router's pairing rule reads their
registrations."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from pathlib import Path

import orjson

from pdserve import status_read, status_table
from pdserve.engine.config import EngineConfig
from pdserve.engine.models.weights import DIGEST_CACHE, weights_digest
from pdserve.router.routing.policies import PolicyRequest
from pdserve.router.routing.selection import Selector, kv_mismatch
from pdserve.scheduler import InstanceInfo, InstanceRegistry, Keys, RedisSettings
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings


def change_one_value(model_dir: Path, tensor: str = "model.norm.weight") -> None:
    """Rewrite one float32 of ``tensor`` in place: same size, same geometry, other weights."""
    path = model_dir / "model.safetensors"
    with path.open("r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = orjson.loads(f.read(header_len))
        assert header[tensor]["dtype"] == "F32"
        f.seek(8 + header_len + header[tensor]["data_offsets"][0])
        (value,) = struct.unpack("<f", f.read(4))
        f.seek(-4, 1)
        f.write(struct.pack("<f", value + 0.5))


async def registration(model_dir: Path, role: str, redis_url: str, cluster: str) -> InstanceInfo:
    """Start a worker on ``model_dir`` serving the name ``tiny``, read its registration, stop it."""
    service = WorkerService(
        WorkerSettings(
            model_dir=model_dir,
            role=role,
            served_model_name="tiny",
            redis_url=redis_url,
            cluster=cluster,
            ttl_s=3.0,
            engine_kind="model",
            instance_id=f"{role}-{uuid.uuid4().hex[:6]}",
            engine=EngineConfig(num_blocks=32, max_model_len=256),
        )
    )
    task = asyncio.create_task(service.run())
    deadline = time.monotonic() + 60
    try:
        while (info := await service.registry.get(service.id)) is None:
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, "the worker did not register"
            await asyncio.sleep(0.05)
        return info
    finally:
        service.begin_drain()
        await asyncio.wait_for(task, 30)


def test_two_checkpoints_under_one_name_are_never_paired(
    tiny_model_dir, model_copy, redis_url, cluster
) -> None:
    change_one_value(model_copy)

    async def main() -> tuple[InstanceInfo, InstanceInfo, InstanceInfo, str]:
        p = await registration(tiny_model_dir, "prefill", redis_url, cluster)
        old_d = await registration(model_copy, "decode", redis_url, cluster)
        same_d = await registration(tiny_model_dir, "decode", redis_url, cluster)
        redis = RedisSettings.from_url(redis_url).connect()
        for info in (p, old_d, same_d):  # registered again as they were live: what status reads
            await InstanceRegistry(redis, Keys(cluster), ttl_s=30).register(info)
        shown = status_table.render(await status_read.read(redis, cluster))
        await redis.aclose()
        return p, old_d, same_d, shown

    p, other, same, shown = asyncio.run(main())
    # `pdserve status` shows each instance's model identity: the same for the same checkpoint
    rows = {
        line.split()[0]: line.split()
        for line in shown.splitlines()
        if line.startswith(("prefill-", "decode-"))
    }
    assert rows[p.id][2] == rows[other.id][2] == rows[same.id][2] == "tiny"
    assert rows[p.id][3] == rows[same.id][3] != rows[other.id][3]
    assert len(rows[p.id][3]) == 8
    # the geometry, precision and tokenizer are equal: only the weights tell them apart
    assert p.tokenizer == other.tokenizer == same.tokenizer is not None
    reason = kv_mismatch(p, other)
    assert reason is not None and "different models (weights" in reason and "KV caches" not in reason
    assert kv_mismatch(p, same) is None
    request = PolicyRequest(model="tiny")
    sel = Selector("round_robin", "round_robin")
    for _ in range(3):
        route = sel.route([p, other], request)
        assert route.prefill is None and route.decode.id == other.id  # served whole, never paired
    for _ in range(3):
        route = sel.route([p, other, same], request)
        assert (route.prefill.id, route.decode.id) == (p.id, same.id)


def test_the_weights_digest_is_cached_and_follows_the_bytes(model_copy) -> None:
    """The files are hashed once: a later digest reads the cache beside them; a changed file (new
    mtime) is hashed again, so the cache never hides a change."""
    first = weights_digest(model_copy)
    cache = orjson.loads((model_copy / DIGEST_CACHE).read_bytes())
    assert set(cache) == {"model.safetensors"}
    assert weights_digest(model_copy) == first
    change_one_value(model_copy)
    changed = weights_digest(model_copy)
    assert changed != first
    assert (
        orjson.loads((model_copy / DIGEST_CACHE).read_bytes())["model.safetensors"]["digest"]
        != (cache["model.safetensors"]["digest"])
    )
    (model_copy / DIGEST_CACHE).unlink()
    assert weights_digest(model_copy) == changed  # from the bytes alone
