"""The host tier in the prefix index (a real engine in a worker of this process, real Redis): after a
run with evictions from the pool and from the tier, every block the index lists is where it says
(the ``pool`` set is the prefix cache, the ``host`` set the host tier), a prompt the pool lost is
read back from the tier with the tokens it had, and a worker restarted under the same id finds no
stale entry and answers the same."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid

from test_worker_service import ask, router_registered, settings, started

from pdserve.block_hash import chain_hashes
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.tiers.disk_tier import HEADER
from pdserve.scheduler import InstanceRegistry, Keys
from pdserve.worker.service import WorkerService

BS = 16


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(blocks * BS + 5)]


def tier_settings(redis_url, tmp_path, cluster, tiny_model_dir, instance_id=None):
    tier_blocks = 8
    host_bytes = tier_blocks * block_bytes(ModelConfig.from_dir(tiny_model_dir), BS)
    base = settings(redis_url, tmp_path, cluster)
    return dataclasses.replace(
        base,
        model_dir=tiny_model_dir,
        engine_kind="model",
        instance_id=instance_id or base.instance_id,
        engine=dataclasses.replace(
            base.engine, num_blocks=12, max_num_seqs=1, prefill_chunk_size=64, kv_host_bytes=host_bytes
        ),
    )


async def settled(redis, keys: Keys, service: WorkerService) -> tuple[set, set, set, set]:
    """The index's two sets and the engine's two tiers, once they agree (the publisher writes after
    each step; the engine is idle here): what each set lists, and what each tier holds."""
    engine = service.engine._engine  # idle: its thread touches nothing now
    deadline = time.monotonic() + 5
    while True:
        pool = set(await redis.smembers(keys.prefix_index(service.id)))
        host = set(await redis.smembers(keys.prefix_index(service.id, "host")))
        held_pool, held_host = set(engine.blocks.hashes()), set(engine.host_tier.hashes())
        if (pool, host) == (held_pool, held_host) or time.monotonic() > deadline:
            return pool, host, held_pool, held_host
        await asyncio.sleep(0.05)


def test_the_index_lists_only_blocks_that_are_where_it_says(
    redis_url, tmp_path, tiny_model_dir, cluster
) -> None:
    prompts = {f"p{i}": prompt(500 + i, 4) for i in range(6)}  # 6 x 4 blocks through an 11-block pool

    async def main() -> dict:
        redis, keys = await router_registered(redis_url, cluster)
        service = WorkerService(tier_settings(redis_url, tmp_path, cluster, tiny_model_dir))
        task = await started(service)
        try:
            fresh = await InstanceRegistry(redis, keys).get(service.id)  # nothing measured yet
            first = {rid: await ask(redis, keys, service.id, rid, 4, ids) for rid, ids in prompts.items()}
            pool, host, held_pool, held_host = await settled(redis, keys, service)
            engine = service.engine._engine
            stats = dataclasses.replace(engine.host_tier.stats)
            evicted = engine.blocks.num_evicted
            hashes = chain_hashes(prompts["p3"], BS)
            in_pool = len(engine.blocks.lookup(hashes))
            in_tier = engine.host_tier.run(hashes[in_pool:])  # the blocks the pool lost, kept below it
            again = await ask(redis, keys, service.id, "again", 4, prompts["p3"])  # gone from the pool
            hits = engine.host_tier.stats.hits
            after = await settled(redis, keys, service)
            deadline = time.monotonic() + 5  # the next heartbeat carries the tier's counters
            while (info := await InstanceRegistry(redis, keys).get(service.id)).tier.hits != hits:
                assert time.monotonic() < deadline, info.tier
                await asyncio.sleep(0.1)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        return locals()

    got = asyncio.run(main())
    assert got["evicted"] > 0 and got["stats"].evictions > 0  # the pool and the tier both evicted
    assert got["pool"] and got["host"]
    assert got["pool"] <= got["held_pool"] and got["host"] <= got["held_host"]  # nothing claimed is missing
    assert got["pool"] == got["held_pool"] and got["host"] == got["held_host"]  # and nothing held is left out
    assert got["in_pool"] < 4 and got["in_tier"] == 4 - got["in_pool"]
    assert got["again"] == got["first"]["p3"] and got["hits"] == got["in_tier"]  # read back: same tokens
    pool, host, held_pool, held_host = got["after"]
    assert pool == held_pool and host == held_host
    assert (
        got["info"].tier is not None
        and got["info"].tier.hits == got["in_tier"]
        and got["info"].tier.stores > 0
    )
    # the rates it measured ride the same heartbeat: prefill per token, the host tier's read-back per block
    assert got["fresh"].rates is None
    rates = got["info"].rates
    assert rates is not None and rates.prefill_s_per_token > 0 and rates.host_read_s_per_block > 0
    assert rates.disk_read_s_per_block is None and rates.transfer_s_per_block is None  # no disk, no hand-off
    reader = got["engine"].tier_reader
    assert rates.host_read_s_per_block == reader.host_rate.value


def test_a_restarted_worker_finds_no_stale_entry_and_answers_the_same(
    redis_url, tmp_path, tiny_model_dir, cluster
) -> None:
    """A crashed predecessor's sets (left until their TTL) are replaced by the new incarnation's
    (its tier is empty: memory of a process that is gone), and a prompt it served before is
    recomputed to the same tokens."""
    ids = prompt(900, 4)

    async def main() -> dict:
        redis, keys = await router_registered(redis_url, cluster)
        cfg = tier_settings(redis_url, tmp_path, cluster, tiny_model_dir)
        service = WorkerService(cfg)
        task = await started(service)
        try:
            before = await ask(redis, keys, service.id, "r1", 4, ids)
            for i in range(3):  # push r1's blocks out of the pool into the tier
                await ask(redis, keys, service.id, f"o{i}", 1, prompt(910 + i, 4))
            await settled(redis, keys, service)
            host_key = keys.prefix_index(service.id, "host")
            stale = set(await redis.smembers(host_key))
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        # what a crash leaves: the sets, until their TTL
        await redis.sadd(host_key, *stale)
        await redis.sadd(keys.prefix_index(service.id), *stale)
        service = WorkerService(cfg)
        task = await started(service)
        try:
            deadline = time.monotonic() + 5
            while await redis.exists(host_key, keys.prefix_index(service.id)):
                assert time.monotonic() < deadline, "the stale sets were not replaced"
                await asyncio.sleep(0.05)
            after = await ask(redis, keys, service.id, "r1-again", 4, ids)
            hits = service.engine._engine.host_tier.stats.hits
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        return locals()

    got = asyncio.run(main())
    assert got["stale"]  # the tier held r1's blocks before the restart
    assert got["after"] == got["before"] and got["hits"] == 0


# ---- the disk tier: one set per host directory, written by every instance sharing it ------------------
def disk_settings(redis_url, tmp_path, cluster, tiny_model_dir, disk_dir, disk_blocks: int):
    """A worker with no host tier and a disk tier of ``disk_blocks`` files in ``disk_dir``."""
    file_bytes = HEADER.size + block_bytes(ModelConfig.from_dir(tiny_model_dir), BS)
    base = tier_settings(redis_url, tmp_path, cluster, tiny_model_dir)
    engine = dataclasses.replace(
        base.engine, kv_host_bytes=0, kv_disk_path=str(disk_dir), kv_disk_bytes=disk_blocks * file_bytes
    )
    return dataclasses.replace(base, instance_id=f"disk-{uuid.uuid4().hex[:6]}", engine=engine)


async def settled_disk(redis, keys: Keys, services: list[WorkerService]) -> tuple[set, set]:
    """The disk tier's set and the files of its directory, once the writers are done and they agree."""
    engines = [s.engine._engine for s in services]
    for e in engines:
        e.disk_tier.flush()
    tier = engines[0].disk_tier
    key = keys.prefix_disk(services[0].disk_tier_id)
    deadline = time.monotonic() + 8
    while True:
        listed = set(await redis.smembers(key))
        files = {bytes.fromhex(p.name[:-3]) for p in tier.dir.glob("*.kv")}
        if listed == files or time.monotonic() > deadline:
            return listed, files
        await asyncio.sleep(0.1)


def test_the_disk_tier_set_lists_only_blocks_whose_files_are_there(
    redis_url, tmp_path, tiny_model_dir, cluster
) -> None:
    """Two workers share one disk directory (one host): blocks one evicted to disk serve the other
    with the same tokens, and after a run with evictions from the pools and from the disk tier every
    block the tier's one set lists has its file, whole and checked (and every file is listed)."""
    disk_dir = tmp_path / "kv-disk"
    prompts = {f"p{i}": prompt(600 + i, 4) for i in range(6)}

    async def main() -> dict:
        redis, keys = await router_registered(redis_url, cluster)
        services = [
            WorkerService(disk_settings(redis_url, tmp_path, cluster, tiny_model_dir, disk_dir, 10))
            for _ in range(2)
        ]
        tasks = [await started(s) for s in services]
        a, b = services
        try:
            ids = {s.disk_tier_id for s in services}
            first = {rid: await ask(redis, keys, a.id, rid, 4, p) for rid, p in prompts.items()}
            listed, files = await settled_disk(redis, keys, services)
            disk_a, disk_b = a.engine._engine.disk_tier, b.engine._engine.disk_tier
            stats_a = dataclasses.replace(disk_a.stats)
            # a prompt whose 4 full blocks a's pool evicted to disk: b never saw it
            rid = next(r for r, p in prompts.items() if disk_b.run(chain_hashes(p, BS)) == 4)
            served = await ask(redis, keys, b.id, f"b-{rid}", 4, prompts[rid])
            hits_b = disk_b.stats.hits
            for i in range(3):  # b's pool evicts too: both write the one directory
                await ask(redis, keys, b.id, f"b{i}", 1, prompt(700 + i, 4))
            after = await settled_disk(redis, keys, services)
            whole = all(
                disk_a.decode(h, disk_a.path(h).read_bytes()) is not None for h in after[0] if h in after[1]
            )
            deadline = time.monotonic() + 5  # the next heartbeat carries the tier
            while (info := await InstanceRegistry(redis, keys).get(b.id)).disk_tier is None or (
                info.disk_tier.hits != hits_b
            ):
                assert time.monotonic() < deadline, info.disk_tier
                await asyncio.sleep(0.1)
        finally:
            for s in services:
                s.begin_drain()
            for t in tasks:
                await asyncio.wait_for(t, 30)
        left = set(await redis.smembers(keys.prefix_disk(a.disk_tier_id)))  # a clean stop leaves it
        await redis.aclose()
        return locals()

    got = asyncio.run(main())
    assert len(got["ids"]) == 1  # one tier: the same host and directory
    assert got["stats_a"].evictions > 0 and got["stats_a"].stores > 10  # the disk tier evicted
    assert got["listed"] and got["listed"] == got["files"] and len(got["files"]) <= 10
    assert got["served"] == got["first"][got["rid"]] and got["hits_b"] == 4
    listed, files = got["after"]
    assert listed <= files and listed == files and len(files) <= 10 and got["whole"]
    assert got["info"].disk_tier.id == got["a"].disk_tier_id and got["info"].disk_tier.hits == 4
    rates = got["info"].rates  # b read 4 blocks back from disk: it published what that took
    assert rates is not None and rates.disk_read_s_per_block > 0 and rates.host_read_s_per_block is None
    assert got["left"] == files


def test_a_restarted_worker_finds_its_disk_tier_and_tells_the_index(
    redis_url, tmp_path, tiny_model_dir, cluster
) -> None:
    """The disk tier outlives its worker: a new worker on the same directory lists the files at
    start, publishes them (here after the set expired with the last instance), and serves a prompt
    the old one evicted to disk from its files, with the tokens it had."""
    disk_dir = tmp_path / "kv-disk"
    prompts = {f"p{i}": prompt(800 + i, 4) for i in range(5)}

    async def main() -> dict:
        redis, keys = await router_registered(redis_url, cluster)
        service = WorkerService(disk_settings(redis_url, tmp_path, cluster, tiny_model_dir, disk_dir, 40))
        task = await started(service)
        try:
            first = {rid: await ask(redis, keys, service.id, rid, 4, p) for rid, p in prompts.items()}
            before, files_before = await settled_disk(redis, keys, [service])
            key = keys.prefix_disk(service.disk_tier_id)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        await redis.delete(key)  # what one TTL after the last instance of the tier leaves
        service = WorkerService(disk_settings(redis_url, tmp_path, cluster, tiny_model_dir, disk_dir, 40))
        task = await started(service)
        try:
            found = set(service.engine._engine.disk_tier.hashes())
            listed, files = await settled_disk(redis, keys, [service])
            disk = service.engine._engine.disk_tier
            rid = next(r for r, p in prompts.items() if disk.run(chain_hashes(p, BS)) == 4)
            again = await ask(redis, keys, service.id, "again", 4, prompts[rid])
            hits = disk.stats.hits
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        return locals()

    got = asyncio.run(main())
    assert got["before"] == got["files_before"] and got["found"] == got["files_before"]
    assert got["listed"] == got["files"] == got["files_before"]  # the index was told at start
    assert got["again"] == got["first"][got["rid"]] and got["hits"] == 4
