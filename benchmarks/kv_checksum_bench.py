"""What the KV hand-off's checksums cost: hashing rates per MiB, and the share of time to first token.

Part 1 hashes SmolLM2-135M's KV blocks (16 tokens: 720 KiB each) with the algorithm pdserve uses
(``xxh3_64``) and the candidates it was picked against, beside a plain copy of the same bytes:
ms per MiB and GB/s (best and median of --reps). ``crc32c`` and ``blake3`` are measured where
their packages are installed (``pip install crc32c blake3``); the GPU digest (``wsum_i16``) runs
on torch's CPU device where torch is installed (on a GPU it runs on the card).

Part 2 serves the model splitwise (1 prefill + 1 decode over shared memory, the real engine) with
``--kv-checksum`` and ``--no-kv-checksum``, in alternating rounds, and sends prompts of 512 and
2048 distinct random tokens (no prefix-cache hit: every prompt is computed): the checksum's time is
in the prefill instance's KV write (it digests each chunk before it goes out; the first token is
published after the write), which the response's ``timing.kv_transfer_ms`` measures, so its share
of TTFT is (write with - write without) / TTFT. The decode side's check runs after the first token
(before the second): its time is reported beside it.

    python benchmarks/kv_checksum_bench.py [--reps 20] [--rounds 2] [--prompts 4] [--no-serve]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from harness import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, f32, 16-token blocks
NUM_BLOCKS = 128  # a 2048-token prompt's blocks
WARM_BLOCKS = 200  # the served stack's KV cache: a 2048-token prompt and a 512-token one fit


def candidates() -> dict[str, Callable[[memoryview], object]]:
    import xxhash

    out: dict[str, Callable[[memoryview], object]] = {
        "xxh3_64 (pdserve)": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "xxh64": xxhash.xxh64_intdigest,
        "zlib.crc32": zlib.crc32,
        "blake2b-64": lambda v: hashlib.blake2b(v, digest_size=8).digest(),
    }
    try:
        import crc32c

        out["crc32c (hw)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import blake3

        out["blake3"] = lambda v: blake3.blake3(v).digest()
    except ImportError:
        pass
    return out


def hash_rates(reps: int) -> dict[str, dict[str, float]]:
    cache = np.random.default_rng(0).integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    views = [cache[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES].data for i in range(NUM_BLOCKS)]
    copy_dst = np.empty_like(cache)

    def over_views(f: Callable[[memoryview], object]) -> Callable[[], object]:
        return lambda: [f(v) for v in views]

    fns: dict[str, Callable[[], object]] = {name: over_views(f) for name, f in candidates().items()}
    fns["memcpy (reference)"] = lambda: np.copyto(copy_dst, cache)
    try:
        import torch

        from pdserve.cache_transfer import checksum

        tensor = torch.from_numpy(cache)
        ids = list(range(NUM_BLOCKS))
        fns["wsum_i16 (pdserve, GPU; here torch CPU)"] = lambda: checksum.block_digests(
            tensor, ids, BLOCK_BYTES, checksum.DEVICE_ALGO
        )
    except ImportError:
        pass
    out = {}
    mib = cache.nbytes / 2**20
    for name, fn in fns.items():
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = {
            "best_gb_s": cache.nbytes / min(times) / 1e9,
            "median_gb_s": cache.nbytes / statistics.median(times) / 1e9,
            "median_ms_per_mib": statistics.median(times) * 1e3 / mib,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of each hash (default 20)")
    ap.add_argument(
        "--rounds", type=int, default=2, help="served rounds of each setting, alternating (default 2)"
    )
    ap.add_argument("--prompts", type=int, default=4, help="prompts of each length per round (default 4)")
    ap.add_argument(
        "--model", default="smollm2-135m", help="what the served part runs (default smollm2-135m)"
    )
    ap.add_argument("--no-serve", action="store_true", help="measure the hashing rates only")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_checksum.json")
    args = ap.parse_args()
    rates = hash_rates(args.reps)
    print_table(
        ["algorithm", "best GB/s", "median GB/s", "ms per MiB"],
        [
            [name, f"{r['best_gb_s']:.2f}", f"{r['median_gb_s']:.2f}", f"{r['median_ms_per_mib']:.3f}"]
            for name, r in rates.items()
        ],
        title=f"\nhashing {NUM_BLOCKS} SmolLM2 KV blocks ({NUM_BLOCKS * BLOCK_BYTES / 2**20:.0f} MiB), one core:",
    )
    report: dict[str, object] = {
        "block_bytes": BLOCK_BYTES,
        "hash_rates": rates,
    }
    if not args.no_serve:
        report["served"] = serve_ab(args.model, args.rounds, args.prompts, [512, 2048])
    write_json(args.out, report, args)
    return 0


def serve_ab(
    model: str, rounds: int, prompts: int, lengths: list[int]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per setting (checksum on/off) and prompt length: TTFT, the KV write and the decode side's
    check (medians over every prompt of every round), the stacks started in alternating rounds."""
    samples: dict[str, dict[int, dict[str, list[float]]]] = {
        s: {n: {"ttft_ms": [], "kv_transfer_ms": [], "second_token_ms": []} for n in lengths}
        for s in ("on", "off")
    }
    rng = random.Random(0)
    for r in range(rounds):
        for setting in ("on", "off") if r % 2 == 0 else ("off", "on"):
            stack = start(model, setting == "on")
            try:
                vocab = vocab_size(stack)
                for _ in range(-(-2 * WARM_BLOCKS * 16 // max(lengths))):  # every block written twice
                    one_request(
                        stack.urls[0],
                        stack.model.name,
                        [rng.randrange(100, vocab - 100) for _ in range(max(lengths))],
                    )
                for n in lengths:
                    for _ in range(prompts):
                        prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
                        ttft, second, timing = one_request(stack.urls[0], stack.model.name, prompt)
                        got = samples[setting][n]
                        got["ttft_ms"].append(ttft * 1e3)
                        got["second_token_ms"].append(second * 1e3)
                        got["kv_transfer_ms"].append(timing.get("kv_transfer_ms") or 0.0)
                    print(f"round {r + 1}, checksum {setting}, {n} tokens: done", flush=True)
            finally:
                stack.stop(grace_s=20)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for setting, by_len in samples.items():
        out[setting] = {str(n): {k: statistics.median(v) for k, v in m.items()} for n, m in by_len.items()}
    rows = []
    for n in lengths:
        on, off = out["on"][str(n)], out["off"][str(n)]
        share = (on["kv_transfer_ms"] - off["kv_transfer_ms"]) / off["ttft_ms"]
        out.setdefault("share", {})[str(n)] = {"ttft_share": share}
        rows.append(
            [
                n,
                f"{on['ttft_ms']:.0f} / {off['ttft_ms']:.0f}",
                f"{on['kv_transfer_ms']:.2f} / {off['kv_transfer_ms']:.2f}",
                f"{on['second_token_ms']:.1f} / {off['second_token_ms']:.1f}",
                f"{share:.2%}",
            ]
        )
    print()
    print_table(
        ["prompt", "TTFT on/off (ms)", "KV write on/off (ms)", "2nd token on/off (ms)", "TTFT share"], rows
    )
    return out


def start(model: str, checksum: bool):
    from pdserve.engine.config import EngineConfig
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec

    port = free_port()
    spec = StackSpec(
        model=model,
        port=port,
        prefill=1,
        decode=1,
        batch_workers=0,
        cluster=f"bench-{os.getpid()}-{port}",
        # a small cache, warmed up below: every block's pages mapped on both sides before the timed
        # prompts (a first write into a page of the decode instance's segment faults it in, which
        # would cost more than the checksum and vary with which blocks a request gets)
        engine=EngineConfig(max_model_len=4096, prefix_caching=False, num_blocks=WARM_BLOCKS),
        worker_options={"kv_checksum": checksum},
    )
    stack = Stack(spec)
    stack.start()
    stack.wait_ready()
    return stack


def vocab_size(stack) -> int:
    import httpx

    info = httpx.get(stack.urls[0] + "/v1/instances").json()["instances"]
    return min(i.get("vocab_size") or 49152 for i in info)


def one_request(url: str, model: str, prompt: list[int]) -> tuple[float, float, dict]:
    """A streamed completion of ``prompt``'s token ids, 2 tokens: (TTFT, the second token's gap,
    the response's ``timing``)."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first = second = None
    timing: dict = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0].get("text"):
                if first is None:
                    first = now
                elif second is None:
                    second = now
            timing = chunk.get("timing") or timing
    assert first is not None and second is not None, "the server sent fewer than 2 tokens"
    return first - t0, second - first, timing


if __name__ == "__main__":
    sys.exit(main())
