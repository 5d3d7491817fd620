"""``pdserve plan``'s settings: each flag declared once, with its ``PDSERVE_*`` variable."""

from __future__ import annotations

import dataclasses

from pdserve.errors import ConfigError
from pdserve.flags import setting
from pdserve.planner.records import Targets
from pdserve.scheduler.keys import DEFAULT_CLUSTER
from pdserve.scheduler.redis_client import DEFAULT_URL


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    redis_url: str = setting(
        DEFAULT_URL,
        "Redis URL of the cluster to plan (default %(default)s); one with a password is best given as "
        "the variable",
        repr=False,
    )
    cluster: str = setting(DEFAULT_CLUSTER, "namespace inside Redis (default %(default)s)")
    served_model_name: str = setting(
        "", "the model whose instances it plans, as clients name it (default: the cluster's only model)"
    )
    ttft_p90_s: float = setting(
        2.0, "target for the 90th percentile of time to first token, in seconds (default %(default)s)"
    )
    itl_p90_s: float = setting(
        0.1, "target for the 90th percentile of inter-token latency, in seconds (default %(default)s)"
    )
    interval_s: float = setting(10.0, "seconds between two decisions (default %(default)s)")
    patience: int = setting(
        3, "a change is made only after this many decisions in a row wanted it (default %(default)s)"
    )
    cooldown_s: float = setting(
        60.0, "no change within this many seconds of the last one (default %(default)s)"
    )
    reverse_s: float = setting(
        300.0,
        "no change undoing the last one's direction within this many seconds: on a steady load at most "
        "one change in that time (default %(default)s)",
        name="--reverse-cooldown",
    )
    min_requests: int = setting(
        20,
        "trust the latency p90s only from this many requests that began streaming in the routers' last "
        "window; below it only the demand or a prefill queue acts (default %(default)s)",
    )
    min_arrivals: int = setting(
        5,
        "split the instances by the demand arriving (prompt and answer tokens, each at what it costs "
        "here) once this many requests arrived in the routers' last window (default %(default)s)",
    )
    apply: bool = setting(
        False, "switch the instances' roles as decided (default off: only decide and say why)"
    )
    max_instances: int = setting(
        0,
        "let the decisions change the instance count, up to this many prefill + decode instances (for "
        "whoever starts and stops them: pdserve up --autoscale, an autoscaler reading the metrics) "
        "(default 0: the count is not the planner's)",
    )
    min_instances: int = setting(2, "never fewer prefill + decode instances than this (default %(default)s)")
    metrics_port: int = setting(
        0,
        "serve the planner's endpoint on this port: GET /desired (the desired instances per role as "
        "JSON, what KEDA's metrics-api trigger reads) and GET /metrics (Prometheus) (default 0: off)",
    )
    metrics_host: str = setting("127.0.0.1", "address the endpoint listens on (default %(default)s)")
    record: str = setting(
        "", "append each observation to this file, one JSON line each: a trace to replay the rule on"
    )

    def __post_init__(self) -> None:
        for name in ("ttft_p90_s", "itl_p90_s", "interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"--{name.removesuffix('_s').replace('_', '-')} must be > 0, got {getattr(self, name)}"
                )
        if self.patience < 1 or self.min_requests < 1 or self.min_arrivals < 1:
            raise ConfigError("--patience, --min-requests and --min-arrivals must be >= 1")
        if self.max_instances and self.max_instances < self.min_instances:
            raise ConfigError(
                f"--max-instances {self.max_instances} is below --min-instances {self.min_instances}"
            )
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {self.metrics_port}")

    @property
    def targets(self) -> Targets:
        return Targets(
            self.ttft_p90_s,
            self.itl_p90_s,
            patience=self.patience,
            cooldown_s=self.cooldown_s,
            reverse_s=self.reverse_s,
            min_requests=self.min_requests,
            min_arrivals=self.min_arrivals,
            min_instances=self.min_instances,
            max_instances=self.max_instances or None,
        )


def plan_default(name: str) -> object:
    """The declared default of one PlanSettings field (for ``pdserve up --autoscale``'s flags)."""
    return PlanSettings.__dataclass_fields__[name].default
