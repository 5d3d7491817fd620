"""Registration values: what an instance (``InstanceInfo``) and a router (``RouterInfo``) publish
under their registration keys, renewed by every heartbeat: string keys read by whoever picks a peer,
not stream messages (docs/design.md, "Registration values")."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pdserve.scheduler.message_schema import SCHEMA_VERSION, Role, _Model


class KVInfo(_Model):
    """The instance's paged KV cache: geometry and current free space.

    A prefill and a decode instance pair only when every geometry field is equal (and known):
    the prefill side writes its own blocks' bytes at the decode side's block offsets."""

    block_size: int
    num_blocks: int
    free_blocks: int
    dtype: str
    layout: str
    block_bytes: int | None = None  # bytes of one block (all layers, K and V); None: an older worker
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    prefix_caching: bool = False
    """Full blocks are kept for reuse and listed in the prefix index (``Keys.prefix_index``)."""
    weights: str | None = None
    """Precision of the weights that compute the K/V and the tokens (``f32``, ``int8``; None: an
    older worker, i.e. f32): a pair of two precisions would continue a sequence on other numbers."""
    weights_digest: str | None = None
    """Which weights compute the K/V (``engine.weights.weights_digest``: blake2b of config.json and
    the weight files' bytes; ``echo`` for the echo engine; None: an older worker, never paired): two
    checkpoints served under one name (a rolling upgrade) fill blocks with different numbers."""
    device: str = "cpu"
    """Where the cache lives: ``cpu`` (host memory) or ``cuda`` (a GPU; an older worker: cpu). A
    pair's caches must be of one kind: their bytes move by different transports."""
    batch_invariant: bool | None = None
    """Its sequences' bits do not depend on their batch (None: an older worker, not said): a router's
    shadow verification compares bitwise where every instance involved says so."""
    device_name: str | None = None  # e.g. "NVIDIA H200 (cuda:0)": shown by `pdserve status`
    memory_bytes: int | None = None  # device memory the weights and the KV cache hold (None: not said)


class LoadInfo(_Model):
    """Live load, renewed with every heartbeat (the router's selection input)."""

    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    step_tokens: int = 0
    """At most how many tokens its next engine step computes, as of its last one: a token per
    running decode and the prompt tokens its sequences have yet to compute, within its step budget
    (``max_num_batched_tokens``). A peer's fetch waits for the step in progress (the holder pins
    blocks between steps): routers price that wait at its prefill rate. 0 from an older worker.
    Optional (added without a ``v`` bump)."""
    background: int = 0
    """Of ``running`` + ``waiting``, the batch lines (``GenerateRequest.background``): the rest is
    online work, which batch workers yield to."""
    handing_off: int = 0
    """Prefills done here whose KV is still on its way to their decode instance (splitwise prefill
    only; not in ``running`` or ``waiting``): they hold KV blocks and the transfer, so the routers'
    selection counts them as requests; batch workers do not (no sequence runs or waits for them)."""


class TransferInfo(_Model):
    """How peers reach this instance's KV cache (e.g. ``endpoint = {"shm": "<segment name>"}``).

    ``incarnation`` is new at every start of the instance: an id restarted under the same name
    (same shm segment name) has a new cache, which a writer opened to the old one must not reach."""

    protocols: list[str] = Field(default_factory=list)
    endpoint: dict[str, Any] | None = None
    incarnation: str | None = None
    writes: list[str] | None = None
    """The transports it can write KV into a peer's cache over (its open backends, whatever its role:
    a mixed instance's too, whose ``protocols`` stay empty so that it is never paired): a peer
    whose ``endpoint`` offers one of them can fetch blocks from it. None: an older worker, or none."""


class RoleChange(_Model):
    """A role an instance took (``pdserve role``, a planner), and when (unix s, its own clock)."""

    role: Role
    at: float
    reason: str | None = None


class SwitchOutcome(_Model):
    """What became of the latest role switch an instance was asked for (``SetRole``)."""

    id: str
    role: Role
    ok: bool
    error: str | None = None


class IntegrityInfo(_Model):
    """What a decode instance's checks of the KV it received found, since its start (shown by
    ``pdserve status``): hand-offs whose written blocks it checked against the writer's digests,
    and those that did not match (never decoded: their requests were retried)."""

    kv_checked: int = 0
    kv_mismatches: int = 0


class TierInfo(_Model):
    """The host tier below an instance's prefix cache (``--kv-host-bytes``): its size and counters
    since the instance started (``pdserve status`` shows them). Its blocks are in the prefix
    index's ``host`` set (``Keys.prefix_index(id, "host")``)."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    stores: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    dropped: int = 0
    """Writes dropped because the tier's writer was behind (the disk tier's only)."""


class DiskTierInfo(TierInfo):
    """The disk tier an instance reads and writes (``--kv-disk-path``, shared by the instances of a
    host naming the same directory): its id, whose prefix-index set (``Keys.prefix_disk(id)``)
    routers read for this instance, the directory, and the size as this instance last listed it
    with its own counters since it started."""

    id: str
    path: str = ""


class PoolInfo(_Model):
    """The prefix cache's counters since the instance started (``pdserve status``): admitted
    prompts' full blocks found there (``hits``) out of those looked up (``lookups``), and the
    cached blocks it evicted for room."""

    hits: int = 0
    lookups: int = 0
    evictions: int = 0


class FetchInfo(_Model):
    """An instance's peer fetches since it started (``pdserve status``): prefix blocks it fetched
    from peers instead of computing (``hits``) and those it asked for that did not come and were
    computed (``misses``: the peer no longer held them, or the fetch failed), fetches that fell back
    to computing (``failed``: refused, timed out, or ``mismatches``: blocks that differed from the
    writer's digests, never used), and blocks it wrote into peers' caches for their fetches
    (``served``)."""

    fetches: int = 0
    hits: int = 0
    misses: int = 0
    failed: int = 0
    mismatches: int = 0
    served: int = 0


class IdleCpuInfo(_Model):
    """The CPU this instance's host had left over lately (``worker/idle_cpu.py``): the planner moves
    an instance to a role only where it would get CPU of its own (docs/design.md, "The planner")."""

    cpus: float
    """CPUs this instance may run on: its affinity mask, within its cgroup's CPU quota."""
    idle: float
    """Of those, the CPUs idle on average over the last 10 s (whatever ran on the rest)."""
    threads: int
    """Its engine's compute threads: the CPUs it would keep busy."""


class RatesInfo(_Model):
    """What this instance measured of its own speed lately (a decaying mean over recent samples,
    ``engine/rates.py``): the routers' ``prefix_cache`` policy weighs computing a prompt here against
    reading its blocks back from a tier and against moving its KV by these (docs/design.md, "Prefix
    routing"). Each field is None until measured (the policy then uses its ``--prefix-*`` weights)."""

    prefill_s_per_token: float | None = None
    """Seconds per token of its recent steps that prefilled (the forward and picks over their rows)."""
    decode_s_per_token: float | None = None
    """Seconds per token of its recent steps that only decoded (a step's time over its rows, at the
    batch sizes it ran lately): the planner weighs it against ``prefill_s_per_token``."""
    host_read_s_per_block: float | None = None
    """Seconds per block its host tier read back lately: read, checksum, copy into the pool."""
    disk_read_s_per_block: float | None = None
    """Seconds per block its disk tier read back lately: file read, checks, copy into the pool."""
    transfer_s_per_block: dict[str, float] | None = None
    """Per KV transport (``shm``, ``mooncake``, …): seconds per block its recent writes into peers
    took (a prefill instance's hand-offs, any instance's writes for a peer's fetch; the block's bytes
    over the writes' measured rate)."""
    fetch_s_per_block: float | None = None
    """Seconds per block its recent peer fetches took from asking to the blocks checked in its pool
    (messages, the holder's wait for its engine, the write, the check): what a router prices a
    fetch into this instance at."""


class InstanceInfo(_Model):
    """Registration value of one inference instance (``pdserve:{<cluster>}:instance:<id>``)."""

    v: int = Field(default=SCHEMA_VERSION, ge=1)
    id: str
    role: Role
    model: str
    version: str
    host: str
    pid: int
    started_at: float
    kv: KVInfo
    load: LoadInfo = Field(default_factory=LoadInfo)
    transfer: TransferInfo = Field(default_factory=TransferInfo)
    max_model_len: int
    draining: bool = False
    vocab_size: int | None = None
    """Token ids below this are valid prompts (None: not said; the router checks nothing)."""
    max_num_seqs: int | None = None
    """Most sequences this instance runs at once (None: not said); the batch workers' spare-capacity
    gate compares ``load.running`` with it."""
    tokenizer: str | None = None
    """Digest of the tokenizer files this instance published (``Keys.tokenizer(digest)``), with which
    routers compute its prompts' token ids (None: none published, e.g. the echo engine)."""
    integrity: IntegrityInfo | None = None
    """A decode instance's KV checks since it started (None: nothing checked yet, or another role)."""
    tier: TierInfo | None = None
    """Its host tier (None: it has none): routers read its ``host`` prefix-index set too. Optional
    (added without a ``v`` bump)."""
    disk_tier: DiskTierInfo | None = None
    """Its disk tier (None: it has none): routers read that tier's set for it too. Optional."""
    pool: PoolInfo | None = None
    """Its prefix cache's counters (None: no prefix cache, or an older instance). Optional."""
    rates: RatesInfo | None = None
    """What it measured of its prefill, read-back and hand-off speed (None: nothing yet, or an
    older instance). Optional (added without a ``v`` bump)."""
    fetch: FetchInfo | None = None
    """Its peer fetches' counters (None: none yet, asked or served). Optional."""
    cpu: IdleCpuInfo | None = None
    """Its host's CPUs and how many were idle lately (None: not measured yet, or a GPU instance,
    whose capacity is its device's). Optional (added without a ``v`` bump)."""
    switchable: bool | None = None
    """It can take any role when told: started ``--switchable`` (its KV cache in shared memory,
    every KV transport open) or as a decode instance (which has both); None or False: only the
    switches its start allows (a prefill or mixed instance's cache is not shared, so it cannot
    become a decode instance)."""
    roles: list[RoleChange] | None = None
    """The roles it took after the one it started with, oldest first (the last few): ``role`` is the
    current one. None: it never switched."""
    last_switch: SwitchOutcome | None = None
    """The latest switch it was asked for, done or refused (``pdserve role`` waits for it)."""


class VerifyInfo(_Model):
    """A router's shadow verification since its start (``--verify-fraction``): disaggregated
    requests replayed on the aggregated path and compared, how many differed, and the last
    difference (``pdserve status`` shows it)."""

    checked: int = 0
    mismatches: int = 0
    last_mismatch: str | None = None


class TrafficInfo(_Model):
    """What a router served over its last ``window_s`` seconds (``router/http/traffic.py``): finished
    requests, their prompt and generated tokens, and its TTFT and inter-token latency histograms'
    bucket counts over the window (``*_counts[i]`` observations at most ``*_bounds[i]`` seconds, the
    last past every bound), for a planner to merge across routers."""

    window_s: float
    requests: int
    prompt_tokens: int
    generation_tokens: int
    ttft_bounds: list[float]
    ttft_counts: list[int]
    itl_bounds: list[float]
    itl_counts: list[int]
    prefix_lookup_tokens: int = 0
    """Prompt tokens placed by cached prefix, and of those the ones the chosen instance held."""
    prefix_hit_tokens: int = 0
    kv_transfers: int = 0
    """Splitwise KV writes timed by their prefill workers, and their seconds in all."""
    kv_transfer_s: float = 0.0
    arrivals: int = 0
    """Choices placed for the first time in the window (requests arriving, not finishing) ..."""
    arrival_prompt_tokens: int = 0
    arrival_prompt_known: int = 0
    """... their prompt tokens, of those whose length the router knew (a token-id prompt, or one it
    tokenized to route it) ..."""
    arrival_max_tokens: int = 0
    arrival_max_known: int = 0
    """... and their ``max_tokens``, of those whose client set one (the planner's demand, from
    before the requests finish)."""
    finished_asked: int = 0
    finished_generated: int = 0
    """Of the finished choices whose client set ``max_tokens``: the tokens asked and generated (how
    much of what is asked gets generated)."""


class RouterInfo(_Model):
    """Registration value of one router (``pdserve:{<cluster>}:router:<id>``)."""

    v: int = Field(default=SCHEMA_VERSION, ge=1)
    id: str
    host: str
    pid: int
    port: int
    started_at: float
    verify: VerifyInfo | None = None
    """Its shadow verification's counts (None: ``--verify-fraction`` 0, or an older router)."""
    traffic: TrafficInfo | None = None
    """What it served lately (None: ``--no-metrics``, or an older router)."""
