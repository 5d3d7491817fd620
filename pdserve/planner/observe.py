"""What the planner sees: the instances' registrations and the routers' traffic, from Redis.

Everything is read from what routers and instances already publish there: the live set (roles,
queues, KV use, switchability) and each router's ``traffic`` (its last window's finished requests,
prompt and generated tokens, TTFT / inter-token latency histograms, prefix hits, KV transfer
times, and what arrived: ``demand.py``), whose histograms are merged across routers before their
90th percentile is taken; and each instance's measured seconds per prompt and per answer token.
Nothing is kept between reads but what the rule keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.scheduler import InstanceInfo, InstanceRegistry, Keys, RouterInfo, RouterRegistry, TrafficInfo
from pdserve.scheduler.redis_client import RedisClient


@dataclasses.dataclass(frozen=True)
class Member:
    """One instance as the rule weighs it."""

    id: str
    role: str
    switchable: bool
    draining: bool
    running: int
    waiting: int
    waiting_prefill_tokens: int
    handing_off: int
    kv_use: float  # share of its KV blocks in use
    prefill_s_per_token: float | None = None  # what it measured (its registration's rates)
    decode_s_per_token: float | None = None
    host: str | None = None
    idle_cpus: float | None = None  # its host's idle CPUs lately (None: not said, or a GPU instance)
    threads: int | None = None  # its engine's compute threads (with idle_cpus)

    @classmethod
    def of(cls, info: InstanceInfo) -> Member:
        load, rates = info.load, info.rates
        return cls(
            info.id,
            info.role,
            bool(info.switchable),
            info.draining,
            load.running,
            load.waiting,
            load.waiting_prefill_tokens,
            load.handing_off,
            round(1 - info.kv.free_blocks / info.kv.num_blocks, 4) if info.kv.num_blocks else 0.0,
            rates.prefill_s_per_token if rates is not None else None,
            rates.decode_s_per_token if rates is not None else None,
            info.host,
            info.cpu.idle if info.cpu is not None else None,
            info.cpu.threads if info.cpu is not None else None,
        )


@dataclasses.dataclass(frozen=True)
class Observation:
    """The cluster at one moment (``at``, unix s), for one model."""

    at: float
    model: str
    members: tuple[Member, ...]
    requests: int  # finished over the routers' windows
    window_s: float
    ttft_p90_s: float | None  # None: no request finished in the window
    itl_p90_s: float | None
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_rate: float | None = None  # of the prompt tokens routed by prefix, the cached share
    kv_transfer_mean_s: float | None = None  # a splitwise KV write's mean time in the window
    # what arrived in the routers' windows (TrafficInfo's fields of the same names, added up)
    arrivals: int = 0
    arrival_prompt_tokens: int = 0
    arrival_prompt_known: int = 0
    arrival_max_tokens: int = 0
    arrival_max_known: int = 0
    finished_asked: int = 0
    finished_generated: int = 0
    # requests whose first token came in the windows (the TTFT histogram's samples; None: a trace
    # recorded before routers counted them, where the finished requests stand in)
    first_tokens: int | None = None

    @property
    def latency_samples(self) -> int:
        """The requests the p90s rest on: those that got their first token in the window (their
        TTFTs, and their streams' gaps in the inter-token histogram), or where that is not known
        the finished ones."""
        return self.first_tokens if self.first_tokens is not None else self.requests

    def count(self, role: str) -> int:
        return sum(1 for m in self.members if m.role == role and not m.draining)

    def queued(self, role: str) -> int:
        """Requests waiting at the role's instances."""
        return sum(m.waiting for m in self.members if m.role == role and not m.draining)

    def kv_use(self, role: str) -> float | None:
        """The mean KV use of the role's instances (None: none)."""
        uses = [m.kv_use for m in self.members if m.role == role and not m.draining]
        return round(sum(uses) / len(uses), 4) if uses else None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["members"] = [dataclasses.asdict(m) for m in self.members]
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> Observation:
        members = tuple(Member(**m) for m in raw["members"])
        return cls(**{**raw, "members": members})


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile of a histogram (``counts[i]`` at most ``bounds[i]``; the last count past
    every bound), by linear interpolation within its bucket as Prometheus' histogram_quantile does;
    None when it is empty. Past the last bound: that bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, n in enumerate(counts):
        if seen + n >= rank and n > 0:
            if i >= len(bounds):
                return bounds[-1]
            low = bounds[i - 1] if i > 0 else 0.0
            return low + (bounds[i] - low) * (rank - seen) / n
        seen += n
    return bounds[-1]


def merged(traffic: Sequence[TrafficInfo]) -> tuple[list[float], list[int], list[float], list[int]]:
    """The routers' histograms added up (those whose bounds are the first one's)."""
    if not traffic:
        return [], [], [], []
    first = traffic[0]
    ttft, itl = [0] * len(first.ttft_counts), [0] * len(first.itl_counts)
    for t in traffic:
        if t.ttft_bounds == first.ttft_bounds and len(t.ttft_counts) == len(ttft):
            ttft = [a + b for a, b in zip(ttft, t.ttft_counts)]
        if t.itl_bounds == first.itl_bounds and len(t.itl_counts) == len(itl):
            itl = [a + b for a, b in zip(itl, t.itl_counts)]
    return first.ttft_bounds, ttft, first.itl_bounds, itl


def observation(
    instances: Sequence[InstanceInfo], routers: Sequence[RouterInfo], model: str, at: float
) -> Observation:
    """The observation of ``model``'s instances and every router's traffic."""
    # a batch worker's in-process router (port 0) serves batch lines, which have no latency target
    traffic = [r.traffic for r in routers if r.traffic is not None and r.port]
    ttft_bounds, ttft, itl_bounds, itl = merged(traffic)
    return Observation(
        at=at,
        model=model,
        members=tuple(Member.of(i) for i in instances if i.model == model),
        requests=sum(t.requests for t in traffic),
        window_s=max((t.window_s for t in traffic), default=0.0),
        ttft_p90_s=quantile(ttft_bounds, ttft, 0.9) if ttft else None,
        itl_p90_s=quantile(itl_bounds, itl, 0.9) if itl else None,
        prompt_tokens=sum(t.prompt_tokens for t in traffic),
        generation_tokens=sum(t.generation_tokens for t in traffic),
        prefix_hit_rate=_ratio(
            sum(t.prefix_hit_tokens for t in traffic), sum(t.prefix_lookup_tokens for t in traffic)
        ),
        kv_transfer_mean_s=_ratio(
            sum(t.kv_transfer_s for t in traffic), sum(t.kv_transfers for t in traffic)
        ),
        arrivals=sum(t.arrivals for t in traffic),
        arrival_prompt_tokens=sum(t.arrival_prompt_tokens for t in traffic),
        arrival_prompt_known=sum(t.arrival_prompt_known for t in traffic),
        arrival_max_tokens=sum(t.arrival_max_tokens for t in traffic),
        arrival_max_known=sum(t.arrival_max_known for t in traffic),
        finished_asked=sum(t.finished_asked for t in traffic),
        finished_generated=sum(t.finished_generated for t in traffic),
        first_tokens=sum(ttft),
    )


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


async def observe(redis: RedisClient, keys: Keys, model: str | None, at: float) -> Observation | None:
    """Read the live set and the routers from Redis; None when no instance serves a model (the
    only model when ``model`` is None)."""
    instances = await InstanceRegistry(redis, keys).live()
    routers = await RouterRegistry(redis, keys).live()
    models = sorted({i.model for i in instances})
    if model is None:
        if len(models) != 1:
            return None
        model = models[0]
    if model not in models:
        return None
    return observation(instances, routers, model, at)
