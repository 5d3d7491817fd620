"""The prefix index against a real Redis: what a writer applies is what readers count, a replacement
is whole, the set expires with its TTL, and a reader's answer is the leading run of held blocks."""

from __future__ import annotations

import asyncio

from redis_support import run

from pdserve.block_hash import chain_hashes
from pdserve.scheduler import Keys, PrefixIndex

KEYS = Keys("prefix-test")
HASHES = chain_hashes(list(range(16 * 6)), 16)  # six blocks of one prompt


def test_readers_count_the_leading_blocks_each_instance_holds(redis_url, redis_client) -> None:
    async def main(redis) -> list:
        index = PrefixIndex(redis, KEYS, ttl_s=5)
        assert await index.apply("a", {h: True for h in HASHES[:4]}) is False  # the set was new
        assert await index.apply("b", {HASHES[0]: True, HASHES[2]: True}) is False
        first = await index.cached_blocks(["a", "b", "c"], HASHES)
        assert await index.apply("a", {HASHES[1]: False, HASHES[4]: True}) is True  # an eviction
        second = await index.cached_blocks(["a", "b"], HASHES)
        sizes = await index.sizes(["a", "b", "c"])
        await index.replace("a", HASHES)  # a full re-publication
        third = await index.cached_blocks(["a"], HASHES)
        await index.remove("b")
        return [first, second, sizes, third, await index.sizes(["b"])]

    first, second, sizes, third, gone = run(redis_url, main)
    assert first == {"a": 4, "b": 1, "c": 0}  # b holds block 2 but not block 1: its prefix is 1 block
    assert second == {"a": 1, "b": 1}
    assert sizes == {"a": 4, "b": 2, "c": 0}
    assert third == {"a": 6} and gone == {"b": 0}
    ttl = redis_client.pttl(KEYS.prefix_index("a"))
    assert 0 < ttl <= 5000


def test_the_set_expires_unless_refreshed(redis_url, redis_client) -> None:
    async def main(redis) -> tuple[bool, bool, bool]:
        index = PrefixIndex(redis, KEYS, ttl_s=0.3)
        await index.replace("x", HASHES)
        await asyncio.sleep(0.2)
        refreshed = await index.refresh("x")
        await asyncio.sleep(0.2)
        alive = (await index.sizes(["x"]))["x"] == len(HASHES)
        await asyncio.sleep(0.25)
        return refreshed, alive, await index.refresh("x")

    refreshed, alive, refreshed_after_expiry = run(redis_url, main)
    assert refreshed and alive  # the refresh kept it past its first TTL
    assert not refreshed_after_expiry and not redis_client.exists(KEYS.prefix_index("x"))


async def pool_and_host(index: PrefixIndex, *args, **kwargs) -> dict[str, tuple[int, ...]]:
    """Per instance, the leading blocks in its pool, and in its pool or host tier."""
    return {i: held[:2] for i, held in (await index.held_blocks(*args, **kwargs)).items()}


def test_a_host_tier_set_extends_the_pools_run_and_is_its_own(redis_url, redis_client) -> None:
    """An instance with a host tier has a second set: a block in either counts toward the leading
    run, the pool's own run is said apart; each set is written, replaced and removed by tier."""

    async def main(redis) -> list:
        index = PrefixIndex(redis, KEYS, ttl_s=5)
        await index.replace("a", HASHES[:2])
        await index.replace("a", HASHES[2:4], "host")  # evicted from the pool into the host tier
        await index.replace("b", HASHES[:1])
        await index.apply("b", {HASHES[1]: True}, "host")
        first = await pool_and_host(index, ["a", "b", "c"], HASHES, tiered=["a", "b"])
        untiered = await pool_and_host(index, ["a"], HASHES)  # a registration without a tier: pool only
        await index.apply("a", {HASHES[2]: False}, "host")  # the tier evicted block 2
        second = await pool_and_host(index, ["a"], HASHES, tiered=["a"])
        sizes = (await index.sizes(["a"]), await index.sizes(["a"], "host"))
        await index.remove("a")
        return [first, untiered, second, sizes, await pool_and_host(index, ["a"], HASHES, tiered=["a"])]

    first, untiered, second, sizes, gone = run(redis_url, main)
    assert first == {"a": (2, 4), "b": (1, 2), "c": (0, 0)}
    assert untiered == {"a": (2, 2)}
    assert second == {"a": (2, 2)} and sizes == ({"a": 2}, {"a": 1})
    assert gone == {"a": (0, 0)} and not redis_client.exists(KEYS.prefix_index("a", "host"))
    assert KEYS.prefix_index("a", "host") == KEYS.prefix_index("a") + ":host"


def test_a_disk_tier_set_is_one_per_tier_and_extends_the_runs_of_its_instances(
    redis_url, redis_client
) -> None:
    """Instances sharing a disk tier (one host's directory) read one set, written by each of them;
    a block in it counts toward the leading run after the pool's and the host tier's, said apart;
    an instance's clean stop leaves it."""

    async def main(redis) -> list:
        index = PrefixIndex(redis, KEYS, ttl_s=5)
        await index.replace("a", HASHES[:1])
        await index.replace("a", HASHES[1:2], "host")
        await index.replace_disk("t1", HASHES[2:4], writer="a")  # a's listing of the directory
        await index.apply_disk("t1", {HASHES[4]: True})  # b, sharing it, wrote block 4
        first = await index.held_blocks(["a", "b", "c"], HASHES, ["a"], {"a": "t1", "b": "t1"})
        await index.apply_disk("t1", {HASHES[3]: False})  # someone evicted block 3
        second = await index.held_blocks(["a", "b"], HASHES, ["a"], {"a": "t1", "b": "t1"})
        pair = await pool_and_host(index, ["a"], HASHES, ["a"])  # the pool-and-host view as before
        await index.remove("a")
        refreshed = await index.refresh_disk("t1")
        return [first, second, pair, refreshed, await index.held_blocks(["b"], HASHES, (), {"b": "t1"})]

    first, second, pair, refreshed, after = run(redis_url, main)
    assert first == {"a": (1, 2, 5), "b": (0, 0, 0), "c": (0, 0, 0)}  # b's pool lacks block 0
    assert second == {"a": (1, 2, 3), "b": (0, 0, 0)} and pair == {"a": (1, 2)}
    assert refreshed and after == {"b": (0, 0, 0)}
    assert redis_client.scard(KEYS.prefix_disk("t1")) == 2  # a's stop left the shared set
    assert KEYS.prefix_disk("t1") == "pdserve:prefix-test:prefix:{disk:t1}"
    assert not redis_client.exists(KEYS.prefix_disk_scratch("t1", "a"))
