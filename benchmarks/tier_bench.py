"""The host and disk tiers and peer fetch on a multi-tenant long-context workload, through a served stack.

T tenants (default 6), each with its own API key (so the router salts its prefix cache: no tenant
reads another's blocks) and its own long context (2-4k tokens, drawn per tenant), talk in turns: turn
t of every tenant, then turn t + 1 of every tenant, ... (default 12 turns); a turn's prompt is the
tenant's context, its earlier turns (64-token user messages, 16-token greedy answers sent back as
the answer's own token ids) and the new user message. Each configuration is a fresh stack as
``pdserve up --mixed 2`` runs it (``pdserve.stack.Stack``; SmolLM2-135M, 2 mixed instances of one
thread each, one router with the default ``prefix_cache`` policy, an embedded Redis), driven through
the OpenAI API (``/v1/completions``, streamed) by --concurrency clients at once. Each instance's
pool (its KV cache, ``--num-blocks``) holds --pool-fraction (a third) of the working set (every
tenant's context and turns), so by the time a tenant comes back its blocks have left the pools.

Configurations (--configs; default all five: the issue's comparison, and each tier alone):

- ``tiers``: prefix cache on, a host tier per instance (``--kv-host-bytes``, --host-factor x the
  working set each), instances ``--switchable`` (their caches in shared memory, so a peer can write
  a fetch into them: peer fetch on);
- ``host``: as ``tiers``, not switchable (no peer fetch: a tenant whose instance is busy waits for
  it or is computed on the other);
- ``disk``: as ``tiers`` with no host tier and one disk tier both instances share (``--kv-disk-path``
  in a fresh temporary directory, ``--kv-disk-bytes``: --disk-factor x the working set);
- ``pool``: tiers off: prefix cache and prefix routing alone (not switchable: no peer fetch);
- ``off``: prefix cache off.

Reported per configuration: TTFT p50/p90 (client side, first token) over all requests and over the
later turns (turn >= 1, those that can hit); the later turns' prompt blocks by where they came from
(pool, host tier, disk tier, peer fetch, computed), from usage ``cached_tokens`` and the instances'
counters in their registrations (what ``pdserve status`` shows), and the router's picks by source
(``pdserve_route_picks_total``); the later turns' hit rate against the ideal for the trace (an
unbounded cache shared by every instance: each prompt's full blocks, before its last token, that the
tenant's earlier prompt and answer filled) and the achieved fraction of it; the wall time.

The default shape: the first turns are cold in every configuration, so they must be well under a
tenth of the requests for the p90 over all requests to be a later turn's (12 turns: 1/12 = 8.3 %;
at 3 turns a third of the requests are cold and every configuration's p90 is a cold prefill). The
configurations without a tier (``pool``, ``off``) recompute every tenant's whole context on every
turn, so their time grows with tenants x turns x context: 6 tenants keep the five configurations within
an hour on a 2-vCPU host (55 min measured, 72 min forecast; 12 tenants: over two hours), with the
working set still 3x one pool (the issue's e.g. 24 tenants x 3 turns: ~70 min for four configurations, and the cold
first turns set every p90).
Prints a forecast of the run time first (rough:
--ms-per-token), two tables on stdout (progress on stderr), and writes JSON
(``benchmarks/results/tier_bench.json``).

    .venv/bin/python benchmarks/tier_bench.py    # issue 46's workload: 6 tenants x 2-4k x 12 turns
    .venv/bin/python benchmarks/tier_bench.py --tenants 6 --context-min 512 --context-max 1024 --turns 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness import print_table, write_json
from tier_trace import BLOCK, Workload, estimate_s, ideal_tokens, sizing, workload

from pdserve import bench

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("tiers", "host", "disk", "pool", "off")
PICKS = re.compile(r"^pdserve_route_picks_total\{([^}]*)\} (\S+)$", re.M)
COUNTERS = {
    "pool": ("hits", "lookups"),
    "tier": ("hits", "stores", "evictions", "corrupt"),
    "disk_tier": ("hits", "stores", "evictions", "corrupt", "dropped"),
    "fetch": ("fetches", "hits", "misses", "failed", "mismatches", "served"),
}


@dataclasses.dataclass
class Turn:
    tenant: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int  # what an unbounded cache shared by every instance would have held
    error: str = ""


# ---- the stack and its counters ------------------------------------------------------------------
def make_spec(name: str, args: argparse.Namespace, sizes: dict, keys: list[str]) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.tiers.disk_tier import HEADER
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import StackSpec

    disk = sizes["disk_dir"] if name == "disk" else ""
    engine = EngineConfig(
        num_blocks=sizes["pool_blocks"],
        threads=args.threads,
        prefix_caching=name != "off",
        kv_host_bytes=sizes["host_bytes"] if name in ("tiers", "host") else 0,
        kv_disk_path=disk,
        kv_disk_bytes=sizes["disk_blocks"] * (sizes["block_bytes"] + HEADER.size) if disk else 0,
        max_model_len=args.context_max + args.turns * (args.user_tokens + args.answer_tokens) + 64,
    )
    return StackSpec(
        model=args.model,
        port=free_port(),
        routers=1,
        prefill=0,
        decode=0,
        mixed=args.instances,
        batch_workers=0,
        engine=engine,
        # the first token of a 4k prompt queued behind others may take minutes on a loaded host: a
        # timeout would retry it and time the retry
        router_options={"api_key": ",".join(keys), "first_token_timeout_s": 1800, "request_timeout_s": 3600},
        worker_options={"switchable": name in ("tiers", "disk")},
        ready_timeout_s=900,
    )


def start(spec: Any) -> Any:
    from pdserve.stack import Stack

    for attempt in (1, 2, 3):  # a free port taken meanwhile by another process fails a start
        stack = Stack(spec)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # its banner is progress, not the result
                stack.start()
                stack.wait_ready()
            return stack
        except RuntimeError as e:
            stack.stop()
            if attempt == 3:
                raise
            print(f"the stack did not start ({e}); again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def counters(stack: Any) -> dict[str, float]:
    """The router's picks by source and every instance's tier, pool and fetch counters, summed."""
    from pdserve.status_read import collect

    out: dict[str, float] = {}
    for url in stack.urls:
        for labels, value in PICKS.findall(httpx.get(url + "/metrics", timeout=10).text):
            source = re.search(r'source="(\w+)"', labels)
            key = f"picks.{source.group(1) if source else '?'}"
            out[key] = out.get(key, 0.0) + float(value)
    status = asyncio.run(collect(stack.redis_url, stack.spec.cluster))
    for inst in status["instances"]:
        for part, fields in COUNTERS.items():
            for f in fields:
                out[f"{part}.{f}"] = out.get(f"{part}.{f}", 0.0) + ((inst.get(part) or {}).get(f) or 0)
    return out


def settled_counters(stack: Any) -> dict[str, float]:
    """:func:`counters` once two reads a heartbeat apart agree (registrations lag by one)."""
    last = counters(stack)
    for _ in range(6):
        time.sleep(stack.spec.ttl_s / 3 + 0.5)
        now = counters(stack)
        if now == last:
            break
        last = now
    return last


# ---- one configuration -----------------------------------------------------------------------------
async def one_turn(
    clients: list[httpx.AsyncClient],
    url: str,
    model: str,
    turn: int,
    prompts: list[list[int]],
    args: argparse.Namespace,
    name: str,
) -> list[tuple[bench.Result, list[int]]]:
    """Turn ``turn`` of every tenant, --concurrency at once in tenant order; each result with the
    prompt it answered."""
    sem = asyncio.Semaphore(args.concurrency)

    async def one(tenant: int) -> tuple[bench.Result, list[int]]:
        body = {"prompt": prompts[tenant], "max_tokens": args.answer_tokens, "return_token_ids": True}
        async with sem:
            r = await bench.one_request(
                clients[tenant], url + "/v1/completions", model, bench.Prompt(body, args.answer_tokens), True
            )
        print(
            f"  {name:5} turn {turn} tenant {tenant:2}: {len(prompts[tenant]):5} tokens, TTFT "
            f"{r.ttft * 1000:7.0f} ms, cached {r.cached_tokens:5}" + ("" if r.ok else f" FAILED {r.error}"),
            file=sys.stderr,
            flush=True,
        )
        return r, prompts[tenant]

    return list(await asyncio.gather(*(one(t) for t in range(len(prompts)))))


async def converse(stack: Any, name: str, args: argparse.Namespace, load: Workload, keys: list[str]) -> tuple:
    """Every turn of every tenant: the turns, the counters after turn 0 and after the last, and the
    seconds the turns took (the counters' reads left out)."""
    assert stack.model is not None
    url, model = stack.urls[0], stack.model.name
    history: list[list[int]] = [[] for _ in range(args.tenants)]  # earlier turns' prompt and answer
    turns: list[Turn] = []
    snaps = []
    wall = 0.0
    timeout = httpx.Timeout(3600, connect=10)
    async with contextlib.AsyncExitStack() as stack_:
        clients = [
            await stack_.enter_async_context(
                httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {key}"})
            )
            for key in keys
        ]
        for turn in range(args.turns):
            prompts = [(history[t] or load.contexts[t]) + load.users[t][turn] for t in range(args.tenants)]
            t0 = time.perf_counter()
            done = await one_turn(clients, url, model, turn, prompts, args, name)
            wall += time.perf_counter() - t0
            for tenant, (r, prompt) in enumerate(done):
                ideal = ideal_tokens(prompt, history[tenant]) if turn else 0
                turns.append(Turn(tenant, turn, r.ttft, len(prompt), r.cached_tokens, ideal, r.error))
                history[tenant] = prompt + r.token_ids
            if turn == 0 or turn == args.turns - 1:
                snaps.append(await asyncio.to_thread(settled_counters, stack))
    return turns, snaps, wall


def run_config(name: str, args: argparse.Namespace, sizes: dict, load: Workload) -> dict:
    keys = [f"tier-bench-tenant-{t}" for t in range(args.tenants)]
    spec = make_spec(name, args, sizes, keys)
    if name == "disk":
        Path(sizes["disk_dir"]).mkdir(parents=True, exist_ok=True)
    print(f"{name}: starting {args.instances} mixed instances ...", file=sys.stderr, flush=True)
    stack = start(spec)
    try:
        turns, (after0, after), wall = asyncio.run(converse(stack, name, args, load, keys))
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            stack.stop()
        if name == "disk":
            shutil.rmtree(sizes["disk_dir"], ignore_errors=True)
    return summarize(name, turns, after0, after, wall)


def summarize(name: str, turns: list[Turn], after0: dict, after: dict, wall: float) -> dict:
    def ttft(ts: list[Turn]) -> dict[str, float]:
        ok = [t.ttft_s for t in ts if not t.error]
        return bench.stats(ok, (50, 90)) if ok else {"p50": float("nan"), "p90": float("nan")}

    later = [t for t in turns if t.turn > 0]
    d = {k: after.get(k, 0.0) - after0.get(k, 0.0) for k in after}  # the later turns' counters
    prompt = sum(t.prompt_tokens for t in later)
    cached = sum(t.cached_tokens for t in later) // BLOCK
    # usage's cached tokens are the blocks an admission found in the pool (a peer's fetched ones
    # among them: they are adopted into it first) plus those it read back from a tier; which tier:
    # the tiers' read-backs' shares (one tier per configuration here, so exact); the rest of each
    # prompt's blocks (its last, partial one among them) were computed
    pool_hits = d.get("pool.hits", 0.0)
    peer = d.get("fetch.hits", 0.0)
    read_back = max(0.0, cached - pool_hits)
    host_reads, disk_reads = d.get("tier.hits", 0.0), d.get("disk_tier.hits", 0.0)
    share = host_reads / (host_reads + disk_reads) if host_reads + disk_reads else 1.0
    blocks = {
        "pool": pool_hits - peer,
        "host": read_back * share,
        "disk": read_back * (1 - share),
        "peer": peer,
        "computed": sum(-(-t.prompt_tokens // BLOCK) for t in later) - cached,
    }
    hit, ideal = (
        sum(t.cached_tokens for t in later) / (prompt or 1),
        sum(t.ideal_tokens for t in later) / (prompt or 1),
    )
    return {
        "config": name,
        "requests": len(turns),
        "failed": sum(bool(t.error) for t in turns),
        "ttft_s": ttft(turns),
        "later_ttft_s": ttft(later),
        "later_blocks": blocks,
        "later_hit_rate": hit,
        "ideal_hit_rate": ideal,
        "of_ideal": hit / ideal if ideal else float("nan"),
        "later_picks": {k[6:]: v for k, v in d.items() if k.startswith("picks.") and v},
        "later_counters": d,
        "counters": after,
        "wall_s": wall,
        "turns": [dataclasses.asdict(t) for t in turns],
    }


# ---- the report -------------------------------------------------------------------------------------
def report(results: list[dict]) -> None:
    ms = lambda s: f"{s * 1000:.0f}"  # noqa: E731
    print_table(
        [
            "config",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "later turns p50 ms",
            "later turns p90 ms",
            "failed",
            "wall s",
        ],
        [
            [
                r["config"],
                ms(r["ttft_s"]["p50"]),
                ms(r["ttft_s"]["p90"]),
                ms(r["later_ttft_s"]["p50"]),
                ms(r["later_ttft_s"]["p90"]),
                r["failed"],
                f"{r['wall_s']:.0f}",
            ]
            for r in results
        ],
        title="\nTTFT (client side, to the first token)",
    )
    rows = []
    for r in results:
        b = r["later_blocks"]
        total = sum(b.values()) or 1
        picks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["later_picks"].items()))
        fetches, failed = (
            r["later_counters"].get("fetch.fetches", 0),
            r["later_counters"].get("fetch.failed", 0),
        )
        rows.append(
            [
                r["config"],
                *(f"{b[k]:.0f} ({b[k] / total:.0%})" for k in ("pool", "host", "disk", "peer", "computed")),
                f"{r['later_hit_rate']:.3f}",
                f"{r['ideal_hit_rate']:.3f}",
                f"{r['of_ideal']:.2f}",
                f"{fetches:.0f} / {failed:.0f}" if fetches else "-",
                picks or "-",
            ]
        )
    print_table(
        [
            "config",
            "pool",
            "host tier",
            "disk tier",
            "peer fetch",
            "computed",
            "hit rate",
            "ideal",
            "of ideal",
            "fetches / failed",
            "router picks",
        ],
        rows,
        title="\nLater turns' prompt blocks by source; hit rate (cached / prompt tokens) against the trace's ideal",
    )
    base = {r["config"]: r for r in results}
    for tiered in ("tiers", "host", "disk"):
        for other in ("pool", "off"):
            if tiered in base and other in base:
                t, o = base[tiered], base[other]
                print(
                    f"{tiered} vs {other}: TTFT p90 {o['ttft_s']['p90'] / t['ttft_s']['p90']:.1f}x better over "
                    f"all requests, {o['later_ttft_s']['p90'] / t['later_ttft_s']['p90']:.1f}x over the later turns"
                )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--tenants", type=int, default=6, help="tenants, one API key each (default %(default)s)")
    ap.add_argument(
        "--context-min", type=int, default=2048, help="shortest context, tokens (default %(default)s)"
    )
    ap.add_argument(
        "--context-max", type=int, default=4096, help="longest context, tokens (default %(default)s)"
    )
    ap.add_argument("--turns", type=int, default=12, help="turns per tenant (default %(default)s)")
    ap.add_argument(
        "--user-tokens", type=int, default=64, help="tokens per user message (default %(default)s)"
    )
    ap.add_argument("--answer-tokens", type=int, default=16, help="tokens per answer (default %(default)s)")
    ap.add_argument("--instances", type=int, default=2, help="mixed instances (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="each instance's threads (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (default %(default)s)")
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=1 / 3,
        help="each instance's pool (--num-blocks) as a share of the working set (default 1/3)",
    )
    ap.add_argument(
        "--host-factor",
        type=float,
        default=1.0,
        help="each instance's host tier as a multiple of the working set (default %(default)s: the router "
        "places tenants by load, so one instance may get most of them: at 0.75, 6 tenants x 2-4k tokens, "
        "one got 4 and its tier evicted 330 of the 1194 blocks it stored)",
    )
    ap.add_argument(
        "--disk-factor",
        type=float,
        default=1.25,
        help="the shared disk tier (disk) as a multiple of the working set (default %(default)s)",
    )
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)} (default %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the trace's (default %(default)s)")
    ap.add_argument("--model", default="smollm2-135m", help="a --model source (default %(default)s)")
    ap.add_argument(
        "--ms-per-token",
        type=float,
        default=6.0,
        help="for the forecast printed at the start: ms to prefill one prompt token near the start of a "
        "context on one thread, twice that at 2k tokens (default %(default)s: SmolLM2-135M on a loaded "
        "2-vCPU EPYC Zen 3)",
    )
    ap.add_argument(
        "--start-s",
        type=float,
        default=60.0,
        help="for the forecast: one stack's start (default %(default)s)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "tier_bench.json",
        help="the JSON (default benchmarks/results/tier_bench.json)",
    )
    args = ap.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if args.turns < 2:
        ap.error("--turns must be at least 2: the later turns are what the tiers serve")
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")

    from pdserve.engine.kv_layout import block_bytes
    from pdserve.engine.models.model_config import ModelConfig
    from pdserve.engine.models.model_store import resolve_model

    model_dir = Path(resolve_model(args.model).path)
    config = ModelConfig.from_dir(model_dir)
    load = workload(args, config.vocab_size)
    sizes = sizing(args, load, block_bytes(config, BLOCK))
    ws, gib = sizes["working_set_blocks"], sizes["block_bytes"] / 2**30
    print(
        f"{args.tenants} tenants x {args.context_min}-{args.context_max} tokens x {args.turns} turns, "
        f"{args.instances} instances of {args.threads} thread(s), {args.concurrency} requests in flight: working "
        f"set {ws} blocks ({ws * gib:.2f} GiB) = {ws / sizes['pool_blocks']:.1f}x one pool of "
        f"{sizes['pool_blocks']} blocks ({sizes['pool_blocks'] * gib:.2f} GiB); host tier "
        f"{sizes['host_bytes'] / 2**30:.2f} GiB per instance; configs {', '.join(names)}",
        file=sys.stderr,
    )
    if ws < 3 * sizes["pool_blocks"]:
        print("note: the working set is under 3x one pool (a request must fit one)", file=sys.stderr)
    print(f"forecast: ~{estimate_s(args, load, names) / 60:.0f} min (rough; --ms-per-token)", file=sys.stderr)
    results = [run_config(name, args, sizes, load) for name in names]
    report(results)
    write_json(
        args.out, {"meta": {k: v for k, v in sizes.items() if k != "disk_dir"}, "results": results}, args
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
