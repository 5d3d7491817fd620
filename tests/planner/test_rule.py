"""The planner's rule on made-up observations: the split follows the pressures, the hysteresis holds
(patience, cooldown, no quick reversal, too few requests), the instances that move are the right
ones, and a count change is asked only where the count is the planner's to change."""

from __future__ import annotations

import dataclasses

from pdserve.planner.observe import Member, Observation, quantile
from pdserve.planner.records import PlannerState, Targets
from pdserve.planner.rule import decide

TARGETS = Targets(ttft_p90_s=1.0, itl_p90_s=0.1, patience=2, cooldown_s=30, reverse_s=300, min_requests=10)


def member(id: str, role: str, switchable: bool = True, waiting: int = 0, draining: bool = False) -> Member:
    return Member(id, role, switchable, draining, 0, waiting, 0, 0, 0.0)


def obs(
    at: float, ttft: float | None, itl: float | None, roles: str = "ppdd", requests: int = 50, **kw
) -> Observation:
    members = kw.pop("members", None) or tuple(
        member(f"i{n}", {"p": "prefill", "d": "decode", "m": "mixed"}[r]) for n, r in enumerate(roles)
    )
    return Observation(at, "m", members, requests, 30.0, ttft, itl, 1000, 1000)


def test_met_targets_hold_and_pressure_moves_the_split_after_patience() -> None:
    state = PlannerState()
    assert decide(obs(0, 0.5, 0.05), TARGETS, state).action == "hold"
    first = decide(obs(10, 3.0, 0.05), TARGETS, state)  # TTFT 3x its target: prefill wanted
    assert first.action == "hold" and "waiting (1/2)" in first.reason
    assert first.desired == {"prefill": 3, "decode": 1, "mixed": 0}
    second = decide(obs(20, 3.0, 0.05), TARGETS, state)
    assert second.action == "switch" and [(s.from_role, s.to_role) for s in second.switches] == [
        ("decode", "prefill")
    ]
    assert second.inputs["ttft_pressure"] == 3.0 and second.inputs["itl_pressure"] == 0.5


def test_a_streak_broken_by_another_target_starts_over() -> None:
    state = PlannerState()
    decide(obs(0, 3.0, 0.05), TARGETS, state)
    decide(obs(10, 0.5, 0.3), TARGETS, state)  # now decode is short
    assert decide(obs(20, 3.0, 0.05), TARGETS, state).action == "hold"


def test_no_change_within_the_cooldown_and_no_reversal_within_reverse_s() -> None:
    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 3.0, 0.05), TARGETS, state)
    assert d.action == "switch"
    for t in (20, 30):  # the switch not seen yet: the same split wanted again, cooling down
        d = decide(obs(t, 3.0, 0.05), TARGETS, state)
    assert d.action == "hold" and "cooling down" in d.reason
    roles = "pppd"
    for t in (50, 60):  # decode now short: the reverse, 50 s after the change
        d = decide(obs(t, 0.3, 0.5, roles), TARGETS, state)
    assert d.action == "hold" and "not reversing" in d.reason
    d = decide(obs(320, 0.3, 0.5, roles), TARGETS, state)  # the streak went on: at once
    assert d.action == "switch" and d.desired == {"prefill": 2, "decode": 2, "mixed": 0}


def test_no_change_before_the_routers_window_holds_only_the_new_split() -> None:
    """A cooldown shorter than the routers' window (30 s here) still waits the window out: until
    then its latencies are partly the old split's."""
    quick = dataclasses.replace(TARGETS, cooldown_s=5)
    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 3.0, 0.05, "pppddd"), quick, state)
    assert d.action == "switch"
    for t in (20, 30):
        d = decide(obs(t, 3.0, 0.05, "ppppdd"), quick, state)  # still short: a 5th prefill wanted
    assert d.action == "hold" and "cooling down (20 s" in d.reason
    assert decide(obs(40, 3.0, 0.05, "ppppdd"), quick, state).action == "switch"


def test_too_few_requests_or_no_split_decide_nothing() -> None:
    state = PlannerState()
    assert "too little traffic" in decide(obs(0, 9.0, 0.05, requests=3), TARGETS, state).reason
    assert "no prefill/decode split" in decide(obs(0, 9.0, 0.05, roles="mm"), TARGETS, state).reason
    assert decide(obs(0, None, None), TARGETS, state).action == "hold"


def test_who_moves_least_loaded_decode_and_only_switchable_prefill() -> None:
    members = (
        member("p1", "prefill", switchable=False, waiting=0),
        member("p2", "prefill", switchable=True, waiting=5),
        member("p3", "prefill", switchable=True, waiting=1),
        member("d1", "decode", waiting=4),
        member("d2", "decode", waiting=0),
        member("d3", "decode", draining=True),
    )
    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 0.2, 0.5, members=members), TARGETS, state)
    # 1P4D wanted: one step at a time, the least queued switchable prefill (the idle p1 cannot)
    assert d.desired == {"prefill": 2, "decode": 3, "mixed": 0}
    assert d.action == "switch" and [s.instance for s in d.switches] == ["p3"]
    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 5.0, 0.05, members=members), TARGETS, state)
    assert [s.instance for s in d.switches] == ["d2"]  # the draining d3 is not counted nor moved
    nothing = (member("p0", "prefill", switchable=False), *(m for m in members if m.id in ("p1", "d1", "d2")))
    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 0.2, 0.5, members=nothing), TARGETS, state)
    assert d.action == "hold" and "--switchable" in d.reason


def test_a_switch_waits_for_a_host_with_cpu_to_spare() -> None:
    """Decode is short (inter-token p90 5x), but the only host's CPUs are busy: a third decode
    instance would share the cores the two keep busy (plan_bench on a 2-core host: 1:3 worse than
    2:2). It holds, saying so, and moves once the host has a core idle; across hosts the instance
    whose host has CPU to spare moves, though another is less loaded."""

    def on(host: str, idle: float, roles: str = "ppdd") -> tuple[Member, ...]:
        return tuple(
            dataclasses.replace(member(f"i{n}", r), host=host, idle_cpus=idle, threads=1)
            for n, r in enumerate({"p": "prefill", "d": "decode"}[c] for c in roles)
        )

    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 0.2, 0.5, members=on("h", 0.3)), TARGETS, state)
    assert d.action == "hold" and "no host has CPU to spare for another decode instance" in d.reason
    assert "0.3 CPUs idle on h" in d.reason and d.inputs["idle_cpus"] == {"h": 0.3}
    assert d.desired == {"prefill": 1, "decode": 3, "mixed": 0}  # what it would do, and why not
    d = decide(obs(20, 0.2, 0.5, members=on("h", 1.2)), TARGETS, state)
    assert d.action == "switch" and [s.instance for s in d.switches] == ["i0"]
    busy, idle = on("busy", 0.1, "pd"), on("idle", 1.5, "pd")
    members = (
        busy[0],
        busy[1],
        dataclasses.replace(idle[0], id="j0", waiting=3),
        dataclasses.replace(idle[1], id="j1"),
    )
    state = PlannerState()
    for t in (0, 10):
        d = decide(obs(t, 0.2, 0.5, members=members), TARGETS, state)
    assert d.action == "switch" and [s.instance for s in d.switches] == ["j0"]  # not the idler i0


def test_the_count_changes_only_within_the_allowed_instances() -> None:
    scaled = Targets(1.0, 0.1, patience=1, cooldown_s=0, min_requests=10, min_instances=2, max_instances=5)
    both = decide(obs(0, 2.0, 0.3), scaled, PlannerState())  # both over: one more, to decode (3x)
    assert both.action == "scale" and both.desired == {"prefill": 2, "decode": 3, "mixed": 0}
    full = decide(obs(0, 2.0, 0.3, roles="pppdd"), scaled, PlannerState())
    assert full.desired["prefill"] + full.desired["decode"] == 5  # at the most: a switch at most
    idle = decide(obs(0, 0.1, 0.01, roles="ppdd"), scaled, PlannerState())
    assert idle.action == "scale" and sum(idle.desired.values()) == 3
    fixed = decide(obs(0, 2.0, 0.3), TARGETS, PlannerState())  # no max_instances: never a count change
    assert fixed.action != "scale" and sum(fixed.desired.values()) == 4


def test_quantile_interpolates_within_buckets_like_prometheus() -> None:
    bounds = [0.1, 0.2, 0.5, 1.0]
    assert quantile(bounds, [0, 10, 0, 0, 0], 0.9) == 0.1 + 0.1 * 0.9
    assert quantile(bounds, [5, 0, 0, 0, 5], 0.9) == 1.0  # past the last bound: that bound
    assert quantile(bounds, [0, 0, 0, 0, 0], 0.9) is None
