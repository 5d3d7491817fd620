"""The hand-off cell of benchmarks/gpu_bench.py: a prompt's KV in the llama3-8b shape pushed over
pdserve.cache_transfer.cuda_ipc from this process's GPU cache into a second process's, as a
prefill instance pushes into a decode instance's; per push (the median), GB/s, the bytes checked
on the far side, and the same gather/scatter within one process beside it.

The three ``ipc_*`` functions are all this file knows of the transport's API.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from typing import Any

import numpy as np
from gpu_cells import Opts, Recorder, Skip, preset_name, torch_setup


def ipc_backend(flat: Any, block_bytes: int, shared: bool) -> Any:
    """An open CudaIpcBackend over a flat uint8 CUDA cache (``shared``: the decode side, exported)."""
    from pdserve.cache_transfer.base import LocalCache
    from pdserve.cache_transfer.cuda_ipc import CudaIpcBackend

    backend = CudaIpcBackend()
    backend.open(LocalCache(view=flat, device="cuda", block_bytes=block_bytes, shared=shared))
    return backend


def ipc_segments(
    src_blocks: list[int], dst_blocks: list[int], block_bytes: int
) -> list[tuple[int, int, int]]:
    from pdserve.cache_transfer.regions import block_regions, pair_regions

    return pair_regions(block_regions(src_blocks, block_bytes), block_regions(dst_blocks, block_bytes))


def ipc_local_push(src: Any, dst: Any, src_blocks: list[int], dst_blocks: list[int]) -> None:
    from pdserve.cache_transfer.cuda_ipc import push_blocks

    push_blocks(src, dst, src_blocks, dst_blocks)


def rows_digest(flat: Any, block_bytes: int, blocks: list[int]) -> str:
    import torch

    idx = torch.tensor(blocks, dtype=torch.long, device=flat.device)
    rows = flat.view(-1, block_bytes).index_select(0, idx).cpu().numpy()
    return hashlib.sha256(rows.tobytes()).hexdigest()


def handoff_decode_side(conn: Any, num_blocks: int, block_bytes: int) -> None:
    """The decode process: a zeroed cache exported over CUDA IPC; answers digests until told to stop."""
    import torch

    flat = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8, device="cuda")
    backend = ipc_backend(flat, block_bytes, shared=True)
    conn.send({"endpoint": backend.endpoint()})
    while True:
        msg = conn.recv()
        if msg.get("stop"):
            break
        torch.cuda.synchronize()
        conn.send({"digest": rows_digest(flat, block_bytes, msg["blocks"])})
    backend.close()


def job_handoff(rec: Recorder, o: Opts, preset: str | None) -> None:
    def cell() -> dict:
        if o.device != "cuda":
            raise Skip("CUDA IPC needs a GPU (the cell runs on the GPU machine)")
        torch = torch_setup(o)
        import multiprocessing as mp

        from pdserve.engine.models.model_init import PRESETS

        cfg = PRESETS[preset_name("llama3-8b")]
        block_size, itemsize = 16, 2
        block_bytes = (
            2
            * cfg["num_hidden_layers"]
            * block_size
            * cfg["num_key_value_heads"]
            * cfg["head_dim"]
            * itemsize
        )
        nblk = -(-o.prefill_len // block_size)
        rng = np.random.default_rng(0)
        src_blocks = (1 + rng.permutation(2 * nblk)[:nblk]).tolist()  # scattered, as a busy cache's
        d_total = 4 * nblk + 1
        dst_blocks = (1 + rng.permutation(d_total - 1)[:nblk]).tolist()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=handoff_decode_side, args=(child, d_total, block_bytes), daemon=True)
        proc.start()
        try:
            if not parent.poll(30):
                raise RuntimeError("the decode process did not export its cache within 30 s")
            endpoint = parent.recv()["endpoint"]
            flat = torch.randint(0, 256, ((2 * nblk + 1) * block_bytes,), dtype=torch.uint8, device="cuda")
            backend = ipc_backend(flat, block_bytes, shared=False)
            writer = backend.writer(json.loads(json.dumps(endpoint)))  # as it travels through Redis
            segments = ipc_segments(src_blocks, dst_blocks, block_bytes)
            t0 = time.perf_counter()
            moved = writer.write(flat, segments)  # opens the peer's cache: timed apart
            first_s = time.perf_counter() - t0
            times = []
            for _ in range(o.handoff_reps):
                t0 = time.perf_counter()
                writer.write(flat, segments)  # returns once the bytes have landed
                times.append(time.perf_counter() - t0)
            parent.send({"blocks": dst_blocks})
            if not parent.poll(60):
                raise RuntimeError("the decode process did not answer with its digest")
            match = parent.recv()["digest"] == rows_digest(flat, block_bytes, src_blocks)
            # the same gather/scatter within this process: the copy's own cost
            local = torch.zeros(d_total * block_bytes, dtype=torch.uint8, device="cuda")
            src2d, dst2d = flat.view(-1, block_bytes), local.view(-1, block_bytes)
            ipc_local_push(src2d, dst2d, src_blocks, dst_blocks)
            torch.cuda.synchronize()
            local_times = []
            for _ in range(o.handoff_reps):
                t0 = time.perf_counter()
                ipc_local_push(src2d, dst2d, src_blocks, dst_blocks)
                torch.cuda.synchronize()
                local_times.append(time.perf_counter() - t0)
            writer.close()
            backend.close()
        finally:
            with contextlib.suppress(Exception):
                parent.send({"stop": True})
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        med = statistics.median(times)
        local_med = statistics.median(local_times)
        return {
            "status": "ok" if match and moved == nblk * block_bytes else "fail",
            "tokens": o.prefill_len,
            "blocks": nblk,
            "block_bytes": block_bytes,
            "bytes": nblk * block_bytes,
            "segments": len(segments),
            "first_push_ms": first_s * 1e3,
            "push_ms_median": med * 1e3,
            "push_ms_p90": float(np.percentile(times, 90)) * 1e3,
            "GB_s": nblk * block_bytes / med / 1e9,
            "local_push_ms_median": local_med * 1e3,
            "local_GB_s": nblk * block_bytes / local_med / 1e9,
            "bytes_match": match,
            "note": "GB/s: bytes moved (read once, written once) over the median push",
        }

    rec.cell("cuda_ipc", 40, cell)
