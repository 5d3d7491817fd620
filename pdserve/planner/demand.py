"""The demand arriving, in each role's time: what the planner splits the instances by before any
latency has moved (in the spirit of Dynamo's planner, which sizes prefill and decode from the
input and output lengths arriving and each role's profiled throughput).

From the routers' windows (``observe.py``): the arrival rate, the prompt tokens of an arriving
request and the answer tokens it will get; from the instances' registrations: what a prompt token
and an answer token cost here lately (``rates.prefill_s_per_token``, ``rates.decode_s_per_token``,
measured on the running instances, so under the host's present contention). Their products are
the **work** each role has to do: instance-seconds of computing per second, e.g. 384 prompt tokens/s
at 3.3 ms a token is 1.28 prefill instances kept busy. Why the arrivals and not the finished
requests: a request is counted the moment it is placed, so a shift shows within one planner
interval; a p90 of finished requests moves a window and a request's whole duration later, and a
throughput of finished requests is capped by the split it is meant to correct. The arrival rate
cancels out of the split (``prefill_share``): a few arrivals already tell what kind of traffic it is.

An arriving request's answer tokens: its ``max_tokens`` times the share of what was asked that
finished requests generated lately (1 before any), where the client set one; else the mean answer
of the requests finished in the window. Its prompt: its length where the router knew it, else the
finished requests' mean.
"""

from __future__ import annotations

import dataclasses
import statistics

from pdserve.planner.observe import Member, Observation


@dataclasses.dataclass(frozen=True)
class Demand:
    """The demand of one observation's window, and what each of its tokens costs here."""

    arrivals: int
    prompt_tokens_s: float  # prompt tokens arriving per second
    answer_tokens_s: float  # answer tokens the arrivals will be given, per second
    prefill_s_per_token: float
    decode_s_per_token: float

    @property
    def prefill_work(self) -> float:
        """Prefill instances the arrivals keep busy (instance-seconds per second)."""
        return self.prompt_tokens_s * self.prefill_s_per_token

    @property
    def decode_work(self) -> float:
        """Decode instances the arrivals keep busy."""
        return self.answer_tokens_s * self.decode_s_per_token

    def prefill_share(self, prefill_pressure: float = 1.0, decode_pressure: float = 1.0) -> float:
        """Prefill's share of the work, each side's weighed by its latency pressure where that is
        over 1 (a role missing its target needs more than its measured work says: queues, the
        host's contention), as Dynamo corrects its predictions by the latencies observed."""
        p = self.prefill_work * max(1.0, prefill_pressure)
        d = self.decode_work * max(1.0, decode_pressure)
        return p / (p + d)

    def as_dict(self) -> dict[str, float]:
        return {
            "arrivals": self.arrivals,
            "prompt_tokens_s": round(self.prompt_tokens_s, 1),
            "answer_tokens_s": round(self.answer_tokens_s, 1),
            "prefill_s_per_token": round(self.prefill_s_per_token, 6),
            "decode_s_per_token": round(self.decode_s_per_token, 6),
            "prefill_work": round(self.prefill_work, 3),
            "decode_work": round(self.decode_work, 3),
        }


def demand(obs: Observation, min_arrivals: int, prefill_rate: float | None = None) -> Demand | None:
    """The demand of ``obs``; None below ``min_arrivals`` arrivals in the window, or where a
    length or a token's cost is not known yet (no request finished nor measured, no instance
    timed a step of that kind): the rule then goes by the latencies alone. ``prefill_rate``: prompt
    tokens/s of one prefill instance as configured (``Targets.prefill_rate``), for where no
    instance measured one. Not the rule's learned rate: that is a lower bound from what finished
    requests showed, which at a light load is far below what an instance can do and would make
    prefill's work look many times what it is."""
    if obs.arrivals < max(1, min_arrivals) or obs.window_s <= 0:
        return None
    prompt = _prompt_per_arrival(obs)
    answer = _answer_per_arrival(obs)
    prefill_cost = _cost(obs.members, "prefill", "prefill_s_per_token")
    if prefill_cost is None and prefill_rate:
        prefill_cost = 1 / prefill_rate
    decode_cost = _cost(obs.members, "decode", "decode_s_per_token")
    if prompt is None or answer is None or prefill_cost is None or decode_cost is None:
        return None
    if prompt * prefill_cost + answer * decode_cost <= 0:
        return None
    rate = obs.arrivals / obs.window_s
    return Demand(obs.arrivals, rate * prompt, rate * answer, prefill_cost, decode_cost)


def _prompt_per_arrival(obs: Observation) -> float | None:
    if obs.arrival_prompt_known:
        return obs.arrival_prompt_tokens / obs.arrival_prompt_known
    return obs.prompt_tokens / obs.requests if obs.requests else None


def _answer_per_arrival(obs: Observation) -> float | None:
    """The answer tokens an arrival will get, over the window's arrivals (see the module)."""
    finished = obs.generation_tokens / obs.requests if obs.requests else None
    asked = obs.arrival_max_tokens / obs.arrival_max_known if obs.arrival_max_known else None
    fill = obs.finished_generated / obs.finished_asked if obs.finished_asked else 1.0
    unasked = obs.arrivals - obs.arrival_max_known
    if asked is None:
        return finished
    if unasked > 0 and finished is None:
        return asked * fill  # the arrivals without a max_tokens taken as those with one
    return (obs.arrival_max_known * asked * fill + unasked * (finished or 0.0)) / obs.arrivals


def _cost(members: tuple[Member, ...], role: str, rate: str) -> float | None:
    """The median of what the role's live instances measured; where none of them did, of any
    instance that did (one that had the role before keeps what it measured then)."""
    live = [m for m in members if not m.draining]
    for pool in ([m for m in live if m.role == role], live):
        costs = [v for m in pool if (v := getattr(m, rate)) is not None and v > 0]
        if costs:
            return float(statistics.median(costs))
    return None
