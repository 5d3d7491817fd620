"""A worker instance's settings: a validated dataclass, light to import (no Paddle); the engine's own
settings are :class:`pdserve.engine.config.EngineConfig`. Each field that is a flag declares its default and help once (:func:`pdserve.flags.setting`);
``pdserve worker``, ``generate`` and ``up`` generate their flags and ``PDSERVE_*`` variables from them."""

from __future__ import annotations

import dataclasses
import socket
import uuid
from pathlib import Path

from pdserve.cache_transfer.mooncake import MOONCAKE_PROTOCOLS
from pdserve.cache_transfer.transports import KV_TRANSFERS
from pdserve.engine.config import EngineConfig
from pdserve.engine.models.model_store import MODEL_HELP
from pdserve.errors import ConfigError
from pdserve.flags import setting
from pdserve.grammar_limits import DEFAULT_MAX_OPTIONAL_PROPERTIES, MAX_OPTIONAL_PROPERTIES_HELP
from pdserve.priority import PREPARE_NICE, PREPARE_NICE_HELP
from pdserve.scheduler.keys import DEFAULT_CLUSTER
from pdserve.scheduler.redis_client import (
    DEFAULT_URL,
    NO_WAIT,
    WAIT_REPLICAS_HELP,
    WAIT_TIMEOUT_HELP,
    ReplicaWait,
)
from pdserve.scheduler.registry import DEFAULT_TTL_S
from pdserve.scheduler.streams import MAX_DELIVERIES

ROLES = ("prefill", "decode", "mixed")
ENGINES = ("model", "echo")


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    model_dir: Path | None = setting(None, MODEL_HELP, name="--model", kind=str)
    role: str = setting(
        "mixed",
        "prefill: prompts to KV cache; decode: KV cache to tokens; mixed: both (default %(default)s)",
        choices=ROLES,
    )
    served_model_name: str = setting(
        "", "model name clients use (default: the preset, hub id, .gguf file or folder name given to --model)"
    )
    instance_id: str = setting(
        "",
        "stable id; a restart with the same id re-reads its unacknowledged inbox entries (default: random)",
    )
    host: str = setting(
        "",
        "host identity: prefill and decode with the same one move KV through shared memory "
        "(default: this machine's hostname)",
        name="--hostname",
    )
    drain_timeout_s: float = setting(
        30.0, "seconds SIGTERM waits for in-flight requests (default %(default)s)"
    )
    redis_url: str = setting(
        DEFAULT_URL,
        "Redis URL: redis://, rediss:// (TLS), unix://, redis+sentinel://HOST:PORT[,...]/SERVICE[/DB] or "
        "redis+cluster://HOST:PORT[,...], with user:password@ (default %(default)s); "
        "one with a password is best given as the variable (the command line shows in `ps`)",
        repr=False,
    )  # may hold a password
    cluster: str = setting(DEFAULT_CLUSTER, "namespace of this deployment inside Redis (default %(default)s)")
    redis_wait_replicas: int = setting(NO_WAIT.replicas, WAIT_REPLICAS_HELP)
    redis_wait_timeout_ms: int = setting(NO_WAIT.timeout_ms, WAIT_TIMEOUT_HELP)
    ttl_s: float = setting(
        DEFAULT_TTL_S, "registration TTL in seconds; heartbeats renew it every ttl/3 (default %(default)s)"
    )
    engine_kind: str = setting(
        "model",
        "what computes tokens: model (the Paddle engine), or echo (no model: returns the prompt's tokens, "
        "cycled; a benchmarking aid for the router and control plane) (default %(default)s)",
        name="--engine",
        choices=ENGINES,
    )
    kv_transfer: str = setting(
        "auto",
        "KV transports a prefill/decode instance offers: shm (same host, one copy), mooncake (across "
        "hosts), cuda_ipc (GPU caches, same host), both (all those that move this instance's cache); "
        "auto: on a CPU cache shm, plus mooncake when it is installed and --transfer-address is given; "
        "on a GPU cache cuda_ipc (default %(default)s)",
        choices=KV_TRANSFERS,
    )
    # The flags of one transport, read by its backend by field name (TransportBackend.from_options):
    # declared here, as cache_transfer may not import pdserve.flags, and their names and variables stay.
    mooncake_protocol: str = setting(
        "tcp",
        "mooncake's wire: tcp, or rdma where the NICs exist (default %(default)s)",
        choices=MOONCAKE_PROTOCOLS,
    )
    transfer_address: str = setting(
        "",
        "address other hosts reach this instance's mooncake engine at (default: the address of the "
        "default route's interface)",
    )
    switchable: bool = setting(
        False,
        "the instance may be told to take any role while it serves (pdserve role, a planner): its KV "
        "cache lives in shared memory and every KV transport is open whatever its role; without it, "
        "only switches its start prepared for (a decode instance can become prefill or mixed, a "
        "prefill mixed) (default off)",
    )
    kv_checksum: bool = setting(
        True,
        "digest every KV block a prefill writes to a decode instance, and have the decode instance check "
        "its blocks against the digests before it decodes or caches any (a mismatch is never decoded: the "
        "request is retried); costs well under 1%% of a 2048-token prompt's TTFT (default on)",
    )
    mooncake_staging_mb: int = setting(
        1024,
        "a decode instance whose KV cache is on a GPU lands mooncake hand-offs in this many MiB of "
        "pinned host memory, registered once (a prefill uses 64 MiB of it to send from): it bounds "
        "the hand-offs in flight into the instance, not the cache (default %(default)s)",
    )
    metrics_port: int = setting(
        0, "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (default 0: off)"
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "address the metrics port listens on; 0.0.0.0 for a Prometheus on another host (default %(default)s)",
    )
    stream_interval_s: float = setting(
        0.02,
        "a request's tokens are published at most every this many seconds: those of faster steps wait "
        "for the next step and go together (its first token and its end never wait), so routers relay "
        "a few larger SSE events instead of one per token; a model's steps on a CPU mostly take longer, "
        "and then every token goes alone (0: each step's at once) (default %(default)s)",
    )
    max_prompt_chars_per_token: int = setting(
        32,
        "a prompt (or chat messages and tools) longer than this many characters per token of the model "
        "length is refused with 400 before it is tokenized: a prompt that fits has no more characters per "
        "token than the vocabulary's longest token (13 in the presets; text averages ~4) (default %(default)s)",
    )
    max_grammar_bytes: int = setting(
        65536,
        "structured output (JSON schema, regex, choices, a tool call's schema) larger than this many bytes "
        "of JSON is refused with 400 before it is compiled (default %(default)s)",
    )
    max_optional_properties: int = setting(DEFAULT_MAX_OPTIONAL_PROPERTIES, MAX_OPTIONAL_PROPERTIES_HELP)
    prepare_nice: int = setting(PREPARE_NICE, PREPARE_NICE_HELP)
    max_deliveries: int = setting(
        MAX_DELIVERIES,
        "an inbox message is handed over at most this many times: one whose handling the instance never "
        "finished (it crashed or was killed each time, then restarted under its id) then goes to its "
        "dead-letter stream and its request fails, instead of crashing every restart (default %(default)s)",
    )
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)

    @property
    def replica_wait(self) -> ReplicaWait:
        return ReplicaWait(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    def __post_init__(self) -> None:
        self.replica_wait.check_url(self.redis_url)
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        if self.model_dir is None:
            raise ConfigError("--model is required (or set PDSERVE_MODEL)")
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.ttl_s > 0:
            raise ConfigError(f"--ttl must be > 0, got {self.ttl_s}")
        if self.max_deliveries < 1:
            raise ConfigError(f"--max-deliveries must be >= 1, got {self.max_deliveries}")
        if self.max_prompt_chars_per_token < 1:
            raise ConfigError(
                f"--max-prompt-chars-per-token must be >= 1, got {self.max_prompt_chars_per_token}"
            )
        if self.max_grammar_bytes < 1:
            raise ConfigError(f"--max-grammar-bytes must be >= 1, got {self.max_grammar_bytes}")
        if self.max_optional_properties < 1:
            raise ConfigError(f"--max-optional-properties must be >= 1, got {self.max_optional_properties}")
        if not 0 <= self.prepare_nice <= 19:
            raise ConfigError(f"--prepare-nice must be 0..19, got {self.prepare_nice}")
        if self.stream_interval_s < 0:
            raise ConfigError(f"--stream-interval must be >= 0, got {self.stream_interval_s}")
        if self.mooncake_staging_mb < 1:
            raise ConfigError(f"--mooncake-staging-mb must be >= 1, got {self.mooncake_staging_mb}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not self.instance_id:
            object.__setattr__(self, "instance_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", self.model_dir.resolve().name)
        if not self.host:
            object.__setattr__(self, "host", socket.gethostname())


def default(name: str):
    """The declared default of one WorkerSettings field (for flags of other commands)."""
    return WorkerSettings.__dataclass_fields__[name].default
