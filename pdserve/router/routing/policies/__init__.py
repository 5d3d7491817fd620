"""How one instance is picked among candidates: the policy registry.

A router holds one policy for prefill and one for decode (mixed instances use the decode one),
named by ``--prefill-policy`` / ``--decode-policy`` (their choices are this table's names).
Candidates arrive already filtered (right model and role, not draining) and sorted by id; every
pick also sees the request (:class:`PolicyRequest`). A new policy is one module in this package
plus one line in :data:`POLICIES`.
"""

from __future__ import annotations

from pdserve.router.routing.policies.base import Policy, PolicyFactory, PolicyRequest, PrefixWeights, Stage
from pdserve.router.routing.policies.least_load import LeastLoad
from pdserve.router.routing.policies.prefix_affinity import PrefixAffinity
from pdserve.router.routing.policies.prefix_cache import PairChoice, PrefixCache
from pdserve.router.routing.policies.simple import Random, RoundRobin

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "PairChoice",
    "Policy",
    "PolicyFactory",
    "PolicyRequest",
    "PrefixCache",
    "PrefixWeights",
    "Stage",
    "make_policy",
]

POLICIES: dict[str, PolicyFactory] = {
    "prefix_cache": PrefixCache,
    "least_load": lambda stage, weights: LeastLoad(stage),
    "prefix_affinity": lambda stage, weights: PrefixAffinity(stage),
    "round_robin": lambda stage, weights: RoundRobin(),
    "random": lambda stage, weights: Random(),
}
"""Policy name -> factory of the policy of one stage."""
POLICY_NAMES = tuple(POLICIES)


def make_policy(name: str, stage: Stage, weights: PrefixWeights | None = None) -> Policy:
    """The policy called ``name`` for ``stage``; ValueError for an unknown name."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return factory(stage, weights or PrefixWeights())
