"""``least_load`` (the default): the candidate with the least work, by heartbeat and own counts."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from pdserve.router.routing.policies.base import PolicyRequest, Stage
from pdserve.scheduler.registration import InstanceInfo


def requests_on(info: InstanceInfo, in_flight: Mapping[str, int]) -> int:
    """An instance's requests: ``running + waiting + handing_off`` (a prefill instance's hand-offs
    in flight hold its KV blocks and its transfers) from its last heartbeat plus this router's own
    in-flight requests on it (fresh between heartbeats; they overlap the heartbeat's counts once
    the instance has seen them, which errs on the side of spreading)."""
    load = info.load
    return load.running + load.waiting + load.handing_off + in_flight.get(info.id, 0)


class LeastLoad:
    """The candidate with the least load, compared as a tuple:

    1. requests (:func:`requests_on`),
    2. prefill only: ``waiting_prefill_tokens`` (the queued prompt work),
    3. most free KV blocks,
    4. a random draw, so that ties do not send every router to the same instance.
    """

    def __init__(self, stage: Stage, rng: random.Random | None = None) -> None:
        self.stage = stage
        self._rng = rng or random.Random()

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        if len(candidates) == 1:
            return candidates[0]
        return min(candidates, key=lambda info: self.key(info, in_flight))

    def key(self, info: InstanceInfo, in_flight: Mapping[str, int]) -> tuple[int, int, int, float]:
        queued_tokens = info.load.waiting_prefill_tokens if self.stage == "prefill" else 0
        return requests_on(info, in_flight), queued_tokens, -info.kv.free_blocks, self._rng.random()
