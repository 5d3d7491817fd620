"""The host tier: blocks evicted from the pool's prefix cache are kept in host memory (LRU, bounded in
bytes, keyed by their namespace and chain hash) and read back, checksum verified, by a later prompt
with their prefix; the answer is a cold miss's bit for bit (MKL_CBWR=AUTO,STRICT, set in conftest),
and a corrupted stored block is a counted miss, recomputed, never decoded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.block_hash import chain_hashes
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiers.host_tier import HostTier, TierNamespace
from tests.engine.test_prefix_cache import BS, assert_same, ids, run

NS = TierNamespace("w" * 32, "f32", "float32", "block_major", BS, 64)


def block(fill: int) -> bytes:
    return bytes([fill]) * 64


# ---- the tier alone -------------------------------------------------------------------------------
def test_the_tier_keeps_the_most_recently_used_blocks_within_its_bytes() -> None:
    tier = HostTier(3 * 64 + 10, NS)  # room for 3 blocks
    tier.take_changes()  # start the record
    for i in range(3):
        tier.put(bytes([i]) * 16, block(i))
    assert tier.read([bytes([0]) * 16]) == [block(0)]  # 0 is the most recently used now
    tier.put(bytes([3]) * 16, block(3))  # evicts 1, the least recently used
    assert bytes([1]) * 16 not in tier and bytes([0]) * 16 in tier and tier.num_blocks == 3
    assert tier.used_bytes == 3 * 64 <= tier.capacity_bytes
    assert tier.take_changes() == {
        bytes([0]) * 16: True,
        bytes([1]) * 16: False,
        bytes([2]) * 16: True,
        bytes([3]) * 16: True,
    }
    assert tier.stats.stores == 4 and tier.stats.evictions == 1 and tier.stats.hits == 1
    assert sorted(tier.hashes()) == sorted(bytes([i]) * 16 for i in (0, 2, 3))


def test_a_chain_read_back_keeps_its_head_longest() -> None:
    """Blocks read together become the most recently used, the first one most: the tier then drops
    a prefix's tail before its head (which every longer prompt needs)."""
    tier = HostTier(3 * 64, NS)
    chain = [bytes([i]) * 16 for i in range(3)]
    for i, h in enumerate(chain):
        tier.put(h, block(i))
    assert len(tier.read(chain)) == 3
    tier.put(b"x" * 16, block(9))
    assert chain[2] not in tier and chain[0] in tier and chain[1] in tier


def test_a_key_is_what_the_block_is() -> None:
    """Another checkpoint, dtype, block size or layout is another key; the salt is in the hash."""
    h = chain_hashes(list(range(BS)), BS)[0]
    salted = chain_hashes(list(range(BS)), BS, extra=b"tenant")[0]
    keys = {HostTier(64, NS).key(h), HostTier(64, NS).key(salted)}
    for change in ({"weights_digest": "x" * 32}, {"dtype": "bfloat16"}, {"block_size": 32}, {"layout": "x"}):
        keys.add(HostTier(64, dataclasses.replace(NS, **change)).key(h))
    assert len(keys) == 6


def test_a_corrupted_entry_is_a_counted_miss_and_is_never_written() -> None:
    tier = HostTier(4 * 64, NS)
    hashes = [bytes([i]) * 16 for i in range(3)]
    for i, h in enumerate(hashes):
        tier.put(h, block(i))
    entry = tier._entries[tier.key(hashes[1])]
    entry.data = bytes([9]) + entry.data[1:]  # one byte flipped in host memory
    tier.take_changes()
    assert tier.read(hashes) == [block(0)]  # only the block before the bad one
    assert tier.stats.corrupt == 1 and hashes[1] not in tier
    assert tier.take_changes() == {hashes[1]: False}  # the index is told at once


def test_zero_bytes_keeps_nothing() -> None:
    tier = HostTier(0, NS)
    tier.put(b"h" * 16, block(1))
    assert tier.num_blocks == 0


# ---- the engine -----------------------------------------------------------------------------------
def engine(model_dir, **kw) -> LLMEngine:
    cfg = {"num_blocks": 14, "prefill_chunk_size": 64, "max_num_seqs": 2, "keep_logits": True, **kw}
    return LLMEngine(model_dir, EngineConfig(**cfg))


def evict_with_others(eng: LLMEngine, seed: int) -> None:
    """Prompts that fill the pool, so every earlier cached block is evicted."""
    for i in range(2):
        run(eng, {f"other-{seed}-{i}": ids(seed + i, 6 * BS + 3)})


@pytest.mark.parametrize("hit_blocks", [2, 5])
def test_a_block_read_back_from_the_tier_changes_no_bit(tiny_model_dir, hit_blocks: int) -> None:
    """A prompt whose prefix was evicted from the pool is served from the host tier: it computes
    only the rest (cached_tokens counts the blocks read back), and its tokens and logits are those
    of an engine without any cache."""
    shared = ids(70, hit_blocks * BS)
    first, second = shared + ids(71, 9), shared + ids(72, 27)
    ((cold, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"b": second}).values()
    eng = engine(tiny_model_dir, kv_host_bytes=64 << 20)
    run(eng, {"a": first})
    evict_with_others(eng, 300)
    assert eng.blocks.lookup(chain_hashes(shared, BS)) == []  # gone from the pool
    tier = eng.host_tier
    assert tier is not None and tier.stats.stores >= hit_blocks
    assert eng.load().host_read_s_per_block is None and eng.load().prefill_s_per_token  # nothing read yet
    ((warm, cached),) = run(eng, {"b": second}).values()
    assert cached == hit_blocks * BS and tier.stats.hits == hit_blocks
    assert eng.batcher.hit_counts.tier == hit_blocks
    load = eng.load()  # the read-back's time per block, for routers; no disk tier read
    assert (
        load.host_read_s_per_block and load.host_read_s_per_block > 0 and load.disk_read_s_per_block is None
    )
    assert_same(cold, warm)
    # read back into the pool, the blocks are cached there again: the next turn hits the pool
    ((again, cached_again),) = run(eng, {"c": second}).values()
    assert cached_again == (len(second) - 1) // BS * BS and tier.stats.hits == hit_blocks
    assert_same(cold, again)


def test_a_corrupted_stored_block_is_recomputed(tiny_model_dir) -> None:
    shared = ids(80, 4 * BS)
    prompt = shared + ids(81, 11)
    ((cold, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"p": prompt}).values()
    eng = engine(tiny_model_dir, kv_host_bytes=64 << 20)
    run(eng, {"a": shared + ids(82, 5)})
    evict_with_others(eng, 400)
    tier = eng.host_tier
    assert tier is not None
    third = chain_hashes(shared, BS)[2]
    entry = tier._entries[tier.key(third)]
    raw = np.frombuffer(entry.data, dtype=np.uint8).copy()
    raw[len(raw) // 2] ^= 0x40
    entry.data = raw.tobytes()
    ((warm, cached),) = run(eng, {"p": prompt}).values()
    assert tier.stats.corrupt == 1 and tier.stats.hits == 2  # blocks 0, 1 read back, 2 recomputed
    assert cached == 2 * BS
    assert_same(cold, warm)


def test_without_the_flag_nothing_is_kept_below_the_pool(tiny_model_dir) -> None:
    eng = engine(tiny_model_dir)
    assert eng.host_tier is None and eng.blocks.on_evict is None and eng.batcher.tier is None


def test_without_the_prefix_cache_the_flag_is_ignored_with_a_warning(tiny_model_dir, caplog) -> None:
    eng = engine(tiny_model_dir, prefix_caching=False, kv_host_bytes=64 << 20)
    assert eng.host_tier is None and not eng.facts().host_tier
    assert "--kv-host-bytes and --kv-disk-bytes are ignored" in caplog.text
