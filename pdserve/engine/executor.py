"""What a platform supplies the engine: an :class:`Executor` (the model, its paged KV cache storage
and the step's forward) built by a :class:`Platform`, and the :class:`EngineCache` and
:class:`PendingPicks` it hands out. One ``LLMEngine`` (scheduling, block manager, prefix cache,
sampler, grammars, the KV hand-off's bookkeeping) serves both platforms through this interface:
``cpu/paddle_executor.py`` (Paddle) and ``cuda/torch_executor.py`` (PyTorch) implement it, and
``platform.py`` picks one. Light to import: no Paddle, no torch.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pdserve.engine.config import EngineConfig

if TYPE_CHECKING:
    from pdserve.cache_transfer.regions import Region
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.models.model_config import ModelConfig
    from pdserve.engine.sample_plan import Picked, SamplingPlan
    from pdserve.engine.step_input import StepInput


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
