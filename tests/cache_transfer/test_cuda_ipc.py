"""The cuda_ipc KV transport: its endpoint, byte segments as whole blocks, the gather/scatter copy
(on torch CPU tensors here), what a host without a GPU says, and, on a GPU host, a real push into
another process's cache over CUDA IPC."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pdserve.cache_transfer.base import LocalCache
from pdserve.cache_transfer.cuda_ipc import (
    CudaIpcBackend,
    CudaIpcEndpoint,
    CudaIpcWriter,
    as_blocks,
    host_id,
    pid_namespace,
    push_blocks,
    segment_blocks,
)
from pdserve.cache_transfer.regions import block_regions, pair_regions
from pdserve.cache_transfer.transports import configured, open_writer
from pdserve.errors import ConfigError, TransferError

BLOCK = 256
NUM_BLOCKS = 32


def endpoint(**changes) -> CudaIpcEndpoint:
    """An endpoint as a decode instance on this host would advertise it (the handle made up)."""
    fields = dict(
        handle=bytes(range(64)),
        storage_bytes=NUM_BLOCKS * BLOCK + 4096,
        storage_offset=2 << 20,
        view_offset=4096,
        nbytes=NUM_BLOCKS * BLOCK,
        block_bytes=BLOCK,
        ref_counter=b"/torch_123_456",
        ref_counter_offset=7,
        event=bytes(64),
        event_sync=True,
        device_uuid="GPU-0c6d2b3e-0000-1111-2222-333344445555",
        pci_bus_id="0000:18:00.0",
        device_name="NVIDIA H200",
        host=host_id(),
        pid=os.getpid(),
        pid_namespace=pid_namespace(),
    )
    return CudaIpcEndpoint(**{**fields, **changes})


def test_the_endpoint_round_trips_through_json() -> None:
    ep = endpoint()
    wire = json.loads(json.dumps(ep.to_json()))  # what the registration carries
    assert isinstance(wire["handle"], str) and wire["pid"] == os.getpid()
    assert CudaIpcEndpoint.from_json(wire) == ep
    assert ep.num_blocks == NUM_BLOCKS


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda w: w.pop("handle"), "lacks handle"),
        (lambda w: w.update(handle="not base64!"), "malformed handle"),
        (lambda w: w.update(nbytes=NUM_BLOCKS * BLOCK + 1), "inconsistent"),
        (lambda w: w.update(view_offset=8192), "inconsistent"),  # past the storage's end
        (lambda w: w.update(block_bytes=0), "inconsistent"),
    ],
)
def test_a_malformed_endpoint_is_a_transfer_error(change, says: str) -> None:
    wire = endpoint().to_json()
    change(wire)
    with pytest.raises(TransferError, match=says):
        CudaIpcEndpoint.from_json(wire)
    with pytest.raises(TransferError, match="not an object"):
        CudaIpcEndpoint.from_json("pdserve-d0")


def test_segments_become_block_indices_in_block_table_order() -> None:
    src_blocks, dst_blocks = [5, 6, 7, 20, 2, 3], [10, 11, 30, 31, 0, 1]
    segments = pair_regions(block_regions(src_blocks, BLOCK), block_regions(dst_blocks, BLOCK))
    assert len(segments) < len(src_blocks)  # merged runs: still whole blocks
    assert segment_blocks(segments, BLOCK) == (src_blocks, dst_blocks)
    assert segment_blocks([], BLOCK) == ([], [])


@pytest.mark.parametrize(
    "segment",
    [(BLOCK // 2, 0, BLOCK), (0, 3, BLOCK), (0, 0, BLOCK + 1), (0, 0, 0)],
    ids=["src-offset", "dst-offset", "length", "empty"],
)
def test_a_segment_of_part_of_a_block_is_refused(segment) -> None:
    with pytest.raises(TransferError, match=f"not whole blocks of {BLOCK} bytes"):
        segment_blocks([(0, 0, BLOCK), segment], BLOCK)


@pytest.fixture
def caches():
    """A prefill cache of random bytes and a decode cache of a known pattern, as flat uint8 tensors."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (NUM_BLOCKS * BLOCK,), dtype=torch.uint8, generator=g)
    dst = torch.arange(NUM_BLOCKS * BLOCK, dtype=torch.int64).remainder(251).to(torch.uint8)
    return src, dst


@pytest.mark.parametrize("max_rows", [None, 2], ids=["one-gather", "chunked"])
def test_the_push_writes_exactly_the_reserved_blocks(caches, max_rows) -> None:
    """Scattered, non-contiguous block lists: each destination block gets its source block's bytes,
    every other byte of the destination is bitwise untouched, the source is unchanged."""
    src, dst = caches
    before, src_before = dst.clone(), src.clone()
    src_blocks, dst_blocks = [9, 3, 4, 5, 31, 0, 17], [2, 29, 30, 12, 7, 8, 1]
    segments = pair_regions(block_regions(src_blocks, BLOCK), block_regions(dst_blocks, BLOCK))
    s, d = segment_blocks(segments, BLOCK)
    moved = push_blocks(as_blocks(src, BLOCK), as_blocks(dst, BLOCK), s, d, max_rows=max_rows)
    assert moved == len(src_blocks) * BLOCK
    got, want = dst.view(NUM_BLOCKS, BLOCK), src.view(NUM_BLOCKS, BLOCK)
    for sb, db in zip(src_blocks, dst_blocks, strict=True):
        assert got[db].equal(want[sb]), (sb, db)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
    assert got[untouched].equal(before.view(NUM_BLOCKS, BLOCK)[untouched])
    assert src.equal(src_before)


def test_the_push_checks_indices_before_touching_the_device(caches) -> None:
    """On a GPU an index out of range is a device-side assert that poisons the CUDA context: the
    push refuses it (and a block written twice) on the host, leaving the cache as it was."""
    src, dst = caches
    before = dst.clone()
    a, b = as_blocks(src, BLOCK), as_blocks(dst, BLOCK)
    with pytest.raises(
        TransferError, match=f"destination block {NUM_BLOCKS} outside a cache of {NUM_BLOCKS}"
    ):
        push_blocks(a, b, [1, 2], [3, NUM_BLOCKS])
    with pytest.raises(TransferError, match="source block 40 outside"):
        push_blocks(a, b, [40], [3])
    with pytest.raises(TransferError, match="written twice"):
        push_blocks(a, b, [1, 2], [3, 3])
    with pytest.raises(TransferError, match="2 source blocks for 1 destination"):
        push_blocks(a, b, [1, 2], [3])
    with pytest.raises(TransferError, match="block sizes differ"):
        push_blocks(a, as_blocks(dst, BLOCK * 2), [1], [1])
    with pytest.raises(TransferError, match="not contiguous blocks"):
        as_blocks(src[:-1], BLOCK)
    assert dst.equal(before)


def test_a_writer_refuses_another_host_or_another_block_size(caches) -> None:
    src, _ = caches
    local = LocalCache(src, device="cuda", block_bytes=BLOCK)
    with pytest.raises(TransferError, match=r"on another host .* \(across hosts, mooncake\)"):
        CudaIpcWriter(endpoint(host="another-boot-id").to_json(), local)
    with pytest.raises(TransferError, match=f"block sizes differ: {BLOCK * 2} vs {BLOCK}"):
        CudaIpcWriter(endpoint().to_json(), LocalCache(src, device="cuda", block_bytes=BLOCK * 2))
    writer = CudaIpcWriter(endpoint().to_json(), local)  # opens nothing until it writes
    assert writer.write(src, []) == 0
    assert writer.current()  # the owner (this process here) is alive
    writer.close()


def test_a_writer_to_a_dead_owner_is_no_longer_current(caches) -> None:
    """A dead decode instance's GPU memory is freed only when every mapping of it is closed: the
    worker's housekeeping prunes writers that are not current."""
    src, _ = caches
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    writer = CudaIpcWriter(endpoint(pid=int(gone.stdout)).to_json(), LocalCache(src, device="cuda"))
    assert not writer.current()
    elsewhere = endpoint(pid=int(gone.stdout), pid_namespace=(pid_namespace() or 0) + 1)
    assert CudaIpcWriter(elsewhere.to_json(), LocalCache(src, device="cuda")).current()  # cannot tell


def test_this_host_without_a_gpu_leaves_cuda_ipc_out_and_says_why(caplog) -> None:
    reason = CudaIpcBackend.unavailable()
    if reason is None:
        pytest.skip("this host has a CUDA device")
    assert reason == "torch is not installed" or "without CUDA" in reason or "no CUDA device" in reason
    assert CudaIpcBackend.left_out_of_auto({"device": "cuda"}) == reason
    assert (
        CudaIpcBackend.left_out_of_auto({})
        == "cuda_ipc moves KV caches in GPU memory, and this instance's is on cpu"
    )
    with pytest.raises(ConfigError, match=f"cannot run here: {re.escape(reason)}"):
        CudaIpcBackend().open(LocalCache(np.zeros(BLOCK, np.uint8), device="cuda", block_bytes=BLOCK))
    with caplog.at_level(logging.INFO, logger="pdserve.cache_transfer.transports"):
        assert configured("auto", {"device": "cuda"}) == []
    assert "cuda_ipc left out (--kv-transfer auto): " + reason in caplog.text


def test_auto_on_a_gpu_offers_cuda_ipc_and_the_staged_mooncake_not_shm(monkeypatch, caplog) -> None:
    """shm maps host memory: a GPU instance's ``auto`` leaves it out and says why; mooncake stages
    through a host mirror (staging.py), offered where its address is given, after cuda_ipc."""
    from pdserve.cache_transfer.mooncake import MooncakeBackend

    monkeypatch.setattr(CudaIpcBackend, "unavailable", classmethod(lambda cls: None))
    monkeypatch.setattr(MooncakeBackend, "unavailable", classmethod(lambda cls: None))
    options = {"device": "cuda", "transfer_address": "10.0.0.2"}
    with caplog.at_level(logging.INFO, logger="pdserve.cache_transfer.transports"):
        assert configured("auto", options) == ["mooncake", "cuda_ipc"]
    assert (
        "shm left out (--kv-transfer auto): the shm transport copies KV caches in host memory" in caplog.text
    )
    assert configured("auto", {"transfer_address": "10.0.0.2"}) == ["shm", "mooncake"]  # a CPU instance


def test_the_cpu_path_never_loads_torch() -> None:
    """A CPU instance imports the transports, asks ``auto`` and ``both`` and opens shm: no torch."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from pdserve.cache_transfer import transports
        from pdserve.cache_transfer.base import LocalCache
        assert transports.configured("auto", {"device": "cpu"}) == ["shm"]
        assert transports.configured("both") == ["shm", "mooncake"]
        backends = transports.open_backends(["shm"], {}, LocalCache(np.zeros(64, np.uint8)))
        transports.close_backends(backends)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- a real push between two processes (a GPU host only) ------------------------------------------
DECODE = textwrap.dedent(
    """
    import json, sys
    import torch
    from pdserve.cache_transfer.base import LocalCache
    from pdserve.cache_transfer.cuda_ipc import CudaIpcBackend

    block, n, pad = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    whole = torch.full((pad + n * block,), 7, dtype=torch.uint8, device="cuda:0")
    cache = whole[pad:]  # the cache starts inside its storage: the view offset travels too
    cache.zero_()
    backend = CudaIpcBackend()
    backend.open(LocalCache(cache, device="cuda", block_bytes=block, shared=True))
    print(json.dumps(backend.endpoint()), flush=True)
    pairs = json.loads(sys.stdin.readline())
    g = torch.Generator().manual_seed(1234)
    want = torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=g)
    got = cache.view(n, block).cpu()
    for s, d in pairs:
        assert got[d].equal(want[s]), (s, d)
    written = {d for _, d in pairs}
    assert not got[[b for b in range(n) if b not in written]].any(), "a block not reserved was written"
    assert (whole[:pad] == 7).all().item(), "bytes before the cache were written"
    backend.close()
    print("ok", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("local_gpu", [0, 1], ids=["same-gpu", "peer-gpu"])
def test_a_prefill_pushes_blocks_into_another_processes_gpu_cache(local_gpu: int) -> None:
    """The decode process allocates and exports its cache; this process opens the handle once,
    pushes scattered blocks with one gather/scatter, and the decode process finds exactly those
    blocks' bytes in exactly the reserved places (with two GPUs, also from the other GPU)."""
    reason = CudaIpcBackend.unavailable()
    if reason is not None:
        pytest.skip(f"needs a CUDA GPU: {reason}")
    import torch

    if local_gpu >= torch.cuda.device_count():
        pytest.skip(f"needs {local_gpu + 1} GPUs, this host has {torch.cuda.device_count()}")
    block, n, pad = 4096, 64, 512
    decode = subprocess.Popen(
        [sys.executable, "-c", DECODE, str(block), str(n), str(pad)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        peer = json.loads(decode.stdout.readline() or "null")
        assert peer is not None, decode.stderr.read()
        g = torch.Generator().manual_seed(1234)
        src = torch.randint(0, 256, (n * block,), dtype=torch.uint8, generator=g).to(f"cuda:{local_gpu}")
        prefill = CudaIpcBackend()
        prefill.open(LocalCache(src, device="cuda", block_bytes=block))
        assert prefill.endpoint() is None  # a prefill's cache is not exported
        writer = open_writer({"cuda_ipc": prefill}, "cuda_ipc", {"cuda_ipc": peer})
        src_blocks, dst_blocks = [5, 6, 7, 40, 2, 3, 63, 0], [10, 11, 30, 31, 32, 1, 2, 50]
        moved = writer.write_blocks(src, block_regions(src_blocks, block), block_regions(dst_blocks, block))
        assert moved == len(src_blocks) * block
        assert writer.current()
        out, err = decode.communicate(json.dumps(list(zip(src_blocks, dst_blocks))) + "\n", timeout=120)
        assert decode.returncode == 0 and out.strip() == "ok", err
        assert not writer.current()  # the owner is gone: housekeeping would close it
        writer.close()
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()
