"""What the engine measured of its own speed, for routers: seconds per prompt token computed, and
per tier below the pool seconds per block read back. Each is a :class:`RateMeter` fed by timings
taken around calls that happen anyway (a step's forward, a tier's read and the copy into the pool):
two ``perf_counter`` calls per step or per block, nothing per token."""

from __future__ import annotations


class RateMeter:
    """Seconds per unit (a prompt token, a block) over the recent samples: the ratio of two decaying
    sums, seconds and units, so a sample weighs by its size (a 512-token chunk more than a 1-token
    one) and older samples fade by ``decay`` per sample.

    The first ``skip`` samples are dropped (the first forward meets cold caches and compiles
    kernels: seconds for a few tokens), and a sample counts at most ``clamp`` times the current
    mean (a pause of the process does not hold the mean up for dozens of samples; a lasting change
    still moves it within a few). ``value`` is None until a sample counted."""

    __slots__ = ("_seconds", "_skip", "_units", "clamp", "decay")

    def __init__(self, decay: float = 0.9, skip: int = 0, clamp: float = 10.0) -> None:
        self.decay = decay
        self.clamp = clamp
        self._skip = skip
        self._seconds = 0.0
        self._units = 0.0

    def add(self, seconds: float, units: float) -> None:
        """``units`` took ``seconds`` (nothing counts for no units or no time)."""
        if units <= 0 or seconds <= 0:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        mean = self.value
        if mean is not None:
            seconds = min(seconds, self.clamp * mean * units)
        self._seconds = self._seconds * self.decay + seconds
        self._units = self._units * self.decay + units

    @property
    def value(self) -> float | None:
        """Seconds per unit lately (None before a sample counted)."""
        return self._seconds / self._units if self._units > 0 else None
