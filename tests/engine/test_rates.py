"""The rate meter behind the rates an instance publishes (``engine/rates.py``)."""

from __future__ import annotations

import pytest

from pdserve.engine.rates import RateMeter


def test_a_rate_is_seconds_over_units_weighted_by_size() -> None:
    meter = RateMeter(decay=1.0)
    assert meter.value is None
    meter.add(1.0, 100)  # 10 ms a unit
    meter.add(0.01, 0)  # no units: nothing to learn
    meter.add(0.3, 10)  # 30 ms a unit, but a tenth of the size
    assert meter.value == pytest.approx(1.3 / 110)


def test_old_samples_fade_and_the_first_can_be_dropped() -> None:
    meter = RateMeter(decay=0.5, skip=1)
    meter.add(50.0, 10)  # the cold first step: dropped
    assert meter.value is None
    meter.add(1.0, 10)
    for _ in range(30):
        meter.add(2.0, 10)
    assert meter.value == pytest.approx(0.2, rel=1e-6)


def test_an_outlier_counts_at_most_clamp_times_the_mean() -> None:
    meter = RateMeter(decay=1.0, clamp=10.0)
    meter.add(1.0, 100)
    meter.add(1000.0, 100)  # a pause: counted as 10x the mean, 10 s
    assert meter.value == pytest.approx(11.0 / 200)
