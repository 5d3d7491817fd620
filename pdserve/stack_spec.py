"""What ``pdserve up`` runs (:class:`StackSpec`): its flags are generated from these fields."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.models.model_store import DEFAULT_MODEL, MODEL_HELP
from pdserve.errors import ConfigError
from pdserve.flags import setting
from pdserve.planner.settings import plan_default
from pdserve.scheduler.keys import DEFAULT_CLUSTER
from pdserve.scheduler.redis_client import NO_WAIT, WAIT_REPLICAS_HELP, WAIT_TIMEOUT_HELP
from pdserve.scheduler.registry import DEFAULT_TTL_S
from pdserve.worker.settings import ENGINES, KV_TRANSFERS
from pdserve.worker.settings import default as worker_default

# The layout `up` starts when some of --prefill/--decode/--mixed are given: the others as here (the
# former default of all three, a prefill/decode pair), so an explicit flag means what it always did.
GIVEN_LAYOUT = {"prefill": 1, "decode": 1, "mixed": 0}
# What omp_passive puts in a worker's environment (a variable set in up's own environment wins).
OMP_PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
LAYOUT_HELP = "(default: the layout picked for this host's cores, see --mixed-below-cores; {} when another of --prefill/--decode/--mixed is given)"


def worker_threads(cores: int, workers: int) -> int:
    """Each worker's threads where --threads is not given: the usable cores split between the
    workers (at least 1 each). Leaving a core to the routers and Redis was measured slower on an
    idle 2-core host (one mixed instance, rand8: 0.27 against 0.35 req/s with both cores)."""
    return max(1, cores // workers)


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
    prefill: int | None = setting(None, f"prefill instances {LAYOUT_HELP.format(1)}", kind=int)
    decode: int | None = setting(None, f"decode instances {LAYOUT_HELP.format(1)}", kind=int)
    mixed: int | None = setting(None, f"mixed instances {LAYOUT_HELP.format(0)}", kind=int)
    mixed_below_cores: int = setting(
        5,
        "with none of --prefill/--decode/--mixed: on a CPU host with fewer usable cores than this (its "
        "affinity mask), one mixed instance, else 1 prefill + 1 decode; on a GPU, and with --autoscale, "
        "always 1 prefill + 1 decode (default %(default)s: from 5 cores each of the pair gets 2 threads; "
        "measured on 2 cores only)",
    )
    omp_passive: bool = setting(
        False,
        "workers' OpenMP threads (Paddle's libiomp5, numba's libgomp) sleep as soon as a parallel region "
        "ends instead of spinning (libiomp5: for 200 ms): OMP_WAIT_POLICY=PASSIVE and KMP_BLOCKTIME=0 in "
        "each worker's environment, where up's environment sets neither. For a host that other jobs "
        "load; on an idle host spinning decodes faster (default off)",
    )
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
    layout_reason: str = ""
    """Why the stack has its prefill/decode/mixed counts (`up` prints it; set by :meth:`with_layout`)."""

    def __post_init__(self) -> None:
        counts = {name: getattr(self, name) for name in GIVEN_LAYOUT}
        if any(n is not None for n in counts.values()):  # given: the others as they always were
            for name, n in counts.items():
                if n is None:
                    object.__setattr__(self, name, GIVEN_LAYOUT[name])
            if not self.layout_reason:
                object.__setattr__(self, "layout_reason", "as given by --prefill/--decode/--mixed")
        for name in ("routers", "prefill", "decode", "mixed", "batch_workers"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if self.routers < 1:
            raise ConfigError("--routers must be >= 1")
        if self.mixed_below_cores < 1:
            raise ConfigError("--mixed-below-cores must be >= 1")
        if self.gpus is not None:
            try:
                cards = [int(g) for g in self.gpus.split(",")]
            except ValueError:
                raise ConfigError(
                    f"--gpus must be GPU indices separated by commas, got {self.gpus!r}"
                ) from None
            if not cards or min(cards) < 0:
                raise ConfigError(f"--gpus must be GPU indices separated by commas, got {self.gpus!r}")
        # a layout left to with_layout is a prefill/decode pair with --autoscale
        pairs = (self.prefill or 0) + (self.decode or 0) if self.layout_given else 2
        if self.max_workers and (not self.autoscale or self.max_workers < pairs):
            raise ConfigError("--max-workers needs --autoscale and at least --prefill + --decode workers")
        if not self.layout_given:  # picked by with_layout, on the host that runs the stack
            return
        if self.n_workers < 1:
            raise ConfigError("at least one of --prefill, --decode, --mixed must be >= 1")
        if self.prefill and not self.decode and not self.mixed:
            raise ConfigError(
                "--prefill needs --decode (or --mixed): a prefill instance cannot finish a request"
            )

    @property
    def layout_given(self) -> bool:
        return self.prefill is not None

    def with_layout(self, cores: int, device: str) -> StackSpec:
        """This spec with its prefill/decode/mixed counts: as given, else picked for ``cores`` usable
        cores and ``device`` (``cpu`` or ``cuda``), with the reason in ``layout_reason``."""
        if self.layout_given:
            return self
        pair, one_mixed = (1, 1, 0), (0, 0, 1)  # (prefill, decode, mixed)
        if self.autoscale:
            counts, why = pair, "--autoscale: 1 prefill + 1 decode, whose roles the planner switches"
        elif device == "cuda":
            counts, why = pair, "a GPU: 1 prefill + 1 decode sharing it"
        elif cores < self.mixed_below_cores:
            counts = one_mixed
            why = (
                f"{cores} usable core(s), fewer than --mixed-below-cores {self.mixed_below_cores}: one mixed "
                "instance (a prefill/decode pair would get one thread each)"
            )
        else:
            counts = pair
            why = (
                f"{cores} usable cores, at least --mixed-below-cores {self.mixed_below_cores}: 1 prefill + "
                "1 decode, each with threads of its own"
            )
        p, d, m = counts
        why += "; --prefill/--decode/--mixed choose"
        return dataclasses.replace(self, prefill=p, decode=d, mixed=m, layout_reason=why)

    @property
    def n_workers(self) -> int:
        """Prefill + decode + mixed workers (once the layout is known)."""
        assert self.prefill is not None and self.decode is not None and self.mixed is not None
        return self.prefill + self.decode + self.mixed


def planner_argv(spec: StackSpec) -> list[str]:
    """The flags of ``up --autoscale``'s planner child (its Redis URL comes in its environment)."""
    argv = ["--cluster", spec.cluster, "--apply", "--ttft-p90", str(spec.ttft_p90_s)]
    argv += ["--itl-p90", str(spec.itl_p90_s)]
    return argv + (["--max-instances", str(spec.max_workers)] if spec.max_workers else [])
