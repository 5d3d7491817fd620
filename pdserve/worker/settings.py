"""A worker instance's settings and its engine's sizing: validated dataclasses, light to import (no
Paddle). Each field that is a flag declares its default and help once (:func:`pdserve.flags.setting`);
``pdserve worker``, ``generate`` and ``up`` generate their flags and ``PDSERVE_*`` variables from them."""

from __future__ import annotations

import dataclasses
import socket
import uuid
from pathlib import Path

from pdserve.cache_transfer.mooncake import MOONCAKE_PROTOCOLS
from pdserve.errors import ConfigError
from pdserve.flags import setting
from pdserve.scheduler.connection import DEFAULT_URL
from pdserve.scheduler.keys import DEFAULT_CLUSTER
from pdserve.scheduler.registry import DEFAULT_TTL_S
from pdserve.worker.cpu import KERNEL_MODES
from pdserve.worker.packed_gemm import GEMM_MODES
from pdserve.worker.paged_kernel import ATTENTION_MODES

ROLES = ("prefill", "decode", "mixed")
KV_TRANSFERS = ("auto", "shm", "mooncake", "both")
ENGINES = ("model", "echo")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizing. ``num_blocks`` wins over ``kv_cache_gb``; ``max_num_batched_tokens`` defaults
    to one prefill chunk plus one token per running sequence."""

    kv_cache_gb: float = setting(1.0, "KV cache size in GiB (default %(default)s)")
    num_blocks: int | None = setting(None, "KV cache size in blocks (overrides --kv-cache-gb)", kind=int)
    block_size: int = setting(16, "tokens per KV block (default %(default)s)")
    max_num_seqs: int = setting(64, "most sequences running at once (default %(default)s)")
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step (default: chunk size + max-num-seqs)", kind=int
    )
    prefill_chunk_size: int = setting(512, "long prompts are prefilled in chunks of this many tokens")
    max_model_len: int | None = setting(
        None, "context limit (default: the model's max_position_embeddings)", kind=int
    )
    threads: int | None = setting(
        None, "CPU threads for Paddle (default: all cores; `pdserve up`: cores / workers)", kind=int
    )
    kernels: str | None = setting(
        None,
        "fused Paddle ops where this CPU runs them (auto), plain composed ops everywhere (composed), "
        "or fused or fail (fused) (default: auto)",
        kind=str,
        choices=KERNEL_MODES,
    )
    attention: str | None = setting(
        None,
        "attention path: numba kernels (decode reads the paged cache in place; RoPE fused with the "
        "K/V write; causal prefill tiles; also SwiGLU and residual + RMSNorm) (kernel), pure Paddle "
        "(reference), or the kernels where numba imports and compiles, else the reference (auto) "
        "(default: auto)",
        kind=str,
        choices=ATTENTION_MODES,
    )
    gemm: str | None = setting(
        None,
        "linear layers and lm_head: weights packed once for MKL's packed GEMM (packed; ~2x faster at "
        "decode batch sizes), Paddle's matmul on plain weights (paddle), or packed where Paddle's MKL "
        "has the packed API, else paddle (auto) (default: auto)",
        kind=str,
        choices=GEMM_MODES,
    )
    shared_kv: bool = False  # decode cache in POSIX shared memory (same-host prefill writes into it)
    shm_name: str | None = None
    keep_logits: bool = False  # attach each sampled row's raw logits to its output (exactness tests)
    # Same bits for a sequence alone or in any batch; None: on when MKL_CBWR asks for STRICT mode.
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    model_dir: Path | None = setting(None, "model folder (Hugging Face layout)", name="--model", kind=Path)
    role: str = setting(
        "mixed",
        "prefill: prompts to KV cache; decode: KV cache to tokens; mixed: both (default %(default)s)",
        choices=ROLES,
    )
    served_model_name: str = setting("", "model name clients use (default: the folder name)")
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
        "Redis URL: redis:// or rediss:// (TLS), with user:password@ and /db (default %(default)s)",
    )
    cluster: str = setting(DEFAULT_CLUSTER, "namespace of this deployment inside Redis (default %(default)s)")
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
        "hosts), both; auto: shm, plus mooncake when it is installed (default %(default)s)",
        choices=KV_TRANSFERS,
    )
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
    metrics_port: int = setting(0, "serve Prometheus metrics at http://0.0.0.0:PORT/metrics (default 0: off)")
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        if self.model_dir is None:
            raise ConfigError("--model is required (or set PDSERVE_MODEL)")
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.ttl_s > 0:
            raise ConfigError(f"--ttl must be > 0, got {self.ttl_s}")
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
