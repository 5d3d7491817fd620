"""The torch platform: the model in PyTorch on an NVIDIA GPU (or torch's CPU device, in tests), its
paged KV cache in that device's memory, decode steps replayed as CUDA graphs.

The KV cache takes what ``--gpu-memory-utilization`` leaves of the card once the weights are loaded
and a profile step of the largest batch has run (``--num-blocks`` overrides it); on the CPU device,
``--kv-cache-gb`` sizes it as on the CPU platform. Never imports Paddle.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.batcher import blocks_for
from pdserve.engine.config import EngineConfig, resolve_dtype
from pdserve.engine.cuda.cuda_graphs import DecodeGraphs
from pdserve.engine.cuda.torch_cache import TORCH_DTYPES, TorchKVCache
from pdserve.engine.cuda.torch_model import TorchModel
from pdserve.engine.cuda.torch_sampler import DevicePicks, DeviceSampler
from pdserve.engine.cuda.triton_attention import select_paged_attention
from pdserve.engine.executor import Executor
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import iter_weights
from pdserve.engine.sample_plan import SamplingPlan
from pdserve.engine.step_input import AttentionGroup, StepInput
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

_WEIGHT_LABELS = {"float32": "f32", "bfloat16": "bf16"}


def exact_float32() -> None:
    """float32 means float32: no TF32 in matmuls or convolutions (the exactness checks rely on it)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class TorchExecutor(Executor):
    """The torch model, its cache and runner on one device."""

    cache: TorchKVCache

    def __init__(
        self, device: torch.device, model_dir: Path, mc: ModelConfig, config: EngineConfig, max_model_len: int
    ) -> None:
        self.torch_device = device
        self.device = device.type
        assert config.dtype is not None  # EngineConfig.__post_init__ resolves it
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.weights not in (None, "f32"):
            raise ConfigError(f"--weights {config.weights}: the torch platform runs --dtype weights only")
        self.weights = _WEIGHT_LABELS[self.dtype]
        self.batch_invariant = False  # a sequence's bits may depend on its batch (cuBLAS picks kernels)
        self.samples_on_device = True  # only token ids (and asked-for logprobs) cross to the host
        self.sampler = DeviceSampler(device)
        self.threads = torch.get_num_threads()
        if device.type == "cuda":
            torch.cuda.set_device(device)
            exact_float32()
            self.device_name: str | None = f"{torch.cuda.get_device_name(device)} ({device})"
        else:
            if config.threads:
                torch.set_num_threads(config.threads)
                self.threads = config.threads
            self.device_name = f"torch {device}"
        self.attention = select_paged_attention(device, "auto")
        log.info("paged attention: %s (%s)", self.attention.impl, self.attention.reason)
        self.model = TorchModel(
            mc,
            iter_weights(model_dir, mc, transposed=False),
            max_model_len,
            device,
            TORCH_DTYPES[self.dtype],
            self.attention,
        )
        self.weight_bytes = self.model.weight_bytes
        per_block = block_bytes(mc, config.block_size, TORCH_DTYPES[self.dtype].itemsize)
        self.num_blocks = config.num_blocks or self._kv_blocks(config, mc, per_block, max_model_len)
        if self.num_blocks < 2:
            raise ConfigError(f"the KV cache holds fewer than 2 blocks of {per_block} bytes")
        self.cache = TorchKVCache(
            mc,
            self.num_blocks,
            config.block_size,
            device,
            self.dtype,
            shared=config.shared_kv,
            shm_name=config.shm_name,
        )
        self.runner = ModelRunner(self.cache, batch_invariant=False, threads=1, paged_kernel=True)
        if device.type == "cuda":  # every Triton kernel compiled now, none on the engine thread serving
            with torch.inference_mode():
                self.model.warm_up(self.cache.tensor)
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and config.cuda_graphs:
            width = blocks_for(max_model_len, config.block_size)
            self.graphs = DecodeGraphs(self.model, self.cache.tensor, config.max_num_seqs, width)
            self.graphs.capture()

    def _kv_blocks(self, config: EngineConfig, mc: ModelConfig, per_block: int, max_model_len: int) -> int:
        """Blocks that fit: ``--kv-cache-gb`` on the CPU; on a GPU what ``--gpu-memory-utilization``
        of the card leaves after the weights and the peak of a profile step of the largest prefill."""
        if self.torch_device.type != "cuda":
            return int(config.kv_cache_gb * 2**30 // per_block)
        dev = self.torch_device
        tokens = min(config.step_tokens, max_model_len)
        scratch = TorchKVCache(
            mc, blocks_for(tokens, config.block_size) + 1, config.block_size, dev, self.dtype
        )
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self.forward_on(scratch, _profile_step(tokens, config.block_size))
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - before
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        budget = total * config.gpu_memory_utilization - torch.cuda.memory_allocated(dev) - activations
        budget -= 256 * 2**20  # CUDA graphs' pool, cuBLAS workspaces
        if budget > free:
            raise ConfigError(
                f"--gpu-memory-utilization {config.gpu_memory_utilization}: this instance may use "
                f"{total * config.gpu_memory_utilization / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB of "
                f"{dev} are free (another process holds the rest): lower it or free the GPU"
            )
        log.info(
            "GPU memory: %.1f GiB total, weights %.2f GiB, activations %.2f GiB, KV cache %.2f GiB",
            total / 2**30,
            self.weight_bytes / 2**30,
            activations / 2**30,
            max(budget, 0) / 2**30,
        )
        return int(max(budget, 0) // per_block)

    def forward_on(self, cache: TorchKVCache, step: StepInput) -> torch.Tensor | None:
        with torch.inference_mode():
            return self.model.forward(cache.tensor, self.model.to_device(step))

    def forward(self, step: StepInput) -> np.ndarray | None:
        logits = self.launch(step)
        return None if logits is None else logits.cpu().numpy()

    def launch(self, step: StepInput) -> torch.Tensor | None:
        """The step's logits rows, left on the device (a graph's are a view of its output buffer,
        valid until the next replay); on a GPU the work is queued, not waited for."""
        with torch.inference_mode():
            logits = self._graph_step(step) if self.graphs is not None else None
            if logits is None:
                logits = self.model.forward(self.cache.tensor, self.model.to_device(step))
            return logits

    def sample(self, launched: torch.Tensor, plan: SamplingPlan) -> DevicePicks:
        """The plan's tokens sampled on the device, queued: ids and asked-for logprobs cross (at
        ``collect()``), never the logits rows."""
        with torch.inference_mode():
            return self.sampler.sample(launched, plan)

    def _graph_step(self, step: StepInput) -> torch.Tensor | None:
        """The step through a captured graph when it is one decode group whose every row samples."""
        assert self.graphs is not None
        if len(step.groups) != 1 or not step.groups[0].is_decode:
            return None
        n = step.token_ids.shape[0]
        group = step.groups[0]
        if step.output_rows.shape[0] != n or group.tables is None or group.lengths is None:
            return None
        return self.graphs.run(step.token_ids, step.positions, step.write_rows, group.tables, group.lengths)


def _profile_step(tokens: int, block_size: int) -> StepInput:
    """A first prefill chunk of ``tokens`` tokens in blocks 1.. of a scratch cache, sampling its last."""
    table = np.arange(1, blocks_for(tokens, block_size) + 1, dtype=np.int64)
    positions = np.arange(tokens, dtype=np.int64)
    group = AttentionGroup(0, tokens, 1, 0, None, False, tables=table[None], lengths=np.array([tokens]))
    return StepInput(
        token_ids=np.zeros(tokens, np.int64),
        positions=positions,
        write_rows=table[positions // block_size] * block_size + positions % block_size,
        gather=None,
        groups=[group],
        output_rows=np.array([tokens - 1], np.int64),
    )


class TorchPlatform:
    """PyTorch on ``device`` (``cuda:N``; ``cpu`` runs the same code on the host, for tests)."""

    name = "torch"

    def __init__(self, device: str = "cuda:0") -> None:
        self.device = torch.device(device)

    def executor(
        self, model_dir: Path, mc: ModelConfig, config: EngineConfig, max_model_len: int
    ) -> TorchExecutor:
        return TorchExecutor(self.device, model_dir, mc, config, max_model_len)
