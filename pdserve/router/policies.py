"""How one instance is picked among candidates: ``round_robin``, ``random`` or ``least_load``.

A router holds one policy for prefill and one for decode (mixed instances use the decode one).
Candidates arrive already filtered (right model and role, not draining) and sorted by id.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from pdserve.scheduler.messages import InstanceInfo

Stage = Literal["prefill", "decode"]


class Policy(Protocol):
    def pick(self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int]) -> InstanceInfo:
        """One of ``candidates`` (never empty); ``in_flight`` = this router's open requests per instance id."""
        ...


class RoundRobin:
    """Each pick takes the next candidate; fair while the candidate set holds still."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int]) -> InstanceInfo:
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return choice


class Random:
    """Uniformly random; needs no state, so replicas never synchronise into the same choice."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int]) -> InstanceInfo:
        return candidates[self._rng.randrange(len(candidates))]


class LeastLoad:
    """The candidate with the least load, compared as a tuple:

    1. requests: ``running + waiting`` from its last heartbeat plus this router's own in-flight
       requests on it (fresh between heartbeats; they overlap the heartbeat's counts once the
       instance has seen them, which errs on the side of spreading),
    2. prefill only: ``waiting_prefill_tokens`` (the queued prompt work),
    3. most free KV blocks,
    4. a random draw, so that ties do not send every router to the same instance.
    """

    def __init__(self, stage: Stage, rng: random.Random | None = None) -> None:
        self.stage = stage
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int]) -> InstanceInfo:
        if len(candidates) == 1:
            return candidates[0]
        return min(candidates, key=lambda info: self.key(info, in_flight))

    def key(self, info: InstanceInfo, in_flight: Mapping[str, int]) -> tuple[int, int, int, float]:
        load = info.load
        requests = load.running + load.waiting + in_flight.get(info.id, 0)
        queued_tokens = load.waiting_prefill_tokens if self.stage == "prefill" else 0
        return requests, queued_tokens, -info.kv.free_blocks, self._rng.random()


POLICIES = ("round_robin", "random", "least_load")


def make_policy(name: str, stage: Stage) -> Policy:
    """The policy called ``name`` for ``stage``; ValueError for an unknown name."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "least_load":
        return LeastLoad(stage)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
