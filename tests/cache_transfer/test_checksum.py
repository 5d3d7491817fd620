"""KV block digests: any one byte changed anywhere in a block changes that block's digest (host
caches: XXH3 over numpy memory; GPU caches: the weighted sum, run here on torch's CPU device), the
same bytes give the same digests in any process, and a message's digests are checked for shape."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from pdserve.cache_transfer import checksum
from pdserve.errors import TransferError

BLOCK = 4096
NUM_BLOCKS = 8


def cache(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)


def torch_view(view: np.ndarray):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(view.copy())


@pytest.mark.parametrize("device", [False, True], ids=["host-xxh3", "device-wsum"])
def test_one_byte_changed_anywhere_changes_its_blocks_digest_only(device) -> None:
    view = cache()
    kv = torch_view(view) if device else view
    ids = [5, 0, 3, 7]
    before = checksum.block_digests(kv, ids, BLOCK)
    assert len(before) == len(ids) * checksum.DIGEST_BYTES
    rng = random.Random(1)
    for _ in range(300):
        i = rng.randrange(len(ids))
        at = ids[i] * BLOCK + rng.randrange(BLOCK)
        flip = rng.choice([0x01, 0x80, 0xFF, rng.randrange(1, 256)])
        kv[at] ^= flip
        after = checksum.block_digests(kv, ids, BLOCK)
        kv[at] ^= flip
        assert checksum.first_mismatch(before, after) == i
        assert all(before[j * 8 : j * 8 + 8] == after[j * 8 : j * 8 + 8] for j in range(len(ids)) if j != i)
    assert checksum.block_digests(kv, ids, BLOCK) == before


def test_the_device_digest_is_the_same_in_another_process() -> None:
    """Its weights come from a fixed seed: a prefill and a decode process agree."""
    pytest.importorskip("torch")
    here = checksum.block_digests(torch_view(cache(3)), [1, 2], BLOCK).hex()
    code = (
        "import numpy as np, torch; from pdserve.cache_transfer import checksum; "
        f"v = np.random.default_rng(3).integers(0, 256, {NUM_BLOCKS * BLOCK}, dtype=np.uint8); "
        f"print(checksum.block_digests(torch.from_numpy(v), [1, 2], {BLOCK}).hex())"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == here


def test_the_algorithm_follows_where_the_cache_lives() -> None:
    assert checksum.algo_for(cache()) == checksum.HOST_ALGO
    assert checksum.algo_for(torch_view(cache())) == checksum.DEVICE_ALGO
    with pytest.raises(TransferError, match="unknown KV digest algorithm"):
        checksum.block_digests(cache(), [0], BLOCK, "md5")


def test_digests_travel_as_one_per_block() -> None:
    digests = checksum.block_digests(cache(), [1, 2, 3], BLOCK)
    assert checksum.decode(checksum.encode(digests), 3) == digests
    with pytest.raises(TransferError, match="2 KV digests for 3 blocks"):
        checksum.decode(checksum.encode(digests[:16]), 3)
    with pytest.raises(TransferError, match="not base64"):
        checksum.decode("@@@", 3)
    assert checksum.first_mismatch(digests, digests) is None
    assert checksum.first_mismatch(digests, digests[:8]) == 1
