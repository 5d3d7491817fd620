"""``prefix_cache`` (the default): the candidate, or for splitwise the pair, where the request costs
least, counting the prompt tokens each instance's prefix cache saves against its load.

The router knows each instance's cached prefix of the prompt from the prefix index
(``PolicyRequest.cached_tokens``; the dispatcher fills it). Costs are in seconds where some
candidate has measured its prefill rate (its registration's ``rates``), else in prompt tokens:

- prefill on instance *i*: ``computed(i) × p(i) + tier(i) / block_size × host_read(i) + disk(i) /
  block_size × disk_read(i) + load(i) × p(i)``, where ``computed(i) = prompt tokens − cached(i) −
  tier(i) − disk(i)`` is what *i* must compute (``tier(i)``: the tokens after its cached prefix
  that its host tier holds; ``disk(i)``: those after them its disk tier holds), ``p(i)`` its
  measured seconds per prompt token, ``host_read(i)`` and ``disk_read(i)`` its measured seconds per
  block read back, and ``load(i) = load_tokens × requests(i) + queued prefill tokens(i)``
  (requests: running + waiting from the heartbeat plus this router's own; queued: the heartbeat's
  ``waiting_prefill_tokens``);
- a fetch: where a peer holds more of the prompt's prefix than *i* (its pool or tiers) and can
  write into *i*'s cache, *i* may fetch those blocks instead of computing them; the fetch replaces
  their compute in ``prefill(i)`` when it costs less (``policies.peer_fetch``: the peer's step in
  progress, which the fetch waits for, plus *i*'s measured seconds per fetched block, else the
  peer's per block written and read back, else the weights);
  the estimate's ``fetch`` names it, and the router tells the instance (``GenerateRequest.fetch``);
- a pair (P, D): ``prefill(P) + moved(D) / block_size × transfer(P) + read(D) + load_tokens ×
  requests(D) × p(D)``, ``moved(D) = prompt tokens − cached(D) − tier(D) − disk(D)``,
  ``transfer(P)`` P's measured seconds per block of its hand-offs over the pair's protocol, ``read(D)``
  D's read-back of the blocks its tiers hold at its reservation: D's cached blocks are not moved, so
  a D that holds the previous turn of a chat costs less;
- D alone (conditional disaggregation): when ``prompt tokens − cached(D) <= local_prefill_tokens``
  the pair is compared with D prefilling the rest itself, ``prefill(D)``, and the cheaper wins.

A rate an instance has not measured yet falls back to the weights (``PrefixWeights``, the
``--prefix-*`` flags), each relative to computing a token: ``p(i)`` is the median of the
candidates' measured prefill rates (a new instance is taken for a typical one), a host tier's read
costs ``host_tier × p(i)`` a token, a disk tier's ``disk_tier × p(i)``, a transfer ``transfer ×
p(P)``. With no measured prefill rate among the candidates every ``p`` is 1: the costs are the
weights' prompt tokens (``new(i) − (1 − host_tier) × tier(i) − (1 − disk_tier) × disk(i) +
load(i)``), and measured read-back times are not used (they cannot be set against tokens).

Ties are broken at random (routers must not all pick the same instance). Without the index (no
prompt ids, no instance with a prefix cache) every ``cached`` is 0 and the policy places by load.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdserve.router.routing.policies.base import PolicyRequest, PrefixWeights, Stage
from pdserve.router.routing.policies.least_load import requests_on
from pdserve.router.routing.policies.peer_fetch import FetchPlan, FetchProtocol, best_fetch
from pdserve.scheduler.registration import InstanceInfo

SOURCES = ("cache_hit", "host_tier", "disk_tier", "peer", "recompute")
"""Where a picked instance gets the prompt's KV beyond computing it (:attr:`Estimate.source`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """What the policy expected of its pick (the router's metrics show it)."""

    cost: float
    """The pick's cost: seconds when ``seconds``, else prompt tokens."""
    seconds: bool
    """Some candidate had measured its prefill rate: the costs were in seconds."""
    measured: bool
    """The picked instance (P of a pair) was priced at its own measured prefill rate."""
    source: str
    """Where the picked instance gets the prompt's KV beyond computing it (:data:`SOURCES`): a peer
    it fetches from, else a read-back from its disk or host tier (the lowest it reads), else its
    pool, else nothing."""
    fetch: FetchPlan | None = None
    """The fetch from a peer the pick counted on (its instance is told), None: none."""


@dataclasses.dataclass(frozen=True, slots=True)
class PairChoice:
    """The pair picked (``prefill`` None: ``decode`` prefills the prompt itself)."""

    decode: InstanceInfo
    prefill: InstanceInfo | None
    estimate: Estimate | None = None


_Option = tuple[float, float, InstanceInfo, "InstanceInfo | None"]
"""A pair-or-decode option of :meth:`PrefixCache.pick_pair`: cost, tie-break draw, D, P."""


def own_rate(info: InstanceInfo) -> float | None:
    """The seconds per prompt token ``info`` measured (None: none yet, or not a positive one)."""
    rate = info.rates.prefill_s_per_token if info.rates is not None else None
    return rate if rate is not None and rate > 0 else None


def fleet_rate(instances: Iterable[InstanceInfo]) -> float | None:
    """The median of the measured prefill rates (seconds per prompt token) among ``instances``
    (None when none measured one): what an instance that has not measured its own is taken for."""
    rates = {info.id: rate for info in instances if (rate := own_rate(info)) is not None}
    return statistics.median(rates.values()) if rates else None


class PrefixCache:
    def __init__(self, stage: Stage, weights: PrefixWeights | None = None, rng: random.Random | None = None):
        self.stage = stage
        self.weights = weights or PrefixWeights()
        self._rng = rng or random.Random()
        self.fetch_protocol: FetchProtocol | None = None
        """How a holder writes into an instance that fetches from it (the selector's rule); None:
        no fetch is ever priced."""

    def new_tokens(self, info: InstanceInfo, request: PolicyRequest) -> int:
        """Prompt tokens ``info`` must compute or receive (its prefix cache holds the rest)."""
        n = request.num_tokens or 0
        return max(0, n - request.cached_tokens.get(info.id, 0))

    def prefill_tokens(self, info: InstanceInfo, request: PolicyRequest) -> float:
        """What prefilling on ``info`` costs in computed tokens by the weights: its host tier's
        blocks are read back at ``host_tier`` of a token each, its disk tier's at ``disk_tier``."""
        w = self.weights
        tier = request.tier_tokens.get(info.id, 0)
        disk = request.disk_tokens.get(info.id, 0)
        saved = (1 - w.host_tier) * tier + (1 - w.disk_tier) * disk
        return max(0.0, self.new_tokens(info, request) - saved)

    @staticmethod
    def token_price(info: InstanceInfo, fleet: float | None) -> float:
        """Seconds per prompt token computed on ``info``: its measured rate, else ``fleet`` (the
        candidates' median); 1 when no candidate measured one (costs in tokens)."""
        if fleet is None:
            return 1.0
        own = own_rate(info)
        return own if own is not None else fleet

    def fetch_plan(
        self, info: InstanceInfo, request: PolicyRequest, fleet: float | None = None
    ) -> FetchPlan | None:
        """The fetch from a peer that saves ``info`` most against computing those tokens (None:
        none does, or fetching is off)."""
        if self.fetch_protocol is None:
            return None
        price = lambda i: self.token_price(i, fleet)  # noqa: E731
        return best_fetch(info, request, self.weights, price, fleet is not None, self.fetch_protocol)

    def prefill_work(self, info: InstanceInfo, request: PolicyRequest, fleet: float | None = None) -> float:
        """What computing, reading back and fetching the prompt's missing KV on ``info`` costs, load
        aside: seconds when ``fleet`` (the candidates' median prefill rate) is known, else tokens."""
        work = self._local_work(info, request, fleet)
        plan = self.fetch_plan(info, request, fleet)
        return work if plan is None else work - plan.saved + plan.cost

    def _local_work(self, info: InstanceInfo, request: PolicyRequest, fleet: float | None) -> float:
        """:meth:`prefill_work` without a fetch: compute what its pool and tiers lack."""
        if fleet is None:
            return self.prefill_tokens(info, request)
        w, rates = self.weights, info.rates
        p = self.token_price(info, fleet)
        tier = request.tier_tokens.get(info.id, 0)
        disk = request.disk_tokens.get(info.id, 0)
        computed = max(0, self.new_tokens(info, request) - tier - disk)
        bs = info.kv.block_size or 1
        host_read = rates.host_read_s_per_block if rates is not None else None
        disk_read = rates.disk_read_s_per_block if rates is not None else None
        host_cost = tier / bs * host_read if host_read is not None else w.host_tier * tier * p
        disk_cost = disk / bs * disk_read if disk_read is not None else w.disk_tier * disk * p
        return computed * p + host_cost + disk_cost

    def prefill_cost(
        self,
        info: InstanceInfo,
        in_flight: Mapping[str, int],
        request: PolicyRequest,
        fleet: float | None = None,
    ) -> float:
        """Prefilling on ``info`` with its queue ahead: seconds when ``fleet`` is known, else tokens."""
        load = self.weights.load_tokens * requests_on(info, in_flight) + info.load.waiting_prefill_tokens
        return self.prefill_work(info, request, fleet) + load * self.token_price(info, fleet)

    def transfer_cost(
        self,
        prefill: InstanceInfo,
        decode: InstanceInfo,
        request: PolicyRequest,
        fleet: float | None = None,
        protocol: str | None = None,
    ) -> float:
        """Moving the prompt's KV that ``decode`` lacks from ``prefill``: by P's measured seconds per
        block over ``protocol`` where it has one (and costs are in seconds), else by the weight.
        What D's tiers hold is not moved: D reads it back at its reservation (its read-back rates,
        else the tier weights)."""
        w, bs = self.weights, prefill.kv.block_size or 1
        tier, disk = request.tier_tokens.get(decode.id, 0), request.disk_tokens.get(decode.id, 0)
        moved = max(0, self.new_tokens(decode, request) - tier - disk)
        rates, d_rates = prefill.rates, decode.rates
        measured = (rates.transfer_s_per_block or {}).get(protocol) if rates and protocol else None
        if fleet is None:
            return w.transfer * moved + w.host_tier * tier + w.disk_tier * disk
        cost = (
            moved / bs * measured
            if measured is not None
            else w.transfer * moved * self.token_price(prefill, fleet)
        )
        host_read = d_rates.host_read_s_per_block if d_rates is not None else None
        disk_read = d_rates.disk_read_s_per_block if d_rates is not None else None
        p_d = self.token_price(decode, fleet)
        cost += tier / bs * host_read if host_read is not None else w.host_tier * tier * p_d
        return cost + (disk / bs * disk_read if disk_read is not None else w.disk_tier * disk * p_d)

    def decode_load(
        self, info: InstanceInfo, in_flight: Mapping[str, int], fleet: float | None = None
    ) -> float:
        """A decode instance's open requests, each ``load_tokens`` at its prefill price."""
        return self.weights.load_tokens * requests_on(info, in_flight) * self.token_price(info, fleet)

    def estimate(
        self, info: InstanceInfo, request: PolicyRequest, cost: float, fleet: float | None
    ) -> Estimate:
        """What a pick of ``info`` (the instance that prefills) at ``cost`` expected."""
        plan = self.fetch_plan(info, request, fleet)
        if plan is not None:
            source = "peer"
        elif request.disk_tokens.get(info.id, 0):
            source = "disk_tier"
        elif request.tier_tokens.get(info.id, 0):
            source = "host_tier"
        elif request.cached_tokens.get(info.id, 0):
            source = "cache_hit"
        else:
            source = "recompute"
        measured = fleet is not None and own_rate(info) is not None
        return Estimate(cost, fleet is not None, measured, source, plan)

    def choose(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> tuple[InstanceInfo, Estimate]:
        """The instance that prefills at least cost, and what it expected."""
        fleet = fleet_rate(candidates)
        best = min(
            (
                (self.prefill_cost(info, in_flight, request, fleet), self._rng.random(), info)
                for info in candidates
            ),
            key=lambda option: option[:2],
        )
        return best[2], self.estimate(best[2], request, best[0], fleet)

    def pick(
        self, candidates: Sequence[InstanceInfo], in_flight: Mapping[str, int], request: PolicyRequest
    ) -> InstanceInfo:
        """The instance that prefills at least cost: one that serves the whole request (mixed,
        aggregated), or P of a pair picked stage by stage."""
        if len(candidates) == 1:
            return candidates[0]
        return self.choose(candidates, in_flight, request)[0]

    def pick_pair(
        self,
        pairs: Sequence[tuple[InstanceInfo, InstanceInfo]],
        in_flight: Mapping[str, int],
        request: PolicyRequest,
        protocol: Callable[[InstanceInfo, InstanceInfo], str | None] | None = None,
    ) -> PairChoice:
        """The cheapest of the usable (prefill, decode) ``pairs`` (never empty), or a decode instance
        alone when it lacks few enough prompt tokens and that is cheaper. ``protocol``: how a pair
        hands off (P's measured transfer rate is per protocol; None: by the weight)."""
        fleet = fleet_rate({info.id: info for pair in pairs for info in pair}.values())
        prefill_costs: dict[str, float] = {}
        decode_loads: dict[str, float] = {}
        best: _Option | None = None
        option: _Option
        for p, d in pairs:
            if p.id not in prefill_costs:
                prefill_costs[p.id] = self.prefill_cost(p, in_flight, request, fleet)
            if d.id not in decode_loads:
                decode_loads[d.id] = self.decode_load(d, in_flight, fleet)
            moved = self.transfer_cost(p, d, request, fleet, protocol(p, d) if protocol else None)
            option = (prefill_costs[p.id] + moved + decode_loads[d.id], self._rng.random(), d, p)
            if best is None or option[:2] < best[:2]:
                best = option
        limit = self.weights.local_prefill_tokens
        if request.num_tokens is not None and limit > 0:
            for d in {d.id: d for _, d in pairs}.values():
                if self.new_tokens(d, request) <= limit:
                    option = (self.prefill_cost(d, in_flight, request, fleet), self._rng.random(), d, None)
                    if best is None or option[:2] < best[:2]:
                        best = option
        assert best is not None, "pick_pair needs at least one pair"
        cost, _, decode, prefill = best
        return PairChoice(decode, prefill, self.estimate(prefill or decode, request, cost, fleet))
