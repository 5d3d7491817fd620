"""``prefix_cache`` (the default): the candidate, or for splitwise the pair, where the request costs
least, counting the prompt tokens each instance's prefix cache saves against its load.

The router knows each instance's cached prefix of the prompt from the prefix index
(``PolicyRequest.cached_tokens``; the dispatcher fills it). Costs are in prompt tokens:

- prefill on instance *i*: ``new(i) + load(i)``, where ``new(i) = prompt tokens − cached(i) −
  (1 − host_tier) × tier(i) − (1 − disk_tier) × disk(i)`` is what *i* must compute (``tier(i)``:
  the tokens after its cached prefix that its host tier holds, each read back at ``host_tier`` of a
  computed token's cost; ``disk(i)``: those after them its disk tier holds, at ``disk_tier``) and
  ``load(i) = load_tokens × requests(i) + queued prefill tokens(i)``
  (requests: running + waiting from the heartbeat plus this router's own; queued: the heartbeat's
  ``waiting_prefill_tokens``);
- a pair (P, D): ``new(P) + load(P) + transfer × (prompt tokens − cached(D)) + load_tokens ×
  requests(D)``: D's cached blocks are not moved, so a D that holds the previous turn of a chat
  costs less;
- D alone (conditional disaggregation): when ``prompt tokens − cached(D) <= local_prefill_tokens``
  the pair is compared with D prefilling the rest itself, ``new(D) + load(D)``, and the cheaper wins.

Ties are broken at random (routers must not all pick the same instance). Without the index (no
prompt ids, no instance with a prefix cache) every ``cached`` is 0 and the policy places by load.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from pdserve.router.routing.policies.base import PolicyRequest, PrefixWeights, Stage
from pdserve.router.routing.policies.least_load import requests_on
from pdserve.scheduler.registration import InstanceInfo


@dataclasses.dataclass(frozen=True, slots=True)
class PairChoice:
    """The pair picked (``prefill`` None: ``decode`` prefills the prompt itself)."""

    decode: InstanceInfo
    prefill: InstanceInfo | None


class PrefixCache:
    def __init__(self, stage: Stage, weights: PrefixWeights | None = None, rng: random.Random | None = None):
        self.stage = stage
        self.weights = weights or PrefixWeights()
        self._rng = rng or random.Random()

    def new_tokens(self, info: InstanceInfo, request: PolicyRequest) -> int:
        """Prompt tokens ``info`` must compute or receive (its prefix cache holds the rest)."""
        n = request.num_tokens or 0
        return max(0, n - request.cached_tokens.get(info.id, 0))

    def prefill_tokens(self, info: InstanceInfo, request: PolicyRequest) -> float:
        """What prefilling on ``info`` costs in computed tokens: its host tier's blocks are read
        back at ``host_tier`` of a token each, its disk tier's at ``disk_tier``."""
        w = self.weights
        tier = request.tier_tokens.get(info.id, 0)
        disk = request.disk_tokens.get(info.id, 0)
        saved = (1 - w.host_tier) * tier + (1 - w.disk_tier) * disk
        return max(0.0, self.new_tokens(info, request) - saved)

    def prefill_cost(self, info: InstanceInfo, in_flight: Mapping[str, int], request: PolicyRequest) -> float:
        load = self.weights.load_tokens * requests_on(info, in_flight) + info.load.waiting_prefill_tokens
        return self.prefill_tokens(info, request) + load

    def decode_cost(self, info: InstanceInfo, in_flight: Mapping[str, int], request: PolicyRequest) -> float:
        moved = self.weights.transfer * self.new_tokens(info, request)
        return moved + self.weights.load_tokens * requests_on(info, in_flight)

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        """The instance that prefills at least cost: one that serves the whole request (mixed,
        aggregated), or P of a pair picked stage by stage."""
        if len(candidates) == 1:
            return candidates[0]
        return min(
            candidates, key=lambda info: (self.prefill_cost(info, in_flight, request), self._rng.random())
        )

    def pick_pair(
        self,
        pairs: Sequence[tuple[InstanceInfo, InstanceInfo]],
        in_flight: Mapping[str, int],
        request: PolicyRequest,
    ) -> PairChoice:
        """The cheapest of the usable (prefill, decode) ``pairs`` (never empty), or a decode instance
        alone when it lacks few enough prompt tokens and that is cheaper."""
        prefill_costs: dict[str, float] = {}
        decode_costs: dict[str, float] = {}
        best: tuple[float, float, PairChoice] | None = None
        for p, d in pairs:
            if p.id not in prefill_costs:
                prefill_costs[p.id] = self.prefill_cost(p, in_flight, request)
            if d.id not in decode_costs:
                decode_costs[d.id] = self.decode_cost(d, in_flight, request)
            option = (prefill_costs[p.id] + decode_costs[d.id], self._rng.random(), PairChoice(d, p))
            if best is None or option[:2] < best[:2]:
                best = option
        limit = self.weights.local_prefill_tokens
        if request.num_tokens is not None and limit > 0:
            for d in {d.id: d for _, d in pairs}.values():
                if self.new_tokens(d, request) <= limit:
                    option = (
                        self.prefill_cost(d, in_flight, request),
                        self._rng.random(),
                        PairChoice(d, None),
                    )
                    if best is None or option[:2] < best[:2]:
                        best = option
        assert best is not None, "pick_pair needs at least one pair"
        return best[2]
