"""``prefix_affinity``: requests whose prompts begin alike go to the same instance while its load
allows, a building block for prefix-cache routing (an instance can reuse the KV cache of a shared
prefix, a system prompt or a conversation's earlier turns, only for requests sent to it).

The key is a prompt's first :data:`PREFIX_CHARS` characters (a text prompt, or a chat's messages
written out in order) or its first :data:`PREFIX_TOKENS` token ids. Candidates are ranked by a hash of
(key, instance id), rendezvous (highest-random-weight) hashing: every router computes the same ranking
from the same live set, so replicas agree without sharing any state, and an instance joining or
leaving moves only the keys it wins or held. The first-ranked candidate is taken unless its requests
are more than :data:`MAX_EXTRA_LOAD` above the least-loaded candidate's; then the next one of the
ranking within that bound is (the least loaded always is), so a hot prefix spills over to the same
second instance on every router. A request without a prompt the router can read is placed by
``least_load``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from pdserve.router.routing.policies.base import PolicyRequest, Stage
from pdserve.router.routing.policies.least_load import LeastLoad, requests_on
from pdserve.scheduler.registration import InstanceInfo

PREFIX_CHARS = 256
"""Characters of a text prompt (or of a chat's messages) that make its key."""
PREFIX_TOKENS = 64
"""Token ids of a token-id prompt that make its key."""
MAX_EXTRA_LOAD = 4
"""Requests an instance may have above the least-loaded candidate and still get its prefixes."""


def prefix_key(
    request: PolicyRequest, chars: int = PREFIX_CHARS, tokens: int = PREFIX_TOKENS
) -> bytes | None:
    """The digest of the request's prompt prefix; None when the router has no prompt to read."""
    if request.text is not None:
        raw = b"t" + request.text[:chars].encode()
    elif request.token_ids is not None:
        raw = b"i" + ",".join(map(str, request.token_ids[:tokens])).encode()
    elif request.messages is not None:
        parts: list[str] = []
        size = 0
        for message in request.messages:  # only as many messages as the prefix needs
            part = f"{message.get('role')}\x1f{message.get('content') or ''}\x1e"
            parts.append(part)
            size += len(part)
            if size >= chars:
                break
        raw = b"m" + "".join(parts)[:chars].encode()
    else:
        return None
    return hashlib.blake2b(raw, digest_size=16).digest()


def rank(key: bytes, candidates: Sequence[InstanceInfo]) -> list[InstanceInfo]:
    """``candidates`` in the key's order of preference (rendezvous hashing)."""
    return sorted(
        candidates,
        key=lambda info: hashlib.blake2b(key + info.id.encode(), digest_size=8).digest(),
        reverse=True,
    )


class PrefixAffinity:
    """The first candidate of the prompt prefix's ranking whose load is within ``max_extra_load``
    requests of the least loaded one's."""

    def __init__(
        self,
        stage: Stage,
        prefix_chars: int = PREFIX_CHARS,
        prefix_tokens: int = PREFIX_TOKENS,
        max_extra_load: int = MAX_EXTRA_LOAD,
    ) -> None:
        self.prefix_chars = prefix_chars
        self.prefix_tokens = prefix_tokens
        self.max_extra_load = max_extra_load
        self._fallback = LeastLoad(stage)

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        key = prefix_key(request, self.prefix_chars, self.prefix_tokens)
        if key is None or len(candidates) == 1:
            return self._fallback.pick(candidates, in_flight, request)
        loads = {info.id: requests_on(info, in_flight) for info in candidates}
        bound = min(loads.values()) + self.max_extra_load
        return next(info for info in rank(key, candidates) if loads[info.id] <= bound)
