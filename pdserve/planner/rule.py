"""The planner's rule: from what the cluster serves now to the prefill:decode split it should have.

First the **demand** (``demand.py``): the prompt and answer tokens arriving per second, each at
what a token of its kind costs here lately (the instances' measured rates), is the work each role
must do; prefill's share of it is the share of the instances it should have. It is known as soon
as ``min_arrivals`` requests arrived in the routers' window, so a traffic shift moves the split
within ``patience`` observations, before any latency has moved; the latencies then correct it: a
role whose pressure (below) is over 1 has its work weighed by that pressure. Without a demand (too
few arrivals, nothing measured yet, routers that do not publish arrivals) the pressures alone
split, as follows.

Given targets for the 90th percentiles of time to first token and of inter-token latency (the
SLOs), each observation gives two pressures, prefill's and decode's:

* decode's is ``ri = itl_p90 / target``;
* prefill's is the larger of ``rt = ttft_p90 / target`` and the **queue pressure** ``rq``: the
  prompt tokens waiting at the prefill instances behind the one each is prefilling, per prefill
  instance, over the tokens one instance prefills in the TTFT target (its rate: the most prompt
  tokens per second per prefill instance the routers' windows have shown, a lower bound of its
  capacity, so ``rq`` rather over- than under-states the wait). Why: a p90 of *finished* requests
  moves only once the prompts that waited have finished, a window later, while a queue is seen in
  the instances' registrations at once; a prefill-heavy shift shows in ``rq`` observations before
  it shows in ``rt``. The prompt each instance is prefilling is left out, so a light load whose
  every prompt starts at once has no queue pressure; the queue must stay long for ``patience``
  observations in a row like any other signal, so a passing burst moves nothing.

With a demand, of the ``n`` instances that take part in splits (prefill and decode) prefill gets the
count around ``n × s`` (``s = wp·max(1, rt) / (wp·max(1, rt) + wd·max(1, ri))``; ``wp``, ``wd``: the
roles' work; ``rt``: prefill's pressure) that leaves the busier role's instances the least work each
(``max(s / p, (1 - s) / (n - p))``: a rounded 2.56 of 4 gave 3:1 more work on its decode instance
than 2:2 put on either prefill one), while the latencies are not trusted yet (the point is to be at
the right split before a target is missed) or the role the split moves toward is over its target. A
role within its target on trusted latencies takes no instance by the demand: the work is an estimate
(a decode token's cost depends on the batch it ran in, and on a host with fewer cores than instances
another instance of a role adds no cores), a measured latency within its target is not; on
plan_bench's decode-heavy phase the demand asked for 1:3 while 2:2 met the inter-token target and
1:3 then missed it. The last trusted latencies keep that word for a routers' window after them (the
window's p90s are then mostly the same requests': a count streaming that dips under ``min_requests``
does not make them wrong), except against a prefill queue over 1. Without a demand, with both
pressures met (≤ 1) nothing changes; otherwise prefill gets ``round(n × rt / (rt + ri))``. Either
way at least one and at most ``n - 1``, the rest decode, moving one instance per change (the
latencies answer a switch unevenly: the next observation says whether another helps). The p90s are
trusted from ``min_requests`` requests that began streaming in the window (the TTFT histogram's
samples; a long answer finishes a window or more after its tokens filled the inter-token histogram);
below that they count as at their targets (1) beside a demand; without one only a queue pressure
over 1 acts, against the last trusted ``ri`` (1 before any). Instances move between the two roles by
switches (``SetRole``): a decode instance can always become a prefill instance; a prefill instance
becomes a decode instance only when it is ``switchable`` (its cache must be where peers write), the
least loaded ones first; and only an instance whose host has CPU to give it moves (``split.CPU_SHARE``
of its threads idle lately, its registration's ``cpu``): where the instances already keep every core
busy, one more of a role shares those cores and adds the role nothing, while the role it leaves
loses a worker (plan_bench on 2 cores: 2:2 → 1:3 with the inter-token p90 over its target made that
p90 worse; fixed 1:3 met 89.5 % of that phase, 2:2 100 %). Where instances may be added
(``max_instances`` above the count), both pressures above 1 add one to the role under more pressure;
both under ``split.IDLE`` remove one from the other, down to ``min_instances``; the desired counts say
it, for whoever starts and stops instances (``pdserve up --autoscale``, Kubernetes through the
planner's metric).

Hysteresis, so a steady load never makes it flap:

* a change is made only after the same target came out ``patience`` observations in a row;
* none within ``cooldown_s`` of the last, nor within the routers' traffic window (30 s): its
  effect must reach the latencies first, and until the window has passed they are partly the old
  split's (plan_bench, with an 8 s cooldown in a 20 s window, moved 2:2 → 1:3 8 s after 3:1 → 2:2
  on an inter-token p90 that was mostly 3:1's);
* none reversing the last one's direction within ``reverse_s`` (default 300 s): on a steady load
  that sits between two splits, at most one change in five minutes;
* nothing from fewer than ``min_requests`` requests streaming (too few to estimate a p90) but the
  demand, or a queue that already says prefill is short; and the demand alone (the latencies not
  trusted, no queue) moves no further while the last switch waits for its verdict: one move on an
  estimate, then the latencies' word on it (plan_bench's decode-heavy phase went 2:2 → 1:3 on the
  demand alone 20 s after a move the latencies had asked for, the first tokens late).

Learning from a switch's effect. More instances of a role add capacity only while that role is
what the host is short of: on a 2-core host a third decode instance adds no decode capacity, it
takes CPU from prefill. So each switch records what it meant to relieve (:class:`Motive`: its
direction and both pressures then). Once its effect window has passed (``cooldown_s``, and at
least the routers' traffic window, so that the p90s are of requests served after it), each
trusted observation judges it (:class:`Verdict`): *relieved* when the pressure it meant to
relieve is met or fell by ``margin`` (15 %); *failing* when it did not while the other side's rose
by ``margin``. ``patience`` failing observations in a row make it *failed*: the switch is undone
(one instance moved back) and its direction held back for ``hold_s`` (default 3 × ``reverse_s``)
from the undo, doubled for each failure in that direction in a row (at most 8×: a load that keeps
asking for a move that does not help asks less often), each decision's reason saying so. An undo is a reversal and waits for ``reverse_s`` like any
other: the five-minute bound on a steady load (whose noise alone can look like a failed switch)
holds with it; until then nothing else moves. A verdict not reached within ``reverse_s`` after
the effect window is dropped: by then the traffic says more than the switch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdserve.planner.demand import Demand, demand
from pdserve.planner.observe import Member, Observation
from pdserve.planner.records import Decision, Motive, PlannerState, Pressures, Switch, Targets, Verdict
from pdserve.planner.split import idle_by_host, idle_text, movers, target_split

MIN_RATE_WINDOW_S = 5.0
"""A prefill rate is learned only from windows this long: a shorter one's few requests may have
been prefilled before it began, overstating the rate."""


def pressures(obs: Observation, targets: Targets, state: PlannerState) -> Pressures:
    """The pressures of ``obs`` (the prefill rate learned from it first)."""
    _learn_rate(obs, state)
    rt = obs.ttft_p90_s / targets.ttft_p90_s if obs.ttft_p90_s is not None else None
    ri = obs.itl_p90_s / targets.itl_p90_s if obs.itl_p90_s is not None else None
    rq = queue_pressure(obs, targets, state)
    if obs.latency_samples >= targets.min_requests and rt is not None and ri is not None:
        prefill = max(rt, rq or 0.0)
        state.last_ri, state.last_prefill, state.last_trusted_at = ri, prefill, obs.at
        return Pressures(rt, ri, rq, prefill, ri, True)
    if rq is not None and rq > 1:  # a queue says it before enough requests finish
        if state.last_ri is not None:
            return Pressures(rt, ri, rq, rq, state.last_ri, False, "last trusted")
        return Pressures(rt, ri, rq, rq, 1.0, False, "assumed")
    return Pressures(rt, ri, rq, None, None, False)


def queue_pressure(obs: Observation, targets: Targets, state: PlannerState) -> float | None:
    """The prompt tokens queued at the prefill instances behind the ones they are prefilling, per
    prefill instance, over what one prefills in the TTFT target; None without a prefill instance
    or a rate."""
    rate = targets.prefill_rate or state.prefill_rate
    prefills = [m for m in obs.members if m.role == "prefill" and not m.draining]
    if not prefills or rate <= 0:
        return None
    return _tokens_ahead(prefills) / len(prefills) / (rate * targets.ttft_p90_s)


def _tokens_ahead(prefills: list[Member]) -> float:
    """The queued prompt tokens not being prefilled: of an instance's ``waiting`` (which counts the
    one it prefills), all but one mean prompt."""
    return sum(m.waiting_prefill_tokens * (m.waiting - 1) / m.waiting for m in prefills if m.waiting > 0)


def _learn_rate(obs: Observation, state: PlannerState) -> None:
    """Raise the learned prefill rate to what the window's finished prompts show per prefill
    instance (a lower bound of what one can do: the highest seen is the best estimate)."""
    p = obs.count("prefill")
    if p and obs.requests and obs.window_s >= MIN_RATE_WINDOW_S:
        state.prefill_rate = max(state.prefill_rate, obs.prompt_tokens / obs.window_s / p)


def decide(obs: Observation, targets: Targets, state: PlannerState) -> Decision:
    """The decision for ``obs``; ``state`` is updated (a change resets the streak). The last
    switch's verdict, when this observation judged it, is in the decision and its reason."""
    pr = pressures(obs, targets, state)
    verdict = _judge(obs, pr, targets, state)
    decision = _decide(obs, pr, targets, state)
    if verdict is not None and decision.verdict is None:
        reason = f"{decision.reason}; {verdict_text(verdict, obs.at, targets)}"
        decision = dataclasses.replace(decision, reason=reason, verdict=verdict)
    return decision


def _inputs(obs: Observation, pr: Pressures, state: PlannerState, dm: Demand | None) -> dict[str, Any]:
    return {
        "demand": dm.as_dict() if dm is not None else None,
        "ttft_p90_s": obs.ttft_p90_s,
        "itl_p90_s": obs.itl_p90_s,
        "ttft_pressure": pr.ttft,
        "itl_pressure": pr.itl,
        "queue_pressure": _round(pr.queue),
        "prefill_pressure": _round(pr.prefill),
        "decode_pressure": _round(pr.decode),
        "prefill_rate_per_instance": round(state.prefill_rate, 1),
        "requests": obs.requests,
        "first_tokens": obs.first_tokens,
        "window_s": obs.window_s,
        "prompt_tokens_per_request": round(obs.prompt_tokens / obs.requests, 1) if obs.requests else None,
        "generation_tokens_per_request": round(obs.generation_tokens / obs.requests, 1)
        if obs.requests
        else None,
        "queued": {role: obs.queued(role) for role in ("prefill", "decode", "mixed")},
        "queued_prefill_tokens": sum(
            m.waiting_prefill_tokens for m in obs.members if m.role == "prefill" and not m.draining
        ),
        "kv_use": {role: obs.kv_use(role) for role in ("prefill", "decode", "mixed")},
        "unswitchable": sum(
            1 for m in obs.members if m.role in ("prefill", "decode") and not m.switchable and not m.draining
        ),
        "prefix_hit_rate": obs.prefix_hit_rate,
        "kv_transfer_mean_s": obs.kv_transfer_mean_s,
        "idle_cpus": idle_by_host(obs) or None,
    }


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


def _decide(obs: Observation, pr: Pressures, targets: Targets, state: PlannerState) -> Decision:
    p, d = obs.count("prefill"), obs.count("decode")
    current = {"prefill": p, "decode": d, "mixed": obs.count("mixed")}
    dm = demand(obs, targets.min_arrivals, targets.prefill_rate)
    inputs = _inputs(obs, pr, state, dm)

    def hold(reason: str, verdict: Verdict | None = None) -> Decision:
        """No change (the streak starts over)."""
        state.candidate, state.streak = None, 0
        return Decision(obs.at, "hold", reason, current, current, inputs=inputs, verdict=verdict)

    if state.undo is not None and p >= 1 and d >= 1:
        return _undo(obs, pr, targets, state, current, inputs, hold)
    if dm is None and (pr.prefill is None or pr.decode is None):
        return hold(
            f"too little traffic to judge ({obs.latency_samples} requests began streaming, {obs.arrivals} "
            "arrived lately)"
        )
    if p < 1 or d < 1:
        return hold("no prefill/decode split to adjust")
    # a latency not trusted yet counts as at its target: the demand alone splits then
    rt = pr.prefill if pr.prefill is not None else 1.0
    ri = pr.decode if pr.decode is not None else 1.0
    share = dm.prefill_share(rt, ri) if dm is not None else None
    target = target_split(p, d, rt, ri, targets, share)
    why = _why(pr, obs, dm, share)
    if target == (p, d):
        met = pr.trusted and rt <= 1 and ri <= 1
        if share is not None:
            return hold(f"{why}: the split follows it{'; the targets are met' if met else ''}")
        return hold("the targets are met" if met else "the split already follows the pressures")
    if share is not None and sum(target) == p + d:
        gains = "prefill" if target[0] > p else "decode"
        if meets := _met(gains, pr, obs, state):  # the work is an estimate; a latency measured is not
            return hold(f"{why}: {gains} {meets}, so no instance moves to it")
    if state.candidate == target:
        state.streak += 1
    else:
        state.candidate, state.streak = target, 1
    desired = {"prefill": target[0], "decode": target[1], "mixed": current["mixed"]}
    moved = target[0] / (target[0] + target[1]) - p / (p + d)  # prefill's share, toward the target
    direction = (moved > 0) - (moved < 0)

    def wait(reason: str) -> Decision:
        return Decision(obs.at, "hold", f"{why}: {reason}", current, desired, inputs=inputs)

    if state.streak < targets.patience:
        return wait(f"waiting ({state.streak}/{targets.patience})")
    since = obs.at - state.last_change_at
    if since < _effect_window_s(obs, targets):
        return wait(f"cooling down ({since:.0f} s since the last change)")
    if direction and direction == -state.last_direction and since < targets.reverse_s:
        return wait(f"not reversing the last change within {targets.reverse_s:g} s")
    queued = direction > 0 and (pr.queue or 0.0) > 1  # a measured prefill queue asks for it
    if not pr.trusted and not queued and state.pending is not None:
        return wait("the demand alone moves no further before the last switch is judged")
    blocked = state.blocked
    held_for = (blocked.hold_until or 0) - obs.at if blocked is not None else 0.0
    if blocked is not None and direction == blocked.motive.direction and held_for > 0:
        return wait(
            f"not moving toward {blocked.motive.relieves} again for {held_for:.0f} s "
            f"(the switch {obs.at - blocked.motive.at:.0f} s ago did not relieve {blocked.motive.relieves})"
        )
    switches: list[Switch] = []
    motive = None
    if target[0] + target[1] != p + d:  # a count change: for whoever starts and stops instances
        action = "scale"
    else:
        switches = movers(obs.members, p, target[0], need_cpu=True)
        action = "switch"
        if not switches:
            if movers(obs.members, p, target[0]):
                gains = "prefill" if direction > 0 else "decode"
                return wait(f"no host has CPU to spare for another {gains} instance ({idle_text(obs)})")
            return wait("no instance can take the role (start workers --switchable)")
        mine, other = (rt, ri) if direction > 0 else (ri, rt)
        motive = Motive(obs.at, direction, round(mine, 4), round(other, 4))
    state.last_change_at, state.last_direction = obs.at, direction or state.last_direction
    state.candidate, state.streak = None, 0
    state.pending, state.failing = motive, 0
    return Decision(obs.at, action, why, current, desired, tuple(switches), inputs, motive=motive)


def _met(gains: str, pr: Pressures, obs: Observation, state: PlannerState) -> str | None:
    """How the role the demand would give an instance is known to meet its target (None: it is
    not, or nothing says): this observation's latencies when trusted, else the last trusted ones
    within the routers' window. The window's p90s are then mostly of the same requests: a count
    of requests streaming that dips under ``min_requests`` does not make them wrong (plan_bench
    went 2:2 -> 3:1 on the demand alone 4 s after the TTFT p90 at 0.89x had held it). A prefill
    queue over 1 is live and is not overruled."""
    if pr.trusted:
        pressure = pr.prefill if gains == "prefill" else pr.decode
        return "meets its target" if pressure is not None and pressure <= 1 else None
    if obs.at - state.last_trusted_at > obs.window_s or (gains == "prefill" and (pr.queue or 0.0) > 1):
        return None
    last = state.last_prefill if gains == "prefill" else state.last_ri
    if last is None or last > 1:
        return None
    return (
        f"met its target {obs.at - state.last_trusted_at:.0f} s ago (the last trusted latencies, {last:.2f}x)"
    )


def _why(pr: Pressures, obs: Observation, dm: Demand | None, share: float | None) -> str:
    """The demand and the pressures in words."""
    latencies = (
        _pressures_text(pr)
        if pr.prefill is not None and pr.decode is not None
        else f"the latencies not trusted yet ({obs.latency_samples} requests began streaming lately)"
    )
    if dm is None or share is None:
        return latencies
    return (
        f"demand: prefill {dm.prefill_work:.2f} instances' time ({dm.prompt_tokens_s:.0f} prompt tok/s at "
        f"{dm.prefill_s_per_token * 1000:.2f} ms), decode {dm.decode_work:.2f} ({dm.answer_tokens_s:.0f} "
        f"answer tok/s at {dm.decode_s_per_token * 1000:.2f} ms), {share:.0%} prefill; {latencies}"
    )


def _pressures_text(pr: Pressures) -> str:
    """The pressures in words (the queue named when it is what drives prefill's)."""
    itl = {
        "trusted": f"inter-token p90 at {pr.decode:.2f}x",
        "last trusted": f"inter-token p90 at {pr.decode:.2f}x (the last trusted)",
        "assumed": "inter-token p90 not trusted yet (taken as at its target)",
    }[pr.decode_basis]
    if pr.queue is not None and pr.queue > 1 and (pr.ttft is None or not pr.trusted or pr.queue > pr.ttft):
        ttft = (
            f"TTFT p90 at {pr.ttft:.2f}x"
            if pr.trusted and pr.ttft is not None
            else "TTFT p90 not trusted yet"
        )
        return f"prefill queue at {pr.queue:.2f}x what the TTFT target allows ({ttft}), {itl}"
    return f"TTFT p90 at {pr.prefill:.2f}x its target, {itl}"


def _effect_window_s(obs: Observation, targets: Targets) -> float:
    """How long a change takes to show: the cooldown, and at least the routers' traffic window
    (until it has passed, the window's latencies are partly the old split's). No change is made,
    and none is judged, sooner."""
    return max(targets.cooldown_s, obs.window_s)


def _judge(obs: Observation, pr: Pressures, targets: Targets, state: PlannerState) -> Verdict | None:
    """Judge the last switch once its effect window has passed, on trusted observations only. The
    window is the cooldown, and at least the routers' traffic window: the p90s that judge a switch
    must be of requests served after it (a queue answers at once, a p90 a window later)."""
    m = state.pending
    effect_s = _effect_window_s(obs, targets)
    if m is None or obs.at < m.at + effect_s:
        return None
    if obs.at > m.at + effect_s + targets.reverse_s:
        state.pending, state.failing = None, 0  # too late: the traffic says more than the switch
        return None
    if not pr.trusted or pr.prefill is None or pr.decode is None:
        return None
    now, other = (pr.prefill, pr.decode) if m.direction > 0 else (pr.decode, pr.prefill)
    now, other = round(now, 4), round(other, 4)
    if now <= 1 or now <= m.pressure * (1 - targets.margin):
        state.pending, state.failing = None, 0
        if state.blocked is not None and state.blocked.motive.direction == m.direction:
            state.blocked = None  # this direction helps again: its failures start over
        return Verdict(m, "relieved", now, other)
    if other < m.other * (1 + targets.margin):
        state.failing = 0  # not relieved, but no worse elsewhere: keep watching
        return None
    state.failing += 1
    if state.failing < targets.patience:
        return Verdict(m, "failing", now, other, failing=state.failing)
    prev = state.blocked
    repeats = prev.repeats + 1 if prev is not None and prev.motive.direction == m.direction else 1
    hold_until = obs.at + _hold_s(targets, repeats)
    failed = Verdict(m, "failed", now, other, hold_until, state.failing, repeats)
    state.pending, state.failing, state.undo, state.blocked = None, 0, failed, failed
    return failed


def _hold_s(targets: Targets, repeats: int) -> float:
    """How long a failed switch's direction is held back: ``hold_s``, doubled for each failure in
    that direction before it (a load that keeps asking for a move that does not help asks less
    often), at most 8 times."""
    return targets.failed_hold_s * 2 ** min(repeats - 1, 3)


def verdict_text(v: Verdict, now: float, targets: Targets, undoing: bool = False) -> str:
    """A verdict in words, for the decisions' reasons (``undoing``: said by the undo itself)."""
    m = v.motive
    switch = f"the switch toward {m.relieves} {now - m.at:.0f} s ago"
    if v.outcome == "relieved":
        return f"{switch} relieved {m.relieves} ({m.pressure:.2f}x -> {v.pressure:.2f}x)"
    missed = (
        f"did not relieve {m.relieves} ({m.pressure:.2f}x -> {v.pressure:.2f}x) while {m.other_side} "
        f"worsened ({m.other:.2f}x -> {v.other:.2f}x)"
    )
    if v.outcome == "failing":
        return f"{switch} {missed} ({v.failing}/{targets.patience})"
    held = f"no move toward {m.relieves} for {(v.hold_until or now) - now:.0f} s"
    if v.outcome == "kept":
        return f"{switch} {missed}, but the targets are met now: kept; {held}"
    return f"{switch} {missed}: {'undone now' if undoing else 'to be undone'}; {held}"


def _undo(
    obs: Observation,
    pr: Pressures,
    targets: Targets,
    state: PlannerState,
    current: dict[str, int],
    inputs: dict[str, Any],
    hold: Callable[[str, Verdict | None], Decision],
) -> Decision:
    """Move one instance back against a failed switch, once a reversal is allowed (``reverse_s``
    after the switch); nothing else moves meanwhile."""
    v = state.undo
    assert v is not None
    back = -v.motive.direction
    p = current["prefill"]
    if pr.trusted and pr.prefill is not None and pr.decode is not None and max(pr.prefill, pr.decode) <= 1:
        state.undo = None
        kept = dataclasses.replace(v, outcome="kept")
        state.blocked = kept
        return hold(verdict_text(kept, obs.at, targets), kept)
    text = verdict_text(v, obs.at, targets)
    since = obs.at - state.last_change_at
    if since < targets.reverse_s:
        return hold(
            f"{text}; the undo waits {targets.reverse_s - since:.0f} s more (no reversal within reverse_s)", v
        )
    if not 1 <= p + back < p + current["decode"]:  # the split changed since: nothing to undo
        state.undo = None
        return hold(f"{text}, but the split changed since: not undoing it", v)
    switches = movers(obs.members, p, p + back)
    if not switches:
        return hold(f"{text}, but no instance can take the role (start workers --switchable)", v)
    desired = {**current, "prefill": p + back, "decode": current["decode"] - back}
    v = dataclasses.replace(v, hold_until=obs.at + _hold_s(targets, v.repeats))  # from the undo on
    state.undo, state.pending, state.failing, state.blocked = None, None, 0, v
    state.last_change_at, state.last_direction = obs.at, back
    state.candidate, state.streak = None, 0
    return Decision(
        obs.at,
        "switch",
        verdict_text(v, obs.at, targets, undoing=True),
        current,
        desired,
        tuple(switches),
        inputs,
        verdict=v,
    )
