"""Which platform runs the model: Paddle on the CPU, or PyTorch on an NVIDIA GPU.

One ``LLMEngine`` (scheduling, block manager, prefix cache, sampler, grammars, the KV hand-off's
bookkeeping) serves both; a platform supplies only the model, its paged KV cache storage and the
step's forward (an :class:`Executor`). Light to import: it loads neither Paddle nor torch, and
``auto`` decides without importing torch on a host that has no NVIDIA driver, so the CPU path never
loads torch and the CUDA path never loads Paddle.
"""

from __future__ import annotations

import abc
import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pdserve.engine.config import DEVICES, DTYPES, EngineConfig

if TYPE_CHECKING:
    from pdserve.cache_transfer.regions import Region
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sample_plan import Picked, SamplingPlan
    from pdserve.engine.step_input import StepInput

log = logging.getLogger(__name__)


class EngineCache(Protocol):
    """A platform's paged KV cache as the engine and the KV hand-off see it (kv_layout.py's layout)."""

    block_size: int
    block_bytes: int
    nbytes: int
    shm_name: str | None

    def write_rows(self, slots: np.ndarray) -> np.ndarray: ...

    def gather_chunks(self, block_table: np.ndarray) -> np.ndarray: ...

    def regions(self, block_ids: list[int]) -> list[Region]: ...

    def raw_view(self) -> Any: ...

    def read_blocks(self, block_ids: list[int]) -> bytes: ...

    def write_blocks(self, block_ids: list[int], data: bytes | memoryview) -> None: ...

    def close(self) -> None: ...


class PendingPicks(Protocol):
    """A step's picks on their way from the device (:meth:`Executor.sample`)."""

    def collect(self) -> Picked:
        """The picks on the host (waits for the device)."""
        ...


class Executor(abc.ABC):
    """What a platform builds for one engine: the model, its cache and the step's forward."""

    cache: EngineCache
    runner: ModelRunner
    num_blocks: int
    threads: int
    weight_bytes: int  # bytes the weights occupy where they run
    device: str  # "cpu" or "cuda": where the KV cache lives (a pair's caches must be of one kind)
    device_name: str | None
    dtype: str  # the KV cache's element type ("float32", "bfloat16")
    weights: str  # precision of the linear weights as registered ("f32", "int8", "bf16")
    batch_invariant: bool  # a sequence's bits do not depend on its batch (prefix-cache hits are exact)

    samples_on_device: bool = False
    """It picks tokens where the logits are (:meth:`launch`, :meth:`sample`, then the picks'
    ``collect()``): only token ids and the logprob numbers asked for cross to the host
    (engine/step_sampling.py decides)."""

    @abc.abstractmethod
    def forward(self, step: StepInput) -> np.ndarray | None:
        """The step's logits rows on the host (float32 [rows, vocab], rows as ``step.output_rows``),
        or None when no row is wanted."""

    def launch(self, step: StepInput) -> Any:
        """Start the step's forward; its logits rows stay on the device (None: no row wanted). On a
        GPU it returns once the work is queued, so the host can prepare the sampling meanwhile."""
        raise NotImplementedError(f"{type(self).__name__} does not sample on its device")

    def sample(self, launched: Any, plan: SamplingPlan) -> PendingPicks:
        """Queue the picks ``plan`` makes from :meth:`launch`'s logits and their copy to the host;
        on a GPU it returns at once (the host works on until ``collect()``)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample on its device")

    def close(self) -> None:
        self.cache.close()


class Platform(Protocol):
    """Builds an :class:`Executor` for a model folder."""

    name: str

    def executor(
        self, model_dir: Path, mc: ModelConfig, config: EngineConfig, max_model_len: int
    ) -> Executor: ...


def nvidia_driver_present() -> bool:
    """A cheap look for an NVIDIA driver (no CUDA initialised, torch not imported)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or any(Path("/dev").glob("nvidia[0-9]*"))


def cuda_unavailable() -> str | None:
    """Why ``--device cuda`` cannot run on this host, or None when it can (imports torch only when a
    driver is there)."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (pip install 'pdserve[cuda]')"
    if not nvidia_driver_present() and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return "no NVIDIA driver on this host (/proc/driver/nvidia and /dev/nvidia* are missing)"
    import torch

    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES, driver)"
    return None


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when a GPU is usable here, else ``cpu``; ``cuda`` checked, with the reason."""
    from pdserve.errors import ConfigError

    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    reason = cuda_unavailable()
    if device == "cuda" and reason is not None:
        raise ConfigError(f"--device cuda: {reason}")
    if device == "auto" and reason is not None:
        log.info("device: cpu (%s)", reason)
        return "cpu"
    return "cuda"


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` → bfloat16 on cuda, float32 on cpu; the CPU engine computes in float32 only."""
    from pdserve.errors import ConfigError

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype
