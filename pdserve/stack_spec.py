"""What ``pdserve up`` runs (:class:`StackSpec`): its flags are generated from these fields."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_store import DEFAULT_MODEL, MODEL_HELP
from pdserve.errors import ConfigError
from pdserve.flags import setting
from pdserve.planner.settings import plan_default
from pdserve.scheduler.connection import NO_WAIT, WAIT_REPLICAS_HELP, WAIT_TIMEOUT_HELP
from pdserve.scheduler.keys import DEFAULT_CLUSTER
from pdserve.scheduler.registry import DEFAULT_TTL_S
from pdserve.worker.settings import ENGINES, KV_TRANSFERS
from pdserve.worker.settings import default as worker_default


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """What ``pdserve up`` runs; the flags of ``up`` are generated from these fields."""

    model: str = setting(DEFAULT_MODEL, f"{MODEL_HELP} (default %(default)s)")
    redis_url: str | None = setting(
        None, "use this Redis instead of starting an embedded one", kind=str, repr=False
    )  # may hold a password
    host: str = setting("127.0.0.1", "router bind address (default %(default)s)")
    port: int = setting(8000, "first router's port; more routers take the next ports (default %(default)s)")
    routers: int = setting(1, "number of routers (default %(default)s)")
    prefill: int = setting(1, "prefill instances (default %(default)s)")
    decode: int = setting(1, "decode instances (default %(default)s)")
    mixed: int = setting(0, "mixed instances (default %(default)s)")
    batch_workers: int = setting(
        1,
        "batch workers running the Batch API's lines in spare capacity (`pdserve batch-worker`); "
        "none on a Redis Cluster, which rq does not support (default %(default)s)",
    )
    cluster: str = setting(DEFAULT_CLUSTER, "namespace inside Redis (default %(default)s)")
    ttl_s: float = setting(DEFAULT_TTL_S, "registration TTL of every worker and router (default %(default)s)")
    redis_wait_replicas: int = setting(NO_WAIT.replicas, f"every worker's and router's: {WAIT_REPLICAS_HELP}")
    redis_wait_timeout_ms: int = setting(NO_WAIT.timeout_ms, WAIT_TIMEOUT_HELP)
    kv_transfer: str = setting(
        worker_default("kv_transfer"),
        "KV transports of every prefill/decode worker (as `pdserve worker --kv-transfer`; default %(default)s)",
        choices=KV_TRANSFERS,
    )
    engine_kind: str = setting(
        worker_default("engine_kind"),
        "what computes tokens in every worker (as `pdserve worker --engine`; default %(default)s)",
        name="--engine",
        choices=ENGINES,
    )
    metrics: bool = setting(
        False,
        "give every worker a Prometheus port (free ports, printed in the banner; routers always "
        "serve /metrics) (default off)",
    )
    gpus: str | None = setting(
        None,
        "with --device cuda: the GPUs the workers share, as indices (e.g. 0,1): workers go to them in "
        "turn, and each card's --gpu-memory-utilization is split between the workers on it "
        "(default: every worker on --gpu, else the first card)",
        kind=str,
    )
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)  # every worker's
    router_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """RouterSettings fields every router gets (benchmarks and tests: `up` has no flags for them)."""
    autoscale: bool = setting(
        False,
        "run the planner (pdserve plan --apply): every worker --switchable, their roles switched to keep "
        "TTFT and inter-token latency within --ttft-p90 and --itl-p90, and with --max-workers the "
        "prefill and decode workers started and stopped within it (default off)",
    )
    max_workers: int = setting(
        0, "with --autoscale, the most prefill + decode workers (default 0: the count stays as started)"
    )
    ttft_p90_s: float = setting(
        plan_default("ttft_p90_s"), "with --autoscale, the TTFT p90 target in seconds (default %(default)s)"
    )
    itl_p90_s: float = setting(
        plan_default("itl_p90_s"),
        "with --autoscale, the inter-token latency p90 target in seconds (default %(default)s)",
    )
    worker_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """WorkerSettings fields every worker gets (benchmarks and tests: `up` has no flags for them)."""
    ready_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("routers", "prefill", "decode", "mixed", "batch_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if self.routers < 1:
            raise ConfigError("--routers must be >= 1")
        if self.prefill + self.decode + self.mixed < 1:
            raise ConfigError("at least one of --prefill, --decode, --mixed must be >= 1")
        if self.gpus is not None:
            try:
                cards = [int(g) for g in self.gpus.split(",")]
            except ValueError:
                raise ConfigError(
                    f"--gpus must be GPU indices separated by commas, got {self.gpus!r}"
                ) from None
            if not cards or min(cards) < 0:
                raise ConfigError(f"--gpus must be GPU indices separated by commas, got {self.gpus!r}")
        if self.max_workers and (not self.autoscale or self.max_workers < self.prefill + self.decode):
            raise ConfigError("--max-workers needs --autoscale and at least --prefill + --decode workers")
        if self.prefill and not self.decode and not self.mixed:
            raise ConfigError(
                "--prefill needs --decode (or --mixed): a prefill instance cannot finish a request"
            )


def planner_argv(spec: StackSpec) -> list[str]:
    """The flags of ``up --autoscale``'s planner child (its Redis URL comes in its environment)."""
    argv = ["--cluster", spec.cluster, "--apply", "--ttft-p90", str(spec.ttft_p90_s)]
    argv += ["--itl-p90", str(spec.itl_p90_s)]
    return argv + (["--max-instances", str(spec.max_workers)] if spec.max_workers else [])
