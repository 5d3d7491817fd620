"""The Mooncake KV transport: two transfer engines in this process, real bytes over real TCP."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from pdserve.cache_transfer.base import LocalCache
from pdserve.cache_transfer.mooncake import MooncakeAgent, MooncakeBackend
from pdserve.cache_transfer.regions import block_regions
from pdserve.cache_transfer.transports import TRANSPORTS, configured, open_writer
from pdserve.errors import TransferError

pytestmark = pytest.mark.usefixtures("mooncake_ready")

BLOCK = 4096
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def agents():
    """A prefill-side and a decode-side agent on loopback, each with a registered 'KV cache'."""
    src = np.random.default_rng(0).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    prefill, decode = MooncakeAgent("127.0.0.1"), MooncakeAgent("127.0.0.1")
    prefill.register(src)
    decode.register(dst)
    yield prefill, decode, src, dst
    prefill.close()
    decode.close()


def backend(agent: MooncakeAgent) -> MooncakeBackend:
    """The backend as the worker holds it, over an agent already open."""
    b = MooncakeBackend()
    b.agent = agent
    return b


def hand_off(prefill, decode, src, src_blocks, dst_blocks) -> int:
    writer = open_writer({"mooncake": backend(prefill)}, "mooncake", {"mooncake": decode.endpoint})
    return writer.write_blocks(src, block_regions(src_blocks, BLOCK), block_regions(dst_blocks, BLOCK))


def assert_moved(src, dst, src_blocks, dst_blocks) -> None:
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert np.array_equal(dst[d * BLOCK : (d + 1) * BLOCK], src[s * BLOCK : (s + 1) * BLOCK]), (s, d)


def test_scattered_blocks_arrive_in_block_table_order(agents) -> None:
    prefill, decode, src, dst = agents
    src_blocks = [5, 6, 7, 40, 2, 3, 63]  # runs merge into one descriptor each
    dst_blocks = [10, 11, 30, 31, 32, 0, 1]
    assert hand_off(prefill, decode, src, src_blocks, dst_blocks) == len(src_blocks) * BLOCK
    assert_moved(src, dst, src_blocks, dst_blocks)


def test_the_endpoint_says_where_to_write(agents) -> None:
    _prefill, decode, _src, dst = agents
    ep = decode.endpoint
    assert ep["session"].startswith("127.0.0.1:") and 15000 <= int(ep["session"].split(":")[1]) <= 17000
    assert (ep["addr"], ep["length"], ep["protocol"]) == (dst.ctypes.data, dst.nbytes, "tcp")


def test_a_write_past_the_peer_cache_is_refused_before_it_is_sent(agents) -> None:
    prefill, decode, src, _dst = agents
    with pytest.raises(TransferError, match="exceeds peer cache"):
        hand_off(prefill, decode, src, [0], [NUM_BLOCKS])


def test_an_unreachable_peer_is_a_transfer_error(agents) -> None:
    prefill, decode, src, _dst = agents
    gone = {**decode.endpoint, "session": "127.0.0.1:1"}
    writer = open_writer({"mooncake": backend(prefill)}, "mooncake", {"mooncake": gone})
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=r"mooncake write to 127\.0\.0\.1:1 failed"):
        writer.write_blocks(src, block_regions([0], BLOCK), block_regions([0], BLOCK))
    assert time.monotonic() - t0 < 5


def test_transfers_after_idle_gaps_longer_than_five_seconds(agents) -> None:
    """Mooncake 0.3.13 may fail the first batch after ~5 s idle (upstream #4209); the agent retries."""
    prefill, decode, src, dst = agents
    for gap in range(3):
        time.sleep(5.5)
        blocks = [gap * 8 + i for i in range(8)]
        src[blocks[0] * BLOCK : (blocks[-1] + 1) * BLOCK] = gap + 1  # new bytes each time
        assert hand_off(prefill, decode, src, blocks, blocks[::-1]) == 8 * BLOCK
        assert_moved(src, dst, blocks, blocks[::-1])


def test_without_an_agent_or_an_endpoint_there_is_no_mooncake(agents) -> None:
    _prefill, decode, _src, _dst = agents
    with pytest.raises(TransferError, match="does not offer the mooncake transport"):
        open_writer({}, "mooncake", {"mooncake": decode.endpoint})
    with pytest.raises(TransferError, match="no mooncake endpoint"):
        open_writer({"mooncake": backend(decode)}, "mooncake", {"shm": "x"})


def test_the_backend_opens_an_engine_over_the_cache_and_advertises_it() -> None:
    """As a worker starts it: options by its flags' names, the whole cache registered, the endpoint
    what the registration publishes; closed, it advertises nothing."""
    assert TRANSPORTS["mooncake"] is MooncakeBackend and "mooncake" in configured(
        "auto", {"transfer_address": "127.0.0.1"}
    )
    cache = np.zeros(4 * BLOCK, dtype=np.uint8)
    b = MooncakeBackend.from_options(
        {"transfer_address": "127.0.0.1", "mooncake_protocol": "tcp", "role": "x"}
    )
    b.open(LocalCache(cache))
    try:
        ep = b.endpoint()
        assert ep["session"].startswith("127.0.0.1:") and (ep["addr"], ep["length"]) == (
            cache.ctypes.data,
            cache.nbytes,
        )
    finally:
        b.close()
    assert b.agent is not None and b.agent._buffer is None  # unregistered


def test_explicitly_asked_for_without_the_wheel_it_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['mooncake'] = None\n"
        "import numpy as np\n"
        "from pdserve.cache_transfer.base import LocalCache\n"
        "from pdserve.cache_transfer.transports import configured, open_backends\n"
        "from pdserve.errors import ConfigError\n"
        "print(configured('auto'), configured('mooncake'))\n"
        "try:\n    open_backends(['mooncake'], {}, LocalCache(np.zeros(8, np.uint8)))\n"
        "except ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "['shm'] ['mooncake']" in out.stdout and "pip install 'pdserve[mooncake]'" in out.stdout, out


def test_a_missing_wheel_names_what_to_install() -> None:
    code = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from pdserve.cache_transfer.mooncake import load_engine_class\n"
        "from pdserve.errors import ConfigError\n"
        "try:\n    load_engine_class()\nexcept ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'pdserve[mooncake]'" in out.stdout, out


def test_a_gpu_cache_is_staged_through_bounded_host_memory_never_handed_back() -> None:
    """A cache in device memory goes through host staging (staging.py): P's blocks device -> its
    bounce buffer (in pieces of at most its size), Mooncake -> the extent D reserved in its landing
    pool, D's ``land`` -> its device blocks. Both buffers are a bounded size (not the cache's), are
    registered once and keep their bytes (no page is handed back: an RDMA NIC still reaches them);
    an extent is reused only once released, and a full pool refuses a reservation. The staging's
    own code runs here on torch's CPU device standing in for the GPU; the bytes cross real TCP."""
    torch = pytest.importorskip("torch", reason="staging a GPU cache needs PyTorch")
    from pdserve.cache_transfer.base import NoLandingRoom

    block, blocks = 64 << 10, 64  # a 4 MiB cache; P's bounce 1 MiB (16 blocks), D's pool 2 MiB (32)
    src = torch.from_numpy(np.random.default_rng(1).integers(0, 256, blocks * block, dtype=np.uint8))
    dst = torch.zeros(blocks * block, dtype=torch.uint8)
    prefill, decode = MooncakeBackend("127.0.0.1", staging_mb=1), MooncakeBackend("127.0.0.1", staging_mb=2)
    prefill.open(LocalCache(src, device="cuda", block_bytes=block))
    decode.open(LocalCache(dst, device="cuda", block_bytes=block, shared=True))
    try:
        assert prefill.staging is not None and decode.staging is not None
        assert (prefill.staging.nbytes, decode.staging.nbytes) == (1 << 20, 2 << 20)
        assert prefill.reserve_landing(block) is None  # a prefill's staging is no landing pool
        endpoint = decode.endpoint()
        assert endpoint is not None and endpoint["length"] == 2 << 20  # the pool is what peers write
        assert endpoint["addr"] == decode.staging.buffer.ctypes.data
        src_blocks = [3, 4, 9, 60, *range(20, 36)]  # 20 blocks: more than P's bounce holds at once
        dst_blocks = [50, 51, 7, 0, *range(10, 26)]
        n = len(src_blocks) * block
        at = decode.reserve_landing(n)
        assert at is not None and decode.staging.free_bytes == (2 << 20) - n
        with pytest.raises(NoLandingRoom):
            decode.reserve_landing(16 * block)  # 12 blocks left
        writer = open_writer({"mooncake": prefill}, "mooncake", {"mooncake": endpoint})
        assert writer.write_blocks(src, block_regions(src_blocks, block), [(at, n)]) == n
        assert not dst.any()  # in D's pool only: the cache changes when the bytes land
        decode.land(block_regions(dst_blocks, block), at)
        out, want = dst.numpy(), src.numpy()
        for s_, d in zip(src_blocks, dst_blocks, strict=True):
            assert np.array_equal(out[d * block : (d + 1) * block], want[s_ * block : (s_ + 1) * block])
        untouched = sorted(set(range(blocks)) - set(dst_blocks))
        assert not any(out[b * block : (b + 1) * block].any() for b in untouched)
        pool = decode.staging.buffer[at : at + n]
        assert np.array_equal(pool[:block], want[3 * block : 4 * block])  # kept: never handed back
        decode.release_landing(at, n)
        assert decode.staging.free_bytes == 2 << 20
        assert decode.reserve_landing(32 * block) == 0  # released extents merge back into one
    finally:
        prefill.close()
        decode.close()
