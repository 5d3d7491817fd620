"""Inbox messages: what routers and peer instances send to an instance's inbox (``InboxMessage``):
run a request, reserve blocks and the reply, a prefilled hand-off, abort, tokenize, set a role, a
peer fetch and its answer (docs/design.md, "Inbox messages")."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.message_schema import Role, _Message, _Model
from pdserve.scheduler.outbox_messages import ErrorInfo


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


class FetchHint(_Model):
    """Where the instance that prefills a request can fetch the prompt's prefix blocks instead of
    computing them (``GenerateRequest.fetch``, set by a router's ``prefix_cache`` when it priced the
    fetch below the recompute): ``peer`` holds the prompt's first ``blocks`` full blocks (in its pool
    or its tiers, by the prefix index) and writes into this instance's cache over ``protocol``.
    ``expect_s``: the seconds the router priced the fetch at (the peer's step in progress, its
    read-back and the write), which the instance's wait for it follows (None: priced in tokens, or
    an older router). Added without a ``v`` bump."""

    peer: PeerInfo
    protocol: str
    blocks: int
    expect_s: float | None = None


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
    fetch: FetchHint | None = None
    """Fetch the prompt's prefix from a peer before computing (None: compute what the instance's own
    pool and tiers lack). A fetch that fails is a miss: the blocks are computed. Added without a
    ``v`` bump: an older instance ignores it and computes them."""

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


class FetchBlocks(_Message):
    """Fetcher -> holder inbox: write the blocks named by ``block_hashes`` into my ``block_ids``.

    The holder writes the leading run of them it holds (pool, then tiers) through its writer over
    ``protocol`` into ``fetcher``'s cache (its registered ``transfer``: endpoint and incarnation),
    fenced to ``incarnation`` and started no later than ``budget_s`` after it reads this (its own
    clock), digesting each block as it goes; then it answers :class:`FetchedBlocks`. The fetcher
    holds ``block_ids`` until that answer or its own backstop: no write into them can land after
    they are handed to another request."""

    type: Literal["fetch_blocks"] = "fetch_blocks"
    request_id: str
    """The fetch's own id (the request's engine key + ``#fetch``): its messages never wait behind the
    request's."""
    reply_to: str
    fetcher: PeerInfo
    protocol: str
    block_hashes: str
    """Base64 of the 16-byte chain hashes (``block_hash``) of the blocks wanted, in order."""
    block_ids: list[int]
    """Where each goes in the fetcher's cache (the same count, the same order)."""
    lease: str
    """The fetcher's id of this reservation: the answer names it."""
    incarnation: str | None = None
    """The fetcher's incarnation that reserved the blocks: written only into that cache."""
    budget_s: float
    """Seconds from reading this until the holder starts no more writes for it."""
    namespace: str
    """The fetcher's KV namespace (hex of ``TierNamespace.digest``: weights, their precision, KV
    dtype, layout, block size and bytes): a holder of another namespace writes nothing."""
    staging_offset: int | None = None
    """As ``ReserveReply.staging_offset``: where a staged cache has the blocks land first."""


class FetchedBlocks(_Message):
    """Holder -> fetcher inbox: the first ``num_blocks`` asked blocks are written (0 and ``error``:
    none), with one digest per block written of the bytes the holder read; no write of this fetch
    can land after it."""

    type: Literal["fetched"] = "fetched"
    request_id: str
    lease: str
    num_blocks: int = 0
    kv_digests: str | None = None
    """As ``Prefilled.kv_digests``: the fetcher checks its blocks against them before it uses any."""
    kv_digest_algo: str | None = None
    error: str | None = None


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


InboxMessage = (
    GenerateRequest
    | ReserveBlocks
    | ReserveReply
    | Prefilled
    | Abort
    | Tokenize
    | SetRole
    | FetchBlocks
    | FetchedBlocks
)
"""What an instance's inbox carries."""
