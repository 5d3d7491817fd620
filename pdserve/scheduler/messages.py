"""Versioned control-plane messages: pydantic v2 models as compact JSON, never pickle.

Every stream message carries ``v`` (the schema's major version), ``type`` (the discriminator) and
``request_id``. Compatibility rule: adding an optional field keeps ``v``; readers ignore fields they
do not know. Removing, renaming or retyping a field bumps ``v``, and readers reject messages with a
``v`` newer than :data:`SCHEMA_VERSION` instead of misreading them.

The outbox message :class:`StepOutput` batches one engine step's output for many requests of one
router, so it has no top-level ``request_id``: each of its items carries its own.

Optional fields default to ``None`` (and ``None`` means "absent"), so :func:`encode` drops them to
keep entries small; decoding restores the defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdserve.errors import MessageError, PdserveError
from pdserve.sampling_params import SamplingParams

SCHEMA_VERSION = 3
"""The newest message schema (major) version this code reads and writes.

2: ``ErrorInfo`` carries the exception tree's ``kind`` and ``param`` instead of ``code``/``type``;
fields nothing produced or read are gone (``detokenize``, ``arrival_time``, ``first_logprobs``,
``num_cached_tokens``). Additive since: ``RequestDelta.timing``, ``GenerateRequest.echo`` with
``RequestDelta.prompt_text``, ``RequestDelta.seq`` with ``Prefilled.next_seq`` (older readers
ignore them).

3: ``GenerateRequest.sampling`` and ``ReserveBlocks.sampling`` are a typed ``SamplingParams``
(``None`` fields left out; unknown keys refused); a request without ``max_tokens`` says
``GenerateRequest.fill_max_tokens`` instead of ``sampling.max_tokens = null``. Additive since:
the registration's KV geometry (``KVInfo.block_bytes``, ``num_layers``, ``num_kv_heads``,
``head_dim``: a registration without them is read, but never paired), ``InstanceInfo.tokenizer``
(the digest of the tokenizer files the instance published; an older router ignores it),
``KVInfo.prefix_caching``, ``TransferInfo.incarnation`` (peers' writers are keyed by it), ``RequestDelta.prompt_logprobs`` with
``LogprobInfo.rank``, ``ReserveReply.num_cached_blocks`` (an older prefill side writes those
blocks too, with the same bytes), ``SamplingParams.cache_salt`` (refused by an older worker as
any unknown sampling key) (a ``LogprobInfo`` without ``logprob`` occurs only as a prompt's first entry,
inside the field an older reader skips; the sampling field that asks for it is refused by an older
worker, as any unknown sampling key is), ``ReserveBlocks.transfer_budget_s`` (an older decode side
frees by the deadline on its own wall clock), ``Abort.writer_done``, ``ReserveBlocks.protocol`` with ``ReserveReply.staging_offset`` (an older
prefill writes at the blocks' offsets, which a staged endpoint refuses), ``Prefilled.kv_digests`` with
``kv_digest_algo`` (an older decode side does not check them), ``InstanceInfo.integrity`` and
``RouterInfo.verify``, the ``SetRole`` message with ``InstanceInfo.switchable``, ``roles`` and
``last_switch`` (an older instance dead-letters a ``set_role``; an older router ignores the fields).
"""

ANY_ATTEMPT = -1
"""``RequestDelta.attempt`` of events that end every attempt (e.g. the router lost Redis)."""

Role = Literal["prefill", "decode", "mixed"]
_M = TypeVar("_M", bound=BaseModel)


class _Model(BaseModel):
    # extra="ignore": fields added by a newer minor revision are skipped, not fatal.
    model_config = ConfigDict(extra="ignore")


# -- registration values (string keys, not stream messages) ---------------------------------------


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


# -- parts of messages -----------------------------------------------------------------------------


class PeerInfo(_Model):
    """One side of a prefill/decode pair, as copied from its registration."""

    id: str
    host: str
    transfer: dict[str, Any] = Field(default_factory=dict)


class PhaseDeadlines(_Model):
    """Unix-seconds deadline of each splitwise phase; a missed one ends the request with an error."""

    reserve: float
    transfer: float
    first_token: float


class DisaggregateInfo(_Model):
    """Who prefills, who decodes, and how KV moves between them; chosen once by the router."""

    request_id: str
    router_id: str
    prefill: PeerInfo
    decode: PeerInfo
    protocol: str
    deadlines: PhaseDeadlines


class TopLogprob(_Model):
    token_id: int
    token: str
    logprob: float


class LogprobInfo(_Model):
    """Logprob of one sampled (or prompt) token, with the requested number of best alternatives.

    ``logprob`` None: a prompt's first token, which nothing precedes. ``rank``: 1 + how many tokens
    are likelier (given for prompt tokens; vLLM's ``prompt_logprobs`` show it)."""

    token_id: int
    token: str
    logprob: float | None = None
    top: list[TopLogprob] = Field(default_factory=list)
    rank: int | None = None


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from a prefix cache (in splitwise: the prefill instance's)."""


class ErrorInfo(_Model):
    """A failure as it crosses processes: the ``kind`` of its class in :mod:`pdserve.errors`, the
    message, the request field it concerns, and whether another instance may succeed. The router
    maps the kind to an HTTP status and OpenAI body in one table; nobody else picks codes."""

    kind: str
    message: str
    param: str | None = None
    retryable: bool = False

    @classmethod
    def of(cls, error: PdserveError, *, retryable: bool = False) -> ErrorInfo:
        return cls(
            kind=error.kind, message=error.message or str(error), param=error.param, retryable=retryable
        )


class Timing(_Model):
    """Where the first token's time went, measured by the instance that produced it (its own clock).

    ``s_ttft_s``: from the ``generate`` reaching that instance to the engine sampling the first
    token (queueing in its engine included); ``queue_s``: the part of it the request waited in the
    engine before its first prefill chunk ran (the rest is prefill); ``kv_transfer_s``: the
    splitwise KV write that followed.
    """

    s_ttft_s: float
    queue_s: float | None = None
    kv_transfer_s: float | None = None


class RequestDelta(_Model):
    """What happened to one request: new tokens, its finish, or its failure.

    A finished request has ``finish_reason`` set (and ``usage``); a failed one has ``error`` set
    and ``finish_reason == "error"``. ``attempt`` lets the router drop events of a superseded try
    (:data:`ANY_ATTEMPT` applies to whichever attempt is current).
    """

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[LogprobInfo] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    attempt: int = 0
    timing: Timing | None = None  # on the delta that carries the first token
    prompt_text: str | None = None
    """The prompt's text, on the delta with the first token of a request that asked (``echo``)."""
    prompt_logprobs: list[LogprobInfo] | None = None
    """One per prompt token (the first without ``logprob``), on the delta with the first token of a
    request whose sampling asked (``prompt_logprobs``); in splitwise the prefill instance sends it."""
    seq: int | None = None
    """This delta's number within its attempt (0, 1, 2, ..., across prefill and decode): the router
    drops a number it already accepted (a send repeated by a retry) and fails the attempt on a gap.
    ``None``: not numbered (a failure, or an event the router made itself)."""

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @classmethod
    def failure(
        cls, request_id: str, error: PdserveError, *, retryable: bool = False, attempt: int = 0
    ) -> RequestDelta:
        """The final event of a request that failed with ``error``."""
        info = ErrorInfo.of(error, retryable=retryable)
        return cls(request_id=request_id, finish_reason="error", error=info, attempt=attempt)


# -- stream messages -------------------------------------------------------------------------------


class _Message(_Model):
    v: int = Field(default=SCHEMA_VERSION, ge=1)


class GenerateRequest(_Message):
    """Router -> instance inbox: run one request (with ``disaggregate_info`` when split over P and D).

    Exactly one of ``prompt_token_ids``, ``prompt`` and ``messages`` (chat) is set. ``sampling``
    was validated by the router; decoding checks its types only. ``fill_max_tokens``: the client
    set no ``max_tokens`` (chat), so ``sampling.max_tokens`` is a placeholder: the worker makes it
    the model length minus the prompt length, which only it knows after tokenizing.

    ``echo``: put the prompt's text (its token ids decoded) in the first token's delta as
    ``prompt_text``; the router asks only for token-id prompts, whose text only a worker can make.

    ``tools`` (chat only): the request's tool definitions (OpenAI's ``tools`` entries), handed to the
    chat template as Hugging Face templates expect them.

    ``resume_token_ids`` (a migration): the tokens an earlier attempt already delivered to the
    client. The instance recomputes the prompt plus these and continues after them, as if it had
    generated them itself (text, stop strings, penalties, seeded draws, usage); always served whole
    by one instance, never split.
    """

    type: Literal["generate"] = "generate"
    request_id: str
    router_id: str
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    fill_max_tokens: bool | None = None
    deadline: float
    attempt: int = 0
    disaggregate_info: DisaggregateInfo | None = None
    resume_token_ids: list[int] | None = None
    echo: bool | None = None
    background: bool | None = None
    """A batch line: the instance runs it only in what online requests leave (see the engine's
    batcher); None or False: an online request."""

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [n for n in ("prompt_token_ids", "prompt", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt_token_ids, prompt, messages must be set, got {given}")
        if self.resume_token_ids and self.disaggregate_info is not None:
            raise ValueError("a resumed request (resume_token_ids) is served whole, not split")
        return self


class ReserveBlocks(_Message):
    """Prefill -> decode inbox: reserve KV blocks for ``num_tokens`` prompt tokens, answer ``reply_to``.

    Carries what decode needs to continue the request (``sampling`` with ``max_tokens`` filled in).
    Decode frees the reservation if no :class:`Prefilled` arrives by ``deadlines.transfer`` (a
    lease, not a leak).
    """

    type: Literal["reserve"] = "reserve"
    request_id: str
    router_id: str
    num_tokens: int
    reply_to: str
    deadline: float
    deadlines: PhaseDeadlines
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    prompt_token_ids: list[int]
    attempt: int = 0
    background: bool | None = None
    """The request's ``GenerateRequest.background``: the decode side schedules it the same way."""
    protocol: str | None = None
    """The transport the KV will come by (``DisaggregateInfo.protocol``): a decode instance whose
    cache that transport stages (Mooncake into a GPU) reserves room in its landing pool too."""
    transfer_budget_s: float | None = None
    """Seconds from this ask until the prefill side starts no more KV writes for it (its transfer
    deadline, on its own clock). The decode side's backstop counts it from when it reads the ask,
    on its own monotonic clock: no wall clocks are compared across hosts. None (an older prefill):
    ``deadlines.transfer`` on the decode side's wall clock."""


class ReserveReply(_Message):
    """Decode -> prefill inbox: the reserved block ids, or a refusal (``retry_after_ms`` when worth it)."""

    type: Literal["reserve_reply"] = "reserve_reply"
    request_id: str
    ok: bool
    block_ids: list[int] = Field(default_factory=list)
    error: str | None = None
    retry_after_ms: int | None = None
    attempt: int = 0
    num_cached_blocks: int = 0
    """The first ``num_cached_blocks`` of ``block_ids`` already hold this prompt's K/V (decode's
    prefix cache shares them): prefill writes only the blocks after them."""
    incarnation: str | None = None
    """The decode instance's incarnation that reserved the blocks (its ``TransferInfo.incarnation``):
    prefill writes them only into that incarnation's cache (a restart under the same id is another)."""
    lease: str | None = None
    """The reservation's id, new for every reservation: prefill names it in its ``Prefilled``, and
    decode continues only a request whose lease it holds."""
    staging_offset: int | None = None
    """Where prefill writes the blocks after ``num_cached_blocks``: this byte offset of the memory
    decode's endpoint registered, one block after another (a GPU cache staged in host memory, which
    decode copies into the blocks when ``prefilled`` arrives); None: at the blocks' own offsets."""


class Prefilled(_Message):
    """Prefill -> decode inbox: KV is written (or ``error`` says why not); go on from ``first_token``."""

    type: Literal["prefilled"] = "prefilled"
    request_id: str
    first_token: int
    prompt_token_ids: list[int]
    error: ErrorInfo | None = None
    attempt: int = 0
    next_seq: int = 1
    """The ``RequestDelta.seq`` decode's first delta gets (prefill published the ones before)."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefill instance took from its prefix cache (decode reports them in usage)."""
    protocol: str | None = None
    """The transport that wrote the KV (``DisaggregateInfo.protocol``): decode lets it land them
    (``TransportBackend.land``: a staged transport copies them from host memory to its GPU)."""
    lease: str | None = None
    """The reservation written into (``ReserveReply.lease``): decode refuses one it does not hold."""
    router_id: str | None = None
    """Whose request it is: decode tells that router when it refuses the hand-off."""
    kv_digests: str | None = None
    """Base64 of one 8-byte digest per block written (block-table order, the blocks after
    ``ReserveReply.num_cached_blocks``), of the bytes the prefill side read as it wrote them: the
    decode side checks its blocks against them before it decodes or caches any (None: not
    computed, by an older prefill or one with ``--no-kv-checksum``)."""
    kv_digest_algo: str | None = None
    """How ``kv_digests`` were computed (``cache_transfer.checksum``: ``xxh3_64`` for host caches)."""


class Abort(_Message):
    """Anyone -> instance inbox: stop a request and free its blocks (``attempt=None``: every attempt).

    A decode instance frees a reserved lease's blocks only once its writer is done: an abort from a
    router marks the lease aborted, and the blocks are freed when the prefill side's own message
    (``writer_done``, or a ``Prefilled``) says no write of it can still land, or at the lease's
    backstop."""

    type: Literal["abort"] = "abort"
    request_id: str
    reason: str
    attempt: int | None = None
    writer_done: bool | None = None
    """Sent by the request's prefill instance, the writer of its KV: none of its writes into the
    decode instance's blocks is running or will start (None: a router's abort)."""


class Tokenize(_Message):
    """Router -> instance inbox: tokenize ``prompt`` or chat ``messages`` (with ``tools``), or
    detokenize ``token_ids``; exactly one is set. The answer is one final RequestDelta in the
    router's outbox: ``token_ids`` (tokenize) or ``text`` (detokenize), ``usage.prompt_tokens`` the
    count. Serves ``POST /tokenize`` and ``/detokenize``: the router has no tokenizer.
    """

    type: Literal["tokenize"] = "tokenize"
    request_id: str
    router_id: str
    deadline: float
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool | None = None
    """None: as generation does (yes for a prompt, no for a rendered chat)."""
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> Tokenize:
        given = [n for n in ("prompt", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt, messages, token_ids must be set, got {given}")
        return self


class SetRole(_Message):
    """Anyone -> instance inbox: take ``role`` from now on (``pdserve role``, a planner). New work
    follows the registration's role at once; work of the old role already here finishes where it
    is, so no request fails or is retried. ``request_id`` names the switch (``last_switch.id``)."""

    type: Literal["set_role"] = "set_role"
    request_id: str
    role: Role
    reason: str | None = None


class StepOutput(_Message):
    """Instance -> router outbox: one engine step's deltas for the requests of ONE router.

    The batched exception to the top-level ``request_id`` rule: each item carries its own. Events
    outside a step (a rejection before running, a prefill-side failure) use the same shape with one
    item, so a router handles exactly one event type.
    """

    type: Literal["step"] = "step"
    instance_id: str
    items: list[RequestDelta]


InboxMessage = GenerateRequest | ReserveBlocks | ReserveReply | Prefilled | Abort | Tokenize | SetRole
"""What an instance's inbox carries."""
Message = Annotated[
    GenerateRequest | ReserveBlocks | ReserveReply | Prefilled | Abort | Tokenize | SetRole | StepOutput,
    Field(discriminator="type"),
]
"""Every stream message, discriminated by ``type``."""

MESSAGE_TYPES: dict[str, type[BaseModel]] = {
    cls.model_fields["type"].default: cls
    for cls in (GenerateRequest, ReserveBlocks, ReserveReply, Prefilled, Abort, Tokenize, SetRole, StepOutput)
}


def encode(msg: BaseModel) -> bytes:
    """Serialize a message (or registration value) to compact JSON; ``None`` fields are left out.

    pydantic-core's serializer writes the same JSON as ``orjson.dumps(msg.model_dump())`` in ~80%
    of the time (no intermediate dict: 14 vs 17 µs for a 32-item step); decoding uses orjson.
    """
    return msg.model_dump_json(exclude_none=True).encode()


def decode_message(data: bytes | str) -> Message:
    """Parse one stream message; raise MessageError with a clear reason when it cannot be used."""
    raw = _load(data)
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {kind!r}; known types: {sorted(MESSAGE_TYPES)}")
    return _validate(cls, raw, str(kind))  # type: ignore[return-value]


def decode_as(cls: type[_M], data: bytes | str) -> _M:
    """Parse a value that must be of one model (a registration value, or a message of known type)."""
    return _validate(cls, _load(data), cls.__name__)


def _load(data: bytes | str) -> dict[str, Any]:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise MessageError(f"message is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise MessageError(f"message must be a JSON object, got {type(raw).__name__}")
    v = raw.get("v", SCHEMA_VERSION)
    if isinstance(v, int) and not isinstance(v, bool) and v > SCHEMA_VERSION:
        raise MessageError(
            f"message schema v{v} is newer than this pdserve understands (v{SCHEMA_VERSION}); "
            "upgrade this process"
        )
    return raw


def _validate(cls: type[_M], raw: dict[str, Any], what: str) -> _M:
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<message>'}: {err['msg']}" for err in e.errors()
        )
        raise MessageError(f"invalid {what} message: {problems}") from None
