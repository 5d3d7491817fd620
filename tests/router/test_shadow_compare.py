"""How shadow verification compares a served request with its replay: bitwise where every
instance is batch-invariant, within a tolerance elsewhere, a first differing token at a near-tie
being no mismatch there; and how a sampled request is sent (seeded, with logprobs)."""

from __future__ import annotations

import random

from pdserve.router.routing.shadow import LOGPROB_TOLERANCE, ShadowVerifier, divergence
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.outbox_messages import LogprobInfo, TopLogprob


def lp(token: int, logprob: float, *top: tuple[int, float]) -> LogprobInfo:
    return LogprobInfo(
        token_id=token,
        token=str(token),
        logprob=logprob,
        top=[TopLogprob(token_id=t, token=str(t), logprob=v) for t, v in top],
    )


SERVED = [5, 6, 7]
SERVED_LP = [lp(5, -0.1), lp(6, -0.2), lp(7, -0.3)]


def test_identical_runs_agree_in_both_modes() -> None:
    for exact in (True, False):
        assert divergence(SERVED, SERVED_LP, SERVED, SERVED_LP, exact) is None


def test_bitwise_mode_flags_the_first_differing_token_or_logprob() -> None:
    other = [lp(5, -0.1), lp(9, -0.2, (9, -0.2), (6, -0.2)), lp(7, -0.3)]
    assert divergence(SERVED, SERVED_LP, [5, 9, 7], other, True) == "token 1: 6 served, 9 replayed"
    shifted = [lp(5, -0.1), lp(6, -0.2 + 1e-7), lp(7, -0.3)]
    found = divergence(SERVED, SERVED_LP, SERVED, shifted, True)
    assert found is not None and found.startswith("logprob of token 1 (6)")
    assert (
        divergence(SERVED, SERVED_LP, SERVED[:2], SERVED_LP[:2], True) == "token 2: 7 served, None replayed"
    )


def test_tolerant_mode_allows_small_logprob_noise_and_near_ties_only() -> None:
    noisy = [lp(5, -0.1 + 0.01), lp(6, -0.2 - 0.02), lp(7, -0.3)]
    assert divergence(SERVED, SERVED_LP, SERVED, noisy, False) is None
    far = [lp(5, -0.1 + 2 * LOGPROB_TOLERANCE), lp(6, -0.2), lp(7, -0.3)]
    assert divergence(SERVED, SERVED_LP, SERVED, far, False) is not None
    # the replay chose 9 at position 1 where the served 6 was just as likely: a near-tie, no verdict after
    tie = [lp(5, -0.1), lp(9, -0.69, (9, -0.69), (6, -0.70)), lp(3, -0.1)]
    assert divergence(SERVED, SERVED_LP, [5, 9, 3], tie, False) is None
    # ... but not when the served token was far less likely in the replay
    clear = [lp(5, -0.1), lp(9, -0.1, (9, -0.1), (6, -3.0)), lp(3, -0.1)]
    assert divergence(SERVED, SERVED_LP, [5, 9, 3], clear, False) == "token 1: 6 served, 9 replayed"
    assert divergence(SERVED, SERVED_LP, [5, 9, 3], tie, True) == "token 1: 6 served, 9 replayed"


class _NoHost:
    pass


def test_a_sampled_request_is_seeded_and_asks_for_logprobs_only_where_needed() -> None:
    verifier = ShadowVerifier(_NoHost(), 1.0, random.Random(0))  # type: ignore[arg-type]
    greedy = verifier.prepare(SamplingParams(temperature=0.0))
    assert greedy.seed is None and greedy.logprobs == 0
    random_draws = verifier.prepare(SamplingParams(temperature=0.7))
    assert random_draws.seed is not None and random_draws.logprobs == 0
    asked = verifier.prepare(SamplingParams(temperature=0.7, seed=3, logprobs=5))
    assert asked.seed == 3 and asked.logprobs == 5
    assert [verifier.sampled() for _ in range(5)] == [True] * 5
    assert not ShadowVerifier(_NoHost(), 0.0).sampled()  # type: ignore[arg-type]
