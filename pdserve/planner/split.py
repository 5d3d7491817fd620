"""The split's arithmetic, apart from the rule's hysteresis (``rule.py``): the prefill:decode
counts a demand's share or the latency pressures ask for, and which instances move there (only
those whose host has CPU to give them).
"""

from __future__ import annotations

import math

from pdserve.planner.observe import Member, Observation
from pdserve.planner.records import Switch, Targets

IDLE = 0.5
"""Both pressures under this (with instances to spare): one instance fewer would still meet them."""

CPU_SHARE = 0.5
"""An instance switched to a role adds it capacity only where its host has at least this share of
the instance's engine threads idle: else it would share the cores that role's instances (or
others) already keep busy."""


def target_split(
    p: int, d: int, rt: float, ri: float, t: Targets, share: float | None = None
) -> tuple[int, int]:
    """The (prefill, decode) split asked for: prefill's ``share`` of the instances (the demand's,
    see :class:`Demand`), or without one the pressures' (then only where one is over 1); the count
    changed where allowed."""
    n = p + d
    if t.max_instances is not None:
        if rt > 1 and ri > 1 and n < t.max_instances:
            n += 1
        elif rt < IDLE and ri < IDLE and n > max(2, t.min_instances):
            n -= 1
    if share is None:
        if rt <= 1 and ri <= 1 and n == p + d:
            return p, d
        prefill = round(n * rt / (rt + ri))  # pressures, not work: no loads to balance
    else:
        prefill = balanced_prefill(n, share)
    prefill = min(max(prefill, 1), n - 1)
    prefill = min(max(prefill, p - 1), p + 1)  # one instance per change: see its effect first
    return prefill, n - prefill


def balanced_prefill(n: int, share: float) -> int:
    """Of ``n`` instances, the prefill count whose busier role is least busy (prefill's ``share``
    of the work over its instances against the rest over decode's), of the two counts around
    ``n × share``. Not the rounded count: a share of 64 % of 4 instances rounds to 3:1, 0.36 of the
    work on the one decode instance, where 2:2 puts at most 0.32 on an instance (plan_bench's light
    prefill-heavy phase, a share of 62-64 %, went 2:2 -> 3:1 and began the decode-heavy one a decode
    instance short)."""
    low = min(max(math.floor(n * share), 1), n - 1)

    def busiest(p: int) -> float:
        return max(share / p, (1 - share) / (n - p))

    return min((low, min(low + 1, n - 1)), key=busiest)


def movers(members: tuple[Member, ...], p: int, want_p: int, need_cpu: bool = False) -> list[Switch]:
    """Who moves so that ``want_p`` instances are prefill: decode instances (least loaded first)
    to prefill, or switchable prefill instances (least loaded first) to decode; with ``need_cpu``
    only those whose host has CPU to give them (:data:`CPU_SHARE`; an undo moves back regardless)."""
    live = [m for m in members if not m.draining and (not need_cpu or gets_cpu(m))]
    if want_p > p:
        decodes = sorted((m for m in live if m.role == "decode"), key=lambda m: (m.running + m.waiting, m.id))
        return [Switch(m.id, "decode", "prefill") for m in decodes[: want_p - p]]
    if want_p < p:
        prefills = [m for m in live if m.role == "prefill" and m.switchable]
        prefills.sort(key=lambda m: (m.waiting + m.handing_off, m.waiting_prefill_tokens, m.id))
        return [Switch(m.id, "prefill", "decode") for m in prefills[: p - want_p]]
    return []


def gets_cpu(m: Member) -> bool:
    """Its host has idle at least :data:`CPU_SHARE` of its threads (or does not say)."""
    return m.idle_cpus is None or m.idle_cpus >= CPU_SHARE * (m.threads or 1)


def idle_by_host(obs: Observation) -> dict[str, float]:
    """Each host's idle CPUs, as its instances said (the last one's word per host)."""
    return {m.host or m.id: m.idle_cpus for m in obs.members if m.idle_cpus is not None}


def idle_text(obs: Observation) -> str:
    """The hosts' idle CPUs in words."""
    return ", ".join(f"{idle:g} CPUs idle on {host}" for host, idle in sorted(idle_by_host(obs).items()))
