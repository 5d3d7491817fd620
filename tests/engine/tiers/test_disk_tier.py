"""The disk tier: blocks the host tier (or, without one, the pool) evicts are written to files in a
directory the instances of a host share (one file per block, named by its chain hash, a header and
an XXH3 digest), LRU by file time within a byte bound, and read back, checked, by a later prompt
with their prefix; the answer is a cold miss's bit for bit (MKL_CBWR=AUTO,STRICT, set in conftest).
A file that fails a check is a counted miss, removed and recomputed; a new engine on the same
directory (a restart, or another instance) finds the blocks and hits."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

from pdserve.block_hash import chain_hashes
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.tiers.disk_tier import HEADER, DiskTier, tier_id
from pdserve.engine.tiers.host_tier import HostTier, TierNamespace
from pdserve.engine.tiers.tier_reader import TierReader
from tests.engine.test_prefix_cache import BS, assert_same, ids, run

NS = TierNamespace("w" * 32, "f32", "float32", "block_major", BS, 64)
FILE = HEADER.size + 64


def block(fill: int) -> bytes:
    return bytes([fill]) * 64


def h(i: int) -> bytes:
    return bytes([i]) * 16


# ---- the tier alone -------------------------------------------------------------------------------
def test_a_block_goes_to_one_checked_file_named_by_its_hash(tmp_path) -> None:
    tier = DiskTier(tmp_path, 4 * FILE, NS, background=False)
    tier.take_changes()
    tier.put(h(1), block(1))
    path = tier.path(h(1))
    assert path.parent.name == NS.digest().hex() and path.name == h(1).hex() + ".kv"
    assert path.stat().st_size == FILE and not [p for p in path.parent.iterdir() if p != path]
    assert tier.read([h(1), h(2)]) == [block(1)]
    assert tier.stats.stores == 1 and tier.stats.hits == 1
    assert tier.take_changes() == {h(1): True}


def test_the_files_stay_within_the_bytes_least_recently_used_out(tmp_path) -> None:
    tier = DiskTier(tmp_path, 3 * FILE + 10, NS, background=False)
    tier.take_changes()
    for i in range(3):
        tier.put(h(i), block(i))
        os.utime(tier.path(h(i)), (1000 + i, 1000 + i))  # distinct times (a coarse clock ties them)
        tier._known[h(i)] = 1000 + i
    assert tier.read([h(0)]) == [block(0)]  # touched: now the most recent
    tier.put(h(3), block(3))  # evicts 1, the least recently used
    names = sorted(p.name for p in tier.dir.iterdir())
    assert names == sorted(h(i).hex() + ".kv" for i in (0, 2, 3))
    used = sum(p.stat().st_size for p in tier.dir.iterdir())
    assert used == tier.used_bytes == 3 * FILE <= tier.capacity_bytes
    assert tier.stats.evictions == 1 and tier.take_changes()[h(1)] is False


@pytest.mark.parametrize("damage", ["payload", "header", "truncate", "namespace"])
def test_a_damaged_file_is_a_counted_miss_and_is_removed(tmp_path, damage: str) -> None:
    tier = DiskTier(tmp_path, 8 * FILE, NS, background=False)
    for i in range(3):
        tier.put(h(i), block(i))
    path = tier.path(h(1))
    raw = bytearray(path.read_bytes())
    if damage == "payload":
        raw[-5] ^= 0x01
    elif damage == "header":
        raw[2] ^= 0x01  # the magic
    elif damage == "truncate":
        raw = raw[:-1]
    else:  # a file of another namespace under this name
        raw[8:24] = bytes(16)
    path.write_bytes(bytes(raw))
    tier.take_changes()
    assert tier.read([h(0), h(1), h(2)]) == [block(0)]
    assert tier.stats.corrupt == 1 and not path.exists()
    assert tier.take_changes() == {h(1): False}


def test_a_file_another_process_removed_is_a_plain_miss(tmp_path) -> None:
    tier = DiskTier(tmp_path, 8 * FILE, NS, background=False)
    tier.put(h(1), block(1))
    os.remove(tier.path(h(1)))
    assert tier.read([h(1)]) == [] and tier.stats.corrupt == 0
    assert tier.run([h(1)]) == 0  # forgotten: the next plan does not count it


def test_a_new_tier_on_the_directory_holds_what_it_lists(tmp_path) -> None:
    first = DiskTier(tmp_path, 8 * FILE, NS)
    for i in range(3):
        first.put(h(i), block(i))
    first.close()
    (first.dir / ".x.kv.1.2.tmp").write_bytes(b"half")  # a writer's leftover: not a block
    again = DiskTier(tmp_path, 8 * FILE, NS, background=False)
    assert sorted(again.hashes()) == [h(0), h(1), h(2)]
    assert again.read([h(0), h(1), h(2)]) == [block(0), block(1), block(2)]
    other = DiskTier(tmp_path, 8 * FILE, dataclasses.replace(NS, dtype="bfloat16"), background=False)
    assert other.hashes() == [] and other.dir != again.dir  # another namespace reads none of them


def test_a_burst_larger_than_the_queue_is_written_whole(tmp_path) -> None:
    """An admission evicts its prompt's blocks in one call: the engine's thread waits for the
    writer when the queue is full instead of dropping the rest of the burst."""
    tier = DiskTier(tmp_path, 64 * FILE, NS, queue_blocks=2)
    for i in range(50):
        tier.put(h(i), block(i))
    tier.flush()
    assert tier.stats.stores == 50 and tier.stats.dropped == 0
    assert tier.read([h(i) for i in range(50)]) == [block(i) for i in range(50)]
    tier.close()


def test_a_stuck_writer_drops_the_writes_and_counts_them(tmp_path) -> None:
    """A writer that frees no slot in put_timeout_s (a stuck disk) has the write dropped, and the
    ones after it at once, until the queue has room again: the engine waits once, not per block."""
    tier = DiskTier(tmp_path, 64 * FILE, NS, queue_blocks=1, put_timeout_s=0.05)
    stuck, write = threading.Event(), tier._write

    def slow_write(*item) -> None:
        stuck.wait(10)
        write(*item)

    tier._write = slow_write  # type: ignore[method-assign,assignment]
    t0 = time.monotonic()
    for i in range(20):
        tier.put(h(i), block(i))
    assert time.monotonic() - t0 < 1.0  # one timeout's wait, not twenty
    assert tier.stats.dropped >= 17
    stuck.set()
    tier.flush()
    tier.put(h(30), block(30))  # room again: queued, written
    tier.flush()
    assert tier.stats.stores + tier.stats.dropped == 21 and h(30) in tier.hashes()
    tier.close()


def test_a_block_already_on_disk_is_touched_not_written_again(tmp_path) -> None:
    tier = DiskTier(tmp_path, 8 * FILE, NS, queue_blocks=1)
    tier.put(h(1), block(1))
    tier.flush()
    os.utime(tier.path(h(1)), (1000, 1000))
    assert tier.refresh(h(1)) and not tier.refresh(h(2))
    tier.put(h(1), block(1))
    tier.flush()
    assert tier.stats.stores == 1 and tier.path(h(1)).stat().st_mtime > 1000  # the most recent
    tier.close()


def test_the_tier_id_is_the_host_and_the_directory(tmp_path) -> None:
    tier = DiskTier(tmp_path, FILE, NS, background=False)
    assert tier_id("a", str(tier.dir)) == tier_id("a", str(tier.dir))
    assert tier_id("a", str(tier.dir)) != tier_id("b", str(tier.dir))
    assert len(tier_id("a", str(tier.dir))) == 32


# ---- the engine -----------------------------------------------------------------------------------
def engine(model_dir, disk, **kw) -> LLMEngine:
    cfg = {
        "num_blocks": 14,
        "prefill_chunk_size": 64,
        "max_num_seqs": 2,
        "keep_logits": True,
        "kv_disk_path": str(disk),
        "kv_disk_bytes": 64 << 20,
        **kw,
    }
    return LLMEngine(model_dir, EngineConfig(**cfg))


def evict_with_others(eng: LLMEngine, seed: int) -> None:
    """Prompts that fill the pool (and a small host tier), so every earlier block goes to disk."""
    for i in range(3):
        run(eng, {f"other-{seed}-{i}": ids(seed + i, 6 * BS + 3)})
    assert eng.disk_tier is not None
    eng.disk_tier.flush()


@pytest.mark.parametrize("host_blocks", [0, 4])
def test_a_block_read_back_from_disk_changes_no_bit(tiny_model_dir, tmp_path, host_blocks: int) -> None:
    """A prompt whose prefix left the pool (and the host tier) is served from disk: it computes
    only the rest, and its tokens and logits are those of an engine without any cache."""
    shared = ids(70, 4 * BS)
    first, second = shared + ids(71, 9), shared + ids(72, 27)
    ((cold, _),) = run(engine(tiny_model_dir, tmp_path, prefix_caching=False), {"b": second}).values()
    host_bytes = host_blocks * block_bytes(ModelConfig.from_dir(tiny_model_dir), BS)
    eng = engine(tiny_model_dir, tmp_path / "d", kv_host_bytes=host_bytes)
    run(eng, {"a": first})
    evict_with_others(eng, 300)
    hashes = chain_hashes(shared, BS)
    assert eng.blocks.lookup(hashes) == []  # gone from the pool
    assert eng.host_tier is None or eng.host_tier.run(hashes) == 0  # and from the host tier
    disk = eng.disk_tier
    assert disk is not None and disk.run(hashes) == 4
    ((warm, cached),) = run(eng, {"b": second}).values()
    assert cached == 4 * BS and disk.stats.hits == 4 and disk.stats.corrupt == 0
    assert eng.batcher.hit_counts.tier == 4
    load = eng.load()  # the read-back's time per block, for routers: the disk tier's, not the host tier's
    assert (
        load.disk_read_s_per_block and load.disk_read_s_per_block > 0 and load.host_read_s_per_block is None
    )
    assert_same(cold, warm)
    if host_blocks:  # the host tier wrote back what it evicted
        assert eng.host_tier is not None and eng.host_tier.stats.evictions > 0


def test_a_flipped_byte_on_disk_is_a_counted_miss_with_the_same_tokens(tiny_model_dir, tmp_path) -> None:
    shared = ids(80, 4 * BS)
    prompt = shared + ids(81, 11)
    ((cold, _),) = run(engine(tiny_model_dir, tmp_path, prefix_caching=False), {"p": prompt}).values()
    eng = engine(tiny_model_dir, tmp_path / "d")
    run(eng, {"a": shared + ids(82, 5)})
    evict_with_others(eng, 400)
    disk = eng.disk_tier
    assert disk is not None
    path = disk.path(chain_hashes(shared, BS)[2])
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    ((warm, cached),) = run(eng, {"p": prompt}).values()
    assert disk.stats.corrupt == 1 and disk.stats.hits == 2  # blocks 0, 1 read back, 2 recomputed
    assert cached == 2 * BS and not path.exists()
    assert_same(cold, warm)


def test_a_restarted_engine_finds_the_blocks_and_a_second_engine_shares_them(
    tiny_model_dir, tmp_path
) -> None:
    """One engine fills the directory and stops; a new one on it (a restart) holds what it lists
    and hits; a third, alive beside the second, hits what the second wrote after it started."""
    shared = ids(90, 4 * BS)
    prompt = shared + ids(91, 13)
    ((cold, _),) = run(engine(tiny_model_dir, tmp_path, prefix_caching=False), {"p": prompt}).values()
    disk_dir = tmp_path / "shared"
    first = engine(tiny_model_dir, disk_dir)
    run(first, {"a": shared + ids(92, 3)})
    evict_with_others(first, 500)
    first.close()
    restarted = engine(tiny_model_dir, disk_dir)
    peer = engine(tiny_model_dir, disk_dir)  # both live now, on one directory
    assert restarted.disk_tier is not None and peer.disk_tier is not None
    assert set(chain_hashes(shared, BS)) <= set(restarted.disk_tier.hashes())
    ((warm, cached),) = run(restarted, {"p": prompt}).values()
    assert cached == 4 * BS and restarted.disk_tier.stats.hits == 4
    assert_same(cold, warm)
    # a prefix the restarted engine writes after the peer started: the peer reads it from the files
    other = ids(93, 4 * BS)
    other_prompt = other + ids(94, 7)
    ((other_cold, _),) = run(
        engine(tiny_model_dir, tmp_path, prefix_caching=False), {"o": other_prompt}
    ).values()
    run(restarted, {"o1": other + ids(95, 2)})
    evict_with_others(restarted, 600)
    ((peer_warm, peer_cached),) = run(peer, {"o": other_prompt}).values()
    assert peer_cached == 4 * BS and peer.disk_tier.stats.hits == 4 and peer.disk_tier.stats.stores == 0
    assert_same(other_cold, peer_warm)


def test_the_byte_bound_holds_for_an_engine(tiny_model_dir, tmp_path) -> None:
    file_bytes = HEADER.size + block_bytes(ModelConfig.from_dir(tiny_model_dir), BS)
    eng = engine(tiny_model_dir, tmp_path / "d", kv_disk_bytes=10 * file_bytes + 7)
    for i in range(4):
        run(eng, {f"x{i}": ids(700 + i, 6 * BS + 3)})
    disk = eng.disk_tier
    assert disk is not None
    disk.flush()
    files = list(disk.dir.glob("*.kv"))
    assert disk.stats.evictions > 0 and len(files) == 10
    assert sum(f.stat().st_size for f in files) <= 10 * file_bytes + 7


def test_without_a_path_or_bytes_there_is_no_disk_tier(tiny_model_dir, tmp_path, caplog) -> None:
    eng = engine(tiny_model_dir, tmp_path, kv_disk_bytes=0)
    assert eng.disk_tier is None and eng.batcher.tier is None and eng.facts().disk_tier is None
    assert "needs both" in caplog.text


def test_two_writers_on_one_directory_keep_its_byte_bound(tmp_path) -> None:
    """Instances sharing the directory each list it again when another changed it, so their
    writes in turn stay within the bound together."""
    a = DiskTier(tmp_path, 6 * FILE, NS, background=False)
    b = DiskTier(tmp_path, 6 * FILE, NS, background=False)
    for i in range(20):
        (a if i % 2 else b).put(h(i), block(i))
        assert len(list(a.dir.glob("*.kv"))) <= 6
    assert a.stats.evictions + b.stats.evictions == 14
    assert b.read([h(19)]) == [block(19)]  # a's latest write, read by b


def test_a_block_whose_host_copy_is_corrupt_comes_from_its_disk_copy(tiny_model_dir, tmp_path) -> None:
    """The host tier's entry fails its checksum (dropped, counted); the same block's file on disk
    (written when the host tier evicted it earlier) serves it instead of a recompute."""
    host = HostTier(8 * 64, NS)
    disk = DiskTier(tmp_path, 8 * FILE, NS, background=False)
    written: list[tuple[list[int], bytes]] = []
    reader = TierReader(host, lambda blocks, data: written.append((blocks, data)), disk)
    for i in range(3):
        host.put(h(i), block(i))
        disk.put(h(i), block(i))
    entry = host._entries[host.key(h(1))]
    entry.data = bytes([7]) + entry.data[1:]  # flipped in host memory
    assert reader.plan([h(0), h(1), h(2)]) == 3
    assert reader.read([h(0), h(1), h(2)]) == [block(0), block(1), block(2)]
    assert host.stats.corrupt == 1 and host.stats.hits == 2 and disk.stats.hits == 1
    reader.missed(0)
    assert host.stats.misses == 1 and disk.stats.misses == 0  # the host tier missed one, disk none
