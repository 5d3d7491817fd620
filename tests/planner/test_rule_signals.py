"""The rule's two later parts, on synthetic observation traces: a prefill queue seen in the
instances' registrations moves the split before the p90s of finished requests do, and a switch that
did not relieve its pressure (while the other side's got worse) is undone and not tried again
within its hold. Both fail on the rule before them (TTFT and inter-token p90s alone, no verdicts)."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.planner.observe import Member, Observation
from pdserve.planner.records import Decision, PlannerState, Targets
from pdserve.planner.restore import restored
from pdserve.planner.rule import decide

TARGETS = Targets(ttft_p90_s=1.0, itl_p90_s=0.1, patience=2, cooldown_s=30, reverse_s=60, min_requests=10)
STEP_S = 5.0


def members(roles: dict[str, str], queue: tuple[int, int] = (0, 0)) -> tuple[Member, ...]:
    """Every instance switchable; each prefill instance with ``queue`` = (waiting requests, their
    prompt tokens)."""
    return tuple(
        Member(id, role, True, False, 0, *(queue if role == "prefill" else (0, 0)), 0, 0.0)
        for id, role in sorted(roles.items())
    )


def observation(
    at: float,
    roles: dict[str, str],
    ttft: float,
    itl: float,
    requests: int,
    prompt: int,
    queue: tuple[int, int],
) -> Observation:
    return Observation(
        at, "m", members(roles, queue), requests, 30.0, ttft, itl, requests * prompt, requests * 24
    )


def two_two() -> dict[str, str]:
    return {"d0": "decode", "d1": "decode", "p0": "prefill", "p1": "prefill"}


def shift_trace(requests_after: int) -> list[Observation]:
    """One steady minute of 300-token prompts (each prefill instance prefilling one, none queued:
    150 prompt tokens/s per prefill instance), then long prompts arrive faster than two prefill
    instances take them: their queues grow by two 512-token prompts every 5 s, while the requests
    that finish are still the earlier ones (TTFT p90 0.6-0.8 s, under its 1 s target)."""
    roles, out = two_two(), []
    for i in range(12):
        out.append(observation(i * STEP_S, roles, 0.6, 0.05, 30, 300, (1, 300)))
    for k in range(1, 7):
        waiting = 1 + 2 * k
        ttft = 0.6 + 0.03 * k
        out.append(
            observation((11 + k) * STEP_S, roles, ttft, 0.05, requests_after, 300, (waiting, 512 * waiting))
        )
    return out


def first_change(trace: list[Observation], targets: Targets) -> tuple[int, Decision] | None:
    """The first decision that is not a hold, and its index."""
    state = PlannerState()
    for i, obs in enumerate(trace):
        decision = decide(obs, targets, state)
        if decision.action != "hold":
            return i, decision
    return None


def test_a_prefill_heavy_shift_is_seen_in_the_queues_before_the_p90s_move() -> None:
    trace = shift_trace(requests_after=30)
    changed = first_change(trace, TARGETS)
    assert changed is not None, "held all along: the p90s never passed their targets"
    index, decision = changed
    assert index - 11 <= TARGETS.patience  # within patience observations of the queues' first growth
    assert decision.action == "switch" and [(s.from_role, s.to_role) for s in decision.switches] == [
        ("decode", "prefill")
    ]
    assert decision.inputs["ttft_p90_s"] < TARGETS.ttft_p90_s  # the finished requests had not said it
    assert decision.inputs["queue_pressure"] > 1 and "prefill queue" in decision.reason
    assert decision.motive is not None and decision.motive.direction == 1


def test_the_queue_acts_before_enough_requests_finish_to_trust_a_p90() -> None:
    trace = shift_trace(requests_after=4)  # after the shift, fewer than min_requests finish
    changed = first_change(trace, TARGETS)
    assert changed is not None
    index, decision = changed
    assert index - 11 <= TARGETS.patience and decision.desired["prefill"] == 3
    assert "TTFT p90 not trusted yet" in decision.reason


def test_a_steady_queue_of_one_prompt_per_instance_is_no_pressure() -> None:
    """Every prefill instance prefilling one long prompt, none behind it: nothing to act on."""
    state = PlannerState()
    for i in range(20):
        obs = observation(i * STEP_S, two_two(), 0.6, 0.05, 30, 300, (1, 4096))
        decision = decide(obs, TARGETS, state)
        assert decision.action == "hold" and decision.inputs["queue_pressure"] == 0


World = Callable[[float, dict[str, str]], Observation]


def decode_short_world(at: float, roles: dict[str, str]) -> Observation:
    """Chat whose inter-token latency is twice its target at 2:2 and stays so at 1:3 (a third
    decode instance adds no decode capacity on this host), while prefill, 0.5x at 2:2, gets worse
    with one instance (0.9x: still within its target, so the split's formula wants 1:3 still)."""
    prefills = sum(1 for r in roles.values() if r == "prefill")
    ttft = {1: 0.9, 2: 0.5, 3: 0.4}[prefills]
    return observation(at, roles, ttft, 0.2, 40, 64, (0, 0))


def run_world(world: World, targets: Targets, seconds: float) -> list[Decision]:
    """The rule on a world that answers the split at once, each switch applied."""
    state, roles, out = PlannerState(), two_two(), []
    for i in range(int(seconds / STEP_S)):
        decision = decide(world(i * STEP_S, roles), targets, state)
        for s in decision.switches:
            roles[s.instance] = s.to_role
        out.append(decision)
    return out


def switches(decisions: list[Decision]) -> list[tuple[float, int]]:
    """(time, +1 toward prefill / -1 toward decode) of each switch."""
    return [
        (d.at, 1 if d.switches[0].to_role == "prefill" else -1) for d in decisions if d.action == "switch"
    ]


def test_a_switch_that_did_not_relieve_its_pressure_is_undone_and_not_retried_within_the_hold() -> None:
    decisions = run_world(decode_short_world, TARGETS, 400)
    made = switches(decisions)
    assert made[0][1] == -1  # 2:2 -> 1:3 for the inter-token latency
    first_at = made[0][0]
    assert len(made) >= 2 and made[1][1] == 1, f"never undone: {made}"
    undo_at = made[1][0]
    assert first_at + TARGETS.reverse_s <= undo_at <= first_at + TARGETS.reverse_s + STEP_S
    undo = next(d for d in decisions if d.at == undo_at)
    assert undo.verdict is not None and undo.verdict.outcome == "failed"
    assert "did not relieve decode" in undo.reason and "undone now" in undo.reason
    hold_until = undo.verdict.hold_until
    assert hold_until is not None and hold_until >= undo_at + TARGETS.reverse_s
    assert not [t for t, direction in made[2:] if direction == -1 and t < hold_until]  # not retried
    held = [d for d in decisions if undo_at < d.at < hold_until and "not moving toward decode" in d.reason]
    assert held, "the hold is not said in the reasons"
    judged = [d for d in decisions if d.verdict is not None and d.verdict.outcome == "failing"]
    assert judged and all("did not relieve decode" in d.reason for d in judged)


def test_a_switch_that_relieved_its_pressure_is_kept() -> None:
    def helped(at: float, roles: dict[str, str]) -> Observation:
        decodes = sum(1 for r in roles.values() if r == "decode")
        return observation(at, roles, 0.6, {2: 0.2, 3: 0.12}[decodes], 40, 64, (0, 0))

    decisions = run_world(helped, TARGETS, 200)
    assert [direction for _, direction in switches(decisions)] == [-1]
    assert any(d.verdict is not None and d.verdict.outcome == "relieved" for d in decisions)


def test_a_restarted_planner_still_undoes_and_holds() -> None:
    """What ``Planner.restore`` rebuilds from the decisions stream: the failed switch still to be
    undone, then, after the undo, the direction held back."""
    decisions = run_world(decode_short_world, TARGETS, 400)
    made = switches(decisions)
    failed_at = next(d.at for d in decisions if d.verdict is not None and d.verdict.outcome == "failed")
    before_undo = [d.as_dict() for d in decisions if d.at <= failed_at][::-1]
    state = restored(before_undo, failed_at)
    assert state.undo is not None and state.last_change_at == made[0][0] and state.pending is None
    after_undo = [d.as_dict() for d in decisions if d.at <= made[1][0]][::-1]
    state = restored(after_undo, made[1][0] + 1)
    assert state.undo is None and state.blocked is not None and state.last_direction == 1


def test_each_failure_in_a_row_doubles_the_hold() -> None:
    decisions = run_world(decode_short_world, TARGETS, 800)
    undos = [d for d in decisions if d.action == "switch" and d.verdict is not None]
    holds = [(d.verdict.hold_until or 0) - d.at for d in undos if d.verdict is not None]
    assert [d.verdict.repeats for d in undos if d.verdict is not None][:2] == [1, 2]
    assert holds[:2] == [TARGETS.failed_hold_s, 2 * TARGETS.failed_hold_s]


def test_decisions_written_before_motives_and_verdicts_still_restore_the_cooldowns() -> None:
    """A stream written by the rule before this one: no ``motive`` or ``verdict`` in its decisions."""
    old = {
        "at": 100.0,
        "action": "switch",
        "reason": "TTFT p90 at 3.00x its target, inter-token p90 at 0.50x",
        "current": {"prefill": 2, "decode": 2, "mixed": 0},
        "desired": {"prefill": 3, "decode": 1, "mixed": 0},
        "switches": [{"instance": "d0", "from_role": "decode", "to_role": "prefill"}],
        "inputs": {},
    }
    hold = {**old, "at": 110.0, "action": "hold", "desired": old["current"], "switches": []}
    state = restored([hold, old], 120.0)
    assert (state.last_change_at, state.last_direction) == (100.0, 1)
    assert state.pending is None and state.undo is None and state.blocked is None


def test_a_switch_is_judged_only_once_the_routers_window_holds_requests_served_after_it() -> None:
    """With a cooldown (8 s) shorter than the routers' window (30 s) the first verdict waits for the
    window: the p90s before it are partly of the split before the switch."""
    short = Targets(ttft_p90_s=1.0, itl_p90_s=0.1, patience=2, cooldown_s=8, reverse_s=60, min_requests=10)
    decisions = run_world(decode_short_world, short, 120)
    first_at = switches(decisions)[0][0]
    judged = [d.at for d in decisions if d.verdict is not None]
    assert judged and min(judged) >= first_at + 30.0
