"""tier_bench.py's trace: the tenants' contexts and user turns, the ideal hit rate for it, the pool
and tier sizes it implies, and a forecast of its run time."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import tempfile
import time
from pathlib import Path

BLOCK = 16  # tokens per KV block (the engines' default)
ANSWER_S_PER_TOKEN = 0.06  # the forecast's decode step on one loaded thread


@dataclasses.dataclass
class Workload:
    contexts: list[list[int]]
    users: list[list[list[int]]]  # per tenant, one user message per turn

    def blocks(self, args: argparse.Namespace) -> list[int]:
        """Each tenant's KV blocks after its last turn: its share of the working set."""
        per_turn = args.user_tokens + args.answer_tokens
        return [-(-(len(c) + args.turns * per_turn) // BLOCK) for c in self.contexts]


def workload(args: argparse.Namespace, vocab: int) -> Workload:
    """Each tenant's context and user messages, token ids (seeded: the same for every configuration)."""
    rng = random.Random(args.seed)
    contexts, users = [], []
    for _ in range(args.tenants):
        n = rng.randint(args.context_min, args.context_max)
        contexts.append([rng.randrange(100, vocab) for _ in range(n)])
        users.append(
            [[rng.randrange(100, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        )
    return Workload(contexts, users)


def ideal_tokens(prompt: list[int], before: list[int]) -> int:
    """Prompt tokens an unbounded cache would hold: the leading full blocks of ``prompt`` (its last
    token always computed) that ``before`` (the tenant's earlier prompt and answer, whose last token
    was sampled, never computed) filled."""
    from pdserve.block_hash import chain_hashes

    seen = set(chain_hashes(before[:-1], BLOCK))
    n = 0
    for h in chain_hashes(prompt[:-1], BLOCK):
        if h not in seen:
            break
        n += 1
    return n * BLOCK


def sizing(args: argparse.Namespace, load: Workload, block_bytes: int) -> dict:
    """Each instance's pool (--pool-fraction of the working set, but room for the longest tenant
    and a little more: a request must fit) and host tier, the shared disk tier, in blocks or bytes."""
    per_tenant = load.blocks(args)
    working_set = sum(per_tenant)
    biggest = max(per_tenant)
    pool = max(math.floor(working_set * args.pool_fraction), biggest + 16)  # one request fits, at least
    return {
        "working_set_blocks": working_set,
        "pool_blocks": pool,
        "block_bytes": block_bytes,
        "host_bytes": int(working_set * args.host_factor) * block_bytes,
        "disk_blocks": int(working_set * args.disk_factor),
        "disk_dir": str(Path(tempfile.gettempdir()) / f"tier-bench-{time.time_ns()}"),
    }


def estimate_s(args: argparse.Namespace, load: Workload, names: list[str]) -> float:
    """A rough forecast of the run: every prompt token a configuration computes (all of them
    without a tier; with one, the first turn's and each later turn's new tokens) at --ms-per-token,
    growing with its position (attention: x2 at 2k tokens), each answer's tokens at
    ANSWER_S_PER_TOKEN, the instances working in parallel, and --start-s per stack."""
    total = 0.0
    parallel = max(1, min(args.concurrency, args.instances))
    per_turn = args.user_tokens + args.answer_tokens
    for name in names:
        work = 0.0
        for c in load.contexts:
            for turn in range(args.turns):
                n = len(c) + turn * per_turn + args.user_tokens
                new = n if turn == 0 or name in ("pool", "off") else args.user_tokens + args.answer_tokens
                work += new * args.ms_per_token / 1000 * (1 + (n - new / 2) / 2048)
                work += args.answer_tokens * ANSWER_S_PER_TOKEN
        total += work / parallel + args.start_s
    return total
