"""What a policy is: the request it places (:class:`PolicyRequest`), the :class:`Policy` protocol,
and the factory signature the registry (:data:`pdserve.router.policies.POLICIES`) holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pdserve.scheduler.messages import InstanceInfo

Stage = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    """What the router knows of a request when it places it (before any worker tokenized it).

    One per choice, built once and shared by all its attempts. At most one of ``text`` (a
    completions text prompt), ``token_ids`` (a completions token-id prompt) and ``messages`` (a
    chat, as the chat template takes it) is set. Policies must not modify what it holds.
    """

    model: str
    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None


class Policy(Protocol):
    """Picks one instance among candidates for one stage of one request."""

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        """One of ``candidates`` (never empty; filtered to the request's model and role, not
        draining, sorted by id); ``in_flight`` = this router's open requests per instance id."""
        ...


PolicyFactory = Callable[[Stage], Policy]
"""Makes the policy of one stage (a router holds one for prefill and one for decode)."""
