"""What the engine hands out, as plain data (no Paddle): per-step request outputs, its load, its
fixed KV facts. The service and its tests use these without loading the model."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class TokenLogprob:
    """A token's logprob under the raw model distribution, with the best alternatives asked for.

    ``logprob`` None: a prompt's first token, which nothing precedes (no distribution); it still
    carries its id and text, as the legacy echo format lists it."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    token: str = ""  # the token's text, for display
    top_tokens: list[str] | None = None  # texts of top_logprobs, same order
    rank: int | None = None  # 1 + how many ids have a strictly larger logprob


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request (a delta, not the whole output so far)."""

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prefilled: bool = False  # prefill-only request: KV is ready for hand-off
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    """With ``params.prompt_logprobs``: one per prompt token, on the output with the first token only."""
    error: str | None = None
    logits: np.ndarray | None = None  # only with EngineConfig.keep_logits
    queue_s: float | None = None  # on the first token: arrival in the engine -> first prefill chunk
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """A snapshot taken on the engine thread after a step (the heartbeat reports it)."""

    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    step_tokens: int = 0
    """At most how many tokens its next step computes (``Batcher.step_tokens``): how long a call
    queued on its engine thread, a peer's fetch, waits for the step in progress."""
    background: int = 0  # of running + waiting, the batch lines
    free_blocks: int = 0
    preemptions: int = 0  # sequences preempted since the engine started
    cached_blocks: int = 0  # blocks registered in the prefix cache (in use or kept for reuse)
    tier: TierLoad | None = None  # the host tier below the prefix cache, when there is one
    disk: TierLoad | None = None  # the disk tier below it, when there is one
    pool_hits: int = 0  # admitted prompts' full blocks found in the prefix cache (first admissions)
    pool_lookups: int = 0  # admitted prompts' full blocks looked up there (first admissions)
    pool_evictions: int = 0  # cached blocks the prefix cache evicted for room
    prefill_s_per_token: float | None = None
    """Seconds per token of the recent steps that prefilled (``rates.RateMeter``; None: none yet)."""
    decode_s_per_token: float | None = None
    """Seconds per token of the recent steps that only decoded (None: none yet)."""
    host_read_s_per_block: float | None = None  # a block read back from the host tier, lately
    disk_read_s_per_block: float | None = None  # a block read back from the disk tier, lately


@dataclasses.dataclass(frozen=True)
class TierLoad:
    """A tier's size and counters since the engine started (the host tier, ``engine/tiers/host_tier.py``;
    the disk tier, ``engine/tiers/disk_tier.py``)."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    stores: int = 0  # blocks written (evicted from the pool)
    hits: int = 0  # blocks read back into the pool, checksum verified
    misses: int = 0  # admitted prompts' full blocks that neither the pool nor the tier held
    corrupt: int = 0  # entries whose bytes failed their checksum at a read-back (recomputed)
    evictions: int = 0  # entries dropped to stay within the bound
    dropped: int = 0  # the disk tier: writes dropped because its writer's queue was full


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What does not change while the engine lives (registered with the instance)."""

    max_model_len: int
    block_size: int
    num_blocks: int
    block_bytes: int  # bytes of one block (all layers, K and V)
    num_layers: int  # the KV geometry a peer's bytes must match to land in the right places
    num_kv_heads: int
    head_dim: int
    shm_name: str | None = None  # the shared-memory segment holding the KV cache, if shared
    dtype: str = "float32"
    layout: str = "block_major"
    vocab_size: int | None = None  # valid token ids are below it (the router refuses others)
    prefix_caching: bool = False  # full blocks are kept for reuse (and published to the prefix index)
    weights: str = "f32"  # precision of the linear weights: a prefill and a decode pair only when equal
    weights_digest: str | None = None  # which weights (weights.weights_digest): pairs only when equal
    device: str = "cpu"  # where the KV cache lives: "cpu" or "cuda" (a pair's caches must be of one kind)
    device_name: str | None = None  # e.g. "NVIDIA H200 (cuda:0)": shown by `pdserve status`
    memory_bytes: int = 0  # device memory held by the weights and the KV cache
    batch_invariant: bool = False
    """A sequence's bits do not depend on what it is batched with (the CPU engine under
    ``MKL_CBWR=...,STRICT``; the echo engine): routers' shadow verification compares bitwise."""
    host_tier: bool = False
    """A host tier below the prefix cache (its blocks in the prefix index's ``host`` set)."""
    disk_tier: str | None = None
    """The disk tier's directory (real path, one per namespace; None: no disk tier): the worker
    names the tier's prefix-index set after it and its host (``disk_tier.tier_id``)."""
    calls_inline: bool = False
    """Every engine call takes microseconds (the echo engine, no model): the worker makes them on its
    event loop, where handing each to the engine thread would cost far more than the call (preparing
    a request, which may tokenize a large prompt, still runs on the preparation threads)."""
