"""What a policy is: the request it places (:class:`PolicyRequest`), the :class:`Policy` protocol,
and the factory signature the registry (:data:`pdserve.router.routing.policies.POLICIES`) holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pdserve.scheduler.registration import InstanceInfo

Stage = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    """What the router knows of a request when it places it (before any worker tokenized it).

    One per choice, built once and shared by all its attempts. At most one of ``text`` (a
    completions text prompt), ``token_ids`` (a completions token-id prompt) and ``messages`` (a
    chat, as the chat template takes it) is set. Policies must not modify what it holds.

    The rest is what a worker tokenizes the prompt with (``Tokenizer.prompt_ids``), so that a router
    computes the same ids (:mod:`pdserve.router.routing.prompt_ids`): the chat's ``tools`` as the template
    takes them, ``add_special_tokens`` (None: yes for a text prompt, no for a rendered chat),
    ``add_generation_prompt``; ``cache_salt``: the request's prefix-cache salt (None: unsalted).
    """

    model: str
    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    cache_salt: str | None = None
    num_tokens: int | None = None
    """The prompt's length in tokens, where the router tokenized it (set per attempt, with
    ``cached_tokens``)."""
    cached_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Instance id -> leading prompt tokens its prefix cache holds, from the prefix index (absent: 0)."""
    tier_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Instance id -> prompt tokens after ``cached_tokens`` that its host tier holds (read back
    instead of computed), from the prefix index's ``host`` sets (absent: 0)."""
    disk_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Instance id -> prompt tokens after ``cached_tokens`` and ``tier_tokens`` that its disk tier
    holds (read back from files its host's instances share), from that tier's set (absent: 0)."""
    holders: Sequence[InstanceInfo] = ()
    """The live instances of the model whose holds the three maps above report, candidates or not:
    where a candidate could fetch the prompt's prefix from (``policies.peer_fetch``)."""


class Policy(Protocol):
    """Picks one instance among candidates for one stage of one request."""

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        """One of ``candidates`` (never empty; filtered to the request's model and role, not
        draining, sorted by id); ``in_flight`` = this router's open requests per instance id."""
        ...


@dataclass(frozen=True)
class PrefixWeights:
    """The weights of the cost (``--prefix-load-tokens``, ``--prefix-transfer-weight``,
    ``--local-prefill-tokens``, ``--prefix-host-tier-weight``, ``--prefix-disk-tier-weight``). The
    transfer and tier weights stand in for the rates an instance has not measured yet (its
    registration's ``rates``), relative to its prefill price (``prefix_cache``)."""

    load_tokens: float = 64.0
    """What one open request on an instance costs, in prompt tokens to compute (at its prefill price)."""
    transfer: float = 0.05
    """What moving one token's KV to D (or from a peer that holds it: a fetch) costs, relative to
    computing it."""
    local_prefill_tokens: int = 0
    """A decode instance prefills a request itself when it lacks at most this many of its prompt
    tokens (0: never; a pair always prefills)."""
    host_tier: float = 0.1
    """What reading one token's KV back from an instance's host tier costs, relative to computing it."""
    disk_tier: float = 0.05
    """What reading one token's KV back from an instance's disk tier costs, relative to computing it:
    measured 1.5 ms to read, check and write back one SmolLM2 block from the page cache against
    56 ms to prefill it on one thread (0.026), doubled for a read past the page cache and a
    prefill on more threads (docs/design.md, the disk tier)."""


PolicyFactory = Callable[[Stage, PrefixWeights], Policy]
"""Makes the policy of one stage (a router holds one for prefill and one for decode); the weights
are the router's ``--prefix-*`` settings (only ``prefix_cache`` reads them)."""
