"""What the planner's rule is given, remembers and says: the targets (SLOs and hysteresis), its
state between observations, each switch's motive and verdict, and the decisions it publishes
(``rule.py`` decides; ``loop.py`` publishes the decisions; ``restore.py`` rebuilds the state).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Targets:
    """The SLOs, and how the rule may act on them."""

    ttft_p90_s: float
    itl_p90_s: float
    patience: int = 3
    cooldown_s: float = 60.0
    reverse_s: float = 300.0
    min_requests: int = 20
    min_arrivals: int = 5  # the demand (demand.py) is read from this many arrivals in the window
    min_instances: int = 2
    max_instances: int | None = None  # None: the count is not the planner's to change
    prefill_rate: float | None = None  # prompt tokens/s one prefill instance prefills; None: learned
    margin: float = 0.15  # a switch relieved its pressure when it fell by this share
    hold_s: float | None = None  # a failed switch's direction held back this long; None: 3 x reverse_s

    @property
    def failed_hold_s(self) -> float:
        return self.hold_s if self.hold_s is not None else 3 * self.reverse_s


@dataclasses.dataclass(frozen=True)
class Motive:
    """What a switch meant to relieve: kept until its effect is judged."""

    at: float
    direction: int  # +1: toward prefill, -1: toward decode
    pressure: float  # the pressure it meant to relieve (prefill's toward prefill), at the switch
    other: float  # the other side's, at the switch

    @property
    def relieves(self) -> str:
        return "prefill" if self.direction > 0 else "decode"

    @property
    def other_side(self) -> str:
        return "decode" if self.direction > 0 else "prefill"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A switch's effect judged after its effect window: ``relieved``, ``failing`` (k of
    ``patience``), ``failed`` (to be undone), ``kept`` (failed, but the targets were met by the time
    the undo was allowed)."""

    motive: Motive
    outcome: str
    pressure: float  # the pressure it meant to relieve, now
    other: float  # the other side's, now
    hold_until: float | None = None  # failed or kept: no move in the motive's direction before this
    failing: int = 0
    repeats: int = 1  # failed switches in this direction in a row (each doubles the hold, up to 8x)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Verdict:
        return cls(**{**raw, "motive": Motive(**raw["motive"])})


@dataclasses.dataclass
class PlannerState:
    """What the rule remembers between observations (rebuilt from the decisions stream at start)."""

    candidate: tuple[int, int] | None = None  # the (prefill, decode) target seen in a row
    streak: int = 0
    last_change_at: float = float("-inf")
    last_direction: int = 0  # +1: toward prefill, -1: toward decode, 0: none yet
    prefill_rate: float = 0.0  # learned: the most prompt tokens/s one prefill instance served
    last_ri: float | None = None  # the last trusted inter-token pressure
    last_prefill: float | None = None  # the last trusted prefill pressure (TTFT's, or the queue's)
    last_trusted_at: float = float("-inf")  # when the latencies were last trusted
    pending: Motive | None = None  # the last switch, its effect not judged yet
    failing: int = 0  # trusted observations in a row that found it failing
    undo: Verdict | None = None  # a failed switch waiting to be undone
    blocked: Verdict | None = None  # a failed switch whose direction is held back


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
    motive: Motive | None = None  # a switch's: what it means to relieve
    verdict: Verdict | None = None  # a switch's effect, as judged at this observation

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Pressures:
    """One observation's pressures; ``prefill`` and ``decode`` are what the split follows (None:
    nothing to judge by)."""

    ttft: float | None
    itl: float | None
    queue: float | None
    prefill: float | None
    decode: float | None
    trusted: bool  # the p90s rest on at least min_requests requests (Observation.latency_samples)
    decode_basis: str = "trusted"  # untrusted: "last trusted" ri, or "assumed" at its target (none yet)
