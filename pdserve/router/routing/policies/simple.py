"""The request-blind policies: ``round_robin`` and ``random``."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from pdserve.router.routing.policies.base import PolicyRequest
from pdserve.scheduler.registration import InstanceInfo


class RoundRobin:
    """Each pick takes the next candidate; fair while the candidate set holds still."""

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return choice


class Random:
    """Uniformly random; needs no state, so replicas never synchronise into the same choice."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        return candidates[self._rng.randrange(len(candidates))]
