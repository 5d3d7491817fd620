"""The disk tier end to end (real workers, routers and Redis, files in a temporary directory): a
prompt whose prefix left the pool (and the host tier) is served from disk with the tokens and
logprobs of its cold miss, bit for bit, in a mixed stack and through a splitwise (P/D) stack whose
two instances share the directory; the registrations name one disk tier and count the read-backs,
and the tier's set in the prefix index lists only blocks whose files are there."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.tiers.disk_tier import HEADER
from pdserve.scheduler import Keys
from pdserve.stack import Stack
from tests.e2e.test_host_tier_serving import BS, complete, ids, tiers
from tests.e2e.test_serving import start_stack

pytestmark = pytest.mark.timeout(300)


def start(tiny_model_dir, redis_url: str, disk: Path, host_blocks: int, **counts) -> Stack:
    """A stack whose workers have a 40-block pool, a host tier of ``host_blocks`` blocks, and a
    disk tier of 256 blocks in ``disk`` (shared by them)."""
    bb = block_bytes(ModelConfig.from_dir(tiny_model_dir), BS)
    engine = EngineConfig(
        num_blocks=40,
        max_model_len=1024,
        threads=1,
        max_num_seqs=2,
        kv_host_bytes=host_blocks * bb,
        kv_disk_path=str(disk),
        kv_disk_bytes=256 * (HEADER.size + bb),
    )
    return start_stack(tiny_model_dir, redis_url, engine=engine, **counts)


def served_from_disk(stack: Stack, redis_url: str, disk: Path) -> None:
    prompt = ids(11, 10 * BS) + ids(12, 7)
    cold = complete(stack, prompt)
    assert cold[2] == 0
    for i in range(5):  # 5 x 11 blocks through a 39-block pool and an 8-block host tier
        complete(stack, ids(200 + i, 10 * BS + 3))
    warm = complete(stack, prompt)
    assert warm[:2] == cold[:2]  # the same tokens and logprobs, bit for bit
    assert warm[2] == 10 * BS  # every full block came back: from the pool or a tier
    cluster = stack.spec.cluster
    deadline = time.monotonic() + 5
    while not any(i.disk_tier and i.disk_tier.hits for i in tiers(redis_url, cluster).values()):
        assert time.monotonic() < deadline, tiers(redis_url, cluster)
        time.sleep(0.2)
    infos = tiers(redis_url, cluster).values()
    assert all(i.disk_tier is not None and i.disk_tier.corrupt == 0 for i in infos)
    (tier_id,) = {i.disk_tier.id for i in infos if i.disk_tier is not None}  # one tier per host dir
    # the tier's set claims only blocks whose files are there (the writers idle: they settle)
    (directory,) = {i.disk_tier.path for i in infos if i.disk_tier is not None}
    deadline = time.monotonic() + 8
    with redis.Redis.from_url(redis_url) as r:
        while True:
            listed = set(r.smembers(Keys(cluster).prefix_disk(tier_id)))
            files = {bytes.fromhex(p.name[:-3]) for p in Path(directory).glob("*.kv")}
            if listed == files or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert listed and listed == files and Path(directory).parent == disk


def test_a_mixed_instance_serves_an_evicted_prefix_from_disk(tiny_model_dir, redis_url, tmp_path) -> None:
    stack = start(tiny_model_dir, redis_url, tmp_path / "kv", host_blocks=8, mixed=1)
    try:
        served_from_disk(stack, redis_url, tmp_path / "kv")
    finally:
        assert stack.stop(grace_s=15) == []


def test_a_splitwise_pair_sharing_a_disk_tier_serves_an_evicted_prefix(
    tiny_model_dir, redis_url, tmp_path
) -> None:
    stack = start(tiny_model_dir, redis_url, tmp_path / "kv", host_blocks=0, prefill=1, decode=1)
    try:
        served_from_disk(stack, redis_url, tmp_path / "kv")
    finally:
        assert stack.stop(grace_s=15) == []
