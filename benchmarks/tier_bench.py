"""The host and disk tiers on a multi-tenant long-context workload: what reading evicted blocks back saves.

T tenants (default 24), each with its own long context (2-4k tokens, drawn per tenant) and its own
cache salt (as a router gives each API key), talk in turns: turn t of every tenant, then turn t + 1
of every tenant, ... (default 3 turns); a turn's prompt is the tenant's context, its earlier turns
(~64-token user messages, 16-token greedy answers) and the new user message. The pool (the engine's
KV cache) holds a third of the working set (every tenant's context), so by the time a tenant comes
back its blocks have been evicted from the pool: without a tier below it every later turn is a miss.

Configurations, each a fresh engine (SmolLM2-135M, the engine in this process, one request at a time,
so TTFT is the engine's queue-free time to the first token: a prefill, or a read-back and the rest):

- ``tiers``: prefix cache on, a host tier of ``--host-factor`` x the working set (``--kv-host-bytes``);
- ``disk``: prefix cache on, no host tier, a disk tier of as many blocks (``--kv-disk-path`` in a
  fresh temporary directory, ``--kv-disk-bytes``): every read-back comes from a file;
- ``pool``: prefix cache on, no tier;
- ``off``: prefix cache off.

Reported per configuration: TTFT p50/p90 over all requests and over the later turns (those that can
hit), the later turns' prompt blocks by where they came from (pool, host tier, disk tier, computed:
the hit rate per tier), the tiers' stores, evictions and checksum failures, and the wall time. Prints a table,
writes JSON (``benchmarks/results/tier_bench.json``).

    .venv/bin/python benchmarks/tier_bench.py [--tenants 24] [--context-min 2048 --context-max 4096] [--turns 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16


@dataclasses.dataclass
class Turn:
    tenant: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    pool: int  # prompt blocks from the pool's prefix cache
    tier: int  # ... read back from the host tier
    computed: int  # ... computed
    disk: int = 0  # ... read back from the disk tier


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each tenant's context and its user messages, one per turn (seeded: the same for every run)."""
    rng = random.Random(args.seed)
    contexts, users = [], []
    for _ in range(args.tenants):
        n = rng.randint(args.context_min, args.context_max)
        contexts.append([rng.randrange(3, vocab) for _ in range(n)])
        users.append([[rng.randrange(3, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)])
    return contexts, users


def run_config(
    name: str, args: argparse.Namespace, model_dir: Path, pool_blocks: int, host_bytes: int, block_bytes: int
) -> dict:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.tiers.disk_tier import HEADER
    from pdserve.sampling_params import SamplingParams

    disk_dir = tempfile.mkdtemp(prefix="tier-bench-") if name == "disk" else ""
    cfg = EngineConfig(
        num_blocks=pool_blocks,
        prefix_caching=name != "off",
        kv_host_bytes=host_bytes if name == "tiers" else 0,
        kv_disk_path=disk_dir,
        # as many blocks as the host tier's, each file a header more
        kv_disk_bytes=host_bytes // block_bytes * (block_bytes + HEADER.size) if disk_dir else 0,
        max_model_len=args.context_max + args.turns * (args.user_tokens + args.answer_tokens) + 64,
        max_num_seqs=4,
        prefill_chunk_size=args.chunk,
    )
    engine = LLMEngine(model_dir, cfg)
    contexts, users = workload(args, engine.model_config.vocab_size)
    history: list[list[int]] = [[] for _ in range(args.tenants)]
    turns: list[Turn] = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for tenant in range(args.tenants):
            prompt = contexts[tenant] + history[tenant] + users[tenant][turn]
            params = SamplingParams(
                temperature=0, max_tokens=args.answer_tokens, ignore_eos=True, cache_salt=f"tenant-{tenant}"
            )
            before = dataclasses.replace(engine.batcher.hit_counts)
            disk_before = engine.disk_tier.stats.hits if engine.disk_tier is not None else 0
            rid = f"{tenant}-{turn}"
            start = time.perf_counter()
            engine.add_request(rid, prompt_token_ids=prompt, params=params)
            ttft, answer = None, []
            while engine.has_unfinished():
                for out in engine.step():
                    if ttft is None and out.token_ids:
                        ttft = time.perf_counter() - start
                    answer += out.token_ids
            after = engine.batcher.hit_counts
            from_disk = (engine.disk_tier.stats.hits if engine.disk_tier is not None else 0) - disk_before
            assert ttft is not None
            turns.append(
                Turn(
                    tenant,
                    turn,
                    ttft,
                    len(prompt),
                    after.pool - before.pool,
                    after.tier - before.tier - from_disk,
                    after.computed - before.computed,
                    from_disk,
                )
            )
            history[tenant] += users[tenant][turn] + answer
            print(
                f"  {name:5} turn {turn} tenant {tenant:2}: {len(prompt):5} tokens, TTFT {ttft * 1000:7.0f} ms "
                f"(pool {turns[-1].pool}, host {turns[-1].tier}, disk {turns[-1].disk}, computed "
                f"{turns[-1].computed} blocks)",
                file=sys.stderr,
                flush=True,
            )
    wall = time.perf_counter() - t0
    tier = engine.host_tier.snapshot() if engine.host_tier is not None else None
    disk = engine.disk_tier.snapshot() if engine.disk_tier is not None else None
    engine.close()
    if disk_dir:
        shutil.rmtree(disk_dir, ignore_errors=True)
    later = [t for t in turns if t.turn > 0]
    blocks = {k: sum(getattr(t, k) for t in later) for k in ("pool", "tier", "disk", "computed")}
    total = sum(blocks.values()) or 1
    return {
        "config": name,
        "requests": len(turns),
        "ttft_p50_s": percentile([t.ttft_s for t in turns], 0.5),
        "ttft_p90_s": percentile([t.ttft_s for t in turns], 0.9),
        "later_ttft_p50_s": percentile([t.ttft_s for t in later], 0.5),
        "later_ttft_p90_s": percentile([t.ttft_s for t in later], 0.9),
        "later_blocks": blocks,
        "later_hit_rate": {k: blocks[k] / total for k in ("pool", "tier", "disk")},
        "tier": dataclasses.asdict(tier) if tier is not None else None,
        "disk": dataclasses.asdict(disk) if disk is not None else None,
        "wall_s": wall,
        "turns": [dataclasses.asdict(t) for t in turns],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--context-min", type=int, default=2048)
    ap.add_argument("--context-max", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument(
        "--pool-fraction", type=float, default=1 / 3, help="the pool as a share of the working set (1/3)"
    )
    ap.add_argument(
        "--host-factor", type=float, default=1.25, help="the host tier as a multiple of the working set"
    )
    ap.add_argument("--configs", default="tiers,disk,pool,off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="a --model source (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tier_bench.json")
    args = ap.parse_args()

    from pdserve.engine.kv_layout import block_bytes
    from pdserve.engine.models.model_config import ModelConfig
    from pdserve.engine.models.model_store import resolve_model

    model_dir = Path(resolve_model(args.model).path)
    bb = block_bytes(ModelConfig.from_dir(model_dir), BLOCK)
    mean_context = (args.context_min + args.context_max) / 2
    per_tenant = -(-int(mean_context + args.turns * (args.user_tokens + args.answer_tokens)) // BLOCK)
    working_set = args.tenants * per_tenant
    pool_blocks = max(int(working_set * args.pool_fraction), -(-args.context_max // BLOCK) * 2 + 16)
    host_bytes = int(working_set * args.host_factor) * bb
    print(
        f"{args.tenants} tenants x {args.context_min}-{args.context_max} tokens x {args.turns} turns: working "
        f"set ~{working_set} blocks ({working_set * bb / 2**30:.2f} GiB); pool {pool_blocks} blocks "
        f"({pool_blocks * bb / 2**30:.2f} GiB), host tier {host_bytes / 2**30:.2f} GiB",
        file=sys.stderr,
    )
    results: list[dict[str, Any]] = []
    for name in args.configs.split(","):
        results.append(run_config(name, args, model_dir, pool_blocks, host_bytes, bb))

    table = []
    for r in results:
        tier = r["tier"] or r["disk"]
        t = f"{tier['stores']} / {tier['evictions']} / {tier['corrupt']}" if tier else "–"
        b, rate = r["later_blocks"], r["later_hit_rate"]
        table.append(
            [
                r["config"],
                f"{r['ttft_p50_s'] * 1000:.0f} ms",
                f"{r['ttft_p90_s'] * 1000:.0f} ms",
                f"{r['later_ttft_p50_s'] * 1000:.0f} ms",
                f"{r['later_ttft_p90_s'] * 1000:.0f} ms",
                f"{rate['pool']:.1%}",
                f"{rate['tier']:.1%}",
                f"{rate['disk']:.1%}",
                b["computed"],
                t,
                f"{r['wall_s']:.0f} s",
            ]
        )
    print()
    print_table(
        [
            "config",
            "TTFT p50",
            "TTFT p90",
            "later turns p50",
            "later turns p90",
            "later blocks: pool",
            "host",
            "disk",
            "computed",
            "tier stores / evictions / corrupt",
            "wall",
        ],
        table,
    )
    meta = {
        "pool_blocks": pool_blocks,
        "host_bytes": host_bytes,
        "block_bytes": bb,
        "working_set_blocks": working_set,
    }
    write_json(args.out, {"meta": meta, "results": results}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
