"""The planner's rule: from what the cluster serves now to the prefill:decode split it should have.

Given targets for the 90th percentiles of time to first token and of inter-token latency (the
SLOs), each observation gives two pressures: ``rt = ttft_p90 / target`` (prefill's) and ``ri =
itl_p90 / target`` (decode's). With both met (≤ 1) nothing changes; otherwise the split follows
them: of the ``n`` instances that take part in splits (prefill and decode), prefill gets ``round(n
× rt / (rt + ri))``, at least one and at most ``n - 1``, the rest decode, moving one instance per
change (the latencies answer a switch unevenly: the next observation says whether another helps). Instances move between
the two roles by switches (``SetRole``): a decode instance can always become a prefill instance; a
prefill instance becomes a decode instance only when it is ``switchable`` (its cache must be
where peers write), the least loaded ones first. Where instances may be added (``max_instances``
above the count), both pressures above 1 add one to the role under more pressure; both under
:data:`IDLE` remove one from the other, down to ``min_instances``; the desired counts say it, for
whoever starts and stops instances (``pdserve up --autoscale``, Kubernetes through the planner's
metric).

Hysteresis, so a steady load never makes it flap:

* a change is made only after the same target came out ``patience`` observations in a row;
* none within ``cooldown_s`` of the last (its effect must reach the latencies first: they are
  measured over the routers' last 30 s);
* none reversing the last one's direction within ``reverse_s`` (default 300 s): on a steady load
  that sits between two splits, at most one change in five minutes;
* nothing at all from fewer than ``min_requests`` finished requests (too few to estimate a p90).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.planner.observe import Member, Observation

IDLE = 0.5
"""Both pressures under this (with instances to spare): one instance fewer would still meet them."""


@dataclasses.dataclass(frozen=True)
class Targets:
    """The SLOs, and how the rule may act on them."""

    ttft_p90_s: float
    itl_p90_s: float
    patience: int = 3
    cooldown_s: float = 60.0
    reverse_s: float = 300.0
    min_requests: int = 20
    min_instances: int = 2
    max_instances: int | None = None  # None: the count is not the planner's to change


@dataclasses.dataclass
class PlannerState:
    """What the rule remembers between observations (rebuilt from the decisions stream at start)."""

    candidate: tuple[int, int] | None = None  # the (prefill, decode) target seen in a row
    streak: int = 0
    last_change_at: float = float("-inf")
    last_direction: int = 0  # +1: toward prefill, -1: toward decode, 0: none yet


@dataclasses.dataclass(frozen=True)
class Switch:
    instance: str
    from_role: str
    to_role: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """One observation's outcome: the split wanted, the switches that make it, and why."""

    at: float
    action: str  # "switch", "scale", "hold"
    reason: str
    current: dict[str, int]
    desired: dict[str, int]
    switches: tuple[Switch, ...] = ()
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def decide(obs: Observation, targets: Targets, state: PlannerState) -> Decision:
    """The decision for ``obs``; ``state`` is updated (a change resets the streak)."""
    p, d = obs.count("prefill"), obs.count("decode")
    current = {"prefill": p, "decode": d, "mixed": obs.count("mixed")}
    rt = obs.ttft_p90_s / targets.ttft_p90_s if obs.ttft_p90_s is not None else None
    ri = obs.itl_p90_s / targets.itl_p90_s if obs.itl_p90_s is not None else None
    inputs = {
        "ttft_p90_s": obs.ttft_p90_s,
        "itl_p90_s": obs.itl_p90_s,
        "ttft_pressure": rt,
        "itl_pressure": ri,
        "requests": obs.requests,
        "window_s": obs.window_s,
        "prompt_tokens_per_request": round(obs.prompt_tokens / obs.requests, 1) if obs.requests else None,
        "generation_tokens_per_request": round(obs.generation_tokens / obs.requests, 1)
        if obs.requests
        else None,
        "queued": {role: obs.queued(role) for role in ("prefill", "decode", "mixed")},
        "kv_use": {role: obs.kv_use(role) for role in ("prefill", "decode", "mixed")},
        "unswitchable": sum(
            1 for m in obs.members if m.role in ("prefill", "decode") and not m.switchable and not m.draining
        ),
        "prefix_hit_rate": obs.prefix_hit_rate,
        "kv_transfer_mean_s": obs.kv_transfer_mean_s,
    }

    def hold(reason: str) -> Decision:
        state.candidate, state.streak = None, 0
        return Decision(obs.at, "hold", reason, current, current, inputs=inputs)

    if obs.requests < targets.min_requests or rt is None or ri is None:
        return hold(f"too little traffic to judge ({obs.requests} requests finished lately)")
    if p < 1 or d < 1:
        return hold("no prefill/decode split to adjust")
    target = _target(p, d, rt, ri, targets)
    if target == (p, d):
        return hold(
            "the targets are met" if rt <= 1 and ri <= 1 else "the split already follows the pressures"
        )
    if state.candidate == target:
        state.streak += 1
    else:
        state.candidate, state.streak = target, 1
    desired = {"prefill": target[0], "decode": target[1], "mixed": current["mixed"]}
    share = target[0] / (target[0] + target[1]) - p / (p + d)  # of prefill, toward the target
    direction = (share > 0) - (share < 0)
    why = f"TTFT p90 at {rt:.2f}x its target, inter-token p90 at {ri:.2f}x"
    if state.streak < targets.patience:
        return Decision(
            obs.at,
            "hold",
            f"{why}: waiting ({state.streak}/{targets.patience})",
            current,
            desired,
            inputs=inputs,
        )
    since = obs.at - state.last_change_at
    if since < targets.cooldown_s:
        return Decision(
            obs.at,
            "hold",
            f"{why}: cooling down ({since:.0f} s since the last change)",
            current,
            desired,
            inputs=inputs,
        )
    if direction and direction == -state.last_direction and since < targets.reverse_s:
        return Decision(
            obs.at,
            "hold",
            f"{why}: not reversing the last change within {targets.reverse_s:g} s",
            current,
            desired,
            inputs=inputs,
        )
    switches: list[Switch] = []
    if target[0] + target[1] != p + d:  # a count change: for whoever starts and stops instances
        action = "scale"
    else:
        switches = _switches(obs.members, p, target[0])
        action = "switch"
        if not switches:
            return Decision(
                obs.at,
                "hold",
                f"{why}: no instance can take the role (start workers --switchable)",
                current,
                desired,
                inputs=inputs,
            )
    state.last_change_at, state.last_direction = obs.at, direction or state.last_direction
    state.candidate, state.streak = None, 0
    return Decision(obs.at, action, why, current, desired, tuple(switches), inputs)


def _target(p: int, d: int, rt: float, ri: float, t: Targets) -> tuple[int, int]:
    """The (prefill, decode) split the pressures ask for (the count changed where allowed)."""
    n = p + d
    if t.max_instances is not None:
        if rt > 1 and ri > 1 and n < t.max_instances:
            n += 1
        elif rt < IDLE and ri < IDLE and n > max(2, t.min_instances):
            n -= 1
    if rt <= 1 and ri <= 1 and n == p + d:
        return p, d
    prefill = min(max(round(n * rt / (rt + ri)), 1), n - 1)
    prefill = min(max(prefill, p - 1), p + 1)  # one instance per change: see its effect first
    return prefill, n - prefill


def _switches(members: tuple[Member, ...], p: int, want_p: int) -> list[Switch]:
    """Who moves so that ``want_p`` instances are prefill: decode instances (least loaded first)
    to prefill, or switchable prefill instances (least loaded first) to decode."""
    live = [m for m in members if not m.draining]
    if want_p > p:
        decodes = sorted((m for m in live if m.role == "decode"), key=lambda m: (m.running + m.waiting, m.id))
        return [Switch(m.id, "decode", "prefill") for m in decodes[: want_p - p]]
    if want_p < p:
        prefills = [m for m in live if m.role == "prefill" and m.switchable]
        prefills.sort(key=lambda m: (m.waiting + m.handing_off, m.waiting_prefill_tokens, m.id))
        return [Switch(m.id, "prefill", "decode") for m in prefills[: p - want_p]]
    return []
