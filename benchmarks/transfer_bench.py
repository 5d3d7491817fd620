"""KV transfer speed: shm and Mooncake TCP next to a plain memory copy of the same bytes, in one run.

The geometry is the `small` preset's (ERNIE-4.5-0.3B shape: 18 layers, 2 KV heads of 64, fp32,
16-token blocks: 288 KiB a block). Two cases, with block ids drawn at random on both sides:
one 512-token prompt (32 blocks, 9 MiB) and 64 scattered blocks (18 MiB). The decode side is a
child process that owns its cache in POSIX shared memory and registers it with its own Mooncake
engine, as a decode instance does; this process writes into it through each transport (the
`write_blocks` call a prefill instance makes) and, for the baseline, copies the same segments
between two local arrays. Every path's bytes are checked once at the receiver. Prints a table of
GB/s (best and median of --reps), writes JSON.

    python benchmarks/transfer_bench.py [--reps 20] [--out benchmarks/results/transfer.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE_BYTES = 18, 2, 64, 16, 4
BLOCK_BYTES = 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE_BYTES
NUM_BLOCKS = 256
CASES = {"prompt_512_tokens": 32, "scattered_64_blocks": 64}
OPTIONS = {"transfer_address": "127.0.0.1", "mooncake_protocol": "tcp"}  # the worker flags backends read


def decode_side(conn, protocols: list[str]) -> None:
    """The child: a shared-memory cache with each transport's local side over it, as a decode
    worker opens them; sends their endpoints, then answers checksum requests."""
    from pdserve.cache_transfer import shm
    from pdserve.cache_transfer.base import LocalCache
    from pdserve.cache_transfer.transports import close_backends, open_backends

    segment = shm.create_segment(f"pdserve-bench-{os.getpid()}", NUM_BLOCKS * BLOCK_BYTES)
    cache = np.ndarray((NUM_BLOCKS * BLOCK_BYTES,), dtype=np.uint8, buffer=segment.buf)
    backends = open_backends(protocols, OPTIONS, LocalCache(cache, segment.name))
    conn.send({protocol: backend.endpoint() for protocol, backend in backends.items()})
    while (msg := conn.recv()) is not None:
        conn.send(digest(cache, msg))
    close_backends(backends)
    del cache
    segment.close()  # and removes it


def digest(cache: np.ndarray, blocks: list[int]) -> str:
    h = hashlib.sha256()
    for b in blocks:
        h.update(cache[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES].data)
    return h.hexdigest()


def mover(transport, src: np.ndarray, local_dst: np.ndarray, segments, src_r, dst_r):
    """One hand-off's bytes through ``transport``, or (None) the same segments copied locally."""
    if transport is not None:
        return lambda: transport.write_blocks(src, src_r, dst_r)

    def copy() -> None:
        for s, d, k in segments:
            np.copyto(local_dst[d : d + k], src[s : s + k])

    return copy


def timed(fn, reps: int) -> list[float]:
    fn()  # warm-up (first Mooncake write opens the session)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per path and case (default 20)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "transfer.json")
    args = ap.parse_args()

    from pdserve.cache_transfer import mooncake
    from pdserve.cache_transfer.base import LocalCache
    from pdserve.cache_transfer.regions import block_regions, pair_regions
    from pdserve.cache_transfer.transports import close_backends, configured, open_backends, open_writer

    protocols = configured("auto", OPTIONS)
    if mooncake.PROTOCOL not in protocols:
        print(
            "mooncake is not available here (pip install 'pdserve[mooncake]'): measuring shm only",
            file=sys.stderr,
        )
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=decode_side, args=(child, protocols))
    proc.start()
    endpoint = parent.recv()
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    local_dst = np.zeros_like(src)
    backends = open_backends(protocols, OPTIONS, LocalCache(src))
    names = {mooncake.PROTOCOL: "mooncake_tcp"}  # the path names of earlier results
    paths = {"memcpy": None} | {names.get(p, p): open_writer(backends, p, endpoint) for p in protocols}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for case, n in CASES.items():
        src_blocks = [int(b) for b in rng.choice(NUM_BLOCKS, n, replace=False)]
        dst_blocks = [int(b) for b in rng.choice(NUM_BLOCKS, n, replace=False)]
        src_r, dst_r = block_regions(src_blocks, BLOCK_BYTES), block_regions(dst_blocks, BLOCK_BYTES)
        segments = pair_regions(src_r, dst_r)
        nbytes = n * BLOCK_BYTES
        want = digest(src, src_blocks)
        results[case] = {}
        for name, transport in paths.items():
            times = timed(mover(transport, src, local_dst, segments, src_r, dst_r), args.reps)
            if transport is None:
                got = digest(local_dst, dst_blocks)
            else:
                parent.send(dst_blocks)
                got = parent.recv()
            if got != want:
                raise SystemExit(f"{name}/{case}: the receiver's bytes differ from the sender's")
            results[case][name] = {
                "bytes": nbytes,
                "best_gb_s": nbytes / min(times) / 1e9,
                "median_gb_s": nbytes / statistics.median(times) / 1e9,
                "median_ms": statistics.median(times) * 1e3,
            }
    parent.send(None)
    proc.join(30)
    for transport in paths.values():
        if transport is not None:
            transport.close()
    close_backends(backends)
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "geometry": {"block_bytes": BLOCK_BYTES, "preset": "small"},
        "reps": args.reps,
        "results": results,
    }
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def print_table(results: dict) -> None:
    print(
        f"\n{'case':<22} {'path':<14} {'MiB':>6} {'best GB/s':>10} {'median GB/s':>12} {'median ms':>10} {'vs memcpy':>10}"
    )
    for case, paths in results.items():
        base = paths["memcpy"]["median_gb_s"]
        for name, r in paths.items():
            print(
                f"{case:<22} {name:<14} {r['bytes'] / 2**20:>6.1f} {r['best_gb_s']:>10.2f} "
                f"{r['median_gb_s']:>12.2f} {r['median_ms']:>10.2f} {r['median_gb_s'] / base:>9.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
