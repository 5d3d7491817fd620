"""The engine's settings: sizing and kernel choice. Light to import (no Paddle). Each field that is a
flag declares its default and help once (:func:`pdserve.flags.setting`); the kernel fields and
``threads`` left unset are read from ``PDSERVE_*`` here, once, so the offline ``LLM`` and the worker
resolve them alike and the engine reads no environment variable itself."""

from __future__ import annotations

import dataclasses
import os

from pdserve.errors import ConfigError
from pdserve.flags import setting

DEVICES = ("auto", "cpu", "cuda")  # --device: platform.py resolves auto
DTYPES = ("auto", "bfloat16", "float32")
# The CPU platform's kernel choices (cpu/: host_cpu, attention, gemm, fused_decode, int8 check them).
KERNEL_MODES: tuple[str, ...] = ("auto", "fused", "composed")
ATTENTION_MODES: tuple[str, ...] = ("auto", "kernel", "reference")
GEMM_MODES: tuple[str, ...] = ("auto", "packed", "paddle")
DECODE_MODES: tuple[str, ...] = ("auto", "fused", "layers")
WEIGHT_TYPES: tuple[str, ...] = ("f32", "int8")

# The choice settings left unset: read from PDSERVE_<NAME>, else this default (said in each help).
_CHOICE_DEFAULTS = {
    "device": "auto",
    "dtype": "auto",
    "kernels": "auto",
    "attention": "auto",
    "gemm": "auto",
    "decode_step": "auto",
    "weights": "f32",
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizing. ``num_blocks`` wins over ``kv_cache_gb``; ``max_num_batched_tokens`` defaults
    to one prefill chunk plus one token per running sequence."""

    device: str | None = setting(
        None,
        "where the model runs: the CPU with Paddle (cpu), an NVIDIA GPU with PyTorch (cuda; needs "
        "`pip install pdserve[cuda]`), or cuda when PyTorch sees a GPU, else cpu (auto) (default: auto)",
        kind=str,
        choices=DEVICES,
    )
    dtype: str | None = setting(
        None,
        "weights and KV cache on a GPU: bfloat16, or float32 (exact, TF32 off); auto: bfloat16 on cuda, "
        "float32 on cpu (the CPU engine computes in float32 only) (default: auto)",
        kind=str,
        choices=DTYPES,
    )
    gpu: int | None = setting(
        None, "which GPU (its index among CUDA_VISIBLE_DEVICES; default: the first)", kind=int
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "share of the GPU's memory this instance may fill with weights, KV cache and CUDA graphs; two "
        "instances sharing one GPU take a part each (`pdserve up --device cuda` splits it) "
        "(default %(default)s)",
    )
    cuda_graphs: bool = setting(
        True, "replay decode steps as CUDA graphs captured per batch size (default on; prefill runs eagerly)"
    )
    kv_cache_gb: float = setting(1.0, "KV cache size in GiB on the CPU (default %(default)s)")
    num_blocks: int | None = setting(None, "KV cache size in blocks (overrides --kv-cache-gb)", kind=int)
    block_size: int = setting(16, "tokens per KV block (default %(default)s)")
    max_num_seqs: int = setting(64, "most sequences running at once (default %(default)s)")
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step (default: chunk size + max-num-seqs)", kind=int
    )
    prefill_chunk_size: int = setting(512, "long prompts are prefilled in chunks of this many tokens")
    prefix_caching: bool = setting(
        True,
        "keep full KV blocks after their request ends and reuse them for a later prompt with the same "
        "prefix (usage.prompt_tokens_details.cached_tokens counts them) (default on)",
    )
    kv_host_bytes: int = setting(
        0,
        "bytes of host memory for KV blocks evicted from the prefix cache, kept LRU and read back "
        "(checksum verified) by a later prompt with their prefix instead of recomputing them; 0: "
        "off (default %(default)s)",
    )
    kv_disk_path: str = setting(
        "",
        "directory for KV blocks the host tier (or, without one, the prefix cache) evicts, one file "
        "per block, read back (header and checksum verified) instead of recomputing them; meant to "
        "be shared by the instances of one host (one copy of a prefix per host), kept across "
        "restarts; empty: off (default: off)",
    )
    kv_disk_bytes: int = setting(
        0,
        "bytes of files the disk tier (--kv-disk-path) keeps per model namespace, least recently "
        "used removed first; 0: off (default %(default)s)",
    )
    max_model_len: int | None = setting(
        None, "context limit (default: the model's max_position_embeddings)", kind=int
    )
    threads: int | None = setting(
        None,
        "CPU threads for Paddle (default: the cores this process may run on, its affinity mask; `pdserve up`: those / workers, at least 1)",
        kind=int,
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
    decode_step: str | None = setting(
        None,
        "decode steps: the whole model in one compiled call (fused; bitwise the layers path, 1.4x "
        "faster at batch 1 on SmolLM2), one Paddle/numba call per operation (layers), or fused "
        "where the numba kernels and MKL's packed GEMM are both in use, else layers (auto) "
        "(default: auto)",
        kind=str,
        choices=DECODE_MODES,
    )
    weights: str | None = setting(
        None,
        "precision of the linear layers and lm_head: float32 as the checkpoint has them (f32; the "
        "exact path every test compares), or int8 per output channel (int8; half of the bytes: rows for "
        "decode, the same bytes packed for prefill; faster than f32 at decode and prefill; on "
        "SmolLM2 97%% of greedy tokens as f32's; a prefill and a decode instance pair only at the "
        "same precision) (default: f32)",
        kind=str,
        choices=WEIGHT_TYPES,
    )
    shared_kv: bool = False  # decode cache in POSIX shared memory (same-host prefill writes into it)
    shm_name: str | None = None
    keep_logits: bool = False  # attach each sampled row's raw logits to its output (exactness tests)
    # Same bits for a sequence alone or in any batch; None: on when MKL_CBWR asks for STRICT mode.
    batch_invariant: bool | None = None

    @property
    def step_tokens(self) -> int:
        """The token budget of one step: ``max_num_batched_tokens``, else its default."""
        return self.max_num_batched_tokens or self.prefill_chunk_size + self.max_num_seqs

    def __post_init__(self) -> None:
        for name, default in _CHOICE_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, os.environ.get(f"PDSERVE_{name.upper()}") or default)
        if self.threads is None and os.environ.get("PDSERVE_THREADS"):
            try:
                object.__setattr__(self, "threads", int(os.environ["PDSERVE_THREADS"]))
            except ValueError:
                raise ConfigError(
                    f"PDSERVE_THREADS must be an integer, got {os.environ['PDSERVE_THREADS']!r}"
                ) from None
        if self.batch_invariant is None:
            object.__setattr__(self, "batch_invariant", "STRICT" in os.environ.get("MKL_CBWR", "").upper())
        for name in ("block_size", "max_num_seqs", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu is not None and self.gpu < 0:
            raise ConfigError(f"gpu must be >= 0, got {self.gpu}")
        if self.kv_host_bytes < 0:
            raise ConfigError(f"kv_host_bytes must be >= 0, got {self.kv_host_bytes}")
        if self.kv_disk_bytes < 0:
            raise ConfigError(f"kv_disk_bytes must be >= 0, got {self.kv_disk_bytes}")
        if self.num_blocks is None and self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` → bfloat16 on cuda, float32 on cpu; the CPU engine computes in float32 only."""
    from pdserve.errors import ConfigError

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype
