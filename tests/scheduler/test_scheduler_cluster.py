"""The scheduler on a real 3-primary Redis Cluster: registrations (Lua on the registry's slot), the
live set, inbox sends to instances on different shards in one pipeline, acks, outbox publishes, a
prefix index replaced by RENAME, restart detection asking the shard that holds the outbox, and files
stored in pieces (APPEND to a partial key, RENAMEd by a script on the file's slot)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis_support import outbox_deltas
from router_support import instance

from pdserve.batchstore.files import CHUNK_BYTES, FileStore
from pdserve.localredis.embedded_ha import EmbeddedCluster
from pdserve.router.routing.sender import InboxSender
from pdserve.scheduler import (
    GenerateRequest,
    Inbox,
    InstanceRegistry,
    Keys,
    Outbox,
    PrefixIndex,
    RedisSettings,
    RequestDelta,
)
from pdserve.scheduler.redis_server import server_info

pytestmark = pytest.mark.timeout(120)
KEYS = Keys("cl-test")


@pytest.fixture(scope="module")
def cluster():
    c = EmbeddedCluster(primaries=3)
    c.start()
    yield c
    c.close()


def test_the_control_plane_works_across_shards(cluster) -> None:
    async def main() -> None:
        r = RedisSettings.from_url(cluster.url).connect()
        assert isinstance(r, aioredis.RedisCluster)
        try:
            registry = InstanceRegistry(r, KEYS)
            ids = [f"i{n}" for n in range(12)]
            for i in ids:
                await registry.register(instance(i))
            assert {x.id for x in await registry.live()} == set(ids)
            shards = {r.get_node_from_key(KEYS.inbox(i)).name for i in ids}
            assert len(shards) == 3  # the inboxes spread over every shard

            sender = InboxSender(r, KEYS)
            requests = [
                GenerateRequest(request_id=f"q-{i}", router_id="r1", prompt="x", deadline=time.time() + 60)
                for i in ids
            ]
            await asyncio.gather(*(sender.send(i, m) for i, m in zip(ids, requests, strict=True)))
            assert sender.num_batches == 1  # one pipeline, split per shard by the client
            for i in ids:
                inbox = Inbox(r, KEYS, i)
                await inbox.ensure_group()
                got = await inbox.read(count=10, block_ms=10)
                assert [m.request_id for _, m in got] == [f"q-{i}"]
                await inbox.ack([entry_id for entry_id, _ in got])
                assert await r.xlen(KEYS.inbox(i)) == 0

            await Outbox(r, KEYS).publish_many(
                "i0",
                {
                    router: [
                        RequestDelta(request_id=f"q-{router}", token_ids=[1], text="a", finish_reason="stop")
                    ]
                    for router in ("r1", "r2", "r3")
                },
            )
            for router in ("r1", "r2", "r3"):
                deltas = [d async for d in outbox_deltas(r, KEYS.outbox(router), f"q-{router}", timeout_s=5)]
                assert [d.text for d in deltas] == ["a"]

            index = PrefixIndex(r, KEYS)
            await index.replace("i0", [b"a" * 16, b"b" * 16])
            await index.replace("i0", [b"c" * 16])
            assert await r.smembers(KEYS.prefix_index("i0")) == {b"c" * 16}
            assert not await r.exists(KEYS.prefix_index_scratch("i0"))

            for i in ids:  # the run_id of the shard holding each key
                node = r.get_node_from_key(KEYS.outbox(i))
                own = await aioredis.Redis(host=node.host, port=node.port).info("server")
                assert (await server_info(r, KEYS.outbox(i)))["run_id"] == own["run_id"]
            await registry.deregister("i0")
            assert "i0" not in {x.id for x in await registry.live()}
        finally:
            await r.aclose()

    asyncio.run(main())


def test_files_are_listed_across_shards(cluster) -> None:
    """``GET /v1/files`` reads every listed file's metadata: each file has its own hash tag, so on a
    cluster they sit on different shards (a cross-slot MGET was refused: a 500)."""

    async def main() -> None:
        r = RedisSettings.from_url(cluster.url).connect()
        try:
            keys = Keys("cl-files")
            files = FileStore(r, keys)
            made = []
            for n in range(12):
                made.append(await files.create(f"f{n}.jsonl", "batch", b"{}\n"))
                await asyncio.sleep(0.002)  # distinct creation ms: a definite order
            assert len({r.get_node_from_key(keys.file(f.id)).name for f in made}) > 1
            await r.delete(keys.file(made[0].id))  # expired: dropped from the index
            listed, more = await files.list_files()
            assert [f.id for f in listed] == [f.id for f in reversed(made[1:])] and not more
            page, more = await files.list_files(limit=3, newest_first=False)
            assert [f.id for f in page] == [f.id for f in made[1:4]] and more
            assert made[0].id.encode() not in await r.zrange(keys.owner_files(""), 0, -1)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_file_is_stored_and_read_in_pieces_on_a_cluster(cluster) -> None:
    """``FileStore.store`` appends pieces to a partial key and renames it to the content with the
    metadata in one script, all on the file's slot; ``FileStore.open`` reads it back by GETRANGE."""

    async def main() -> None:
        r = RedisSettings.from_url(cluster.url).connect()
        try:
            keys = Keys("cl-files")
            files = FileStore(r, keys)
            content = bytes(range(256)) * (CHUNK_BYTES // 256) * 2 + b"tail\n"
            made = [await files.create(f"f{n}.jsonl", "batch_output", content) for n in range(3)]
            for info in made:
                _, size, pieces = await files.open(info.id)
                assert size == len(content) == info.bytes
                assert b"".join([p async for p in pieces]) == content
                assert not await r.exists(keys.file_partial(info.id))
        finally:
            await r.aclose()

    asyncio.run(main())
